"""Before/after of the transport suite across two source trees, interleaved (issue 21).

Usage::

    PYTHONPATH=bench python bench/ab_trees.py BEFORE_TREE AFTER_TREE [--rounds 5]
        [--sizes tiny,small,large] [--transports mploader,mploader.torch-tensors] [--bench DIR]

Each tree is a checkout with its extensions built in place (``git worktree add`` of the
older commit, then ``setup.py build_ext --inplace``).  A round runs the transport suite
once per tree (``mploader_bench.transport.main`` with ``--repeats 1 --cache cold``, the
tree's own ``mploader`` and ``bench`` on ``PYTHONPATH``), alternating which tree goes
first, so both see the same load (``--bench DIR``: one suite, e.g. the newer tree's
``bench/``, for both trees, so that both measure shares the same way).  Each run also
measures ``copy-limit``; printed per size and transport: the median batches/s of each
tree with min-max, the median of the per-round ratios after/before, and each tree's
median share of that run's ``copy-limit`` (around the row's own blocks where the suite
runs bracketed; it takes the machine's load out of the comparison).  Every run's
batches are checked by the suite itself (a mismatch is an error, printed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COPY_LIMIT = "copy-limit"


def run_tree(tree: Path, sizes: str, transports: str, seconds: float,
             bench: Path | None = None) -> tuple[dict, dict]:
    """One transport-suite run of ``tree`` (with ``bench``'s suite when given, else the
    tree's own): ({(size, transport): batches/s}, {(size, transport): share of copy-limit}).
    The share is over the copy-limit around the row's own blocks where the suite ran
    bracketed (schema 3), else over the run's copy-limit."""
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{bench or tree / 'bench'}")
    with tempfile.TemporaryDirectory() as out:
        entry = "import sys; from mploader_bench.transport import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", entry,
               "--repeats", "1", "--cache", "cold",
               "--sizes", sizes, "--transports", f"{transports},{COPY_LIMIT}", "--seconds", str(seconds),
               "--out", out, "--quiet"]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{tree}: transport suite failed:\n{proc.stderr[-3000:]}")
        report = json.loads(next(Path(out).glob("*.json")).read_text())
    if report.get("errors") or report.get("mismatches"):
        print(f"  {tree}: errors {report.get('errors')} mismatches {report.get('mismatches')}")
    rates = {(r["size"], r["transport"]): r["batches_per_s"] for r in report["runs"]}
    shares = {(r["size"], r["transport"]): r["batches_per_s"] / (
        r.get("copy_limit_batches_per_s") or rates.get((r["size"], COPY_LIMIT)) or float("nan"))
        for r in report["runs"]}
    return rates, shares


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):9.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="tiny,small,large")
    p.add_argument("--transports", default="mploader,mploader.torch-tensors")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--bench", type=Path, default=None,
                   help="run this bench/ folder's suite for both trees (default: each tree's own; "
                        "an older tree's suite may measure shares another way)")
    a = p.parse_args()
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    shares: dict[str, list[dict]] = {"before": [], "after": []}
    bench = a.bench.resolve() if a.bench else None
    for r in range(a.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in order:
            rates, share = run_tree(trees[name], a.sizes, a.transports, a.seconds, bench)
            runs[name].append(rates)
            shares[name].append(share)
            print(f"round {r + 1}/{a.rounds} {name} done", flush=True)
    keys = sorted({k for rr in runs["after"] for k in rr if k[1] != COPY_LIMIT})
    print(f"\n{'size':6s} {'transport':26s} {'before b/s (min-max)':>28s} {'after b/s (min-max)':>28s}"
          f" {'after/before':>12s} {'share of copy-limit before/after':>34s}")
    for key in keys:
        size, _ = key
        b = [rr[key] for rr in runs["before"]]
        f = [rr[key] for rr in runs["after"]]
        ratio = statistics.median(x / y for x, y in zip(f, b))
        share_b = statistics.median(rr[key] for rr in shares["before"])
        share_f = statistics.median(rr[key] for rr in shares["after"])
        print(f"{size:6s} {key[1]:26s} {_spread(b):>28s} {_spread(f):>28s} {ratio:12.3f}"
              f" {share_b:16.3f} / {share_f:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
