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

/* Slot states (docs/design.md, "Slot protocol"): the low byte of the state word. */
enum {
    MPL_FREE = 0,     /* owned by the parent's allocator */
    MPL_ASSIGNED = 1, /* handed to one worker, which may write the payload */
    MPL_READY = 2,    /* published by that worker; payload and header are final */
    MPL_LEASED = 3    /* read by the parent; returns to FREE when its lease dies */
};

/* Bits of the state word besides the state.  MPL_WAITER is set (only in state
 * ASSIGNED) by the parent before it sleeps on the word with FUTEX_WAIT; the
 * publishing worker makes the FUTEX_WAKE system call only when it finds the bit
 * set.  A slot that is READY before the parent looks costs no system call. */
#define MPL_STATE_MASK 0xffu
#define MPL_WAITER 0x100u

/* Limits (the Python layer checks user arguments against the same numbers). */
#define MPL_MAX_SLOTS 4096u
#define MPL_MAX_SLOT_BYTES (1ull << 40)     /* 1 TiB per slot */
#define MPL_MAX_RESERVE_BYTES (1ull << 46)  /* 64 TiB of address space (x86-64 user space is 128 TiB) */
#define MPL_DEFAULT_RESERVE_BYTES (16ull << 30)
#define MPL_MAGIC 0x6d706c72696e6731ull   /* "mplring1", first word of the control block */
#define MPL_LAYOUT_VERSION 4u               /* bump when mpl_ctl or the slot header changes */

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
    MPL_EINVAL = -5,    /* argument out of range (or, for attach, a control block field) */
    MPL_EMAGIC = -6,    /* attach/populate: the file does not start with the region's magic */
    MPL_EVERSION = -7,  /* attach/populate: written by another layout version of this library */
    MPL_ECORRUPT = -8   /* mpl_slot_take: the READY slot's header failed validation */
};

/* Which header field failed validation (mpl_slot_check, mpl_slot_take). */
enum {
    MPL_FIELD_NONE = 0,
    MPL_FIELD_KIND = 1,     /* not SLOT, PIPE or ERROR */
    MPL_FIELD_OFFSET = 2,   /* not page-aligned, inside the control block/headers, or past the file */
    MPL_FIELD_CAPACITY = 3, /* not page-aligned, or offset + capacity past the file or the reservation */
    MPL_FIELD_USED = 4,     /* used > capacity */
    MPL_FIELD_DESC_OFF = 5, /* desc_off > used */
    MPL_FIELD_DESC_LEN = 6, /* desc_off + desc_len > used */
    MPL_FIELD_UNCHECKED = 7 /* the range ends past the file size seen so far and the memfd is
                             * closed, so it cannot be checked (mpl_slot_take: MPL_ESYS, EBADF) */
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
    uint64_t payload_off;   /* first payload byte: the control block and headers lie below */
    _Atomic uint64_t seen_bytes; /* file size this process last saw (fstat); only grows;
                                  * read by the header range checks (mpl_slot_check_range) */
} mpl_region;

/* Create a region of `nslots` slots with `slot_bytes` of payload each (0 allowed:
 * slots are then sized on first use by mpl_slot_grow), inside a mapping of
 * `reserve_bytes` of address space (0 picks 16 GiB; raised to at least 4x the
 * initial size).  All pages are faulted in.  The memfd is close-on-exec and never
 * a standard stream (>= 3, mpl_fd_off_stdio).
 * On success returns 0 and fills *r; on failure returns MPL_EINVAL (nslots not in
 * 1..MPL_MAX_SLOTS, slot_bytes > MPL_MAX_SLOT_BYTES, reserve_bytes or 4x the initial
 * size > MPL_MAX_RESERVE_BYTES), MPL_ENOSPACE (the initial size exceeds physical
 * memory) or MPL_ESYS (errno set), and leaves r->fd == -1, r->base == NULL. */
int mpl_region_create(mpl_region *r, uint32_t nslots, uint64_t slot_bytes,
                      uint64_t reserve_bytes);

