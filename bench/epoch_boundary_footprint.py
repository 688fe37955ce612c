"""The staged epoch boundary against a steady ``next()``, on a hot and a waking core.

Usage (repository root, extensions built): ``PYTHONPATH=. python bench/epoch_boundary_footprint.py spin|sleep``

The Gluon face, ``seed=0``, 2 workers, epochs of 16 batches of 8 cheap samples (a
float32 row of 64 each), 200 epochs.  Between batches the loop pauses 2 ms and before
each epoch's ``iter()`` 20 ms (so the next epoch's batches are all staged and loaded),
either spinning on the CPU (``spin``: the core stays awake) or sleeping (``sleep``: as a
training step that waits for an accelerator).  Prints the medians of ``iter()`` + the
first ``next()`` of each epoch (and of ``iter()`` alone) against a steady ``next()``
(the 4th batch of an epoch on), in microseconds, and the batches taken over from the
staging (``staged_used``).  Results: docs/bench-log.md, "Sixth session: the staged epoch
boundary, and its footprint".
"""
import statistics
import sys
import time

import numpy as np

import mploader


class Rows:
    def __len__(self) -> int:
        return 16 * 8

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(64, i, np.float32)


def pause(mode: str, seconds: float) -> None:
    if mode == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_epochs(loader: mploader.DataLoader, mode: str, epochs: int, ahead: bool = False) -> tuple[list, list, list]:
    """Run ``epochs`` epochs of ``loader``; return the nanoseconds of each staged epoch's
    ``iter()`` + first ``next()``, of its ``iter()``, and of every steady ``next()``.
    ``ahead``: call ``iter()`` right after the previous epoch's end, before the pause
    (then only the first ``next()`` is timed; ``bench/epoch_boundary_floor.py``)."""
    first, iters, steady = [], [], []
    it = iter(loader)
    for _ in range(epochs):
        k = 0
        while True:
            pause(mode, 0.002)
            t0 = time.perf_counter_ns()
            b = next(it, None)
            t1 = time.perf_counter_ns()
            if b is None:
                break
            k += 1
            if k >= 4:
                steady.append(t1 - t0)
            del b
        if ahead:
            it = iter(loader)
        pause(mode, 0.02)
        t0 = time.perf_counter_ns()
        if not ahead:
            it = iter(loader)
        t1 = time.perf_counter_ns()
        next(it)
        t2 = time.perf_counter_ns()
        first.append(t2 - t0)
        iters.append(t1 - t0)
    return first, iters, steady


def main(mode: str) -> None:
    loader = mploader.DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=2, seed=0)
    try:
        first, iters, steady = time_epochs(loader, mode, 200)
        staged_used = loader.stats()["staged_used"]
    finally:
        loader.close()
    print(f"{mode}: iter()+first next() {statistics.median(first) / 1e3:.1f} us (iter() "
          f"{statistics.median(iters) / 1e3:.1f}), steady next() {statistics.median(steady) / 1e3:.1f} us, "
          f"staged_used {staged_used}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sleep")
