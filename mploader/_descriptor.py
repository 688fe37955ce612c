"""Batch structure <-> slot layout (docs/design.md, "Batch descriptor").

A READY slot's payload is ``[arrays, each 64-byte aligned][descriptor]``.  The
descriptor is a compact binary record (``mploader._structure`` has the grammar)
whose decoding bounds its own allocations:

``header`` (28 bytes)
    magic, version, the byte lengths of the three sections below and the
    structure's 64-bit hash (BLAKE2b).
``structure``
    The batch's shape as a tree: tuple / list / dict (with its keys) / namedtuple
    (its class, pickled by reference) nodes, and leaves (array with its dtype, ndim
    and whether it is C-contiguous; int; float; bool; complex; None; str; bytes;
    NumPy scalar with its dtype; in-band pickle).  The same bytes for every batch of
    one structure: the worker encodes it once per structure, the parent parses it
    once per structure into a decode template; both caches are keyed by the
    structure (the worker's by the signature its walk collects, the parent's by the
    hash, checked against the bytes when it parses them).
``values``
    The per-batch numbers, packed by one :class:`struct.Struct` the structure
    determines: each array's offset, shape (and strides when not C-contiguous),
    each number's value, the byte length of each variable-length leaf.
``var``
    The bytes of the variable-length leaves, in order: UTF-8 strings, bytes, and
    in-band pickles (``mploader._inband``) of whatever is not a plain container,
    array or number (object arrays, arbitrary objects, lists of Python leaves).
    Plain arrays inside in-band pickles still live in the slot, zero-copy.

Decoding checks the section lengths against the descriptor length (itself inside
the slot), every count against the bytes that remain before allocating for it,
every array against the slot (NumPy's buffer bounds check on the lease), every
dtype (a validated type string, or a dtype object from a checked pickle), and every
in-band pickle's opcode stream.  A descriptor that fails raises
:class:`CorruptDescriptor` naming the field and its value.
"""
from __future__ import annotations

import io
import itertools
import pickle
import struct
from typing import Any

import numpy as np

from . import _ring
from . import _structure as S
from ._inband import CorruptDescriptor, InbandPickler, simple_dtype
from ._protocol import PIPE_HEADER
from ._sizing import HEADROOM, shrink, sizing_for

__all__ = ["ALIGN", "PIPE_SIDE", "CorruptDescriptor", "SlotWriter", "Structures", "decode", "pipe_message",
           "pipe_side"]

#: Alignment of every array (and of the descriptor) in a slot payload, bytes.
ALIGN = 64
_CONTAINERS = (np.ndarray, list, tuple, dict)
try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # NumPy < 2.0
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]


def _holds_leaves(obj: list) -> bool:
    """Whether a non-empty list holds Python leaves rather than arrays or containers
    of them: its first element is not an array, list, tuple or dict, or every
    element is a list and the first of those that is not empty starts with such
    a leaf (ragged sequences)."""
    x = obj[0]
    if not isinstance(x, _CONTAINERS):
        return True
    if type(x) is not list or set(map(type, obj)) != _LIST_ONLY:
        return False
    for inner in obj:
        if inner:
            return not isinstance(inner[0], _CONTAINERS)
    return True


_LIST_ONLY = {list}
_OBJECT = np.dtype(object)


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------

