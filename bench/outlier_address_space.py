"""Address space that rare outlier batches use over a long run (issue 26).

Usage: ``python bench/outlier_address_space.py OUTLIERS BIG_MIB [PERIOD] [ROOM_MIB] [--spread F]``

A DataLoader (batch_size 1, 2 workers, the default ring) over ``OUTLIERS * PERIOD``
samples: sample ``i`` is ``BIG_MIB`` MiB when ``i % PERIOD == 0`` (default 10), else 64
bytes; with ``--spread F`` an outlier is between ``(1 - F) * BIG_MIB`` and ``BIG_MIB``
MiB instead (uniform, fixed per index), so later outliers may be larger than earlier
ones in the same slot.  With ``ROOM_MIB``, ``RLIMIT_AS`` is set to the process's ``VmSize`` plus that
much first, so the ring reserves a quarter of it (mploader/_memory.py).  Every batch
is checked; prints the ring's file size (the address space its ranges took,
``Region.file_bytes``) every tenth of the outliers, the reservation, and the
``fallback_pipe`` and ``grown`` counters.  docs/design-log.md ("Growth") quotes it.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a source checkout without installing

import numpy as np  # noqa: E402 - after the sys.path line above

import mploader  # noqa: E402
from mploader import _memory  # noqa: E402

MiB = 1 << 20


class Sizes:
    """Sample ``i``: an outlier of ``size(i)`` bytes when ``i % period == 0``, else 64;
    all ``i % 251``."""

    def __init__(self, outliers: int, big: int, period: int, spread: float) -> None:
        self.n, self.big, self.period, self.spread = outliers * period, big, period, spread

    def size(self, i: int) -> int:
        if i % self.period:
            return 64
        u = np.random.default_rng(i).random()   # fixed per index: the parent checks it
        return int(self.big * (1.0 - self.spread * u))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.size(i), i % 251, np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outliers", type=int)
    ap.add_argument("big_mib", type=float)
    ap.add_argument("period", type=int, nargs="?", default=10)
    ap.add_argument("room_mib", type=int, nargs="?", default=None)
    ap.add_argument("--spread", type=float, default=0.0)
    args = ap.parse_args()
    if args.room_mib is not None:
        resource.setrlimit(resource.RLIMIT_AS,
                           (_memory._vm_size_bytes() + args.room_mib * MiB, resource.RLIM_INFINITY))
    big, period = int(args.big_mib * MiB), args.period
    every = period * max(1, args.outliers // 10)
    marks = []
    t0 = time.perf_counter()
    data = Sizes(args.outliers, big, period, args.spread)
    with mploader.DataLoader(data, batch_size=1, num_workers=2) as loader:
        for i, b in enumerate(loader):
            want = data.size(i)
            if b.shape != (1, want) or int(b.min()) != i % 251 or int(b.max()) != i % 251:
                raise SystemExit(f"batch {i} is wrong: shape {b.shape}")
            del b
            if i % every == 0:
                marks.append(loader._engine.region.file_bytes // MiB)
        region = loader._engine.region
        stats = loader.stats()
        print(f"outliers={args.outliers} big={big / MiB:.1f} MiB spread={args.spread} period={period} "
              f"slots={region.nslots} "
              f"reserve={region.reserve_bytes // MiB} MiB; ring file (MiB) every {every // period} outliers: "
              f"{marks}, at the end {region.file_bytes // MiB}; fallback_pipe={stats['fallback_pipe']} "
              f"grown={stats['grown']} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
