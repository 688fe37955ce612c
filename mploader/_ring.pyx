# cython: language_level=3
"""Python objects over the C slot region (csrc/ring.h).

Lifecycle invariants
--------------------
* A :class:`Region` is built only by :func:`create_region` (in the parent, before
  the workers fork; the workers use their inherited copy) or :func:`attach_region`
  (a spawned worker mapping the parent's memfd).  ``Region()`` from Python raises
  TypeError.  ``__cinit__`` takes no arguments and marks every field "not built"
  (fd -1, no mapping), so ``__dealloc__`` is safe in every half-built state: it
  never closes a descriptor it did not open.
* ``close()`` closes the memfd; the mapping itself lives until the Region object is
  deallocated, which cannot happen while any :class:`SlotLease` (and so any
  zero-copy view) still refers to it.
* A :class:`SlotLease` is made only by :meth:`Region.wait`, in the same C-level step
  that takes edge E3 (READY -> LEASED): no Python code runs between the two, so an
  asynchronous exception (KeyboardInterrupt) cannot leave a LEASED slot without its
  lease.  The lease is the slot's only owner; its deallocation takes edge E4
  (LEASED -> FREE) -- in the process that created the region only: a forked child
  that drops an inherited lease does not free the parent's slot, and an attached
  region never takes leases.
"""
cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

import collections
import operator
import os

KIND_NONE = MPL_KIND_NONE
KIND_SLOT = MPL_KIND_SLOT
KIND_PIPE = MPL_KIND_PIPE
KIND_ERROR = MPL_KIND_ERROR
FLAG_GROWN = MPL_FLAG_GROWN
FLAG_INBAND = MPL_FLAG_INBAND
STATE_FREE = MPL_FREE
STATE_ASSIGNED = MPL_ASSIGNED
STATE_READY = MPL_READY
STATE_LEASED = MPL_LEASED
STATE_NAMES = {MPL_FREE: "FREE", MPL_ASSIGNED: "ASSIGNED", MPL_READY: "READY", MPL_LEASED: "LEASED"}
#: Most slots a region can have.
MAX_SLOTS = MPL_MAX_SLOTS
#: Most initial payload bytes per slot (1 TiB); create_region also refuses an
#: initial size above the machine's physical memory.
MAX_SLOT_BYTES = MPL_MAX_SLOT_BYTES
#: Most address space a region may reserve (64 TiB).
MAX_RESERVE_BYTES = MPL_MAX_RESERVE_BYTES
#: Address space reserved when ``reserve_bytes=0`` (16 GiB; not memory).
DEFAULT_RESERVE_BYTES = MPL_DEFAULT_RESERVE_BYTES
#: Layout version written into (and checked in) every region's control block.
LAYOUT_VERSION = MPL_LAYOUT_VERSION
#: State-word bit the parent sets before sleeping on a slot (docs/design.md).
WAITER_BIT = MPL_WAITER
cdef char *_FORMAT_B = b"B"
cdef uint64_t _PAGE = 4096

_FIELD_NAMES = {MPL_FIELD_KIND: "kind", MPL_FIELD_OFFSET: "offset", MPL_FIELD_CAPACITY: "capacity",
                MPL_FIELD_USED: "used", MPL_FIELD_DESC_OFF: "desc_off", MPL_FIELD_DESC_LEN: "desc_len"}

cdef mpl_slot_meta _m0
#: Byte offset of each header field from Region._meta_address(slot) (tests write there).
_META_OFFSETS = {
    "seq": <size_t>&_m0.seq - <size_t>&_m0, "offset": <size_t>&_m0.offset - <size_t>&_m0,
    "capacity": <size_t>&_m0.capacity - <size_t>&_m0, "used": <size_t>&_m0.used - <size_t>&_m0,
    "desc_off": <size_t>&_m0.desc_off - <size_t>&_m0, "desc_len": <size_t>&_m0.desc_len - <size_t>&_m0,
    "kind": <size_t>&_m0.kind - <size_t>&_m0, "flags": <size_t>&_m0.flags - <size_t>&_m0,
    "worker_pid": <size_t>&_m0.worker_pid - <size_t>&_m0, "grow_count": <size_t>&_m0.grow_count - <size_t>&_m0,
}