class SlotWriter:
    """Lays out one batch in an ASSIGNED slot (worker side).

    ``alloc`` hands out arrays inside the payload while they fit and heap arrays
    after that; ``finish`` encodes the descriptor, grows the slot if the batch did
    not fit (copying the heap arrays in once), and publishes the slot.  On
    construction the slot is sized by the worker's :class:`~mploader._sizing.SlotSizing` policy
    (docs/design.md, "Slot sizing"): grown to the typical batch before collation,
    or shrunk when it holds far more than the typical batch (after an outlier).
    """

    __slots__ = ("base", "capacity", "described", "flags", "handed", "keep_descriptor", "mv", "region", "side",
                 "sizing", "slot", "structures", "used")

    def __init__(self, region: _ring.Region, slot: int, seq: int, structures: Structures | None = None) -> None:
        self.region = region
        self.slot = slot
        #: where ``finish`` finds and keeps the encoding of each structure (the worker
        #: loop's :class:`Structures`; default: this process's, :data:`_LAYOUTS`)
        self.structures = _STRUCTURES if structures is None else structures
        self.flags = 0
        self.used = 0
        self.handed: dict[int, tuple] = {}  # id(array from alloc) -> (array, offset)
        #: Set by the caller before ``finish`` when it wants ``described``: (desc_off,
        #: encoder flags, the descriptor's bytes) of the KIND_SLOT batch ``finish``
        #: published, taken before publication (mploader._plan learns from them).
        self.keep_descriptor = False
        self.described: tuple[int, int, bytes] | None = None
        #: The batch's side record (mploader._face.Face.side), set before ``finish`` or
        #: ``publish_plan``: written after the descriptor, inside ``used`` (a KIND_SLOT
        #: batch only), where :func:`side_record` finds it.
        self.side: bytes | None = None
        capacity = region.begin(slot, seq)
        self.sizing = sizing = sizing_for(region)
        target = sizing.target_bytes()
        if capacity < target:
            if region.grow(slot, target, 0):
                self.flags |= _ring.FLAG_GROWN
        elif sizing.should_shrink(capacity, target) and region.meta(slot).grow_count:
            shrink(region, slot, target)  # (a slot never grown keeps its configured size)
        self._map()

    def _map(self) -> None:
        self.mv: memoryview | None
        self.base, self.capacity = self.region.payload_address(self.slot)
        self.mv = self.region.payload(self.slot) if self.capacity else None

    def alloc(self, shape: tuple, dtype: Any) -> np.ndarray:
        """Uninitialised C-contiguous array of ``shape``/``dtype``, in the slot if it fits."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        off = (self.used + ALIGN - 1) & ~(ALIGN - 1)
        if dtype.itemsize == 0 or dtype.hasobject or off + nbytes > self.capacity or self.mv is None:
            return np.empty(shape, dtype)  # (object pointers must never live in shared memory)
        self.used = off + nbytes
        out = np.ndarray(shape, dtype, self.mv, off)
        self.handed[id(out)] = (out, off)
        return out

    def finish(self, obj: Any, kind: int = _ring.KIND_SLOT) -> bytes | None:
        """Publish ``obj`` in the slot.

        Returns None when published as ``kind``; otherwise (the region's address
        reservation is exhausted) publishes KIND_PIPE and returns the pickle the
        caller must send through the worker's pipe.  Raises what pickling raises
        (``PicklingError``, ``TypeError``, ``AttributeError``) for a leaf that
        cannot be serialised; the slot is then still ASSIGNED and ``finish`` may be
        called again with another object.
        """
        enc = _Encoder(self)
        enc.walk(obj, 0)
        layout = self.structures.layout(tuple(enc.sig))
        var = enc.var
        var_len = sum(map(len, var)) if var else 0
        desc_off = (enc.end + ALIGN - 1) & ~(ALIGN - 1)
        desc_len = layout.whole.size + var_len
        side = self.side if kind == _ring.KIND_SLOT else None
        total = desc_off + desc_len + (len(side) if side else 0)
        if total > self.capacity:
            need = int(total * HEADROOM)
            if not self.region.grow(self.slot, need, self.used):
                data = pickle.dumps(obj, protocol=5)
                self.region.publish(self.slot, _ring.KIND_PIPE, self.flags, 0)
                return data
            self.flags |= _ring.FLAG_GROWN
            self._map()
        mv = self.mv
        assert mv is not None  # total > 0, so the slot has a payload
        for off, arr in enc.pending:  # arrays from elsewhere, copied in once
            if arr.nbytes:
                np.copyto(np.ndarray(arr.shape, arr.dtype, mv, off), arr, casting="no")
        layout.whole.pack_into(mv, desc_off, S.MAGIC, S.VERSION, 0, layout.struct_len, layout.values.size, var_len,
                               layout.digest, layout.struct_bytes, *enc.vals)
        p = desc_off + layout.whole.size
        for b in var:
            n = len(b)
            mv[p:p + n] = b
            p += n
        if side:
            mv[p:total] = side
        if kind == _ring.KIND_SLOT and self.keep_descriptor:
            # Copied before E2: once published, the slot may be taken, freed and
            # rewritten by another worker before this one reads it again.
            self.described = (desc_off, enc.flags, bytes(mv[desc_off:desc_off + desc_len]))
        self.region.publish(self.slot, kind, self.flags | enc.flags, total, desc_off, desc_len)
        self.sizing.note(total)
        return None

    def publish_plan(self, plan: Any) -> bool:
        """Publish the batch that ``plan`` (a :class:`mploader._columns.BatchPlan`) has just
        written into this slot with ``plan.fill``, with the side record after it; False
        (nothing published) when that does not fit the slot."""
        total, side = plan.total, self.side
        if side:
            end = total + len(side)
            if end > self.capacity or self.mv is None:
                return False
            self.mv[total:end] = side
            total = end
        self.region.publish(self.slot, _ring.KIND_SLOT, self.flags, total, plan.desc_off, len(plan.descriptor))
        self.sizing.note(total)
        return True


class Structures:
    """One worker's cache of the batch structures it has met: the one place where
    "this structure repeats" is kept (docs/design.md, "Batch plans").

    ``layouts``: structure signature (the walk of :meth:`SlotWriter.finish`) -> its
    descriptor encoding (:class:`mploader._structure.Layout`), at most
    ``CACHE_ENTRIES`` (all dropped when full).  ``plans``: batch size
    -> the batch plan learnt from a published batch of one structure
    (:class:`mploader._plan.Plan`, kept by :class:`mploader._plan.Planner`), at most
    ``max_plans`` (all dropped when full).  The worker loop makes one per worker and
    hands it to every :class:`SlotWriter` and to its planner."""

    __slots__ = ("layouts", "max_plans", "plans")

    def __init__(self, max_plans: int, layouts: dict | None = None) -> None:
        self.layouts: dict[tuple, S.Layout] = {} if layouts is None else layouts
        self.plans: dict[int, Any] = {}
        self.max_plans = max_plans

    def layout(self, sig: tuple) -> S.Layout:
        """The encoding of the structure ``sig``, compiled at its first batch."""
        layout = self.layouts.get(sig)
        if layout is None:
            layout = S.compile_layout(sig)
            if len(self.layouts) >= S.CACHE_ENTRIES:
                self.layouts.clear()
            self.layouts[sig] = layout
        return layout

    def keep_plan(self, key: int, plan: Any) -> None:
        """Keep ``plan`` for the batches of ``key`` (replacing the one there); the
        dict ``plans`` is only ever changed in place (a planner holds it)."""
        if len(self.plans) >= self.max_plans and key not in self.plans:
            self.plans.clear()
        self.plans[key] = plan


#: The flag a pipe message's kind carries when a side record ends the message
#: (:func:`pipe_message`); no kind has it.
PIPE_SIDE = 0x10000
_SIDE_LEN = struct.Struct("<I")


def pipe_message(seq: int, kind: int, data: bytes, side: bytes | None) -> bytes:
    """A batch's message on the worker's pipe: the header, ``data`` (the pickle), and
    when ``side`` is given, the side record and its length after it (the header's
    kind then carries :data:`PIPE_SIDE`)."""
    if side is None:
        return PIPE_HEADER.pack(seq, kind) + data
    return PIPE_HEADER.pack(seq, kind | PIPE_SIDE) + data + side + _SIDE_LEN.pack(len(side))


def pipe_side(msg: Any) -> tuple[memoryview, bytes | None]:
    """The pickle and the side record (None: none) of a :func:`pipe_message` whose
    header's kind carries :data:`PIPE_SIDE`."""
    mv = memoryview(msg)
    n = _SIDE_LEN.unpack_from(mv, len(mv) - _SIDE_LEN.size)[0]
    end = len(mv) - _SIDE_LEN.size - n
    return mv[PIPE_HEADER.size:end], bytes(mv[end:end + n])


