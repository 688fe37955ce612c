"""The C checks behind default collation (mploader._columns: uniform_arrays,
number_column_dtype, fill_numbers), through ``_collate._asarray_into``, against
NumPy itself: a column of samples batches as ``np.asarray`` makes it, or stays the
list of its samples where NumPy can only make an object array or fails."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mploader import _collate

NUMERIC = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64", "complex64", "complex128", ">i4", "<f8"]


def reference(samples):
    try:
        arr = np.asarray(samples)
    except (ValueError, TypeError, OverflowError):
        return list(samples)
    return list(samples) if arr.dtype.hasobject else arr


def check(samples):
    got = _collate._asarray_into(samples, np.empty)
    want = reference(samples)
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        assert all(g is w for g, w in zip(got, want))
    else:
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


python_numbers = st.one_of(
    st.lists(st.integers(-2**70, 2**70), min_size=1, max_size=40),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=40),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=40),
    st.lists(st.booleans(), min_size=1, max_size=40),
    st.lists(st.one_of(st.integers(-5, 5), st.floats(-5, 5), st.booleans()), min_size=1, max_size=10),
)


@settings(max_examples=300, deadline=None)
@given(python_numbers)
def test_python_number_columns_batch_as_numpy_makes_them(samples):
    check(samples)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(NUMERIC), min_size=1, max_size=3), st.integers(1, 30), st.data())
def test_numpy_scalar_columns_batch_as_numpy_makes_them(dtypes, n, data):
    values = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    samples = [np.array(v).astype(dtypes[i % len(dtypes)])[()] for i, v in enumerate(values)]
    check(samples)


shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(shapes, st.sampled_from(NUMERIC + ["O"])), min_size=1, max_size=4), st.integers(1, 12))
def test_array_columns_batch_as_numpy_makes_them(kinds, n):
    samples = []
    for i in range(n):
        shape, dtype = kinds[i % len(kinds)]
        samples.append(np.arange(int(np.prod(shape)), dtype="int64").reshape(shape).astype(dtype))
    check(samples)


def test_non_arrays_and_subclasses_are_not_uniform():
    class Sub(np.ndarray):
        pass

    a = np.zeros(3)
    assert _collate._uniform_arrays([a, a.view(Sub)]) is False
    assert _collate._uniform_arrays([a, [0.0, 0.0, 0.0]]) is False
    assert _collate._uniform_arrays((a, a.copy())) is True    # a tuple column (zip) works too
    assert _collate._uniform_arrays([np.zeros(3, object)] * 2) is False


@pytest.mark.parametrize("dtype", NUMERIC)
def test_nested_rule_numbers_are_numpys(dtype):
    samples = [np.array(v).astype(dtype)[()] for v in (1, 0, 7)]
    got = _collate.collate_nested(samples)
    want = np.asarray(samples)
    assert got.dtype == want.dtype and (got == want).all()


SCALAR_TYPES = ["bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("name", SCALAR_TYPES)
@pytest.mark.parametrize("mixed", [False, True])
def test_torch_face_scalar_columns_are_default_collates(name, mixed):
    """mploader.torch's collation of a column of NumPy scalars (filled in C when they
    share one type) against torch.utils.data.default_collate itself."""
    torch = pytest.importorskip("torch")
    from mploader import _torch_collate as tc

    t = getattr(np, name)
    samples = [t(v) for v in (1, 0, 3, 1)]
    if mixed:
        samples[2] = np.float32(2.5)
    try:
        want = torch.utils.data.default_collate(samples)
    except Exception as exc:  # noqa: BLE001 - the same error type is expected
        with pytest.raises(type(exc)):
            tc.to_tensors(tc.collate_into(samples, np.empty))
        return
    got = tc.to_tensors(tc.collate_into(samples, np.empty))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["uint8", "float32", ">i4", "<f8", "complex64"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "byte_offset"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_columns_batch_as_numpy_does(dtype, layout, size):
    """Columns are copied row by row in C (``_columns.copy_rows``: memcpy, or streaming
    stores from STREAM_MIN_BYTES on) when the samples are C-contiguous and of the
    output's native dtype; whatever the path, the batch is what np.asarray makes of
    the samples (an odd row length checks the unaligned head and tail of each row's
    copy)."""
    from mploader import _columns

    n = 6
    row = _columns.STREAM_MIN_BYTES // n + 13 if size == "large" else 8 * 37 + 13  # odd
    count = row // np.dtype(dtype).itemsize
    rng = np.random.default_rng(3)
    base = rng.integers(0, 255, size=n * count * np.dtype(dtype).itemsize + 8, dtype=np.uint8)
    if layout == "byte_offset":  # each sample starts at an address that is not 16-aligned
        samples = [base[1 + k:].view(np.uint8)[:count * np.dtype(dtype).itemsize].view(dtype) for k in range(n)]
    elif layout == "transposed":  # Fortran order: not C-contiguous, NumPy's own copy
        samples = [np.asfortranarray(rng.integers(0, 100, size=(count // 8, 8)).astype(dtype)) for _ in range(n)]
    else:
        samples = [rng.integers(0, 100, size=count).astype(dtype) for _ in range(n)]
    check(samples)


def test_copy_rows_copies_uniform_rows_and_declines_what_it_cannot_copy():
    from mploader import _columns

    big = _columns.STREAM_MIN_BYTES
    samples = [np.full(big // 4, k, np.uint8) for k in range(4)]
    out = np.empty((4, big // 4), np.uint8)
    assert _columns.copy_rows(samples, out) is True                                 # streaming stores
    np.testing.assert_array_equal(out, np.stack(samples))
    small = [np.arange(k, k + 16, dtype=np.float32) for k in range(32)]
    out = np.empty((32, 16), np.float32)
    assert _columns.copy_rows(small, out) is True                                   # memcpy below the threshold
    np.testing.assert_array_equal(out, np.stack(small))
    assert _columns.copy_rows(samples, np.empty((big // 4, 4), np.uint8).T) is False  # output not C-contiguous
    swapped = [np.ones(big // 16, ">i4") for _ in range(4)]
    assert _columns.copy_rows(swapped, np.empty((4, big // 16), "<i4")) is False    # a byte swap is a cast
    assert _columns.copy_rows(samples[:3] + [np.ones(big // 4 - 1, np.uint8)],
                              np.empty((4, big // 4), np.uint8)) is False
    assert _columns.copy_rows([s[::2] for s in small], np.empty((32, 8), np.float32)) is False  # samples not contiguous
    assert _columns.copy_rows(small, np.empty((32, 16), np.float64)) is False       # another dtype: a cast
    assert _columns.copy_rows([], np.empty((0, 16), np.float32)) is False


def test_timedelta_scalars_of_mixed_units_batch_as_numpy_converts_them():
    """Regression: the column took the first scalar's unit and copied the others' raw
    counts (1 s and 1 ms became [1, 1] s); NumPy converts them to the finer unit."""
    check([np.timedelta64(1, "s"), np.timedelta64(1, "ms"), np.timedelta64(3, "s")])
    check([np.timedelta64(1, "s"), np.timedelta64(2, "s")])
