"""Tests for mploader.batchify against in-test references of GluonNLP 0.10 behaviour."""

import collections
import tracemalloc
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mploader.batchify import (
    Batchify,
    Dict,
    Group,
    List,
    NamedTuple,
    Pad,
    Stack,
    Tuple,
    collate,
)

GARBAGE = 0xA5


# ---------------------------------------------------------------- helpers


class RecordingAlloc:
    """An ``alloc`` that hands out garbage-filled arrays and remembers them."""

    def __init__(self):
        self.calls = []
        self.arrays = []

    def __call__(self, shape, dtype):
        self.calls.append((tuple(shape), np.dtype(dtype)))
        raw = np.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, GARBAGE, np.uint8)
        arr = raw.view(dtype).reshape(shape)
        self.arrays.append(arr)
        return arr


class ArenaAlloc:
    """An ``alloc`` that carves views out of one preallocated buffer, like a slot."""

    def __init__(self, nbytes):
        self.buffer = np.full(nbytes, GARBAGE, np.uint8)
        self.offset = 0
        self.arrays = []

    def __call__(self, shape, dtype):
        dtype = np.dtype(dtype)
        self.offset = -(-self.offset // 64) * 64
        n = int(np.prod(shape)) * dtype.itemsize
        view = self.buffer[self.offset:self.offset + n].view(dtype).reshape(shape)
        self.offset += n
        self.arrays.append(view)
        return view


def assert_same_array(got, expected):
    assert isinstance(got, np.ndarray)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    np.testing.assert_array_equal(got, expected)


def ref_stack(samples, dtype=None):
    """GluonNLP 0.10 Stack on non-NDArray input: asarray of the whole list, then cast."""
    out = np.asarray(samples)
    return out.astype(out.dtype if dtype is None else dtype)


def ref_pad(samples, axis=0, pad_val=0, dtype=None, round_to=None):
    """Pad element by element; dtype rule of GluonNLP 0.10 (ndarray: sample 0, else float32)."""
    if dtype is None:
        dtype = samples[0].dtype if isinstance(samples[0], np.ndarray) else np.float32
    arrays = [np.asarray(s) for s in samples]
    axis = axis % arrays[0].ndim
    lengths = [a.shape[axis] for a in arrays]
    size = max(lengths)
    if round_to is not None:
        size = ((size + round_to - 1) // round_to) * round_to
    shape = list(arrays[0].shape)
    shape[axis] = size
    out = np.empty((len(arrays),) + tuple(shape), dtype)
    for i, a in enumerate(arrays):
        for idx in np.ndindex(*shape):
            out[(i,) + idx] = a[idx] if idx[axis] < a.shape[axis] else pad_val
    return out, np.array(lengths, np.int32)


def check_into_alloc(fn, samples):
    """collate() via RecordingAlloc; return (result, alloc) after checking identity."""
    alloc = RecordingAlloc()
    result = fn.collate(samples, alloc)
    flat = result if isinstance(result, tuple) else (result,)
    assert len(alloc.arrays) == len(flat)
    for got, handed_out in zip(flat, alloc.arrays):
        assert got is handed_out
        assert got.size == 0 or np.shares_memory(got, handed_out)
    return result, alloc


# ---------------------------------------------------------------- Stack


def test_stack_lists_gluonnlp_example():
    out = Stack()([[1, 2, 3, 4], [4, 5, 6, 8], [8, 9, 1, 2]])
    assert_same_array(out, np.array([[1, 2, 3, 4], [4, 5, 6, 8], [8, 9, 1, 2]]))
    assert out.dtype == np.asarray([1]).dtype


def test_stack_arrays_and_dtype():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    b = np.array([[5, 6, 7, 8], [1, 2, 3, 4]], np.int32)
    assert_same_array(Stack()([a, b]), np.stack([a, b]))
    assert_same_array(Stack(dtype="float16")([a, b]), np.stack([a, b]).astype(np.float16))


def test_stack_scalars():
    assert_same_array(Stack()([1, 2, 3]), np.array([1, 2, 3]))
    assert_same_array(Stack()([1, 2.5]), np.array([1.0, 2.5]))
    assert_same_array(Stack()([np.float32(1), np.float32(2)]), np.array([1, 2], np.float32))
    assert_same_array(Stack()([True, False]), np.array([True, False]))


def test_stack_mixed_dtypes_promote_like_asarray():
    samples = [np.array([1, 2], np.int8), np.array([3.5, 4], np.float32)]
    assert_same_array(Stack()(samples), ref_stack(samples))


def test_stack_unsafe_cast_like_astype():
    samples = [np.array([1.7, -2.2]), np.array([3.9, 300.0])]
    assert_same_array(Stack(dtype=np.int32)(samples), ref_stack(samples, np.int32))


def test_stack_collates_into_alloc_once():
    samples = [np.arange(6.0).reshape(2, 3) + i for i in range(4)]
    out, alloc = check_into_alloc(Stack(), samples)
    assert alloc.calls == [((4, 2, 3), np.dtype(np.float64))]
    assert_same_array(out, np.stack(samples))


def test_stack_ragged_error_names_sample():
    samples = [np.zeros(5)] * 3 + [np.zeros(4)]
    alloc = RecordingAlloc()
    with pytest.raises(ValueError) as info:
        Stack().collate(samples, alloc)
    assert str(info.value) == "Stack: sample 3 has shape (4,), expected (5,) like sample 0"
    assert alloc.calls == []  # validated before allocating


def test_stack_errors():
    with pytest.raises(ValueError, match="Stack: got no samples"):
        Stack()([])
    with pytest.raises(ValueError, match="Stack: sample 1 cannot be converted to an array"):
        Stack()([[1, 2], [1, [2, 3]]])
    with pytest.raises(TypeError, match=r"Stack: sample 0 \(object\) converts to an object array"):
        Stack()([object(), object()])
    with pytest.raises(TypeError, match="dtype must be a NumPy dtype or None, got 'nope'"):
        Stack(dtype="nope")


@given(
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    dtype=st.sampled_from([np.int8, np.int32, np.int64, np.float32, np.float64, np.bool_]),
    n=st.integers(1, 6),
    out_dtype=st.sampled_from([None, np.float64, np.int16]),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_stack_matches_reference(shape, dtype, n, out_dtype, data):
    samples = [data.draw(hnp.arrays(dtype, shape)) for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nan/inf -> int casts
        expected = ref_stack(samples, out_dtype)
        out, _ = check_into_alloc(Stack(dtype=out_dtype), samples)
    assert_same_array(out, expected)


# ---------------------------------------------------------------- Pad


def test_pad_default_pad_val_warns_and_is_zero():
    with pytest.warns(UserWarning, match="pad_val was not given and defaults to 0"):
        pad = Pad()
    out = pad([[1, 2, 3, 4], [4, 5, 6], [8, 2]])
    assert_same_array(out, np.array([[1, 2, 3, 4], [4, 5, 6, 0], [8, 2, 0, 0]], np.float32))


def test_pad_explicit_pad_val_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pad(pad_val=0)


def test_pad_lists_are_float32_like_gluonnlp():
    batch, length = Pad(pad_val=0, ret_length=True)([[1, 2, 3, 4], [4, 5, 6], [8, 2]])
    assert batch.dtype == np.float32
    assert_same_array(length, np.array([4, 3, 2], np.int32))


def test_pad_ndarray_axis1_gluonnlp_example():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    b = np.array([[5, 8], [1, 2]])
    out = Pad(axis=1, pad_val=-1)([a, b])
    assert_same_array(out, np.array([[[1, 2, 3, 4], [5, 6, 7, 8]],
                                     [[5, 8, -1, -1], [1, 2, -1, -1]]]))


def test_pad_dtype_follows_sample_zero():
    samples = [np.array([1, 2], np.int16), np.array([3.5])]
    out = Pad(pad_val=7)(samples)
    assert_same_array(out, np.array([[1, 2], [3, 7]], np.int16))


def test_pad_round_to():
    samples = [np.arange(5), np.arange(2)]
    out, length = Pad(pad_val=-1, round_to=4, ret_length=True)(samples)
    assert out.shape == (2, 8)
    assert_same_array(out, ref_pad(samples, pad_val=-1, round_to=4)[0])
    assert_same_array(length, np.array([5, 2], np.int32))
    # already a multiple: unchanged
    assert Pad(pad_val=0, round_to=5)(samples).shape == (2, 5)


def test_pad_negative_axis_and_empty_sample():
    samples = [np.ones((2, 3)), np.ones((2, 0)), np.ones((2, 1))]
    out = Pad(axis=-1, pad_val=9)(samples)
    assert_same_array(out, ref_pad(samples, axis=-1, pad_val=9)[0])


def test_pad_collates_into_alloc_in_order():
    samples = [np.arange(n, dtype=np.float32) for n in (3, 1, 4)]
    (out, length), alloc = check_into_alloc(Pad(pad_val=-2, ret_length=True), samples)
    assert alloc.calls == [((3, 4), np.dtype(np.float32)), ((3,), np.dtype(np.int32))]
    expected, expected_len = ref_pad(samples, pad_val=-2)
    assert_same_array(out, expected)
    assert_same_array(length, expected_len)


def test_pad_without_ret_length_allocates_once():
    samples = [[1, 2], [3]]
    out, alloc = check_into_alloc(Pad(pad_val=0), samples)
    assert len(alloc.calls) == 1


def test_pad_pad_val_conversion_like_numpy_full():
    # a value that does not fit: as np.full -- NumPy 2 raises OverflowError (here with
    # the argument named), NumPy 1.24-1.26 wraps it (with a DeprecationWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            wrapped = np.full(1, -1, np.uint8)[0]
        except OverflowError:
            wrapped = None
        if wrapped is None:
            with pytest.raises(OverflowError, match=r"Pad: pad_val=-1 cannot be stored as uint8"):
                Pad(pad_val=-1, dtype=np.uint8)([[1], [2, 3]])
        else:
            assert_same_array(Pad(pad_val=-1, dtype=np.uint8)([[1], [2, 3]]),
                              np.array([[1, wrapped], [2, 3]], np.uint8))
    # float pad into an int batch truncates, as np.full does
    out = Pad(pad_val=2.7)([np.array([1, 2]), np.array([3])])
    assert_same_array(out, np.array([[1, 2], [3, 2]]))


@pytest.mark.parametrize(
    "samples, kwargs, exc, message",
    [
        ([np.zeros((2, 3)), np.zeros((3, 4))], {}, ValueError,
         "Pad: sample 1 has shape (3, 4), expected (*, 3) like sample 0 (only axis 0 may differ)"),
        ([np.zeros((2, 3)), np.zeros((3, 4))], {"axis": 1}, ValueError,
         "Pad: sample 1 has shape (3, 4), expected (2, *) like sample 0 (only axis 1 may differ)"),
        ([np.zeros(3), np.zeros((3, 1))], {}, ValueError,
         "Pad: sample 1 has shape (3, 1), expected (*,) like sample 0 (only axis 0 may differ)"),
        ([np.zeros((2, 3))], {"axis": 2}, ValueError,
         "Pad: axis=2 is out of range for samples with 2 dimension(s) (sample 0 has shape (2, 3))"),
        ([1, 2], {}, TypeError,
         "Pad: sample 0 is 0-dimensional (int); Pad needs arrays or lists with at least one "
         "axis (use Stack for scalars)"),
        ([], {}, ValueError, "Pad: got no samples; a batch needs at least one"),
    ],
)
def test_pad_collate_errors(samples, kwargs, exc, message):
    alloc = RecordingAlloc()
    with pytest.raises(exc) as info:
        Pad(pad_val=0, **kwargs).collate(samples, alloc)
    assert str(info.value) == message
    assert alloc.calls == []


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"axis": 1.0}, TypeError, "axis must be an int, got 1.0 (float)"),
        ({"round_to": 0}, ValueError, "round_to must be positive, got 0"),
        ({"round_to": "8"}, TypeError, "round_to must be an int or None, got '8' (str)"),
        ({"dtype": "nope"}, TypeError, "dtype must be a NumPy dtype or None, got 'nope'"),
    ],
)
def test_pad_constructor_errors(kwargs, exc, message):
    with pytest.raises(exc) as info:
        Pad(pad_val=0, **kwargs)
    assert str(info.value) == message


