"""The descriptors the engine creates in Python, and the limits they run into.

* Every descriptor is close-on-exec and never 0, 1 or 2 (:func:`off_stdio`): a
  process started with its standard streams closed (``daemon(3)``, some
  schedulers) hands those numbers out first, and a ``print`` would then write into
  a worker's pipe or the ring.
* :class:`PassedFd` hands a descriptor to a spawned or forkserver worker at the
  moment its process is started (as ``multiprocessing`` passes a ``Connection``):
  nothing is kept in this process for a worker that never starts.
* Where ``pidfd_open`` is refused (seccomp profiles, kernels before 5.3:
  :func:`pidfd_usable`), the workers watch this process through its
  :func:`lifeline` instead, and this process watches each worker through a pipe it
  holds the write end of (:func:`pipe`).
* :func:`check_headroom` raises a clear error before a worker start would run out
  of descriptors (``RLIMIT_NOFILE``).
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import multiprocessing.connection
import multiprocessing.reduction
import os
import resource
import socket
from collections.abc import Iterator
from typing import Any

from . import _ring

#: How a loader's workers start, as the descriptor figures below name it: "fork";
#: "zygote" (spawn and forkserver workers forked by mploader's zygote, the default);
#: "spawn" and "forkserver" where ``multiprocessing`` starts them (MPLOADER_ZYGOTE=0).
HOW = {"fork": "fork", "zygote": "spawn/forkserver, from the zygote",
       "spawn": "spawn, MPLOADER_ZYGOTE=0", "forkserver": "forkserver, MPLOADER_ZYGOTE=0"}
#: Descriptors one loader holds in this process: the ring's memfd, plus (spawn and
#: forkserver) the memfds of the workers' busy counters and of the pickled spec,
#: each with the duplicate its ``mmap.mmap`` keeps.  Counted by test_limits.py.
PER_LOADER = {"fork": 1, "zygote": 5, "spawn": 5, "forkserver": 5}
#: ... and per worker: its task pipe and a descriptor that reports its exit (a
#: pidfd; without pidfd_open, the read end of a pipe it holds the write end of; from
#: the zygote, its status pipe), plus (multiprocessing) the two start-up pipes its
#: ``Popen`` keeps (one is the sentinel).
PER_WORKER = {"fork": 2, "zygote": 2, "spawn": 4, "forkserver": 4}
#: Descriptors a worker start needs besides what it keeps: the worker's end of its
#: pipe and a pipe's second end until the fork, the start-up pipes (spawn,
#: forkserver), and in the worker its own watch of this process and the few files
#: Python opens (imports) before the first batch.
STARTING = {"fork": 8, "zygote": 10, "spawn": 12, "forkserver": 12}


def off_stdio(fd: int) -> int:
    """``fd`` if it is >= 3, else a close-on-exec duplicate >= 3 (``fd`` is closed
    either way on failure).  Raises OSError (EMFILE)."""
    return fd if fd > 2 else _ring.fd_off_stdio(fd)


def is_open(fd: int) -> bool:
    """Whether ``fd`` is an open descriptor of this process."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def pipe() -> tuple[int, int]:
    """``os.pipe()``, both ends close-on-exec and >= 3."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        r = off_stdio(r)
    except BaseException:
        os.close(w)
        raise
    try:
        return r, off_stdio(w)
    except BaseException:
        os.close(r)
        raise


def connection_pair() -> tuple[Any, Any]:
    """``multiprocessing.Pipe(duplex=True)`` with both descriptors >= 3."""
    a, b = socket.socketpair()
    with a, b:
        fa = off_stdio(a.detach())
        try:
            fb = off_stdio(b.detach())
        except BaseException:
            os.close(fa)
            raise
    return multiprocessing.connection.Connection(fa), multiprocessing.connection.Connection(fb)


def dup(fd: int) -> int:
    """A close-on-exec duplicate of ``fd``, >= 3."""
    return off_stdio(os.dup(fd))


def _received(dup_fd: Any) -> int:
    return off_stdio(dup_fd.detach())


class PassedFd:
    """A descriptor for a spawned or forkserver worker: pickled as the worker's
    process starts (``multiprocessing.reduction.DupFd`` then passes it with the
    process, as ``multiprocessing`` passes a ``Connection``), unpickled there as an
    int (>= 3) the worker owns.  Made earlier, ``DupFd`` would keep a duplicate in
    this process (``multiprocessing.resource_sharer``) until the worker fetched it:
    a worker that died first leaked it (issue 26: 24 memfds after six failed
    starts)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _received, (multiprocessing.reduction.DupFd(self.fd),)


class _Process:
    """Per-process state: whether pidfd_open works here, and the lifeline."""

    pid = -1
    pidfd_usable: bool | None = None
    lifeline: tuple[int, int] | None = None


