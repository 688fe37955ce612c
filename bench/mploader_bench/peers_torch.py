"""The torch transports: torch's DataLoader and mploader.torch, over numpy-style and
tensor-style samples (split from :mod:`.peers` to keep modules under ~600 lines)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .peers import Transport, _MPLoader, _SwappableBatches, _torch_to_numpy


class _Torch(Transport):
    name = "torch"
    requires = ("torch.utils.data",)
    tensor_samples = False

    def __init__(self, dataset: Any, **kw: Any) -> None:
        super().__init__(dataset, **kw)
        import torch.utils.data

        if self.tensor_samples:
            dataset = TensorSamples(dataset)

        self._sampler = _SwappableBatches()
        if self.workers > 0:
            factor = max(1, self.prefetch // self.workers) if self.prefetch else 2
            extra = dict(persistent_workers=True, prefetch_factor=factor,
                         multiprocessing_context="fork")
        else:
            extra = {}
        self._loader: Any = torch.utils.data.DataLoader(  # None once closed
            dataset, batch_sampler=self._sampler, num_workers=self.workers, **extra)

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:
        self._sampler.batches = batches
        for batch in self._loader:
            out = _torch_to_numpy(batch)
            del batch
            yield out
            del out

    def _close(self) -> None:
        loader, self._loader = getattr(self, "_loader", None), None
        if loader is None:
            return
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        loader._iterator = None


class TensorSamples:
    """A numpy dataset in torch style: every array of a sample becomes a tensor
    (``torch.from_numpy``: zero-copy; a copy for read-only arrays, which torch
    cannot wrap).  What a PyTorch user's ``Dataset.__getitem__`` typically returns.

    Parameters
    ----------
    dataset : map-style dataset
        Samples that are arrays, numbers, or tuples of those.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return _to_tensors(self.dataset[i])


def _to_tensors(sample: Any) -> Any:
    import torch

    if isinstance(sample, tuple):
        return tuple(_to_tensors(s) for s in sample)
    if isinstance(sample, np.ndarray):
        return torch.from_numpy(sample if sample.flags.writeable else sample.copy())
    return sample


class _MPLTorch(_MPLoader):
    """``mploader.torch.DataLoader`` (persistent forked workers, torch's default
    ``prefetch_factor``), tensors delivered; over the numpy dataset, as ``torch``."""

    name = "mploader.torch"
    requires = ("torch.utils.data", "mploader.torch")
    tensor_samples = False

    #: Pass the suite's seed as ``seed=`` (per-batch seeding; tasks to the least-loaded worker).
    per_batch_seed = False

    def __init__(self, dataset: Any, **kw: Any) -> None:
        Transport.__init__(self, dataset, **kw)  # not _MPLoader's: it builds the Gluon loader
        import mploader.torch

        self._sampler = _SwappableBatches()
        if self.workers > 0:
            # prefetch None: the face's own default (torch's 2 per worker, raised for small batches)
            extra: dict[str, Any] = dict(persistent_workers=True, multiprocessing_context="fork")
            if self.prefetch:
                extra["prefetch_factor"] = max(1, self.prefetch // self.workers)
        else:
            extra = {}
        if self.per_batch_seed:
            extra["seed"] = self.seed
        if self.tensor_samples:
            dataset = TensorSamples(dataset)
        self._loader: Any = mploader.torch.DataLoader(  # None once closed
            dataset, batch_sampler=self._sampler, num_workers=self.workers, **extra)

    _convert = staticmethod(_torch_to_numpy)  # tensors -> zero-copy numpy views of the slot


class _MPLTorchSeed(_MPLTorch):
    """``mploader.torch`` with ``seed=``: a batch is a function of its task alone, so
    each task goes to the least-loaded worker instead of torch's round robin
    (docs/faces.md, "Tasks"); in the transport suite, beside the torch face as torch
    users get it by default (issue 24's target read on both)."""

    name = "mploader.torch-seed"
    suites = ("transport",)
    per_batch_seed = True


class _MPLTorchTensors(_MPLTorch):
    """``mploader.torch`` over the dataset in torch style (samples of tensors); opt-in."""

    name = "mploader.torch-tensors"
    suites = ()
    tensor_samples = True


# --------------------------------------------------------------------------


class _TorchTensors(_Torch):
    """``torch`` over the dataset in torch style (samples of tensors); opt-in."""

    name = "torch-tensors"
    suites = ()
    tensor_samples = True
