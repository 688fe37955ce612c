"""In-band pickles of the batch descriptor, both directions, and the checks that
bound decoding (docs/design.md, "Batch descriptor").

What the structure section cannot express (object arrays, arbitrary objects,
lists of Python leaves, ints beyond 64 bits) travels as a pickle inside the
descriptor.  Plain ndarrays inside such a pickle still live in the slot: the
pickler replaces each by a persistent id ``("a", offset, dtype, shape, strides)``
and the unpickler turns it back into a view of the lease after checking it.

Bounding: :func:`check_pickle` walks the opcode stream before anything is
unpickled (every declared length within the data, frames within the data, memo
indices no larger than the stores so far), so the unpickler's own allocations are
bounded by the pickle's length; object arrays are rebuilt by :func:`object_array`,
which checks the item count against the shape (NumPy's own rebuild does not and
crashes on a corrupt shape).  What the classes a pickle names do when called is
trusted as much as the dataset's own code.
"""
from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _ring

#: NumPy's limit on dimensions.
MAX_NDIM = 64
_OBJECT = np.dtype(object)
_DTYPE_STR = re.compile(r"[<>|=]?[?a-zA-Z]\d{0,12}(\[\d{0,12}[a-zA-Z]{1,3}\])?")


class CorruptDescriptor(_ring.CorruptSlotError):
    """A slot's descriptor is malformed or describes memory outside its slot.

    One of the ring's corrupt-shared-state errors; :func:`mploader._descriptor.decode`
    sets ``slot`` and prefixes the message with the slot and batch.
    """


