"""The descriptor's wire format: its header, and its structure section both ways
(docs/design.md, "Batch descriptor").

Worker side: a batch's structure *signature* (the flat tuple of tokens
``mploader._descriptor`` collects while walking a batch) is compiled once per
structure into a :class:`Layout`: the structure bytes, their hash, and the
``struct`` format of the per-batch values.  Parent side: structure bytes are parsed
once per structure into a :class:`Template`: the values format and a tree of
builder functions that rebuild a batch from the unpacked values, the leased slot
and the var section.  Parsing checks every count against the bytes that remain
before allocating, the nesting depth, every dtype, and every in-band pickle.

Structure grammar (little-endian; counts are u32)::

    node  := TUPLE n node*n | LIST n node*n | DICT n (const node)*n
           | NAMEDTUPLE len class-pickle n node*n
           | ARRAY dtype ndim:u8 contiguous:u8 | SCALAR dtype
           | INT | FLOAT | BOOL | COMPLEX | NONE | STR | BYTES | BLOB
           | STR_LIST | INT_LIST | FLOAT_LIST | INT_LISTS | OBJ_ARRAY ndim:u8 node
    dtype := D_STR len:u8 ascii-type-string | D_PICKLE len pickle
    const := K_NONE | K_FALSE | K_TRUE | K_INT i64 | K_FLOAT f64
           | K_STR len utf-8 | K_BYTES len bytes | K_TUPLE n const*n

Values per leaf: ARRAY offset:u64, shape:u64*ndim (strides:i64*ndim when not
contiguous); OBJ_ARRAY shape:u64*ndim; INT i64; FLOAT f64; BOOL u8; COMPLEX f64 f64; SCALAR itemsize bytes;
STR / BYTES / BLOB their length in the var section, u64; STR_LIST / INT_LIST /
FLOAT_LIST / INT_LISTS the list's length and their length in the var section, u64
each (var: the strings UTF-8 encoded and joined by NUL; the ints or floats as
little-endian 64-bit; for INT_LISTS the n + 1 offsets, then the concatenated ints).
"""
from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ._inband import (
    MAX_NDIM,
    CorruptDescriptor,
    dtype_from_str,
    load_pickle,
    object_array,
    simple_dtype,
)

#: Descriptor format: magic, version.
MAGIC = 0x444D
VERSION = 1
#: magic u16, version u8, reserved u8, structure bytes u32, values bytes u32,
#: var bytes u64, structure hash u64.
HEADER = struct.Struct("<HBBIIQQ")
#: Nesting deeper than this travels as an in-band pickle (the parser refuses deeper
#: structures, so a corrupt descriptor cannot exhaust the parent's stack).
MAX_DEPTH = 32
#: Entries kept in each structure cache (worker: layouts, parent: templates); a
#: cache that fills up is emptied (a stream of ever-new structures costs one
#: encode/parse each, and memory stays bounded).
CACHE_ENTRIES = 256
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

# Structure opcodes (one byte each).
TUPLE, LIST, DICT, NAMEDTUPLE = 1, 2, 3, 4
ARRAY, INT, FLOAT, BOOL, COMPLEX, NONE, STR, BYTES, SCALAR, BLOB = range(16, 26)
# Lists of Python leaves encoded without pickle: of str, of int (64-bit), of float,
# of lists of int (ragged sequences such as token ids).
STR_LIST, INT_LIST, FLOAT_LIST, INT_LISTS = range(32, 36)
# An object array: its ndim, then one node for its items in C order (values: its shape).
OBJ_ARRAY = 40
# Constant (dict key) tags.
K_NONE, K_FALSE, K_TRUE, K_INT, K_FLOAT, K_STR, K_BYTES, K_TUPLE = range(8)
# Dtype tags.
D_STR, D_PICKLE = 0, 1
#: Values-format codes of the leaves whose structure entry is the opcode alone.
LEAF_CODES = {INT: "q", FLOAT: "d", BOOL: "?", COMPLEX: "dd", NONE: "", STR: "Q", BYTES: "Q", BLOB: "Q",
              STR_LIST: "QQ", INT_LIST: "QQ", FLOAT_LIST: "QQ", INT_LISTS: "QQ"}
