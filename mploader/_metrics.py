"""Input-pipeline metrics: what the training loop waited for, and what the workers did.

Two sides of the ring are measured (docs/metrics.md has the table of keys):

* the parent's :class:`Meter` -- one per engine.  Per batch, ``Run.__next__`` reads
  the clock twice around the blocking part of ``next()`` and adds the difference to
  ``wait``, and the scheduler's ``_consume`` adds the batch's bytes to ``bytes``;
  nothing else.  Window marks, the epoch's start and the periodic report happen in
  :meth:`Meter.tick`, at most every MARK_S; rates, fractions and occupancy are
  computed only when :func:`engine_stats` is called.  ``wait``/``wall`` and the
  per-epoch counters restart with every run (one epoch for the Gluon and torch
  faces).  bench/metrics_cost.py measures the cost;
* the workers' :class:`BusyCells` -- a small shared array of ``(busy, start)``
  float64 pairs, one cell per worker process.  For forked workers it is an anonymous
  ``MAP_SHARED`` mapping created in the parent before the workers fork (they inherit
  it; no descriptor is involved); for spawn/forkserver workers a memfd mapped by the
  parent, passed to each worker as a descriptor the way the region's is
  (:class:`mploader._fds.PassedFd`) and mapped once at start-up.  A worker stores
  ``start`` when a task arrives and adds the task's duration to ``busy`` after
  publishing its batch: plain stores into memory it already maps, no system call.

Clock: ``time.monotonic()`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every
process of the machine, so a worker's ``start`` can be compared with the parent's
now.  (It is also cheaper than ``monotonic_ns()``, whose large ints are allocated.)
"""
from __future__ import annotations

import collections
import dataclasses
import math
import mmap
import os
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import _fds, _memory, _rng_state

__all__ = ["Meter", "BusyCells", "WorkerBusy", "MeteredRun", "Snapshot", "engine_stats", "inline_stats",
           "empty_stats", "METRIC_KEYS", "COUNTER_KEYS", "idle_transport_stats"]

_now = time.monotonic
_frexp = math.frexp

#: A window mark is taken at most this often (s), at the start of a ``next()``.
MARK_S = 0.5
#: Rates (``batches_per_s``, ``bytes_per_s``) cover about this much recent time (s).
WINDOW_S = 10.0
_MARKS = int(WINDOW_S / MARK_S) + 2

#: One cell, two float64: busy (total seconds spent on tasks), start (``monotonic()``
#: when the task in progress began; 0.0 when idle; negative, ``-monotonic()`` of the
#: fork, while a forked worker boots: :meth:`BusyCells.booting`, :func:`booted`).
#: Each is one aligned 8-byte store.
_CELL = struct.Struct("<dd")
_SEQ = struct.Struct("<q")   # the cancel word (BusyCells.cancel_below)
_START = struct.Struct("<d")
#: After the cells, one histogram of batch times per cell: HIST_BUCKETS float64
#: counts, bucket ``k`` for times ``d`` with ``frexp(d)[1] == k - HIST_SHIFT``
#: (``2**(k - HIST_SHIFT - 1) <= d < 2**(k - HIST_SHIFT)`` s: from below 1 ns to 68 years,
#: so the worker needs no clamp: a monotonic difference lies there).  Read by
#: the watchdog's default stall limit (mploader._watchdog: the p99 batch time).
HIST_BUCKETS = 72
HIST_SHIFT = 40
_HIST = struct.Struct(f"<{HIST_BUCKETS}d")

#: The keys every face's ``stats()`` adds to the transport counters (docs/metrics.md).
METRIC_KEYS = ("wait_s", "wall_s", "first_batch_s", "epoch_batches", "epoch_no_free_slot", "epoch_fallback_pipe",
               "batches_per_s", "bytes_per_s", "worker_busy", "ready_batches", "held_slots", "seeding",
               "worker_private_bytes")


