"""Checkpoints that are tampered with or do not fit (issue 26).

Every face's ``load_state_dict`` validates every field: a tampered state is either
accepted and then resumes as its fields say, or refused with a ValueError
(``StateMismatchError``) whose message names the field -- never another exception
type (before: ``OverflowError`` for an epoch beyond int64, ``IndexError`` for an
emptied RNG-state list, a position beyond the epoch silently resumed with no batch).
hypothesis tampers one field (or an element of a list field) at a time.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mploader
from mploader._state import StateMismatchError
from mploader.sampler import BatchSampler, RandomSampler

try:
    import torch
    from torch.utils.data import IterableDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from mploader.torch import DataLoader as TorchFace
except ImportError:  # the core suite runs without torch: the torch face's cases skip
    torch = None
    IterableDataset = object
needs_torch = pytest.mark.skipif(torch is None, reason="the torch face's case needs torch and torchdata")

N, B = 20, 3   # 7 batches an epoch (the last one short)
BATCHES = math.ceil(N / B)


class Arange:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.int64(i)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


# ---- a different batch size ----

@needs_torch
def test_load_with_another_batch_size_is_refused_naming_both_torch_face():
    """torchdata 0.11 resumes at the right sample (it replays samples); the torch face
    refuses with both values (it counts batches).  Before: it resumed at sample 40
    where 20 was next."""
    data = list(range(100))
    saved = StatefulDataLoader(data, batch_size=10)
    it = iter(saved)
    next(it), next(it)
    other = StatefulDataLoader(data, batch_size=20)
    other.load_state_dict(saved.state_dict())
    assert next(iter(other))[0].item() == 20   # torchdata: the next sample

    loader = TorchFace(data, batch_size=10)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["batch_size"] == 10
    with pytest.raises(StateMismatchError, match="it was saved with batch_size=10, this batch sampler has "
                                                 "batch_size=20"):
        TorchFace(data, batch_size=20).load_state_dict(state)
    same = TorchFace(data, batch_size=10)
    same.load_state_dict(state)
    assert next(iter(same))[0].item() == 20


def test_load_with_another_batch_size_is_refused_naming_both_gluon():
    loader = mploader.DataLoader(np.arange(100), batch_size=10)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(StateMismatchError, match="batch_size=10, this batch sampler has batch_size=20"):
        mploader.DataLoader(np.arange(100), batch_size=20).load_state_dict(loader.state_dict())


# ---- the cases of the issue, one by one ----

def gluon_state():
    loader = mploader.DataLoader(Arange(), batch_size=B, shuffle=True, seed=7)
    it = iter(loader)
    next(it), next(it)
    return loader.state_dict()


def torch_state(iterable=False, num_workers=0):
    loader = (TorchFace(Stream(), batch_size=B) if iterable else
              TorchFace(Arange(), batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(3),
                        num_workers=num_workers))
    with loader:
        it = iter(loader)
        next(it), next(it)
        return loader.state_dict()


def chainer_state():
    it = mploader.MultiprocessIterator(Arange(), B, shuffle=True, n_processes=0, seed=7)
    next(it), next(it)
    state = it.state_dict()
    it.finalize()
    return state


@needs_torch
@pytest.mark.parametrize("field, value, words", [
    ("batches_consumed", BATCHES + 1, "batches_consumed=8 is beyond the epoch: the batch sampler yields 7 batches"),
    ("epoch", 2 ** 63, "epoch must be an int in [0, 9223372036854775806], got 9223372036854775808"),
    ("epoch", "1", "epoch must be an int in [0, 9223372036854775806], got '1'"),
    ("seed", 1.5, "seed must be an int >= 0 or None, got 1.5"),
    ("rng_state", [], "rng_state must be a torch generator state, a list of 5056 ints in [0, 255], got []"),
    ("batches_ahead", [1], "batches_ahead[0] must be an int in [3, 6], got 1"),
    ("batch_sampler_mode", "sometimes", "batch_sampler_mode must be one of None, 'undecided', 'per pass', "
                                        "'per batch', got 'sometimes'"),
])
def test_tampered_map_state_is_refused_naming_field_value_and_range(field, value, words):
    state = torch_state()
    state[field] = value
    with pytest.raises(StateMismatchError) as info:
        TorchFace(Arange(), batch_size=B, shuffle=True, generator=torch.Generator()).load_state_dict(state)
    assert words in str(info.value)


def test_tampered_chainer_state_is_refused_naming_field_value_and_range():
    it = mploader.MultiprocessIterator(Arange(), B, shuffle=True, n_processes=0, seed=7)
    try:
        for field, value, words in [("current_position", 20, "current_position must be an int in [0, 19], got 20"),
                                    ("order", list(range(19)) + [20], "order must hold dataset indices"),
                                    ("previous_epoch_detail", float("nan"), "previous_epoch_detail must be -1.0"),
                                    ("is_new_epoch", 0, "is_new_epoch must be a bool, got 0")]:
            state = chainer_state()
            state[field] = value
            with pytest.raises(StateMismatchError, match=None) as info:
                it.load_state_dict(state)
            assert words in str(info.value)
    finally:
        it.finalize()


@needs_torch
def test_tampered_worker_rng_is_refused_naming_the_field():
    loader = TorchFace(Arange(), batch_size=B, num_workers=2)
    with loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        del it
    assert state["worker_rng"] is not None
    for path, value, words in [(("states",), [], "worker_rng['states'] must hold one entry per worker"),
                               (("base_seed",), -1, "worker_rng['base_seed'] must be an int"),
                               (("assigned",), [[1, 9]], "worker_rng['assigned'][0][1] (a worker id) must be"),
                               (("states", 0, "numpy", "pos"), 625, "['numpy']['pos'] must be an int in [0, 624]")]:
        bad = copy.deepcopy(state)
        node = bad["worker_rng"]
        for key in path[:-1]:
            node = node[key]
        if node is None:
            continue   # (that worker had sent no batch yet)
        node[path[-1]] = value
        with pytest.raises(StateMismatchError) as info:
            TorchFace(Arange(), batch_size=B, num_workers=2).load_state_dict(bad)
        assert words in str(info.value)


# ---- hypothesis: any tampered field ----

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 30), st.integers(2 ** 62, 2 ** 70), st.integers(),
    st.floats(allow_nan=True), st.text(max_size=4), st.just([]), st.lists(st.integers(-2, 300), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2), st.just(object()))
DELETE = object()


def paths(state, prefix=()):
    """Every key path into ``state``'s dicts and (short) lists."""
    for key, value in state.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from paths(value, prefix + (key,))
        elif isinstance(value, list) and value:
            for i in sorted({0, len(value) - 1}):
                yield prefix + (key, i)
                if isinstance(value[i], dict):
                    yield from paths(value[i], prefix + (key, i))