#: Leaves with bytes in the var section; their var length is the last value.
VAR_LEAVES = frozenset((STR, BYTES, BLOB, STR_LIST, INT_LIST, FLOAT_LIST, INT_LISTS))

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


# ---------------------------------------------------------------------------
# worker side: signature -> layout
# ---------------------------------------------------------------------------

class Layout:
    """A structure's encoding, cached by the worker per structure signature."""

    __slots__ = ("digest", "struct_bytes", "struct_len", "values", "whole")

    def __init__(self, struct_bytes: bytes, fmt: str) -> None:
        self.struct_bytes = struct_bytes
        self.struct_len = len(struct_bytes)
        self.digest = digest(struct_bytes)
        self.values = struct.Struct(fmt)
        # header, structure and values in one pack_into per batch
        self.whole = struct.Struct(f"{HEADER.format}{self.struct_len}s{fmt[1:]}")


def digest(struct_bytes: bytes | memoryview) -> int:
    return int.from_bytes(hashlib.blake2b(struct_bytes, digest_size=8).digest(), "little")


def const_ok(k: Any, depth: int) -> bool:
    """Whether a dict key can be encoded as a constant in the structure."""
    t = type(k)
    if k is None or t is bool or t is float or t is str or t is bytes:
        return True
    if t is int:
        return I64_MIN <= k <= I64_MAX
    if t is tuple:
        return depth < 8 and all(const_ok(x, depth + 1) for x in k)
    return False


_NT_CLASSES: dict[type, bytes | None] = {}


def namedtuple_class(cls: type) -> bytes | None:
    """The pickle (by reference) of a namedtuple class, or None if ``cls`` is not
    one that can be rebuilt by name in the parent."""
    try:
        return _NT_CLASSES[cls]
    except KeyError:
        pass
    blob = None
    fields = getattr(cls, "_fields", None)
    if isinstance(fields, tuple) and all(type(f) is str for f in fields):
        try:
            data = pickle.dumps(cls, protocol=5)
            if pickle.loads(data) is cls:
                blob = data
        except Exception:  # noqa: BLE001 - a local class: not rebuildable by name
            blob = None
    if len(_NT_CLASSES) >= CACHE_ENTRIES:
        _NT_CLASSES.clear()
    _NT_CLASSES[cls] = blob
    return blob


def compile_layout(sig: tuple) -> Layout:
    """Encode a structure signature: the structure bytes and the values format."""
    out = bytearray()
    codes: list[str] = []
    pos = 0

    def node() -> None:
        nonlocal pos, out
        op = sig[pos]
        pos += 1
        out.append(op)
        if op == TUPLE or op == LIST:
            n = sig[pos]
            pos += 1
            out += _U32.pack(n)
            for _ in range(n):
                node()
        elif op == DICT:
            n = sig[pos]
            pos += 1
            out += _U32.pack(n)
            for _ in range(n):
                key = sig[pos]
                pos += 1
                _encode_const(out, key if type(key) is str else key[1])
                node()
        elif op == NAMEDTUPLE:
            cls, n = sig[pos], sig[pos + 1]
            pos += 2
            blob = namedtuple_class(cls)
            assert blob is not None  # the walk only emits NAMEDTUPLE for such classes
            out += _U32.pack(len(blob))
            out += blob
            out += _U32.pack(n)
            for _ in range(n):
                node()
        elif op == ARRAY:
            dtype, ndim, contiguous = sig[pos:pos + 3]
            pos += 3
            _encode_dtype(out, dtype)
            out.append(ndim)
            out.append(1 if contiguous else 0)
            codes.append("Q")
            codes.extend("Q" * ndim)
            if not contiguous:
                codes.extend("q" * ndim)
        elif op == OBJ_ARRAY:
            ndim = sig[pos]
            pos += 1
            out.append(ndim)
            codes.extend("Q" * ndim)
            node()
        elif op == SCALAR:
            dtype = sig[pos]
            pos += 1
            _encode_dtype(out, dtype)
            codes.append(f"{dtype.itemsize}s")
        else:
            codes.extend(LEAF_CODES[op])

    node()
    assert pos == len(sig), (pos, len(sig))
    return Layout(bytes(out), _format(codes))


