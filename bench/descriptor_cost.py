"""Per-batch cost of the batch descriptor: µs to encode (worker) and to decode (parent).

Usage: ``python bench/descriptor_cost.py [--n N] [--baseline REV]``

One process, one region, no waiting: for each of N batches a slot is assigned,
a :class:`mploader._descriptor.SlotWriter` allocates the batch's arrays in it
(``images`` (32, 3, 8, 8) uint8 and ``labels`` (32,) int64, as the default
batchify returns them: a list), ``finish`` encodes the descriptor and publishes,
the parent takes the slot and ``decode`` rebuilds the batch, which is then
dropped (the slot is freed).  Reported: the median over N of

* ``encode``: ``SlotWriter.finish`` (walk, descriptor, publish);
* ``decode``: ``decode(lease, ...)`` (descriptor to zero-copy views).

``--baseline REV`` also times ``mploader/_descriptor.py`` as it was at git
revision REV (e.g. the pickle descriptor of ``a933407``), interleaved with the
current one in the same run, so the two are compared on the same machine state.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a source checkout without installing

import numpy as np  # noqa: E402 - after the sys.path line above

import mploader._descriptor as current  # noqa: E402
from mploader import _ring  # noqa: E402


def load_revision(rev: str) -> types.ModuleType:
    """``mploader/_descriptor.py`` at git revision ``rev`` as a module of the package."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:mploader/_descriptor.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType(f"mploader._descriptor_{rev}")
    mod.__package__ = "mploader"
    exec(compile(src, f"{rev}:mploader/_descriptor.py", "exec"), mod.__dict__)  # our own source, from git
    return mod


def run(mod: types.ModuleType, region, n: int, seq0: int) -> tuple[list[float], list[float]]:
    enc, dec = [], []
    clock = time.perf_counter_ns
    u8, i64 = np.dtype(np.uint8), np.dtype(np.int64)
    for k in range(n):
        seq = seq0 + k
        region.assign(0, seq)
        w = mod.SlotWriter(region, 0, seq)
        images = w.alloc((32, 3, 8, 8), u8)
        labels = w.alloc((32,), i64)
        batch = [images, labels]
        t0 = clock()
        w.finish(batch)
        t1 = clock()
        del batch, images, labels, w
        lease = region.wait(0, 0)
        t2 = clock()
        got = mod.decode(lease, lease.desc_off, lease.desc_len)
        t3 = clock()
        assert got[0].shape == (32, 3, 8, 8) and got[1].shape == (32,)
        del got, lease
        enc.append((t1 - t0) / 1e3)
        dec.append((t3 - t2) / 1e3)
    return enc, dec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="batches per implementation and round (default 20000)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--baseline", metavar="REV", help="also time mploader/_descriptor.py at git revision REV")
    args = ap.parse_args()
    impls = {"current": current}
    if args.baseline:
        impls[f"at {args.baseline}"] = load_revision(args.baseline)
    region = _ring.create_region(1, 1 << 16)
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in impls}
    seq = 0
    gc.disable()  # a collection inside a timed call is noise, not descriptor cost
    try:
        for _ in range(args.rounds):
            for name, mod in impls.items():
                run(mod, region, 200, seq)  # warm caches (structure templates, branch predictors)
                seq += 200
                enc, dec = run(mod, region, args.n, seq)
                seq += args.n
                results[name][0].extend(enc)
                results[name][1].extend(dec)
                gc.collect()
    finally:
        gc.enable()
    print(f"descriptor cost, batch [images (32, 3, 8, 8) uint8, labels (32,) int64]; "
          f"median of {args.rounds} x {args.n} batches, µs per batch")
    print(f"{'implementation':<22}{'encode (finish)':>17}{'decode':>10}")
    for name, (enc, dec) in results.items():
        print(f"{name:<22}{statistics.median(enc):>17.2f}{statistics.median(dec):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