def simple_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype``'s type string round-trips it exactly (no fields, subarray,
    metadata or objects)."""
    return dtype.fields is None and dtype.subdtype is None and dtype.metadata is None and not dtype.hasobject


def dtype_from_str(s: str, what: str) -> np.dtype:
    """The plain dtype a type string such as ``"<f8"`` names; raises
    :class:`CorruptDescriptor` (naming ``what``) for anything else, object dtypes
    included."""
    if not _DTYPE_STR.fullmatch(s):
        raise CorruptDescriptor(f"{what}: dtype string {s!r} is not a NumPy type string")
    try:
        dtype = np.dtype(s)
    except (TypeError, ValueError) as e:
        raise CorruptDescriptor(f"{what}: dtype string {s!r}: {e}") from None
    if dtype.hasobject:
        raise CorruptDescriptor(f"{what}: dtype string {s!r} names an object dtype")
    return dtype


# ---- worker side ----

class InbandPickler(pickle.Pickler):
    """Protocol-5 pickler that moves plain ndarrays out of band into the slot.

    ``place(arr) -> (offset, strides or None)`` says where an array lies in the
    slot (copying it in later if it lies elsewhere).
    """

    def __init__(self, file: io.BytesIO, place: Callable[[np.ndarray], tuple[int, tuple | None]]) -> None:
        super().__init__(file, protocol=5)
        self.place = place

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not np.ndarray:
            return None
        dtype = obj.dtype
        if dtype.hasobject or dtype.itemsize == 0:
            return None
        off, strides = self.place(obj)
        return ("a", off, dtype.str if simple_dtype(dtype) else dtype, obj.shape, strides)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.dtype == _OBJECT:
            return object_array, (obj.shape, list(obj.reshape(-1)))
        return NotImplemented


def object_array(shape: Any, items: Any) -> np.ndarray:
    """Rebuild an object array of ``shape`` from its items in C order (shape and
    item count checked first); raises :class:`CorruptDescriptor`."""
    if not (type(shape) is tuple and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)
            and type(items) is list and math.prod(shape) == len(items)):
        count = len(items) if type(items) is list else repr(items)
        raise CorruptDescriptor(f"object array of shape {shape!r} with {count} items")
    return np.fromiter(items, _OBJECT, count=len(items)).reshape(shape)


# ---- parent side ----

def _arg_table() -> list[tuple[int, int] | None]:
    """Per opcode byte: (kind, size) of its argument -- kind 0: ``size`` fixed bytes;
    1: a ``size``-byte little-endian length, then that many bytes; 2: one line;
    3: two lines.  None: not an opcode."""
    table: list[tuple[int, int] | None] = [None] * 256
    prefix = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
              pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            spec = (0, 0)
        elif arg.n >= 0:
            spec = (0, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            spec = (3 if arg.name.endswith("_pair") else 2, 0)
        else:
            spec = (1, prefix[arg.n])
        table[ord(op.code)] = spec
    return table


_ARGS = _arg_table()
_STOP, _FRAME, _MEMOIZE = ord("."), 0x95, 0x94
_BIN_PUTS = frozenset((ord("q"), ord("r")))          # BINPUT, LONG_BINPUT
_BIN_GETS = frozenset((ord("h"), ord("j")))          # BINGET, LONG_BINGET
_TEXT_PUT, _TEXT_GET = ord("p"), ord("g")             # PUT, GET (decimal line)
_SIGNED_LENGTHS = frozenset((ord("T"), 0x8B))        # BINSTRING, LONG4


def check_pickle(data: bytes | memoryview, what: str) -> None:
    """Check a pickle's opcode stream before unpickling it.

    Every opcode must be known, every declared length must lie within the data
    (CPython's unpickler allocates a declared length before reading it), every
    frame too, and every memo index must be at most the number of memo stores
    before it (CPython's unpickler grows its memo to the largest index it is
    given; a pickler numbers them in order).  Raises :class:`CorruptDescriptor`
    naming ``what``, the opcode's byte position and the value.  About 0.2 µs per
    opcode.
    """
    b = data if type(data) is bytes else bytes(data)
    n = len(b)
    pos = 0
    stores = 0
    args = _ARGS
    while pos < n:
        op = b[pos]
        spec = args[op]
        if spec is None:
            raise CorruptDescriptor(f"{what}: unknown opcode {op:#04x} at byte {pos}")
        at = pos
        pos += 1
        kind, size = spec
        if kind == 0:
            if size:
                if size > n - pos:
                    raise CorruptDescriptor(f"{what}: opcode {op:#04x} at byte {at} runs past the {n}-byte pickle")
                if op in _BIN_PUTS or op in _BIN_GETS or op == _FRAME:
                    value = int.from_bytes(b[pos:pos + size], "little")
                    _check_value(op, value, stores, n - pos - size, what, at)
                    stores += op in _BIN_PUTS
                pos += size
            elif op == _MEMOIZE:
                stores += 1
            elif op == _STOP:
                return
        elif kind == 1:
            if size > n - pos:
                raise CorruptDescriptor(f"{what}: opcode {op:#04x} at byte {at} runs past the {n}-byte pickle")
            length = int.from_bytes(b[pos:pos + size], "little", signed=op in _SIGNED_LENGTHS)
            pos += size
            if length < 0 or length > n - pos:
                raise CorruptDescriptor(f"{what}: length {length} declared at byte {at} exceeds the {n - pos} "
                                        f"bytes left")
            pos += length
        else:
            for _ in range(kind - 1):
                end = b.find(b"\n", pos)
                if end < 0:
                    raise CorruptDescriptor(f"{what}: line at byte {at} has no end")
                if op == _TEXT_PUT or op == _TEXT_GET:
                    try:
                        value = int(b[pos:end])
                    except ValueError:
                        raise CorruptDescriptor(f"{what}: memo index {b[pos:end]!r} at byte {at}") from None
                    _check_value(op, value, stores, 0, what, at)
                    stores += op == _TEXT_PUT
                pos = end + 1
    raise CorruptDescriptor(f"{what}: no STOP opcode in the {n}-byte pickle")


def _check_value(op: int, value: int, stores: int, left: int, what: str, at: int) -> None:
    """The argument of a memo or FRAME opcode at byte ``at``."""
    if op == _FRAME:
        if value > left:
            raise CorruptDescriptor(f"{what}: frame of {value} bytes at byte {at} runs past the pickle "
                                    f"({left} bytes left)")
    elif value > stores or (value == stores and (op in _BIN_GETS or op == _TEXT_GET)) or value < 0:
        raise CorruptDescriptor(f"{what}: memo index {value} at byte {at} after {stores} stores")


class _Unpickler(pickle.Unpickler):
    """Unpickler that maps persistent ids to checked views of the lease."""

    def __init__(self, file: io.BytesIO, lease: Any, copy: bool, what: str) -> None:
        super().__init__(file)
        self.lease = lease
        self.copy = copy
        self.what = what

    def persistent_load(self, pid: Any) -> np.ndarray:
        lease = self.lease
        if lease is None:
            raise CorruptDescriptor(f"{self.what}: persistent id {pid!r} where none may occur")
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "a"):
            raise CorruptDescriptor(f"{self.what}: persistent id {pid!r} is not an array reference")
        _, off, dtype, shape, strides = pid
        if type(dtype) is str:
            dtype = dtype_from_str(dtype, self.what)
        if not (isinstance(dtype, np.dtype) and not dtype.hasobject and type(off) is int
                and type(shape) is tuple and len(shape) <= MAX_NDIM and all(type(d) is int for d in shape)
                and (strides is None or (type(strides) is tuple and len(strides) == len(shape)
                                         and all(type(s) is int for s in strides)))):
            raise CorruptDescriptor(f"{self.what}: persistent id {pid!r} is not a valid array reference")
        try:  # NumPy checks offset, shape and strides against the lease's length
            arr = np.ndarray(shape, dtype, buffer=lease, offset=off, strides=strides)
        except (ValueError, TypeError, OverflowError) as e:
            raise CorruptDescriptor(f"{self.what}: array reference {pid!r} does not fit the "
                                    f"{lease.nbytes}-byte slot: {e}") from None
        return arr.copy() if self.copy else arr


def load_pickle(data: bytes | memoryview, what: str, lease: Any = None, copy: bool = False) -> Any:
    """Check, then unpickle ``data``; array references become views of ``lease``
    (copies with ``copy=True``; none may occur without a lease).  Raises
    :class:`CorruptDescriptor` naming ``what`` for a failed check, and for any
    exception while rebuilding (chained as its cause)."""
    check_pickle(data, what)
    try:
        return _Unpickler(io.BytesIO(data), lease, copy, what).load()
    except CorruptDescriptor:
        raise
    except Exception as e:
        raise CorruptDescriptor(f"{what}: unpickling failed ({type(e).__name__}: {e})") from e
