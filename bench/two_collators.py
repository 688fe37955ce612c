"""What the memory bus allows: the transport suite's ``large`` batches collated by one
and by two processes at once, in-process (no ring, no pipes, no parent).

Usage: ``PYTHONPATH=.:bench python bench/two_collators.py [--batches N] [--cache cold|resident]``

The samples are not in the CPU cache (``--cache cold``, the default: the transport
suite's pool of at least 4 x the last-level cache); the journal's runs of
2026-11-26 before 14:00 UTC used the 4 cache-resident samples (``--cache resident``).

Each process builds batches of the suite's ``large`` dataset (256 x (224, 224, 3)
uint8 images and their labels) into 4 rotating, pre-faulted output buffers, as a
loader's workers write rotating slots, with ordinary stores (``np.concatenate``) or
with streaming stores (``mploader._columns.copy_rows``).  Printed: batches/s of one
process alone and of two at once (their sum).  The transport suite's collate-limit
row writes one buffer again and again (partly from the cache) and its "2-core limit"
is twice that one process; this script shows what two cores really reach together
(docs/bench-log.md, issue 13).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from mploader import _columns
from mploader_bench.transport import _Batches, make_dataset


def _collate(queue: mp.Queue, stream: bool, seed: int, n: int, cache: str) -> None:
    ds = make_dataset("large", cache)
    batches = _Batches(len(ds), 256, seed).take(n + 20)
    shape = np.asarray(ds[0][0]).shape
    images = [np.ones((256,) + shape, np.uint8) for _ in range(4)]   # written once: faulted in
    labels = [np.ones(256, np.int64) for _ in range(4)]

    def one(k: int, indices: list[int]) -> None:
        samples = [ds[i] for i in indices]
        column = [s[0] for s in samples]
        out = images[k % 4]
        if not (stream and _columns.copy_rows(column, out)):
            np.concatenate(column, axis=0, out=out.reshape((-1,) + shape[1:]))
        labels[k % 4][:] = [s[1] for s in samples]

    for k in range(20):
        one(k, batches[k])
    t0 = time.perf_counter()
    for k, indices in enumerate(batches[20:]):
        one(k, indices)
    queue.put(n / (time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=280, help="timed batches per process")
    ap.add_argument("--cache", default="cold", choices=("cold", "resident"),
                    help="samples not in the CPU cache (default) or 4 cache-resident ones")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    for stream in (False, True):
        for procs in (1, 2):
            queue = ctx.Queue()
            workers = [ctx.Process(target=_collate, args=(queue, stream, seed, args.batches,
                                                                args.cache))
                       for seed in range(procs)]
            for w in workers:
                w.start()
            rates = [queue.get() for _ in workers]
            for w in workers:
                w.join()
            stores = "streaming" if stream else "ordinary"
            print(f"{stores:9s} stores, {procs} process(es): {sum(rates):,.0f} batches/s "
                  f"({', '.join(f'{r:,.0f}' for r in rates)})")


if __name__ == "__main__":
    main()
