"""Input-pipeline metrics: what the training loop waited for, and what the workers did.

Two sides of the ring are measured (docs/metrics.md has the table of keys):

* the parent's :class:`Meter` -- one per engine, updated by ``Run.__next__`` (one
  ``time.monotonic_ns()`` pair around the blocking part of ``next()``) and by the
  scheduler's ``_consume`` (two integer increments per batch).  Counters live in
  slots; rates, fractions and occupancy are computed only when :func:`engine_stats`
  is called.  ``wait``/``wall`` and the per-epoch counters restart with every run
  (one epoch for the Gluon and torch faces);
* the workers' :class:`BusyCells` -- a small shared array of ``(busy_ns, start_ns)``
  int64 pairs, one cell per worker process, in an anonymous ``MAP_SHARED`` mapping
  created in the parent before the workers fork (they inherit it; no descriptor is
  involved).  A worker stores ``start_ns`` when a task arrives and adds the task's
  duration to ``busy_ns`` after publishing it: two plain stores into memory it
  already maps, no system call.  Spawned/forkserver workers do not inherit the
  mapping: their busy fraction is reported as None (unknown).

Clocks: ``time.monotonic_ns()`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every
process of the machine, so a worker's ``start_ns`` can be compared with the
parent's now.
"""
from __future__ import annotations

import collections
import mmap
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = ["Meter", "BusyCells", "WorkerBusy", "engine_stats", "empty_stats", "METRIC_KEYS"]

_now = time.monotonic_ns

#: A window mark is taken at most this often (ns), at the start of a ``next()``.
MARK_NS = 500_000_000
#: Rates (``batches_per_s``, ``bytes_per_s``) cover about this much recent time (ns).
WINDOW_NS = 10_000_000_000
_MARKS = WINDOW_NS // MARK_NS + 2

#: One cell: busy_ns (total nanoseconds spent on tasks), start_ns (when the task in
#: progress began; 0 when idle).
_CELL = struct.Struct("<qq")

#: The keys every face's ``stats()`` adds to the transport counters (docs/metrics.md).
METRIC_KEYS = ("wait_s", "wall_s", "first_batch_s", "epoch_batches", "epoch_no_free_slot", "epoch_fallback_pipe",
               "batches_per_s", "bytes_per_s", "worker_busy", "ready_batches", "held_slots")


class Meter:
    """The parent's counters of one engine (see the module docstring).

    Written only by the thread that iterates (under the engine's lock, or in
    ``Run.__next__`` around it); :func:`engine_stats` may read them from any thread
    (a reading racing an update is off by one batch, never inconsistent in type).
    """

    __slots__ = ("wait_ns", "first_ns", "first_batch_ns", "end_ns", "last_ns", "batches", "bytes", "base_batches",
                 "base_counts", "tick_ns", "marks", "busy", "busy_base", "busy_end", "report", "report_ns",
                 "report_every_ns")

    def __init__(self) -> None:
        self.batches = 0             # batches delivered since the engine was made
        self.bytes = 0               # their slot bytes (``lease.nbytes``) or pipe message bytes
        self.marks: collections.deque = collections.deque(maxlen=_MARKS)  # (t_ns, batches, bytes)
        self.busy: BusyCells | None = None
        self.report: Callable[[], None] | None = None   # the periodic logging report
        self.report_ns = 0
        self.report_every_ns = 0
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """A new run: ``wait``/``wall`` and the epoch counters restart at its first ``next()``."""
        self.wait_ns = 0
        self.first_ns = 0            # when the first batch of the run was requested
        self.first_batch_ns = 0      # how long that first request took
        self.end_ns = 0              # when the run ended (StopIteration); 0 while it goes on
        self.last_ns = 0             # when the last ``next()`` returned
        self.base_batches = self.batches
        self.base_counts: dict = {}
        self.busy_base: list | None = None
        self.busy_end: list | None = None
        self.tick_ns = 0             # the first next() of the run ticks

    def tick(self, t_ns: int, counts: Any) -> None:
        """At the start of a ``next()`` at least MARK_NS after the previous tick: start
        the epoch's clock (first call of a run), take a window mark, and emit the
        periodic report when it is due.  ``counts`` is the scheduler's Counter."""
        if not self.first_ns:
            self.first_ns = t_ns
            self.base_counts = dict(counts)
            self.base_batches = self.batches
            self.busy_base = self.busy.totals(t_ns) if self.busy is not None else None
        self.marks.append((t_ns, self.batches, self.bytes))
        next_ns = t_ns + MARK_NS
        if self.report is not None:
            if t_ns >= self.report_ns:
                self.report_ns = t_ns + self.report_every_ns
                self.report()
            next_ns = min(next_ns, self.report_ns)
        self.tick_ns = next_ns

    def finish(self, t_ns: int) -> None:
        """The run ended (StopIteration): the epoch's clock stops here."""
        if not self.end_ns:
            self.end_ns = t_ns
            self.busy_end = self.busy.totals(t_ns) if self.busy is not None else None

    def set_report(self, report: Callable[[], None] | None, every_s: float) -> None:
        self.report = report
        self.report_every_ns = int(every_s * 1e9)
        self.report_ns = _now() + self.report_every_ns
        self.tick_ns = min(self.tick_ns, self.report_ns)

    # ---- read side (lazy) ----

    def rates(self) -> tuple[float, float]:
        """(batches/s, bytes/s) between the oldest mark of the recent window and the
        last delivered batch; (0.0, 0.0) before two points a millisecond apart."""
        last_ns, batches, nbytes = self.last_ns, self.batches, self.bytes
        marks = list(self.marks)
        for t_ns, b, n in marks:
            if t_ns >= last_ns - WINDOW_NS:
                dt = (last_ns - t_ns) / 1e9
                if dt < 1e-3 or batches <= b:
                    return 0.0, 0.0
                return (batches - b) / dt, (nbytes - n) / dt
        return 0.0, 0.0


