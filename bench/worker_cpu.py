"""What one spawn/forkserver worker costs to start, across two source trees, interleaved
(issue 27).

Usage::

    PYTHONPATH=bench python bench/worker_cpu.py BEFORE_TREE AFTER_TREE [--rounds 5]
        [--method spawn] [--workers 8] [--mib 128]

With 2 cores, the workers of a loader start no faster than the cores can run their
start-ups: the first batch of 8 workers waits for about 8 times one worker's CPU time
halved.  This measures that time directly, free of the load's noise: in a fresh
process per tree and round (the tree's ``mploader`` on ``PYTHONPATH``), a second loader
(the zygote already warm) of ``mploader_bench.startup``'s setting (torch face, map-style
dataset of one ``--mib`` MiB array, ``batch_size=32``, persistent workers) is iterated
for ``workers + 1`` batches (each worker has built one batch), and each worker's CPU
time (``/proc/PID/schedstat``: time on a CPU, ns) and minor page faults
(``/proc/PID/stat``: copy-on-write copies of the zygote's pages among them) are read.
Printed: the median (min-max) over all workers of all rounds, for each tree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from mploader_bench.startup import spread  # (bench/ is this script's sys.path[0])

CHILD = r'''
import json, sys, warnings
warnings.simplefilter("ignore")
import torch  # noqa: F401 - the setting is a torch user's process
import mploader.torch
from mploader_bench.startup import ArrayDataset

method, workers, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dataset = ArrayDataset(mib)
out = []
for k in range(2):   # the first loader starts the zygote; the second is measured
    loader = mploader.torch.DataLoader(dataset, batch_size=32, num_workers=workers, multiprocessing_context=method,
                                       persistent_workers=True)
    it = iter(loader)
    for _ in range(workers + 1):
        next(it)
    if k:
        for pid in loader._mpl_engine.worker_pids():
            with open(f"/proc/{pid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/stat") as f:
                minflt = int(f.read().rsplit(")", 1)[1].split()[7])
            out.append({"cpu_ms": ns / 1e6, "minflt": minflt})
    del it
    loader.close()
print(json.dumps(out))
'''


def run(tree: Path, method: str, workers: int, mib: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'bench'}")
    proc = subprocess.run([sys.executable, "-c", CHILD, method, str(workers), str(mib)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {proc.stderr[-2000:]}")
    result: list[dict] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _spread(xs: list[float], fmt: str) -> str:
    return spread(xs, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--method", default="spawn")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--mib", type=int, default=128)
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    got: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            got[name] += run(trees[name], args.method, args.workers, args.mib)
    print(f"{args.method}, {args.workers} workers, {args.rounds} rounds: each worker's start to its first batch")
    print("| tree | CPU (ms) | minor faults |")
    print("|---|---:|---:|")
    for name, xs in got.items():
        print(f"| {name} | {_spread([x['cpu_ms'] for x in xs], '.2f')} | {_spread([x['minflt'] for x in xs], '.0f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
