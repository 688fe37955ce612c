# Included by _ring.pyx: the SlotLease class and the CorruptSlotError message.


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
    E4), in the process that created the region only -- or, where the region has a
    ``release_hook``, the hook is called with the slot and owes ``Region.release``.
    """

    def __cinit__(self):
        self.region = None
        self.held = False
        self.ptr = NULL
        self.exports = 0
        global _live_leases
        _live_leases += 1

    def __init__(self, *args, **kwargs):
        raise TypeError("SlotLease objects are made by Region.wait(), not directly")

    def __dealloc__(self):
        global _live_leases
        _live_leases -= 1
        if (self.held and self.region is not None and self.region.r.base != NULL
                and self.region.owner_pid == mpl_self_pid()):
            hook = self.region.release_hook
            if hook is not None:
                try:
                    hook(self.slot_)  # now owes Region.release(slot) (pinned memory: after the GPU's reads)
                    return
                except BaseException:  # noqa: BLE001 - never lose a slot: release it now
                    pass
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
