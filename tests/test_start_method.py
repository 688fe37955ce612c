"""The Gluon face's ``start_method`` (mploader's keyword): spawned and forkserver
workers give the same batches as forked ones (the reference: the in-process loader)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import mploader


def batches(loader):
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_spawned_workers_give_the_in_process_batches(start_method):
    data = np.arange(60, dtype=np.int64).reshape(30, 2)
    want = batches(mploader.DataLoader(data, 4, shuffle=True, seed=3))
    with mploader.DataLoader(data, 4, shuffle=True, seed=3, num_workers=2, start_method=start_method) as dl:
        assert dl._engine.start_method == start_method
        assert batches(dl) == want
        assert batches(dl) != want  # the next epoch's order
    with mploader.ShardedDataLoader(data, 4, num_workers=1, start_method=start_method) as dl:
        assert batches(dl) == batches(mploader.ShardedDataLoader(data, 4))


def test_an_unknown_start_method_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="start_method"):
        mploader.DataLoader(np.arange(4), 2, num_workers=1, start_method="vfork")


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_run_under_sched_batch_and_the_parent_does_not(start_method):
    """docs/design.md, "Workers": a worker's wake-up must not preempt the training loop."""
    before = os.sched_getscheduler(0)
    with mploader.DataLoader(np.arange(8), 4, num_workers=2, start_method=start_method) as dl:
        assert len(list(dl)) == 2
        pids = dl.worker_pids()
        assert len(pids) == 2
        assert [os.sched_getscheduler(pid) for pid in pids] == [os.SCHED_BATCH] * 2
    assert os.sched_getscheduler(0) == before == os.SCHED_OTHER