@st.composite
def pad_cases(draw):
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(-ndim, ndim - 1))
    base = list(draw(hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=0, max_side=3)))
    n = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([np.int32, np.float64, np.uint8]))
    samples = []
    for _ in range(n):
        shape = list(base)
        shape[axis] = draw(st.integers(0, 5))
        samples.append(draw(hnp.arrays(dtype, tuple(shape),
                                       elements=st.integers(0, 100))))
    lossless = all(np.asarray(s.tolist()).shape == s.shape for s in samples)
    if lossless and draw(st.booleans()):  # nested lists (shape (0, k) would become [])
        samples = [s.tolist() for s in samples]
    pad_val = draw(st.integers(0, 9))
    round_to = draw(st.one_of(st.none(), st.integers(1, 4)))
    out_dtype = draw(st.sampled_from([None, np.int64, np.float32]))
    return samples, dict(axis=axis, pad_val=pad_val, round_to=round_to, dtype=out_dtype)


@given(case=pad_cases())
@settings(max_examples=80, deadline=None)
def test_pad_matches_reference(case):
    samples, kwargs = case
    expected, expected_len = ref_pad(samples, **kwargs)
    pad = Pad(ret_length=True, **kwargs)
    (out, length), alloc = check_into_alloc(pad, samples)
    assert_same_array(out, expected)
    assert_same_array(length, expected_len)
    # the collated batch equals the heap one
    heap_out, heap_len = pad(samples)
    assert_same_array(heap_out, out)
    assert_same_array(heap_len, length)