def side_record(lease: Any) -> bytes | None:
    """The side record of a leased KIND_SLOT batch: its bytes after the descriptor,
    up to ``nbytes`` (None when there are none)."""
    end = lease.desc_off + lease.desc_len
    return bytes(memoryview(lease)[end:lease.nbytes]) if lease.nbytes > end else None


#: This process's structure encodings, for writers made without a loop's cache (tests, benchmarks).
_LAYOUTS: dict[tuple, S.Layout] = {}
_STRUCTURES = Structures(1, _LAYOUTS)  # (no planner keeps plans here)


class _Encoder:
    """One batch's walk: the structure signature, the values, the var bytes, and
    where each array goes in the slot."""

    __slots__ = ("end", "flags", "handed", "pending", "seen", "sig", "vals", "var", "writer")

    def __init__(self, writer: SlotWriter) -> None:
        self.writer = writer
        self.handed = writer.handed
        self.end = writer.used
        self.pending: list[tuple[int, np.ndarray]] = []
        self.seen: dict[int, tuple] = {}
        self.flags = 0
        self.sig: list = []
        self.vals: list = []
        self.var: list = []

    def place(self, arr: np.ndarray) -> tuple[int, tuple | None]:
        """(offset, strides or None) of a plain ndarray in the slot, copying it in
        later (``pending``) when it lies elsewhere."""
        hit = self.handed.get(id(arr))
        if hit is not None and hit[0] is arr:  # exactly an array alloc handed out
            return hit[1], None
        w = self.writer
        if arr.base is not None and w.capacity:
            addr = arr.__array_interface__["data"][0]
            start, stop = w.base, w.base + w.capacity
            if start <= addr < stop or (arr.size == 0 and start <= addr <= stop):
                lo, hi = _byte_bounds(arr)
                if start <= lo and hi <= stop:
                    return addr - start, (None if arr.flags.c_contiguous else arr.strides)
        hit = self.seen.get(id(arr))
        if hit is None:
            off = _align(self.end)
            self.end = off + arr.nbytes
            self.pending.append((off, arr))
            hit = self.seen[id(arr)] = (off, arr)
        return hit[0], None

    def blob(self, obj: Any) -> None:
        """``obj`` pickled in-band; the plain arrays inside it still go to the slot."""
        f = io.BytesIO()
        InbandPickler(f, self.place).dump(obj)
        data = f.getbuffer()
        self.sig.append(S.BLOB)
        self.vals.append(len(data))
        self.var.append(data)
        self.flags |= _ring.FLAG_INBAND

    def leaf_list(self, obj: list) -> None:
        """A list of Python leaves: natively when it is all str, int, float or
        lists of int (ragged sequences), else pickled in-band."""
        kinds = set(map(type, obj))
        kind = kinds.pop() if len(kinds) == 1 else None
        data: Any = None
        try:
            if kind is str:
                joined = "\0".join(obj)
                if joined.count("\0") == len(obj) - 1:  # no NUL inside a string
                    op, data = S.STR_LIST, joined.encode("utf-8", "surrogatepass")
            elif kind is int:
                op, data = S.INT_LIST, np.array(obj, "<i8").tobytes()
            elif kind is float:
                op, data = S.FLOAT_LIST, np.array(obj, "<f8").tobytes()
            elif kind is list and set(map(type, itertools.chain.from_iterable(obj))) <= {int}:
                lengths = list(map(len, obj))
                offsets = np.zeros(len(obj) + 1, "<i8")
                np.cumsum(lengths, out=offsets[1:])
                flat = np.fromiter(itertools.chain.from_iterable(obj), "<i8", int(offsets[-1]))
                op, data = S.INT_LISTS, offsets.tobytes() + flat.tobytes()
        except OverflowError:  # an int beyond 64 bits
            data = None
        if data is None:
            return self.blob(obj)
        self.sig.append(op)
        self.vals += (len(obj), len(data))
        self.var.append(data)
        self.flags |= _ring.FLAG_INBAND
        return None

    def walk(self, obj: Any, depth: int) -> None:
        t = type(obj)
        sig = self.sig
        if t is np.ndarray:
            dtype = obj.dtype
            if dtype.hasobject or dtype.itemsize == 0:
                if dtype != _OBJECT or depth >= S.MAX_DEPTH:
                    return self.blob(obj)
                # its shape, then its items as a list (natively when they are all
                # str, int or float; pickled otherwise)
                items = list(obj.reshape(-1))
                sig += (S.OBJ_ARRAY, obj.ndim)
                self.vals += obj.shape
                return self.leaf_list(items) if items and _holds_leaves(items) else self.blob(items)
            off, strides = self.place(obj)
            vals = self.vals
            vals.append(off)
            vals += obj.shape
            if strides is None:
                sig += (S.ARRAY, dtype, obj.ndim, True)
            else:
                sig += (S.ARRAY, dtype, obj.ndim, False)
                vals += strides
            return None
        if t is list or t is tuple:
            if t is list and obj and _holds_leaves(obj):
                # A list of Python leaves (what a batchify passes through when it
                # cannot stack them: strings, ragged sequences, numbers of mixed
                # types) is not zero-copy: count the batch as a fallback.
                return self.leaf_list(obj)
            if depth >= S.MAX_DEPTH:
                return self.blob(obj)
            sig.append(S.LIST if t is list else S.TUPLE)
            sig.append(len(obj))
            depth += 1
            handed, vals = self.handed, self.vals
            for x in obj:
                if type(x) is np.ndarray:  # fast path: an array alloc handed out
                    hit = handed.get(id(x))
                    if hit is not None and hit[0] is x:
                        sig += (S.ARRAY, x.dtype, x.ndim, True)
                        vals.append(hit[1])
                        vals += x.shape
                        continue
                self.walk(x, depth)
            return None
        if t is dict:
            if depth >= S.MAX_DEPTH or not all(type(k) is str or S.const_ok(k, 0) for k in obj):
                return self.blob(obj)
            sig.append(S.DICT)
            sig.append(len(obj))
            depth += 1
            for k, v in obj.items():
                sig.append(k if type(k) is str else (type(k), k))
                self.walk(v, depth)
            return None
        if t is int:
            if S.I64_MIN <= obj <= S.I64_MAX:
                sig.append(S.INT)
                self.vals.append(obj)
                return None
            return self.blob(obj)
        if t is float:
            sig.append(S.FLOAT)
            self.vals.append(obj)
            return None
        if t is bool:
            sig.append(S.BOOL)
            self.vals.append(obj)
            return None
        if obj is None:
            sig.append(S.NONE)
            return None
        if t is str:
            data = obj.encode("utf-8", "surrogatepass")
            sig.append(S.STR)
            self.vals.append(len(data))
            self.var.append(data)
            return None
        if t is bytes:
            sig.append(S.BYTES)
            self.vals.append(len(obj))
            self.var.append(obj)
            return None
        if t is complex:
            sig.append(S.COMPLEX)
            self.vals += (obj.real, obj.imag)
            return None
        if isinstance(obj, np.generic):
            dtype = obj.dtype
            if simple_dtype(dtype) and dtype.itemsize:
                sig += (S.SCALAR, dtype)
                self.vals.append(obj.tobytes())
                return None
            return self.blob(obj)
        if isinstance(obj, tuple) and depth < S.MAX_DEPTH and S.namedtuple_class(t) is not None \
                and not getattr(obj, "__dict__", None):
            sig += (S.NAMEDTUPLE, t, len(obj))
            depth += 1
            for x in obj:
                self.walk(x, depth)
            return None
        return self.blob(obj)


