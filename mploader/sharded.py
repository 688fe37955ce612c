"""``mploader.ShardedDataLoader``: GluonNLP 0.10's ShardedDataLoader on the slot ring."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._collate import Alloc
from .dataloader import BatchifyFetch, DataLoader

__all__ = ["ShardedDataLoader"]


class _Shards(list):
    """The samples of a sharded batch: one list of samples per shard."""

    __slots__ = ()


class ShardedFetch(BatchifyFetch):
    """The GluonNLP face's worker contract, with GluonNLP's sharding rule.

    As ``gluonnlp.data.ShardedDataLoader``'s worker: a batch whose first element is a
    list or tuple is a list of shards, and the result is the list of the shards'
    batchified results, all built by this one task (one worker, one slot).  Any other
    batch is loaded and batchified as :class:`~mploader.dataloader.BatchifyFetch`
    does (and may go by a plan).
    """

    __slots__ = ()

    def load(self, dataset: Any, indices: Sequence[Any]) -> Any:
        if len(indices) and isinstance(indices[0], (list, tuple)):
            return _Shards([dataset[i] for i in shard] for shard in indices)
        return [dataset[i] for i in indices]

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> Any:
        one = super().collate
        if type(samples) is _Shards:
            return [one(shard, alloc) for shard in samples]
        return one(samples, alloc)


class ShardedDataLoader(DataLoader):
    """A :class:`~mploader.DataLoader` whose batch sampler may yield lists of shards,
    as ``gluonnlp.data.ShardedDataLoader`` (GluonNLP 0.10).

    When the batch sampler yields a list of index lists (e.g. GluonNLP's
    ``FixedBucketSampler`` with ``num_shards > 1``), one batch is the list of the
    shards' batchified results, ``[batchify_fn([dataset[i] for i in shard]) for shard
    in batch]``; it is built by one worker and written into one slot, so every array
    of every shard is a zero-copy view of that slot.  A batch of plain indices is
    batchified as :class:`~mploader.DataLoader` does.  As in GluonNLP, a batch is
    sharded when its first element is a list or tuple.  The default ``batchify_fn`` is
    Gluon's ``default_batchify_fn`` rule, as GluonNLP's.

    Takes the same arguments as :class:`~mploader.DataLoader` (GluonNLP's accepted a
    subset: no ``pin_device_id``, ``timeout`` or ``try_nopython``); ``len()`` is
    ``len(batch_sampler)``, the number of (sharded) batches per epoch.  With
    ``pin_memory``, every shard lies in the page-locked region (GluonNLP copied each
    shard into pinned memory).
    """

    _fetch_class = ShardedFetch
    _face = "gluonnlp"