# ---------------------------------------------------------------- no full-size temporaries


@pytest.mark.parametrize(
    "fn, make",
    [
        (Stack(), lambda i: np.full(16_384, i, np.float32)),
        (Pad(pad_val=0), lambda i: np.full(16_384 - 64 * i, i, np.float32)),
    ],
)
def test_collate_builds_no_full_size_temporary(fn, make):
    samples = [make(i) for i in range(64)]  # a 4 MiB batch of 64 KiB samples
    arena = ArenaAlloc(64 * 16_384 * 4 + 4096)
    tracemalloc.start()
    try:
        fn.collate(samples, arena)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 512 * 1024, f"collate allocated {peak} bytes besides alloc"
    (out,) = arena.arrays
    assert np.shares_memory(out, arena.buffer)
    assert_same_array(out, fn(samples))


# ---------------------------------------------------------------- Tuple / Group


def test_tuple_gluonnlp_example():
    samples = [([1, 2, 3, 4], 0), ([5, 7], 1)]
    data, label = Tuple(Pad(pad_val=0), Stack())(samples)
    assert_same_array(data, np.array([[1, 2, 3, 4], [5, 7, 0, 0]], np.float32))
    assert_same_array(label, np.array([0, 1]))


@pytest.mark.parametrize("make", [
    lambda fns: Tuple(*fns), lambda fns: Tuple(list(fns)), lambda fns: Tuple(tuple(fns)),
    lambda fns: Group(*fns), lambda fns: Group(list(fns)),
])
def test_tuple_forms_pass_alloc_down_in_order(make):
    fn = make([Pad(pad_val=-1, ret_length=True), Stack(), List(), Stack(dtype=np.float32)])
    samples = [(np.arange(n), n, f"s{n}", [n, n]) for n in (2, 4, 1)]
    alloc = RecordingAlloc()
    (data, length), label, text, pair = fn.collate(samples, alloc)
    assert [c[0] for c in alloc.calls] == [(3, 4), (3,), (3,), (3, 2)]
    assert data is alloc.arrays[0] and length is alloc.arrays[1]
    assert label is alloc.arrays[2] and pair is alloc.arrays[3]
    assert_same_array(data, ref_pad([s[0] for s in samples], pad_val=-1)[0])
    assert_same_array(length, np.array([2, 4, 1], np.int32))
    assert_same_array(label, np.array([2, 4, 1]))
    assert text == ["s2", "s4", "s1"]
    assert_same_array(pair, np.array([[2, 2], [4, 4], [1, 1]], np.float32))