# ---------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------

#: Parent cache: structure hash -> decode template.
_TEMPLATES: dict[int, S.Template] = {}


def decode(lease: _ring.SlotLease, desc_off: int, desc_len: int, copy: bool = False,
           copy_below: int = 0) -> Any:
    """Rebuild a batch from a leased slot.

    Parameters
    ----------
    lease : SlotLease
        The leased slot; its length (``lease.nbytes``) bounds every array.
    desc_off, desc_len : int
        Where the descriptor lies in the slot payload (bytes).
    copy : bool
        False: arrays are zero-copy views whose ``base`` chain ends at ``lease``
        (valid as long as they live; the slot is freed after the last one dies).
        True: arrays are owned copies and nothing refers to the lease.
    copy_below : int
        With ``copy=False``: arrays of fewer than this many bytes (``ndarray.nbytes``)
        are owned copies all the same (default 0: none), so that keeping a batch's
        small leaves (labels, indices) does not keep its slot.  In-band pickles'
        arrays stay views.

    Returns
    -------
    The batch, with the structure, container types, dtypes and shapes the worker
    published.

    Raises
    ------
    CorruptDescriptor
        The descriptor lies outside the slot, fails a check (magic, version,
        lengths, counts, dtypes, pickle opcodes), or names an array outside the
        slot; the message names the slot, the batch, the field and its value
        (attributes ``slot``, and ``field == "descriptor"``).  A subclass of
        :class:`mploader._ring.CorruptSlotError`.
    """
    try:
        nbytes = lease.nbytes
        if desc_off < 0 or desc_len < S.HEADER.size or desc_off + desc_len > nbytes:
            raise CorruptDescriptor(
                f"descriptor [{desc_off}, {desc_off + desc_len}) outside the {nbytes}-byte slot "
                f"or shorter than its {S.HEADER.size}-byte header")
        magic, version, _, struct_len, values_len, var_len, digest = S.HEADER.unpack_from(lease, desc_off)
        if magic != S.MAGIC or version != S.VERSION:
            raise CorruptDescriptor(f"descriptor magic {magic:#x} version {version}, expected {S.MAGIC:#x} "
                                    f"version {S.VERSION}")
        if S.HEADER.size + struct_len + values_len + var_len != desc_len:
            raise CorruptDescriptor(
                f"descriptor sections (structure {struct_len}, values {values_len}, var {var_len} bytes) do not "
                f"add up to desc_len {desc_len}")
        p = desc_off + S.HEADER.size
        tmpl = _TEMPLATES.get(digest)
        if tmpl is None or tmpl.struct_len != struct_len:
            with memoryview(lease) as mv:
                data = bytes(mv[p:p + struct_len])
            if S.digest(data) != digest:
                raise CorruptDescriptor(f"descriptor structure hash {digest:#x} does not match its "
                                        f"{struct_len} structure bytes")
            tmpl = S.parse(data)
            if len(_TEMPLATES) >= S.CACHE_ENTRIES:
                _TEMPLATES.clear()
            _TEMPLATES[digest] = tmpl
        p += struct_len
        if tmpl.values.size != values_len:
            raise CorruptDescriptor(f"descriptor values section is {values_len} bytes, its structure "
                                    f"needs {tmpl.values.size}")
        v = tmpl.values.unpack_from(lease, p)
        if tmpl.var_slots:
            p += values_len
            pos = [0]
            end = 0
            for i in tmpl.var_slots:
                end += v[i]
                pos.append(end)
            if end != var_len:
                raise CorruptDescriptor(f"descriptor var lengths add up to {end}, the var section is {var_len} bytes")
            with memoryview(lease) as mv:
                var = mv[p:p + var_len]
            b = (lease, S.COPY_ALL if copy else copy_below, var, pos)
            try:
                return tmpl.build(v, b)
            finally:
                var.release()
        return tmpl.build(v, (lease, S.COPY_ALL if copy else copy_below))

    except CorruptDescriptor as e:
        if e.slot is not None:
            raise
        raise CorruptDescriptor(f"slot {lease.slot} (batch {lease.seq}): {e}", slot=lease.slot,
                                field="descriptor") from e.__cause__
