"""Checkpoint and resume of the map-style faces (issue 11): ``state_dict`` /
``load_state_dict`` of ``mploader.DataLoader`` and ``ShardedDataLoader``.

The reference for every resumed run is the same configuration run without
interruption in the calling process (``num_workers=0``), whose order is checked
once against the samplers' definition (``default_rng([seed, epoch]).permutation``).
Samples carry a random augmentation drawn from NumPy's global RNG in the worker,
so a resumed batch is equal only if its worker seed is the uninterrupted one.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mploader
from mploader._state import StateMismatchError
from mploader.sampler import BatchSampler, RandomSampler, SequentialSampler

pytestmark = pytest.mark.usefixtures("no_leaks")

N = 11
BATCH = 3
EPOCHS = 2


class Augmented:
    """``dataset[i] = (i, noise)``: noise is a draw from NumPy's global RNG (the
    random augmentation the worker's per-batch seeding makes reproducible)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.int64(i), np.random.randint(0, 2**31, size=2)


def as_lists(batch):
    return [np.asarray(x).tolist() for x in batch]


def run_all(loader, epochs=EPOCHS):
    """Every batch of ``epochs`` epochs, with the state before each one and at the end."""
    states, batches = [json.loads(json.dumps(loader.state_dict()))], []
    for _ in range(epochs):
        for batch in loader:
            batches.append(as_lists(batch))
            states.append(json.loads(json.dumps(loader.state_dict())))
        states[-1] = json.loads(json.dumps(loader.state_dict()))   # after StopIteration
    return states, batches


def resume(loader, state, needed):
    """Load ``state`` and collect ``needed`` batches across as many epochs as needed."""
    loader.load_state_dict(state)
    out = []
    for _ in range(EPOCHS + 2):
        if len(out) >= needed:
            break
        out.extend(as_lists(b) for b in loader)
    return out[:needed]


def make(num_workers, shuffle=True, last_batch="keep", seed=7, **kw):
    return mploader.DataLoader(Augmented(), batch_size=BATCH, shuffle=shuffle, last_batch=last_batch,
                               num_workers=num_workers, seed=seed, copy=True, **kw)


def test_reference_order_is_the_samplers_definition():
    with make(0) as loader:
        _, batches = run_all(loader)
    ids = [i for b in batches for i in b[0]]
    want = [i for e in range(EPOCHS) for i in np.random.default_rng([7, e]).permutation(N).tolist()]
    assert ids == want


@pytest.mark.parametrize("saved_workers", [0, 1, 2, 3])
def test_resume_any_worker_count(saved_workers):
    """N -> M workers for every pair in {0, 1, 2, 3}, saved at every position of two
    epochs (before the first iter(), mid-epoch, at the boundaries)."""
    with make(0) as ref:
        _, want = run_all(ref)
    with make(saved_workers) as saved:
        states, got = run_all(saved)
    assert got == want
    assert [s["batches_consumed"] for s in states] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [s["epoch"] for s in states] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    for m in (0, 1, 2, 3):
        with make(m) as loader:
            for p, state in enumerate(states):
                assert resume(loader, state, len(want) - p) == want[p:], (saved_workers, m, p)


@pytest.mark.parametrize("shuffle,last_batch", [(False, "keep"), (True, "discard"), (True, "rollover"),
                                                (False, "rollover")])
def test_resume_sampler_variants(shuffle, last_batch):
    """Rollover carries indices between epochs: the carry is part of the batch sampler's state."""
    with make(0, shuffle, last_batch) as ref:
        _, want = run_all(ref, 3)
    with make(2, shuffle, last_batch) as saved:
        states = []
        got = []
        for _ in range(3):
            for b in saved:
                got.append(as_lists(b))
                states.append(json.loads(json.dumps(saved.state_dict())))
    assert got == want
    with make(1, shuffle, last_batch) as loader:
        for p, state in enumerate(states, 1):
            loader.load_state_dict(state)
            out = []
            for _ in range(4):
                out.extend(as_lists(b) for b in loader)
                if len(out) >= len(want) - p:
                    break
            assert out[:len(want) - p] == want[p:]


def test_batches_in_flight_are_not_consumed():
    with make(2, prefetch=4) as loader:
        it = iter(loader)
        next(it)
        assert loader.state_dict()["batches_consumed"] == 1   # 4 were dispatched


def test_state_is_a_snapshot():
    with make(2) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        frozen = copy.deepcopy(state)
        list(it)
        list(loader)
        assert state == frozen


