"""What a checkpoint costs (issue 11): ``state_dict()``, its JSON size, and the time
from ``load_state_dict()`` to the first batch of a resumed epoch.

Run: ``PYTHONPATH=. python bench/resume_cost.py [--samples N] [--batch B] [--repeats R]``

A resumed map-style epoch is rebuilt by iterating the batch sampler from the
epoch's start and skipping the batches already received (indices only: the
dataset is not read), so resuming costs one pass over the sampler's indices up to
the saved position.  Measured on ``mploader.DataLoader(shuffle=True,
num_workers=0)`` over a dataset whose samples cost nothing, saved halfway through
an epoch; the "fresh" line is the first batch of a loader that was not resumed,
for scale.  Medians of ``--repeats`` runs, in milliseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import mploader


class Cheap:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.int64:
        return np.int64(i)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ds = Cheap(args.samples)
    half = args.samples // args.batch // 2
    saved = mploader.DataLoader(ds, batch_size=args.batch, shuffle=True, seed=0)
    it = iter(saved)
    for _ in range(half):
        next(it)
    save_ms, load_ms, fresh_ms = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state = saved.state_dict()
        text = json.dumps(state)
        save_ms.append((time.perf_counter() - t0) * 1e3)
        loader = mploader.DataLoader(ds, batch_size=args.batch, shuffle=True, seed=0)
        t0 = time.perf_counter()
        loader.load_state_dict(json.loads(text))
        next(iter(loader))
        load_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        next(iter(mploader.DataLoader(ds, batch_size=args.batch, shuffle=True, seed=0)))
        fresh_ms.append((time.perf_counter() - t0) * 1e3)
    print(f"{args.samples:,} samples, batch {args.batch}, saved after {half:,} batches")
    print(f"state_dict + json.dumps   {statistics.median(save_ms):8.2f} ms   ({len(text):,} bytes of JSON)")
    print(f"load + first batch        {statistics.median(load_ms):8.2f} ms   (rebuilds and skips {half:,} batches)")
    print(f"fresh loader, first batch {statistics.median(fresh_ms):8.2f} ms")


if __name__ == "__main__":
    main()
