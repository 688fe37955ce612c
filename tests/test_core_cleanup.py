"""No leak: processes, fds, shared mappings and /dev/shm come back to where they were.

Beyond the per-test check of ``conftest.py``, these tests count resources across
many loaders: 200 loaders created, iterated and closed; loaders dropped without
``close()``; ``close()`` twice; the context manager; batches outliving ``close()``.
"""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import psutil
import pytest
from _leaks import Snapshot, check, child_pids, memfd_mappings

import mploader

pytestmark = pytest.mark.timeout(90)


class Small:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.full((2, 3), i, np.float32), i


def check_epoch(loader):
    n = 0
    for k, (x, y) in enumerate(loader):
        idx = list(range(4 * k, min(10, 4 * k + 4)))
        np.testing.assert_array_equal(y, idx)
        np.testing.assert_array_equal(x, np.stack([np.full((2, 3), i, np.float32) for i in idx]))
        n += 1
    assert n == 3


def counts():
    """What this process tree holds, after a full collection (tests/_leaks.py)."""
    gc.collect()
    return Snapshot()


def assert_back_to(start, what="now"):
    """Nothing held now that was not held at ``start``: children, fds, shared mappings,
    and /dev/shm entries this process tree made."""
    problems = check(start)
    assert not problems, f"{what}: " + "\n".join(problems)


def test_200_loaders_created_iterated_closed():
    start = counts()
    pids_seen = set()
    for _ in range(200):
        loader = mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0)
        check_epoch(loader)
        pids = loader.worker_pids()
        assert len(pids) == 2
        # (pid, start time): a pid alone can come back (pid_max may be 32768 on a busy runner)
        pids_seen.update((p, psutil.Process(p).create_time()) for p in pids)
        loader.close()
        assert loader.worker_pids() == []
    del loader
    assert_back_to(start, "after 200 loaders")
    assert len(pids_seen) == 400
    assert not {p for p, _ in pids_seen} & child_pids()  # none is a child now, not even a zombie


def test_loaders_dropped_without_close_are_cleaned_up():
    start = counts()
    for _ in range(20):
        loader = mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0)
        check_epoch(loader)
        del loader  # no close(): the weakref.finalize backstop must release everything
    assert_back_to(start)


def test_loader_dropped_mid_epoch_with_batches_held():
    start = counts()
    loader = mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0)
    it = iter(loader)
    first = next(it)
    pids = loader.worker_pids()
    del loader
    gc.collect()
    # The running epoch keeps the engine alive on its own ...
    second = next(it)
    np.testing.assert_array_equal(second[1], [4, 5, 6, 7])
    assert set(pids) <= child_pids()
    # ... and once the iterator and the batches go, everything goes.
    del it
    np.testing.assert_array_equal(first[1], [0, 1, 2, 3])
    del first, second
    assert_back_to(start)


def test_close_is_idempotent_and_final():
    loader = mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0)
    check_epoch(loader)
    loader.close()
    loader.close()
    assert loader.worker_pids() == []
    assert not child_pids()
    with pytest.raises(RuntimeError, match="closed"):
        list(loader)
    loader.close()
    # Closing a loader that never started workers, and a num_workers=0 loader.
    mploader.DataLoader(Small(), batch_size=4, num_workers=2).close()
    inline = mploader.DataLoader(Small(), batch_size=4, num_workers=0)
    inline.close()
    inline.close()


def test_close_during_iteration_raises_and_releases():
    loader = mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0)
    it = iter(loader)
    batch = next(it)
    loader.close()
    assert not child_pids()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    # The batch returned before close() stays valid.
    np.testing.assert_array_equal(batch[1], [0, 1, 2, 3])
    np.testing.assert_array_equal(batch[0][3], np.full((2, 3), 3, np.float32))


def test_context_manager_closes_on_exit_and_on_error():
    with mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0) as loader:
        assert isinstance(loader, mploader.DataLoader)
        check_epoch(loader)
        pids = loader.worker_pids()
        assert set(pids) == child_pids()
    assert loader.worker_pids() == [] and not child_pids()

    with pytest.raises(KeyError, match="inside the with block"):
        with mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0) as loader:
            next(iter(loader))
            raise KeyError("inside the with block")
    assert loader.worker_pids() == [] and not child_pids()


def test_batch_outlives_close():
    """close() stops the workers at once; shared memory held by a live batch stays
    mapped (and valid) until that batch is dropped."""
    maps_before = len(memfd_mappings())
    with mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0) as loader:
        batches = list(loader)
    assert not child_pids()
    for k, (x, y) in enumerate(batches):
        np.testing.assert_array_equal(y, list(range(4 * k, min(10, 4 * k + 4))))
        assert (x == y[:, None, None]).all()
    del batches, x, y
    gc.collect()
    assert len(memfd_mappings()) == maps_before


class BlocksAfterFirstBatch:
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i >= 4:
            threading.Event().wait()  # blocks until the worker is killed
        return np.full(2, i), i


def close_with_workers_stuck_in_dataset():
    """Seconds close() took with both workers blocked for ever in ``__getitem__`` (a
    close() that waited for them would hang: the module's timeout fails the test)."""
    loader = mploader.DataLoader(BlocksAfterFirstBatch(), batch_size=4, num_workers=2, seed=0)
    it = iter(loader)
    next(it)
    start = time.monotonic()
    loader.close()
    elapsed = time.monotonic() - start
    assert not child_pids()
    del it
    return elapsed


def test_close_with_workers_stuck_in_dataset():
    close_with_workers_stuck_in_dataset()


@pytest.mark.timing
def test_close_with_workers_stuck_in_dataset_takes_the_grace_period_only():
    elapsed = close_with_workers_stuck_in_dataset()
    assert elapsed < 5, f"close() took {elapsed:.2f} s with stuck workers"


def test_two_loaders_alive_at_once():
    """Workers forked for one loader must not hold on to another's resources."""
    start = counts()
    a = mploader.DataLoader(Small(), batch_size=4, num_workers=2, seed=0)
    b = mploader.DataLoader(Small(), batch_size=4, num_workers=1, seed=1)
    ia, ib = iter(a), iter(b)
    for _ in range(3):
        np.testing.assert_array_equal(next(ia)[1], next(ib)[1])
    assert len(child_pids()) == 3
    a.close()
    assert set(child_pids()) == set(b.worker_pids())
    check_epoch(b)
    b.close()
    del ia, ib
    assert_back_to(start)
