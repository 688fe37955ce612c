"""Batch plans (mploader._plan, _columns.BatchPlan): a batch written by a plan is the
batch the face's rule makes of its samples, whatever the samples do -- the same
structure again, or a sample that differs in type, dtype, shape, length or layout
anywhere in the batch (then the generic path writes it, in the same slot, over
what the plan had begun).

The references are not mploader's collation: for the Gluon face its rule restated
with NumPy (``np.asarray`` per field of tuple samples), for the torch face
``torch.utils.data.default_collate`` itself (as in a worker of torch's DataLoader).  The slot is a real one-slot region,
written and read the way a worker and the parent do.  The torch face's cases are in
test_plan_torch.py, which reuses this module's slot and sample makers."""
from __future__ import annotations

import numpy as np
import pytest
from _util import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mploader
from mploader import _columns, _plan, _ring
from mploader import _descriptor as D
from mploader._worker import Batches
from mploader.dataloader import BatchifyFetch

try:
    import torch
except ImportError:  # the core suite runs without torch; the torch face's plans: test_plan_torch.py
    torch = None

pytestmark = pytest.mark.timeout(120)


def gluon_numpy(samples):
    """Gluon's ``default_batchify_fn`` with NumPy arrays: tuples are zipped and each
    field batched (a list); anything else is ``np.asarray`` of the samples, or the
    samples unchanged where NumPy makes no array of them."""
    if isinstance(samples[0], tuple):
        return [gluon_numpy(list(col)) for col in zip(*samples)]
    try:
        arr = np.asarray(samples)
    except (ValueError, TypeError, OverflowError):
        return list(samples)
    return list(samples) if arr.dtype.hasobject else arr


class OneSlot:
    """A one-slot region and one worker's batch steps (``mploader._worker.Batches``,
    what ``_loop`` runs); :meth:`load` runs a batch the way the loop does and returns
    (the decoded batch, whether a plan wrote it); ``side``: the batch's side record."""

    def __init__(self, slot_bytes=1 << 16, fetch=None):
        self.region = _ring.create_region(1, slot_bytes)
        self.batches = Batches(BatchifyFetch(None) if fetch is None else fetch)
        self.planner = self.batches.planner
        self.seq = 0
        self.before_learning = None   # runs between a generic batch's publication and learn()
        self.side = None              # the last batch's side record (the face's side(), after the descriptor)

    @staticmethod
    def _send(data):
        raise AssertionError("the batch went through the pipe, not the slot")

    def load(self, samples):
        self.seq += 1
        self.region.assign(0, self.seq)
        writer = self.batches.writer(self.region, 0, self.seq)
        try:
            batch, planned = self.batches.make(samples, range(len(samples)), writer)
        except Exception:
            self.region.publish(0, _ring.KIND_ERROR, 0, 0)  # as the worker: the slot carries the error
            self.region.wait(0, 0)  # the lease, dropped at once: the slot is free again
            raise
        if not planned:
            self.batches.deliver(self._send, writer, self.seq, _ring.KIND_SLOT, batch)
            del batch
            if self.before_learning is not None:
                self.before_learning()
            self.batches.learn(writer)
        lease = self.region.wait(0, 0)
        got = D.decode(lease, lease.desc_off, lease.desc_len, copy=True)
        self.side = D.side_record(lease)
        del lease
        return got, planned

    def close(self):
        self.region.close()


@pytest.fixture
def slot():
    s = OneSlot()
    yield s
    s.close()


DTYPES = ["bool", "int8", "uint8", "int32", "int64", "uint64", "float16", "float32", "float64", "complex64"]
SCALARS = [np.int64, np.int32, np.uint8, np.float32, np.float64, np.bool_, np.complex128]

leaf_specs = st.one_of(
    st.tuples(st.just("array"), st.sampled_from(DTYPES),
              st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)),
    st.tuples(st.sampled_from(["int", "float", "bool"])),
    st.tuples(st.just("scalar"), st.sampled_from(SCALARS)),
)
structures = st.tuples(st.booleans(), st.lists(leaf_specs, min_size=1, max_size=4))


def make_leaf(spec, value):
    kind = spec[0]
    if kind == "array":
        dtype, shape = np.dtype(spec[1]), spec[2]
        raw = (np.arange(int(np.prod(shape)) * dtype.itemsize, dtype=np.int64) * 7 + value) % 251
        return raw.astype(np.uint8).view(dtype).reshape(shape) if dtype.kind != "b" else \
            (raw % 2).astype(bool).reshape(shape)
    if kind == "tensor":
        return torch.from_numpy(make_leaf(("array",) + spec[1:], value).copy())
    if kind == "int":
        return value * 3 - 7
    if kind == "float":
        return value / 4
    if kind == "bool":
        return value % 2 == 0
    return spec[1](value % 100)


