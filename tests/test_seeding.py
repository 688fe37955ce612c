"""Per-batch seeding (docs/design.md, "Per-batch seeding"): the state each generator
gets from a batch seed, checked through the generators' public getters against a
reference written from the documented rule."""
from __future__ import annotations

import random

import numpy as np
import pytest

from mploader import _rng_state, _worker

MASK64 = (1 << 64) - 1
NUMPY_SALT = 0x6E756D7079


def splitmix_words(seed: int) -> list[int]:
    """624 uint32 words: the low, then the high half of each splitmix64 output."""
    x, out = seed & MASK64, []
    for _ in range(312):
        x = (x + 0x9E3779B97F4A7C15) & MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        out += [z & 0xFFFFFFFF, z >> 32]
    return out


@pytest.fixture
def fresh_targets():
    saved = dict(vars(_worker._SeedTargets))
    yield _worker._SeedTargets
    for k, v in saved.items():
        if not k.startswith("__"):
            setattr(_worker._SeedTargets, k, v)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63 + 17, MASK64])
def test_the_generators_get_the_documented_states(seed):
    random.random()
    np.random.standard_normal()       # leaves a cached Gaussian behind
    random.gauss(0, 1)                # and Python's own
    _worker.seed_rngs(seed)
    assert _worker._SeedTargets.py_inst is not None, "the in-place seeding is not used on this interpreter"
    version, internal, gauss_next = random.getstate()
    assert list(internal) == splitmix_words(seed) + [624] and gauss_next is None
    name, key, pos, has_gauss, gauss = np.random.get_state()
    assert name == "MT19937" and key.tolist() == splitmix_words(seed ^ NUMPY_SALT)
    assert (pos, has_gauss, gauss) == (624, 0, 0.0)


def test_draws_after_seeding_are_those_of_the_public_setstate():
    _worker.seed_rngs(99)
    got = ([random.random() for _ in range(700)], np.random.standard_normal(5).tolist(), random.gauss(0, 1))
    ref_py = random.Random()
    ref_py.setstate((3, tuple(splitmix_words(99)) + (624,), None))
    ref_np = np.random.RandomState()
    ref_np.set_state(("MT19937", np.array(splitmix_words(99 ^ NUMPY_SALT), np.uint32), 624, 0, 0.0))
    assert got == ([ref_py.random() for _ in range(700)], ref_np.standard_normal(5).tolist(), ref_py.gauss(0, 1))


def test_without_the_layout_the_public_seeding_is_used(fresh_targets, monkeypatch):
    monkeypatch.setattr(_rng_state._Layout, "py_state", None)
    monkeypatch.setattr(_rng_state._Layout, "done", True)
    fresh_targets.checked, fresh_targets.py_inst = False, None
    _worker.seed_rngs(2**40 + 3)
    assert fresh_targets.py_inst is None
    got = random.getstate(), np.random.get_state()[1].tolist()
    random.seed(2**40 + 3)
    np.random.seed((2**40 + 3) & 0xFFFFFFFF)
    assert got == (random.getstate(), np.random.get_state()[1].tolist())
