# Declarations of csrc/ring.h (declarations only; keep in sync with that file).
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t

cdef extern from "sys/types.h":
    ctypedef int pid_t

cdef extern from "ring.h" nogil:
    enum:
        MPL_FREE
        MPL_ASSIGNED
        MPL_READY
        MPL_LEASED
    enum:
        MPL_KIND_NONE
        MPL_KIND_SLOT
        MPL_KIND_PIPE
        MPL_KIND_ERROR
    enum:
        MPL_OK
        MPL_ETIMEDOUT
        MPL_ESTATE
        MPL_ENOSPACE
        MPL_ESYS
        MPL_EINVAL
        MPL_EMAGIC
        MPL_EVERSION
        MPL_ECORRUPT
    enum:
        MPL_FIELD_NONE
        MPL_FIELD_KIND
        MPL_FIELD_OFFSET
        MPL_FIELD_CAPACITY
        MPL_FIELD_USED
        MPL_FIELD_DESC_OFF
        MPL_FIELD_DESC_LEN
        MPL_FIELD_UNCHECKED
    enum:
        MPL_FLAG_GROWN
        MPL_FLAG_INBAND
        MPL_STATE_MASK
        MPL_WAITER
        MPL_MAX_SLOTS
        MPL_LAYOUT_VERSION
    const uint64_t MPL_MAX_SLOT_BYTES
    const uint64_t MPL_MAX_RESERVE_BYTES
    const uint64_t MPL_DEFAULT_RESERVE_BYTES
    const uint64_t MPL_MAGIC

    ctypedef struct mpl_slot_meta:
        uint64_t seq
        uint64_t offset
        uint64_t capacity
        uint64_t used
        uint64_t desc_off
        uint64_t desc_len
        uint32_t kind
        uint32_t flags
        int32_t worker_pid
        uint32_t grow_count

    ctypedef struct mpl_region:
        uint8_t *base
        uint64_t reserve_bytes
        int fd
        uint32_t nslots
        uint64_t payload_off
        uint64_t seen_bytes

    int mpl_region_create(mpl_region *r, uint32_t nslots, uint64_t slot_bytes, uint64_t reserve_bytes)
    int mpl_region_attach(mpl_region *r, int fd, uint64_t *found_magic, uint32_t *found_version)
    void mpl_region_close_fd(mpl_region *r)
    void mpl_region_unmap(mpl_region *r)
    int mpl_region_populate(mpl_region *r)
    uint64_t mpl_region_file_bytes(const mpl_region *r)
    uint64_t mpl_region_size_hint(const mpl_region *r)
    void mpl_region_note_size(mpl_region *r, uint64_t need)
    void mpl_region_set_size_hint(mpl_region *r, uint64_t n)
    uint64_t mpl_region_wake_count(const mpl_region *r)
    void mpl_region_set_pinned(mpl_region *r)
    int mpl_region_pinned(const mpl_region *r)
    pid_t mpl_self_pid()
    int mpl_find_free(mpl_region *r, uint32_t start)
    int mpl_slot_assign(mpl_region *r, uint32_t slot, uint64_t seq)
    int mpl_slot_wait(mpl_region *r, uint32_t slot, int64_t timeout_ns)
    int mpl_slot_take(mpl_region *r, uint32_t slot, int64_t timeout_ns, int64_t spin_ns,
                      mpl_slot_meta *snap, uint32_t *bad_field)
    uint32_t mpl_slot_check(mpl_region *r, const mpl_slot_meta *m)
    uint32_t mpl_slot_check_range(mpl_region *r, uint64_t offset, uint64_t capacity)
    int mpl_slot_release(mpl_region *r, uint32_t slot)
    int mpl_slot_reclaim(mpl_region *r, uint32_t slot)
    uint32_t mpl_slot_state(const mpl_region *r, uint32_t slot)
    uint32_t mpl_slot_word(const mpl_region *r, uint32_t slot)
    mpl_slot_meta *mpl_slot_meta_of(mpl_region *r, uint32_t slot)
    uint64_t mpl_slot_span(const mpl_region *r, uint32_t slot)
    uint8_t *mpl_slot_payload(mpl_region *r, uint32_t slot)
    int mpl_slot_begin(mpl_region *r, uint32_t slot, uint64_t seq)
    int mpl_slot_grow(mpl_region *r, uint32_t slot, uint64_t need, uint64_t preserve)
    int mpl_slot_shrink(mpl_region *r, uint32_t slot, uint64_t need)
    int mpl_slot_trim(mpl_region *r, uint32_t slot, uint64_t keep)
    int mpl_slot_park(mpl_region *r, uint32_t slot)
    int mpl_slot_publish(mpl_region *r, uint32_t slot, uint32_t kind, uint32_t flags,
                         uint64_t used, uint64_t desc_off, uint64_t desc_len)
    int mpl_watch_parent(pid_t parent_pid, int lifeline_fd)
    int mpl_pidfd_open(pid_t pid)
    int mpl_pidfd_refused(int err)
    int mpl_fd_off_stdio(int fd)


cdef class Region:
    cdef mpl_region r
    cdef readonly long owner_pid
    cdef readonly bint closed
    cdef readonly bint attached
    cdef public object release_hook
    cdef int _check(self, uint32_t slot) except -1
    cdef int _not_owner(self, str what, str short, str action) except -1
    cdef int _fail(self, int rc, str what, uint32_t slot=*) except -1


cdef class SlotLease:
    cdef Region region
    cdef uint32_t slot_
    cdef bint held
    cdef uint8_t *ptr
    cdef mpl_slot_meta m
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef readonly long exports
