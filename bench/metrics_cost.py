"""What the input-pipeline metrics cost per batch (issue 12: under 1 us on the hot path).

Run: ``PYTHONPATH=. python bench/metrics_cost.py [--calls N] [--repeats R]``

The parent's hot path gains, per batch: in ``Run.__next__`` one
``time.monotonic()`` pair, a comparison with the next tick and one float addition;
in ``Scheduler._consume`` the read of ``lease.nbytes`` and one integer addition.
An end-to-end loader cannot resolve a few hundred nanoseconds against tens of
microseconds of transport and scheduling noise, so each side is timed in isolation
against the same code without the metrics:

* ``next``   -- ``Run.__next__`` of mploader over a stub engine whose ``next_batch``
  only sets the handoff, versus the same method without the metering lines (the
  body as it was before the metrics, kept below);
* ``consume`` -- the lines ``_consume`` gained, on a real ``SlotLease``;
* ``worker``  -- the worker's ``WorkerBusy.start()`` + ``stop()`` per batch (two
  clock reads and three 8-byte stores into the shared mapping; no system call).

Each figure is the median over ``--repeats`` runs of ``--calls`` calls, in ns per
batch.  A last line times whole epochs of a ``DataLoader`` over a trivial dataset
with and without the metering (stubbed out), for scale.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from mploader import _ring, _scheduler
from mploader._metrics import BusyCells, Meter, WorkerBusy


class _StubScheduler:
    def __init__(self) -> None:
        self.stats: dict = {}

    def adopt(self, run: Any) -> tuple:
        """What ``Scheduler.adopt`` gives a new run: its meter, counters and weak reference."""
        self.meter.begin_epoch()  # type: ignore[attr-defined]
        return self.meter, self.stats, None  # type: ignore[attr-defined]

    def abandon(self, run: Any) -> None:
        pass


class _StubEngine:
    """Enough of an Engine for ``Run.__next__``: the batch is there at once."""

    closed = True  # the runs' abandon finalizers have nothing to hand back

    def __init__(self) -> None:
        self.scheduler = _StubScheduler()   # (what Engine.run gives each Run)
        self.scheduler.meter = Meter()  # type: ignore[attr-defined]

    def next_batch(self, run: Any) -> None:
        run.handoff = run


def _next_without_metrics(self: Any) -> Any:
    """``Run.__next__`` as it was before the metrics (the baseline)."""
    if self.superseded:
        raise RuntimeError("this iterator was superseded by a newer iteration of the same loader")
    if self.done:
        raise StopIteration
    try:
        self._engine.next_batch(self)
    except StopIteration:
        self.done = True
        raise
    batch = self.handoff
    self.handoff = _scheduler._EMPTY
    return batch


class _BaselineRun(_scheduler.Run):
    __next__ = _next_without_metrics


def _time(fn: Any, calls: int, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(calls)
        out.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(out)


def _loop_next(run: Any) -> Any:
    nxt = type(run).__next__

    def go(calls: int) -> None:
        for _ in range(calls):
            nxt(run)
    return go


def bench_next(calls: int, repeats: int) -> tuple[float, float]:
    engine = _StubEngine()
    with_m = _scheduler.Run(engine, engine.scheduler, [], True)
    without = _BaselineRun(engine, engine.scheduler, [], True)
    a = _time(_loop_next(with_m), calls, repeats)
    b = _time(_loop_next(without), calls, repeats)
    return a, b


def _lease() -> Any:
    region = _ring.create_region(1, 4096)
    region.assign(0, 0)
    region.begin(0, 0)
    region.publish(0, _ring.KIND_SLOT, 0, 64)
    return region.wait(0, 1.0)


def bench_consume(calls: int, repeats: int) -> tuple[float, float]:
    lease = _lease()
    meter = Meter()

    holder = _StubScheduler()
    holder.meter = meter  # type: ignore[attr-defined]

    def with_m(n: int) -> None:
        self = holder
        for _ in range(n):
            nbytes = lease.nbytes
            self.meter.bytes += nbytes  # type: ignore[attr-defined]

    def without(n: int) -> None:
        for _ in range(n):
            pass

    return _time(with_m, calls, repeats), _time(without, calls, repeats)


def bench_worker(calls: int, repeats: int) -> float:
    cells = BusyCells(1)
    w = WorkerBusy(cells.boot(cells.allocate()))  # type: ignore[arg-type]

    def go(n: int) -> None:
        for _ in range(n):
            w.start()
            w.stop()
    return _time(go, calls, repeats)  # the mapping goes with the process (the worker's view pins it)


class _Trivial:
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> np.ndarray:
        return np.zeros(4, np.float32)


def bench_epoch(repeats: int) -> tuple[float, float]:
    import mploader

    def epoch_ns(dl: Any) -> float:
        t0 = time.perf_counter_ns()
        n = sum(1 for _ in dl)
        return (time.perf_counter_ns() - t0) / n

    out = []
    with mploader.DataLoader(_Trivial(), batch_size=4, num_workers=2) as dl:
        epoch_ns(dl)  # start the workers, size the slots
        for patched in (False, True):
            if patched:
                _scheduler.Run.__next__ = _next_without_metrics  # type: ignore[method-assign]
            try:
                out.append(statistics.median(epoch_ns(dl) for _ in range(repeats)))
            finally:
                _scheduler.Run.__next__ = _ORIGINAL_NEXT  # type: ignore[method-assign]
    return out[0], out[1]


_ORIGINAL_NEXT = _scheduler.Run.__next__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    a, b = bench_next(args.calls, args.repeats)
    print(f"next:    {a:7.1f} ns with metrics, {b:7.1f} ns without -> {a - b:6.1f} ns per batch")
    c, d = bench_consume(args.calls, args.repeats)
    print(f"consume: {c:7.1f} ns with metrics, {d:7.1f} ns without -> {c - d:6.1f} ns per batch")
    print(f"hot path total: {a - b + c - d:6.1f} ns per batch (parent)")
    print(f"worker:  {bench_worker(args.calls, args.repeats):7.1f} ns per batch (start + stop, in the worker)")
    e, f = bench_epoch(args.repeats)
    print(f"epoch (DataLoader, 2 workers, trivial samples): {e / 1000:.1f} us per batch with metrics, "
          f"{f / 1000:.1f} us without (noise dominates)")


if __name__ == "__main__":
    main()
