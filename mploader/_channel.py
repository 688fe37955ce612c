"""One worker's channel: everything the parent holds for one worker process.

A :class:`Channel` owns, for its worker, the process handle (pid, the pidfd or
watch pipe, the exit status), the task socket, and the scheduler's records on it:
the task records buffered and not yet sent (``pending``), those that never reached
a dead worker (``unsent``), the tasks sent and not yet consumed (``outstanding``),
the prefix of them known to be published (``done``), and the batches and reports
that came back through the socket (``mailbox``).  Nothing else holds any of it: the
scheduler's parts (:mod:`._scheduler`, :mod:`._dispatch`, :mod:`._receive`) change
it through its methods or through the C steps of :mod:`._steps` that an interrupt
must not split (``dispatch``, ``flush``, ``hand_over``, ``hand_off``), and forget it
in one place (:meth:`Channel.forget_records`, called by the scheduler's
``reset``).  :mod:`._executors` makes a channel when it starts a worker and ends
it in :func:`~mploader._executors.stop_workers`.

A :class:`Task` is one batch asked of a worker: its seq, slot (-1: the pipe), the
channel of the worker loading it, and its state on the parent's side.
"""
from __future__ import annotations

import collections
import os
import select
from typing import Any

from . import _ring
from ._errors import UNKNOWN_STATUS, ExitStatus

__all__ = ["Channel", "Task", "take", "hung_up"]


class Task:
    """One batch asked of a worker (see the module docstring)."""

    __slots__ = ("seq", "slot", "worker", "epoch", "batch_index", "indices", "generation", "box", "stale", "consumed",
                 "pinned", "via_pipe", "source")

    def __init__(self, seq: int, slot: int, worker: Channel, epoch: int, batch_index: int, indices: Any,
                 generation: int, source: tuple) -> None:
        self.seq = seq
        self.slot = slot
        self.worker = worker
        self.epoch = epoch
        self.batch_index = batch_index
        self.indices = indices
        self.generation = generation
        self.box: list = []         # [SlotLease] once E3 was taken (kept across interruptions)
        self.stale = False
        self.consumed = False       # its batch was handed off, or its exception raised
        self.via_pipe = slot < 0    # the batch comes (or came) through the worker's pipe
        self.source = source        # the task tuple, to dispatch again if sending failed

    def published(self, region: Any) -> bool:
        """Whether the worker finished this batch (nothing more is owed by it)."""
        if self.via_pipe:
            return self.seq in self.worker.mailbox
        return bool(self.box) or region.state(self.slot) == _ring.STATE_READY


def take(region: Any, task: Task, timeout_s: float, spin_s: float = 0.0) -> bool:
    """Wait for ``task``'s slot and take E3; the lease lands in ``task.box`` inside the
    C call, so an interrupt raised right after it cannot drop it (the task keeps it
    and a later ``next()`` consumes it)."""
    if not task.box:
        region.wait(task.slot, timeout_s, task.box, spin_s)
    return bool(task.box)


class Channel:
    """The parent's end of one worker (see the module docstring).

    Lifecycle: made by :func:`mploader._executors.start_worker` once the process
    runs; ``status`` is set by :meth:`reap` once it has exited; :meth:`close_fds`
    (idempotent) lets go of the socket and the pidfd; :meth:`forget_records` empties
    the records when the scheduler gives the worker up.  A retiring channel
    (``retiring``) is given no new task; ``replaced`` once its successor started.
    """

    __slots__ = ("wid", "pid", "pidfd", "conn", "fd", "process", "status", "outstanding", "done", "mailbox",
                 "pending", "unsent", "sent", "retiring", "replaced", "watch_pipe")

    def __init__(self, wid: int, pid: int, conn: Any, process: Any = None, watch_fd: int = -1) -> None:
        self.wid = wid
        self.pid = pid
        # Readable once the process has exited: a pidfd, or (watch_fd, where pidfd_open
        # is refused) the read end of a pipe whose write end the worker holds.
        self.pidfd = watch_fd if watch_fd >= 0 else _ring.pidfd_open(pid)
        self.watch_pipe = watch_fd >= 0 and process is None  # a forked worker's fallback pipe
        self.conn = conn
        self.fd = conn.fileno()         # the task socket, written by _steps.flush; -1 once closed
        self.process = process          # multiprocessing.Process for spawn/forkserver, else None
        self.status: ExitStatus | None = None
        # Task records [(task or None for a RETIRE, frame)] buffered for one send()
        # (_steps.flush: what a full socket did not take stays), and those that never
        # reached the socket of this worker once it died (Scheduler._resend).
        self.pending: list[tuple[Task | None, bytes]] = []
        self.unsent: list[tuple[Task | None, bytes]] = []
        self.outstanding: collections.deque[Task] = collections.deque()   # sent, not consumed, in order
        self.done = 0                   # leading tasks of ``outstanding`` known to be published
        self.mailbox: dict[int, bytes] = {}   # pipe messages by seq
        self.sent = 0                   # tasks given (maxtasksperchild)
        self.retiring = False
        self.replaced = False           # a successor was started for this retiring worker

    @property
    def alive(self) -> bool:
        return self.status is None

    def finish(self, task: Task) -> None:
        """``task`` is done with (consumed, or dropped stale): off ``outstanding``.  The
        head is the common case (a worker publishes in order: the known-published prefix
        shrinks by one); elsewhere the prefix is recounted (``done = 0``).  The C step
        ``_steps.hand_off`` does the same for a batch handed off."""
        out = self.outstanding
        if out and out[0] is task:
            out.popleft()
            self.done = max(0, self.done - 1)
        elif task in out:
            out.remove(task)
            self.done = 0

    def forget_records(self, keep: list[tuple[Task | None, bytes]] | None = None) -> None:
        """The scheduler gave this worker up (stopped, failed, dead and replaced): its
        records not yet sent go with it, but for ``keep`` (records of tasks already
        detached from it, to be given to other workers), which stay in ``unsent`` --
        the same list object, which ``Scheduler._resend`` may be going through."""
        self.pending.clear()
        self.unsent[:] = keep or []

    def reap(self, block: bool = False) -> bool:
        """Collect the exit status if the process has ended; True once it has."""
        if self.status is not None:
            return True
        if self.process is not None:
            self.process.join(None if block else 0)
            known = getattr(self.process, "exit_status", None)  # a zygote's worker (_zygote.ZygoteChild)
            if known is not None:
                self.status = known
                return True
            if self.process.exitcode is None:
                return False
            self.status = ExitStatus.from_exitcode(self.process.exitcode)
            return True
        if not block and self.watch_pipe and self.pidfd >= 0 and hung_up(self.pidfd):
            block = True  # the pipe hangs up as the worker exits, a moment before it can be reaped
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # SIGCHLD ignored: the kernel reaped it, status lost
            self.status = UNKNOWN_STATUS
            return True
        if pid == 0:
            return False
        self.status = ExitStatus.from_wait_status(status)
        return True

    def close_fds(self) -> None:
        for close in (self.conn.close, lambda: os.close(self.pidfd)):
            try:
                close()
            except OSError:
                pass
        self.pidfd = -1
        self.fd = -1
        if self.process is not None and self.status is not None:
            try:  # its Popen's two start-up pipes, held until then
                self.process.close()
            except ValueError:  # pragma: no cover - not reaped by multiprocessing yet
                pass


def hung_up(fd: int) -> bool:
    """Whether ``fd`` reports POLLIN or POLLHUP now (a watch pipe: its worker exited)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
