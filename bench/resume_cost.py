"""What a checkpoint costs (issue 11): ``state_dict()``, its JSON size, and the time
from ``load_state_dict()`` to the first batch of a resumed epoch.

Run: ``PYTHONPATH=. python bench/resume_cost.py [--samples N] [--batch B] [--repeats R] [--calls C]``

A resumed map-style epoch is rebuilt by iterating the batch sampler from the
epoch's start and skipping the batches already received (indices only: the
dataset is not read), so resuming costs one pass over the sampler's indices up to
the saved position.  Measured on ``mploader.DataLoader(shuffle=True,
num_workers=0)`` over a dataset whose samples cost nothing, saved halfway through
an epoch; the "fresh" line is the first batch of a loader that was not resumed,
for scale.  Medians of ``--repeats`` runs, in milliseconds.

The second part is what torch's per-worker seeding costs per batch
(``mploader.torch.DataLoader`` without ``seed=``): each worker captures its RNG
states after every batch (``mploader._rng_state.capture``) and sends them with it,
about 10 KB, so that a checkpoint can restore them.  Timed in isolation (``--calls``
calls, median of ``--repeats``, in us per call) with the calibrated reads the
library uses and with the public getters (``random.getstate``,
``np.random.get_state``, ``torch.get_rng_state``) it falls back to; then whole
the worker's fetch of a one-int batch with and without the capture; whole epochs of
tiny batches (batch 1 over a dataset whose samples cost nothing, 2 workers) with
the capture on and stubbed out, the difference per batch (noisy on a shared
machine: workers and the loop share its cores); and
``state_dict()`` + JSON of such a loader mid-epoch.  Loaders with ``seed=`` and
the other faces do not capture.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import mploader
from mploader import _rng_state


class Cheap:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.int64:
        return np.int64(i)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=20_000, help="calls per timing of the RNG capture")
    args = p.parse_args()
    ds = Cheap(args.samples)
    half = args.samples // args.batch // 2
    saved = mploader.DataLoader(ds, batch_size=args.batch, shuffle=True, seed=0)
    it = iter(saved)
    for _ in range(half):
        next(it)
    save_ms, load_ms, fresh_ms = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state = saved.state_dict()
        text = json.dumps(state)
        save_ms.append((time.perf_counter() - t0) * 1e3)
        loader = mploader.DataLoader(ds, batch_size=args.batch, shuffle=True, seed=0)
        t0 = time.perf_counter()
        loader.load_state_dict(json.loads(text))
        next(iter(loader))
        load_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        next(iter(mploader.DataLoader(ds, batch_size=args.batch, shuffle=True, seed=0)))
        fresh_ms.append((time.perf_counter() - t0) * 1e3)
    print(f"{args.samples:,} samples, batch {args.batch}, saved after {half:,} batches")
    print(f"state_dict + json.dumps   {statistics.median(save_ms):8.2f} ms   ({len(text):,} bytes of JSON)")
    print(f"load + first batch        {statistics.median(load_ms):8.2f} ms   (rebuilds and skips {half:,} batches)")
    print(f"fresh loader, first batch {statistics.median(fresh_ms):8.2f} ms")
    capture_cost(args.calls, args.repeats)


def _per_call_us(fn: object, calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def capture_cost(calls: int, repeats: int) -> None:
    """The torch face's per-batch RNG capture (see the module docstring)."""
    try:
        import torch
    except ImportError:
        print("torch is not installed: no RNG capture to time")
        return
    import mploader.torch as torch_face
    from mploader import _torch_worker
    from mploader.torch import DataLoader

    fast = _per_call_us(_rng_state.capture, calls, repeats)
    calibrated = "yes" if _rng_state.path() == "fast" else f"no: {_rng_state._Layout.reason}"
    with _rng_state.forced_fallback():
        slow = _per_call_us(_rng_state.capture, max(calls // 20, 1), repeats)
    print(f"RNG capture per batch     {fast:8.2f} us   (calibrated reads: {calibrated}; "
          f"{len(_rng_state.capture()):,} bytes)")
    print(f"  with the public getters {slow:8.2f} us")

    class Tiny(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4_000

        def __getitem__(self, i: int) -> int:
            return i

    def fetch_us(cls: type) -> float:
        fetch = cls(_torch_worker.DEFAULT, torch.utils.data.default_collate, True, False)
        ds = Tiny()
        return _per_call_us(lambda: fetch(ds, [7], np.empty), calls, repeats)

    plain, capturing = fetch_us(_torch_worker.Fetch), fetch_us(_torch_worker.CapturingFetch)
    print(f"worker fetch of a batch   {capturing:8.2f} us with the capture, {plain:.2f} without "
          f"({capturing - plain:+.2f} us; batch of one int, in this process)")

    def epoch_us(capture: bool) -> float:
        # The loader picks CapturingFetch without seed=; stubbing it by Fetch takes the capture out.
        original = torch_face.CapturingFetch
        if not capture:
            torch_face.CapturingFetch = _torch_worker.Fetch  # type: ignore[misc]
        try:
            with DataLoader(Tiny(), batch_size=1, num_workers=2, persistent_workers=True) as loader:
                for _ in loader:   # start the workers, size the slots
                    pass
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    n = sum(1 for _ in loader)
                    times.append((time.perf_counter() - t0) / n * 1e6)
                return min(times)
        finally:
            torch_face.CapturingFetch = original  # type: ignore[misc]

    on, off = [], []
    for _ in range(repeats):   # interleaved: the machine's load drifts
        on.append(epoch_us(True))
        off.append(epoch_us(False))
    diffs = sorted(a - b for a, b in zip(on, off))
    print(f"epoch of tiny batches     {statistics.median(on):8.2f} us/batch with the capture, "
          f"{statistics.median(off):.2f} without (medians of {repeats} interleaved pairs, each the fastest of 3 "
          f"epochs of 4,000 batches); difference per pair {diffs[0]:+.1f} .. {diffs[-1]:+.1f} us, "
          f"median {statistics.median(diffs):+.1f} us")
    with DataLoader(Tiny(), batch_size=1, num_workers=2) as loader:
        it = iter(loader)
        for _ in range(10):
            next(it)
        save = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            text = json.dumps(loader.state_dict())
            save.append((time.perf_counter() - t0) * 1e3)
    print(f"torch face state_dict + json.dumps, 2 workers {statistics.median(save):8.2f} ms "
          f"({len(text):,} bytes of JSON)")


if __name__ == "__main__":
    main()