def test_state_before_iter_and_after_load():
    with make(0) as loader:
        fresh = loader.state_dict()
        assert (fresh["version"], fresh["kind"], fresh["epoch"], fresh["batches_consumed"]) == (1, "map", 0, 0)
        it = iter(loader)
        next(it), next(it)
        mid = loader.state_dict()
    with make(0) as other:
        other.load_state_dict(mid)
        assert other.state_dict() == mid   # pending until iter()


def test_load_adopts_the_saved_seed():
    with make(0, seed=3) as ref:
        _, want = run_all(ref)
    with make(2, seed=3) as saved:
        it = iter(saved)
        next(it)
        state = saved.state_dict()
        del it
    with make(2, seed=99) as loader:
        list(loader)   # workers running with another seed: restarted by load_state_dict
        loader.load_state_dict(state)
        assert resume(loader, state, len(want) - 1) == want[1:]


def test_dataset_exception_consumes_its_batch():
    class Failing(Augmented):
        def __getitem__(self, i):
            if i == 4:
                raise KeyError(i)
            return super().__getitem__(i)

    with mploader.DataLoader(Failing(), batch_size=BATCH, num_workers=2, seed=1, copy=True) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(KeyError):
            next(it)
        state = loader.state_dict()
        rest = [as_lists(b) for b in it]
    assert state["batches_consumed"] == 2
    with mploader.DataLoader(Failing(), batch_size=BATCH, num_workers=0, seed=1, copy=True) as loader:
        loader.load_state_dict(state)
        assert [as_lists(b) for b in loader] == rest


class RotatingSampler:
    """A user sampler with state: every pass rotates the order by one more step."""

    def __init__(self, n):
        self.n, self.passes = n, 0

    def __iter__(self):
        k, self.passes = self.passes, self.passes + 1
        return iter([(i + k) % self.n for i in range(self.n)])

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"passes": self.passes}

    def load_state_dict(self, state):
        self.passes = state["passes"]


class CountingDataset(Augmented):
    """A user dataset with state (the parent's copy; workers fork after load)."""

    def __init__(self):
        super().__init__()
        self.offset = 0

    def __getitem__(self, i):
        return np.int64(i + self.offset), np.random.randint(0, 2**31, size=2)

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, state):
        self.offset = state["offset"]


@pytest.mark.parametrize("workers", [(0, 2), (2, 0)])
def test_duck_typed_sampler_and_dataset(workers):
    def loader(nw, ds):
        return mploader.DataLoader(ds, batch_size=BATCH, sampler=RotatingSampler(N), num_workers=nw, seed=2,
                                   copy=True)

    ds = CountingDataset()
    ds.offset = 100
    with loader(0, ds) as ref:
        _, want = run_all(ref, 3)
    ds = CountingDataset()
    ds.offset = 100
    with loader(workers[0], ds) as saved:
        states, got = run_all(saved, 3)
    assert got == want
    assert states[5]["batch_sampler_state"]["sampler"] == {"passes": 1}
    assert states[5]["dataset_state"] == {"offset": 100}
    for p in (0, 3, 5, 8, len(want)):
        with loader(workers[1], CountingDataset()) as fresh:
            assert resume(fresh, states[p], len(want) - p) == want[p:]


def test_unseeded_random_sampler_cannot_be_saved():
    with mploader.DataLoader(np.arange(10), batch_size=2, sampler=RandomSampler(10)) as loader:
        it = iter(loader)
        next(it)   # iteration is unaffected
        with pytest.raises(ValueError, match=r"RandomSampler\(seed=None\) draws its order from NumPy's global "
                                             r"random state, which a checkpoint cannot rebuild: pass seed=<int>"):
            loader.state_dict()


def _state_of(loader):
    it = iter(loader)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize("change,message", [
    (dict(dataset=np.arange(21)), "it was saved with dataset_length=20, this loader has dataset_length=21"),
    (dict(batch_size=4), "it was saved with batch_size=3, this batch sampler has batch_size=4"),
    (dict(shuffle=False), "it was saved with sampler_type='mploader.sampler.RandomSampler', this batch sampler "
                          "has sampler_type='mploader.sampler.SequentialSampler'"),
    (dict(last_batch="discard"), "it was saved with last_batch='keep', this batch sampler has "
                                 "last_batch='discard'"),
])
def test_mismatch_is_refused_with_both_values(change, message):
    args = dict(dataset=np.arange(20), batch_size=3, shuffle=True, seed=1)
    with mploader.DataLoader(**args) as loader:
        state = _state_of(loader)
    with mploader.DataLoader(**{**args, **change}) as other:
        with pytest.raises(StateMismatchError, match="cannot load the state: " + message.replace("(", r"\(")
                           .replace(")", r"\)")):
            other.load_state_dict(state)


