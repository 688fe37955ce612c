"""The worker loop: read a task, load its samples, collate into the slot, publish.

A worker is a child of the parent -- forked (it inherits the dataset, the fetch
function and the mapped region) or spawned (they arrive pickled, and the region's
memfd as a passed descriptor that it maps with ``attach_region``).  Tasks arrive
on its end of a pipe in the format of :mod:`mploader._protocol`; ``slot == -1``
means "no slot was free: send the batch back through this pipe".
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import struct
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _bad_samples, _ring, _rng_state, _spec, _stacks
from ._descriptor import SlotWriter, Structures, pipe_message
from ._errors import BatchFailure
from ._face import Face
from ._metrics import WorkerBusy, booted
from ._plan import MAX_PLANS, Planner
from ._protocol import TaskReader

_MASK64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def batch_seed(seed: int, epoch: int, batch_index: int) -> int:
    """The 64-bit seed of one batch, a pure function of (seed, epoch, batch_index)."""
    return _splitmix(_splitmix(_splitmix(seed & _MASK64) ^ (epoch & _MASK64)) ^ (batch_index & _MASK64))


#: The batch seed :func:`seed_rngs` last applied in this process (None: none yet).
seeded_with: int | None = None


def seed_rngs(seed64: int) -> None:
    """Seed ``random``, NumPy's global RNG and (if already imported) torch's from one
    64-bit batch seed (docs/design.md, "Per-batch seeding").

    The two Mersenne Twisters get 624 words of splitmix64 output and position 624
    (:func:`mploader._rng_state.seed`: written in place, 0.2 us each, where the
    generators' layout was checked in this process, else through ``random.setstate``
    and ``np.random.set_state`` -- the same state); torch's CPU generator gets
    ``manual_seed(seed64 & (2**63 - 1))``.  The states are a pure function of
    ``seed64``, so every worker, either path and the in-process loaders agree."""
    global seeded_with
    seeded_with = seed64   # (torch imported later in this batch is seeded from it: _torch_worker)
    _rng_state.seed(seed64)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):  # not a half-imported torch
        # The CPU generator only: torch.manual_seed also seeds every accelerator
        # backend (~130 us a call), and a forked worker cannot use CUDA anyway.
        torch.default_generator.manual_seed(seed64 & 0x7FFFFFFFFFFFFFFF)


@dataclass
class WorkerSpec:
    """What every worker of one engine runs (pickled for spawn/forkserver workers).

    Made in the parent, before any worker starts: making it settles how the workers
    seed and capture the generators (:func:`mploader._rng_state.path`, which logs the
    fallback once), so that forked workers inherit that check instead of repeating it."""

    dataset: Any
    fetch: Callable[[Any, Any, Callable], Any]   # a mploader._face.Face, or (dataset, indices, alloc) -> batch
    seed: int
    reseed_per_batch: bool
    worker_init: Callable[[int, int], None] | None
    num_workers: int
    on_error: str = "raise"                      # the bad-sample policy (mploader._bad_samples)

    def __post_init__(self) -> None:
        _rng_state.path()


@dataclass
class WorkerBoot:
    """One worker's own start-up data."""

    worker_id: int
    parent_pid: int
    conn: Any                                    # multiprocessing Connection (worker end)
    region_fd: Any = None                        # spawn: the region's memfd (_fds.PassedFd; an int here)
    region: Any = None                           # fork: the inherited Region
    drop: Callable[[], None] | None = None       # fork: closes what this child must not hold
    busy: tuple | None = None                    # its busy-time cell (mploader._metrics.BusyCells.boot)
    lifeline: Any = -1                           # where pidfd_open is refused: the parent's lifeline (_fds)
    spec_fd: Any = -1                            # spawn: the memfd holding the WorkerSpec (mploader._spec)


