"""Batch structure <-> slot layout (docs/design.md, "Batch descriptor").

A slot payload holds the batch's arrays (each at a 64-byte aligned offset) followed
by the descriptor: a pickle (protocol 5) of the batch in which every eligible
ndarray is replaced by a persistent id ``("a", offset, dtype, shape, strides)``.
Everything else (containers, numbers, strings, object arrays, arbitrary objects)
is pickled in-band in the descriptor.  The parent unpickles the descriptor and
turns each persistent id into a zero-copy ndarray over the slot's
:class:`~mploader._ring.SlotLease`; NumPy checks every offset/shape/stride against
the lease's length, so a corrupt descriptor raises instead of reading outside the
slot.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from . import _ring

ALIGN = 64
_HEADROOM = 1.25
_PLAIN = frozenset((tuple, list, dict, int, float, bool, complex, str, bytes, type(None)))
_EMPTY = np.empty(0, np.uint8)
_CONTAINERS = (np.ndarray, list, tuple, dict)


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class SlotWriter:
    """Lays out one batch in an ASSIGNED slot (worker side).

    ``alloc`` hands out arrays inside the payload while they fit and heap arrays
    after that; ``finish`` pickles the descriptor, grows the slot if the batch did
    not fit (copying the heap arrays in once), and publishes the slot.
    """

    __slots__ = ("region", "slot", "flags", "used", "base", "capacity", "buf", "handed")

    def __init__(self, region: _ring.Region, slot: int, seq: int) -> None:
        self.region = region
        self.slot = slot
        self.flags = 0
        self.used = 0
        self.handed: dict[int, tuple] = {}  # id(array from alloc) -> (array, offset)
        capacity = region.begin(slot, seq)
        hint = region.size_hint
        if capacity < hint and region.grow(slot, hint, 0):
            self.flags |= _ring.FLAG_GROWN
        self._map()

    def _map(self) -> None:
        self.base, self.capacity = self.region.payload_address(self.slot)
        if self.capacity:
            self.buf = np.frombuffer(self.region.payload(self.slot), np.uint8)
        else:
            self.buf = _EMPTY

    def alloc(self, shape: tuple, dtype: Any) -> np.ndarray:
        """Uninitialised C-contiguous array of ``shape``/``dtype``, in the slot if it fits."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        off = _align(self.used)
        if dtype.itemsize == 0 or off + nbytes > self.capacity:
            return np.empty(shape, dtype)
        self.used = off + nbytes
        out = self.buf[off:off + nbytes].view(dtype).reshape(shape)
        self.handed[id(out)] = (out, off)
        return out

    def finish(self, obj: Any, kind: int = _ring.KIND_SLOT) -> bytes | None:
        """Publish ``obj`` in the slot.

        Returns None when published as ``kind``; otherwise (the region's address
        reservation is exhausted) publishes KIND_PIPE and returns the in-band
        pickle the caller must send through the worker's pipe.
        """
        pickler_file = io.BytesIO()
        p = _SlotPickler(pickler_file, self)
        p.dump(obj)
        desc = pickler_file.getbuffer()
        desc_off = _align(p.end)
        total = desc_off + len(desc)
        if total > self.capacity:
            need = int(total * _HEADROOM)
            if not self.region.grow(self.slot, need, self.used):
                data = pickle.dumps(obj, protocol=5)
                self.region.publish(self.slot, _ring.KIND_PIPE, self.flags, 0)
                return data
            self.flags |= _ring.FLAG_GROWN
            self._map()
        buf = self.buf
        for off, arr in p.pending:
            if arr.nbytes:
                np.copyto(buf[off:off + arr.nbytes].view(arr.dtype).reshape(arr.shape), arr, casting="no")
        buf[desc_off:total] = np.frombuffer(desc, np.uint8)
        self.region.publish(self.slot, kind, self.flags | p.flags, total, desc_off, len(desc))
        return None


