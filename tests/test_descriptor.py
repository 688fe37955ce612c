"""The batch descriptor (docs/design.md, "Batch descriptor") and slot sizing ("Slot sizing").

* Round trips through a real slot: every kind of leaf and container comes back with
  the same types, dict key types and order, dtypes, shapes and bytes (checked by
  ``same`` below, written independently of the encoder); plain arrays are zero-copy
  views of the slot, also inside in-band pickles; ``copy=True`` owns its arrays.
* The structure is encoded once per structure (worker cache) and parsed once per
  structure (parent cache), whatever the shapes and values.
* Corruption (issue 9, item 9): each field of the descriptor, changed, raises
  ``CorruptDescriptor`` naming the field -- no crash, no view outside the slot, no
  large allocation (``tracemalloc`` peak); random 1-5 byte changes in a child
  process with a hard timeout give only batches or ``CorruptDescriptor``.
* Sizing (issue 9, item 3): one 32 MiB batch among 16 KiB batches leaves the
  region's allocated memory at a few times the typical batch once small batches
  follow.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import multiprocessing
import os
import pickle
import random
import struct
import traceback
import tracemalloc

import numpy as np
import pytest
from _util import lease_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mploader
from mploader import _descriptor as D
from mploader import _inband, _ring, _sizing
from mploader import _structure as S
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(120)
# NumPy 2 moved byte_bounds to numpy.lib.array_utils; 1.24-1.26 have np.byte_bounds
byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds

Point = collections.namedtuple("Point", "x y")
Empty = collections.namedtuple("Empty", "")


class Thing:
    """An arbitrary picklable object holding an array."""

    def __init__(self, i, arr):
        self.i, self.arr = i, arr

    def __eq__(self, other):
        return type(other) is Thing and other.i == self.i and same(other.arr, self.arr)


@dataclasses.dataclass
class Record:
    name: str
    values: list


# ---- the independent reference: exact equality ----

def same(got, want) -> bool:
    """Same types all the way down (dict key types and order too); arrays with the
    same dtype, shape and bytes; floats compared by their bits (NaN == NaN)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, np.ndarray):
        if got.dtype != want.dtype or got.dtype.str != want.dtype.str or got.shape != want.shape:
            return False
        if want.dtype.hasobject:
            return all(same(g, w) for g, w in zip(got.reshape(-1), want.reshape(-1)))
        return got.tobytes() == want.tobytes()
    if isinstance(want, np.generic):
        return got.dtype == want.dtype and got.tobytes() == want.tobytes()
    if isinstance(want, dict):
        return [key_id(k) for k in got] == [key_id(k) for k in want] \
            and all(same(g, w) for g, w in zip(got.values(), want.values()))
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if isinstance(want, float):
        return struct.pack("<d", got) == struct.pack("<d", want)
    if isinstance(want, complex):
        return struct.pack("<dd", got.real, got.imag) == struct.pack("<dd", want.real, want.imag)
    return got == want


def key_id(k):
    """A dict key's type and value, floats by their bits (a NaN key equals itself)."""
    if isinstance(k, float):
        return float, struct.pack("<d", k)
    if isinstance(k, tuple):
        return tuple, tuple(map(key_id, k))
    return type(k), k