def _fresh_std_streams() -> None:
    """Replace sys.stdout/stderr by new objects on fds 1/2 (forked children only).

    A thread of the parent that was writing when the worker forked leaves the
    stream's buffer lock held in the child forever; the first print, traceback or
    flush of the worker would deadlock on it.  The old objects are abandoned
    unflushed (their buffered bytes belong to the parent, which flushes them).
    """
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if old is None:  # started without it (fd closed): a print stays a no-op, as in the parent
            continue
        try:
            encoding = getattr(old, "encoding", None) or "utf-8"
            errors = getattr(old, "errors", None) or "backslashreplace"
            new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors,
                                   line_buffering=True, write_through=True)
        except (OSError, ValueError):
            continue
        setattr(sys, name, new)
        if getattr(sys, f"__{name}__") is old:
            setattr(sys, f"__{name}__", new)


def fork_main(spec: WorkerSpec, boot: WorkerBoot) -> None:
    """Entry point of a forked worker; never returns (the process exits)."""
    booted(boot.busy)   # first: the watchdog's start-up deadline ends here (docs/design.md, "Faults")
    _fresh_std_streams()
    _run(spec, boot)


def spawn_main(spec: WorkerSpec | None, boot: WorkerBoot, unpacked: Callable[[], None] | None = None) -> None:
    """Entry point of a spawned or forkserver worker (started by the zygote or by
    ``multiprocessing``); never returns.  ``spec`` None: it is unpacked from
    ``boot.spec_fd`` (:func:`mploader._spec.unpack`) once the worker watches the
    parent, then ``unpacked()`` is called (the zygote's ``end_boot``)."""
    _run(spec, boot, unpacked)


def _run(spec: WorkerSpec | None, boot: WorkerBoot, unpacked: Callable[[], None] | None = None) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        batch_scheduling()
        _stacks.install()  # SIGUSR1 dumps every thread's stack for the parent's watchdog
        # Not PR_SET_PDEATHSIG: it fires when the forking *thread* ends.
        _ring.watch_parent(boot.parent_pid, boot.lifeline)
        if boot.lifeline >= 0:
            os.close(boot.lifeline)  # the watch has its own duplicate
        if boot.drop is not None:
            boot.drop()
        if boot.region is not None:
            region = boot.region
            region.populate()
        else:
            fd = boot.region_fd
            region = _ring.attach_region(fd)  # maps its own duplicate of the memfd
            os.close(fd)
        if spec is None:  # its arrays: views of a copy-on-write mapping shared by every worker
            spec = _spec.unpack(boot.spec_fd)
            os.close(boot.spec_fd)
        if unpacked is not None:
            unpacked()
        init_failure = _init(spec, boot.worker_id)
        _loop(spec, boot, region, init_failure)
    except SystemExit as exc:  # sys.exit() in user code: exit with the status it asked for
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except (BrokenPipeError, ConnectionResetError):
        code = 0  # the parent went away mid-send: nothing to report to anyone
    except BaseException:  # noqa: BLE001 - the process is about to exit; say why
        code = 1
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


def batch_scheduling() -> None:
    """Put this process under Linux's ``SCHED_BATCH`` policy (docs/design.md,
    "Workers"): a worker that wakes up no longer preempts the running training loop;
    its share of the CPU is unchanged.  Nothing happens where the policy does not
    exist or is refused."""
    setter, policy = getattr(os, "sched_setscheduler", None), getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return
    try:
        setter(0, policy, os.sched_param(0))
    except OSError:
        pass


def _init(spec: WorkerSpec, worker_id: int) -> BatchFailure | None:
    """Seed per worker (when not per batch) and run ``worker_init``; a failure is
    reported as the error of every batch this worker is given (as torch does)."""
    if spec.worker_init is None:
        return None
    try:
        spec.worker_init(worker_id, spec.num_workers)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
        return BatchFailure.capture(exc, -1, None, worker_id, stage="running worker_init for")
    return None


#: The ``epoch`` field of the task this worker is loading (-1 outside a worker): a
#: face's ``fetch`` may keep state per run (``_torch_worker.CapturingFetch``).
task_epoch = -1


#: :meth:`Batches.make`'s answer when a plan published the batch.
_PUBLISHED = (None, True)