SlotMeta = collections.namedtuple(
    "SlotMeta", "seq kind flags used desc_off desc_len worker_pid capacity grow_count offset")
SlotMeta.__doc__ = """A slot header as read now (not validated; see SlotLease for a checked copy).

Fields: seq (batch sequence number), kind (KIND_*), flags (FLAG_*), used (payload
bytes written), desc_off/desc_len (descriptor range within the payload, bytes),
worker_pid, capacity (payload bytes available), grow_count, offset (payload byte
offset in the region)."""


class SlotStateError(RuntimeError):
    """A slot was not in the state the requested protocol edge starts from."""


class CorruptSlotError(RuntimeError):
    """A READY slot's header failed validation (a stray writer, a misbehaving worker).

    Raised by :meth:`Region.wait` after the slot was returned to FREE (its payload
    range reset when the range itself was bad), so nothing leaks.  The message names
    the slot, the field and the bad value.  Attributes: ``slot``, ``field``, ``value``.
    """

    def __init__(self, message, slot=None, field=None, value=None):
        super().__init__(message)
        self.slot = slot
        self.field = field
        self.value = value


class RegionFullError(MemoryError):
    """The region's address reservation, or the machine's memory, cannot hold the request."""


class RegionLayoutError(ValueError):
    """A file given to attach_region (or a mapping being populated) is not a region of this layout."""


cdef object _as_int(str name, object value):
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


cdef uint64_t _round_page(uint64_t n):
    return (n + _PAGE - 1) // _PAGE * _PAGE


def create_region(nslots, slot_bytes, reserve_bytes=0):
    """A new region of ``nslots`` slots, each with ``slot_bytes`` of payload.

    Parameters
    ----------
    nslots : int
        Number of slots, 1..MAX_SLOTS (4096).
    slot_bytes : int
        Initial payload bytes per slot, 0..MAX_SLOT_BYTES (rounded up to 4 KiB); 0
        sizes each slot on its first use.
    reserve_bytes : int, optional
        Address space reserved for the region's growth (bytes), 0..MAX_RESERVE_BYTES;
        0 picks DEFAULT_RESERVE_BYTES (16 GiB).  Raised to at least 4x the initial
        size.  Only pages in use consume memory.

    Raises
    ------
    TypeError
        An argument is not an int (bool is refused).
    ValueError
        An argument is out of range; the message names it, its value and the limit.
    RegionFullError
        ``nslots`` x ``slot_bytes`` exceeds the machine's physical memory.
    OSError
        ``memfd_create``, ``mmap`` or ``fallocate`` failed (errno attached).
    """
    nslots = _as_int("nslots", nslots)
    slot_bytes = _as_int("slot_bytes", slot_bytes)
    reserve_bytes = _as_int("reserve_bytes", reserve_bytes)
    if not 1 <= nslots <= MAX_SLOTS:
        raise ValueError(f"nslots must be in 1..{MAX_SLOTS}, got {nslots}")
    if not 0 <= slot_bytes <= MAX_SLOT_BYTES:
        raise ValueError(f"slot_bytes must be in 0..{MAX_SLOT_BYTES} (MAX_SLOT_BYTES, 1 TiB), got {slot_bytes}")
    if not 0 <= reserve_bytes <= MAX_RESERVE_BYTES:
        raise ValueError(f"reserve_bytes must be in 0..{MAX_RESERVE_BYTES} (MAX_RESERVE_BYTES, 64 TiB; "
                         f"0 = {DEFAULT_RESERVE_BYTES}), got {reserve_bytes}")
    initial = _round_page(_PAGE + nslots * 128) + nslots * _round_page(slot_bytes)
    if 4 * initial > MAX_RESERVE_BYTES:
        raise ValueError(f"nslots * slot_bytes ({nslots} x {slot_bytes}) is too large: the region needs "
                         f"4 x {initial} bytes of address space, above MAX_RESERVE_BYTES ({MAX_RESERVE_BYTES})")
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if initial > phys:
        raise RegionFullError(f"nslots * slot_bytes ({nslots} x {slot_bytes} = {initial} bytes with headers) "
                              f"exceeds this machine's physical memory ({phys} bytes)")
    return _create(nslots, slot_bytes, reserve_bytes)