def arrays(obj):
    """Every ndarray in a batch, including those inside objects and object arrays."""
    if isinstance(obj, np.ndarray):
        yield obj
        if obj.dtype.hasobject:
            for x in obj.reshape(-1):
                yield from arrays(x)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from arrays(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from arrays(x)
    elif isinstance(obj, Thing):  # (a fuzzed one may have lost its attribute)
        yield from arrays(getattr(obj, "arr", None))


# ---- a real region: publish in a slot, take it, decode ----

class Slot:
    """One slot of a one-slot region: ``publish`` a batch the way a worker does,
    ``take`` it the way the parent does."""

    def __init__(self, slot_bytes=1 << 16):
        self.region = _ring.create_region(1, slot_bytes)
        self.seq = 0

    def publish(self, build):
        """``build(alloc) -> batch``, written and published in the slot."""
        self.seq += 1
        self.region.assign(0, self.seq)
        w = D.SlotWriter(self.region, 0, self.seq)
        assert w.finish(build(w.alloc)) is None

    def take(self):
        """(lease, desc_off, desc_len, flags) of the published slot."""
        lease = self.region.wait(0, 0)
        return lease, lease.desc_off, lease.desc_len, lease.flags

    def roundtrip(self, build, copy=False):
        self.publish(build)
        lease, off, n, flags = self.take()
        return D.decode(lease, off, n, copy=copy), flags

    def close(self):
        self.region.close()


@pytest.fixture
def slot():
    s = Slot()
    yield s
    s.close()


def tiny(alloc):
    images = alloc((32, 3, 8, 8), np.uint8)
    images[...] = np.arange(images.size, dtype=np.uint64).reshape(images.shape) % 251
    labels = alloc((32,), np.int64)
    labels[...] = np.arange(32) * 7 - 100
    return [images, labels]


def heap(x):
    return x  # a batch built without alloc: arrays on the heap, copied into the slot


def in_slot_views(alloc):
    base = alloc((6, 4), np.float32)
    base[...] = np.arange(24).reshape(6, 4)
    return {"every_other": base[::2], "column": base[:, 1], "transposed": base.T, "whole": base}


SHARED = np.arange(5, dtype=np.int16)
STRUCTURED = np.zeros(3, dtype=[("i", "<i4"), ("f", ">f8"), ("s", "S3")])
STRUCTURED["i"] = [1, 2, 3]
STRUCTURED["s"] = [b"ab", b"c", b""]
OBJECTS = np.array([1, "two", None, [3], np.arange(2)], dtype=object)

CASES = {
    "tiny": (tiny, False),
    "in-slot views (strided, transposed)": (in_slot_views, False),
    "scalars": (lambda a: heap((1, -2**63, 2**63 - 1, 0.5, float("nan"), -0.0, True, False, None, 1 + 2j)), False),
    "str and bytes": (lambda a: heap(["", "é\U0001f600", "\udc80 lone surrogate", b"", b"\x00\xff"]), True),
    "str and bytes in a tuple": (lambda a: heap(("", "é\U0001f600", b"\x00\xff")), False),
    "big int (in-band)": (lambda a: heap((2**70, -2**64)), True),
    "numpy scalars": (lambda a: heap((np.float32(1.5), np.int8(-3), np.bool_(True), np.datetime64(5, "s"),
                                      np.str_("ab"), np.bytes_(b"xy"), np.void(b"\x01\x02"))), False),
    "dict keys of many types": (lambda a: heap({"s": 1, 2: 2.0, None: [], (1, "t"): (), b"b": 3, True: 4,
                                                1.5: np.arange(3)}), False),
    "namedtuples": (lambda a: heap(Point(np.arange(3), Point(1, "z"))), False),
    "empty containers": (lambda a: heap(([], (), {}, Empty())), False),
    "zero-size and 0-d arrays": (lambda a: heap([np.zeros((0, 3)), np.array(7, np.uint16), np.zeros((2, 0), "c8")]),
                                 False),
    "dtypes": (lambda a: heap([np.ones(4, dtype=d) for d in ("?", "f2", ">i4", "<u8", "c16", "M8[ms]", "m8[s]")]
                              + [np.array([b"ab"], "S2"), np.array(["xyz"], "U3"), STRUCTURED]), False),
    "one heap array twice": (lambda a: heap([SHARED, SHARED, {"again": SHARED}]), False),
    "object array (in-band)": (lambda a: heap([OBJECTS, np.arange(3)]), True),
    "2-d object array": (lambda a: heap([OBJECTS[:4].reshape(2, 2)]), True),
    "arbitrary objects holding arrays (in-band)": (lambda a: heap({"t": Thing(3, np.arange(4.0)),
                                                                   "r": Record("x", [1, 2])}), True),
    "list of numbers (in-band)": (lambda a: heap([1, 2, 3]), True),
    "deep nesting (in-band below the limit)": (lambda a: heap(nested(S.MAX_DEPTH + 5)), True),
    "set and frozenset (in-band)": (lambda a: heap((frozenset({1}), {2})), True),
}


def nested(depth):
    x = np.arange(2)
    for _ in range(depth):
        x = (x,)
    return x


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("copy", [False, True], ids=["views", "copy"])
def test_roundtrip(slot, name, copy):
    build, inband = CASES[name]
    want = build(lambda shape, dtype: np.empty(shape, dtype))  # the same batch, on the heap
    got, flags = slot.roundtrip(build, copy=copy)
    assert same(got, want), f"{got!r}\n!=\n{want!r}"
    assert bool(flags & _ring.FLAG_INBAND) == inband, flags
    for arr in arrays(got):
        if arr.dtype.hasobject:
            continue
        if copy:
            assert not isinstance(lease_of(arr), SlotLease)
        else:
            assert isinstance(lease_of(arr), SlotLease), f"{arr!r} is not a view of the slot"


# ---- property: any batch of supported leaves and containers round-trips ----

I64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=6)  # NULs and lone surrogates too
ARRAY_DTYPES = [np.dtype(d) for d in ("?", "i1", "u2", "i4", "<i8", ">f4", "f8", "c8", "M8[s]", "m8[us]", "S3",
                                      "U2")] + [STRUCTURED.dtype]