def tamper(state, path, value):
    bad = copy.deepcopy(state)
    node = bad
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        if isinstance(node, dict):
            del node[path[-1]]
        else:
            node.pop(path[-1])
    else:
        node[path[-1]] = value
    return bad


def refused_naming(load, bad, path):
    """Load ``bad``: None if accepted; else the exception must be a ValueError naming
    the top-level field tampered with."""
    try:
        load(bad)
    except ValueError as exc:
        assert str(path[0]) in str(exc), f"{path}: {exc}"
        return exc
    return None


def check_map_resume(loader, bad, length, path):
    """An accepted map state resumes as its fields say: the rest of the saved epoch
    (``length - batches_consumed - len(batches_ahead)`` batches), then whole epochs.
    False: the batch sampler's iterator refused its state at ``iter()`` (where the
    iterator is made), with a ValueError naming the field."""
    consumed, ahead = bad.get("batches_consumed", 0), bad.get("batches_ahead", [])
    if refused_naming(lambda _: list(loader), None, path) is not None:
        assert path[0] == "batch_sampler_iter_state"
        return False
    loader.load_state_dict(bad)
    rest = [list(map(int, b)) for b in loader]
    assert len(rest) == length - consumed - len(ahead)
    assert all(0 <= i < N for b in rest for i in b)
    assert sum(len(b) for b in [list(map(int, b)) for b in loader]) == N
    return True


