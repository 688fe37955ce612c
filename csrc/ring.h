/*
 * mploader ring: a shared-memory region of fixed-count slots handed between one
 * parent process and its forked workers.  C11, no Python.h.
 *
 * Must match mploader/_ring.pxd.
 *
 * The slot protocol (states, who moves each edge, memory orders) is written down
 * once, in docs/design.md, section "Slot protocol"; comments here refer to its
 * edges as E1..E5.
 *
 * All functions are async-signal-unsafe but thread-safe in the sense of the
 * protocol: each edge has exactly one process allowed to take it.
 */
#ifndef MPLOADER_RING_H
#define MPLOADER_RING_H

#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Slot states (docs/design.md, "Slot protocol"). */
enum {
    MPL_FREE = 0,     /* owned by the parent's allocator */
    MPL_ASSIGNED = 1, /* handed to one worker, which may write the payload */
    MPL_READY = 2,    /* published by that worker; payload and header are final */
    MPL_LEASED = 3    /* read by the parent; returns to FREE when its lease dies */
};

/* What a READY slot carries (mpl_slot_meta.kind). */
enum {
    MPL_KIND_NONE = 0,
    MPL_KIND_SLOT = 1,  /* descriptor + arrays in the payload */
    MPL_KIND_PIPE = 2,  /* the batch follows on the worker's pipe */
    MPL_KIND_ERROR = 3  /* a pickled exception record in the payload */
};

/* Return codes besides 0. */
enum {
    MPL_OK = 0,
    MPL_ETIMEDOUT = -1, /* the wait ran out; state unchanged */
    MPL_ESTATE = -2,    /* the slot was not in the state this edge starts from */
    MPL_ENOSPACE = -3,  /* the region's reservation is exhausted */
    MPL_ESYS = -4,      /* a system call failed; errno says which */
    MPL_EINVAL = -5     /* argument out of range */
};

/* Header fields of one slot that are not atomics.  They are written only by the
 * process that holds the slot in the matching state and are published by the
 * release store of the state word that ends that state (docs/design.md). */
typedef struct mpl_slot_meta {
    uint64_t seq;        /* batch sequence number; written by the parent at E1 */
    uint64_t offset;     /* payload byte offset in the region; parent or worker (grow) */
    uint64_t capacity;   /* payload bytes available at offset */
    uint64_t used;       /* bytes the worker wrote, <= capacity; written at E2 */
    uint64_t desc_off;   /* descriptor offset within the payload */
    uint64_t desc_len;   /* descriptor length in bytes */
    uint32_t kind;       /* MPL_KIND_* */
    uint32_t flags;      /* worker's per-batch flags (MPL_FLAG_*) */
    int32_t worker_pid;  /* pid of the worker that published */
    uint32_t grow_count; /* how many times this slot was grown */
} mpl_slot_meta;

#define MPL_FLAG_GROWN 1u     /* the slot was grown for this batch */
#define MPL_FLAG_INBAND 2u    /* some leaf was pickled in-band (object dtype, ...) */

/* Process-local handle on a region.  The region itself (control block, slot
 * headers, payloads) is shared; this struct is per process and is copied into
 * workers by fork(). */
typedef struct mpl_region {
    uint8_t *base;          /* start of the mapping */
    uint64_t reserve_bytes; /* length of the mapping (address space reserved) */
    int fd;                 /* the memfd, or -1 once closed */
    uint32_t nslots;
} mpl_region;

/* Create a region of `nslots` slots with `slot_bytes` of payload each (0 allowed:
 * slots are then sized on first use by mpl_slot_grow), inside a mapping of
 * `reserve_bytes` of address space (0 picks 16 GiB; raised to at least 4x the
 * initial size).  All pages are faulted in.
 * On success returns 0 and fills *r; on failure returns MPL_ESYS or MPL_EINVAL
 * with errno set and leaves nothing behind. */
int mpl_region_create(mpl_region *r, uint32_t nslots, uint64_t slot_bytes,
                      uint64_t reserve_bytes);

/* Close the memfd (the mapping stays valid).  Idempotent. */
void mpl_region_close_fd(mpl_region *r);