/* Map an existing region from its memfd `fd` (a spawned worker that received it).
 * Reads the control block with pread first (no mapping of a file that is not a
 * region), checks magic, layout version and layout fields, then maps a duplicate
 * of fd (F_DUPFD_CLOEXEC, >= 3; the caller keeps and closes its own fd).
 * On success returns 0 and fills *r.  On failure leaves r->fd == -1, r->base ==
 * NULL and returns MPL_EMAGIC (*found_magic set), MPL_EVERSION (*found_version
 * set), MPL_EINVAL (nslots/reserve/headers fields out of range, or the file is
 * shorter than the headers) or MPL_ESYS (errno). */
int mpl_region_attach(mpl_region *r, int fd, uint64_t *found_magic, uint32_t *found_version);

/* Close the memfd (the mapping stays valid).  Idempotent. */
void mpl_region_close_fd(mpl_region *r);

/* Unmap the region and close the fd.  Idempotent. */
void mpl_region_unmap(mpl_region *r);

/* Fault in every allocated page of the region in this process (for workers after
 * fork, whose page tables start empty); holes left by mpl_slot_grow stay holes.
 * Checks the control block's magic and layout version first.
 * Returns 0, MPL_EMAGIC, MPL_EVERSION or MPL_ESYS. */
int mpl_region_populate(mpl_region *r);

/* Bytes of the memfd in use (its size), for stats. */
uint64_t mpl_region_file_bytes(const mpl_region *r);

/* Largest payload any worker has needed so far (a sizing hint, bytes). */
uint64_t mpl_region_size_hint(const mpl_region *r);
/* Raise the hint to `need` (atomic max). */
void mpl_region_note_size(mpl_region *r, uint64_t need);
/* Set the hint to `n`, lower or higher (the outlier policy lowers it). */
void mpl_region_set_size_hint(mpl_region *r, uint64_t n);

/* Mark the region's pages as possibly page-locked by someone else (the pinning
 * module's cudaHostRegister): the pin holds the physical pages it found, so a
 * page punched out and faulted in again would no longer be the page the device
 * reads.  From then on mpl_slot_grow never faults in a punched range again: a slot
 * that needs more than its capacity takes a fresh range of the reservation (its
 * span is not reused), as before spans existed.  Call it in the parent before the
 * first page is registered; idempotent, cannot fail. */
void mpl_region_set_pinned(mpl_region *r);
/* 1 once mpl_region_set_pinned was called (in any process), else 0. */
int mpl_region_pinned(const mpl_region *r);

/* How many FUTEX_WAKE calls publishers of this region made (statistics, tests). */
uint64_t mpl_region_wake_count(const mpl_region *r);

/* This process's pid, cached (refreshed in the child by a pthread_atfork handler,
 * so it is right after fork() without a getpid() system call per batch). */
pid_t mpl_self_pid(void);

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

/* Wait as mpl_slot_wait -- after spinning up to spin_ns (bounded by the timeout)
 * on the state word without announcing a waiter, for callers with a spare core --
 * take E3, copy the header into *snap and validate it
 * (mpl_slot_check).  Returns 0 (LEASED, *snap valid), MPL_ETIMEDOUT, MPL_ESTATE,
 * MPL_ESYS (EBADF: a grown range cannot be checked because the memfd is closed;
 * the slot is returned to FREE), or MPL_ECORRUPT: *bad_field names the field (snap holds the bad
 * values); the slot's payload range is reset to empty if offset or capacity was
 * bad, and the slot is returned to FREE (E4), so nothing leaks and the next batch
 * in it gets a fresh range from its worker's grow. */
int mpl_slot_take(mpl_region *r, uint32_t slot, int64_t timeout_ns, int64_t spin_ns, mpl_slot_meta *snap,
                  uint32_t *bad_field);

/* Check a payload range for this process's mapping: page-aligned, inside
 * [payload_off, file size) and the reservation (fstat when it ends past the size
 * seen so far).  Returns MPL_FIELD_NONE, MPL_FIELD_OFFSET, MPL_FIELD_CAPACITY or
 * MPL_FIELD_UNCHECKED (memfd closed). */
uint32_t mpl_slot_check_range(mpl_region *r, uint64_t offset, uint64_t capacity);

/* Validate a header copy for reading through this process's mapping: kind, page
 * alignment, payload range inside [payload_off, file size) and the reservation,
 * used <= capacity, the descriptor inside [0, used).  May fstat the memfd once
 * when the range ends past the file size seen so far (growth).  Returns
 * MPL_FIELD_NONE or the first bad MPL_FIELD_*. */
