"""The watchdog's cost and its detection latency (issue 23; docs/design.md, "The watchdog").

Run: ``PYTHONPATH=.:bench python bench/watchdog_cost.py overhead [--repeats R] [--batches N]``
     ``PYTHONPATH=.:bench python bench/watchdog_cost.py latency --stall-timeout S``

* ``overhead``: the transport suite's tiny workload (``mploader_bench.synthetic``
  "tiny": batches of 32 x ``(np.int64, float32 (16,))``, 2.3 kB, the pool not in the
  cache), Gluon face, 2 forked workers, one epoch of ``--batches`` batches, in
  alternation: "before" (no watchdog, the workers without the batch-time histogram),
  ``stall_timeout=None`` (the histogram only) and the default ``"auto"``; the median
  batches/s of each with min-max, and the differences of the medians.
  The parent checks only while it waits (no per-batch work); the workers gain one
  ``frexp`` and one 8-byte store per batch (the batch-time histogram), timed alone
  on the last line (``WorkerBusy.stop``, ns per call).
* ``latency``: a dataset whose sample 40 sleeps for ever once (the batches before it
  take ~1 ms, so "auto" has its 20 timed batches and its 60 s floor): the time from
  the moment the worker starts sleeping to the watchdog's WARNING (stack taken,
  about to kill and respawn) and to the respawned worker's first batch delivered.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import timeit
from typing import Any

import numpy as np

import mploader
from mploader import _metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
from mploader_bench.synthetic import make_dataset


def _epoch_rate(dataset: Any, batches: int, stall_timeout: Any) -> float:
    sampler = mploader.BatchSampler(mploader.SequentialSampler(batches * 32), 32, "discard")
    with mploader.DataLoader(dataset, batch_sampler=sampler, num_workers=2, seed=0,
                             stall_timeout=stall_timeout) as dl:
        it = iter(dl)
        next(it)                    # workers started, slots sized
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        return n / (time.perf_counter() - t0)


def _stop_without_histogram(self: Any) -> None:
    """``WorkerBusy.stop`` as before issue 23 (no batch-time histogram)."""
    cell = self.cell
    self.busy += time.monotonic() - self.start_t
    cell[0] = self.busy
    cell[1] = 0.0


def overhead(repeats: int, batches: int) -> None:
    """Three configurations in alternation: "before" (no watchdog and the workers'
    ``stop`` without the histogram, patched in before the workers fork), "None"
    (stall_timeout=None: the histogram only) and "auto" (the default)."""
    dataset = make_dataset("tiny", "cold", processes=2)
    names = ("before", "None", "auto")
    rates: dict[str, list[float]] = {name: [] for name in names}
    with_histogram = _metrics.WorkerBusy.stop
    for k in range(len(names) * repeats):
        name = names[k % len(names)]
        _metrics.WorkerBusy.stop = _stop_without_histogram if name == "before" else with_histogram  # type: ignore[method-assign]
        try:
            rates[name].append(_epoch_rate(dataset, batches, "auto" if name == "auto" else None))
        finally:
            _metrics.WorkerBusy.stop = with_histogram  # type: ignore[method-assign]
    for name, xs in rates.items():
        print(f"{name:6}: {statistics.median(xs):9,.0f} batches/s (min {min(xs):,.0f}, "
              f"max {max(xs):,.0f}, {repeats} epochs of {batches} batches)")
    a = statistics.median(rates["before"])
    for name in ("None", "auto"):
        print(f"{name} against before, difference of the medians: {(statistics.median(rates[name]) - a) / a:+.2%}")
    cells = _metrics.BusyCells(1)
    worker = _metrics.WorkerBusy(cells.boot(0))

    def with_hist() -> None:
        worker.start()
        worker.stop()

    def without_hist() -> None:   # the cell's two stores as before the histogram
        worker.start()
        cell = worker.cell
        worker.busy += time.monotonic() - worker.start_t
        cell[0] = worker.busy
        cell[1] = 0.0

    n = 200_000
    for name, fn in (("start+stop with the histogram", with_hist), ("start+stop without", without_hist)):
        ns = min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e9
        print(f"worker {name}: {ns:.0f} ns per batch")
    cells.close()   # (the worker's views keep the mapping: forget() leaves it to them)


class _Hang:
    def __init__(self, marks: str) -> None:
        self.marks = marks

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 40 and not os.listdir(self.marks):
            with open(os.path.join(self.marks, "t"), "w") as f:
                f.write(repr(time.monotonic()))
            time.sleep(10 ** 6)
        time.sleep(0.001)
        return np.full(4, i)


class _When(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.at: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.at.append(time.monotonic())


def latency(stall_timeout: Any) -> None:
    marks = tempfile.mkdtemp()
    when = _When()
    logging.getLogger("mploader").addHandler(when)
    with mploader.DataLoader(_Hang(marks), batch_size=1, num_workers=2, seed=0, prefetch=2,
                             stall_timeout=stall_timeout) as dl:
        for k, _b in enumerate(dl):
            if k == 40:
                delivered = time.monotonic()
        with open(os.path.join(marks, "t")) as f:
            hung = float(f.read())
        stats = dl.stats()
    print(f"stall_timeout={stall_timeout!r}: hang -> WARNING (stack taken, respawn next) "
          f"{when.at[0] - hung:.2f} s; hang -> the batch delivered by the replacement {delivered - hung:.2f} s; "
          f"stalls {stats['stalls']}, respawns {stats['respawns']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("overhead", "latency"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batches", type=int, default=20_000)
    p.add_argument("--stall-timeout", default="auto", help="seconds, or 'auto' (the default rule)")
    args = p.parse_args()
    if args.what == "overhead":
        overhead(args.repeats, args.batches)
    else:
        latency(args.stall_timeout if args.stall_timeout == "auto" else float(args.stall_timeout))


if __name__ == "__main__":
    main()