cdef Region _create(uint32_t nslots, uint64_t slot_bytes, uint64_t reserve_bytes):
    cdef Region region = Region.__new__(Region)
    cdef int rc
    with nogil:
        rc = mpl_region_create(&region.r, nslots, slot_bytes, reserve_bytes)
    if rc != MPL_OK:
        region._fail(rc, f"create_region(nslots={nslots}, slot_bytes={slot_bytes}, reserve_bytes={reserve_bytes})")
    region.owner_pid = mpl_self_pid()
    region.closed = False
    return region


def attach_region(fd):
    """Map the region whose memfd is ``fd`` (a spawned or forkserver worker).

    Reads nslots and the reservation from the control block after checking its
    magic and layout version.  The Region keeps its own duplicate of ``fd`` (close
    yours when done).  An attached region is not the owner: it never takes leases
    (:meth:`Region.wait` raises) and never frees slots.

    Raises
    ------
    TypeError
        ``fd`` is not an int.
    ValueError
        ``fd`` is negative.
    RegionLayoutError
        The file is not a region (bad magic, or too short), was written by another
        layout version (the message names both versions), or its control block is
        inconsistent.
    OSError
        ``pread``/``fstat``/``mmap`` failed (e.g. EBADF for a closed fd).
    """
    fd = _as_int("fd", fd)
    if fd < 0:
        raise ValueError(f"fd must be a non-negative file descriptor, got {fd}")
    if fd > 0x7fffffff:
        raise ValueError(f"fd must be a file descriptor (< 2**31), got {fd}")
    cdef Region region = Region.__new__(Region)
    cdef uint64_t magic = 0
    cdef uint32_t version = 0
    cdef int cfd = fd
    cdef int rc
    with nogil:
        rc = mpl_region_attach(&region.r, cfd, &magic, &version)
    if rc == MPL_EMAGIC:
        raise RegionLayoutError(f"fd {fd} is not an mploader region: magic {magic:#018x}, "
                                f"expected {MPL_MAGIC:#018x}")
    if rc == MPL_EVERSION:
        raise RegionLayoutError(f"fd {fd} holds an mploader region of layout version {version}; "
                                f"this build reads layout version {LAYOUT_VERSION}")
    if rc == MPL_EINVAL:
        raise RegionLayoutError(f"fd {fd}: the region's control block is inconsistent (nslots, reservation "
                                f"or headers out of range, or the file is shorter than its headers)")
    if rc != MPL_OK:
        region._fail(rc, f"attach_region(fd={fd})")
    region.owner_pid = 0
    region.attached = True
    region.closed = False
    return region


cdef str _state_name(uint32_t st):
    return STATE_NAMES.get(st, f"state {st}")