def test_group_is_tuple():
    assert issubclass(Group, Tuple)
    samples = [(1, [1.0]), (2, [2.0])]
    g, t = Group(Stack(), Stack())(samples), Tuple(Stack(), Stack())(samples)
    for a, b in zip(g, t):
        assert_same_array(a, b)


def test_tuple_plain_callable_child_is_called_without_alloc():
    seen = []

    def plain(column):
        seen.append(column)
        return sum(column)

    alloc = RecordingAlloc()
    total, label = Tuple(plain, Stack()).collate([(1, 5), (2, 6)], alloc)
    assert total == 3 and seen == [[1, 2]]
    assert len(alloc.calls) == 1 and label is alloc.arrays[0]


def test_tuple_errors():
    with pytest.raises(ValueError, match=r"Tuple: pass the functions either as Tuple\(A, B, C\)"):
        Tuple([Stack()], Stack())
    with pytest.raises(ValueError, match="Tuple: needs at least one batchify function"):
        Tuple([])
    with pytest.raises(TypeError, match="Tuple: batchify function 1 must be callable, got 3"):
        Tuple(Stack(), 3)
    with pytest.raises(ValueError) as info:
        Tuple(Stack(), Stack())([(1, 2), (1, 2), (1, 2, 3)])
    assert str(info.value) == "Tuple: sample 2 has 3 fields, expected 2 (one per batchify function)"
    with pytest.raises(TypeError, match="Tuple: sample 0 is int, expected a sequence of 2 fields"):
        Tuple(Stack(), Stack())([1, 2])
    with pytest.raises(ValueError, match="Group: sample 0 has 1 fields, expected 2"):
        Group(Stack(), Stack())([(1,)])


