"""Per-batch cost of the batch descriptor: µs to encode (worker) and to decode (parent).

Usage: ``python bench/descriptor_cost.py [--n N] [--baseline REV]``

One process, one region, no waiting: for each of N batches a slot is assigned,
a :class:`mploader._descriptor.SlotWriter` allocates the batch's arrays in it,
``finish`` encodes the descriptor and publishes, the parent takes the slot and
``decode`` rebuilds the batch, which is then dropped (the slot is freed).  Batch
kinds (``--batches``): ``tiny`` (``images`` (32, 3, 8, 8) uint8 and ``labels``
(32,) int64, as the default batchify returns them: a list), and the fallback
paths: ``strings`` (256 str), ``ragged`` (256 token-id lists), ``objects`` (64
small objects: an in-band pickle), ``object-array`` (256 str in an object array).
Reported: the median over N of

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


class Record:
    """A small arbitrary object (travels as an in-band pickle)."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.name = f"r{i}"


WORDS = [f"word{i} of some sentence number {i}" for i in range(256)]
TOKEN_IDS = [list(range(i % 20 + 5)) for i in range(256)]
RECORDS = [Record(i) for i in range(64)]
OBJECTS = np.array(WORDS, dtype=object)

#: name -> (description, batch built with ``alloc``, default batches per round)
BATCHES: dict[str, tuple[str, Callable[[Callable], Any], int]] = {
    "tiny": ("[images (32, 3, 8, 8) uint8, labels (32,) int64]",
             lambda alloc: [alloc((32, 3, 8, 8), np.uint8), alloc((32,), np.int64)], 20000),
    "strings": ("[256 str, labels (256,) int64]", lambda alloc: [WORDS, alloc((256,), np.int64)], 2000),
    "ragged": ("[256 lists of 5-24 int token ids, labels (256,) int64]",
               lambda alloc: [TOKEN_IDS, alloc((256,), np.int64)], 1000),
    "objects": ("[64 small objects]", lambda alloc: [RECORDS], 1000),
    "object-array": ("[object array of 256 str]", lambda alloc: [OBJECTS], 2000),
}


def run(mod: types.ModuleType, region: Any, build: Callable[[Callable], Any], n: int,
        seq0: int) -> tuple[list[float], list[float]]:
    enc, dec = [], []
    clock = time.perf_counter_ns
    for k in range(n):
        seq = seq0 + k
        region.assign(0, seq)
        w = mod.SlotWriter(region, 0, seq)
        batch = build(w.alloc)
        t0 = clock()
        w.finish(batch)
        t1 = clock()
        del batch, w
        lease = region.wait(0, 0)
        t2 = clock()
        got = mod.decode(lease, lease.desc_off, lease.desc_len)
        t3 = clock()
        del got, lease
        enc.append((t1 - t0) / 1e3)
        dec.append((t3 - t2) / 1e3)
    return enc, dec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(BATCHES),
                    help=f"comma-separated, of {', '.join(BATCHES)} (default: all)")
    ap.add_argument("--n", type=int, help="batches per implementation and round (default: per batch kind, "
                    + ", ".join(f"{k} {v[2]}" for k, v in BATCHES.items()) + ")")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--baseline", metavar="REV", help="also time mploader/_descriptor.py at git revision REV")
    args = ap.parse_args()
    kinds = args.batches.split(",")
    for kind in kinds:
        if kind not in BATCHES:
            ap.error(f"--batches: unknown batch kind {kind!r}; expected some of {', '.join(BATCHES)}")
    impls = {"current": current}
    if args.baseline:
        impls[f"at {args.baseline}"] = load_revision(args.baseline)
    region = _ring.create_region(1, 1 << 20)
    print(f"descriptor cost, µs per batch, median of {args.rounds} interleaved rounds")
    print(f"{'batch':<14}{'implementation':<22}{'encode (finish)':>17}{'decode':>10}")
    seq = 0
    for kind in kinds:
        desc, build, default_n = BATCHES[kind]
        n = args.n or default_n
        results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in impls}
        gc.disable()  # a collection inside a timed call is noise, not descriptor cost
        try:
            for _ in range(args.rounds):
                for name, mod in impls.items():
                    run(mod, region, build, 50, seq)  # warm the caches (structure templates)
                    seq += 50
                    enc, dec = run(mod, region, build, n, seq)
                    seq += n
                    results[name][0].extend(enc)
                    results[name][1].extend(dec)
                    gc.collect()
        finally:
            gc.enable()
        for name, (enc, dec) in results.items():
            print(f"{kind:<14}{name:<22}{statistics.median(enc):>17.2f}{statistics.median(dec):>10.2f}")
        print(f"{'':<14}({desc}, {n} batches a round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
