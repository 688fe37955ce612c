"""``mploader.DistributedBatchSampler`` (issue 11): the global batch order is a
function of (seed, epoch) only, and a checkpoint taken with W ranks resumes with W'.

Ranks are simulated in one process with explicit ``rank``/``world_size``.  The
reference is the definition: epoch ``e``'s order is
``numpy.random.default_rng([seed, e]).permutation(length)``, global batch ``j`` its
``j``-th slice of ``global_batch_size``.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import mploader
from mploader import DistributedBatchSampler
from mploader._state import StateMismatchError

pytestmark = pytest.mark.usefixtures("no_leaks")

LENGTH = 37
GLOBAL = 8


def reference_batches(epoch, seed=5, length=LENGTH, g=GLOBAL):
    order = np.random.default_rng([seed, epoch]).permutation(length).tolist()
    return [order[j * g:(j + 1) * g] for j in range(length // g)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_global_batches_are_a_function_of_seed_and_epoch(world):
    for epoch in (0, 3):
        ranks = [DistributedBatchSampler(LENGTH, GLOBAL, seed=5, rank=r, world_size=world) for r in range(world)]
        for s in ranks:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in ranks]
        assert all(len(b) == GLOBAL // world for batches in per_rank for b in batches)
        glued = [sum(parts, []) for parts in zip(*per_rank)]
        assert glued == reference_batches(epoch)
        assert len(ranks[0]) == LENGTH // GLOBAL


def test_no_shuffle_and_padding():
    s = DistributedBatchSampler(10, 4, shuffle=False, drop_last=False, rank=1, world_size=2)
    assert list(s) == [[2, 3], [6, 7], [0, 1]]   # 8, 9, then padded from the start: 0, 1
    assert len(s) == 3


def loader_for(sampler, num_workers):
    data = np.arange(LENGTH) * 10
    return mploader.DataLoader(data, batch_sampler=sampler, num_workers=num_workers, copy=True)


@pytest.mark.parametrize("old_world,new_world", list(itertools.product([1, 2, 4], [1, 2, 4])))
def test_resume_with_another_world_size(old_world, new_world):
    """Save rank 0's loader state after k global batches (W ranks), load it on every
    rank of a W' run: the epoch's samples are consumed exactly once, in the global
    batch order of an uninterrupted run."""
    epoch = 1
    want = reference_batches(epoch)
    for k in range(len(want) + 1):
        seen = []
        old = [DistributedBatchSampler(LENGTH, GLOBAL, seed=5, rank=r, world_size=old_world)
               for r in range(old_world)]
        loaders = [loader_for(s, 0) for s in old]
        its = []
        for s, loader in zip(old, loaders):
            s.set_epoch(epoch)
            its.append(iter(loader))
        for _ in range(k):
            seen.append(sum(((next(it) // 10).tolist() for it in its), []))
        state = json.loads(json.dumps(loaders[0].state_dict()))
        for loader in loaders:
            loader.close()
        assert state["batches_consumed"] == k
        new = [DistributedBatchSampler(LENGTH, GLOBAL, seed=5, rank=r, world_size=new_world)
               for r in range(new_world)]
        workers = [(r + k) % 2 for r in range(new_world)]   # 0 or 1 worker, whatever the old run had
        resumed = []
        for s, nw in zip(new, workers):
            with loader_for(s, nw) as loader:
                loader.load_state_dict(state)
                resumed.append([(b // 10).tolist() for b in loader])
        seen.extend(sum(parts, []) for parts in zip(*resumed))
        assert seen == want, (old_world, new_world, k)
        flat = sum(seen, [])
        assert len(flat) == len(set(flat)) == (LENGTH // GLOBAL) * GLOBAL


def test_sampler_state_alone():
    a = DistributedBatchSampler(LENGTH, GLOBAL, seed=5, rank=0, world_size=2)
    a.set_epoch(2)
    assert a.state_dict()["global_batches_consumed"] == 0
    it = iter(a)
    next(it), next(it)
    state = json.loads(json.dumps(a.state_dict()))
    assert (state["epoch"], state["global_batches_consumed"]) == (2, 2)
    assert "rank" not in state and "world_size" not in state
    b = DistributedBatchSampler(LENGTH, GLOBAL, seed=5, rank=3, world_size=4)
    b.load_state_dict(state)
    assert list(b) == [batch[6:8] for batch in reference_batches(2)[2:]]
    assert b.state_dict()["global_batches_consumed"] == 0   # pass over: the next one repeats epoch 2
    b.set_epoch(3)
    assert (b.state_dict()["epoch"], b.state_dict()["global_batches_consumed"]) == (3, 0)


def test_state_mismatch_prints_both_values():
    state = DistributedBatchSampler(LENGTH, GLOBAL, seed=5, world_size=1, rank=0).state_dict()
    other = DistributedBatchSampler(LENGTH, GLOBAL, seed=6, world_size=1, rank=0)
    with pytest.raises(StateMismatchError, match="it was saved with seed=5, this sampler has seed=6"):
        other.load_state_dict(state)
    other = DistributedBatchSampler(LENGTH, 16, seed=5, world_size=1, rank=0)
    with pytest.raises(StateMismatchError, match="global_batch_size=8, this sampler has global_batch_size=16"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="global_batches_consumed must be"):
        DistributedBatchSampler(LENGTH, GLOBAL, seed=5, world_size=1, rank=0).load_state_dict(
            {**state, "global_batches_consumed": 99})


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(world_size=3), ValueError, "global_batch_size must be a multiple of world_size, got global_batch_size=8, "
                                     "world_size=3"),
    (dict(rank=2, world_size=2), ValueError, "rank must be smaller than world_size, got rank=2, world_size=2"),
    (dict(world_size=0, rank=0), ValueError, "world_size"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(rank="0", world_size=1), TypeError, "rank"),
])
def test_bad_arguments(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        DistributedBatchSampler(LENGTH, GLOBAL, **kwargs)


def test_defaults_without_a_process_group():
    s = DistributedBatchSampler(LENGTH, GLOBAL)
    assert (s.rank, s.world_size, s.batch_size) == (0, 1, GLOBAL)


def test_torch_distributed_sampler_keeps_working():
    torch_data = pytest.importorskip("torch.utils.data")
    data = np.arange(20)
    samplers = [torch_data.DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=3) for r in (0, 1)]
    want = [list(s) for s in samplers]
    for s in samplers:
        s.set_epoch(0)
    with mploader.DataLoader(data, batch_size=3, sampler=samplers[1], num_workers=1, copy=True) as loader:
        it = iter(loader)
        first = next(it).tolist()
        state = loader.state_dict()
        rest = [b.tolist() for b in it]
    assert first + sum(rest, []) == want[1]
    with mploader.DataLoader(data, batch_size=3, sampler=samplers[1], num_workers=0, copy=True) as loader:
        loader.load_state_dict(state)
        assert [b.tolist() for b in loader] == rest
