"""``mploader.ShardedDataLoader``: GluonNLP 0.10's ShardedDataLoader on the slot ring."""
from __future__ import annotations

from .dataloader import DataLoader

__all__ = ["ShardedDataLoader"]


class ShardedDataLoader(DataLoader):
    """A :class:`~mploader.DataLoader` whose batch sampler may yield lists of shards,
    as ``gluonnlp.data.ShardedDataLoader`` (GluonNLP 0.10).

    When the batch sampler yields a list of index lists (e.g. GluonNLP's
    ``FixedBucketSampler`` with ``num_shards > 1``), one batch is the list of the
    shards' batchified results, ``[batchify_fn([dataset[i] for i in shard]) for shard
    in batch]``; it is built by one worker and written into one slot, so every array
    of every shard is a zero-copy view of that slot.  A batch of plain indices is
    batchified as :class:`~mploader.DataLoader` does.  As in GluonNLP, a batch is
    sharded when its first element is a list or tuple.

    Takes the same arguments as :class:`~mploader.DataLoader` (GluonNLP's accepted a
    subset: no ``pin_device_id``, ``timeout`` or ``try_nopython``); ``len()`` is
    ``len(batch_sampler)``, the number of (sharded) batches per epoch.  With
    ``pin_memory``, every shard lies in the page-locked region (GluonNLP copied each
    shard into pinned memory).
    """

    _sharded = True
