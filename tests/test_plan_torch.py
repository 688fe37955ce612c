"""Batch plans of the torch face: a batch written by a plan is the batch
``torch.utils.data.default_collate`` makes of its samples (run as in a worker of torch's
DataLoader), whatever the samples do.  The slot and the sample makers are
test_plan.py's; this module needs torch, the core suite does not."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _torch_util import as_torch_worker, assert_same_batch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_plan import OneSlot, perturbed_batch  # noqa: E402

import mploader.torch as mpt  # noqa: E402
from mploader import _rng_state, _torch_collate, _torch_worker  # noqa: E402
from mploader import _worker as mpl_worker  # noqa: E402

pytestmark = pytest.mark.timeout(120)


TORCH_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64"]
torch_leaf_specs = st.one_of(
    st.tuples(st.just("array"), st.sampled_from(TORCH_DTYPES),
              st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)),
    st.tuples(st.just("tensor"), st.sampled_from(TORCH_DTYPES),
              st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)),
    st.tuples(st.sampled_from(["int", "float", "bool"])),
    st.tuples(st.just("scalar"), st.sampled_from([np.int64, np.int32, np.float32, np.float64, np.bool_])),
)


def torch_face_batch(slot, samples):
    """(what mploader.torch's parent makes of the batch, or the exception the worker
    raised; whether a plan wrote it; the RNG states beside it, its side record)."""
    try:
        got, planned = slot.load(samples)
    except Exception as exc:  # noqa: BLE001 - compared with torch's
        return exc, False, None
    payload, kind = got
    assert kind == _torch_worker.ARRAYS
    return _torch_collate.to_tensors(payload), planned, slot.side


@pytest.mark.parametrize("capturing", [True, False], ids=["torch seeding", "seed="])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(structure=st.tuples(st.booleans(), st.lists(torch_leaf_specs, min_size=1, max_size=3)),
       batch_size=st.integers(1, 5),
       changes=st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 127))),
                        min_size=2, max_size=5))
def test_torch_face_batches_are_default_collates(monkeypatch, capturing, structure, batch_size, changes):
    monkeypatch.setattr(mpl_worker, "task_epoch", 0)  # as in a worker's run (states sent once per run)
    cls = _torch_worker.CapturingFetch if capturing else _torch_worker.Fetch
    slot = OneSlot(fetch=cls(_torch_worker.DEFAULT, torch.utils.data.default_collate, True, False))
    try:
        planned_batches = 0
        for b, change in enumerate(changes):
            samples = perturbed_batch(structure, batch_size, b, change)
            if capturing and b % 3 == 2:
                torch.rand(1)  # the dataset drew: this batch carries new RNG states (its side record)
            got, planned, rng = torch_face_batch(slot, samples)
            assert rng is None or rng == _rng_state.capture()
            try:
                with as_torch_worker():
                    want = torch.utils.data.default_collate(samples)
            except Exception as exc:  # noqa: BLE001 - the face must raise the same type
                assert type(got) is type(exc), (got, exc)
                continue
            assert not isinstance(got, Exception), got
            assert_same_batch(got, want)
            planned_batches += planned
        assert planned_batches <= len(changes) - 1
    finally:
        slot.close()


def test_torch_face_batches_with_new_rng_states_go_by_the_same_plan(monkeypatch):
    """With torch's seeding a batch carries the worker's RNG states when they changed
    since its previous batch: the states follow its descriptor in the slot (the side
    record), outside the plan, so batches with and without them share one plan, which
    writes each batch's states after it (checked against capture())."""
    monkeypatch.setattr(mpl_worker, "task_epoch", 0)
    slot = OneSlot(fetch=_torch_worker.CapturingFetch(_torch_worker.DEFAULT, torch.utils.data.default_collate,
                                                      True, False))
    try:
        def samples(b):
            return [(np.full(4, b * 8 + i, np.float32), b * 8 + i) for i in range(8)]

        outcomes = []
        for b in range(7):
            if b in (3, 5):
                torch.rand(1)  # the dataset drew a number: this batch sends the states
            (payload, kind), planned = slot.load(samples(b))
            rng = slot.side
            outcomes.append((rng is not None, planned))
            assert rng is None or rng == _rng_state.capture()
            assert_same_batch(_torch_collate.to_tensors(payload), torch.utils.data.default_collate(samples(b)))
        # batch 0 sends the run's states (its plan is learnt), 1 sends none; from then on
        # each batch goes by that one plan, with or without states
        assert outcomes == [(True, False), (False, True), (False, True), (True, True), (False, True),
                            (True, True), (False, True)]
        assert list(slot.batches.structures.plans) == [8]
    finally:
        slot.close()


def test_torch_loader_with_structures_changing_mid_epoch_gives_torchs_batches():
    """Through real workers, against torch's default_collate as a worker runs it."""
    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 103

        def __getitem__(self, i):
            return (np.full((2, 3), i, np.float64 if i % 7 == 0 and i > 40 else np.float32), i, float(i) / 3,
                    torch.full((4,), i, dtype=torch.int32 if i % 9 == 0 and i > 60 else torch.int64))

    data = Data()
    with as_torch_worker():
        want = [torch.utils.data.default_collate([data[i] for i in range(s, min(s + 10, 103))])
                for s in range(0, 103, 10)]
    with mpt.DataLoader(data, batch_size=10, num_workers=2, persistent_workers=True) as loader:
        for _epoch in range(2):
            got = list(loader)
            assert len(got) == len(want) == 11
            for g, w in zip(got, want):
                assert_same_batch(g, w)