STATES = {"gluon": gluon_state(), "chainer": chainer_state()}
if torch is not None:
    STATES.update(torch=torch_state(), torch_iterable=torch_state(iterable=True),
                  torch_workers=torch_state(num_workers=2))
    assert STATES["torch_workers"]["worker_rng"]["states"] != [None, None]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_tampered_gluon_state_is_accepted_and_correct_or_refused_naming_the_field(data):
    state = STATES["gluon"]
    path = data.draw(st.sampled_from(list(paths(state))))
    bad = tamper(state, path, data.draw(st.one_of(JUNK, st.just(DELETE))))
    loader = mploader.DataLoader(Arange(), batch_size=B, shuffle=True, seed=1)
    if refused_naming(loader.load_state_dict, bad, path) is None and check_map_resume(loader, bad, BATCHES, path):
        # ... with the seed and epoch the state gives: an independent rebuild of the order
        sampler = RandomSampler(N, seed=bad["seed"])
        sampler.set_epoch(bad["epoch"])
        expected = list(BatchSampler(sampler, B))
        again = mploader.DataLoader(Arange(), batch_size=B, shuffle=True, seed=1)
        again.load_state_dict(bad)
        skip = set(bad["batches_ahead"])
        assert [list(map(int, b)) for b in again] == [b for i, b in enumerate(expected)
                                                      if i >= bad["batches_consumed"] and i not in skip]


@needs_torch
@pytest.mark.parametrize("saved", ["torch", "torch_workers"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tampered_torch_state_is_accepted_and_correct_or_refused_naming_the_field(saved, data):
    """(``torch_workers``: saved with 2 workers and torch's seeding, so it holds
    ``worker_rng``; loaded without workers, which checks it all the same.)"""
    state = STATES[saved]
    path = data.draw(st.sampled_from(list(paths(state))))
    bad = tamper(state, path, data.draw(st.one_of(JUNK, st.just(DELETE))))
    loader = TorchFace(Arange(), batch_size=B, shuffle=True, generator=torch.Generator())
    if refused_naming(loader.load_state_dict, bad, path) is None:
        check_map_resume(loader, bad, BATCHES, path)


@needs_torch
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_tampered_torch_iterable_state_is_accepted_and_correct_or_refused_naming_the_field(data):
    state = STATES["torch_iterable"]
    path = data.draw(st.sampled_from(list(paths(state))))
    bad = tamper(state, path, data.draw(st.one_of(JUNK, st.just(DELETE))))
    loader = TorchFace(Stream(), batch_size=B)
    if refused_naming(loader.load_state_dict, bad, path) is None:
        rest = [b.tolist() for b in loader]
        first = B * bad["batches_consumed"]
        assert rest == [list(range(i, min(i + B, N))) for i in range(first, N, B)]
        assert [b.tolist() for b in loader] == [list(range(i, min(i + B, N))) for i in range(0, N, B)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_tampered_chainer_state_is_accepted_and_correct_or_refused_naming_the_field(data):
    state = STATES["chainer"]
    path = data.draw(st.sampled_from(list(paths(state))))
    bad = tamper(state, path, data.draw(st.one_of(JUNK, st.just(DELETE))))
    it = mploader.MultiprocessIterator(Arange(), B, shuffle=True, n_processes=0, seed=7)
    try:
        if refused_naming(it.load_state_dict, bad, path) is not None:
            return
        pos, order = bad["current_position"], bad["order"]
        batch = [int(x) for x in next(it)]
        if pos + B < N:   # no epoch boundary inside the batch: the saved order from the saved position
            assert batch == (order[pos:pos + B] if order is not None else list(range(pos, pos + B)))
        assert all(0 <= i < N for i in batch)
        assert it.epoch in (bad["epoch"], bad["epoch"] + 1)
    finally:
        it.finalize()