def _after_fork_in_child() -> None:
    # The parent's lifeline belongs to the parent: a child holding its write end
    # would keep the workers of a dead parent alive.  The read end stays (a forked
    # worker watches it; elsewhere it is one close-on-exec descriptor).
    line = _Process.lifeline
    _Process.lifeline = None
    _Process.pidfd_usable = None
    if line is not None:
        try:
            os.close(line[1])
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def pidfd_usable() -> bool:
    """Whether ``pidfd_open`` works in this process (probed once): False where a
    seccomp filter or the kernel refuses it (:func:`mploader._ring.pidfd_refused`;
    ``MPLOADER_TEST_REFUSE_PIDFD`` simulates that)."""
    if _Process.pidfd_usable is None:
        try:
            os.close(_ring.pidfd_open(os.getpid()))
            _Process.pidfd_usable = True
        except OSError as exc:
            if not _ring.pidfd_refused(exc.errno or 0):
                raise
            _Process.pidfd_usable = False
    return _Process.pidfd_usable


def lifeline() -> int:
    """The read end of this process's lifeline: a pipe whose write end only this
    process holds (close-on-exec, and closed in every child ``os.fork`` makes), so
    it reads EOF once this process has died.  Workers watch it where pidfd_open is
    refused (:func:`mploader._ring.watch_parent`).  Created at the first call."""
    if _Process.lifeline is None:
        _Process.lifeline = pipe()
    return _Process.lifeline[0]


def open_count() -> int:
    """Descriptors open in this process now."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself used


def per_loader(num_workers: int, how: str) -> int:
    """Descriptors a loader with ``num_workers`` workers started ``how`` (a key of
    :data:`HOW`) holds in this process."""
    return PER_LOADER[how] + num_workers * PER_WORKER[how]


def check_headroom(num_workers: int, how: str, what: str) -> None:
    """Raise OSError(EMFILE) naming the limit and what to change when starting
    ``what`` (a worker, started ``how``: a key of :data:`HOW`) could run out of
    descriptors under ``RLIMIT_NOFILE``.
    Nothing is created: the loaders made before keep working."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        n_open = open_count()
    except OSError:  # no /proc: the start itself will tell
        return
    need = PER_WORKER[how] + STARTING[how]
    if n_open + need <= soft:
        return
    raise descriptors_exhausted(num_workers, how, what, n_open, soft, hard)


def descriptors_exhausted(num_workers: int, how: str, what: str, n_open: int | None = None,
                          soft: int | None = None, hard: int | None = None) -> OSError:
    """The OSError(EMFILE) :func:`check_headroom` raises (also for an EMFILE met while
    starting a worker)."""
    if soft is None or hard is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if n_open is None:
        try:
            n_open = open_count()
        except OSError:
            n_open = -1
    total = per_loader(num_workers, how)
    suggest = max(4096, 2 * soft) if soft != resource.RLIM_INFINITY else 4096
    if hard != resource.RLIM_INFINITY:
        suggest = min(suggest, hard)
    hard_s = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return OSError(errno.EMFILE, (
        f"out of file descriptors: cannot start {what}: this process has {n_open} open and "
        f"RLIMIT_NOFILE allows {soft} (hard limit {hard_s}).  Each loader holds "
        f"{PER_LOADER[how]} + {PER_WORKER[how]} per worker ({HOW[how]}): {total} with "
        f"num_workers={num_workers}, and starting a worker needs about {STARTING[how]} more for a "
        f"moment.  Raise the limit: `ulimit -n {suggest}` in the shell that starts the job, or "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({suggest}, {hard_s if hard_s != 'unlimited' else 'hard'})) "
        f"before the loaders are made; or use fewer loaders or workers"))


@contextlib.contextmanager
def stdio_reserved(inheritable: bool = True) -> Iterator[None]:
    """Whichever of fds 0, 1, 2 are closed here hold ``/dev/null`` meanwhile, then
    are closed again, so that descriptors made meanwhile by code we do not own land
    above 2.  ``inheritable=True``, while a spawned or forkserver process starts:
    the new interpreter gets them as its standard streams, and ``multiprocessing``'s
    own start-up pipes stay off them here and there (a print there went into them).
    ``inheritable=False``, around ``mmap.mmap(fd)``: CPython keeps a ``dup`` of the
    descriptor, at the lowest free number."""
    held = []
    try:
        for fd in range(3):
            try:
                os.fstat(fd)
            except OSError:
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:  # another thread took it meanwhile: leave the rest alone
                    os.close(null)
                    break
                if inheritable:
                    os.set_inheritable(null, True)
                held.append(null)
        yield
    finally:
        for fd in held:
            os.close(fd)


def mmap_fd(fd: int, length: int) -> mmap.mmap:
    """``mmap.mmap(fd, length)`` (shared, read-write), its internal duplicate of
    ``fd`` kept off fds 0..2."""
    with stdio_reserved(inheritable=False):
        return mmap.mmap(fd, length)