def perturbed_batch(structure, batch_size, b, change):
    """Batch ``b``'s samples; ``change`` (or None): (which sample, how) to perturb."""
    samples = [make_sample(structure, 10 * b + i) for i in range(batch_size)]
    if change is not None:
        where, how = change
        samples[where % batch_size] = perturb(samples[where % batch_size], how, structure)
    return samples


def make_sample(structure, value):
    in_tuple, leaves = structure
    if in_tuple:
        return tuple(make_leaf(spec, value + k) for k, spec in enumerate(leaves))
    return make_leaf(leaves[0], value)


def perturb(sample, how, structure):
    """``sample`` changed in one way a plan must notice."""
    in_tuple, leaves = structure
    fields = list(sample) if in_tuple else [sample]
    k = how % len(fields)
    leaf = fields[k]
    kind = how // 8 % 8
    if kind == 0 and in_tuple:
        return list(sample)                                   # a list, not a tuple
    if kind == 1 and in_tuple:
        return tuple(fields[:-1]) if len(fields) > 1 else tuple(fields) + (1,)  # another length
    if torch is not None and isinstance(leaf, torch.Tensor):
        fields[k] = [
            lambda t: t.double() if t.dtype != torch.float64 else t.float(),      # another dtype: cast by stack
            lambda t: t.reshape((1,) + tuple(t.shape)),                           # another shape: stack refuses
            lambda t: t.repeat_interleave(2)[::2].reshape(t.shape) if t.numel() else t[None],  # not contiguous
            lambda t: t.numpy().copy(),                                           # an array, not a tensor
            lambda t: t.float().requires_grad_(),                                 # stack(out=) refuses autograd
            lambda t: torch.nn.Parameter(t.float(), requires_grad=False),         # a Tensor subclass
            lambda t: t.to(torch.float16),
            lambda t: t.clone(),                                                  # the same, another tensor
        ][kind](leaf)
    elif isinstance(leaf, np.ndarray):
        if kind == 2:
            fields[k] = leaf.reshape(-1).view(np.uint8)  # another dtype (and shape)
        elif kind == 3 and leaf.ndim:
            fields[k] = np.concatenate([leaf, leaf[..., :1]], axis=-1)  # one more along the last axis
        elif kind == 6 and leaf.ndim >= 2 and leaf.shape != leaf.shape[::-1]:
            fields[k] = leaf.reshape(leaf.shape[::-1])                  # the same bytes, another shape
        elif kind == 7:
            fields[k] = leaf.reshape((1,) + leaf.shape)                 # one more dimension
        elif kind == 4 and leaf.ndim and leaf.shape[-1] > 1:
            fields[k] = np.repeat(leaf, 2, axis=-1)[..., ::2]   # same shape, not contiguous
        elif kind == 5 and leaf.dtype.itemsize > 1:
            fields[k] = leaf.astype(leaf.dtype.newbyteorder(">"))  # byte-swapped
        else:
            fields[k] = leaf.tolist() if leaf.ndim else leaf.item()  # not an array
    elif type(leaf) is int:
        fields[k] = [2 ** 70, 1.5, True, np.int64(3)][kind % 4]  # beyond int64, or another type
    elif type(leaf) is float:
        fields[k] = [np.float64(2.5), 3, True][kind % 3]
    elif type(leaf) is bool:
        fields[k] = [1, np.bool_(True)][kind % 2]
    else:
        fields[k] = [float(leaf.real) if np.iscomplexobj(leaf) else leaf.item(), np.int16(1)][kind % 2]
    return tuple(fields) if in_tuple else fields[0]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structure=structures, batch_size=st.integers(1, 6),
       changes=st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, 127))),
                        min_size=2, max_size=6))
def test_every_batch_is_gluons_batch_of_its_samples(structure, batch_size, changes):
    slot = OneSlot()
    try:
        planned_batches = 0
        for b, change in enumerate(changes):
            samples = perturbed_batch(structure, batch_size, b, change)
            got, planned = slot.load(samples)
            assert_same(got, gluon_numpy(samples))
            planned_batches += planned
            if planned:
                assert change is None or (type(samples[0]) is tuple) == structure[0]
        assert planned_batches <= len(changes) - 1  # the first batch cannot have a plan
    finally:
        slot.close()


def test_the_loaders_tiny_structure_goes_by_a_plan_after_its_first_batch(slot):
    """(np.int64 label, float32 (16,)) samples, as the transport suite's tiny batches."""
    rng = np.random.default_rng(0)
    for b in range(5):
        samples = [(np.int64(b * 32 + i), rng.random(16, dtype=np.float32)) for i in range(32)]
        got, planned = slot.load(samples)
        assert planned == (b > 0)
        assert_same(got, gluon_numpy(samples))