@st.composite
def arrays_in_or_out(draw):
    """An array on the heap, or ("alloc", array, view) meaning: allocate it in the slot
    and use ``view`` (a slicing) of it."""
    a = draw(hnp.arrays(st.sampled_from(ARRAY_DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0,
                                                                        max_side=4)))
    where = draw(st.sampled_from(["heap", "slot", "slot-view"]))
    return a if where == "heap" else Alloc(a, where == "slot-view")


class Alloc:
    """Placeholder for an array the batch allocates in the slot (``build`` makes it)."""

    def __init__(self, arr, view):
        self.arr, self.view = arr, view

    def make(self, alloc):
        out = alloc(self.arr.shape, self.arr.dtype)
        out[...] = self.arr
        return out[::-1] if self.view and out.ndim else out

    def want(self):
        return self.arr[::-1] if self.view and self.arr.ndim else self.arr


def object_array(items):
    out = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        out[i] = x
    return out


leaves = st.one_of(
    arrays_in_or_out(), I64, st.integers(), st.floats(), st.booleans(), st.none(), st.complex_numbers(), TEXT,
    st.binary(max_size=6), st.builds(np.float32, st.floats(width=32)), st.builds(np.int16, st.integers(-9, 9)),
    st.lists(TEXT, min_size=1, max_size=5), st.lists(I64, min_size=1, max_size=5),
    st.lists(st.floats(), min_size=1, max_size=5), st.lists(st.lists(I64, max_size=4), min_size=1, max_size=4),
    st.lists(st.one_of(I64, TEXT, st.none()), min_size=1, max_size=4),
    st.lists(st.one_of(I64, TEXT, st.none()), max_size=4).map(object_array),
)
KEYS = st.one_of(TEXT, I64, st.none(), st.binary(max_size=3), st.tuples(I64, TEXT), st.booleans(), st.floats())
batches = st.recursive(leaves, lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.lists(children, max_size=3).map(tuple),
    st.dictionaries(KEYS, children, max_size=3),
    st.builds(Point, children, children),
), max_leaves=8)


def build_with(batch, alloc):
    """The batch with each Alloc placeholder made (in the slot when ``alloc`` is the writer's)."""
    if isinstance(batch, Alloc):
        return batch.make(alloc)
    if type(batch) is list:
        return [build_with(x, alloc) for x in batch]
    if type(batch) is tuple:
        return tuple(build_with(x, alloc) for x in batch)
    if type(batch) is Point:
        return Point(*(build_with(x, alloc) for x in batch))
    if type(batch) is dict:
        return {k: build_with(v, alloc) for k, v in batch.items()}
    return batch


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches, copy=st.booleans())
def test_roundtrip_property(slot, batch, copy):
    want = build_with(batch, lambda shape, dtype: np.empty(shape, dtype))
    got, _ = slot.roundtrip(lambda alloc: build_with(batch, alloc), copy=copy)
    ok = same(got, want)
    got = None  # drop the slot before asserting (a failing example keeps its traceback)
    assert ok, f"{want!r}"


def test_noncontiguous_views_are_referenced_in_place(slot):
    """A strided view of an allocated array is described by its strides, not copied."""
    got, _ = slot.roundtrip(in_slot_views)
    whole = got["whole"]
    assert np.shares_memory(got["every_other"], whole) and np.shares_memory(got["transposed"], whole)
    assert got["column"].strides == (16,)


def test_structure_encoded_and_parsed_once_per_structure(slot):
    D._LAYOUTS.clear()
    D._TEMPLATES.clear()
    for n in range(1, 40):
        got, _ = slot.roundtrip(lambda alloc, n=n: [alloc((n, 3), np.uint8), alloc((n,), np.int64), n, "s" * n])
        assert got[0].shape == (n, 3) and got[2] == n and got[3] == "s" * n
        del got
    assert len(D._LAYOUTS) == 1 and len(D._TEMPLATES) == 1
    got, _ = slot.roundtrip(lambda alloc: [alloc((2, 3), np.uint8), alloc((2,), np.int32), 2, "s"])
    assert got[1].dtype == np.int32
    assert len(D._LAYOUTS) == 2 and len(D._TEMPLATES) == 2