#: The transport counters every face's ``stats()`` starts with (the engine's
#: scheduler counts them; zeros before the first run).
COUNTER_KEYS = ("batches", "slot", "fallback_inband", "fallback_pipe", "no_free_slot", "grown", "errors")


def idle_transport_stats() -> dict[str, Any]:
    """The transport part of ``stats()`` for a loader with no engine (yet): zero
    counters, no slots, no shared memory, and the memory budget in force."""
    out: dict[str, Any] = dict.fromkeys(COUNTER_KEYS, 0)
    out.update(num_slots=0, shm_bytes=0, memory_budget_bytes=_memory.budget_bytes(), memory_held_bytes=0,
               stalls=0, respawns=0, bad_samples=[], bad_sample_count=0)
    return out


class Meter:
    """The parent's counters of one engine (see the module docstring).

    Per batch, ``Run.__next__`` adds the time it blocked to ``wait`` and the
    scheduler adds the batch's bytes to ``bytes``; everything else happens in
    :meth:`tick` (at most every MARK_S, at the start of a ``next()``) or when stats
    are read.  Written only by the thread that iterates; :func:`engine_stats` may
    read from any thread (a reading racing an update is off by one batch).
    """

    __slots__ = ("wait", "first", "first_batch", "ticks", "end", "bytes", "base_counts", "tick_at", "marks",
                 "busy", "busy_base", "busy_end", "report", "report_at", "report_every", "epochs", "private")

    def __init__(self) -> None:
        self.epochs = 0              # runs begun
        # (run number, the workers' private bytes, their pids), sampled when stats are read, once per run
        self.private: collections.deque = collections.deque(maxlen=8)
        self.bytes = 0               # slot bytes (``lease.nbytes``) or pipe message bytes delivered, all runs
        self.marks: collections.deque = collections.deque(maxlen=_MARKS)  # (t, batches, bytes)
        self.busy: BusyCells | None = None
        self.report: Callable[[], None] | None = None   # the periodic logging report
        self.report_at = 0.0
        self.report_every = 0.0
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """A new run: ``wait``/``wall`` and the epoch counters restart at its first ``next()``."""
        self.epochs += 1
        self.wait = 0.0              # seconds blocked in next() in this run
        self.first = 0.0             # when the run's first batch was requested
        self.first_batch = 0.0       # how long that first request took (known from the second tick)
        self.ticks = 0               # ticks in this run
        self.end = 0.0               # when the run ended (StopIteration); 0 while it goes on
        self.base_counts: dict = {}
        self.busy_base: list | None = None
        self.busy_end: list | None = None
        self.tick_at = 0.0           # the first next() of the run ticks

    def tick(self, t: float, counts: Any) -> None:
        """At the start of a ``next()`` due for it: start the epoch's clock (first call
        of a run), note the first batch's wait (second call), take a window mark,
        emit the periodic report when due.  ``counts``: the scheduler's Counter."""
        self.ticks += 1
        if self.ticks == 1:
            self.first = t
            self.base_counts = dict(counts)
            self.busy_base = self.busy.totals(t) if self.busy is not None else None
            self.tick_at = t         # the second call ticks too
            return
        if self.ticks == 2:
            self.first_batch = self.wait
        self.marks.append((t, counts.get("batches", 0), self.bytes))
        due = t + MARK_S
        if self.report is not None:
            if t >= self.report_at:
                self.report_at = t + self.report_every
                self.report()
            due = min(due, self.report_at)
        self.tick_at = due

    def finish(self, t: float) -> None:
        """The run ended (StopIteration): the epoch's clock stops here."""
        if not self.end:
            self.end = t
            self.busy_end = self.busy.totals(t) if self.busy is not None else None

    def set_report(self, report: Callable[[], None] | None, every_s: float) -> None:
        self.report = report
        self.report_every = every_s
        self.report_at = _now() + every_s
        self.tick_at = min(self.tick_at, self.report_at)

    # ---- read side (lazy) ----

    def rates(self, now: float, batches: int) -> tuple[float, float]:
        """(batches/s, bytes/s) from the oldest mark of the recent window to ``now``
        (the end of the run, once it ended); (0.0, 0.0) before a mark 1 ms old."""
        nbytes = self.bytes
        for t, b, n in list(self.marks):
            if t >= now - WINDOW_S:
                dt = now - t
                if dt < 1e-3 or batches <= b:
                    return 0.0, 0.0
                return (batches - b) / dt, (nbytes - n) / dt
        return 0.0, 0.0


