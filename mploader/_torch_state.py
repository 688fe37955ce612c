"""Checkpoints of the PyTorch face (issue 11): ``mploader.torch.DataLoader.state_dict()``
/ ``load_state_dict()`` with torchdata 0.11 ``StatefulDataLoader`` semantics.

Map-style datasets use :class:`mploader._state.MapState` (the position is the
epoch and the batches received; any ``num_workers`` on resume).  torch's
``RandomSampler`` draws its order lazily from a generator (its own, or torch's
global one): that generator's state is part of the checkpoint (see
``MapState``'s ``rng``).  IterableDatasets: the position lives in each worker's
replica, so the state records the worker count and the batches received, a loader
with another ``num_workers`` refuses it (as torchdata), and resuming replays the
replicas and drops the batches already received (torchdata's fallback for datasets
without ``state_dict``).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, RandomSampler
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from . import _state
from ._options import check_int

if TYPE_CHECKING:
    from .torch import DataLoader

__all__ = ["Position", "begin", "state_dict", "load_state_dict", "SingleIter", "check_snapshot_every", "next_counted"]


class _GeneratorRNG:
    """A ``torch.Generator``'s state as a list of ints (JSON-safe)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def get(self) -> list:
        return self.generator.get_state().tolist()

    def set(self, state: list) -> None:
        self.generator.set_state(torch.tensor(state, dtype=torch.uint8))


class _GlobalRNG:
    """torch's global CPU generator (what ``RandomSampler(generator=None)`` draws from)."""

    shared = True   # the training loop draws from it too

    def get(self) -> list:
        return torch.random.get_rng_state().tolist()

    def set(self, state: list) -> None:
        torch.random.set_rng_state(torch.tensor(state, dtype=torch.uint8))


def _rng_of(sampler: Any) -> Any:
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        return _GeneratorRNG(generator)
    if isinstance(sampler, RandomSampler):
        return _GlobalRNG()
    return None


class _IterableState:
    """The position of a loader over an IterableDataset (see the module docstring)."""

    def __init__(self) -> None:
        self.progress: _state.MapProgress | None = None
        self.pending: dict | None = None


def _checkpoint(loader: DataLoader) -> Any:
    ckpt = loader.__dict__.get("_mpl_ckpt")
    if ckpt is None:
        if isinstance(loader.dataset, IterableDataset):
            ckpt = _IterableState()
        else:
            ckpt = _state.MapState("torch", loader.dataset, loader._index_sampler, rng=_rng_of(loader.sampler))
        loader.__dict__["_mpl_ckpt"] = ckpt
    return ckpt


class Position:
    """What one iterator reports to the checkpoint: ``pairs`` (``(batch_index,
    indices)`` to load), :meth:`received`, :meth:`finish`; ``skip`` (IterableDataset
    resume: batch indices already received, rebuilt and dropped); ``current`` (the
    batch index of the last pair taken)."""

    __slots__ = ("progress", "pairs", "skip", "current")

    def __init__(self, progress: _state.MapProgress, pairs: Iterator[tuple], skip: frozenset) -> None:
        self.progress = progress
        self.pairs = pairs
        self.skip = skip
        self.current = -1

    def indices(self) -> Iterator[Any]:
        """The indices alone (for torch's single-process iterator), recording ``current``."""
        for i, index in self.pairs:
            self.current = i
            yield index

    def received(self, batch_index: int) -> None:
        self.progress.received(batch_index)

    def finish(self) -> None:
        self.progress.finished = True


def _tasks_to_pairs(tasks: Iterator[tuple]) -> Iterator[tuple]:
    for _, i, index in tasks:
        yield i, index


def begin(loader: DataLoader, epoch: int, sampler_iter: Iterator) -> Position:
    """Start an epoch of ``loader`` whose iterator made ``sampler_iter``."""
    ckpt = _checkpoint(loader)
    if isinstance(ckpt, _IterableState):
        pending, ckpt.pending = ckpt.pending, None
        skip: frozenset = frozenset()
        progress = _state.MapProgress(epoch, 0, set(), None, None, None)
        if pending is not None:
            skip = frozenset(range(pending["batches_consumed"]))
        ckpt.progress = progress
        return Position(progress, enumerate(sampler_iter), skip)
    progress, tasks = ckpt.start_epoch(epoch, sampler_iter)
    return Position(progress, _tasks_to_pairs(tasks), frozenset())


