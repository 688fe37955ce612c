# Included by _ring.pyx (textually, as numpy/random does with .pxi): the Region class.


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
        self.release_hook = None
        global _live_regions
        _live_regions += 1

    def __init__(self, *args, **kwargs):
        raise TypeError("Region objects cannot be built directly: use mploader._ring.create_region(nslots, "
                        "slot_bytes, reserve_bytes=0) or mploader._ring.attach_region(fd)")

    def __dealloc__(self):
        global _live_regions
        _live_regions -= 1
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

    cdef int _not_owner(self, str what, str short, str action) except -1:
        if self.attached:
            raise SlotStateError(f"{what}: an attached region cannot {short} (only the process that created "
                                 f"it can)")
        raise SlotStateError(f"{what}: this process (pid {mpl_self_pid()}) did not create the region "
                             f"(pid {self.owner_pid}); a forked child cannot {action}")

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

    @property
    def pinned(self):
        """True once :meth:`set_pinned` was called (in any process mapping the region)."""
        return bool(mpl_region_pinned(&self.r)) if self.r.base != NULL else False

    def set_pinned(self):
        """Declare that the region's pages may be page-locked (``cudaHostRegister``).

        A lock holds the physical pages it found, so a page given back and faulted
        in again would no longer be the one the device reads: from now on a slot
        that grows past its capacity takes a fresh range of the reservation instead
        of growing in place into its own given-back range (docs/design.md,
        "Growth").  Call it before the first page is registered.  Idempotent.
        """
        self._check(0)
        mpl_region_set_pinned(&self.r)

    def span(self, uint32_t slot):
        """Bytes of address space ``slot`` owns at its payload offset (>= its capacity).

        The range the slot was last given; shrinking and trimming keep it, so the
        slot grows again in place up to it (docs/design.md, "Growth").
        """
        self._check(slot)
        return mpl_slot_span(&self.r, slot)

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
        """Edge E1 (FREE -> ASSIGNED) for batch ``seq``.

        Raises SlotStateError if the slot is not FREE, or in any process but the
        region's creator (a forked child would steal the parent's slots).
        """
        self._check(slot)
        if self.owner_pid != mpl_self_pid():
            self._not_owner(f"assign slot {slot}", "assign slots", "assign the parent's slots")
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
        if self.owner_pid != mpl_self_pid():
            self._not_owner(f"wait slot {slot}", "take leases", "take the parent's batches")
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

    def release(self, uint32_t slot):
        """Edge E4 (LEASED -> FREE) for a slot whose lease handed its release to
        ``release_hook`` (docs/design.md, "Pinned memory and asynchronous copies").

        ``release_hook``: None (a lease's last reference releases its slot at once),
        or a callable ``(slot) -> None`` that the lease calls instead, in the
        region's creator, when its last reference goes; the callable then owes this
        call.  Should it raise, the slot is released at once.

        Raises SlotStateError if the slot is not LEASED, or in any process but the
        region's creator.
        """
        self._check(slot)
        if self.owner_pid != mpl_self_pid():
            self._not_owner(f"release slot {slot}", "release slots", "release the parent's slots")
        cdef int rc = mpl_slot_release(&self.r, slot)
        if rc != MPL_OK:
            self._fail(rc, f"release slot {slot} (needs LEASED)", slot)

    def reclaim(self, uint32_t slot):
        """Edge E5 (ASSIGNED or READY -> FREE) for a batch whose worker is dead.

        Raises SlotStateError if the slot is neither, or in any process but the
        region's creator.
        """
        self._check(slot)
        if self.owner_pid != mpl_self_pid():
            self._not_owner(f"reclaim slot {slot}", "reclaim slots", "reclaim the parent's slots")
        cdef int rc = mpl_slot_reclaim(&self.r, slot)
        if rc != MPL_OK:
            self._fail(rc, f"reclaim slot {slot} (needs ASSIGNED or READY)", slot)

    def trim(self, uint32_t slot, uint64_t keep=0):
        """Give back the memory of a FREE slot's payload pages beyond ``keep`` bytes
        (rounded up to 4 KiB): the kernel frees them, the slot keeps its range and
        capacity (no address space is used), and the next batch written there has its
        pages allocated again as it touches them.

        Returns True once those pages are given back, False if the slot was not FREE
        (left as it was: a worker or a lease holds it).

        Raises SlotStateError in any process but the region's creator; OSError if
        the kernel refused (the slot is unchanged).
        """
        self._check(slot)
        if self.owner_pid != mpl_self_pid():
            self._not_owner(f"trim slot {slot}", "trim slots", "trim the parent's slots")
        cdef int rc
        with nogil:
            rc = mpl_slot_trim(&self.r, slot, keep)
        if rc == MPL_OK:
            return True
        if rc == MPL_ESTATE:
            return False
        self._fail(rc, f"trim slot {slot} to {keep} bytes (needs FREE)", slot)

    def park(self, uint32_t slot):
        """Give back a FREE slot's whole range: its pages to the kernel, its address
        space to the region's pool of spare ranges, where the next grow of any slot
        finds it (docs/design.md, "Growth"); the slot is left empty (capacity 0) and
        its next worker grows it.  For the slot of an outlier: its range serves the
        next outlier wherever that lands, so rare outliers use the address space of
        those in flight, not of every slot they visited.

        Returns True once done, False if the slot was not FREE or the region is
        pinned (:meth:`set_pinned`; left as it was).

        Raises SlotStateError in any process but the region's creator; OSError if
        the kernel refused (the slot is unchanged).
        """
        self._check(slot)
        if self.owner_pid != mpl_self_pid():
            self._not_owner(f"park slot {slot}", "park slots", "park the parent's slots")
        cdef int rc
        with nogil:
            rc = mpl_slot_park(&self.r, slot)
        if rc == MPL_OK:
            return True
        if rc == MPL_ESTATE:
            return False
        self._fail(rc, f"park slot {slot} (needs FREE)", slot)

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
        """Give the ASSIGNED slot a payload of ``need`` bytes rounded up to 4 KiB whose
        first ``preserve`` bytes are those of the old payload.

        In place when that fits the range the slot owns (:meth:`span`: kept by a
        shrink or trim after an outlier), with no address space used; else in a
        fresh range of the reservation (docs/design.md, "Growth").  Returns False
        when a fresh range was needed and the reservation is exhausted (slot
        unchanged).  Raises SlotStateError (not ASSIGNED) or OSError.
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
        kernel; the slot keeps its range (:meth:`span`), so growing it again later
        uses no address space.  Larger: as :meth:`grow`.  Returns False only when a
        grow finds the reservation exhausted (slot unchanged).
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