def _no_face(dataset: Any, what: Any) -> Any:
    """:class:`Batches`' steps for a plain ``fetch`` callable (never called)."""
    raise AssertionError("a plain fetch callable has no steps")


class Batches:
    """One worker's way from a task to a published batch: load, plan, collate,
    publish, learn (docs/faces.md, "The worker contract").

    ``fetch`` is the engine's: a :class:`mploader._face.Face`, whose steps this runs
    -- offering every batch the face calls plannable to the worker's batch plans
    (:mod:`mploader._plan`) -- or a plain ``fetch(dataset, indices, alloc)``
    callable, called as it is.  The plans and the descriptor encodings of the
    structures this worker has met live in one cache, ``structures``
    (:class:`mploader._descriptor.Structures`), which every :meth:`writer` uses.
    """

    __slots__ = ("face", "fetch", "load", "pipe_side", "plannable", "planner", "side", "structures")

    def __init__(self, fetch: Callable) -> None:
        self.fetch = fetch
        face = self.face = fetch if isinstance(fetch, Face) else None
        self.structures = Structures(MAX_PLANS)
        self.planner = Planner(face.other_columns, self.structures) if face is not None else None
        #: the face's ``side``, None where it is Face's (no side record: one call less per batch)
        self.side = face.side if face is not None and type(face).side is not Face.side else None
        #: the side record of the batch :meth:`make` made for the pipe (no writer)
        self.pipe_side: bytes | None = None
        # (bound once: the face's steps cost a method lookup less per batch)
        self.load: Callable[[Any, Any], Any] = face.load if face is not None else _no_face
        self.plannable: Callable[[Any, Any], bool] = face.plannable if face is not None else _no_face

    def writer(self, region: Any, slot: int, seq: int) -> SlotWriter:
        """The writer of task ``seq``'s batch into ``slot`` (ASSIGNED to it)."""
        return SlotWriter(region, slot, seq, self.structures)

    def make(self, dataset: Any, indices: Any, writer: SlotWriter | None, guard: Any = None) -> tuple[Any, bool]:
        """``(batch, False)``: the batch of ``indices`` for :meth:`deliver`; or
        ``(None, True)``: a plan wrote it into ``writer``'s slot and published it.
        ``writer`` None: no slot (the batch goes through the pipe).  The face's side
        record goes to ``writer.side`` (or ``pipe_side``).  ``guard``: the
        :class:`mploader._bad_samples.Guard` over ``dataset`` under ``"skip"`` /
        ``"substitute"``, which loads again without a sample that raised.  Raises
        what the face raises."""
        face = self.face
        if face is None:
            alloc = writer.alloc if writer is not None else np.empty
            fetch = self.fetch
            if guard is not None:
                return guard.fetch(lambda left: fetch(guard, left, alloc), indices), False
            return fetch(dataset, indices, alloc), False
        load = self.load
        if guard is not None:
            dataset = guard
            samples = guard.fetch(lambda left: load(guard, left), indices)
        else:
            samples = load(dataset, indices)
        take_side = self.side
        if writer is not None and self.plannable(dataset, samples):
            planner = self.planner
            assert planner is not None
            if take_side is not None:
                writer.side = take_side()
            if planner.publish(samples, writer):
                return _PUBLISHED
            collated = face.collate(samples, writer.alloc)
            planner.remember(samples, collated)
            return face.wrap(collated), False
        collated = face.collate(samples, writer.alloc if writer is not None else np.empty)
        if take_side is not None:
            if writer is not None:
                writer.side = take_side()
            else:
                self.pipe_side = take_side()
        return face.wrap(collated), False

    def deliver(self, send: Callable[[bytes], None], writer: SlotWriter | None, seq: int, kind: int,
                batch: Any) -> None:
        """Publish ``batch`` (made by :meth:`make`, or a failure) in ``writer``'s slot,
        or send it through the pipe; the descriptor is kept when a plan is to be
        learnt from it.  Raises what serialising the batch raises."""
        planner = self.planner
        if writer is not None and planner is not None and planner.pending is not None:
            writer.keep_descriptor = True  # the plan is learnt from it (mploader._plan)
        side = self.pipe_side
        if side is not None:
            self.pipe_side = None
        _deliver(send, writer, seq, kind, batch, side)

    def learn(self, writer: SlotWriter | None) -> None:
        """After :meth:`deliver`: the plan of the batch, when it was published in the
        slot (forgotten otherwise)."""
        if self.planner is not None:
            self.planner.learn(writer)