def _format(codes: list[str]) -> str:
    """``struct`` format of ``codes`` with runs of one code merged (``QQQ`` -> ``3Q``)."""
    parts = ["<"]
    i = 0
    while i < len(codes):
        c = codes[i]
        j = i + 1
        if len(c) == 1:
            while j < len(codes) and codes[j] == c:
                j += 1
        parts.append(c if j - i == 1 else f"{j - i}{c}")
        i = j
    return "".join(parts)


def _encode_dtype(out: bytearray, dtype: np.dtype) -> None:
    if simple_dtype(dtype):
        s = dtype.str.encode("ascii")
        out.append(D_STR)
        out.append(len(s))
        out += s
    else:
        data = pickle.dumps(dtype, protocol=5)
        out.append(D_PICKLE)
        out += _U32.pack(len(data))
        out += data


def _encode_const(out: bytearray, k: Any) -> None:
    t = type(k)
    if k is None:
        out.append(K_NONE)
    elif t is bool:
        out.append(K_TRUE if k else K_FALSE)
    elif t is int:
        out.append(K_INT)
        out += _I64.pack(k)
    elif t is float:
        out.append(K_FLOAT)
        out += _F64.pack(k)
    elif t is str or t is bytes:
        data = k.encode("utf-8", "surrogatepass") if t is str else k
        out.append(K_STR if t is str else K_BYTES)
        out += _U32.pack(len(data))
        out += data
    else:  # tuple (checked by const_ok)
        out.append(K_TUPLE)
        out += _U32.pack(len(k))
        for x in k:
            _encode_const(out, x)


# ---------------------------------------------------------------------------
# parent side: structure bytes -> decode template
# ---------------------------------------------------------------------------