class BusyCells:
    """Per-worker-process busy counters in a shared mapping: anonymous for forked
    workers, a memfd passed to spawned ones (``passed_fd=True``).

    Cell ``c`` is written by one worker process at a time: a new process takes a
    cell whose previous owner has been reaped, after the parent folded that owner's
    total into ``retired[wid]``.  Per worker id the busy total is
    ``retired[wid] + sum(cells owned by processes with that id)``, monotonic.
    When no cell is free (more than ``capacity`` processes alive, only with a tiny
    ``maxtasksperchild``), the new process is not measured (cell -1).

    The mapping's last 8 bytes are the engine's *cancel word* (int64): tasks with a
    lower seq belong to runs that were abandoned (a ``break``, a superseded
    iterator), and a worker skips them unloaded (:meth:`cancel_below`,
    :meth:`WorkerBusy.cancelled`; docs/design.md, "Faults").
    """

    def __init__(self, num_workers: int, passed_fd: bool = False) -> None:
        self.capacity = 2 * num_workers + 16
        self.map_bytes = self.capacity * (_CELL.size + 8 * HIST_BUCKETS) + 8   # + the cancel word
        self.fd = -1
        if passed_fd:
            self.fd = _fds.off_stdio(os.memfd_create("mploader-busy", os.MFD_CLOEXEC))
            try:
                os.ftruncate(self.fd, self.map_bytes)
                self.map: mmap.mmap | None = _fds.mmap_fd(self.fd, self.map_bytes)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            self.map = mmap.mmap(-1, self.map_bytes, flags=mmap.MAP_SHARED)
        self.owners: list[Any] = [None] * self.capacity     # a worker's Channel, or None
        # Cells at and above ``used`` were never owned: the readers stop there (an
        # epoch's first next() reads the totals, and the cells are 2 per worker + 16).
        self.used = 0
        self.retired = [0.0] * num_workers

    def allocate(self) -> int:
        """A cell for a process about to start (-1 if none is free)."""
        m = self.map
        if m is None:
            return -1
        for cell, owner in enumerate(self.owners):
            if owner is None:
                return cell
            if owner.status is not None:  # reaped: nobody writes it any more
                self.retired[owner.wid] += _CELL.unpack_from(m, cell * _CELL.size)[0]
                _CELL.pack_into(m, cell * _CELL.size, 0.0, 0.0)
                self.owners[cell] = None
                return cell
        return -1

    def own(self, cell: int, worker: Any) -> None:
        if cell >= 0:
            self.owners[cell] = worker
            if cell >= self.used:
                self.used = cell + 1

    def cancel_below(self, seq: int) -> None:
        """Workers skip every task with a seq below ``seq`` they have not started (the
        word only grows).  A worker that read the word just before this store builds
        its next task still: at most one batch per worker after the call."""
        m = self.map
        if m is None:
            return
        try:
            off = self.map_bytes - 8
            if _SEQ.unpack_from(m, off)[0] < seq:
                _SEQ.pack_into(m, off, seq)   # one aligned 8-byte store; workers read it relaxed
        except ValueError:   # close() unmapped it meanwhile (a run dropped from another thread)
            pass

    def booting(self, cell: int) -> None:
        """A worker is about to be forked into ``cell``: its start word says booting
        since now (negative) until the child's first step clears it (:func:`booted`);
        the watchdog's start-up deadline reads it (docs/design.md, "Faults")."""
        if cell >= 0 and self.map is not None:
            _START.pack_into(self.map, cell * _CELL.size + 8, -_now())

    def clear_start(self, cell: int) -> None:
        """The start of the worker meant for ``cell`` failed: the cell is idle again."""
        if cell >= 0 and self.map is not None:
            _START.pack_into(self.map, cell * _CELL.size + 8, 0.0)

    def boot(self, cell: int) -> tuple | None:
        """What a worker needs to write its cell (None: not measured): ``(mapping,
        cell)`` for a forked worker, ``(PassedFd, map_bytes, cell)`` for a spawned one
        (made just before it starts, as the region's descriptor)."""
        if cell < 0 or self.map is None:
            return None
        if self.fd >= 0:
            return (_fds.PassedFd(self.fd), self.map_bytes, cell)
        return (self.map, cell)

    def totals(self, now: float) -> list[float]:
        """Busy seconds per worker id up to ``now`` (a task in progress counted)."""
        m = self.map
        if m is None:
            return list(self.retired)
        try:
            return self._read(m, now)
        except ValueError:  # close() unmapped it meanwhile (stats() from another thread)
            return list(self.retired)

    def _read(self, m: mmap.mmap, now: float) -> list[float]:
        out = list(self.retired)
        for cell, owner in enumerate(self.owners[:self.used]):
            if owner is None or owner.wid >= len(out):
                continue
            off = cell * _CELL.size
            # Two 8-byte stores by the worker; read until two readings agree so that a
            # busy total and a start time from different tasks are never combined.
            pair = _CELL.unpack_from(m, off)
            for _ in range(3):
                again = _CELL.unpack_from(m, off)
                if again == pair:
                    break
                pair = again
            busy, start = pair
            if start > 0 and owner.status is None:   # (negative: booting, no task yet)
                busy += max(0.0, now - start)
            out[owner.wid] += busy
        return out

    def starts(self) -> dict[int, float]:
        """``{id(worker): monotonic start of its task in progress}`` for the live
        workers that are busy, ``-monotonic()`` of the fork for forked workers still
        booting (the watchdog's view; mploader._watchdog)."""
        m = self.map
        out: dict[int, float] = {}
        if m is None:
            return out
        for cell, owner in enumerate(self.owners[:self.used]):
            if owner is not None and owner.status is None:
                start = _START.unpack_from(m, cell * _CELL.size + 8)[0]
                if start:
                    out[id(owner)] = start
        return out

    def p99(self) -> tuple[int, float]:
        """(batches timed by this loader's workers, the upper end of the histogram
        bucket that holds their 99th percentile time, in seconds)."""
        m = self.map
        if m is None:
            return 0, 0.0
        base = self.capacity * _CELL.size
        counts = [0.0] * HIST_BUCKETS
        for cell in range(self.capacity):
            for k, c in enumerate(_HIST.unpack_from(m, base + cell * _HIST.size)):
                counts[k] += c
        total = sum(counts)
        if not total:
            return 0, 0.0
        seen = 0.0
        for k, c in enumerate(counts):
            seen += c
            if seen >= 0.99 * total:
                return int(total), 2.0 ** (k - HIST_SHIFT)
        return int(total), 2.0 ** (HIST_BUCKETS - 1 - HIST_SHIFT)

    def close(self) -> None:
        """Fold every cell into ``retired`` (the totals stay readable) and unmap."""
        m = self.map
        if m is None:
            return
        for cell, owner in enumerate(self.owners):
            if owner is not None and owner.wid < len(self.retired):
                self.retired[owner.wid] += _CELL.unpack_from(m, cell * _CELL.size)[0]
        self.owners = [None] * self.capacity
        self.forget()

    def forget(self) -> None:
        """Unmap and close the descriptor (also in a forked child that must not hold them).

        A worker of this loader that forks a child (a loader used inside a worker)
        writes its own cell through a view of the mapping: the child cannot unmap it
        while that view exists, and leaves it mapped (its size: one cell per worker)."""
        m, self.map = self.map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def booted(boot: tuple | None) -> None:
    """In a forked worker, its first step: the fork's child-side clean-up is over,
    the start word :meth:`BusyCells.booting` set goes back to idle."""
    if boot is not None and len(boot) == 2:
        mapping, cell = boot
        _START.pack_into(mapping, cell * _CELL.size + 8, 0.0)