uint32_t mpl_slot_check(mpl_region *r, const mpl_slot_meta *m);

/* Edge E4, LEASED -> FREE.  Returns 0 or MPL_ESTATE. */
int mpl_slot_release(mpl_region *r, uint32_t slot);

/* Edge E5, ASSIGNED or READY -> FREE, for a batch the parent abandons after its
 * worker died (READY: it published, then died, and nobody will read it).
 * Returns 0 or MPL_ESTATE. */
int mpl_slot_reclaim(mpl_region *r, uint32_t slot);

/* Current state (acquire load, MPL_WAITER masked off), for diagnostics and tests. */
uint32_t mpl_slot_state(const mpl_region *r, uint32_t slot);
/* The raw state word, waiter bit included (tests). */
uint32_t mpl_slot_word(const mpl_region *r, uint32_t slot);

/* Header of a slot.  Valid to read by the parent once mpl_slot_wait returned 0,
 * and by the worker while it holds the slot ASSIGNED. */
mpl_slot_meta *mpl_slot_meta_of(mpl_region *r, uint32_t slot);

/* Bytes of address space the slot owns at meta->offset (its span, >= capacity;
 * docs/design.md, "Growth").  Read by the holder of the slot's write right, and by
 * tests. */
uint64_t mpl_slot_span(const mpl_region *r, uint32_t slot);

/* Payload pointer of a slot (base + meta->offset). */
uint8_t *mpl_slot_payload(mpl_region *r, uint32_t slot);

/* ---- worker side ---- */

/* Check that the slot is ASSIGNED for batch `seq` (acquire load pairing with E1)
 * and that its payload range is sane (mpl_slot_check_range).  Returns 0,
 * MPL_ESTATE, or MPL_ECORRUPT: the range was bad and has been reset to empty
 * (offset payload_off, capacity 0; mpl_slot_grow still works). */
int mpl_slot_begin(mpl_region *r, uint32_t slot, uint64_t seq);

/* Give an ASSIGNED slot a payload of round_up(need, page) bytes (a page for 0)
 * whose first min(preserve, need, old capacity) bytes are those of the old payload
 * (docs/design.md, "Growth").  In place when that fits the address range the slot
 * owns (its span: what it was last given, kept by mpl_slot_shrink, mpl_slot_trim and
 * a smaller grow): the added pages are allocated and faulted in, pages past the new
 * capacity are given back, offset stays, no address space is used.  Otherwise a
 * range is taken from the region's pool of spare ranges (the shortest of at least
 * the new capacity and at most twice what would be carved), else carved from the
 * reservation -- the new capacity, or 1.5 x the old span where that is more and
 * fits (the part past the capacity left as holes) -- the preserved bytes copied
 * into it, and the old range's memory released and its address space put into the
 * pool.  So address space follows the largest payloads held at the same time, not
 * the number of grows.  In a pinned region (mpl_region_set_pinned) only a smaller
 * grow stays in place, the pool is not used, and a fresh range is exactly the new
 * capacity.
 * grow_count counts every grow of this slot since creation.  Returns 0,
 * MPL_ENOSPACE (a fresh range was needed and the reservation is exhausted; the slot
 * is unchanged), MPL_ESTATE (the slot is not ASSIGNED) or MPL_ESYS (errno set; the
 * slot is unchanged). */
int mpl_slot_grow(mpl_region *r, uint32_t slot, uint64_t need, uint64_t preserve);

/* Shrink an ASSIGNED slot's payload in place to round_up(need, page) bytes (0
 * allowed), returning the tail's memory to the kernel (FALLOC_FL_PUNCH_HOLE).  The
 * first `need` bytes stay where they are; no address space is used, and the slot
 * keeps its whole range (span), so a later mpl_slot_grow up to the span happens in
 * place.  A `need` at or above the capacity changes nothing.  Returns 0, MPL_ESTATE
 * (not ASSIGNED) or MPL_ESYS (errno set; the slot is unchanged). */
int mpl_slot_shrink(mpl_region *r, uint32_t slot, uint64_t need);

