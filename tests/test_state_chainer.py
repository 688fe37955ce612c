"""Checkpoint and resume of the Chainer face (issue 11): ``MultiprocessIterator``'s
``state_dict`` / ``load_state_dict`` hold what ``serialize`` writes, JSON-safe, and
resume with any ``n_processes``.  The reference is an uninterrupted iterator with
``n_processes=0``; examples carry a draw from NumPy's global RNG, so a resumed
batch matches only with the uninterrupted per-batch seed."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mploader
from mploader._state import StateMismatchError

pytestmark = pytest.mark.usefixtures("no_leaks")

N = 10
BATCH = 4
STEPS = 8   # 3.2 epochs


class Augmented:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return int(i), int(np.random.randint(0, 2**31))


def rotate(order, position):
    """A deterministic order sampler (its orders do not depend on hidden state)."""
    return np.roll(order, 3)


def make(n_processes, seed=11, **kw):
    kw.setdefault("order_sampler", rotate)
    return mploader.MultiprocessIterator(Augmented(), BATCH, n_processes=n_processes, seed=seed, **kw)


def plain(batch):
    return [tuple(int(v) for v in example) for example in batch]


@pytest.mark.parametrize("saved", [0, 1, 2, 3])
def test_resume_any_process_count(saved):
    with make(0) as ref:
        want = [plain(next(ref)) for _ in range(STEPS)]
    with make(saved) as it:
        states = [json.loads(json.dumps(it.state_dict()))]
        got = []
        for _ in range(STEPS):
            got.append(plain(next(it)))
            states.append(json.loads(json.dumps(it.state_dict())))
    assert got == want
    for m in (0, 1, 2, 3):
        with make(m, seed=99) as it:   # adopts the saved seed
            for p, state in enumerate(states):
                it.load_state_dict(state)
                assert [plain(next(it)) for _ in range(STEPS - p)] == want[p:], (saved, m, p)
                assert it.epoch == states[-1]["epoch"] or p == STEPS


def test_state_holds_the_serialize_keys():
    with make(2, shuffle=None) as it:
        next(it), next(it), next(it)
        saved = {}

        def serializer(key, value):
            saved[key] = value
            return value

        it.serialize(serializer)
        state = it.state_dict()
    assert (state["version"], state["kind"]) == (1, "chainer")
    assert {k: state[k] for k in saved} == {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                            for k, v in saved.items()}
    assert state["current_position"] == 2 and state["epoch"] == 1 and state["is_new_epoch"] is True
    assert state["order"] == np.roll(np.roll(np.arange(N), 3), 3).tolist()


def test_non_repeating_and_without_order():
    with mploader.MultiprocessIterator(Augmented(), BATCH, repeat=False, shuffle=False, n_processes=2,
                                       seed=1) as it:
        next(it)
        state = it.state_dict()
        rest = [plain(b) for b in it]
    assert state["order"] is None and state["order_sampler_type"] is None
    with mploader.MultiprocessIterator(Augmented(), BATCH, repeat=False, shuffle=False, n_processes=0,
                                       seed=1) as it:
        it.load_state_dict(state)
        assert [plain(b) for b in it] == rest


def test_mismatch_is_refused():
    with make(0) as it:
        state = it.state_dict()
    with mploader.MultiprocessIterator(Augmented(), BATCH + 1, n_processes=0, order_sampler=rotate) as other:
        with pytest.raises(StateMismatchError, match="cannot load the state: it was saved with batch_size=4, "
                                                     "this iterator has batch_size=5"):
            other.load_state_dict(state)
    with mploader.MultiprocessIterator(Augmented(), BATCH, n_processes=0, shuffle=False) as other:
        with pytest.raises(StateMismatchError, match="order_sampler_type="):
            other.load_state_dict(state)
        with pytest.raises(StateMismatchError, match="it is a state of kind 'map', this iterator takes kind "
                                                     "'chainer'"):
            other.load_state_dict({**state, "kind": "map"})