# ---------------------------------------------------------------- Dict


def test_dict_gluonnlp_example_and_alloc_order():
    samples = [{"data": [1, 2, 3, 4], "label": 0, "extra": "x"},
               {"data": [5, 7], "label": 1, "extra": "y"},
               {"data": [1, 2, 3, 4, 5, 6, 7], "label": 0, "extra": "z"}]
    fn = Dict({"label": Stack(), "data": Pad(pad_val=0)})
    alloc = RecordingAlloc()
    out = fn.collate(samples, alloc)
    assert list(out) == ["label", "data"]
    assert out["label"] is alloc.arrays[0] and out["data"] is alloc.arrays[1]
    assert_same_array(out["label"], np.array([0, 1, 0]))
    assert_same_array(out["data"], ref_pad([s["data"] for s in samples])[0])


def test_dict_errors():
    with pytest.raises(TypeError, match="fn_dict must be a dict of batchify functions, got list"):
        Dict([Stack()])
    with pytest.raises(TypeError, match=r"Dict: fn_dict\['a'\] must be callable, got 1"):
        Dict({"a": 1})
    with pytest.raises(KeyError, match="Dict: sample 1 has no key 'label'"):
        Dict({"label": Stack()})([{"label": 1}, {"data": 2}])


# ---------------------------------------------------------------- NamedTuple


Sample = collections.namedtuple("Sample", ["data", "label"])


