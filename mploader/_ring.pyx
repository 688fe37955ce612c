# cython: language_level=3
"""Python objects over the C slot region (csrc/ring.h).

Lifecycle invariants
--------------------
* A :class:`Region` is created in the parent before the workers fork; the workers
  use their inherited copy.  ``close()`` closes the memfd; the mapping itself lives
  until the Region object is deallocated, which cannot happen while any
  :class:`SlotLease` (and so any zero-copy view) still refers to it.
* A :class:`SlotLease` is the only owner of a LEASED slot.  Its deallocation takes
  edge E4 (LEASED -> FREE, docs/design.md) -- but only in the process that created
  the region: a forked child that drops an inherited lease must not free the
  parent's slot.
"""
from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from posix.unistd cimport getpid

import os

KIND_NONE = MPL_KIND_NONE
KIND_SLOT = MPL_KIND_SLOT
KIND_PIPE = MPL_KIND_PIPE
KIND_ERROR = MPL_KIND_ERROR
FLAG_GROWN = MPL_FLAG_GROWN
FLAG_INBAND = MPL_FLAG_INBAND
cdef char *_FORMAT_B = b"B"
STATE_FREE = MPL_FREE
STATE_ASSIGNED = MPL_ASSIGNED
STATE_READY = MPL_READY
STATE_LEASED = MPL_LEASED
STATE_NAMES = {MPL_FREE: "FREE", MPL_ASSIGNED: "ASSIGNED", MPL_READY: "READY", MPL_LEASED: "LEASED"}


class SlotStateError(RuntimeError):
    """A slot was not in the state the requested protocol edge starts from."""


cdef int _raise(int rc, str what) except -1:
    if rc == MPL_ESYS:
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    if rc == MPL_ESTATE:
        raise SlotStateError(f"{what}: slot is not in the expected state")
    if rc == MPL_EINVAL:
        raise ValueError(f"{what}: argument out of range")
    raise RuntimeError(f"{what}: unexpected return code {rc}")


