"""A/B of one candidate change to the torch face (issue 24): large tensor leaves copied
into the slot with streaming stores instead of ``torch.stack``.

Usage: ``PYTHONPATH=.:bench python bench/tensor_leaves_ab.py [--batches N] [--rounds R]``

``mploader.torch.DataLoader`` over the transport suite's cold ``large`` pool in torch
style (samples of tensors, :class:`mploader_bench.peers_torch.TensorSamples`), 2
workers.  ``A`` is the library as it is: the batch plan fills a tensor column with
``torch.stack(leaves, 0, out=slot tensor)`` (ordinary stores).  ``B`` patches the
worker's ``plan_tensor_column`` (before the workers fork; the library's files are not
changed) so that a column of at least ``mploader._columns.STREAM_MIN_BYTES`` whose leaves
are all exact CPU tensors of the plan's shape and dtype goes through
``_columns.copy_rows([t.numpy() for t in leaves], dest)`` -- the streaming copy the
numpy path uses -- and falls back to ``torch.stack`` otherwise (``t.numpy()`` raises
for a tensor that requires grad, has its conj/neg bit set or is not on the CPU;
``copy_rows`` declines another dtype or a non-contiguous leaf).  A and B alternate; every batch is checked
against the dataset (:mod:`mploader_bench.checks`).  Printed per run: batches/s and the
workers' CPU per batch.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from mploader_bench.synthetic import make_dataset


def _patched_plan(original: Any) -> Any:
    import torch

    from mploader import _columns

    stream_min = _columns.STREAM_MIN_BYTES
    exact = torch.Tensor

    def plan_tensor_column(leaf: Any, out: np.ndarray, batch_size: int) -> Any:
        fill = original(leaf, out, batch_size)
        if fill is None or out.nbytes < stream_min or out.dtype.names is not None:
            return fill
        shape = leaf.shape

        def streaming_fill(leaves: list, dest: np.ndarray) -> bool:
            if all(type(t) is exact and t.shape == shape for t in leaves):
                try:
                    arrays = [t.numpy() for t in leaves]  # RuntimeError: grad, conj, neg; TypeError: device
                except (RuntimeError, TypeError):
                    arrays = None
                if arrays is not None and _columns.copy_rows(arrays, dest):
                    return True
            return fill(leaves, dest)
        return streaming_fill
    return plan_tensor_column


def _run(ds: Any, batches: list, patched: bool) -> tuple[float, float]:
    import psutil
    import torch

    import mploader.torch
    from mploader import _torch_worker
    from mploader_bench.peers import _SwappableBatches
    from mploader_bench.peers_torch import TensorSamples

    original = _torch_worker.plan_tensor_column
    if patched:
        _torch_worker.plan_tensor_column = _patched_plan(original)
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
        _torch_worker.plan_tensor_column = original
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
        for patched in (False, True):
            bps, cpu = _run(ds, batches, patched)
            print(f"round {r + 1} {'B streaming copy_rows' if patched else 'A torch.stack        '}: "
                  f"{bps:7.1f} batches/s, workers {cpu * 1e3:6.2f} ms CPU per batch", flush=True)


if __name__ == "__main__":
    main()
