"""mploader._options: one validation convention for every face, the samplers and the engine options.

Python's convention: TypeError for a value of the wrong type, ValueError for a value
out of range, and a message that names the argument as the user spelled it, the value
and the expectation.  The limits come from the ring (``mploader._ring.MAX_SLOTS``,
``MAX_SLOT_BYTES``, with the documented fallbacks while the ring does not export
them) and the engine's ``prefetch + 3`` slots (docs/design.md, "The lease rule").
Every case fails at construction: no process, no fd and no shared memory is made.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import re

import numpy as np
import pytest

import mploader
from mploader import _options, _ring
from mploader._options import LoaderOptions, default_seed

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]

# The reference limits, from the ring itself (independent of _options' own constants).
RING_SLOTS = _ring.MAX_SLOTS
RING_SLOT_BYTES = getattr(_ring, "MAX_SLOT_BYTES", 1 << 40)
PREFETCH_LIMIT = RING_SLOTS - 3


def gluon(**kw):
    return mploader.DataLoader(np.zeros((8, 4)), **{"batch_size": 2, **kw})


def sharded(**kw):
    return mploader.ShardedDataLoader(np.zeros((8, 4)), **{"batch_size": 2, **kw})


def chainer(**kw):
    return mploader.MultiprocessIterator(np.zeros((8, 4)), **{"batch_size": 2, "n_processes": 0, **kw})


# (id, constructor, kwargs, exception type, the exact message)
CASES = [
    ("num_workers=-1", gluon, dict(num_workers=-1), ValueError, "num_workers must be a non-negative integer, got -1"),
    ("num_workers=1.5", gluon, dict(num_workers=1.5), TypeError,
     "num_workers must be a non-negative integer, got 1.5 (float)"),
    ("num_workers=True", gluon, dict(num_workers=True), TypeError,
     "num_workers must be a non-negative integer, got True (bool)"),
    ("prefetch=-2", gluon, dict(num_workers=1, prefetch=-2), ValueError,
     "prefetch must be a non-negative integer, got -2"),
    ("prefetch=5000", gluon, dict(num_workers=2, prefetch=5000), ValueError,
     f"prefetch must be at most {PREFETCH_LIMIT} (the ring holds at most {RING_SLOTS} slots and the engine uses "
     "prefetch + 3), got 5000"),
    ("num_workers=2047, default prefetch", gluon, dict(num_workers=PREFETCH_LIMIT // 2 + 1), ValueError,
     f"num_workers must be at most {PREFETCH_LIMIT // 2} with the default prefetch of 2 * num_workers (the ring "
     f"holds at most {RING_SLOTS} slots and the engine uses prefetch + 3), got {PREFETCH_LIMIT // 2 + 1}"),
    ("prefetch=0 with workers", gluon, dict(num_workers=2, prefetch=0), ValueError,
     "prefetch must be a positive integer when num_workers > 0 (the engine keeps at least one batch in flight; "
     "Gluon's 0 loaded each batch only when asked for it), got 0"),
    ("prefetch=0 with threads", gluon, dict(num_workers=2, prefetch=0, thread_pool=True), ValueError,
     "prefetch must be a positive integer when num_workers > 0 (the engine keeps at least one batch in flight; "
     "Gluon's 0 loaded each batch only when asked for it), got 0"),
    ("shared_mem=2**62", gluon, dict(num_workers=1, shared_mem=2**62), ValueError,
     f"shared_mem must be at most {RING_SLOT_BYTES} bytes (the largest slot the ring can make), got {2**62}"),
    ("shared_mem=2**64", gluon, dict(num_workers=1, shared_mem=2**64), ValueError,
     f"shared_mem must be at most {RING_SLOT_BYTES} bytes (the largest slot the ring can make), got {2**64}"),
    ("shared_mem=-1", gluon, dict(shared_mem=-1), ValueError,
     "shared_mem must be a non-negative integer or None, got -1"),
    ("shared_mem='1'", gluon, dict(shared_mem="1"), TypeError,
     "shared_mem must be a non-negative integer or None, got '1' (str)"),
    ("timeout=-1", gluon, dict(timeout=-1), ValueError,
     "timeout must be a non-negative number of seconds or None, got -1"),
    ("timeout=nan", gluon, dict(timeout=math.nan), ValueError,
     "timeout must be a non-negative number of seconds or None, got nan"),
    ("timeout='1'", gluon, dict(timeout="1"), TypeError,
     "timeout must be a non-negative number of seconds or None, got '1' (str)"),
    ("seed=-1", gluon, dict(seed=-1), ValueError, "seed must be a non-negative integer or None, got -1"),
    ("seed='abc'", gluon, dict(seed="abc"), TypeError, "seed must be a non-negative integer or None, got 'abc' (str)"),
    ("batch_size=0", gluon, dict(batch_size=0), ValueError, "batch_size must be a positive integer, got 0"),
    ("batch_size=2.5", gluon, dict(batch_size=2.5), TypeError,
     "batch_size must be a positive integer, got 2.5 (float)"),
    ("last_batch='drop'", gluon, dict(last_batch="drop"), ValueError,
     "last_batch must be one of 'keep', 'discard', 'rollover', got 'drop'"),
    ("batchify_fn=3", gluon, dict(batchify_fn=3), TypeError, "batchify_fn must be callable or None, got 3"),
    ("pin_device_id=-1", gluon, dict(pin_device_id=-1), ValueError,
     "pin_device_id must be a non-negative integer, got -1"),
    ("sharded prefetch=5000", sharded, dict(num_workers=1, prefetch=5000), ValueError,
     f"prefetch must be at most {PREFETCH_LIMIT} (the ring holds at most {RING_SLOTS} slots and the engine uses "
     "prefetch + 3), got 5000"),
    ("sharded num_workers=-3", sharded, dict(num_workers=-3), ValueError,
     "num_workers must be a non-negative integer, got -3"),
    ("chainer n_processes=-1", chainer, dict(n_processes=-1), ValueError,
     "n_processes must be a non-negative integer, got -1"),
    ("chainer n_prefetch=5000", chainer, dict(n_prefetch=5000), ValueError,
     f"n_prefetch must be at most {PREFETCH_LIMIT} (the ring holds at most {RING_SLOTS} slots and the engine uses "
     "n_prefetch + 3), got 5000"),
    ("chainer n_prefetch=0 with workers", chainer, dict(n_processes=2, n_prefetch=0), ValueError,
     "n_prefetch must be a positive integer when n_processes > 0 (the engine keeps at least one batch in flight; "
     "Gluon's 0 loaded each batch only when asked for it), got 0"),
    ("chainer dataset_timeout=-1", chainer, dict(dataset_timeout=-1), ValueError,
     "dataset_timeout must be a non-negative number of seconds or None, got -1"),
    ("chainer seed=1.0", chainer, dict(seed=1.0), TypeError,
     "seed must be a non-negative integer or None, got 1.0 (float)"),
    ("sampler length=-1", lambda **kw: mploader.SequentialSampler(**kw), dict(length=-1), ValueError,
     "length must be a non-negative integer, got -1"),
    ("sampler batch_size=0", lambda **kw: mploader.BatchSampler(mploader.SequentialSampler(4), **kw),
     dict(batch_size=0), ValueError, "batch_size must be a positive integer, got 0"),
    ("options timeout_s=-1", LoaderOptions, dict(timeout_s=-1), ValueError,
     "timeout_s must be a non-negative number of seconds or None, got -1"),
]


@pytest.mark.parametrize("make, kwargs, exc_type, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_type_and_message(make, kwargs, exc_type, message):
    with pytest.raises(exc_type, match=f"^{re.escape(message)}$") as info:
        make(**kwargs)
    assert type(info.value) is exc_type


def test_chainer_shared_mem_limit_is_per_example():
    # a slot holds batch_size examples: the per-example limit shrinks as batch_size grows
    for batch_size in (2, 64):
        limit = (RING_SLOT_BYTES - 4096) // batch_size - 128
        chainer(batch_size=batch_size, shared_mem=limit)  # the largest accepted value
        with pytest.raises(ValueError, match=re.escape(
                f"shared_mem must be at most {limit} bytes per example with batch_size={batch_size} "
                f"(a slot holds at most {RING_SLOT_BYTES} bytes), got {limit + 1}")):
            chainer(batch_size=batch_size, shared_mem=limit + 1)


def test_huge_shared_mem_fails_at_construction_and_keeps_fd_0():
    """issue 8: shared_mem=2**64 used to fail only at the first next(), and a half-built
    Region then closed fd 0.  Now it never gets that far."""
    before = os.fstat(0)
    for shared_mem in (2**62, 2**64):
        with pytest.raises(ValueError, match="shared_mem"):
            mploader.DataLoader(np.zeros((8, 4)), batch_size=2, num_workers=1, shared_mem=shared_mem)
    gc.collect()
    after = os.fstat(0)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)


def test_limits_are_accepted_exactly_at_the_bound():
    options = LoaderOptions(num_workers=2, prefetch=PREFETCH_LIMIT, shared_mem=RING_SLOT_BYTES)
    assert options.num_slots == RING_SLOTS
    # Nothing is clamped: what was asked is what the engine gets.
    kwargs = LoaderOptions(num_workers=3, prefetch=1, timeout_s=0, seed=5).engine_kwargs()
    assert kwargs["prefetch"] == 1 and kwargs["timeout_s"] is None and kwargs["seed"] == 5
    # Chainer keeps every worker busy: max(n_prefetch, n_processes) in flight.
    assert LoaderOptions(num_workers=3, prefetch=1, busy_workers=True).engine_kwargs()["prefetch"] == 3


def test_prefetch_zero_without_workers_is_accepted():
    # Gluon's default with num_workers=0 is prefetch 0; nothing is in flight there.
    with mploader.DataLoader(np.arange(6), batch_size=2, prefetch=0) as loader:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


def test_numpy_integers_are_integers():
    with mploader.DataLoader(np.arange(6), batch_size=np.int64(3), num_workers=np.int32(1),
                             prefetch=np.uint8(2)) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]


def test_options_are_frozen_and_slotted():
    options = LoaderOptions(num_workers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_workers = 3  # type: ignore[misc]
    assert not hasattr(options, "__dict__")
    assert options.prefetch == 4, "Gluon's default: 2 * num_workers"
    # the default may rise while batches are small (docs/design.md, "Batches in flight")
    deepest = _options.AUTO_PREFETCH_PER_WORKER * 2
    assert options.auto_prefetch == deepest and options.num_slots == deepest + _options.EXTRA_SLOTS
    explicit = LoaderOptions(num_workers=2, prefetch=4, seed=options.seed)
    assert explicit.auto_prefetch is None and explicit.num_slots == 7
    assert options != explicit
    assert options == LoaderOptions(num_workers=2, seed=options.seed)


# ---------------------------------------------------------------- one seed default for every face


def face_seeds():
    """The base seed each face resolves for ``seed=None`` (Chainer with shuffle=False:
    its ShuffleOrderSampler draws an order from the global RNG at construction, as
    Chainer's does)."""
    return {
        "DataLoader": mploader.DataLoader(np.arange(4), batch_size=2)._options.seed,
        "ShardedDataLoader": mploader.ShardedDataLoader(np.arange(4), batch_size=2)._options.seed,
        "MultiprocessIterator": mploader.MultiprocessIterator(np.arange(4), 2, n_processes=0, shuffle=False)._seed,
    }


def test_default_seed_is_one_rule_for_every_face():
    np.random.seed(7)
    want = int(np.random.RandomState(7).randint(0, 2**63 - 1, dtype=np.int64))
    state = np.random.get_state()
    seeds = face_seeds()
    assert set(seeds.values()) == {want}, seeds
    assert default_seed() == want
    after = np.random.get_state()
    assert after[0] == state[0] and np.array_equal(after[1], state[1]) and after[2:] == state[2:], \
        "reading the default seed must not advance NumPy's global RNG"
    np.random.seed(8)
    assert set(face_seeds().values()) == {int(np.random.RandomState(8).randint(0, 2**63 - 1, dtype=np.int64))}


def test_default_seed_leaves_chainer_orders_as_chainer_draws_them():
    # Chainer's ShuffleOrderSampler draws from NumPy's global RNG: creating the
    # iterator (which resolves the seed) must not shift that stream.
    np.random.seed(3)
    with mploader.MultiprocessIterator(np.arange(5), 5, n_processes=0) as it:
        got = [[int(x) for x in it.next()] for _ in range(3)]
    ref = np.random.RandomState(3)
    assert got == [ref.permutation(5).tolist() for _ in range(3)]
