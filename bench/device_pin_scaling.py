"""On a machine with a CUDA GPU and many cores: pin_memory and scaling with workers,
``mploader.torch.DataLoader`` against ``torch.utils.data.DataLoader``, interleaved.

Usage (repository root, extensions built): ``PYTHONPATH=.:bench python bench/device_pin_scaling.py``

1. pin_memory: batches of 64 x 3x224x224 uint8 (9.6 MB), 4 workers, fork; each batch
   moved with ``.cuda(non_blocking=True)``; ``is_pinned()`` checked on the first batch,
   every 10th batch's indices and bytes (on the GPU, copied back) compared with the
   dataset; 80 batches per run, 3 runs per loader and pin_memory setting.
2. scaling: CPU-bound samples (a sort of 20,000 floats and a 150 KB image each), batch
   32, pin_memory=True, 1/4/8/14 workers, 2 runs each.

Prints batches/s medians with min-max.  Results: docs/bench-log.md.
"""
import statistics
import sys
import time

import numpy as np
import torch

import mploader.torch as mt

POOL = torch.randint(0, 255, (256, 3, 224, 224), dtype=torch.uint8)

class DS(torch.utils.data.Dataset):
    def __init__(self, work):
        self.work = work
    def __len__(self):
        return 1 << 20
    def __getitem__(self, i):
        if self.work:
            np.sort(np.random.default_rng(i).random(self.work))
        return POOL[i % 256].clone(), i

def run(cls, pin, workers, work, bs, n):
    dl = cls(DS(work), batch_size=bs, num_workers=workers, pin_memory=pin,
             persistent_workers=True, multiprocessing_context="fork", prefetch_factor=2)
    it = iter(dl)
    x, y = next(it)
    assert bool(x.is_pinned()) == pin, (cls, x.is_pinned())
    torch.cuda.synchronize()
    t = time.perf_counter()
    seen = 0
    for k in range(n):
        x, y = next(it)
        g = x.cuda(non_blocking=True)
        if k % 10 == 0:
            idx = y.tolist()
            assert idx == list(range((k + 1) * bs, (k + 2) * bs)), (k, idx[:3])
            assert torch.equal(g.cpu(), POOL[torch.tensor(idx) % 256])
        seen += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del it, dl
    return seen / dt

def table(name, cells, order):
    print(f"## {name}")
    for key in order:
        m = cells[key]
        print(f"{key}: median {statistics.median(m):.1f} batches/s (min {min(m):.1f} max {max(m):.1f}) n={len(m)}")

cells = {}
# 1. pin_memory on GPU: large batches (64 x 150,528 B = 9.6 MB), 4 workers, no per-sample work
for _r in range(3):
    for cls, nm in ((mt.DataLoader, "mploader"), (torch.utils.data.DataLoader, "torch")):
        for pin in (True, False):
            cells.setdefault(("pin", nm, pin), []).append(run(cls, pin, 4, 0, 64, 80))
table("pin_memory: 64x3x224x224 uint8 batches to cuda, 4 workers", cells,
      [k for k in cells if k[0] == "pin"])
sys.stdout.flush()
# 2. scaling with workers: CPU-bound samples (sort of 20k floats), batch 32 small images
for _r in range(2):
    for w in (1, 4, 8, 14):
        for cls, nm in ((mt.DataLoader, "mploader"), (torch.utils.data.DataLoader, "torch")):
            cells.setdefault(("scale", nm, w), []).append(run(cls, True, w, 20000, 32, 60 if w > 1 else 20))
table("scaling: CPU-bound samples, batch 32, pin_memory=True", cells, [k for k in cells if k[0] == "scale"])