class BusyCells:
    """Per-worker-process busy counters in an anonymous shared mapping (fork only).

    Cell ``c`` is written by one worker process at a time: a new process takes a
    cell whose previous owner has been reaped, after the parent folded that owner's
    total into ``retired_ns[wid]``.  Per worker id the busy total is
    ``retired_ns[wid] + sum(cells owned by processes with that id)``, monotonic.
    When no cell is free (more than ``capacity`` processes alive, only with a tiny
    ``maxtasksperchild``), the new process is not measured (cell -1).
    """

    def __init__(self, num_workers: int) -> None:
        self.capacity = 2 * num_workers + 16
        self.num_workers = num_workers
        self.map: mmap.mmap | None = mmap.mmap(-1, self.capacity * _CELL.size, flags=mmap.MAP_SHARED)
        self.owners: list[Any] = [None] * self.capacity     # WorkerProcess or None
        self.retired_ns = [0] * num_workers

    def allocate(self) -> int:
        """A cell for a process about to start (-1 if none is free)."""
        m = self.map
        if m is None:
            return -1
        for cell, owner in enumerate(self.owners):
            if owner is None:
                return cell
            if owner.status is not None:  # reaped: nobody writes it any more
                busy, _ = _CELL.unpack_from(m, cell * _CELL.size)
                self.retired_ns[owner.wid] += busy
                _CELL.pack_into(m, cell * _CELL.size, 0, 0)
                self.owners[cell] = None
                return cell
        return -1

    def own(self, cell: int, worker: Any) -> None:
        if cell >= 0:
            self.owners[cell] = worker

    def boot(self, cell: int) -> tuple | None:
        """What a forked worker needs to write its cell (None: not measured)."""
        return None if cell < 0 or self.map is None else (self.map, cell * _CELL.size)

    def totals(self, now_ns: int) -> list[int]:
        """Busy nanoseconds per worker id up to ``now_ns`` (the task in progress counted)."""
        m = self.map
        out = list(self.retired_ns)
        if m is None:
            return out
        for cell, owner in enumerate(self.owners):
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
            if start and owner.status is None:
                busy += max(0, now_ns - start)
            out[owner.wid] += busy
        return out

    def close(self) -> None:
        """Fold every cell into ``retired_ns`` (the totals stay readable) and unmap."""
        m = self.map
        if m is None:
            return
        for cell, owner in enumerate(self.owners):
            if owner is not None and owner.wid < len(self.retired_ns):
                self.retired_ns[owner.wid] += _CELL.unpack_from(m, cell * _CELL.size)[0]
        self.owners = [None] * self.capacity
        self.map = None
        m.close()


