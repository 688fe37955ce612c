"""The staged epoch boundary in CPU counters: cycles, instructions and cache misses
per window, against a steady ``next()`` (issue 27).

Usage (repository root, extensions built; Linux ``perf`` with hardware counters)::

    PYTHONPATH=. python bench/epoch_boundary_counters.py [--epochs N]

Wall-time A/Bs of a change to the epoch's start drown in this machine's noise (the
same tree's boundary moves by 30 % from one run to the next).  Counted instructions
and cache misses barely move, so they show what a change does to the boundary's work.
The setting of ``bench/epoch_boundary_footprint.py sleep``: the Gluon face, ``seed=0``,
2 workers, epochs of 16 cheap batches, 2 ms slept between batches and 20 ms before
each epoch's ``iter()``.  ``perf stat`` counts only the parent, and only inside the
windows the child opens through perf's control pipe (``--control``): ``boundary``,
around ``iter()`` + the first ``next()`` of each epoch; ``steady``, around one
``next()`` mid-epoch (the 8th call after the first batch); ``empty``, around nothing: the cost of opening
and closing a window, subtracted from the other two.  Printed per window: user-space
cycles, instructions and cache misses, kernel cycles, and the user-space IPC.  A
child of another tree: ``PYTHONPATH=TREE``.  Results: docs/bench-log.md, "Twentieth
session" and "Twenty-first session" (an A/B of two trees, alternating).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

EVENTS = ["cycles:u", "instructions:u", "cache-misses:u", "cycles:k"]
MODES = ["empty", "boundary", "steady"]


def child(mode: str, epochs: int, ctl_path: str, ack_path: str) -> None:
    """Run the loop, opening a counting window where ``mode`` says."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from epoch_boundary_footprint import Rows

    import mploader

    ctl = os.open(ctl_path, os.O_WRONLY)
    ack = os.open(ack_path, os.O_RDONLY)

    def window(on: bool) -> None:
        os.write(ctl, b"enable\n" if on else b"disable\n")
        os.read(ack, 5)   # perf's "ack\n": counting has started or stopped

    loader = mploader.DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=2, seed=0)
    try:
        it = iter(loader)
        for _ in range(epochs):
            k = 0
            while True:
                time.sleep(0.002)
                k += 1
                mid = k == 8
                if mid and mode == "empty":
                    window(True)
                    window(False)
                if mid and mode == "steady":
                    window(True)
                batch = next(it, None)
                if mid and mode == "steady":
                    window(False)
                if batch is None:
                    break
                del batch
            time.sleep(0.02)
            if mode == "boundary":
                window(True)
            it = iter(loader)
            next(it)
            if mode == "boundary":
                window(False)
    finally:
        loader.close()


def count(mode: str, epochs: int) -> dict[str, float]:
    """``perf stat``'s counts for one child in ``mode``, per window."""
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack = os.path.join(tmp, "ctl"), os.path.join(tmp, "ack")
        os.mkfifo(ctl)
        os.mkfifo(ack)
        cmd = ["perf", "stat", "-x", ",", "-D", "-1", "--control", f"fifo:{ctl},{ack}", "--no-inherit",
               "-e", ",".join(EVENTS), sys.executable, os.path.abspath(__file__), "--epochs", str(epochs),
               "--child", mode, ctl, ack]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"perf stat failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in EVENTS:
            if not fields[0].strip().isdigit():
                raise RuntimeError(f"{fields[2]} was not counted here: {line}")
            out[fields[2]] = int(fields[0]) / epochs
    missing = [e for e in EVENTS if e not in out]
    if missing:
        raise RuntimeError(f"perf stat did not report {missing}: {proc.stderr[-2000:]}")
    return out


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--child", nargs=3, metavar=("MODE", "CTL", "ACK"))
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.child:
        child(args.child[0], args.epochs, args.child[1], args.child[2])
        return
    counts = {mode: count(mode, args.epochs) for mode in MODES}
    print(f"per window, the empty window's counts subtracted ({args.epochs} windows each):")
    print(f"{'window':10s} {'cycles:u':>12s} {'instructions:u':>15s} {'cache-misses:u':>15s} "
          f"{'cycles:k':>10s} {'IPC':>5s}")
    for mode in MODES[1:]:
        c = {e: counts[mode][e] - counts["empty"][e] for e in EVENTS}
        ipc = c["instructions:u"] / c["cycles:u"] if c["cycles:u"] > 0 else float("nan")
        print(f"{mode:10s} {c['cycles:u']:12,.0f} {c['instructions:u']:15,.0f} {c['cache-misses:u']:15,.0f} "
              f"{c['cycles:k']:10,.0f} {ipc:5.2f}")


if __name__ == "__main__":
    main()
