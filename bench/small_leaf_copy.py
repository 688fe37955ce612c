"""Per-batch cost of delivering a torch-face batch's small leaves as owned copies
(``mploader.torch.SMALL_LEAF_BYTES``) instead of views of the slot.

Usage: ``python bench/small_leaf_copy.py [--n N] [--repeats R]``

One process, one region, no waiting: a worker-side ``SlotWriter`` writes a batch of
``images`` (B, 3, 32, 32) uint8 (views either way) and ``labels`` (B,) int64 (a copy
under the rule), the parent takes the slot and ``decode`` rebuilds the batch, once
with ``copy_below=0`` (every leaf a view) and once with ``copy_below=4096``,
interleaved batch by batch so both see the same machine state.  Reported, for batch
sizes 32 and 256: the median of R repeats of the mean ``decode`` time over N batches,
the min-max beside it, and the difference.  The data are written fresh into the slot
for every batch (the copy reads from a slot just written, as in the loader).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a source checkout without installing

import numpy as np  # noqa: E402 - after the sys.path line above

from mploader import _descriptor as D  # noqa: E402
from mploader import _ring  # noqa: E402

THRESHOLD = 4096


def one(region, seq: int, batch: int, copy_below: int) -> float:
    region.assign(0, seq)
    w = D.SlotWriter(region, 0, seq)
    images = w.alloc((batch, 3, 32, 32), np.uint8)
    images[...] = seq % 251
    labels = w.alloc((batch,), np.int64)
    labels[...] = seq
    assert w.finish([images, labels]) is None
    del images, labels, w
    lease = region.wait(0, 0)
    t0 = time.perf_counter_ns()
    out = D.decode(lease, lease.desc_off, lease.desc_len, False, copy_below)
    t1 = time.perf_counter_ns()
    assert int(out[1][0]) == seq
    return (t1 - t0) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="batches per repeat (default 2000)")
    ap.add_argument("--repeats", type=int, default=7, help="repeats (default 7)")
    args = ap.parse_args()
    region = _ring.create_region(1, 1 << 20)
    seq = 0
    print(f"decode, µs per batch: median of {args.repeats} repeats of {args.n} batches (min-max)")
    for batch in (32, 256):
        means: dict[int, list[float]] = {0: [], THRESHOLD: []}
        for _ in range(args.repeats):
            acc = {0: 0.0, THRESHOLD: 0.0}
            for _ in range(args.n):
                for below in (0, THRESHOLD):
                    seq += 1
                    acc[below] += one(region, seq, batch, below)
            for below in acc:
                means[below].append(acc[below] / args.n)
        views, copies = means[0], means[THRESHOLD]
        diffs = [c - v for c, v in zip(copies, views)]
        print(f"  B={batch:3d}: views {statistics.median(views):.2f} ({min(views):.2f}-{max(views):.2f})  "
              f"labels copied {statistics.median(copies):.2f} ({min(copies):.2f}-{max(copies):.2f})  "
              f"difference {statistics.median(diffs):+.2f} ({min(diffs):+.2f}-{max(diffs):+.2f})")
    region.close()


if __name__ == "__main__":
    main()
