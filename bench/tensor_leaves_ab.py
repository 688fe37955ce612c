"""A/B of the torch face's streaming copy of large tensor columns (issue 24).

Usage: ``PYTHONPATH=.:bench python bench/tensor_leaves_ab.py [--batches N] [--rounds R]``

``mploader.torch.DataLoader`` over the transport suite's cold ``large`` pool in torch
style (samples of tensors, :class:`mploader_bench.peers_torch.TensorSamples`), 2
workers.  ``B`` is the library as it is: a column of at least
``mploader._columns.STREAM_MIN_BYTES`` whose leaves are all exact CPU tensors of the
first leaf's shape and dtype is copied by ``_columns.copy_rows`` over the leaves'
``Tensor.numpy()`` views -- streaming stores -- in the generic path and in a batch
plan's column (``mploader._torch_collate._stream_rows``).  ``A`` is the former path:
``_stream_rows`` patched to decline (before the workers fork; the library's files
are not changed), so every tensor column goes through ``torch.stack(leaves, 0,
out=slot tensor)`` (ordinary stores).  A and B alternate; every batch is checked
against the dataset (:mod:`mploader_bench.checks`).  Printed per run: batches/s and
the workers' CPU per batch.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from mploader_bench.synthetic import make_dataset


def _run(ds: Any, batches: list, streaming: bool) -> tuple[float, float]:
    import psutil
    import torch

    import mploader.torch
    from mploader import _torch_collate
    from mploader_bench.peers import _SwappableBatches
    from mploader_bench.peers_torch import TensorSamples

    original = _torch_collate._stream_rows
    if not streaming:
        _torch_collate._stream_rows = lambda *args: False  # type: ignore[assignment]
    try:
        sampler = _SwappableBatches(batches[:8])
        loader = mploader.torch.DataLoader(TensorSamples(ds), batch_sampler=sampler, num_workers=2,
                                           persistent_workers=True, multiprocessing_context="fork")
        with loader:
            for _ in loader:  # warm-up: forks, slots faulted in
                pass
            sampler.batches = batches
            for _ in loader:
                pass
            kids = psutil.Process().children(recursive=True)
            c0 = sum(sum(k.cpu_times()[:2]) for k in kids)
            t0 = time.perf_counter()
            want = ds.check.expected(batches)
            for k, (images, labels) in enumerate(loader):
                assert isinstance(images, torch.Tensor)
                ds.check.check("mploader.torch", k, (images.numpy(), labels.numpy()), want[k])
            wall = time.perf_counter() - t0
            cpu = sum(sum(k.cpu_times()[:2]) for k in kids) - c0
    finally:
        _torch_collate._stream_rows = original  # type: ignore[assignment]
    return len(batches) / wall, cpu / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ds = make_dataset("large", "cold")
    rng = np.random.default_rng(0)
    batches = rng.integers(0, len(ds), size=(a.batches, 256)).tolist()
    for r in range(a.rounds):
        for streaming in (False, True):
            bps, cpu = _run(ds, batches, streaming)
            print(f"round {r + 1} {'B streaming copy_rows' if streaming else 'A torch.stack        '}: "
                  f"{bps:7.1f} batches/s, workers {cpu * 1e3:6.2f} ms CPU per batch", flush=True)


if __name__ == "__main__":
    main()
