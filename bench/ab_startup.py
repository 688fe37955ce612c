"""Before/after of the start-up suite's first batch across two source trees, interleaved
(issue 27).

Usage::

    PYTHONPATH=bench python bench/ab_startup.py BEFORE_TREE AFTER_TREE [--rounds 3]
        [--methods forkserver,spawn] [--workers 1,8] [--mib 128] [--torch]

Each tree is a checkout with its extensions built in place (``git worktree add`` of the
commit, then ``setup.py build_ext --inplace``).  A round runs, for every method and
worker count, one ``mploader_bench.startup --child mploader ...`` process per tree (the
tree's own ``mploader`` and ``bench`` on ``PYTHONPATH``), alternating which tree goes
first, so both see the same load; with ``--torch``, torch's ``DataLoader`` once per
cell and round (from the after tree).  Printed per cell: the median (min-max) of the
cold first batch (the process's first loader, the zygote's start included), the warm
one (a second loader) and the cold workers' summed USS, for each tree, and the median
of the per-round ratios after/before of the cold time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mploader_bench.startup import spread  # (bench/ is this script's sys.path[0])


def run_child(tree: Path, which: str, method: str, workers: int, mib: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'bench'}")
    cmd = [sys.executable, "-m", "mploader_bench.startup", "--child", which, method, str(workers), str(mib),
           "--setup-s", "0"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {which} {method} {workers}: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _spread(xs: list[float], fmt: str = ".3f") -> str:
    return spread(xs, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default="forkserver,spawn")
    p.add_argument("--workers", default="1,8")
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--torch", action="store_true", help="also torch's DataLoader, once per cell and round")
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    cells: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for r in range(args.rounds):
        for method in args.methods.split(","):
            for n in map(int, args.workers.split(",")):
                order = ["before", "after"] if (r + n) % 2 == 0 else ["after", "before"]
                cell = cells.setdefault((method, n), {"before": [], "after": [], "torch": []})
                for name in order:
                    res = run_child(trees[name], "mploader", method, n, args.mib)
                    cell[name].append(res)
                    print(f"  round {r + 1} {method:10s} {n} workers {name:6s}: cold {res['cold']['first_s']:.3f} s, "
                          f"warm {res['warm']['first_s']:.3f} s, USS {res['cold']['uss_mib']:.0f} MiB", flush=True)
                if args.torch:
                    res = run_child(trees["after"], "torch", method, n, args.mib)
                    cell["torch"].append(res)
                    print(f"  round {r + 1} {method:10s} {n} workers torch : cold {res['cold']['first_s']:.3f} s",
                          flush=True)
    print()
    print("| method | workers | cold before (s) | cold after (s) | after/before | warm before (s) | warm after (s) "
          "| USS before (MiB) | USS after (MiB) | torch (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (method, n), cell in cells.items():
        def cold(name: str, cell: dict = cell) -> list[float]:
            return [x["cold"]["first_s"] for x in cell[name]]

        def warm(name: str, cell: dict = cell) -> list[float]:
            return [x["warm"]["first_s"] for x in cell[name] if x.get("warm")]

        def uss(name: str, cell: dict = cell) -> list[float]:
            return [x["cold"]["uss_mib"] for x in cell[name]]
        ratios = [a / b for a, b in zip(cold("after"), cold("before"))]
        print(f"| {method} | {n} | {_spread(cold('before'))} | {_spread(cold('after'))} | {_spread(ratios, '.2f')} "
              f"| {_spread(warm('before'))} | {_spread(warm('after'))} | {_spread(uss('before'), '.0f')} "
              f"| {_spread(uss('after'), '.0f')} | {_spread(cold('torch'))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