def test_version_kind_and_type_are_checked():
    with mploader.DataLoader(np.arange(20), batch_size=3) as loader:
        state = _state_of(loader)
        with pytest.raises(StateMismatchError, match="cannot load a loader state of version 2: this mploader "
                                                     "reads version 1"):
            loader.load_state_dict({**state, "version": 2})
        with pytest.raises(StateMismatchError, match="it is a state of kind 'chainer', this loader takes kind "
                                                     "'map'"):
            loader.load_state_dict({**state, "kind": "chainer"})
        with pytest.raises(TypeError, match="state must be a dict returned by state_dict\\(\\), got list"):
            loader.load_state_dict([])
        with pytest.raises(StateMismatchError,
                           match=r"batches_consumed must be an int in \[0, 9223372036854775807\], got -1"):
            loader.load_state_dict({**state, "batches_consumed": -1})
    bs = BatchSampler(SequentialSampler(20), 3)
    with mploader.DataLoader(np.arange(20), batch_sampler=bs) as other:
        with pytest.raises(StateMismatchError, match="it was saved with batch_sampler_type="):
            other.load_state_dict({**state, "batch_sampler_type": "x.Y"})


def test_sharded_loader_resumes():
    data = np.arange(40).reshape(20, 2)
    shards = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14, 15]]]
    with mploader.ShardedDataLoader(data, batch_sampler=shards, num_workers=2, copy=True) as saved:
        it = iter(saved)
        next(it), next(it)
        state = json.loads(json.dumps(saved.state_dict()))
        rest = [[s.tolist() for s in b] for b in it]
    assert state["face"] == "gluonnlp"
    with mploader.ShardedDataLoader(data, batch_sampler=shards, num_workers=0, copy=True) as loader:
        loader.load_state_dict(state)
        assert [[s.tolist() for s in b] for b in loader] == rest == [[data[s].tolist() for s in b]
                                                                       for b in shards[2:]]


# ---- snapshots of states (mploader._state.snapshot: deepcopy's value, faster for plain states) ----

_plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
                      | st.binary(max_size=5),
                      lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(state=_plain)
def test_a_snapshot_of_a_plain_state_equals_deepcopy_and_is_independent(state):
    from mploader._state import snapshot

    copied = snapshot(state)
    assert copied == copy.deepcopy(state)
    assert type(copied) is type(state)
    before = repr(copied)
    _mutate(state)
    assert repr(copied) == before


def _mutate(obj) -> None:
    if isinstance(obj, dict):
        for v in obj.values():
            _mutate(v)
        obj["mutated"] = 1
    elif isinstance(obj, list):
        for v in obj:
            _mutate(v)
        obj.append("mutated")
    elif isinstance(obj, tuple):
        for v in obj:
            _mutate(v)


def test_a_snapshot_of_arrays_shared_objects_or_cycles_is_deepcopys():
    from mploader._state import snapshot

    arr = np.arange(4)
    shared = [1, 2]
    state = {"rng": arr, "a": shared, "b": shared}
    copied = snapshot(state)
    assert copied["rng"] is not arr and np.array_equal(copied["rng"], arr)
    assert copied["a"] is copied["b"] and copied["a"] is not shared   # deepcopy's sharing, kept
    arr[0] = 99
    assert copied["rng"][0] == 0
    cycle: list = [1]
    cycle.append(cycle)
    again = snapshot(cycle)
    assert again[1] is again and again is not cycle
    deep: list = []
    node = deep
    for _ in range(100):   # deeper than the plain copy goes: deepcopy's, the same value
        node.append([])
        node = node[0]
    assert snapshot(deep) == deep


# ---- a batch sampler whose snapshots are tokens saves the same states ----

class _Opaque(BatchSampler):
    """mploader's BatchSampler under another type: its snapshots are state dicts (the
    general path), not tokens."""