@cython.final
cdef class Region:
    """A shared-memory region of ``nslots`` slots (C: ``mpl_region``).

    Built by :func:`create_region` or :func:`attach_region` only.  Lifecycle: built
    (mapped, fd open) -> ``close()`` (fd closed, mapping kept for live leases) ->
    deallocated (unmapped).  ``forget()`` unmaps at once (a forked child dropping a
    region it does not use).  Every method raises ValueError once the region is
    unmapped in this process, IndexError for a slot out of range, and
    SlotStateError when a slot is not in the state the edge starts from.
    """

    def __cinit__(self):
        # Every field "not built": __dealloc__ must cope with a Region whose
        # construction stopped anywhere (it never closes fd 0).
        self.r.base = NULL
        self.r.fd = -1
        self.r.nslots = 0
        self.r.reserve_bytes = 0
        self.r.payload_off = 0
        self.r.seen_bytes = 0
        self.owner_pid = -1
        self.closed = True
        self.attached = False

    def __init__(self, *args, **kwargs):
        raise TypeError("Region objects cannot be built directly: use mploader._ring.create_region(nslots, "
                        "slot_bytes, reserve_bytes=0) or mploader._ring.attach_region(fd)")

    def __dealloc__(self):
        mpl_region_unmap(&self.r)  # closes fd only when >= 0, unmaps only when mapped

    def __repr__(self):
        if self.r.base == NULL:
            return "<mploader._ring.Region (not mapped)>"
        return (f"<mploader._ring.Region nslots={self.r.nslots} file_bytes={self.file_bytes} "
                f"fd={self.r.fd}{' attached' if self.attached else ''}{' closed' if self.closed else ''}>")

    cdef int _check(self, uint32_t slot) except -1:
        if self.r.base == NULL:
            raise ValueError("the region is not mapped in this process (forgotten, or never built)")
        if slot >= self.r.nslots:
            raise IndexError(f"slot must be in 0..{self.r.nslots - 1}, got {slot}")
        return 0

    cdef int _fail(self, int rc, str what, uint32_t slot=0xffffffff) except -1:
        cdef int err = errno  # first: nothing below may clobber it before it is read
        if rc == MPL_ESYS:
            raise OSError(err, f"{what}: {os.strerror(err)}")
        if rc == MPL_ESTATE:
            now = (f"slot {slot} is {_state_name(mpl_slot_state(&self.r, slot))}"
                   if self.r.base != NULL and slot < self.r.nslots else "slot in the wrong state")
            raise SlotStateError(f"{what}: {now}")
        if rc == MPL_ENOSPACE:
            raise RegionFullError(f"{what}: exceeds this machine's physical memory or the region's address "
                                  f"reservation ({self.r.reserve_bytes} bytes)")
        if rc == MPL_EINVAL:
            raise ValueError(f"{what}: argument out of range")
        if rc == MPL_EMAGIC:
            raise RegionLayoutError(f"{what}: the control block's magic is not {MPL_MAGIC:#018x} "
                                    f"(not a region, or overwritten)")
        if rc == MPL_EVERSION:
            raise RegionLayoutError(f"{what}: the control block's layout version is not {LAYOUT_VERSION}")
        raise SystemError(f"{what}: internal error, csrc/ring.c returned {rc}")

    @property
    def nslots(self):
        """Number of slots."""
        return self.r.nslots

    @property
    def address(self):
        """Start address of the mapping in this process (0 once unmapped)."""
        return <size_t>self.r.base

    @property
    def reserve_bytes(self):
        """Length of the mapping: address space reserved for the region (bytes)."""
        return self.r.reserve_bytes

    @property
    def fd(self):
        """The memfd (-1 once closed)."""
        return self.r.fd

    @property
    def file_bytes(self):
        """Bytes of shared memory the region's file spans (holes included)."""
        return mpl_region_file_bytes(&self.r) if self.r.base != NULL else 0

    @property
    def size_hint(self):
        """Largest payload a batch has needed so far (bytes), unless lowered by set_size_hint."""
        return mpl_region_size_hint(&self.r) if self.r.base != NULL else 0

    @property
    def wakes(self):
        """FUTEX_WAKE system calls publishers made (only when the parent slept on the slot)."""
        return mpl_region_wake_count(&self.r) if self.r.base != NULL else 0

    def note_size(self, uint64_t need):
        """Raise the size hint to ``need`` bytes (no-op if already larger)."""
        self._check(0)
        mpl_region_note_size(&self.r, need)

    def set_size_hint(self, uint64_t n):
        """Set the size hint to ``n`` bytes, lower or higher (slots begun later are grown to it)."""
        self._check(0)
        mpl_region_set_size_hint(&self.r, n)

    def close(self):
        """Close the memfd; existing leases stay valid.  Idempotent."""
        mpl_region_close_fd(&self.r)
        self.closed = True

    def forget(self):
        """Unmap in this process (a forked child dropping another loader's region).

        Must not be called while a lease of this region is alive in this process.
        """
        self.closed = True
        mpl_region_unmap(&self.r)

    def populate(self):
        """Fault in all pages in this process (workers after fork).

        Raises RegionLayoutError if the control block's magic or layout version is
        wrong, OSError if a system call fails.
        """
        self._check(0)
        cdef int rc
        with nogil:
            rc = mpl_region_populate(&self.r)
        if rc != MPL_OK:
            self._fail(rc, "populate")

    # ---- parent side ----

    def find_free(self, uint32_t start=0):
        """Index of a FREE slot at or after ``start`` (cyclically), or -1."""
        self._check(0)
        return mpl_find_free(&self.r, start)

    def assign(self, uint32_t slot, uint64_t seq):
        """Edge E1 (FREE -> ASSIGNED) for batch ``seq``.  Raises SlotStateError."""
        self._check(slot)
        cdef int rc = mpl_slot_assign(&self.r, slot, seq)
        if rc != MPL_OK:
            self._fail(rc, f"assign slot {slot} (needs FREE)", slot)

    def wait(self, uint32_t slot, double timeout_s, list into=None, double spin_s=0.0):
        """Wait up to ``timeout_s`` seconds (< 0: forever) for READY; take E3; return the lease.

        Taking E3 and creating the slot's single :class:`SlotLease` are one step (no
        Python code in between).  The lease carries a validated snapshot of the
        header.  ``timeout_s=0`` costs one atomic load when not ready, one CAS when
        ready.  The GIL is released while sleeping.

        ``into``: a list the lease is also appended to before ``wait`` returns.
        CPython runs pending signal handlers right after a C call returns, before
        its result is stored anywhere; a handler that raises (KeyboardInterrupt)
        would drop a lease that is only returned, and with it the batch.  A lease
        appended to a list the caller keeps survives that.

        ``spin_s``: spin on the state word (CPU busy, GIL released) up to this many
        seconds, bounded by ``timeout_s``, before sleeping; a batch published during
        the spin costs neither side a system call.  Only worth it where a core is
        spare (the caller decides, e.g. from ``os.sched_getaffinity``); 0 = sleep at
        once.

        Returns
        -------
        SlotLease or None
            None when the slot is still ASSIGNED after ``timeout_s``.

        Raises
        ------
        CorruptSlotError
            The header failed validation; the slot is FREE again.
        SlotStateError
            The slot is neither ASSIGNED nor READY, or this process is not the
            region's owner (a forked child, an attached region).
        ValueError
            ``timeout_s`` is NaN, or ``spin_s`` is negative or NaN.
        """
        self._check(slot)
        cdef pid_t me = mpl_self_pid()
        if self.owner_pid != me:
            if self.attached:
                raise SlotStateError(f"wait slot {slot}: an attached region cannot take leases "
                                     f"(only the process that created it can)")
            raise SlotStateError(f"wait slot {slot}: this process (pid {me}) did not create the region "
                                 f"(pid {self.owner_pid}); a forked child cannot take the parent's batches")
        if timeout_s != timeout_s:
            raise ValueError("timeout_s must be a number of seconds (< 0: forever), got nan")
        if not spin_s >= 0:
            raise ValueError(f"spin_s must be a non-negative number of seconds, got {spin_s}")
        cdef int64_t ns
        cdef int64_t spin_ns = <int64_t>(min(spin_s, 9.0e9) * 1e9)
        if timeout_s < 0 or timeout_s > 9.0e9:
            ns = -1
        else:
            ns = <int64_t>(timeout_s * 1e9)
        if ns == 0 and mpl_slot_state(&self.r, slot) == MPL_ASSIGNED:
            return None
        # Allocated before E3, so that nothing can fail once the slot is LEASED.
        cdef SlotLease lease = SlotLease.__new__(SlotLease)
        cdef uint32_t bad = MPL_FIELD_NONE
        cdef int rc = mpl_slot_take(&self.r, slot, 0, 0, &lease.m, &bad)
        if rc == MPL_ETIMEDOUT and ns != 0:
            with nogil:
                rc = mpl_slot_take(&self.r, slot, ns, spin_ns, &lease.m, &bad)
        if rc == MPL_OK:
            # C-level stores only (no Python code): the lease exists as soon as E3 is taken.
            lease.region = self
            lease.slot_ = slot
            lease.ptr = self.r.base + lease.m.offset
            lease.held = True
            if into is not None:
                into.append(lease)  # C-level append: no Python code runs
            return lease
        if rc == MPL_ETIMEDOUT:
            return None
        if rc == MPL_ECORRUPT:
            raise _corrupt(self, slot, bad, &lease.m)
        self._fail(rc, f"wait slot {slot} (needs ASSIGNED or READY)", slot)

    def meta(self, uint32_t slot):
        """The slot's header as a :data:`SlotMeta` (read now, not validated)."""
        self._check(slot)
        cdef mpl_slot_meta *m = mpl_slot_meta_of(&self.r, slot)
        return SlotMeta(m.seq, m.kind, m.flags, m.used, m.desc_off, m.desc_len, m.worker_pid,
                        m.capacity, m.grow_count, m.offset)

    def reclaim(self, uint32_t slot):
        """Edge E5 (ASSIGNED or READY -> FREE) for a batch whose worker is dead."""
        self._check(slot)
        cdef int rc = mpl_slot_reclaim(&self.r, slot)
        if rc != MPL_OK:
            self._fail(rc, f"reclaim slot {slot} (needs ASSIGNED or READY)", slot)

    def state(self, uint32_t slot):
        """Current state of ``slot`` (0 FREE, 1 ASSIGNED, 2 READY, 3 LEASED)."""
        self._check(slot)
        return mpl_slot_state(&self.r, slot)

    def _state_word(self, uint32_t slot):
        """The raw state word, MPL_WAITER bit included (tests)."""
        self._check(slot)
        return mpl_slot_word(&self.r, slot)

    def _meta_address(self, uint32_t slot):
        """Address of the slot's header metadata in this process (tests corrupt it here)."""
        self._check(slot)
        return <size_t>mpl_slot_meta_of(&self.r, slot)

    # ---- worker side ----

    def begin(self, uint32_t slot, uint64_t seq):
        """Check the slot is ASSIGNED for ``seq``; return its payload capacity (bytes).

        Raises CorruptSlotError when the slot's payload range (offset, capacity) is
        not a sane range of the region: the range is then reset to empty (capacity
        0), so the worker may still ``grow`` the slot and publish its report.
        """
        self._check(slot)
        cdef mpl_slot_meta before = mpl_slot_meta_of(&self.r, slot)[0]
        cdef int rc = mpl_slot_begin(&self.r, slot, seq)
        cdef uint32_t bad
        if rc == MPL_ECORRUPT:
            bad = mpl_slot_check_range(&self.r, before.offset, before.capacity)
            if bad == MPL_FIELD_UNCHECKED:
                raise OSError(9, f"begin slot {slot}: the region's memfd is closed; its range cannot be checked")
            raise _corrupt(self, slot, bad, &before, "the slot's range was reset to empty")
        if rc != MPL_OK:
            if rc == MPL_ESTATE and mpl_slot_state(&self.r, slot) == MPL_ASSIGNED:
                raise SlotStateError(f"begin slot {slot}: it is assigned to batch "
                                     f"{mpl_slot_meta_of(&self.r, slot).seq}, not {seq}")
            self._fail(rc, f"begin slot {slot} for batch {seq} (needs ASSIGNED)", slot)
        return mpl_slot_meta_of(&self.r, slot).capacity

    def payload(self, uint32_t slot):
        """Writable memoryview of the slot's whole payload (worker side).

        Valid until the slot is grown, shrunk or published.
        """
        self._check(slot)
        cdef mpl_slot_meta *m = mpl_slot_meta_of(&self.r, slot)
        return PyMemoryView_FromMemory(<char *>(self.r.base + m.offset), <Py_ssize_t>m.capacity, PyBUF_WRITE)

    def payload_address(self, uint32_t slot):
        """(address, capacity) of the slot's payload in this process."""
        self._check(slot)
        cdef mpl_slot_meta *m = mpl_slot_meta_of(&self.r, slot)
        return (<size_t>(self.r.base + m.offset), m.capacity)

    def grow(self, uint32_t slot, uint64_t need, uint64_t preserve=0):
        """Give the ASSIGNED slot a new payload range of >= ``need`` bytes, copying ``preserve`` bytes.

        Returns False when the region's reservation is exhausted (slot unchanged).
        """
        self._check(slot)
        cdef int rc
        with nogil:
            rc = mpl_slot_grow(&self.r, slot, need, preserve)
        if rc == MPL_OK:
            return True
        if rc == MPL_ENOSPACE:
            return False
        self._fail(rc, f"grow slot {slot} (needs ASSIGNED)", slot)

    def resize(self, uint32_t slot, uint64_t need, uint64_t preserve=0):
        """Make the ASSIGNED slot's payload fit ``need`` bytes, smaller or larger.

        Smaller (``need`` <= capacity): shrinks in place to ``need`` rounded up to
        4 KiB, the first ``need`` bytes untouched, the tail's memory returned to the
        kernel; no address space is used.  Larger: as :meth:`grow`.  Returns False
        only when a grow finds the reservation exhausted (slot unchanged).
        """
        self._check(slot)
        cdef int rc
        if need <= mpl_slot_meta_of(&self.r, slot).capacity:
            with nogil:
                rc = mpl_slot_shrink(&self.r, slot, need)
            if rc != MPL_OK:
                self._fail(rc, f"resize slot {slot} to {need} bytes (needs ASSIGNED)", slot)
            return True
        return self.grow(slot, need, preserve)

    def publish(self, uint32_t slot, uint32_t kind, uint32_t flags, uint64_t used,
                uint64_t desc_off=0, uint64_t desc_len=0):
        """Edge E2 (ASSIGNED -> READY); wakes the parent only if it sleeps on the slot."""
        self._check(slot)
        cdef int rc = mpl_slot_publish(&self.r, slot, kind, flags, used, desc_off, desc_len)
        if rc == MPL_EINVAL:
            cap = mpl_slot_meta_of(&self.r, slot).capacity
            if used > cap:
                raise ValueError(f"publish slot {slot}: used must be <= the slot's capacity {cap}, got {used}")
            raise ValueError(f"publish slot {slot}: the descriptor [desc_off, desc_off + desc_len) = "
                             f"[{desc_off}, {desc_off + desc_len}) must lie inside [0, used={used})")
        if rc != MPL_OK:
            self._fail(rc, f"publish slot {slot} (needs ASSIGNED)", slot)


