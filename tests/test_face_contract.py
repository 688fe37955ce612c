"""The worker contract (mploader._face.Face, run by mploader._worker.Batches): the
loop loads, plans, collates, publishes and learns; a face only loads and collates.

Each case runs the loop's own steps on a real one-slot region (test_plan.OneSlot)
and checks what the face was asked to do, against the samples and batches the
face's rule makes of them without a slot.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_plan import OneSlot, gluon_numpy

from mploader import _bad_samples, _ring
from mploader import _descriptor as D
from mploader._chainer_inline import fetch_examples
from mploader._face import Face
from mploader._worker import Batches
from mploader.dataloader import BatchifyFetch
from mploader.sharded import ShardedFetch

pytestmark = pytest.mark.timeout(120)


class Counting(BatchifyFetch):
    """Gluon's default rule, counting the face's steps."""

    __slots__ = ("calls",)

    def __init__(self):
        super().__init__(None)
        self.calls = []

    def load(self, dataset, indices):
        self.calls.append(("load", list(indices)))
        return super().load(dataset, indices)

    def collate(self, samples, alloc):
        self.calls.append(("collate", len(samples)))
        return super().collate(samples, alloc)


def samples_of(b, n=8):
    return [(np.full(3, b * n + i, np.float32), b * n + i) for i in range(n)]


def test_a_repeating_structure_is_collated_by_the_face_once_then_by_the_loops_plan():
    face = Counting()
    slot = OneSlot(fetch=face)
    try:
        for b in range(4):
            got, planned = slot.load(samples_of(b))
            assert planned == (b > 0)
            np.testing.assert_equal(got, gluon_numpy(samples_of(b)))
        assert [c[0] for c in face.calls] == ["load", "collate", "load", "load", "load"]
        # one cache per worker: the structure's encoding and its plan
        assert len(slot.batches.structures.layouts) == 1 and list(slot.batches.structures.plans) == [8]
    finally:
        slot.close()


def test_the_writers_of_a_worker_share_its_structure_cache_not_the_process_one():
    batches = Batches(BatchifyFetch(None))
    region = _ring.create_region(1, 1 << 16)
    try:
        D._LAYOUTS.clear()
        region.assign(0, 1)
        writer = batches.writer(region, 0, 1)
        assert writer.structures is batches.structures is batches.planner.structures
        batch, planned = batches.make(samples_of(0), range(8), writer)
        batches.deliver(_no_pipe, writer, 1, _ring.KIND_SLOT, batch)
        assert not planned and len(batches.structures.layouts) == 1 and not D._LAYOUTS
        del batch, writer
        region.wait(0, 0)
    finally:
        region.close()


def _no_pipe(data):
    raise AssertionError("the batch went through the pipe")


@pytest.mark.parametrize("face", [fetch_examples, BatchifyFetch(lambda s: list(s))],
                         ids=["chainer examples", "gluon batchify_fn"])
def test_a_face_whose_batches_are_not_plannable_learns_no_plan(face):
    slot = OneSlot(fetch=face)
    try:
        for b in range(3):
            got, planned = slot.load(samples_of(b))
            assert not planned
            assert len(got) == 8 and all(int(x[1]) == b * 8 + i for i, x in enumerate(got))
        assert slot.planner.pending is None and not slot.batches.structures.plans
    finally:
        slot.close()


def test_a_sharded_batch_is_never_planned_and_a_plain_one_is():
    slot = OneSlot(fetch=ShardedFetch(None))
    try:
        data = [(np.full(2, i, np.int64), i) for i in range(12)]
        for _ in range(3):
            region, seq = slot.region, slot.seq + 1
            slot.seq = seq
            region.assign(0, seq)
            writer = slot.batches.writer(region, 0, seq)
            batch, planned = slot.batches.make(data, [[0, 1], [2, 3, 4]], writer)
            assert not planned and len(batch) == 2
            np.testing.assert_equal(batch[1], gluon_numpy([data[2], data[3], data[4]]))
            slot.batches.deliver(_no_pipe, writer, seq, _ring.KIND_SLOT, batch)
            slot.batches.learn(writer)
            del batch, writer
            region.wait(0, 0)
        assert not slot.batches.structures.plans
        planned = [slot.load(data[:4])[1] for _ in range(3)]
        assert planned == [False, True, True]
    finally:
        slot.close()


class Flaky:
    """Samples ``(array, i)``; index 3 raises."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 3:
            raise KeyError(f"sample {i} is broken")
        return (np.full(2, i, np.int32), i)


def test_on_error_skip_loads_again_without_the_bad_sample_and_collates_once():
    face = Counting()
    reports = []
    guard = _bad_samples.Guard(Flaky(), "skip", 0, reports.append)
    batch, planned = Batches(face).make(None, [1, 2, 3, 4], None, guard)
    assert not planned
    assert face.calls == [("load", [1, 2, 3, 4]), ("load", [1, 2, 4]), ("collate", 3)]
    np.testing.assert_equal(batch, gluon_numpy([Flaky()[i] for i in (1, 2, 4)]))
    assert len(reports) == 1 and pickle.loads(reports[0][_bad_samples.PIPE_HEADER.size:])["index"] == 3


def test_a_plain_fetch_callable_is_called_as_it_is_with_the_slots_alloc():
    seen = []

    def fetch(dataset, indices, alloc):
        seen.append((dataset, list(indices)))
        out = alloc((len(indices),), np.int64)
        out[:] = [dataset[i] for i in indices]
        return out

    batches = Batches(fetch)
    assert batches.face is None and batches.planner is None
    region = _ring.create_region(1, 1 << 16)
    try:
        region.assign(0, 1)
        writer = batches.writer(region, 0, 1)
        data = list(range(10, 20))
        batch, planned = batches.make(data, [1, 5], writer)
        assert not planned and seen == [(data, [1, 5])] and list(batch) == [11, 15]
        assert id(batch) in writer.handed  # in the slot, not a heap array
        batches.deliver(_no_pipe, writer, 1, _ring.KIND_SLOT, batch)
        del batch, writer
        region.wait(0, 0)
    finally:
        region.close()


def test_face_call_is_the_steps_without_a_plan():
    class Doubling(Face):
        __slots__ = ()

        def load(self, dataset, indices):
            return [dataset[i] for i in indices]

        def collate(self, samples, alloc):
            out = alloc((len(samples),), np.int64)
            out[:] = samples
            return out

        def side(self):
            return b"t"

        def wrap(self, collated):
            return collated * 2

    got = Doubling()(list(range(10)), [3, 4], np.empty)
    assert list(got) == [6, 8]   # (the side record travels beside a worker's batch only)
    with pytest.raises(NotImplementedError):
        Face().load([], [])