class WorkerBusy:
    """The worker's side of its cell: ``start()`` when a task arrives, ``stop()`` after
    its batch is published.  Continues the cell's total (a cell's writers follow
    one another)."""

    __slots__ = ("map", "off", "busy", "start_ns")

    def __init__(self, boot: tuple) -> None:
        self.map, self.off = boot
        self.busy = _CELL.unpack_from(self.map, self.off)[0]
        self.start_ns = 0

    def start(self) -> None:
        self.start_ns = t = _now()
        _CELL.pack_into(self.map, self.off, self.busy, t)

    def stop(self) -> None:
        self.busy += _now() - self.start_ns
        _CELL.pack_into(self.map, self.off, self.busy, 0)


# ---- stats ----


def empty_stats() -> dict:
    """The metric keys before any batch (or without worker processes)."""
    return {"wait_s": 0.0, "wall_s": 0.0, "first_batch_s": 0.0, "epoch_batches": 0, "epoch_no_free_slot": 0,
            "epoch_fallback_pipe": 0, "batches_per_s": 0.0, "bytes_per_s": 0.0, "worker_busy": [],
            "ready_batches": 0, "held_slots": 0}


def engine_stats(engine: Engine, meter: Meter) -> dict:
    """The metric keys of ``engine`` (see docs/metrics.md)."""
    now = _now()
    out = empty_stats()
    first = meter.first_ns
    if first:
        end = meter.end_ns or now
        wall_ns = max(1, end - first)
        out["wait_s"] = meter.wait_ns / 1e9
        out["wall_s"] = wall_ns / 1e9
        out["first_batch_s"] = meter.first_batch_ns / 1e9
        out["epoch_batches"] = meter.batches - meter.base_batches
        counts = engine._scheduler.stats
        base = meter.base_counts
        out["epoch_no_free_slot"] = counts.get("no_free_slot", 0) - base.get("no_free_slot", 0)
        out["epoch_fallback_pipe"] = counts.get("fallback_pipe", 0) - base.get("fallback_pipe", 0)
        out["worker_busy"] = _busy_fractions(meter, end, wall_ns, engine.num_workers)
    else:
        out["worker_busy"] = [None if meter.busy is None else 0.0] * engine.num_workers
    out["batches_per_s"], out["bytes_per_s"] = meter.rates()
    out["ready_batches"], out["held_slots"] = _occupancy(engine)
    return out


def _busy_fractions(meter: Meter, end_ns: int, wall_ns: int, num_workers: int) -> list:
    cells, base = meter.busy, meter.busy_base
    if cells is None or base is None:
        return [None] * num_workers
    now = meter.busy_end if meter.busy_end is not None else cells.totals(end_ns)
    return [max(0.0, (b - a) / wall_ns) for a, b in zip(base, now)]


def _occupancy(engine: Engine) -> tuple[int, int]:
    """(batches published and waiting to be returned, slots held by the user).

    READY slots are published and not taken; a batch whose lease the scheduler took
    but has not returned yet (``in_order=False`` looks ahead, an interrupt) is
    waiting too, and its LEASED slot is not the user's; pipe batches in a mailbox
    are waiting.  The other LEASED slots are held by batches the user still refers to.
    """
    from . import _ring
    region = engine.region
    if region is None:
        return 0, 0
    run = engine._current()
    for _ in range(3):
        try:
            inflight = list(run.inflight) if run is not None else []
            stale = list(engine._scheduler.stale)
            break
        except RuntimeError:  # the deque changed while another thread copied it
            continue
    else:
        inflight, stale = [], []
    ready = held = 0
    for slot in range(region.nslots):
        state = region.state(slot)
        if state == _ring.STATE_READY:
            ready += 1
        elif state == _ring.STATE_LEASED:
            held += 1
    for t in inflight:
        if t.consumed:
            continue
        if t.box:
            ready += 1
            held -= 1
        elif t.via_pipe and t.seq in t.worker.mailbox:
            ready += 1
    for t in stale:
        if t.box:
            held -= 1
    return ready, max(0, held)
