"""Helpers for the torch face's tests: compare batches from two loaders."""
import collections
import contextlib

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker


@contextlib.contextmanager
def as_torch_worker():
    """Make torch's collate functions behave as in a DataLoader worker (tensors are
    stacked into the first one's dtype there)."""
    saved = torch_worker._worker_info
    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    try:
        yield
    finally:
        torch_worker._worker_info = saved


def assert_same_batch(a, b, path="batch"):
    """``a`` (mploader) equals ``b`` (torch): the same types at every level, tensors
    of the same dtype, shape and values, arrays likewise, other leaves equal."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, path
        assert torch.equal(a.detach(), b.detach()) or (a.dtype.is_floating_point and torch.allclose(
            a.detach(), b.detach(), equal_nan=True, rtol=0, atol=0)), f"{path}: values differ"
    elif isinstance(b, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b)
    elif isinstance(b, collections.abc.Mapping):
        assert list(a.keys()) == list(b.keys()), path
        for k in b:
            assert_same_batch(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_batch(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def outcome(it, limit=10_000):
    """Everything ``it`` yields or raises, as a list: batches, or ("raised", type, first
    line of the message) for an exception (iteration goes on after it, as torch's)."""
    out = []
    for _ in range(limit):
        try:
            out.append(next(it))
        except StopIteration:
            return out
        except Exception as e:  # noqa: BLE001 - recorded for comparison
            out.append(("raised", type(e), str(e).splitlines()[0] if str(e) else ""))
    raise AssertionError("iterator did not end")


def assert_same_outcome(a, b):
    assert len(a) == len(b), f"{len(a)} items != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, tuple) and len(y) == 3 and isinstance(y[0], str) and y[0] == "raised":
            assert x == y, f"item {i}: {x!r} != {y!r}"
        else:
            assert_same_batch(x, y, f"item {i}")