def test_equal_keys_of_different_types_are_different_structures(slot):
    """1, True and 1.0 are equal dict keys; each comes back with its own type."""
    for key in (1, True, 1.0, 1, True):
        got, _ = slot.roundtrip(lambda alloc, key=key: heap({key: np.arange(2)}))
        (k,) = got
        assert type(k) is type(key), (k, key)
        del got


def test_object_array_rebuild_checks_shape_against_items():
    """NumPy's own object-array unpickling crashes on a shape larger than its items;
    ours raises."""
    with pytest.raises(D.CorruptDescriptor, match=r"object array of shape \(1048576,\) with 2 items"):
        _inband.object_array((1 << 20,), [1, 2])
    assert same(_inband.object_array((2, 1), ["a", None]), np.array([["a"], [None]], dtype=object))


# ---- corruption: each field ----

def descriptor(slot, build=tiny):
    """Publish ``build``, take the slot; (lease, desc_off, desc_len, payload view, original bytes)."""
    slot.publish(build)
    lease, off, n, _ = slot.take()
    mv = memoryview(lease)
    return lease, off, n, mv, bytes(mv[off:off + n])


def assert_corrupt(lease, off, n, match):
    """decode raises CorruptDescriptor (a CorruptSlotError) naming the slot, the batch
    and ``match``, and allocates < 1 MiB doing so."""
    tracemalloc.start()
    try:
        with pytest.raises(_ring.CorruptSlotError, match=match) as info:
            D.decode(lease, off, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(info.value) is D.CorruptDescriptor
    assert str(info.value).startswith(f"slot {lease.slot} (batch {lease.seq}): ")
    assert info.value.slot == lease.slot and info.value.field == "descriptor"
    assert peak < 1 << 20, f"decode allocated {peak} bytes on a corrupt descriptor"


def forge_structure(mv, structure: bytes, values: bytes, var: bytes = b""):
    """Write a descriptor with the given sections (and a matching hash) at the start
    of the slot (over the arrays); returns its (offset, length)."""
    header = S.HEADER.pack(S.MAGIC, S.VERSION, 0, len(structure), len(values), len(var), S.digest(structure))
    data = header + structure + values + var
    assert len(data) <= len(mv)
    mv[:len(data)] = data
    return 0, len(data)


def test_header_fields(slot):
    lease, off, n, mv, orig = descriptor(slot)
    assert_corrupt(lease, off, n - 1, "do not add up to desc_len")
    assert_corrupt(lease, off, 3, f"shorter than its {S.HEADER.size}-byte header")
    assert_corrupt(lease, lease.nbytes - 10, 20, "outside the")
    for field, value, match in [(0, 0x1234, "magic 0x1234"), (2, 9, "version 9"),
                                (4, 2**32 - 1, "do not add up"), (8, 2**32 - 1, "do not add up"),
                                (12, 2**40, "do not add up"), (20, 12345, "hash 0x3039 does not match")]:
        fmt = {0: "<H", 2: "<B", 4: "<I", 8: "<I", 12: "<Q", 20: "<Q"}[field]
        mv[off:off + n] = orig
        struct.pack_into(fmt, mv, off + field, value)
        assert_corrupt(lease, off, n, match)
    mv[off:off + n] = orig
    D._TEMPLATES.clear()
    assert same(D.decode(lease, off, n), tiny(lambda s, d: np.empty(s, d)))
    del mv


U32 = struct.Struct("<I").pack


@pytest.mark.parametrize("structure, values, match", [
    (bytes([99]), b"", "unknown opcode 99 at byte 0"),
    (bytes([S.LIST]) + U32(2**32 - 1), b"", "container length 4294967295 at byte 1 exceeds"),
    (bytes([S.DICT]) + U32(1000), b"", "dict length 1000 at byte 1 exceeds"),
    (bytes([S.ARRAY, S.D_STR, 3]) + b"|u1" + bytes([200, 1]), b"", "ndim 200 at byte 0 exceeds 64"),
    (bytes([S.ARRAY, S.D_STR, 3]) + b"|O8" + bytes([1, 1]), b"", "names an object dtype"),
    (bytes([S.ARRAY, S.D_STR, 3]) + b"zz!" + bytes([1, 1]), b"", "is not a NumPy type string"),
    (bytes([S.ARRAY, S.D_STR, 3]) + b"|u1" + bytes([1, 7]), b"", "contiguous flag 7"),
    (bytes([S.ARRAY, 5]), b"", "dtype tag 5"),
    (bytes([S.ARRAY, S.D_STR, 200]) + b"|u1", b"", "dtype string of 200 bytes at byte 3 runs past"),
    (bytes([S.ARRAY, S.D_PICKLE]) + U32(5) + pickle.dumps(5)[:5], b"", "dtype pickle"),
    (bytes([S.TUPLE]) + U32(1), b"", "container length 1 at byte 1 exceeds what the remaining 0 bytes"),
    (bytes([S.NONE, S.NONE]), b"", "1 trailing bytes after byte 1"),
    (b"".join(bytes([S.TUPLE]) + U32(1) for _ in range(S.MAX_DEPTH + 1)) + bytes([S.NONE]), b"",
     f"nesting deeper than {S.MAX_DEPTH}"),
    (bytes([S.DICT]) + U32(1) + bytes([42, S.NONE]), b"", "key tag 42 at byte 5"),
    (bytes([S.INT]), b"\x00" * 9, "values section is 9 bytes, its structure needs 8"),
    (bytes([S.NAMEDTUPLE]) + U32(len(pickle.dumps(int))) + pickle.dumps(int) + U32(0), b"",
     "not a namedtuple type"),
])
def test_structure_fields(slot, structure, values, match):
    lease, _, _, mv, _ = descriptor(slot)
    off, n = forge_structure(mv, structure, values)
    del mv
    assert_corrupt(lease, off, n, match)


ARRAY_U1_2D = bytes([S.ARRAY, S.D_STR, 3]) + b"|u1" + bytes([2, 1])
ARRAY_U1_STRIDED = bytes([S.ARRAY, S.D_STR, 3]) + b"|u1" + bytes([1, 0])


@pytest.mark.parametrize("structure, values, match", [
    (ARRAY_U1_2D, struct.pack("<3Q", 2**40, 1, 1), r"offset 1099511627776, shape \(1, 1\)"),
    (ARRAY_U1_2D, struct.pack("<3Q", 0, 2**40, 2**40), r"shape \(1099511627776, 1099511627776\)"),
    (ARRAY_U1_2D, struct.pack("<3Q", 2**64 - 1, 1, 1), "offset 18446744073709551615"),
    (ARRAY_U1_2D, struct.pack("<3Q", 0, 2**62, 16), "does not fit the"),
    (ARRAY_U1_STRIDED, struct.pack("<Qq", 0, 10) + struct.pack("<q", -1), r"strides \(-1,\)"),
    (ARRAY_U1_STRIDED, struct.pack("<Qq", 0, 3) + struct.pack("<q", 2**40), r"strides \(1099511627776,\)"),
    (bytes([S.STR]), struct.pack("<Q", 2**40), "var lengths add up to 1099511627776"),
    (bytes([S.STR]), struct.pack("<Q", 2), "var lengths add up to 2, the var section is 0"),
])
def test_value_fields(slot, structure, values, match):
    lease, _, _, mv, _ = descriptor(slot)
    off, n = forge_structure(mv, structure, values)
    del mv
    assert_corrupt(lease, off, n, match)


@pytest.mark.parametrize("op, count, var, match", [
    (S.STR_LIST, 4, b"a\0b\0c", "4 strings, but the bytes hold 3 NUL-separated parts"),
    (S.STR_LIST, 0, b"abc", "0 strings, but the bytes hold 1"),
    (S.STR_LIST, 2, b"a\0\xff", "str list 0 .*invalid start byte"),
    (S.INT_LIST, 3, bytes(16), "3 numbers need 24 bytes"),
    (S.INT_LIST, 2**61, bytes(16), "2305843009213693952 numbers need"),
    (S.FLOAT_LIST, 1, bytes(9), "1 numbers need 8 bytes"),
    (S.INT_LISTS, 2**40, bytes(24), "1099511627776 lists do not fit"),
    (S.INT_LISTS, 2, struct.pack("<3q", 0, 5, 1) + struct.pack("<q", 7), "offsets are not 0 <= ... <= 1"),
    (S.INT_LISTS, 1, struct.pack("<2q", 1, 1) + struct.pack("<q", 7), "offsets are not"),
    (S.INT_LISTS, 1, struct.pack("<2q", 0, 1) + b"\x00", "lists do not fit"),
])
def test_leaf_list_fields(slot, op, count, var, match):
    lease, _, _, mv, _ = descriptor(slot)
    off, n = forge_structure(mv, bytes([op]), struct.pack("<QQ", count, len(var)), var)
    del mv
    assert_corrupt(lease, off, n, match)


def blob_descriptor(mv, blob: bytes):
    return forge_structure(mv, bytes([S.BLOB]), struct.pack("<Q", len(blob)), blob)


@pytest.mark.parametrize("blob, match", [
    # BINBYTES8 claiming 1 TiB: CPython's unpickler would allocate it before reading
    (b"\x80\x05\x8e" + struct.pack("<Q", 2**40) + b"xx.", "length 1099511627776 declared at byte 2 exceeds the 3"),
    # LONG_BINPUT 2**32-1: CPython's unpickler grows its memo to that index (32 GiB)
    (b"\x80\x05N" + b"r" + struct.pack("<I", 2**32 - 1) + b".", "memo index 4294967295 at byte 3 after 0 stores"),
    (b"\x80\x05N\x94h\x05.", "memo index 5 at byte 4 after 1 stores"),
    (b"\x80\x05\x95" + struct.pack("<Q", 2**40) + b"N.", "frame of 1099511627776 bytes"),
    (b"\x80\x05\x8c\xffabc.", "length 255 declared at byte 2 exceeds the 4 bytes left"),
    (b"\x80\x05B" + struct.pack("<I", 2**32 - 1) + b".", "length 4294967295 declared at byte 2"),
    (b"\x80\x05T" + struct.pack("<i", -5) + b".", "length -5 declared at byte 2"),
    (b"", "no STOP opcode in the 0-byte pickle"),
    (b"\x80\x05N", "no STOP opcode"),
    (b"\x80\x05\xff.", "unknown opcode 0xff at byte 2"),
    (b"\x80\x05Np99999999999\n.", "memo index 99999999999 at byte 3 after 0 stores"),
    (b"\x80\x05cos\nsystem", "line at byte 2 has no end"),
    (pickle.dumps(("a", 2**40, "|u1", (4,), None), protocol=5)[:-1] + b"Q.", "does not fit the"),
    (pickle.dumps(("a", 0, "|O8", (4,), None), protocol=5)[:-1] + b"Q.", "names an object dtype"),
    (pickle.dumps(("b", 0), protocol=5)[:-1] + b"Q.", "is not an array reference"),
])
def test_inband_pickle_fields(slot, blob, match):
    lease, _, _, mv, _ = descriptor(slot)
    off, n = blob_descriptor(mv, blob)
    del mv
    assert_corrupt(lease, off, n, match)


SHARED_LIST = [1, "x"]
PICKLABLE = [
    [SHARED_LIST, SHARED_LIST, {"k": SHARED_LIST}],      # memo reads
    b"\x00" * 300, bytearray(b"ab"), 2**100, -(2**2000), 1.5, "é" * 300, (None, True, False),
    Thing(2, np.arange(3)), Record("r", [1, 2]), frozenset({1, 2}), {3, 4}, Point(1, 2), int, np.float32(2),
]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_check_pickle_accepts_every_protocol_and_refuses_every_truncation(protocol):
    """No false alarm on what CPython's pickler writes, at any protocol (text and binary
    memo opcodes, frames, long and short lengths); a pickle cut anywhere is refused."""
    for obj in PICKLABLE:
        data = pickle.dumps(obj, protocol=protocol)
        _inband.check_pickle(data, "ok")
        for cut in range(len(data)):
            with pytest.raises(D.CorruptDescriptor):
                _inband.check_pickle(data[:cut], "cut")


class ForgedObjectArray:
    """Pickles as an object array whose shape claims more items than it carries."""

    def __reduce__(self):
        return _inband.object_array, ((1 << 20,), [1, 2])


def test_forged_object_array_shape_raises(slot):
    slot.publish(lambda alloc: heap([ForgedObjectArray()]))
    lease, off, n, _ = slot.take()
    assert_corrupt(lease, off, n, r"object array of shape \(1048576,\)")


# ---- corruption: random byte changes, in a child process ----

FUZZ_BATCHES = {
    "tiny": tiny,
    "mixed": lambda a: heap({"s": "text", "n": 3, "f": 1.5, "pt": Point(np.arange(3.0), b"by"),
                             "arr": np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]}),
    "in-band": lambda a: heap([OBJECTS, Thing(1, np.ones(3)), Record("r", [1, "2", None])]),
    "leaf lists": lambda a: heap([["ab", "c\udc80"], [[1, 2], [], [3]], [1.5, 2.5], [7, -8],
                                  np.array(["x", "yy", "z", ""], dtype=object).reshape(2, 2)]),
}