cdef object _corrupt(Region region, uint32_t slot, uint32_t bad, mpl_slot_meta *m,
                     str outcome="the batch is dropped and the slot freed"):
    field = _FIELD_NAMES.get(bad, f"field {bad}")
    if bad == MPL_FIELD_KIND:
        value, why = m.kind, f"not KIND_SLOT/PIPE/ERROR ({MPL_KIND_SLOT}/{MPL_KIND_PIPE}/{MPL_KIND_ERROR})"
    elif bad == MPL_FIELD_OFFSET:
        value, why = m.offset, (f"must be page-aligned and inside the payload area [{region.r.payload_off}, "
                                f"{region.r.seen_bytes}) of the region's file")
    elif bad == MPL_FIELD_CAPACITY:
        value, why = m.capacity, (f"offset {m.offset} + capacity must be page-aligned and within the region's "
                                  f"file ({region.r.seen_bytes} bytes) and reservation ({region.r.reserve_bytes})")
    elif bad == MPL_FIELD_USED:
        value, why = m.used, f"exceeds the capacity {m.capacity}"
    elif bad == MPL_FIELD_DESC_OFF:
        value, why = m.desc_off, f"exceeds used {m.used}"
    else:
        value, why = m.desc_len, f"desc_off {m.desc_off} + desc_len exceeds used {m.used}"
    return CorruptSlotError(f"slot {slot} (batch {m.seq}): corrupt header field {field} = {value}: {why}; "
                            f"{outcome}", slot, field, value)