cdef class Region:
    """A shared-memory region of ``nslots`` slots (C: ``mpl_region``).

    Parameters
    ----------
    nslots : int
        Number of slots, 1..4096.
    slot_bytes : int
        Initial payload bytes per slot (rounded up to 4 KiB); 0 sizes each slot on
        its first use.
    reserve_bytes : int, optional
        Address space reserved for the region's growth (bytes); 0 picks 16 GiB.
        Only pages in use consume memory.

    Raises
    ------
    OSError
        ``memfd_create``, ``mmap`` or ``fallocate`` failed (errno attached).
    ValueError
        ``nslots`` out of range.
    """

    def __cinit__(self, uint32_t nslots, uint64_t slot_bytes, uint64_t reserve_bytes=0):
        self.r.base = NULL
        self.r.fd = -1
        cdef int rc = mpl_region_create(&self.r, nslots, slot_bytes, reserve_bytes)
        if rc != MPL_OK:
            if rc == MPL_EINVAL:
                raise ValueError(f"nslots must be in 1..4096, got {nslots}")
            _raise(rc, "mpl_region_create")
        self.owner_pid = getpid()
        self.closed = False

    def __dealloc__(self):
        mpl_region_unmap(&self.r)

    cdef int _check(self, uint32_t slot) except -1:
        if self.r.base == NULL:
            raise ValueError("region is unmapped in this process")
        if slot >= self.r.nslots:
            raise IndexError(f"slot must be in 0..{self.r.nslots - 1}, got {slot}")
        return 0

    @property
    def nslots(self):
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
        """Largest payload a batch has needed so far (bytes)."""
        return mpl_region_size_hint(&self.r) if self.r.base != NULL else 0

    def note_size(self, uint64_t need):
        self._check(0)
        mpl_region_note_size(&self.r, need)

    def close(self):
        """Close the memfd; existing leases stay valid.  Idempotent."""
        mpl_region_close_fd(&self.r)
        self.closed = True

    def forget(self):
        """Unmap in this process (a forked child dropping another loader's region)."""
        self.closed = True
        mpl_region_unmap(&self.r)

    def populate(self):
        """Fault in all pages in this process (workers after fork)."""
        self._check(0)
        cdef int rc
        with nogil:
            rc = mpl_region_populate(&self.r)
        if rc != MPL_OK:
            _raise(rc, "populate")

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
            _raise(rc, f"assign slot {slot}")

    def wait(self, uint32_t slot, double timeout_s):
        """Wait up to ``timeout_s`` seconds (< 0: forever) for READY, then take E3.

        Returns True when the slot is now LEASED, False on timeout.
        """
        self._check(slot)
        cdef int64_t ns = <int64_t>(timeout_s * 1e9) if timeout_s >= 0 else -1
        cdef int rc
        rc = mpl_slot_wait(&self.r, slot, 0)
        if rc == MPL_ETIMEDOUT and ns != 0:
            with nogil:
                rc = mpl_slot_wait(&self.r, slot, ns)
        if rc == MPL_OK:
            return True
        if rc == MPL_ETIMEDOUT:
            return False
        _raise(rc, f"wait slot {slot}")

    def meta(self, uint32_t slot):
        """(seq, kind, flags, used, desc_off, desc_len, worker_pid, capacity, grow_count)."""
        self._check(slot)
        cdef mpl_slot_meta *m = mpl_slot_meta_of(&self.r, slot)
        return (m.seq, m.kind, m.flags, m.used, m.desc_off, m.desc_len, m.worker_pid,
                m.capacity, m.grow_count)

    def lease(self, uint32_t slot):
        """A :class:`SlotLease` on a LEASED slot; the slot is FREE again when it dies."""
        self._check(slot)
        if mpl_slot_state(&self.r, slot) != MPL_LEASED:
            raise SlotStateError(f"lease slot {slot}: slot is not LEASED")
        cdef SlotLease lease = SlotLease.__new__(SlotLease)
        cdef mpl_slot_meta *m = mpl_slot_meta_of(&self.r, slot)
        lease.region = self
        lease.slot = slot
        lease.ptr = mpl_slot_payload(&self.r, slot)
        lease.nbytes = <Py_ssize_t>m.used
        return lease

    def release(self, uint32_t slot):
        """Edge E4 (LEASED -> FREE) without a lease object (abandoned batches)."""
        self._check(slot)
        cdef int rc = mpl_slot_release(&self.r, slot)
        if rc != MPL_OK:
            _raise(rc, f"release slot {slot}")

    def reclaim(self, uint32_t slot):
        """Edge E5 (ASSIGNED or READY -> FREE) for a batch whose worker is dead."""
        self._check(slot)
        cdef int rc = mpl_slot_reclaim(&self.r, slot)
        if rc != MPL_OK:
            _raise(rc, f"reclaim slot {slot}")

    def state(self, uint32_t slot):
        """Current state word of ``slot`` (0 FREE, 1 ASSIGNED, 2 READY, 3 LEASED)."""
        self._check(slot)
        return mpl_slot_state(&self.r, slot)

    # ---- worker side ----

    def begin(self, uint32_t slot, uint64_t seq):
        """Check the slot is ASSIGNED for ``seq``; return its payload capacity (bytes)."""
        self._check(slot)
        cdef int rc = mpl_slot_begin(&self.r, slot, seq)
        if rc != MPL_OK:
            _raise(rc, f"begin slot {slot} for batch {seq}")
        return mpl_slot_meta_of(&self.r, slot).capacity

    def payload(self, uint32_t slot):
        """Writable memoryview of the slot's whole payload (worker side).

        Valid until the slot is grown or published.
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
        """Give the slot a payload of >= ``need`` bytes keeping ``preserve`` bytes.

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
        _raise(rc, f"grow slot {slot}")

    def publish(self, uint32_t slot, uint32_t kind, uint32_t flags, uint64_t used,
                uint64_t desc_off=0, uint64_t desc_len=0):
        """Edge E2 (ASSIGNED -> READY) and wake the parent."""
        self._check(slot)
        cdef int rc = mpl_slot_publish(&self.r, slot, kind, flags, used, desc_off, desc_len)
        if rc != MPL_OK:
            _raise(rc, f"publish slot {slot}")


cdef class SlotLease:
    """Ownership of one LEASED slot, exported as a writable 1-D uint8 buffer.

    Every zero-copy array of a batch has this object at the root of its ``base``
    chain.  When the last of them is garbage-collected the lease is deallocated and
    the slot returns to FREE (edge E4), in the process that created the region only.
    """

    def __cinit__(self):
        self.ptr = NULL
        self.nbytes = 0
        self.exports = 0

    def __dealloc__(self):
        if self.region is not None and self.region.r.base != NULL and self.region.owner_pid == getpid():
            mpl_slot_release(&self.region.r, self.slot)

    @property
    def slot(self):
        return self.slot

    @property
    def nbytes(self):
        return self.nbytes

    def __getbuffer__(self, Py_buffer *buf, int flags):
        self.shape[0] = self.nbytes
        self.strides[0] = 1
        buf.buf = <void *>self.ptr
        buf.obj = self
        buf.len = self.nbytes
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


def set_pdeathsig(int sig, int expected_ppid):
    """PR_SET_PDEATHSIG(sig) in a forked worker; exits at once if the parent is gone."""
    cdef int rc = mpl_set_pdeathsig(sig, expected_ppid)
    if rc != MPL_OK:
        _raise(rc, "prctl(PR_SET_PDEATHSIG)")
