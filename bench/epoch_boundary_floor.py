"""How low the staged epoch boundary could go: two floors beside it (issue 27).

Usage (repository root, extensions built): ``PYTHONPATH=. python bench/epoch_boundary_floor.py spin|sleep [--epochs N]``

The setting of ``bench/epoch_boundary_footprint.py`` (the Gluon face, ``seed=0``, 2
workers, epochs of 16 batches of 8 cheap samples, 2 ms between batches and 20 ms
before each epoch's first batch, spun or slept).  Three loops, one after the other
in one process, each printing medians over the epochs in microseconds:

``boundary``
    ``iter()`` + the first ``next()`` of a staged epoch, as the footprint script
    times it.
``iter ahead``
    ``iter()`` called right after the previous epoch's end, *before* the 20 ms pause;
    only the first ``next()`` is timed (the take-over of the staged batches and the
    first batch's delivery): the boundary if ``iter()`` cost nothing.
``long pause``
    no epoch boundary at all: the 7th ``next()`` of each epoch follows a 20 ms pause
    instead of 2 ms, against the steady ``next()`` after 2 ms -- the same code after a
    longer pause; with the thread's CPU time beside the wall time (equal: the extra
    time is work, not waiting).

Results: docs/bench-log.md, "Ninth session: the epoch boundary's floors".
"""
from __future__ import annotations

import argparse
import statistics
import time

from epoch_boundary_footprint import Rows, pause, time_epochs

import mploader


def _loader() -> mploader.DataLoader:
    return mploader.DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=2, seed=0)


def boundary(mode: str, epochs: int, ahead: bool) -> tuple[float, float]:
    """(median first-batch wait, median steady next()), µs."""
    loader = _loader()
    try:
        first, _, steady = time_epochs(loader, mode, epochs, ahead)
    finally:
        loader.close()
    return statistics.median(first) / 1e3, statistics.median(steady) / 1e3


def long_pause(mode: str, epochs: int) -> tuple[float, float, float, float]:
    """(wall, CPU of the next() after 20 ms; wall, CPU of a steady next() after 2 ms), µs."""
    loader = _loader()
    long_wall, long_cpu, wall, cpu = [], [], [], []
    try:
        for _ in range(epochs):
            it = iter(loader)
            k = 0
            while True:
                pause(mode, 0.02 if k == 6 else 0.002)
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                b = next(it, None)
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                if b is None:
                    break
                if k == 6:
                    long_wall.append(t1 - t0)
                    long_cpu.append(c1 - c0)
                elif k >= 4:
                    wall.append(t1 - t0)
                    cpu.append(c1 - c0)
                k += 1
                del b
    finally:
        loader.close()
    return tuple(statistics.median(x) / 1e3 for x in (long_wall, long_cpu, wall, cpu))  # type: ignore[return-value]


def main(mode: str, epochs: int) -> None:
    b, s = boundary(mode, epochs, ahead=False)
    print(f"{mode}: boundary (iter() + first next()) {b:.1f} us, steady next() {s:.1f} us")
    b, s = boundary(mode, epochs, ahead=True)
    print(f"{mode}: iter ahead (first next() alone) {b:.1f} us, steady next() {s:.1f} us")
    lw, lc, w, c = long_pause(mode, epochs)
    print(f"{mode}: long pause: next() after 20 ms {lw:.1f} us (CPU {lc:.1f}), after 2 ms {w:.1f} us (CPU {c:.1f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("spin", "sleep"))
    p.add_argument("--epochs", type=int, default=150)
    args = p.parse_args()
    main(args.mode, args.epochs)