@pytest.mark.parametrize("fn_info", [
    lambda: {"label": Stack(), "data": Pad(pad_val=0)},
    lambda: [Pad(pad_val=0), Stack()],
    lambda: (Pad(pad_val=0), Stack()),
])
def test_namedtuple(fn_info):
    samples = [Sample([1, 2, 3, 4], 0), Sample([5, 7], 1), Sample([1, 2, 3, 4, 5, 6, 7], 0)]
    alloc = RecordingAlloc()
    out = NamedTuple(Sample, fn_info()).collate(samples, alloc)
    assert type(out) is Sample
    assert out.data is alloc.arrays[0] and out.label is alloc.arrays[1]  # field order
    assert_same_array(out.data, ref_pad([s.data for s in samples])[0])
    assert_same_array(out.label, np.array([0, 1, 0]))


def test_namedtuple_errors():
    with pytest.raises(ValueError, match=r"fn_info must hold one function per field of Sample"):
        NamedTuple(Sample, [Stack()])
    with pytest.raises(ValueError, match=r"missing \['label'\], extra \['lbl'\]"):
        NamedTuple(Sample, {"data": Stack(), "lbl": Stack()})
    with pytest.raises(TypeError, match="container must be a namedtuple class"):
        NamedTuple(tuple, [Stack()])
    with pytest.raises(TypeError, match="fn_info must be a list, tuple or dict"):
        NamedTuple(Sample, Stack())
    with pytest.raises(TypeError, match="NamedTuple: batchify function 0 must be callable"):
        NamedTuple(Sample, [None, Stack()])
    with pytest.raises(TypeError, match="NamedTuple: sample 1 is tuple, expected Sample"):
        NamedTuple(Sample, [Stack(), Stack()])([Sample(1, 2), (1, 2)])


# ---------------------------------------------------------------- List, collate, base


def test_list_forwards_anything_without_alloc():
    samples = ["a", {"b": 1}, None, np.zeros(2)]
    alloc = RecordingAlloc()
    out = List().collate(samples, alloc)
    assert out == samples or all(x is y for x, y in zip(out, samples))
    assert type(out) is list and out is not samples
    assert alloc.calls == []
    assert List()(("x", "y")) == ["x", "y"]


def test_collate_function_dispatch():
    alloc = RecordingAlloc()
    out = collate(Stack(), [1, 2], alloc)
    assert out is alloc.arrays[0]
    assert collate(lambda s: ("plain", s), (1, 2), alloc) == ("plain", [1, 2])
    assert len(alloc.calls) == 1


def test_arena_alloc_end_to_end():
    samples = [(np.arange(n, dtype=np.int64), float(n), f"t{n}") for n in (5, 2, 7, 1)]
    fn = Tuple(Pad(pad_val=-1, ret_length=True), Stack(dtype=np.float32), List())
    arena = ArenaAlloc(1 << 12)
    (data, length), label, text = fn.collate(samples, arena)
    for arr in (data, length, label):
        assert np.shares_memory(arr, arena.buffer)
    heap = fn(samples)
    assert_same_array(data, heap[0][0])
    assert_same_array(length, heap[0][1])
    assert_same_array(label, heap[1])
    assert text == heap[2]


def test_bad_alloc_is_reported():
    with pytest.raises(ValueError, match=r"Stack: alloc.* returned array of shape \(3,\)"):
        Stack().collate([[1, 2], [3, 4]], lambda shape, dtype: np.empty(3, dtype))
    with pytest.raises(ValueError, match="writeable=False"):
        def readonly(shape, dtype):
            arr = np.empty(shape, dtype)
            arr.flags.writeable = False
            return arr
        Stack().collate([1, 2], readonly)


def test_base_class():
    class Twice(Batchify):
        def collate(self, samples, alloc):
            out = alloc((len(samples),), np.dtype(np.int64))
            out[:] = [2 * s for s in samples]
            return out

    assert_same_array(Twice()([1, 2, 3]), np.array([2, 4, 6]))
    assert_same_array(Tuple(Twice())([(1,), (5,)])[0], np.array([2, 10]))
    with pytest.raises(NotImplementedError, match="Batchify must implement collate"):
        Batchify()([1])
