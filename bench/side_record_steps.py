"""One worker's per-batch steps and the parent's decode, in process, for two source trees
(issue 21 s3: the torch face's RNG states as a side record instead of the descriptor's
last bytes).

Usage (run from a tree's root, that tree first on ``PYTHONPATH``; alternate the trees)::

    PYTHONPATH=. python bench/side_record_steps.py

Runs ``tests/test_plan.py``'s ``OneSlot.load`` (what the worker loop runs for one task:
writer, load, plan or collate, publish, learn; then the parent's lease and decode) on
tiny batches (8 samples of a float32[4] and an int): the torch face with torch's
seeding (``CapturingFetch``: the states sent once per run) and the Gluon face.  Prints
the process CPU time per batch in µs (CPU time: the machine is shared).
"""
from __future__ import annotations

import sys
import time

import numpy as np

sys.path.insert(0, "tests")
from test_plan import OneSlot

from mploader import _torch_worker
from mploader import _worker as mpl_worker
from mploader.dataloader import BatchifyFetch

N = 20000


def per_batch_us(fetch: object) -> float:
    samples = [(np.full(4, i, np.float32), i) for i in range(8)]
    slot = OneSlot(fetch=fetch)
    try:
        for _ in range(200):   # the plan is learnt, the caches warm
            slot.load(samples)
        t = time.process_time()
        for _ in range(N):
            slot.load(samples)
        return (time.process_time() - t) / N * 1e6
    finally:
        slot.close()


def main() -> None:
    import torch
    mpl_worker.task_epoch = 0   # as in a worker's run
    torch_face = _torch_worker.CapturingFetch(_torch_worker.DEFAULT, torch.utils.data.default_collate, True, False)
    print(f"torch {per_batch_us(torch_face):.2f} us  gluon {per_batch_us(BatchifyFetch(None)):.2f} us")


if __name__ == "__main__":
    main()