def fuzz(name: str, trials: int, seed: int) -> None:
    """Change 1-5 random bytes of a descriptor ``trials`` times; decode must return a
    batch whose arrays lie in the slot, or raise CorruptDescriptor, allocating < 16 MiB."""
    rng = random.Random(seed)
    s = Slot()
    s.publish(FUZZ_BATCHES[name])
    lease, off, n, _ = s.take()
    mv = memoryview(lease)
    orig = bytes(mv[off:off + n])
    lo = np.frombuffer(lease, np.uint8).ctypes.data
    hi = lo + lease.nbytes
    tracemalloc.start()
    outcomes = collections.Counter()
    for _ in range(trials):
        mv[off:off + n] = orig
        for _ in range(rng.randint(1, 5)):
            mv[off + rng.randrange(n)] = rng.randrange(256)
        if rng.random() < 0.3:
            D._TEMPLATES.clear()
        tracemalloc.reset_peak()
        try:
            got = D.decode(lease, off, n)
        except D.CorruptDescriptor:
            outcomes["corrupt"] += 1
        else:
            outcomes["decoded"] += 1
            for arr in arrays(got):
                if not arr.dtype.hasobject and arr.size:
                    a_lo, a_hi = byte_bounds(arr)
                    assert lo <= a_lo and a_hi <= hi, "a view outside the slot"
            del got
        peak = tracemalloc.get_traced_memory()[1]
        assert peak < 16 << 20, f"decode allocated {peak} bytes"
    assert outcomes["corrupt"] > trials // 4, outcomes