/* Parent side, on a FREE slot (docs/design.md, "Slot protocol", trim): give the
 * memory of the payload's pages beyond round_up(keep, page) bytes back to the kernel
 * (FALLOC_FL_PUNCH_HOLE).  Offset and capacity stay: no address space is used when
 * the next batch is written there, its pages are allocated again as they are
 * touched (and read as zero until then).  Only the region's creator may call it: FREE
 * slots belong to it, and no worker touches a slot before E1.  A `keep` at or above
 * the capacity changes nothing.  Returns 0, MPL_EINVAL (slot out of range),
 * MPL_ESTATE (not FREE; nothing changed) or MPL_ESYS (errno set). */
int mpl_slot_trim(mpl_region *r, uint32_t slot, uint64_t keep);

/* Parent side, on a FREE slot, as mpl_slot_trim: give the slot's whole range back --
 * its pages to the kernel, its address space to the region's pool of spare ranges,
 * where the next grow of any slot that needs a fresh range finds it (docs/design.md,
 * "Growth") -- and leave the slot empty (capacity 0; its next worker grows it).  For
 * a slot that held an outlier: its range serves the next outlier wherever it lands.
 * Only the region's creator may call it.  Returns 0, MPL_EINVAL (slot out of range),
 * MPL_ESTATE (not FREE, or the region is pinned; nothing changed) or MPL_ESYS (errno
 * set; the slot is unchanged). */
int mpl_slot_park(mpl_region *r, uint32_t slot);

/* Edge E2, ASSIGNED -> READY: publish the header fields and payload written so
 * far, and wake the parent if it sleeps on the slot (MPL_WAITER).  Returns 0, MPL_ESTATE (not ASSIGNED; the header is
 * left untouched) or MPL_EINVAL (used > capacity, or the descriptor outside
 * [0, used)). */
int mpl_slot_publish(mpl_region *r, uint32_t slot, uint32_t kind, uint32_t flags,
                     uint64_t used, uint64_t desc_off, uint64_t desc_len);

/* In a worker: watch the parent *process* `parent_pid` (not the thread that forked
 * us, unlike PR_SET_PDEATHSIG) through a pidfd polled by a detached thread, which
 * SIGKILLs this process as soon as the parent has exited.  Exits at once (_exit(1))
 * if the parent is already gone.
 * `lifeline_fd`: -1, or the read end of a pipe whose write end only the parent holds
 * (the caller has closed every copy of the write end in this process).  Where
 * pidfd_open is refused (mpl_pidfd_refused: seccomp, a kernel before 5.3) the thread
 * polls a duplicate of it instead (>= 3, close-on-exec; the caller keeps and closes
 * its own): EOF or POLLHUP when the parent has died; where the parent is our parent,
 * also every 250 ms whether getppid() still returns it (a copy of the write end in
 * some other child of the parent then delays nothing).
 * Returns 0, or MPL_ESYS (errno set: pidfd_open's when it failed otherwise, or was
 * refused and lifeline_fd is -1; fcntl's, malloc's or pthread_create's). */
int mpl_watch_parent(pid_t parent_pid, int lifeline_fd);

/* A pidfd of process `pid` (pidfd_open), moved off the standard streams
 * (mpl_fd_off_stdio), close-on-exec.  The environment variable
 * MPLOADER_TEST_REFUSE_PIDFD (tests only) simulates a refusal: "EPERM" gives EPERM,
 * any other non-empty value ENOSYS.
 * On success returns the descriptor (>= 3); on failure -1, errno set. */
int mpl_pidfd_open(pid_t pid);

/* 1 if `err` (an errno of pidfd_open) means the call is refused here -- ENOSYS,
 * EPERM, EACCES (seccomp filters, kernels before 5.3) -- rather than failed. */
int mpl_pidfd_refused(int err);

/* Keep a new descriptor off the standard streams: where `fd` is 0, 1 or 2 (a
 * process started with them closed hands them out first, and a print would then
 * write into the ring or a pipe), move it to the lowest free descriptor >= 3,
 * close-on-exec (F_DUPFD_CLOEXEC), and close `fd`.
 * On success returns a descriptor >= 3 (`fd` itself, unchanged, if it was >= 3, or
 * `fd` if it was negative); on failure returns -1, errno set (EMFILE), and `fd` is
 * closed. */
int mpl_fd_off_stdio(int fd);

#ifdef __cplusplus
}
#endif
#endif /* MPLOADER_RING_H */
