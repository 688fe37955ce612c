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
# Live Region and SlotLease objects in this process (uvloop's debug counters, always
# on: one increment per object).  Tests assert they return to their start value.
cdef Py_ssize_t _live_regions = 0
cdef Py_ssize_t _live_leases = 0


def live_objects():
    """``{"regions": n, "leases": m}``: Region and SlotLease objects alive in this process."""
    return {"regions": _live_regions, "leases": _live_leases}
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


def watch_parent(parent_pid, lifeline_fd=-1):
    """In a worker: die (SIGKILL) as soon as the parent *process* ``parent_pid`` exits.

    Opens a pidfd of the parent and polls it from a detached C thread (no GIL, all
    signals blocked).  Unlike PR_SET_PDEATHSIG it does not fire when the thread that
    forked the worker exits.  Exits at once (status 1) if the parent is already gone.

    ``lifeline_fd``: -1, or the read end of a pipe whose write end only the parent
    holds (this process has closed its copies).  Where ``pidfd_open`` is refused
    (:func:`pidfd_refused`: a seccomp filter, a kernel before 5.3) the thread polls
    its own duplicate of it instead: EOF when the parent dies, and where the parent
    is this process's parent, ``getppid()`` every 250 ms.  The caller keeps (and
    closes) ``lifeline_fd``.

    Raises
    ------
    TypeError / ValueError
        ``parent_pid`` is not a positive int, or ``lifeline_fd`` not an int >= -1.
    PermissionError / OSError
        ``pidfd_open`` was refused and no ``lifeline_fd`` was given (the message says
        so), or ``pidfd_open``, ``fcntl`` or ``pthread_create`` failed.
    """
    parent_pid = _as_int("parent_pid", parent_pid)
    lifeline_fd = _as_int("lifeline_fd", lifeline_fd)
    if not 0 < parent_pid <= 0x7fffffff:
        raise ValueError(f"parent_pid must be a positive process id, got {parent_pid}")
    if not -1 <= lifeline_fd <= 0x7fffffff:
        raise ValueError(f"lifeline_fd must be a file descriptor or -1, got {lifeline_fd}")
    cdef int rc = mpl_watch_parent(<pid_t>parent_pid, <int>lifeline_fd)
    cdef int err = errno
    if rc != MPL_OK:
        if mpl_pidfd_refused(err) and lifeline_fd < 0:
            raise OSError(err, f"watch_parent({parent_pid}): pidfd_open was refused ({os.strerror(err)}; a "
                               f"seccomp filter or a kernel before 5.3) and no lifeline_fd was given to fall "
                               f"back on")
        raise OSError(err, f"watch_parent({parent_pid}, lifeline_fd={lifeline_fd}): {os.strerror(err)}")


def pidfd_open(pid):
    """A pidfd of process ``pid`` (``os.pidfd_open``), close-on-exec and >= 3 (never a
    standard stream).  The caller closes it.  ``MPLOADER_TEST_REFUSE_PIDFD`` in the
    environment (tests only) simulates a refusal (``EPERM`` or ``ENOSYS``).

    Raises
    ------
    OSError
        ``pidfd_open`` failed (ESRCH: no such process; ENOSYS/EPERM/EACCES: refused
        here, see :func:`pidfd_refused`; EMFILE).
    """
    pid = _as_int("pid", pid)
    if not 0 < pid <= 0x7fffffff:
        raise ValueError(f"pid must be a positive process id, got {pid}")
    cdef int fd = mpl_pidfd_open(<pid_t>pid)
    cdef int err = errno
    if fd < 0:
        raise OSError(err, f"pidfd_open({pid}): {os.strerror(err)}")
    return fd


def pidfd_refused(int err):
    """True if ``err`` (an errno of ``pidfd_open``) means the call is refused in this
    process (ENOSYS, EPERM, EACCES: seccomp, old kernels) rather than failed."""
    return bool(mpl_pidfd_refused(err))


def fd_off_stdio(fd):
    """``fd`` if it is >= 3; else a close-on-exec duplicate >= 3 (F_DUPFD_CLOEXEC), and
    ``fd`` is closed.  Every descriptor mploader creates goes through this, so that a
    process started with its standard streams closed never prints into one.

    Raises
    ------
    OSError
        The duplicate could not be made (EMFILE); ``fd`` is closed.
    """
    fd = _as_int("fd", fd)
    if not 0 <= fd <= 0x7fffffff:
        raise ValueError(f"fd must be a file descriptor, got {fd}")
    cdef int orig = fd
    cdef int out = mpl_fd_off_stdio(orig)
    cdef int err = errno
    if out < 0:
        raise OSError(err, f"fd_off_stdio({orig}): {os.strerror(err)}")
    return out


def set_pdeathsig(int sig, int expected_ppid):
    """Deprecated alias of :func:`watch_parent` (``sig`` is ignored: SIGKILL)."""
    watch_parent(expected_ppid)


# The classes, one file each (textual includes: they share this module's globals).
include "_ring_region.pxi"
include "_ring_lease.pxi"