@pytest.mark.parametrize("last_batch, n", [("keep", N), ("rollover", N), ("discard", N), ("keep", BATCH)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_known_per_pass_sampler_saves_the_states_the_snapshots_find(last_batch, n, shuffle):
    """Every state_dict() (before, between and after every batch of 3 epochs; one-batch
    passes included, whose mode stays undecided) of mploader's own BatchSampler --
    snapshots taken as tokens -- equals that of the same sampler under another type,
    whose states the snapshots decide; the type's name aside."""
    def loader(cls):
        inner = RandomSampler(n, seed=3) if shuffle else SequentialSampler(n)
        return mploader.DataLoader(Augmented(n), batch_sampler=cls(inner, BATCH, last_batch), num_workers=0,
                                   seed=7, copy=True)
    known, opaque = loader(BatchSampler), loader(_Opaque)
    assert known._batch_sampler._state_token() is not None and opaque._batch_sampler._state_token() is None
    states_known, batches_known = run_all(known, epochs=3)
    states_opaque, batches_opaque = run_all(opaque, epochs=3)
    assert batches_known == batches_opaque
    for a, b in zip(states_known, states_opaque, strict=True):
        assert a.pop("batch_sampler_type") == "mploader.sampler.BatchSampler"
        assert b.pop("batch_sampler_type").endswith("_Opaque")
        assert a == b
    modes = {s.get("batch_sampler_mode") for s in states_known}
    assert modes == ({None, "undecided"} if n == BATCH else {None, "per pass"}), modes


def test_the_epoch_start_state_is_kept_when_the_sampler_is_loaded_mid_epoch():
    """The batch sampler's state at an epoch's start is kept as a token (the carry, the
    sampler's epoch and seed): a seed loaded into the sampler mid-epoch changes neither
    it nor the loader's state_dict() for that epoch -- as for a sampler whose state is
    deep-copied at the epoch's start (the opaque type)."""
    def states(cls):
        inner = RandomSampler(N, seed=3)
        with mploader.DataLoader(Augmented(N), batch_sampler=cls(inner, BATCH, "rollover"), num_workers=0,
                                 seed=7, copy=True) as loader:
            it = iter(loader)
            next(it)
            before = loader.state_dict()
            inner.load_state_dict({**inner.state_dict(), "seed": 11})
            after = loader.state_dict()
        before.pop("batch_sampler_type"), after.pop("batch_sampler_type")
        return before, after
    known, opaque = states(BatchSampler), states(_Opaque)
    assert known[0] == known[1] == opaque[0] == opaque[1]
    assert known[0]["batch_sampler_state"]["sampler"]["seed"] == 3


class _OpaqueDistributed(mploader.DistributedBatchSampler):
    """mploader's DistributedBatchSampler under another type: its per-batch states are
    taken as state dicts after every pull (the general path), not as tokens."""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_per_batch_state_taken_as_a_token_is_the_state_dict(workers, drop_last):
    """Every state_dict() (before, between and after every batch of 3 epochs, workers
    pulling ahead) of a loader over DistributedBatchSampler -- whose per-batch states
    are kept as (epoch, global batches) tokens -- equals that of the same sampler under
    another type, kept as state dicts; and each is the sampler's own state for the
    batches received (set_epoch as documented)."""
    def run(cls):
        sampler = cls(N, 4, seed=5, rank=0, world_size=2, drop_last=drop_last)
        loader = mploader.DataLoader(Augmented(), batch_sampler=sampler, num_workers=workers, seed=7, copy=True)
        states, batches = [], []
        try:
            for epoch in range(3):
                sampler.set_epoch(epoch)
                states.append(json.loads(json.dumps(loader.state_dict())))
                for batch in loader:
                    batches.append(as_lists(batch))
                    states.append(json.loads(json.dumps(loader.state_dict())))
                states.append(json.loads(json.dumps(loader.state_dict())))
        finally:
            loader.close()
        return states, batches, sampler
    states_token, batches_token, sampler = run(mploader.DistributedBatchSampler)
    states_dict, batches_dict, _ = run(_OpaqueDistributed)
    assert batches_token == batches_dict
    consumed = [s["batch_sampler_state"]["global_batches_consumed"] for s in states_token]
    assert max(consumed) == sampler.num_global_batches and consumed.count(0) >= 3
    for a, b in zip(states_token, states_dict, strict=True):
        assert a.pop("batch_sampler_type").endswith(".DistributedBatchSampler")
        assert b.pop("batch_sampler_type").endswith("_OpaqueDistributed")
        assert a == b
    mid = [s for s in states_token if s["batches_consumed"] > 0]
    assert mid and all(s["batch_sampler_state"]["global_batches_consumed"] == s["batches_consumed"]
                       for s in mid if s["batch_sampler_mode"] == "per batch")