class _SlotPickler(pickle.Pickler):
    """Pickler that moves ndarrays out of band into the slot (persistent ids)."""

    def __init__(self, file: io.BytesIO, writer: SlotWriter) -> None:
        super().__init__(file, protocol=5)
        self.lo = writer.base
        self.hi = writer.base + writer.capacity
        self.handed = writer.handed
        self.end = writer.used
        self.pending: list[tuple[int, np.ndarray]] = []
        self.seen: dict[int, tuple] = {}
        self.flags = 0

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t in _PLAIN:
            if t is list and obj and not isinstance(obj[0], _CONTAINERS):
                # A list of leaves (what a batchify passes through when it cannot
                # stack them: ragged sequences, strings, numbers of mixed types)
                # travels pickled: count the batch as a fallback.
                self.flags |= _ring.FLAG_INBAND
            return None
        if t is np.ndarray:
            dtype = obj.dtype
            if dtype.hasobject or dtype.itemsize == 0:
                self.flags |= _ring.FLAG_INBAND
                return None
            hit = self.handed.get(id(obj))
            if hit is not None and hit[0] is obj:  # exactly an array alloc handed out
                return ("a", hit[1], _dtype_key(dtype), obj.shape, None)
            addr = obj.ctypes.data
            if self.lo <= addr < self.hi or (obj.size == 0 and self.lo <= addr <= self.hi):
                lo, hi = np.lib.array_utils.byte_bounds(obj) if _HAS_ARRAY_UTILS else np.byte_bounds(obj)
                if self.lo <= lo and hi <= self.hi:
                    return ("a", addr - self.lo, _dtype_key(dtype), obj.shape, obj.strides)
            pid = self.seen.get(id(obj))
            if pid is None:
                off = _align(self.end)
                self.end = off + obj.nbytes
                self.pending.append((off, obj))
                pid = self.seen[id(obj)] = ("a", off, _dtype_key(dtype), obj.shape, None)
            return pid
        if isinstance(obj, (tuple, list, dict, np.generic, np.dtype, type)):
            return None
        self.flags |= _ring.FLAG_INBAND
        return None


def _dtype_key(dtype: np.dtype) -> Any:
    """A cheap-to-pickle stand-in for ``dtype``: its type string when that round-trips
    exactly (plain dtypes), else the dtype itself (structured, subarray)."""
    if dtype.fields is None and dtype.subdtype is None and dtype.metadata is None:
        return dtype.str
    return dtype


_HAS_ARRAY_UTILS = hasattr(np.lib, "array_utils") and hasattr(np.lib.array_utils, "byte_bounds")


class _SlotUnpickler(pickle.Unpickler):
    """Unpickler that maps persistent ids to zero-copy views of a lease."""

    def __init__(self, file: io.BytesIO, lease: _ring.SlotLease, copy: bool) -> None:
        super().__init__(file)
        self.lease = lease
        self.copy = copy

    def persistent_load(self, pid: Any) -> np.ndarray:
        try:
            tag, off, dtype, shape, strides = pid
            if tag != "a":
                raise ValueError(f"unknown tag {tag!r}")
            arr = np.ndarray(shape, dtype, buffer=self.lease, offset=off, strides=strides)
        except (TypeError, ValueError) as e:
            raise CorruptDescriptor(f"bad array entry {pid!r} for a {self.lease.nbytes}-byte slot: {e}") from None
        return arr.copy() if self.copy else arr


class CorruptDescriptor(RuntimeError):
    """A slot's descriptor does not describe arrays inside that slot."""


def decode(lease: _ring.SlotLease, desc_off: int, desc_len: int, copy: bool = False) -> Any:
    """Rebuild a batch from a leased slot.

    Arrays are zero-copy views whose ``base`` is ``lease`` (``copy=False``) or owned
    copies (``copy=True``).  Raises :class:`CorruptDescriptor` if the descriptor
    lies outside the slot or names an array outside it.
    """
    if desc_off < 0 or desc_len < 0 or desc_off + desc_len > lease.nbytes:
        raise CorruptDescriptor(
            f"descriptor [{desc_off}, {desc_off + desc_len}) outside the {lease.nbytes}-byte slot")
    with memoryview(lease) as mv:
        raw = io.BytesIO(mv[desc_off:desc_off + desc_len])
    return _SlotUnpickler(raw, lease, copy).load()


def read_record(lease: _ring.SlotLease, desc_off: int, desc_len: int) -> Any:
    """Unpickle a plain (no persistent ids) record stored as a slot's descriptor."""
    if desc_off + desc_len > lease.nbytes:
        raise CorruptDescriptor(f"record [{desc_off}, {desc_off + desc_len}) outside the {lease.nbytes}-byte slot")
    with memoryview(lease) as mv:
        return pickle.loads(mv[desc_off:desc_off + desc_len])