def state_dict(loader: DataLoader) -> dict:
    """``mploader.torch.DataLoader.state_dict`` (see its docstring)."""
    ckpt = _checkpoint(loader)
    seed = loader._mpl_seed
    if isinstance(ckpt, _IterableState):
        if loader.num_workers > 0 and not loader.in_order:
            raise ValueError("an IterableDataset loaded with in_order=False cannot be checkpointed: which worker "
                             "builds which batch depends on timing, so the batches received cannot be rebuilt")
        if ckpt.pending is not None:
            return copy.deepcopy(ckpt.pending)
        progress = ckpt.progress
        if progress is None or progress.finished:
            epoch, consumed = loader._mpl_epoch, 0
        else:
            epoch, consumed = progress.epoch, progress.consumed
        return {"version": _state.VERSION, "kind": "iterable", "face": "torch",
                "dataset_type": _state.type_name(loader.dataset), "num_workers": loader.num_workers,
                "epoch": epoch, "batches_consumed": consumed, "seed": seed}
    return ckpt.state(loader._mpl_epoch, seed, {"num_workers": loader.num_workers})


def load_state_dict(loader: DataLoader, state: Any) -> None:
    """``mploader.torch.DataLoader.load_state_dict`` (see its docstring)."""
    ckpt = _checkpoint(loader)
    if isinstance(ckpt, _IterableState):
        _state.check_state(state, "iterable")
        _state.check_same("dataset_type", state.get("dataset_type"), _state.type_name(loader.dataset))
        if state.get("num_workers") != loader.num_workers:
            raise _state.StateMismatchError(
                f"cannot load the state: it was saved with num_workers={state.get('num_workers')!r}, this loader "
                f"has num_workers={loader.num_workers} (an IterableDataset's position lives in each worker's "
                f"replica, so it resumes only with the same number of workers)")
        for name in ("epoch", "batches_consumed"):
            check_int(name, state.get(name), minimum=0)
        ckpt.pending = copy.deepcopy(dict(state))
        ckpt.progress = None
        loaded = ckpt.pending
    else:
        loaded = ckpt.load(state, seed_none_ok=True)
    loader._mpl_epoch = loaded["epoch"]
    seed = loaded["seed"]
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
    if seed != loader._mpl_seed or isinstance(ckpt, _IterableState):
        loader._mpl_seed = seed
        # The engine was built for the other seeding, or its workers' replicas have
        # moved on: the next iter() makes new ones.
        loader.close()
    iterator = loader.__dict__.get("_iterator")
    if iterator is not None and loader.persistent_workers:
        loader._iterator = None   # persistent workers: the next iter() starts a new pass from the state


def check_snapshot_every(value: Any) -> int | None:
    """torchdata's ``snapshot_every_n_steps``: accepted (a positive int or None) and
    ignored -- the parent knows the position after every batch, so every step is a
    snapshot and the value never changes which batches come out."""
    return check_int("snapshot_every_n_steps", value, minimum=1, none_ok=True)


def next_counted(pos: Position, load: Any) -> Any:
    """``load()`` (one batch of a single-process iterator), reporting it to ``pos``;
    batches ``pos.skip`` names are loaded and dropped."""
    while True:
        try:
            data = load()
        except StopIteration:
            pos.finish()
            raise
        except Exception:
            pos.received(pos.current)   # the dataset's exception used up its batch
            raise
        if pos.current in pos.skip:
            continue   # IterableDataset resume: received before the checkpoint
        pos.received(pos.current)
        return data


class SingleIter(_SingleProcessDataLoaderIter):
    """torch's single-process iterator (``num_workers=0`` without ``seed``), taking
    its indices from the checkpoint's stream and reporting the batches received."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._mpl_pos = begin(loader, loader._mpl_next_epoch(), self._sampler_iter)
        self._sampler_iter: Any = self._mpl_pos.indices()

    def _next_data(self) -> Any:
        return next_counted(self._mpl_pos, super()._next_data)
