"""Randomness: an epoch's batches depend on (seed, epoch), never on ``num_workers``.

Before each batch, ``random``, NumPy's global RNG and torch's are seeded from
(seed, epoch, batch index); with ``num_workers=0`` the caller's RNG state is
restored afterwards.  ``shuffle=True`` draws its permutation from (seed, epoch).
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import mploader

torch = pytest.importorskip("torch")  # every check here includes torch's RNG

pytestmark = pytest.mark.timeout(60)

N = 24
BATCH = 4


class RandomDataset:
    """Each sample draws from all three process-wide RNGs."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return (np.array([random.random() for _ in range(3)]),
                np.random.rand(3),
                np.random.randint(0, 2**31, size=2),
                torch.rand(3, dtype=torch.float64).numpy(),
                torch.randint(0, 2**31, (2,)).numpy(),
                i)


class Index:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def owned(batch):
    return [np.array(a, copy=True) for a in batch]


def epochs(num_workers, seed, n_epochs=2, **kw):
    with mploader.DataLoader(RandomDataset(), batch_size=BATCH, num_workers=num_workers, seed=seed, **kw) as dl:
        return [[owned(b) for b in dl] for _ in range(n_epochs)]


def same_epoch(a, b):
    return len(a) == len(b) and all(
        len(x) == len(y) and all(u.dtype == v.dtype and np.array_equal(u, v) for u, v in zip(x, y))
        for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs():
    return {nw: epochs(nw, seed=1234) for nw in (0, 1, 2)}


def test_epochs_identical_for_any_num_workers(runs):
    for nw in (1, 2):
        for e in range(2):
            assert same_epoch(runs[nw][e], runs[0][e]), f"num_workers={nw} epoch {e} differs from num_workers=0"


def test_epochs_and_batches_differ(runs):
    ep0, ep1 = runs[0]
    assert len(ep0) == N // BATCH
    for k, (b0, b1) in enumerate(zip(ep0, ep1)):
        np.testing.assert_array_equal(b0[-1], b1[-1])  # same indices ...
        for col in range(5):  # ... different draws, from every RNG
            assert not np.array_equal(b0[col], b1[col]), f"batch {k} column {col} repeats across epochs"
    for col in range(5):
        assert not np.array_equal(ep0[0][col], ep0[1][col]), f"column {col}: batches 0 and 1 draw the same"
    # Within a batch, samples draw successive numbers (not one reseed per sample).
    assert not np.array_equal(ep0[0][0][0], ep0[0][0][1])


def test_seed_changes_batches_and_same_seed_repeats(runs):
    again = epochs(2, seed=1234, n_epochs=1)[0]
    assert same_epoch(again, runs[2][0])
    other = epochs(2, seed=4321, n_epochs=1)[0]
    assert not any(np.array_equal(a[1], b[1]) for a, b in zip(other, runs[2][0]))


def rng_states():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_states(a, b):
    assert a[0] == b[0], "random's state changed"
    for x, y in zip(a[1], b[1]):
        assert np.array_equal(x, y), "NumPy's global RNG state changed"
    assert torch.equal(a[2], b[2]), "torch's RNG state changed"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_caller_rng_state_untouched(num_workers, runs):
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    with mploader.DataLoader(RandomDataset(), batch_size=BATCH, num_workers=num_workers, seed=1234) as dl:
        before = rng_states()
        got = [owned(b) for b in dl]
        assert_same_states(before, rng_states())

        # The caller may use the RNGs between batches: neither stream disturbs the other.
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        want_draws = [(random.random(), np.random.rand(), torch.rand(1).item()) for _ in range(N // BATCH)]
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        draws, second = [], []
        for b in dl:
            second.append(owned(b))
            draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws == want_draws
    assert same_epoch(got, runs[0][0])
    assert same_epoch(second, runs[0][1])


def permutation(loader):
    return [int(i) for b in loader for i in b]


def test_shuffle_same_permutation_for_any_num_workers():
    perms = {}
    for nw in (0, 1, 2):
        with mploader.DataLoader(Index(), batch_size=5, shuffle=True, num_workers=nw, seed=77) as dl:
            perms[nw] = [permutation(dl) for _ in range(3)]
    for nw in (1, 2):
        assert perms[nw] == perms[0], f"num_workers={nw}"
    e0, e1, e2 = perms[0]
    for p in (e0, e1, e2):
        assert sorted(p) == list(range(N))
    assert e0 != list(range(N))
    assert e0 != e1 and e1 != e2 and e0 != e2, "each epoch draws a new permutation"
    with mploader.DataLoader(Index(), batch_size=5, shuffle=True, seed=78) as dl:
        assert permutation(dl) != e0


def test_seed_none_draws_from_numpy_global_rng():
    def first_epoch():
        with mploader.DataLoader(Index(), batch_size=6, shuffle=True, num_workers=1) as dl:
            return permutation(dl)

    np.random.seed(2024)
    a = first_epoch()
    np.random.seed(2024)
    b = first_epoch()
    np.random.seed(2025)
    c = first_epoch()
    assert a == b
    assert a != c
