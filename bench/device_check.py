"""What only a machine with a CUDA GPU and many cores can show; run by hand there.

Usage: ``python bench/device_check.py [--workers 14] [--out DIR]`` (needs torch with
CUDA; the tests never run it).  Four checks, each printed as one JSON line and
collected in ``DIR/device_check.json``:

``pinned``
    ``pin_memory=True`` really hands out page-locked memory: every batch of
    ``mploader.torch.DataLoader`` is ``is_pinned()`` (tensors viewing the ring, which
    ``mploader._pinning.HostPinner`` registers with ``cudaHostRegister`` as it
    grows), also across a growth of the batch size mid-epoch; the Gluon face's numpy
    batches are pinned too; and the bytes that reach the GPU with
    ``.cuda(non_blocking=True)`` equal torch's own ``DataLoader``'s, batch by batch
    (checksums computed on the GPU).
``refused``
    A registration the driver refuses (an unmapped range) warns, and the next
    kernel launch still works (the runtime's last error was cleared).
``race``
    A batch whose asynchronous copy is queued behind a long GPU kernel (as a
    training step's copy is) and whose host tensor is dropped at once: does the
    ring hand its slot to a worker before the copy has read it?  Counts batches
    whose GPU checksum differs from the expected one.
``h2d``
    images/s of a loop that copies each large batch (256 x 224 x 224 x 3 uint8,
    38.5 MB) to the GPU, mploader.torch against torch's DataLoader, both with
    ``pin_memory=True``, `--workers` workers; medians of 3 epochs, parent CPU.
``scaling``
    run separately: ``mploader bench --suite transport --workers N``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a source checkout without installing

import numpy as np  # noqa: E402 - after the sys.path line above
import torch  # noqa: E402

import mploader  # noqa: E402
import mploader.torch as mpt  # noqa: E402


class Images:
    """Deterministic uint8 images: sample ``i`` is ``(pool[i % 8] + i) % 256`` of
    shape ``side(i)`` x ``side(i)`` x 3, and its label ``i``."""

    def __init__(self, n: int, sides: tuple[int, ...], batch_size: int) -> None:
        self.n, self.sides, self.bs = n, sides, batch_size
        rng = np.random.default_rng(0)
        self.pools = {s: rng.integers(0, 255, (8, s, s, 3), dtype=np.uint8) for s in set(sides)}

    def side(self, i: int) -> int:
        # the second half of the samples takes the last side: the ring grows mid-epoch
        return self.sides[-1] if 2 * i >= self.n else self.sides[0]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        s = self.side(i)
        return self.pools[s][i % 8] + np.uint8(i % 256), i


def _gpu_sum(x: torch.Tensor) -> int:
    return int(x.to(torch.int64).sum().item())


def _in_ring(engine: Any, address: int) -> bool:
    region = engine.region if engine is not None else None
    return region is not None and region.address <= address < region.address + region.file_bytes


def check_pinned(workers: int) -> dict[str, Any]:
    ds = Images(64 * 32, (64, 160), 64)
    sums: dict[str, list[int]] = {}
    pinned: dict[str, list[bool]] = {}
    for name, cls in (("torch", torch.utils.data.DataLoader), ("mploader.torch", mpt.DataLoader)):
        loader = cls(ds, batch_size=64, num_workers=workers, pin_memory=True)
        s, p, ring = [], [], []
        for x, y in loader:
            p.append(bool(x.is_pinned()) and bool(y.is_pinned()))
            ring.append(_in_ring(getattr(loader, "_mpl_engine", None), x.data_ptr()))
            s.append(_gpu_sum(x.cuda(non_blocking=True)) + _gpu_sum(y.cuda(non_blocking=True)))
        if hasattr(loader, "close"):
            loader.close()
        sums[name], pinned[name] = s, p
        if name != "torch":
            in_ring = ring
    with mploader.DataLoader(ds, batch_size=64, num_workers=workers, pin_memory=True) as gl:
        gluon = [bool(torch.from_numpy(x).is_pinned()) for x, _ in gl]
    return dict(check="pinned", batches=len(sums["torch"]), mploader_torch_batches_in_ring=sum(in_ring),
                sums_equal=sums["torch"] == sums["mploader.torch"],
                torch_all_pinned=all(pinned["torch"]), mploader_torch_all_pinned=all(pinned["mploader.torch"]),
                gluon_all_pinned=all(gluon), gluon_batches=len(gluon))


def check_refused_registration() -> dict[str, Any]:
    """A registration the driver refuses must not fail the next kernel launch."""
    import warnings

    from mploader import _pinning

    class Unmapped:  # an address range with nothing mapped: the driver refuses it
        address = 1 << 20
        file_bytes = 1 << 20
        fd = os.memfd_create("device-check")

    os.ftruncate(Unmapped.fd, 1 << 20)
    runtime = _pinning.cuda_runtime(torch.cuda.current_device())
    assert runtime is not None
    pinner = _pinning.HostPinner(*runtime)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = pinner.on_grow(Unmapped) is None
    os.close(Unmapped.fd)
    try:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        after = "ok"
    except Exception as exc:  # noqa: BLE001 - what is being checked
        after = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return dict(check="refused", refused=refused, warned=len(caught), next_kernel_launch=after)


def check_race(workers: int, sleep_cycles: int) -> dict[str, Any]:
    """Copies queued behind a long kernel, host batch dropped at once."""
    bs, side = 64, 128
    ds = Images(bs * 200, (side,), bs)
    want = []
    for b in range(200):
        xs = np.stack([ds[i][0] for i in range(b * bs, (b + 1) * bs)])
        want.append(int(xs.astype(np.int64).sum()))
    out: dict[str, Any] = dict(check="race", batches=200, sleep_cycles=sleep_cycles)
    for name, cls in (("torch", torch.utils.data.DataLoader), ("mploader.torch", mpt.DataLoader)):
        loader = cls(ds, batch_size=bs, num_workers=workers, pin_memory=True)
        gpu = []
        for x, _ in loader:
            torch.cuda._sleep(sleep_cycles)          # a training step still running on the stream
            gpu.append(x.cuda(non_blocking=True))   # queued behind it
            del x                                    # the host batch is dropped at once
        torch.cuda.synchronize()
        got = [_gpu_sum(g) for g in gpu]
        if hasattr(loader, "close"):
            loader.close()
        out[f"{name}_wrong_batches"] = sum(a != b for a, b in zip(got, want))
    with mploader.DataLoader(ds, batch_size=bs, num_workers=workers, pin_memory=True) as gl:
        gpu = []
        for x, _ in gl:   # the Gluon face: numpy batches, wrapped by the user
            torch.cuda._sleep(sleep_cycles)
            gpu.append(torch.from_numpy(x).cuda(non_blocking=True))
            del x
        torch.cuda.synchronize()
        out["gluon_wrong_batches"] = sum(_gpu_sum(g) != b for g, b in zip(gpu, want))
    return out


def check_h2d(workers: int, batches: int, repeats: int) -> dict[str, Any]:
    bs, side = 256, 224
    ds = Images(bs * batches, (side,), bs)
    out: dict[str, Any] = dict(check="h2d", workers=workers, batch_bytes=bs * side * side * 3, batches=batches)
    loaders = {
        "torch": torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=workers, pin_memory=True,
                                             persistent_workers=True),
        "mploader.torch": mpt.DataLoader(ds, batch_size=bs, num_workers=workers, pin_memory=True,
                                         persistent_workers=True),
    }
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    cpu: dict[str, list[float]] = {k: [] for k in loaders}
    for rep in range(repeats + 1):
        for name, loader in loaders.items():
            c0, t0 = time.process_time(), time.perf_counter()
            for x, _ in loader:
                g = x.cuda(non_blocking=True)
                g.float().mean()                     # something that reads the batch on the GPU
                del x
            torch.cuda.synchronize()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rep:  # the first pass starts the workers and grows/pins the ring
                rates[name].append(bs * batches / dt)
                cpu[name].append(dc / batches * 1e3)
    for name, loader in loaders.items():
        if hasattr(loader, "close"):
            loader.close()
        out[f"{name}_images_per_s"] = round(statistics.median(rates[name]))
        out[f"{name}_parent_cpu_ms_per_batch"] = round(statistics.median(cpu[name]), 2)
    out["ratio"] = round(out["mploader.torch_images_per_s"] / out["torch_images_per_s"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=min(14, (os.cpu_count() or 2) - 2))
    ap.add_argument("--batches", type=int, default=40, help="batches per h2d epoch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sleep-cycles", type=int, default=20_000_000, help="GPU cycles each race step waits")
    ap.add_argument("--only", default="pinned,refused,race,h2d")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("device_check: no CUDA device", file=sys.stderr)
        return 2
    results = [dict(check="machine", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                    cpus=len(os.sched_getaffinity(0)), python=sys.version.split()[0])]
    print(json.dumps(results[0]), flush=True)
    only = args.only.split(",")
    for name, fn in (("pinned", lambda: check_pinned(4)),
                     ("refused", check_refused_registration),
                     ("race", lambda: check_race(4, args.sleep_cycles)),
                     ("h2d", lambda: check_h2d(args.workers, args.batches, args.repeats))):
        if name not in only:
            continue
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            r = dict(check=name, error=f"{type(exc).__name__}: {exc}")
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "device_check.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
