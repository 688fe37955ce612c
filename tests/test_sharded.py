"""mploader.ShardedDataLoader against GluonNLP 0.10's ShardedDataLoader.

A batch sampler that yields a list of shards (a list of index lists) gets one batch
per step: the list of the shards' batchified results, built by one worker into one
slot.  Checked against the in-process reference ``[batchify_fn([dataset[i] for i in
shard]) for shard in batch]`` with num_workers 0, 1, 2 and thread_pool on and off.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from _util import arrays_in, assert_same, lease_of, mxnet_default_batchify_fn

import mploader
from mploader import batchify as bf
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(60)

MODES = [(0, False), (1, False), (2, False), (2, True)]


@pytest.fixture(params=MODES, ids=["workers0", "workers1", "workers2", "threads2"])
def mode(request):
    workers, thread_pool = request.param
    return dict(num_workers=workers, thread_pool=thread_pool)


class Sentences:
    """Sample i: (int32 token ids of length 2 + i % 5, int label)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.arange(2 + i % 5, dtype=np.int32) * 100 + i, i % 3


class ShardedBuckets(mploader.Sampler):
    """Yields batches of ``num_shards`` shards of consecutive indices (as GluonNLP's
    FixedBucketSampler with num_shards > 1); shards may be tuples; shard sizes vary."""

    def __init__(self, n, shard_sizes=(3, 4, 2), as_tuple=False):
        self.n = n
        self.shard_sizes = shard_sizes
        self.as_tuple = as_tuple
        self._batches = []
        start = 0
        while start < n:
            batch = []
            for size in shard_sizes:
                if start >= n:
                    break
                shard = list(range(start, min(start + size, n)))
                batch.append(tuple(shard) if as_tuple else shard)
                start += size
            self._batches.append(batch)

    def __iter__(self):
        return iter(self._batches)

    def __len__(self):
        return len(self._batches)


def owned(obj):
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, (tuple, list)):
        return type(obj)(owned(x) for x in obj)
    return obj


def reference(batch_sampler, dataset, fn):
    out = []
    for batch in batch_sampler:
        if isinstance(batch[0], (list, tuple)):
            out.append([fn([dataset[i] for i in shard]) for shard in batch])
        else:
            out.append(fn([dataset[i] for i in batch]))
    return out


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # Pad without pad_val warns
    BATCHIFY = {
        "tuple-pad-stack": bf.Tuple(bf.Pad(pad_val=0, ret_length=True), bf.Stack()),
        "default": None,
        "plain-callable": lambda samples: (np.concatenate([s[0] for s in samples]), [s[1] for s in samples]),
    }


@pytest.mark.parametrize("name", sorted(BATCHIFY))
@pytest.mark.parametrize("as_tuple", [False, True], ids=["list-shards", "tuple-shards"])
def test_sharded_batches_match_reference(mode, name, as_tuple):
    fn = BATCHIFY[name]
    dataset = Sentences()
    sampler = ShardedBuckets(len(dataset), as_tuple=as_tuple)
    with mploader.ShardedDataLoader(dataset, batch_sampler=sampler, batchify_fn=fn, **mode) as loader:
        assert len(loader) == len(sampler) == 5
        for _ in range(2):
            got = []
            for batch in loader:
                assert type(batch) is list and len(batch) in (1, 2, 3)
                if mode["num_workers"] and not mode["thread_pool"]:
                    leases = {id(lease_of(a)) for a in arrays_in(batch)}
                    assert len(leases) == 1, "every shard of a batch lies in one slot"
                    assert isinstance(lease_of(next(arrays_in(batch))), SlotLease)
                got.append(owned(batch))
                del batch
            # default: the ragged tokens are where Gluon's rule raises and ours passes the
            # list through (pinned against MXNet's rule in test_dataloader_gluon.py)
            want = reference(sampler, dataset, fn or mploader.default_batchify)
            assert len(got) == len(want) == 5
            for g, w in zip(got, want):
                assert_same(g, w)


class FixedSentences(Sentences):
    """Sample i: (int32 token ids of length 4, int label, [label, i]): batchable by Gluon's rule."""

    def __getitem__(self, i):
        return np.arange(4, dtype=np.int32) * 100 + i, i % 3, [i % 3, i]


def test_sharded_default_batchify_is_gluons(mode):
    """GluonNLP's ShardedDataLoader defaults to MXNet's default_batchify_fn; the
    reference is MXNet's rule re-stated from its source (tests/_util.py)."""
    dataset = FixedSentences()
    sampler = ShardedBuckets(len(dataset))
    with mploader.ShardedDataLoader(dataset, batch_sampler=sampler, **mode) as loader:
        got = [owned(b) for b in loader]
    want = reference(sampler, dataset, mxnet_default_batchify_fn)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert_same(g, w)
    assert type(got[0][0][2]) is np.ndarray and got[0][0][2].shape == (3, 2), "lists become one array"


def test_plain_batches_behave_as_dataloader(mode):
    dataset = Sentences()
    fn = BATCHIFY["tuple-pad-stack"]
    with mploader.ShardedDataLoader(dataset, 6, batchify_fn=fn, last_batch="discard", **mode) as loader:
        assert len(loader) == 6
        got = [owned(b) for b in loader]
    want = reference(mploader.BatchSampler(mploader.SequentialSampler(40), 6, "discard"), dataset, fn)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_same_arguments_as_dataloader():
    with pytest.raises(ValueError, match=r"batch_size must be specified unless batch_sampler is specified"):
        mploader.ShardedDataLoader(Sentences())
    with mploader.ShardedDataLoader(Sentences(), 8, shuffle=True, last_batch="rollover", num_workers=1, seed=2,
                                    pin_memory=True, prefetch=3, timeout=30, try_nopython=None) as loader:
        seen = [int(i) for batch in loader for i in batch[1]]
    assert len(seen) == 40 and isinstance(loader, mploader.DataLoader)
