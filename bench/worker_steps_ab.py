"""The worker loop's per-batch steps in one process, for an A/B of two trees (issue 21 s2).

Usage: ``python bench/worker_steps_ab.py TREE_A TREE_B [--rounds R] [--batches N]``

Each round runs, for each tree in turn (a fresh interpreter with the tree first on
``sys.path``), what a worker does for a task of the transport suite's ``tiny`` and
``small`` structures -- ``tiny``: 32 samples ``(np.int64, float32 (16,))``; ``small``:
256 samples ``(uint8 (32, 32, 3), np.int64)`` -- through the Gluon face's fetch
(``mploader.dataloader.BatchifyFetch(None)``, batch plans on) into a one-slot region:
assign the slot, make the writer, load + plan or collate + publish + learn, then the
parent's wait and release of the slot.  A tree with ``mploader._worker.Batches``
runs it (the loop's own steps since issue 21 s2); an older tree runs the loop's former
calls (``fetch.planned`` with the face's planner, ``keep_descriptor``, ``finish``,
``learn``).  Printed: the best of 5 timings of N batches (the thread's CPU time, which a
busy machine inflates less than the wall clock), in microseconds per batch,
per tree and structure; the rounds alternate A and B, so a busy machine slows both.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import numpy as np
from mploader import _ring
from mploader import _descriptor as D
from mploader import _worker
from mploader.dataloader import BatchifyFetch

n_batches = int(sys.argv[1])
rng = np.random.default_rng(0)
pools = {
    "tiny": (32, [(np.int64(i), rng.random(16, dtype=np.float32)) for i in range(4096)]),
    "small": (256, [(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8), np.int64(i)) for i in range(4096)]),
}
out = {}
for name, (bs, pool) in pools.items():
    region = _ring.create_region(1, 1 << 20)
    fetch = BatchifyFetch(None)
    new = hasattr(_worker, "Batches")
    if new:
        batches = _worker.Batches(fetch)
    else:
        planner = fetch.make_planner()
    tasks = [list(range(k * bs % (4096 - bs), k * bs % (4096 - bs) + bs)) for k in range(n_batches)]
    seq = 0

    def one(indices):
        global seq
        seq += 1
        region.assign(0, seq)
        if new:
            writer = D.SlotWriter(region, 0, seq, batches.structures)  # as _worker._loop
            batch, published = batches.make(pool, indices, writer)
            if not published:
                batches.deliver(None, writer, seq, _ring.KIND_SLOT, batch)
                batches.learn(writer)
        else:
            writer = D.SlotWriter(region, 0, seq)
            batch = fetch.planned(pool, indices, writer, planner)
            if batch is not _worker.PUBLISHED:
                writer.keep_descriptor = planner.pending is not None
                writer.finish(batch)
                planner.learn(writer)
        del batch, writer
        lease = region.wait(0, 0)
        del lease

    for t in tasks[:50]:
        one(t)
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for t in tasks:
            one(t)
        best = min(best, (time.thread_time() - t0) / len(tasks))
    out[name] = best * 1e6
    region.close()
print(json.dumps(out))
"""


def _run(tree: str, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    res = subprocess.run([sys.executable, "-c", _CHILD, str(n)], env=env, cwd="/", capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree_a")
    ap.add_argument("tree_b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=2000)
    a = ap.parse_args()
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(a.rounds):
        for label, tree in (("A", a.tree_a), ("B", a.tree_b)):
            got = _run(tree, a.batches)
            results[label].append(got)
            print(f"round {r + 1} {label}: " + ", ".join(f"{k} {v:6.2f} us/batch" for k, v in got.items()),
                  flush=True)
    for k in results["A"][0]:
        ma = sorted(x[k] for x in results["A"])[len(results["A"]) // 2]
        mb = sorted(x[k] for x in results["B"])[len(results["B"]) // 2]
        print(f"{k}: median A {ma:.2f}, B {mb:.2f} us/batch, B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