def _loop(spec: WorkerSpec, boot: WorkerBoot, region: Any, init_failure: BatchFailure | None) -> None:
    global task_epoch
    conn = boot.conn
    reader = TaskReader(conn.fileno())
    send = conn.send_bytes
    dataset, base_seed, reseed = spec.dataset, spec.seed, spec.reseed_per_batch
    wid = boot.worker_id
    meter = WorkerBusy(boot.busy) if boot.busy is not None else None
    batches = Batches(spec.fetch)
    structures = batches.structures
    guard = None
    if spec.on_error != "raise":  # dataset[i] raising: substitute or skip, reported to the parent
        guard = _bad_samples.Guard(dataset, spec.on_error, base_seed, send)
    while True:
        try:
            task = reader.next()
        except (EOFError, OSError):
            return
        if task is None:  # RETIRE
            return
        if meter is not None:
            meter.start()  # busy from here to the batch's publication (docs/metrics.md)
        seq, slot, epoch, batch_index, indices = task
        # A task of a run abandoned since it was sent (a ``break``, a superseded
        # iterator: BusyCells.cancel_below) is published empty, never loaded; only the
        # parent's reaper of stale batches takes it.
        cancelled = meter is not None and meter.cancelled(seq)
        task_epoch = epoch
        if reseed and not cancelled:
            seed_rngs(batch_seed(base_seed, epoch, batch_index))
        writer = SlotWriter(region, slot, seq, structures) if slot >= 0 else None
        batch: Any
        published = False
        if cancelled:
            batch, kind = None, _ring.KIND_SLOT
        elif init_failure is not None:
            init_failure.seq, init_failure.indices = seq, indices
            batch = init_failure
            kind = _ring.KIND_ERROR
        else:
            try:
                if guard is not None:
                    guard.seq, guard.epoch, guard.batch_index = seq, epoch, batch_index
                batch, published = batches.make(dataset, indices, writer, guard)
                kind = _ring.KIND_SLOT
            except SystemExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
                batch = BatchFailure.capture(exc, seq, indices, wid)
                kind = _ring.KIND_ERROR
                del exc
        if not published:  # (else a plan wrote and published it: mploader._plan)
            try:
                batches.deliver(send, writer, seq, kind, batch)
            except (pickle.PicklingError, TypeError, AttributeError, ValueError, struct.error) as exc:
                # The batch cannot be serialised (a lambda, a generator, ...): report
                # that to the parent as this batch's error instead of dying.
                failure = BatchFailure.capture(exc, seq, indices, wid,
                                               stage="serialising (the batch could not be serialised)")
                _deliver(send, writer, seq, _ring.KIND_ERROR, failure)
            if not cancelled:
                batches.learn(writer)  # (forgets the batch unless it was published in the slot)
        if meter is not None:
            meter.stop()
        del batch, writer, task, indices


def _deliver(send: Callable[[bytes], None], writer: SlotWriter | None, seq: int, kind: int, obj: Any,
             side: bytes | None = None) -> None:
    """Publish ``obj`` in the writer's slot, or send it through the pipe; a KIND_SLOT
    batch with its side record (``writer.side``, or ``side`` without a writer)."""
    if writer is not None:
        data = writer.finish(obj, kind)
        if data is not None:
            send(pipe_message(seq, kind, data, writer.side if kind == _ring.KIND_SLOT else None))
    else:
        send(pipe_message(seq, kind, pickle.dumps(obj, protocol=5), side if kind == _ring.KIND_SLOT else None))
