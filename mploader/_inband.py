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

from . import _pickle_scan, _ring

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


_ROLES = {ord("q"): 1, ord("r"): 1,          # BINPUT, LONG_BINPUT: a memo store (binary index)
          ord("h"): 2, ord("j"): 2,          # BINGET, LONG_BINGET: a memo read
          ord("p"): 3, ord("g"): 4,          # PUT, GET: the same with a decimal line
          0x95: 5, 0x94: 6, ord("."): 7,     # FRAME, MEMOIZE, STOP
          ord("T"): 8, 0x8B: 8}              # BINSTRING, LONG4: signed 4-byte lengths
_pickle_scan.set_table(_arg_table(), _ROLES)


def check_pickle(data: bytes | memoryview, what: str) -> None:
    """Check a pickle's opcode stream before unpickling it.

    Every opcode must be known, every declared length must lie within the data
    (CPython's unpickler allocates a declared length before reading it), every
    frame too, every memo index must be at most the number of memo stores before
    it (CPython's unpickler grows its memo to the largest index it is given; a
    pickler numbers them in order), and the stream must end with STOP.  Raises
    :class:`CorruptDescriptor` naming ``what``, the opcode's byte position and the
    value.  The walk is C (``mploader._pickle_scan``): a few ns per opcode.
    """
    problem = _pickle_scan.scan(data)
    if problem is None:
        return
    code, at, value, extra = problem
    if code == 1:
        msg = f"unknown opcode {value:#04x} at byte {at}"
    elif code == 2:
        msg = f"opcode {value:#04x} at byte {at} runs past the {extra}-byte pickle"
    elif code == 3:
        msg = f"length {value} declared at byte {at} exceeds the {extra} bytes left"
    elif code == 4:
        msg = f"line at byte {at} has no end"
    elif code == 5:
        msg = f"memo index {value} at byte {at} after {extra} stores"
    elif code == 6:
        msg = f"frame of {value} bytes at byte {at} runs past the pickle ({extra} bytes left)"
    elif code == 7:
        msg = f"no STOP opcode in the {at}-byte pickle"
    else:
        msg = f"memo index line of {value} bytes at byte {at} is not a decimal number"
    raise CorruptDescriptor(f"{what}: {msg}")


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
