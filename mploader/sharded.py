"""``mploader.ShardedDataLoader``: GluonNLP 0.10's ShardedDataLoader on the slot ring."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._collate import Alloc
from .dataloader import BatchifyFetch, DataLoader

__all__ = ["ShardedDataLoader"]


class ShardedFetch(BatchifyFetch):
    """``fetch(dataset, indices, alloc)`` with GluonNLP's sharding rule.

    As ``gluonnlp.data.ShardedDataLoader``'s worker: a batch whose first element is a
    list or tuple is a list of shards, and the result is the list of the shards'
    batchified results, all built by this one call (one worker, one slot).  Any other
    batch is batchified as :class:`~mploader.dataloader.BatchifyFetch` does.
    """

    __slots__ = ()

    def __call__(self, dataset: Any, indices: Sequence[Any], alloc: Alloc) -> Any:
        if len(indices) and isinstance(indices[0], (list, tuple)):
            return [self.collate([dataset[i] for i in shard], alloc) for shard in indices]
        return self.collate([dataset[i] for i in indices], alloc)

    def planned(self, dataset: Any, indices: Sequence[Any], writer: Any, planner: Any) -> Any:
        """As ``__call__``; a batch that is not a list of shards may go by a plan
        (:meth:`BatchifyFetch.planned`)."""
        if len(indices) and isinstance(indices[0], (list, tuple)):
            return self(dataset, indices, writer.alloc)
        return super().planned(dataset, indices, writer, planner)


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
