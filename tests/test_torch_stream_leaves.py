"""Large tensor columns of the torch face copied with streaming stores (issue 24).

A column of at least ``STREAM_MIN_BYTES`` whose leaves are all exact CPU tensors of
the first leaf's dtype and shape is written by ``_columns.copy_rows`` over the leaves'
NumPy views instead of ``torch.stack``; every other column, and every leaf that
``Tensor.numpy()`` or ``copy_rows`` refuses, goes through ``torch.stack`` as before.
The reference is ``torch.utils.data.default_collate`` run as in a torch worker, and
where torch's collate itself raises for a leaf ``torch.stack`` copes with (conj, neg
and zero-tensor bits), the face's answer before the change: ``torch.stack`` into a
tensor of the first leaf's dtype.  Both the generic path (``collate_into``) and a
batch plan's column (``plan_tensor_column``'s ``fill``) are checked, and a spy on
``copy_rows`` says which way each column went.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _torch_util import as_torch_worker, assert_same_batch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

import mploader.torch as mpt  # noqa: E402
from mploader import _columns, _torch_collate  # noqa: E402
from mploader._torch_collate import collate_into, plan_tensor_column, raw_dtype, to_tensors  # noqa: E402

pytestmark = pytest.mark.timeout(120)

#: 8 samples of 128 x 1024 float32 (512 KiB): a column of exactly STREAM_MIN_BYTES.
B, SHAPE = 8, (128, 1024)
assert B * SHAPE[0] * SHAPE[1] * 4 == _columns.STREAM_MIN_BYTES  # the cases below sit at the threshold


def rows(dtype=torch.float32, shape=SHAPE, n=B):
    """n distinct contiguous tensors (rows of one storage: views, as dataset.x[i])."""
    base = torch.arange(n * int(np.prod(shape)), dtype=torch.float64).reshape((n,) + shape) % 251
    return list(base.to(dtype).unbind(0))


class Spy:
    """Records what each ``copy_rows`` call returned."""

    def __init__(self, monkeypatch):
        self.results = []
        real = _columns.copy_rows

        def copy_rows(samples, out):
            done = real(samples, out)
            self.results.append(done)
            return done
        monkeypatch.setattr(_columns, "copy_rows", copy_rows)


def alloc(shape, dtype):
    return np.empty(shape, dtype)


def ours(batch):
    return to_tensors(pickle.loads(pickle.dumps(collate_into(batch, alloc), protocol=5)))


def stacked(batch):
    """The face's answer before streaming: torch.stack into the first leaf's dtype."""
    first = batch[0]
    return torch.stack(batch, 0, out=torch.empty((len(batch),) + tuple(first.shape), dtype=first.dtype))


def reference(batch):
    with as_torch_worker():
        return default_collate(batch)


def complex_rows():
    return [t.to(torch.complex64) * (1 + 2j) for t in rows(n=B // 2)]


#: name -> (leaves, whether copy_rows writes them, reference)
CASES = {
    "contiguous float32 rows": (lambda: rows(), True, reference),
    "int64 rows": (lambda: rows(torch.int64, (64, 1024)), True, reference),
    "uint8 images": (lambda: rows(torch.uint8, (3, 512, 1024)), True, reference),
    "bool rows": (lambda: [t > 100 for t in rows(torch.int16, (8, 512, 1024))], True, reference),
    "complex64 rows": (complex_rows, True, reference),
    "rows of a larger tensor (views with an offset)": (
        lambda: list(torch.arange(B * 2 * 131072, dtype=torch.float32).reshape(B * 2, 131072)[B // 2:B // 2 + B]),
        True, reference),
    # copy_rows declines (nothing written), torch.stack copies
    "non-contiguous leaves (odd strides)": (
        lambda: [t[:, ::2] for t in rows(shape=(128, 2048))], False, reference),
    "transposed leaves": (lambda: [t.t() for t in rows(shape=(1024, 128))], False, reference),
    # Tensor.numpy() refuses: copy_rows is never called
    "bfloat16 (no NumPy dtype)": (lambda: rows(torch.bfloat16, (256, 1024)), None, reference),
    "float16 then float32 (a cast)": (
        lambda: [rows(torch.float16, (256, 1024))[0]] + rows(torch.float32, (256, 1024))[1:], None, reference),
    "a tensor subclass after the first": (
        lambda: [t.as_subclass(Sub) if k == 3 else t for k, t in enumerate(rows())], None,
        lambda b: reference(b).as_subclass(torch.Tensor)),  # (the face's batches hold plain tensors)
    "conj bit": (lambda: [t.conj() for t in complex_rows()], None, stacked),
    "neg bit": (lambda: [torch._neg_view(t) for t in complex_rows()], None, stacked),
    "zero tensors": (lambda: [torch._efficientzerotensor(SHAPE) for _ in range(B)], None, stacked),
    "below STREAM_MIN_BYTES": (lambda: rows(n=B - 1), None, reference),
}


class Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("name", list(CASES))
def test_generic_collation_of_tensor_leaves_is_default_collate(monkeypatch, name):
    make, streamed, want = CASES[name]
    spy = Spy(monkeypatch)
    batch = make()
    assert_same_batch(ours(batch), want(batch))
    assert spy.results == ([] if streamed is None else [streamed])


@pytest.mark.parametrize("name", list(CASES))
def test_a_plan_fills_tensor_leaves_as_default_collate(monkeypatch, name):
    """The plan learnt from a batch of exact CPU float32 tensors of the case's first
    leaf's shape and dtype fills the case's batch as the generic path would."""
    make, streamed, want = CASES[name]
    batch = make()
    first = batch[0]
    if type(first) is not torch.Tensor or first._is_zerotensor() or first.is_conj() or first.is_neg():
        first = first.resolve_conj().resolve_neg().clone().as_subclass(torch.Tensor)  # a plain one to learn from
    column = np.empty((len(batch),) + tuple(first.shape), raw_dtype(first.dtype))
    fill = plan_tensor_column(first, column, len(batch))
    assert fill is not None
    spy = Spy(monkeypatch)
    dest = np.full_like(column, 7)
    if fill(batch, dest):
        assert_same_batch(_torch_collate.as_tensor_view(dest), want(batch))
    else:  # declined: the generic path raises or collates this batch (test above)
        pytest.fail(f"the plan declined {name}")
    assert spy.results == ([] if streamed is None else [streamed])


GRAD_CASES = {
    "all require grad": lambda: [t.requires_grad_() for t in rows()],
    "the last requires grad": lambda: rows()[:-1] + [rows()[-1].requires_grad_()],
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_tensors_requiring_grad_are_refused_as_before(monkeypatch, name):
    spy = Spy(monkeypatch)
    batch = GRAD_CASES[name]()
    with pytest.raises(RuntimeError) as theirs:
        reference(batch)
    with pytest.raises(RuntimeError, match=r"requires_grad=True.*detach\(\)"):
        collate_into(batch, alloc)
    assert "automatic differentiation" in str(theirs.value)
    column = np.empty((B,) + SHAPE, np.float32)
    fill = plan_tensor_column(rows()[0], column, B)
    assert fill(batch, column) is False  # the generic path then raises its own error
    assert spy.results == []


def test_a_leaf_on_another_device_is_refused_as_before(monkeypatch):
    """A meta tensor after CPU ones: Tensor.numpy() raises TypeError, torch.stack
    refuses the cross-device copy (RuntimeError), the plan declines."""
    spy = Spy(monkeypatch)
    batch = rows()[:-1] + [torch.empty(SHAPE, device="meta")]
    with pytest.raises(RuntimeError, match="meta"):
        collate_into(batch, alloc)
    column = np.empty((B,) + SHAPE, np.float32)
    assert plan_tensor_column(rows()[0], column, B)(batch, column) is False
    assert spy.results == []


def test_a_ragged_leaf_raises_torchs_error(monkeypatch):
    spy = Spy(monkeypatch)
    batch = rows()[:-1] + [torch.zeros(SHAPE[0], SHAPE[1] + 1)]
    with pytest.raises(RuntimeError) as theirs:
        reference(batch)
    with pytest.raises(RuntimeError) as mine:
        collate_into(batch, alloc)
    assert str(mine.value) == str(theirs.value)
    assert spy.results == []


class Large(torch.utils.data.Dataset):
    """(float32 (128, 1024) row, int) samples: batches of 8 fill STREAM_MIN_BYTES."""

    def __init__(self):
        self.x = torch.arange(20 * 131072, dtype=torch.float32).reshape(20, *SHAPE) % 1009

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return self.x[i], i


def test_torch_loader_streams_large_tensor_batches_through_workers():
    """Through a real worker (generic first batch, then the plan): torch's batches."""
    data = Large()
    with as_torch_worker():
        want = [default_collate([data[i] for i in range(s, min(s + B, 20))]) for s in range(0, 20, B)]
    with mpt.DataLoader(data, batch_size=B, num_workers=1) as loader:
        for _epoch in range(2):
            got = list(loader)
            assert len(got) == len(want) == 3
            for g, w in zip(got, want):
                assert_same_batch(g, w)