def run_in_child(fn, *args, timeout_s=100):
    """Run ``fn(*args)`` in a forked child with a hard timeout: a crash or a hang
    fails the test instead of killing the suite."""
    ctx = multiprocessing.get_context("fork")
    r, w = ctx.Pipe(duplex=False)

    def child():
        try:
            fn(*args)
            w.send("ok")
        except BaseException:  # noqa: BLE001 - reported to the parent
            w.send(traceback.format_exc())
        finally:
            w.close()
            os._exit(0)

    p = ctx.Process(target=child)
    p.start()
    w.close()
    try:
        if not r.poll(timeout_s):
            p.kill()
            p.join()
            pytest.fail(f"child did not finish within {timeout_s} s (exit code {p.exitcode})")
        try:
            msg = r.recv()
        except EOFError:
            msg = None
        p.join()
    finally:
        r.close()
    assert p.exitcode == 0 and msg == "ok", f"child exit code {p.exitcode}: {msg}"


@pytest.mark.parametrize("name", list(FUZZ_BATCHES))
def test_random_byte_changes(name):
    run_in_child(fuzz, name, 400, 1234)


class CorruptsTheReadySlot:
    """``dataset[i]``: a row of ``i``.  Loading sample 8 (batch 2) waits until the
    parent has taken batch 0, then overwrites the descriptor magic of every READY
    slot -- batch 1's, published and not yet taken -- as a stray writer would, and
    tells the parent."""

    def __init__(self, n):
        self.n, self.loader = n, None
        self.taken_r, self.taken_w = os.pipe()      # parent -> worker: batch 0 taken
        self.corrupt_r, self.corrupt_w = os.pipe()  # worker -> parent: batch 1 corrupted

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 8:
            assert os.read(self.taken_r, 1) == b"x"
            region = self.loader._engine.region
            for s in range(region.nslots):
                if region.state(s) == _ring.STATE_READY:
                    m = region.meta(s)
                    ctypes.memmove(region.address + m.offset + m.desc_off, b"\xff\xff\xff", 3)
            os.write(self.corrupt_w, b"x")
        return np.full(3, i, np.int64)

    def close(self):
        for fd in (self.taken_r, self.taken_w, self.corrupt_r, self.corrupt_w):
            os.close(fd)