class WorkerBusy:
    """The worker's side of its cell: ``start()`` when a task arrives, ``stop()`` after
    its batch is published; each one clock read and plain 8-byte stores through a
    memoryview of the inherited mapping.  Continues the cell's total (a cell's
    writers follow one another)."""

    __slots__ = ("cell", "busy", "start_t", "hist", "cancel")

    def __init__(self, boot: tuple) -> None:
        if len(boot) == 3:  # spawned: map the passed memfd once
            fd, size, cell = boot  # (the PassedFd arrives as an int)
            try:
                mapping = _fds.mmap_fd(fd, size)
            finally:
                os.close(fd)
        else:
            mapping, cell = boot
        words = memoryview(mapping).cast("d")  # exported in the worker only
        self.cell = words[2 * cell:2 * cell + 2]
        self.cancel = memoryview(mapping).cast("q")[-1:]   # BusyCells.cancel_below's word
        base = (len(words) - 1) // (2 + HIST_BUCKETS) * 2 + cell * HIST_BUCKETS
        self.hist = words[base:base + HIST_BUCKETS]
        self.busy = self.cell[0]
        self.start_t = 0.0

    def start(self) -> None:
        self.start_t = self.cell[1] = _now()

    def cancelled(self, seq: int) -> bool:
        """Whether task ``seq`` belongs to an abandoned run (:meth:`BusyCells.cancel_below`)."""
        return seq < self.cancel[0]

    def stop(self) -> None:
        cell = self.cell
        took = _now() - self.start_t
        self.busy += took
        cell[0] = self.busy   # busy first: a reader seeing start == 0 sees the new total
        cell[1] = 0.0
        hist = self.hist
        k = _frexp(took)[1] + HIST_SHIFT   # (no clamp: see HIST_BUCKETS; +77 ns a batch, one clamped +155)
        hist[k] = hist[k] + 1.0   # the cell's one writer: a plain store


