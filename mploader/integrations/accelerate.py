"""Keep mploader's ring when Hugging Face Accelerate prepares a loader.

``accelerator.prepare(loader)`` (Accelerate 1.x) does not wrap the loader it is
given: it builds a new ``torch.utils.data.DataLoader`` (or torchdata's
``StatefulDataLoader`` with ``use_stateful_dataloader=True``) from the loader's torch
attributes, with a sampler of its own that gives this process its shard, and wraps
that in a ``DataLoaderShard`` (``DataLoaderDispatcher`` with ``dispatch_batches``).
Training then runs on torch's loader, and nothing says so.  This module's two
functions call Accelerate's own and then put an ``mploader.torch.DataLoader`` in
place of the torch loader inside the wrapper (its ``base_dataloader``), built from
exactly what Accelerate built -- the shard's batch sampler, ``num_workers``,
``collate_fn``, ... -- plus the original loader's mploader arguments (``seed``,
``copy``, ``shared_mem``, ``snapshot_every_n_steps``).  Everything Accelerate does
around the base loader (device placement, RNG synchronisation, ``split_batches``,
``even_batches``, its state dict) is unchanged.

Use::

    from mploader.integrations import accelerate as mpl_accelerate
    model, optimizer, loader = mpl_accelerate.prepare(accelerator, model, optimizer, loader)
    skipped = mpl_accelerate.skip_first_batches(accelerator, loader, num_batches=10)

Objects that are not ``mploader.torch.DataLoader`` pass through
``accelerator.prepare`` untouched.  Where the base loader cannot be replaced (a
wrapper without ``base_dataloader``, e.g. Accelerate's XLA device loader), a
``RuntimeWarning`` says so once and the prepared loader is returned as Accelerate
made it.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import torch as mpt

__all__ = ["prepare", "skip_first_batches"]

#: torch DataLoader constructor arguments copied from the loader Accelerate built
#: (besides dataset and the sampling arguments, which ``_sampling`` recovers).
_TORCH_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
               "generator", "persistent_workers", "pin_memory_device", "in_order")
#: mploader's own constructor arguments, copied from the user's original loader.
_MPL_ARGS = ("seed", "copy", "shared_mem", "snapshot_every_n_steps")

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _sampling(base: Any) -> dict[str, Any]:
    """The sampling arguments that rebuild ``base``'s batches, as torch's
    ``DataLoader.__init__`` stored them (torch 2.13: a ``batch_sampler`` argument
    leaves ``batch_size=None`` and ``drop_last=False``; ``batch_size=None`` without
    one turns automatic batching off)."""
    if isinstance(base.dataset, torch.utils.data.IterableDataset):
        return {"batch_size": base.batch_size, "drop_last": base.drop_last}
    if base.batch_size is None:
        if base.batch_sampler is not None:
            return {"batch_sampler": base.batch_sampler}
        return {"batch_size": None, "sampler": base.sampler}
    return {"batch_size": base.batch_size, "sampler": base.sampler, "drop_last": base.drop_last}


def ring_loader(base: Any, original: mpt.DataLoader) -> mpt.DataLoader:
    """An ``mploader.torch.DataLoader`` that yields what ``base`` (a torch or
    torchdata loader Accelerate built) yields, with ``original``'s mploader arguments.

    Raises
    ------
    TypeError
        ``original`` is not an ``mploader.torch.DataLoader``.
    """
    if not isinstance(original, mpt.DataLoader):
        raise TypeError(f"original must be an mploader.torch.DataLoader, got {type(original).__name__}")
    kwargs = {name: getattr(base, name) for name in _TORCH_ARGS if hasattr(base, name)}
    if base.num_workers > 0:
        kwargs["prefetch_factor"] = None if original._mpl.auto_prefetch else base.prefetch_factor
    kwargs.update({name: getattr(original, name) for name in _MPL_ARGS})
    return mpt.DataLoader(base.dataset, **_sampling(base), **kwargs)


def _keep_ring(prepared: Any, original: mpt.DataLoader) -> Any:
    if isinstance(prepared, mpt.DataLoader):
        return prepared
    if type(prepared).__module__.startswith("torch") and isinstance(prepared, torch.utils.data.DataLoader):
        return ring_loader(prepared, original)      # skip_first_batches of a plain loader: a torch loader
    base = getattr(prepared, "base_dataloader", None)
    if base is None or not isinstance(base, torch.utils.data.DataLoader):
        _warn_once(type(prepared).__name__,
                   f"mploader: Accelerate's {type(prepared).__name__} has no base_dataloader to replace; this "
                   f"loader runs on torch's DataLoader, not on mploader's ring")
        return prepared
    ring = ring_loader(base, original)
    prepared.base_dataloader = ring
    if hasattr(prepared, "dl_state_dict") or getattr(prepared, "use_stateful_dataloader", False):
        prepared.dl_state_dict = ring.state_dict()
    return prepared


def _generators(loaders: list[Any]) -> list[tuple[Any, Any]]:
    """(generator, state) of every ``torch.Generator`` the loaders' sampling draws from."""
    found: dict[int, Any] = {}
    for loader in loaders:
        for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                      getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
            g = getattr(owner, "generator", None)
            if isinstance(g, torch.Generator):
                found[id(g)] = g
    return [(g, g.get_state()) for g in found.values()]


def prepare(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
    """``accelerator.prepare(*args, **kwargs)``, with every ``mploader.torch.DataLoader``
    among ``args`` prepared as Accelerate prepares a loader and then run on mploader's
    ring (see the module docstring).  Returns what ``accelerator.prepare`` returns:
    the prepared objects in the order given (one object for one argument).

    The torch loader Accelerate builds and this function discards must leave no trace:
    with ``use_stateful_dataloader`` it draws from the loader's ``generator`` when
    Accelerate asks its first ``state_dict()``; the generators the loaders' sampling
    uses are restored to their state before the call, so the batches are those a torch
    ``DataLoader`` prepared by Accelerate would give (not ``StatefulDataLoader``'s,
    whose draws differ from torch's: docs/faces.md).
    """
    saved = _generators([a for a in args if isinstance(a, mpt.DataLoader)])
    prepared = accelerator.prepare(*args, **kwargs)
    for g, state in saved:
        g.set_state(state)
    many = isinstance(prepared, tuple) and len(args) != 1
    results = list(prepared) if many else [prepared]
    for i, (given, result) in enumerate(zip(args, results)):
        if isinstance(given, mpt.DataLoader):
            results[i] = _keep_ring(result, given)
    return tuple(results) if many else results[0]


def _original_of(dataloader: Any) -> mpt.DataLoader | None:
    if isinstance(dataloader, mpt.DataLoader):
        return dataloader
    base = getattr(dataloader, "base_dataloader", None)
    return base if isinstance(base, mpt.DataLoader) else None


def skip_first_batches(accelerator: Any, dataloader: Any, num_batches: int = 0) -> Any:
    """``accelerator.skip_first_batches(dataloader, num_batches)`` on mploader's ring:
    the loader it returns skips the first ``num_batches`` batches of the epoch
    (Accelerate's ``SkipBatchSampler``) and runs on an ``mploader.torch.DataLoader``
    with the mploader arguments of ``dataloader`` (a loader :func:`prepare` returned,
    or an ``mploader.torch.DataLoader``).  Any other loader is handed to Accelerate
    unchanged."""
    original = _original_of(dataloader)
    skipped = accelerator.skip_first_batches(dataloader, num_batches=num_batches)
    return skipped if original is None else _keep_ring(skipped, original)