def corrupt_descriptor_through_a_loader():
    ds = CorruptsTheReadySlot(40)
    with mploader.DataLoader(ds, batch_size=4, num_workers=1, prefetch=4, seed=0, timeout=20) as dl:
        ds.loader = dl
        it = iter(dl)
        got = [int(next(it)[0, 0])]  # batch 0, its slot FREE again at once
        os.write(ds.taken_w, b"x")
        assert os.read(ds.corrupt_r, 1) == b"x"  # batch 1's slot is corrupt now
        errors = []
        for _ in range(len(dl) - 1):
            try:
                got.append(int(next(it)[0, 0]))
            except _ring.CorruptSlotError as e:
                errors.append(e)
        assert len(errors) == 1, errors
        e = errors[0]
        assert type(e) is D.CorruptDescriptor and e.field == "descriptor" and e.slot is not None
        assert str(e).startswith(f"slot {e.slot} (batch ") and "descriptor magic 0xffff version 255" in str(e), e
        assert got == [4 * k for k in range(10) if k != 1], got
        region = dl._engine.region
        del it, errors, e  # (the traceback holds the frame that held the lease)
        gc.collect()
        staged = dl._engine.staged_slots()   # the next epoch's first batches (docs/design.md)
        states = [region.state(s) for s in range(region.nslots) if s not in staged]
        assert states == [_ring.STATE_FREE] * (region.nslots - len(staged)), states
    ds.close()