/* Unmap the region and close the fd.  Idempotent. */
void mpl_region_unmap(mpl_region *r);

/* Fault in every allocated page of the region in this process (for workers after
 * fork, whose page tables start empty); holes left by mpl_slot_grow stay holes.
 * Returns 0 or MPL_ESYS. */
int mpl_region_populate(mpl_region *r);

/* Bytes of the memfd in use (its size), for stats. */
uint64_t mpl_region_file_bytes(const mpl_region *r);

/* Largest payload any worker has needed so far (a sizing hint, bytes). */
uint64_t mpl_region_size_hint(const mpl_region *r);
void mpl_region_note_size(mpl_region *r, uint64_t need);

/* ---- parent side ---- */

/* First slot at or after `start` (cyclically) whose state is FREE, or -1. */
int mpl_find_free(mpl_region *r, uint32_t start);

/* Edge E1, FREE -> ASSIGNED: claims the slot for batch `seq`.  Returns 0, or
 * MPL_ESTATE if the slot was not FREE. */
int mpl_slot_assign(mpl_region *r, uint32_t slot, uint64_t seq);

/* Wait until the slot is READY, at most timeout_ns nanoseconds (< 0: forever),
 * then take edge E3, READY -> LEASED.  Returns 0 (now LEASED), MPL_ETIMEDOUT,
 * MPL_ESTATE (slot neither ASSIGNED nor READY) or MPL_ESYS. */
int mpl_slot_wait(mpl_region *r, uint32_t slot, int64_t timeout_ns);

/* Edge E4, LEASED -> FREE.  Returns 0 or MPL_ESTATE. */
int mpl_slot_release(mpl_region *r, uint32_t slot);

/* Edge E5, ASSIGNED or READY -> FREE, for a batch the parent abandons after its
 * worker died (READY: it published, then died, and nobody will read it).
 * Returns 0 or MPL_ESTATE. */
int mpl_slot_reclaim(mpl_region *r, uint32_t slot);

/* Current state word (acquire load), for diagnostics and tests. */
uint32_t mpl_slot_state(const mpl_region *r, uint32_t slot);

/* Header of a slot.  Valid to read by the parent once mpl_slot_wait returned 0,
 * and by the worker while it holds the slot ASSIGNED. */
mpl_slot_meta *mpl_slot_meta_of(mpl_region *r, uint32_t slot);

/* Payload pointer of a slot (base + meta->offset). */
uint8_t *mpl_slot_payload(mpl_region *r, uint32_t slot);

/* ---- worker side ---- */

/* Check that the slot is ASSIGNED for batch `seq` (acquire load pairing with E1).
 * Returns 0 or MPL_ESTATE. */
int mpl_slot_begin(mpl_region *r, uint32_t slot, uint64_t seq);

/* Give an ASSIGNED slot a new payload range of at least `need` bytes, copying the
 * first min(preserve, need, old capacity) bytes of the old payload into it and
 * releasing the old range's memory.  Address space is never reused: a region
 * grown many times can exhaust its reservation although little memory is in use.
 * grow_count counts every grow of this slot since creation.  Returns 0,
 * MPL_ENOSPACE (reservation exhausted; the slot is unchanged), MPL_ESTATE (the
 * slot is not ASSIGNED) or MPL_ESYS. */
int mpl_slot_grow(mpl_region *r, uint32_t slot, uint64_t need, uint64_t preserve);

/* Edge E2, ASSIGNED -> READY: publish the header fields and payload written so
 * far, and wake the parent.  Returns 0, MPL_ESTATE (not ASSIGNED; the header is
 * left untouched) or MPL_EINVAL (used > capacity, or the descriptor outside
 * [0, used)). */
int mpl_slot_publish(mpl_region *r, uint32_t slot, uint32_t kind, uint32_t flags,
                     uint64_t used, uint64_t desc_off, uint64_t desc_len);

/* In a freshly forked worker: ask the kernel to send `sig` when the parent dies,
 * then exit at once if the parent (expected_ppid) is already gone.
 * Returns 0 or MPL_ESYS. */
int mpl_set_pdeathsig(int sig, pid_t expected_ppid);

#ifdef __cplusplus
}
#endif
#endif /* MPLOADER_RING_H */
