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
#: Opcodes that store into / read from the memo (CPython's unpickler grows its memo
#: to the largest index it is given).
_MEMO_PUTS = frozenset(("PUT", "BINPUT", "LONG_BINPUT"))
_MEMO_GETS = frozenset(("GET", "BINGET", "LONG_BINGET"))


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

def check_pickle(data: bytes | memoryview, what: str) -> None:
    """Check a pickle's opcode stream before unpickling it.

    Every declared length must lie within the data, every frame too, and every
    memo index must be at most the number of memo stores before it (the pickler
    numbers them in order).  Raises :class:`CorruptDescriptor` naming ``what``, the
    opcode's byte position and the value.  Costs ~1 µs per opcode.
    """
    n = len(data)
    stores = 0
    try:
        for op, raw_arg, pos in pickletools.genops(io.BytesIO(data)):
            name = op.name
            arg = raw_arg if type(raw_arg) is int else 0  # the opcodes checked below take ints
            pos = pos or 0
            if name in _MEMO_PUTS:
                if arg > stores:
                    raise CorruptDescriptor(f"{what}: memo index {arg} at byte {pos} after {stores} stores")
                stores += 1
            elif name == "MEMOIZE":
                stores += 1
            elif name in _MEMO_GETS:
                if arg >= stores:
                    raise CorruptDescriptor(f"{what}: memo index {arg} at byte {pos} after {stores} stores")
            elif name == "FRAME":
                if arg > n - pos:
                    raise CorruptDescriptor(f"{what}: frame of {arg} bytes at byte {pos} runs past the "
                                            f"{n}-byte pickle")
            elif name == "STOP":
                break
    except CorruptDescriptor:
        raise
    except Exception as e:  # noqa: BLE001 - genops raises ValueError and friends for bad data
        raise CorruptDescriptor(f"{what}: malformed pickle ({type(e).__name__}: {e})") from None


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
