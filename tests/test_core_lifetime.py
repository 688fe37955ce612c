"""Lease rule: a slot is reused only after every view of it has been garbage-collected.

A held batch never changes however far the loader runs on; once it (and anything
built on it, such as a torch tensor) is dropped, its slot comes back into use.
``copy=True`` batches own their memory and hold no slot.
"""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
from _util import lease_of

import mploader
from mploader import _options
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(60)

BATCH = 4


class Counting:
    """Sample i: (float32 (5, 3) filled from i, int64 i); batch k is predictable."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.arange(15, dtype=np.float32).reshape(5, 3) + 1000 * i, i


def expected(k):
    idx = range(k * BATCH, (k + 1) * BATCH)
    return np.stack([np.arange(15, dtype=np.float32).reshape(5, 3) + 1000 * i for i in idx]), np.array(idx)


def slot_of(batch):
    leases = {id(lease_of(a)): lease_of(a) for a in batch}
    assert len(leases) == 1, "all arrays of a batch share one lease"
    (lease,) = leases.values()
    assert isinstance(lease, SlotLease)
    return lease.slot


#: Slots of a 2-worker loader with the default prefetch (the deepest queue it keeps).
NUM_SLOTS = _options.AUTO_PREFETCH_PER_WORKER * 2 + _options.EXTRA_SLOTS


@pytest.fixture
def loader():
    # Enough batches to go round every slot 6 times past the held one, and then some.
    with mploader.DataLoader(Counting(BATCH * (8 + 7 * NUM_SLOTS)), batch_size=BATCH, num_workers=2,
                             seed=0) as dl:
        yield dl


def test_held_batch_unchanged_and_its_slot_reused_after_drop(loader):
    it = iter(loader)
    k = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the held-slots warning would be an error here
        for _ in range(k):
            next(it)
        held = next(it)
        held_copy = [a.copy() for a in held]
        held_slot = slot_of(held)
        num_slots = loader.stats()["num_slots"]
        assert num_slots >= 2
        for j in range(k + 1, k + 1 + 3 * num_slots):
            batch = next(it)
            assert slot_of(batch) != held_slot, f"batch {j} reused the slot of held batch {k}"
            np.testing.assert_array_equal(batch[0], expected(j)[0])
            np.testing.assert_array_equal(batch[1], expected(j)[1])
        del batch
        assert [a.tobytes() for a in held] == [c.tobytes() for c in held_copy]
        np.testing.assert_array_equal(held[0], expected(k)[0])
        np.testing.assert_array_equal(held[1], expected(k)[1])

        del held
        gc.collect()
        reused_at = None
        first = j + 1
        for j in range(first, first + 3 * num_slots):
            if slot_of(next(it)) == held_slot:
                reused_at = j
                break
        assert reused_at is not None, f"slot {held_slot} was not reused within {3 * num_slots} batches"
    stats = loader.stats()
    assert stats["no_free_slot"] == 0 and stats["fallback_pipe"] == 0
    assert stats["slot"] == stats["batches"]


def test_base_chain_ends_at_slot_lease(loader):
    batch = next(iter(loader))
    for a in batch:
        assert type(a) is np.ndarray
        lease = lease_of(a)
        assert isinstance(lease, SlotLease)
        assert 0 <= lease.slot < loader.stats()["num_slots"]
        assert lease.nbytes >= a.nbytes
        # The view lies inside the lease's buffer.
        lo = np.frombuffer(lease, np.uint8).ctypes.data
        assert lo <= a.ctypes.data and a.ctypes.data + a.nbytes <= lo + lease.nbytes
    # Derived views keep the chain.
    assert isinstance(lease_of(batch[0][1:, ::2]), SlotLease)


def test_torch_tensor_keeps_slot_alive(loader):
    torch = pytest.importorskip("torch")
    it = iter(loader)
    batch = next(it)
    want = expected(0)[0]
    tensor = torch.from_numpy(batch[0])
    held_slot = slot_of(batch)
    del batch
    gc.collect()
    num_slots = loader.stats()["num_slots"]
    for j in range(1, 1 + 3 * num_slots):
        assert slot_of(next(it)) != held_slot, f"batch {j} reused a slot a live tensor views"
    np.testing.assert_array_equal(tensor.numpy(), want)
    del tensor
    gc.collect()
    assert any(slot_of(next(it)) == held_slot for _ in range(3 * num_slots))
    assert loader.stats()["no_free_slot"] == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_copy_true_gives_owned_arrays(num_workers):
    with mploader.DataLoader(Counting(120), batch_size=BATCH, num_workers=num_workers, copy=True, seed=0) as dl:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batches = list(dl)  # holding every batch costs no slot
        assert len(batches) == 30
        for k, batch in enumerate(batches):
            for a, w in zip(batch, expected(k)):
                assert type(a) is np.ndarray
                assert not isinstance(lease_of(a), SlotLease), "copy=True must not return slot views"
                np.testing.assert_array_equal(a, w)
        if num_workers:
            stats = dl.stats()
            assert stats["no_free_slot"] == 0 and stats["fallback_pipe"] == 0
            assert stats["slot"] == 30