@cython.final
@cython.no_gc  # refers only to a Region, which refers to no Python object: never in a cycle
cdef class SlotLease:
    """Ownership of one LEASED slot, exported as a writable 1-D uint8 buffer of ``nbytes``.

    Made only by :meth:`Region.wait`.  Carries a snapshot of the slot header taken
    (and validated) at E3; its attributes are read-only.  Every zero-copy array of a
    batch has this object at the root of its ``base`` chain.  When the last of them
    is garbage-collected the lease is deallocated and the slot returns to FREE (edge
    E4), in the process that created the region only.
    """

    def __cinit__(self):
        self.region = None
        self.held = False
        self.ptr = NULL
        self.exports = 0

    def __init__(self, *args, **kwargs):
        raise TypeError("SlotLease objects are made by Region.wait(), not directly")

    def __dealloc__(self):
        if (self.held and self.region is not None and self.region.r.base != NULL
                and self.region.owner_pid == mpl_self_pid()):
            mpl_slot_release(&self.region.r, self.slot_)

    def __repr__(self):
        return (f"<mploader._ring.SlotLease slot={self.slot_} seq={self.m.seq} kind={self.m.kind} "
                f"nbytes={self.m.used}>")

    @property
    def slot(self):
        """Slot index."""
        return self.slot_

    @property
    def seq(self):
        """Batch sequence number the worker published."""
        return self.m.seq

    @property
    def kind(self):
        """KIND_SLOT, KIND_PIPE or KIND_ERROR."""
        return self.m.kind

    @property
    def flags(self):
        """FLAG_* bits the worker set."""
        return self.m.flags

    @property
    def nbytes(self):
        """Payload bytes written (the header's ``used``), the buffer's length."""
        return self.m.used

    @property
    def desc_off(self):
        """Descriptor offset within the payload (bytes)."""
        return self.m.desc_off

    @property
    def desc_len(self):
        """Descriptor length (bytes)."""
        return self.m.desc_len

    @property
    def worker_pid(self):
        """Pid of the worker that published."""
        return self.m.worker_pid

    @property
    def capacity(self):
        """Payload bytes the slot had (bytes)."""
        return self.m.capacity

    @property
    def grow_count(self):
        """How many times the slot was grown since the region was created."""
        return self.m.grow_count

    @property
    def offset(self):
        """Payload byte offset in the region."""
        return self.m.offset

    def __getbuffer__(self, Py_buffer *buf, int flags):
        self.shape[0] = <Py_ssize_t>self.m.used
        self.strides[0] = 1
        buf.buf = <void *>self.ptr
        buf.obj = self
        buf.len = <Py_ssize_t>self.m.used
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = _FORMAT_B if (flags & PyBUF_FORMAT) else NULL
        buf.ndim = 1
        buf.shape = self.shape if (flags & PyBUF_ND) else NULL
        buf.strides = self.strides if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        buf.suboffsets = NULL
        buf.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buf):
        self.exports -= 1


def watch_parent(parent_pid):
    """In a worker: die (SIGKILL) as soon as the parent *process* ``parent_pid`` exits.

    Opens a pidfd of the parent and polls it from a detached C thread (no GIL, all
    signals blocked).  Unlike PR_SET_PDEATHSIG it does not fire when the thread that
    forked the worker exits.  Exits at once (status 1) if the parent is already gone.

    Raises
    ------
    TypeError / ValueError
        ``parent_pid`` is not a positive int.
    OSError
        ``pidfd_open`` or ``pthread_create`` failed.
    """
    parent_pid = _as_int("parent_pid", parent_pid)
    if not 0 < parent_pid <= 0x7fffffff:
        raise ValueError(f"parent_pid must be a positive process id, got {parent_pid}")
    cdef int rc = mpl_watch_parent(<pid_t>parent_pid)
    cdef int err = errno
    if rc != MPL_OK:
        raise OSError(err, f"watch_parent({parent_pid}): {os.strerror(err)}")


def set_pdeathsig(int sig, int expected_ppid):
    """Deprecated alias of :func:`watch_parent` (``sig`` is ignored: SIGKILL)."""
    watch_parent(expected_ppid)