class MeteredRun:
    """An in-process run (``num_workers=0`` or ``thread_pool=True``) with its
    ``next()`` timed as the engine's: the time blocked in it is the loading itself (or
    the wait for a pool thread).  ``counts["batches"]`` counts its batches.

    ``held``: the run's box (its ``hold()``; None for a run without one), which the
    face's C ``__next__`` empties once it delivered the batch (``serial_next``,
    ``it._held``).  A batch returned here stays in the box until then: an interrupt
    between the run's return and that delivery (the clock read below) leaves it
    there, and the next ``next()`` returns it, counted once (the count is the last
    step before the return, with no call between)."""

    __slots__ = ("gen", "meter", "counts", "held")

    def __init__(self, gen: Any, meter: Meter, counts: dict) -> None:
        self.gen = gen
        self.meter = meter
        self.counts = counts
        hold = getattr(gen, "hold", None)
        self.held = hold() if hold is not None else None
        meter.begin_epoch()

    def __iter__(self) -> MeteredRun:
        return self

    def __next__(self) -> Any:
        meter = self.meter
        t0 = _now()
        if t0 >= meter.tick_at:
            meter.tick(t0, self.counts)
        try:
            batch = self.gen.__next__()
        except StopIteration:
            t1 = _now()
            meter.wait += t1 - t0
            meter.finish(t1)
            raise
        except BaseException:
            meter.wait += _now() - t0
            raise
        meter.wait += _now() - t0
        self.counts["batches"] += 1
        return batch


# ---- stats ----


def empty_stats() -> dict:
    """The metric keys before any batch (or without worker processes).  ``seeding``:
    how the generators are seeded and captured (:func:`mploader._rng_state.path`)."""
    return {"wait_s": 0.0, "wall_s": 0.0, "first_batch_s": 0.0, "epoch_batches": 0, "epoch_no_free_slot": 0,
            "epoch_fallback_pipe": 0, "batches_per_s": 0.0, "bytes_per_s": 0.0, "worker_busy": [],
            "ready_batches": 0, "held_slots": 0, "seeding": _rng_state.path(), "worker_private_bytes": []}


