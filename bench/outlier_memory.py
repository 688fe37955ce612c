"""Shared memory after an outlier batch: the slot-sizing policy, before and after.

Usage: ``python bench/outlier_memory.py [--baseline REV] [--workers N ...]``

A DataLoader over batches of 4 samples, every batch 16 KiB except batch 8, which is
32 MiB; after each batch (dropped at once) the region's memfd is asked how many
bytes it holds (``st_blocks``: holes excluded).  ``--baseline REV`` runs the same
loader with ``mploader/_descriptor.py`` as it was at git revision REV (e.g.
``a933407``, the high-water-mark sizing) in the workers and the parent.  Prints KiB
after each batch; docs/design-log.md ("Slot sizing") quotes it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a source checkout without installing

import numpy as np  # noqa: E402 - after the sys.path line above

import mploader  # noqa: E402
import mploader._scheduler  # noqa: E402
import mploader._worker  # noqa: E402


class Sizes:
    """Batch ``k`` of 4 samples is 32 MiB when ``k == 8``, else 16 KiB."""

    def __init__(self, n_batches: int) -> None:
        self.n = 4 * n_batches

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((8 << 20) if i // 4 == 8 else 4096, i % 251, np.uint8)


def use_revision(rev: str) -> None:
    """Make the workers and the parent use ``mploader/_descriptor.py`` at ``rev``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:mploader/_descriptor.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType(f"mploader._descriptor_{rev}")
    mod.__package__ = "mploader"
    exec(compile(src, f"{rev}:mploader/_descriptor.py", "exec"), mod.__dict__)  # our own source, from git
    mploader._worker.SlotWriter = mod.SlotWriter  # type: ignore[attr-defined]
    mploader._scheduler.decode = mod.decode  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="use mploader/_descriptor.py at git revision REV")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    ap.add_argument("--batches", type=int, default=40, help="batches (default 40; the outlier is batch 8)")
    args = ap.parse_args()
    if args.baseline:
        use_revision(args.baseline)
    for nw in args.workers:
        with mploader.DataLoader(Sizes(args.batches), batch_size=4, num_workers=nw, seed=0) as dl:
            kib = []
            for batch in dl:
                del batch
                kib.append(os.fstat(dl._engine.region.fd).st_blocks * 512 >> 10)
            slots = dl.stats()["num_slots"]
        print(f"{args.baseline or 'current'}: {nw} worker(s), {slots} slots; KiB held after each batch: {kib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