class _Reader:
    """Bounds-checked cursor over the structure bytes of one descriptor."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise CorruptDescriptor(f"structure: {what} of {n} bytes at byte {self.pos} runs past the "
                                    f"{len(self.data)}-byte structure")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        return _U32.unpack(self.take(4, what))[0]

    def count(self, what: str, min_bytes_each: int) -> int:
        """A u32 element count, checked against the bytes left (each element needs
        at least ``min_bytes_each``) before anything is allocated for it."""
        at = self.pos
        n = self.u32(what)
        if n * min_bytes_each > len(self.data) - self.pos:
            raise CorruptDescriptor(f"structure: {what} {n} at byte {at} exceeds what the remaining "
                                    f"{len(self.data) - self.pos} bytes can hold")
        return n


#: Per-batch decode state handed to the template's builders: (lease, copy_below,
#: var, var_pos) -- the leased slot, the size in bytes under which an array is
#: copied out (0: none, :data:`COPY_ALL`: every one), the var section and the start
#: of each variable-length leaf in it (plus its end).  A tuple: cheaper to make per
#: batch than an object.
_Build = tuple

#: ``copy_below`` that copies every array (``copy=True``).
COPY_ALL = 1 << 62


Builder = Callable[[tuple, _Build], Any]


class Template:
    """A parsed structure: the values format and the function that rebuilds a batch."""

    __slots__ = ("build", "struct_len", "values", "var_slots")

    def __init__(self, struct_len: int, values: struct.Struct, build: Builder, var_slots: tuple[int, ...]) -> None:
        self.struct_len = struct_len
        self.values = values
        self.build = build
        self.var_slots = var_slots  # indices in the values tuple of the var lengths, in order


def parse(data: bytes) -> Template:
    """Parse structure bytes into a decode template; raises CorruptDescriptor."""
    rd = _Reader(data)
    codes: list[str] = []
    var_slots: list[int] = []
    nvals = [0]

    def take_vals(n: int) -> int:
        first = nvals[0]
        nvals[0] += n
        return first

    def node(depth: int) -> Builder:
        at = rd.pos
        op = rd.u8("opcode")
        if op == TUPLE or op == LIST or op == NAMEDTUPLE:
            cls = None
            if op == NAMEDTUPLE:
                blob = rd.take(rd.count("namedtuple class length", 1), "namedtuple class")
                cls = load_pickle(blob, "namedtuple class")
                if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
                    raise CorruptDescriptor(f"structure: namedtuple class at byte {at} is {cls!r}, not a "
                                            f"namedtuple type")
            n = rd.count("container length", 1)
            if n and depth >= MAX_DEPTH:
                raise CorruptDescriptor(f"structure: nesting deeper than {MAX_DEPTH} at byte {at}")
            children = [node(depth + 1) for _ in range(n)]
            return _container(op, children, cls)
        if op == DICT:
            n = rd.count("dict length", 2)
            if n and depth >= MAX_DEPTH:
                raise CorruptDescriptor(f"structure: nesting deeper than {MAX_DEPTH} at byte {at}")
            keys = []
            children = []
            for _ in range(n):
                keys.append(_read_const(rd, 0))
                children.append(node(depth + 1))
            return _dict_builder(tuple(keys), children)
        if op == ARRAY:
            dtype = _read_dtype(rd)
            ndim = rd.u8("ndim")
            if ndim > MAX_NDIM:
                raise CorruptDescriptor(f"structure: ndim {ndim} at byte {at} exceeds {MAX_NDIM}")
            contiguous = rd.u8("contiguous flag")
            if contiguous > 1:
                raise CorruptDescriptor(f"structure: contiguous flag {contiguous} at byte {at} is not 0 or 1")
            codes.append("Q")
            codes.extend("Q" * ndim)
            first = take_vals(1 + ndim)
            if not contiguous:
                codes.extend("q" * ndim)
                take_vals(ndim)
            return _array_builder(dtype, first, ndim, bool(contiguous))
        if op == OBJ_ARRAY:
            ndim = rd.u8("ndim")
            if ndim > MAX_NDIM or depth >= MAX_DEPTH:
                raise CorruptDescriptor(f"structure: object array of ndim {ndim} at byte {at} (depth {depth})")
            codes.extend("Q" * ndim)
            i = take_vals(ndim)
            items = node(depth + 1)
            return lambda v, b: object_array(v[i:i + ndim], items(v, b))
        if op == SCALAR:
            dtype = _read_dtype(rd)
            if dtype.itemsize == 0:
                raise CorruptDescriptor(f"structure: scalar dtype {dtype} at byte {at} has itemsize 0")
            codes.append(f"{dtype.itemsize}s")
            i = take_vals(1)
            return lambda v, b: np.frombuffer(v[i], dtype)[0]
        if op in LEAF_CODES:
            c = LEAF_CODES[op]
            codes.extend(c)
            i = take_vals(len(c))
            if op in VAR_LEAVES:
                j = len(var_slots)
                var_slots.append(i + len(c) - 1)
                return _VAR_BUILDERS[op](i, j)
            return _LEAF_BUILDERS[op](i)
        raise CorruptDescriptor(f"structure: unknown opcode {op} at byte {at}")

    build = node(0)
    if rd.pos != len(data):
        raise CorruptDescriptor(f"structure: {len(data) - rd.pos} trailing bytes after byte {rd.pos}")
    try:
        values = struct.Struct(_format(codes))
    except struct.error as e:
        raise CorruptDescriptor(f"structure: values format: {e}") from None
    return Template(len(data), values, build, tuple(var_slots))


def _container(op: int, children: list[Builder], cls: type | None) -> Builder:
    if op == LIST:
        if len(children) == 2:
            f0, f1 = children
            return lambda v, b: [f0(v, b), f1(v, b)]
        return lambda v, b: [f(v, b) for f in children]
    if op == TUPLE:
        if len(children) == 2:
            f0, f1 = children
            return lambda v, b: (f0(v, b), f1(v, b))
        return lambda v, b: tuple([f(v, b) for f in children])
    assert cls is not None
    new, name = cls.__new__, cls.__qualname__

    def namedtuple(v: tuple, b: _Build) -> Any:
        try:
            return new(cls, *[f(v, b) for f in children])
        except TypeError as e:
            raise CorruptDescriptor(f"namedtuple {name}({len(children)} fields): {e}") from None
    return namedtuple


def _dict_builder(keys: tuple, children: list[Builder]) -> Builder:
    return lambda v, b: dict(zip(keys, [f(v, b) for f in children]))


def _array_builder(dtype: np.dtype, i: int, ndim: int, contiguous: bool) -> Builder:
    j, k = i + 1, i + 1 + ndim
    ndarray = np.ndarray

    def array(v: tuple, b: _Build) -> np.ndarray:
        try:  # NumPy checks offset, shape and strides against the lease's length
            arr = ndarray(v[j:k], dtype, b[0], v[i], None if contiguous else v[k:k + ndim])
        except (ValueError, TypeError, OverflowError) as e:
            raise CorruptDescriptor(
                f"array at value {i}: offset {v[i]}, shape {v[j:k]}, strides "
                f"{None if contiguous else v[k:k + ndim]}, dtype {dtype} does not fit the "
                f"{b[0].nbytes}-byte slot: {e}") from None
        return arr.copy() if arr.nbytes < b[1] else arr
    return array


_LEAF_BUILDERS: dict[int, Callable[[int], Builder]] = {
    INT: lambda i: lambda v, b: v[i],
    FLOAT: lambda i: lambda v, b: v[i],
    BOOL: lambda i: lambda v, b: v[i],
    COMPLEX: lambda i: lambda v, b: complex(v[i], v[i + 1]),
    NONE: lambda i: lambda v, b: None,
}


def _var_str(i: int, j: int) -> Builder:
    def build(v: tuple, b: _Build) -> str:
        a, e = b[3][j], b[3][j + 1]
        try:
            return str(b[2][a:e], "utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CorruptDescriptor(f"string leaf {j} (var bytes [{a}, {e})): {exc}") from None
    return build


def _var_bytes(i: int, j: int) -> Builder:
    return lambda v, b: bytes(b[2][b[3][j]:b[3][j + 1]])


def _var_blob(i: int, j: int) -> Builder:
    def build(v: tuple, b: _Build) -> Any:
        a, e = b[3][j], b[3][j + 1]
        return load_pickle(b[2][a:e], f"in-band pickle {j} (var bytes [{a}, {e}))", b[0], b[1] >= COPY_ALL)
    return build


def _var_str_list(i: int, j: int) -> Builder:
    def build(v: tuple, b: _Build) -> list[str]:
        count, a, e = v[i], b[3][j], b[3][j + 1]
        raw = bytes(b[2][a:e])
        # count the separators first: the split then makes exactly `count` strings
        parts = raw.count(b"\0") + 1 if count else 0
        if parts != count or (not count and raw):
            raise CorruptDescriptor(f"str list {j} (var bytes [{a}, {e})): {count} strings, but the bytes hold "
                                    f"{raw.count(0) + 1} NUL-separated parts")
        if not count:
            return []
        try:
            return str(raw, "utf-8", "surrogatepass").split("\0")
        except UnicodeDecodeError as exc:
            raise CorruptDescriptor(f"str list {j} (var bytes [{a}, {e})): {exc}") from None
    return build


def _var_number_list(dtype: str) -> Callable[[int, int], Builder]:
    def make(i: int, j: int) -> Builder:
        def build(v: tuple, b: _Build) -> list:
            count, a, e = v[i], b[3][j], b[3][j + 1]
            if e - a != 8 * count:
                raise CorruptDescriptor(f"number list {j} (var bytes [{a}, {e})): {count} numbers need "
                                        f"{8 * count} bytes")
            return np.frombuffer(b[2], dtype, count, a).tolist()
        return build
    return make


def _var_int_lists(i: int, j: int) -> Builder:
    def build(v: tuple, b: _Build) -> list[list[int]]:
        count, a, e = v[i], b[3][j], b[3][j + 1]
        head = 8 * (count + 1)
        if head > e - a or (e - a - head) % 8:
            raise CorruptDescriptor(f"int lists {j} (var bytes [{a}, {e})): {count} lists do not fit")
        total = (e - a - head) // 8
        offsets = np.frombuffer(b[2], "<i8", count + 1, a)
        if offsets[0] != 0 or offsets[-1] != total or (count and bool((offsets[1:] < offsets[:-1]).any())):
            raise CorruptDescriptor(f"int lists {j} (var bytes [{a}, {e})): offsets are not 0 <= ... <= {total}")
        flat = np.frombuffer(b[2], "<i8", total, a + head).tolist()
        o = offsets.tolist()
        return [flat[o[k]:o[k + 1]] for k in range(count)]
    return build


_VAR_BUILDERS: dict[int, Callable[[int, int], Builder]] = {
    STR: _var_str, BYTES: _var_bytes, BLOB: _var_blob, STR_LIST: _var_str_list,
    INT_LIST: _var_number_list("<i8"), FLOAT_LIST: _var_number_list("<f8"), INT_LISTS: _var_int_lists,
}


def _read_dtype(rd: _Reader) -> np.dtype:
    at = rd.pos
    tag = rd.u8("dtype tag")
    if tag == D_STR:
        raw = rd.take(rd.u8("dtype string length"), "dtype string")
        try:
            s = raw.decode("ascii")
        except UnicodeDecodeError:
            raise CorruptDescriptor(f"structure: dtype string {raw!r} at byte {at} is not ASCII") from None
        return dtype_from_str(s, f"structure byte {at}")
    if tag == D_PICKLE:
        dtype = load_pickle(rd.take(rd.count("dtype pickle length", 1), "dtype pickle"), "dtype pickle")
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise CorruptDescriptor(f"structure: dtype pickle at byte {at} gave {dtype!r}, not a plain dtype")
        return dtype
    raise CorruptDescriptor(f"structure: dtype tag {tag} at byte {at} is not {D_STR} or {D_PICKLE}")


def _read_const(rd: _Reader, depth: int) -> Any:
    at = rd.pos
    tag = rd.u8("key tag")
    if tag == K_NONE:
        return None
    if tag == K_FALSE or tag == K_TRUE:
        return tag == K_TRUE
    if tag == K_INT:
        return _I64.unpack(rd.take(8, "int key"))[0]
    if tag == K_FLOAT:
        return _F64.unpack(rd.take(8, "float key"))[0]
    if tag == K_STR:
        raw = rd.take(rd.count("str key length", 1), "str key")
        try:
            return str(raw, "utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise CorruptDescriptor(f"structure: str key at byte {at}: {e}") from None
    if tag == K_BYTES:
        return rd.take(rd.count("bytes key length", 1), "bytes key")
    if tag == K_TUPLE and depth < 8:
        n = rd.count("tuple key length", 1)
        return tuple([_read_const(rd, depth + 1) for _ in range(n)])
    raise CorruptDescriptor(f"structure: key tag {tag} at byte {at} is not valid")