def private_bytes(pids: list[int]) -> int | None:
    """The private memory (bytes: ``Private_Clean`` + ``Private_Dirty`` of
    ``/proc/<pid>/smaps_rollup``) of the processes ``pids`` together, or None when it
    cannot be read.  About 1-10 ms per process: read at most once per epoch."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Private_Clean:", "Private_Dirty:")):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return total


def inline_stats(meter: Meter, counts: dict) -> dict:
    """The metric keys of an in-process loader (:class:`MeteredRun`): no workers, no
    ring, so ``worker_busy`` is empty and bytes, occupancy and fallbacks are zero."""
    out = empty_stats()
    if meter.first:
        end = meter.end or _now()
        out["wait_s"] = meter.wait
        out["wall_s"] = max(1e-9, end - meter.first)
        out["first_batch_s"] = meter.first_batch if meter.ticks >= 2 else meter.wait
        out["epoch_batches"] = counts["batches"] - meter.base_counts.get("batches", 0)
        out["batches_per_s"] = meter.rates(end, counts["batches"])[0]
    return out


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What :func:`engine_stats` reads of an engine, copied by its scheduler when
    ``stats()`` is called (``Scheduler.snapshot``): this module reads no engine's
    or scheduler's fields.

    Attributes
    ----------
    counts : mapping of str to int
        The transport counters (:data:`COUNTER_KEYS`) now.
    num_workers : int
        Worker processes the engine runs.
    forked : bool
        The workers are forked (their private memory is sampled once per run).
    worker_pids : list of int
        The live workers' pids.
    ready_batches, held_slots : int
        Batches published and not yet returned; slots the user's batches hold.
    """

    counts: Mapping[str, int]
    num_workers: int
    forked: bool
    worker_pids: list[int]
    ready_batches: int
    held_slots: int


def engine_stats(snap: Snapshot, meter: Meter) -> dict:
    """The metric keys of an engine (see docs/metrics.md), from its ``snap`` and ``meter``."""
    now = _now()
    out = empty_stats()
    counts = snap.counts
    first = meter.first
    end = meter.end or now
    if first:
        wall = max(1e-9, end - first)
        out["wait_s"] = meter.wait
        out["wall_s"] = wall
        out["first_batch_s"] = meter.first_batch if meter.ticks >= 2 else meter.wait
        base = meter.base_counts
        for key, name in (("epoch_batches", "batches"), ("epoch_no_free_slot", "no_free_slot"),
                          ("epoch_fallback_pipe", "fallback_pipe")):
            out[key] = counts.get(name, 0) - base.get(name, 0)
        out["worker_busy"] = _busy_fractions(meter, end, wall, snap.num_workers)
    else:
        out["worker_busy"] = [None if meter.busy is None else 0.0] * snap.num_workers
    out["batches_per_s"], out["bytes_per_s"] = meter.rates(end, counts.get("batches", 0))
    out["ready_batches"], out["held_slots"] = snap.ready_batches, snap.held_slots
    if first and snap.forked and (not meter.private or meter.private[-1][0] != meter.epochs):
        pids = snap.worker_pids
        private = private_bytes(pids) if pids else None
        if private is not None:
            if meter.private and meter.private[-1][2] != pids:
                meter.private.clear()   # other workers (restarted): their memory starts afresh
            meter.private.append((meter.epochs, private, pids))
    out["worker_private_bytes"] = [b for _, b, _ in meter.private]
    return out


def _busy_fractions(meter: Meter, end: float, wall: float, num_workers: int) -> list:
    cells, base = meter.busy, meter.busy_base
    if cells is None or base is None:
        return [None] * num_workers
    now = meter.busy_end if meter.busy_end is not None else cells.totals(end)
    return [max(0.0, (b - a) / wall) for a, b in zip(base, now)]