def test_corrupt_descriptor_in_a_loader_raises_once_and_iteration_goes_on():
    """Issue 9 item 9, end to end: a stray write into a published batch's descriptor is
    that batch's CorruptDescriptor naming the slot; the other batches arrive intact and
    every slot ends FREE."""
    run_in_child(corrupt_descriptor_through_a_loader)


# ---- slot sizing ----

def test_sizing_target_ignores_outliers():
    s = _sizing.SlotSizing()
    assert s.target_bytes() == 0 and not s.should_shrink(1 << 30, 0)
    for _ in range(15):
        s.note(10_000)
    s.note(50 << 20)
    assert s.target_bytes() == 16_384  # 10,000 * 1.25 rounded up to a 4 KiB page
    assert s.should_shrink(60 << 20, 16_384)
    assert not s.should_shrink(100_000, 16_384), "less than 1 MiB to gain: not worth a system call"
    for _ in range(4):
        s.note(50 << 20)  # 5 of 16 large: no longer an outlier
    assert s.target_bytes() == (int((50 << 20) * 1.25) + 4095) & ~4095


class Sizes:
    """Batch ``k`` of 4 samples is ``big_bytes`` when ``k`` is in ``big`` else ``small_bytes``."""

    def __init__(self, n_batches, big, big_bytes, small_bytes):
        self.n, self.big, self.big_bytes, self.small_bytes = 4 * n_batches, big, big_bytes, small_bytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        nbytes = self.big_bytes if i // 4 in self.big else self.small_bytes
        return np.full(nbytes // 4, i % 251, np.uint8)


def region_of(loader):
    engine = loader._engine
    region = getattr(engine, "region", None)  # the redesigned engine's attribute
    return region if region is not None else engine._res.region


def allocated_bytes(region) -> int:
    """Bytes of memory the region's memfd holds (holes excluded)."""
    return os.fstat(region.fd).st_blocks * 512


@pytest.mark.parametrize("num_workers", [1, 2])
def test_outlier_batch_memory_returns(num_workers):
    """Two 32 MiB batches among 16 KiB ones: after each, once every slot has been
    written again, the region holds a few times the typical batch per slot (before
    the sizing policy, every slot grew to the outlier and stayed there: 200-280 MiB)."""
    big_bytes, small_bytes, n_batches, big = 32 << 20, 4 << 10, 64, (8, 36)
    ds = Sizes(n_batches, set(big), big_bytes, small_bytes)
    with mploader.DataLoader(ds, batch_size=4, num_workers=num_workers, prefetch=2 * num_workers, seed=0) as dl:
        num_slots = dl.stats()["num_slots"]
        history = []
        for k, batch in enumerate(dl):
            nbytes = big_bytes if k in big else small_bytes
            assert batch.shape == (4, nbytes // 4)
            assert (batch[:, 0] == np.arange(4 * k, 4 * k + 4) % 251).all() and (batch == batch[:, :1]).all()
            del batch
            history.append(allocated_bytes(region_of(dl)))
    typical = 4 * small_bytes
    bound = num_slots * 4 * typical + (1 << 20)
    for k, end in zip(big, (big[1], n_batches)):
        assert max(history[k:k + 2]) >= big_bytes, f"outlier {k} travelled in the region"
        settled = history[k + 3 * num_slots:end]
        assert settled and max(settled) <= bound, \
            f"{max(settled)} bytes allocated after outlier {k}; typical batch {typical}, {num_slots} slots"


def test_configured_slot_size_is_kept():
    """Slots sized by ``shared_mem`` are not shrunk by small batches: only growth is undone."""
    slot_bytes = 4 << 20
    with mploader.DataLoader(Sizes(24, set(), 0, 4 << 10), batch_size=4, num_workers=1, seed=0,
                             shared_mem=slot_bytes) as dl:
        for batch in dl:
            del batch
        num_slots = dl.stats()["num_slots"]
        assert allocated_bytes(region_of(dl)) >= num_slots * slot_bytes