@pytest.mark.parametrize("where", [0, 16, 31])
def test_a_sample_that_differs_is_batched_by_the_generic_path_in_the_same_slot(slot, where):
    """The plan has written the samples before ``where`` when it meets the odd one out."""
    def sample(i, dtype=np.float32):
        return (i, np.full(3, i, dtype))

    slot.load([sample(i) for i in range(32)])
    assert slot.load([sample(i + 32) for i in range(32)])[1]
    samples = [sample(i + 64, np.float64 if i == where else np.float32) for i in range(32)]
    got, planned = slot.load(samples)
    assert not planned
    assert_same(got, gluon_numpy(samples))
    samples = [(2 ** 63 if i == where else i, np.full(3, i, np.float32)) for i in range(32)]
    got, planned = slot.load(samples)  # an int beyond int64: NumPy makes no int64 column of them
    assert not planned and got[0].dtype != np.int64
    assert_same(got, gluon_numpy(samples))


def test_another_batch_size_gets_its_own_plan(slot):
    def batch(n, start):
        return [np.arange(4, dtype=np.int32) + start + i for i in range(n)]

    assert [slot.load(batch(n, 7 * k))[1] for k, n in enumerate([8, 8, 3, 8, 3])] == [False, True, False, True, True]


def test_a_slot_too_small_for_the_plan_goes_the_generic_way_and_grows():
    slot = OneSlot(slot_bytes=4096)
    try:
        samples = [np.full(100, i, np.int64) for i in range(4)]      # 3.2 KB: fits
        slot.load(samples)
        assert slot.load(samples)[1]
        big = [np.full(100, i, np.int64) for i in range(40)]          # 32 KB: the slot grows
        got, planned = slot.load(big)
        assert not planned
        assert_same(got, gluon_numpy(big))
    finally:
        slot.close()


def test_learning_stops_when_every_batch_has_another_structure(slot):
    for n in range(_plan.MAX_UNUSED_PLANS + 3):
        samples = [np.zeros(n + 1, np.float32) for _ in range(4)]   # a new shape every batch
        got, planned = slot.load(samples)
        assert not planned
        assert_same(got, gluon_numpy(samples))
    assert slot.planner.unused == _plan.MAX_UNUSED_PLANS and slot.planner.pending is None


def test_batch_plan_refuses_a_column_that_overlaps_the_descriptor():
    with pytest.raises(ValueError, match="field 0"):
        _columns.BatchPlan(4, False, [(_columns.PLAN_KINDS["int"], int, None, (), 8, 0)], b"x" * 8, 16)
    with pytest.raises(ValueError, match="one field"):
        _columns.BatchPlan(4, False, [(_columns.PLAN_KINDS["int"], int, None, (), 8, 0)] * 2, b"", 64)


def test_a_loader_with_structures_changing_mid_epoch_gives_gluons_batches():
    """Through real workers: every 7th sample's array is float64, the last batch is short."""
    class Data:
        def __len__(self):
            return 103

        def __getitem__(self, i):
            return (i, np.full((2, 3), i, np.float64 if i % 7 == 0 and i > 40 else np.float32))

    data = Data()
    with mploader.DataLoader(data, 10, num_workers=2, seed=0) as loader:
        for _epoch in range(2):
            got = [[np.array(x) for x in batch] for batch in loader]
            want = [gluon_numpy([data[i] for i in range(s, min(s + 10, 103))]) for s in range(0, 103, 10)]
            assert len(got) == len(want) == 11
            for g, w in zip(got, want):
                assert_same(g, w)


def test_timedelta_scalars_have_no_plan_their_unit_is_per_value(slot):
    same = [(np.timedelta64(i, "s"), i) for i in range(4)]
    assert not slot.load(same)[1]
    assert not slot.load(same)[1]       # no plan was learnt for the timedelta column
    mixed = [(np.timedelta64(i, "ms" if i % 2 else "s"), i) for i in range(4)]
    got, planned = slot.load(mixed)
    assert not planned
    assert_same(got, gluon_numpy(mixed))


def test_a_plan_is_learnt_from_the_descriptor_as_written_not_as_the_slot_holds_it_later(slot):
    """Regression: the plan read the descriptor back from the slot after publishing it;
    by then the parent may have taken and freed the slot and another worker written
    its own batch there (seen as a batch of worker 1 arriving with worker 0's id in
    the torch face).  Here the slot is taken and rewritten with another structure's
    batch between the publication and learn()."""
    def rewrite():
        slot.region.wait(0, 0)   # the parent takes the batch and drops it: the slot is free
        slot.seq += 1
        slot.region.assign(0, slot.seq)
        other = D.SlotWriter(slot.region, 0, slot.seq)
        assert other.finish([np.arange(7, dtype=np.int16), "another worker's batch"]) is None

    def batch(start):
        return [(start + i, np.full(3, start + i, np.float32)) for i in range(4)]

    slot.before_learning = rewrite
    got, planned = slot.load(batch(0))  # (what load reads back is the rewritten batch)
    assert not planned and got[1] == "another worker's batch"
    slot.before_learning = None
    for start in (10, 20):
        got, planned = slot.load(batch(start))
        assert planned
        assert_same(got, gluon_numpy(batch(start)))
