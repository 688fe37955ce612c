/*
 * mploader ring: the shared-memory slot region.  See ring.h for the API and
 * docs/design.md ("Slot protocol") for the state machine this file implements.
 *
 * Key invariant: a slot's payload and its non-atomic header fields (mpl_slot_meta)
 * are written by exactly one process at a time, the one the state word names:
 *   FREE, LEASED  -> the parent        ASSIGNED -> the one worker it was handed to
 *   READY         -> nobody writes; the parent reads after its acquire (E3).
 * Every hand-off of that write right is a release store (or release CAS) of the
 * state word, and every taking-over is an acquire load (or acquire CAS) of it, so
 * whatever the previous owner wrote is visible to the next one.
 *
 * Layout of the region (one memfd, mapped MAP_SHARED before fork):
 *   [mpl_ctl: 1 page][slot headers: nslots x 128 B, page-rounded][payloads ...]
 * Payload ranges are carved from the file by a bump allocator (ctl->file_end) so a
 * slot can be given a bigger range later (mpl_slot_grow) without moving the
 * mapping: the whole reservation is mapped once, the file only grows inside it,
 * and every process that inherited the mapping sees the new pages.
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MPL_MAGIC 0x6d706c72696e6731ull /* "mplring1" */
#define MPL_CACHE_LINE 64
#define MPL_PAGE 4096ull
#define MPL_DEFAULT_RESERVE (16ull << 30) /* 16 GiB of address space, not memory */
#define MPL_MAX_SLOTS 4096u

/* One slot header: the state word alone on the first cache line (the only word
 * both sides touch concurrently), the metadata on the second. */
typedef struct mpl_slot_hdr {
    _Alignas(MPL_CACHE_LINE) _Atomic uint32_t state;
    char pad_[MPL_CACHE_LINE - sizeof(uint32_t)];
    _Alignas(MPL_CACHE_LINE) mpl_slot_meta meta;
} mpl_slot_hdr;

_Static_assert(sizeof(mpl_slot_hdr) == 2 * MPL_CACHE_LINE, "slot header is two cache lines");

/* The control block at offset 0. */
typedef struct mpl_ctl {
    uint64_t magic;
    uint32_t nslots;
    uint32_t pad0_;
    uint64_t reserve_bytes;
    uint64_t headers_off;
    /* Bump allocator for payload ranges: the file's size.  Workers and the parent
     * allocate from it concurrently, so it is an atomic RMW counter on its own line. */
    _Alignas(MPL_CACHE_LINE) _Atomic uint64_t file_end;
    /* Largest payload any batch needed (a sizing hint for later slots). */
    _Alignas(MPL_CACHE_LINE) _Atomic uint64_t size_hint;
} mpl_ctl;

static inline mpl_ctl *ctl_of(const mpl_region *r) { return (mpl_ctl *)r->base; }

static inline mpl_slot_hdr *hdr_of(const mpl_region *r, uint32_t slot) {
    return (mpl_slot_hdr *)(r->base + ctl_of(r)->headers_off) + slot;
}

static inline uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    /* Shared (not FUTEX_PRIVATE) futexes: the word lives in a MAP_SHARED mapping
     * used by several processes. */
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Fault in [p, p+n) for writing in this process.  MADV_POPULATE_WRITE (Linux 5.14)
 * when available, else a touch loop (a read is not enough for shmem: it would map
 * the zero page). */
static int populate(uint8_t *p, uint64_t n) {
    if (n == 0)
        return MPL_OK;
#ifdef MADV_POPULATE_WRITE
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0)
        return MPL_OK;
    if (errno != EINVAL)
        return MPL_ESYS;
#endif
    for (uint64_t i = 0; i < n; i += MPL_PAGE) {
        /* Relaxed atomic add of 0: writes the page without changing its contents,
         * even if another process is writing it; ordering is irrelevant here. */
        atomic_fetch_add_explicit((_Atomic uint8_t *)(p + i), 0, memory_order_relaxed);
    }
    return MPL_OK;
}

/* Carve a page-aligned range of `n` bytes from the file and fault it in.  Returns
 * its offset, or 0 (never a valid payload offset) with *err set. */
static uint64_t carve(mpl_region *r, uint64_t n, int *err) {
    mpl_ctl *c = ctl_of(r);
    if (n > r->reserve_bytes) { /* also keeps round_up below from wrapping */
        *err = MPL_ENOSPACE;
        return 0;
    }
    n = round_up(n ? n : MPL_PAGE, MPL_PAGE);
    /* Relaxed CAS loop: the counter only has to hand out disjoint ranges, and only
     * ranges that fit the reservation (a refused request must not use it up); the
     * pages are published to other processes by the slot state word later. */
    uint64_t off = atomic_load_explicit(&c->file_end, memory_order_relaxed);
    do {
        if (off + n > r->reserve_bytes || off + n < off) {
            *err = MPL_ENOSPACE;
            return 0;
        }
    } while (!atomic_compare_exchange_weak_explicit(&c->file_end, &off, off + n, memory_order_relaxed,
                                                    memory_order_relaxed));
    /* Mode 0 extends the file when off+n is past its end and never shrinks it, so
     * concurrent carves in several processes cannot undo one another. */
    if (fallocate(r->fd, 0, (off_t)off, (off_t)n) != 0) {
        *err = MPL_ESYS;
        return 0;
    }
    if (populate(r->base + off, n) != MPL_OK) {
        *err = MPL_ESYS;
        return 0;
    }
    return off;
}

int mpl_region_create(mpl_region *r, uint32_t nslots, uint64_t slot_bytes, uint64_t reserve_bytes) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    /* Bound slot_bytes so that nslots * round_up(slot_bytes) * 4 cannot wrap. */
    if (nslots == 0 || nslots > MPL_MAX_SLOTS || slot_bytes > (UINT64_MAX / 8) / MPL_MAX_SLOTS) {
        errno = EINVAL;
        return MPL_EINVAL;
    }
    uint64_t headers_off = MPL_PAGE;
    uint64_t first_payload = round_up(headers_off + (uint64_t)nslots * sizeof(mpl_slot_hdr), MPL_PAGE);
    uint64_t slot_stride = round_up(slot_bytes, MPL_PAGE);
    uint64_t initial = first_payload + (uint64_t)nslots * slot_stride;
    if (reserve_bytes == 0)
        reserve_bytes = MPL_DEFAULT_RESERVE;
    if (reserve_bytes < 4 * initial)
        reserve_bytes = 4 * initial;
    reserve_bytes = round_up(reserve_bytes, MPL_PAGE);

    int fd = memfd_create("mploader-ring", MFD_CLOEXEC);
    if (fd < 0)
        return MPL_ESYS;
    uint8_t *base = mmap(NULL, reserve_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        close(fd);
        errno = e;
        return MPL_ESYS;
    }
    if (fallocate(fd, 0, 0, (off_t)initial) != 0 || populate(base, initial) != MPL_OK) {
        int e = errno;
        munmap(base, reserve_bytes);
        close(fd);
        errno = e;
        return MPL_ESYS;
    }
    r->base = base;
    r->reserve_bytes = reserve_bytes;
    r->fd = fd;
    r->nslots = nslots;

    /* Fresh memfd pages are zero: every state word already reads MPL_FREE.  No
     * other process exists yet (workers fork later), so plain initialisation is
     * enough; fork() itself orders it before anything a child does. */
    mpl_ctl *c = ctl_of(r);
    c->magic = MPL_MAGIC;
    c->nslots = nslots;
    c->reserve_bytes = reserve_bytes;
    c->headers_off = headers_off;
    atomic_init(&c->file_end, initial);
    atomic_init(&c->size_hint, slot_bytes);
    for (uint32_t i = 0; i < nslots; i++) {
        mpl_slot_hdr *h = hdr_of(r, i);
        atomic_init(&h->state, MPL_FREE);
        h->meta.offset = first_payload + (uint64_t)i * slot_stride;
        h->meta.capacity = slot_stride;
    }
    return MPL_OK;
}

void mpl_region_close_fd(mpl_region *r) {
    if (r->fd >= 0) {
        close(r->fd);
        r->fd = -1;
    }
}

void mpl_region_unmap(mpl_region *r) {
    mpl_region_close_fd(r);
    if (r->base) {
        munmap(r->base, r->reserve_bytes);
        r->base = NULL;
    }
}

int mpl_region_populate(mpl_region *r) {
    /* Walk the file's allocated ranges (SEEK_DATA/SEEK_HOLE) rather than [0,
     * file_end): ranges released by mpl_slot_grow are holes and must stay holes, and
     * file_end may already count a range another process has carved but not yet
     * fallocated (touching it would fault beyond the end of the file). */
    struct stat st;
    if (fstat(r->fd, &st) != 0)
        return MPL_ESYS;
    off_t size = st.st_size;
    if ((uint64_t)size > r->reserve_bytes)
        size = (off_t)r->reserve_bytes;
    off_t pos = 0;
    while (pos < size) {
        off_t data = lseek(r->fd, pos, SEEK_DATA);
        if (data < 0)
            return errno == ENXIO ? MPL_OK : MPL_ESYS;
        off_t hole = lseek(r->fd, data, SEEK_HOLE);
        if (hole < 0)
            return MPL_ESYS;
        if (hole > size)
            hole = size;
        if (data < hole && populate(r->base + data, (uint64_t)(hole - data)) != MPL_OK)
            return MPL_ESYS;
        pos = hole;
    }
    return MPL_OK;
}

uint64_t mpl_region_file_bytes(const mpl_region *r) {
    /* Relaxed: statistics only. */
    uint64_t end = atomic_load_explicit(&ctl_of(r)->file_end, memory_order_relaxed);
    return end > r->reserve_bytes ? r->reserve_bytes : end;
}

uint64_t mpl_region_size_hint(const mpl_region *r) {
    /* Relaxed: a hint; a stale value only costs one extra grow later. */
    return atomic_load_explicit(&ctl_of(r)->size_hint, memory_order_relaxed);
}

void mpl_region_note_size(mpl_region *r, uint64_t need) {
    mpl_ctl *c = ctl_of(r);
    /* Relaxed CAS loop implementing atomic max: only the value matters. */
    uint64_t cur = atomic_load_explicit(&c->size_hint, memory_order_relaxed);
    while (cur < need &&
           !atomic_compare_exchange_weak_explicit(&c->size_hint, &cur, need, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

/* ---- parent side ---- */

int mpl_find_free(mpl_region *r, uint32_t start) {
    for (uint32_t k = 0; k < r->nslots; k++) {
        uint32_t i = (start + k) % r->nslots;
        /* Acquire pairs with the release store of E4 (lease death, possibly on
         * another thread of the parent): the slot's previous use is over. */
        if (atomic_load_explicit(&hdr_of(r, i)->state, memory_order_acquire) == MPL_FREE)
            return (int)i;
    }
    return -1;
}

int mpl_slot_assign(mpl_region *r, uint32_t slot, uint64_t seq) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* E1.  Only one thread of the parent allocates (docs/design.md), and only it
     * moves a slot out of FREE, so a slot seen FREE stays FREE until we store.
     * Acquire pairs with E4's release: the slot's previous lease is over. */
    if (atomic_load_explicit(&h->state, memory_order_acquire) != MPL_FREE)
        return MPL_ESTATE;
    h->meta.seq = seq;
    h->meta.used = 0;
    h->meta.desc_off = 0;
    h->meta.desc_len = 0;
    h->meta.kind = MPL_KIND_NONE;
    h->meta.flags = 0;
    h->meta.worker_pid = 0;
    uint32_t expect = MPL_FREE;
    /* Release: publishes the header fields just written to the worker's acquire
     * load in mpl_slot_begin (the worker hears of the task through its pipe). */
    if (!atomic_compare_exchange_strong_explicit(&h->state, &expect, MPL_ASSIGNED, memory_order_release,
                                                 memory_order_relaxed))
        return MPL_ESTATE;
    return MPL_OK;
}

static int take_ready(mpl_slot_hdr *h) {
    uint32_t expect = MPL_READY;
    /* E3: acquire on success pairs with the worker's release store in E2 and makes
     * the payload and meta it wrote visible to the parent. */
    if (atomic_compare_exchange_strong_explicit(&h->state, &expect, MPL_LEASED, memory_order_acquire,
                                                memory_order_relaxed))
        return MPL_OK;
    return expect == MPL_ASSIGNED ? MPL_ETIMEDOUT : MPL_ESTATE;
}

int mpl_slot_wait(mpl_region *r, uint32_t slot, int64_t timeout_ns) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    int rc = take_ready(h);
    if (rc != MPL_ETIMEDOUT)
        return rc;
    struct timespec deadline, now, rel;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ns / 1000000000;
        deadline.tv_nsec += timeout_ns % 1000000000;
        if (deadline.tv_nsec >= 1000000000) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000;
        }
    }
    for (;;) {
        const struct timespec *tsp = NULL;
        if (timeout_ns >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            int64_t left = (int64_t)(deadline.tv_sec - now.tv_sec) * 1000000000 + (deadline.tv_nsec - now.tv_nsec);
            if (left <= 0)
                return MPL_ETIMEDOUT;
            rel.tv_sec = left / 1000000000;
            rel.tv_nsec = left % 1000000000;
            tsp = &rel;
        }
        /* Sleeps only while the word still reads ASSIGNED (the kernel compares
         * atomically with the sleep), so a publish between take_ready and here
         * cannot be missed. */
        if (futex(&h->state, FUTEX_WAIT, MPL_ASSIGNED, tsp) != 0 && errno != EAGAIN && errno != EINTR &&
            errno != ETIMEDOUT)
            return MPL_ESYS;
        rc = take_ready(h);
        if (rc != MPL_ETIMEDOUT)
            return rc;
    }
}

int mpl_slot_release(mpl_region *r, uint32_t slot) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    uint32_t expect = MPL_LEASED;
    /* E4: release on success publishes "every read of this payload is over" to the
     * allocator's acquire in mpl_find_free / mpl_slot_assign. */
    if (!atomic_compare_exchange_strong_explicit(&hdr_of(r, slot)->state, &expect, MPL_FREE, memory_order_release,
                                                 memory_order_relaxed))
        return MPL_ESTATE;
    return MPL_OK;
}

int mpl_slot_reclaim(mpl_region *r, uint32_t slot) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    uint32_t expect = MPL_ASSIGNED;
    /* E5: the worker holding the slot is dead (the parent reaped it first), so no
     * write can race; acq_rel orders any of its writes we might have observed. */
    if (atomic_compare_exchange_strong_explicit(&h->state, &expect, MPL_FREE, memory_order_acq_rel,
                                                memory_order_relaxed))
        return MPL_OK;
    /* A worker that published and then died: its batch is abandoned too. */
    expect = MPL_READY;
    if (atomic_compare_exchange_strong_explicit(&h->state, &expect, MPL_FREE, memory_order_acq_rel,
                                                memory_order_relaxed))
        return MPL_OK;
    return MPL_ESTATE;
}

uint32_t mpl_slot_state(const mpl_region *r, uint32_t slot) {
    /* Acquire: diagnostics read the meta after this, as the parent would. */
    return atomic_load_explicit(&hdr_of(r, slot)->state, memory_order_acquire);
}

mpl_slot_meta *mpl_slot_meta_of(mpl_region *r, uint32_t slot) { return &hdr_of(r, slot)->meta; }

uint8_t *mpl_slot_payload(mpl_region *r, uint32_t slot) { return r->base + hdr_of(r, slot)->meta.offset; }

/* ---- worker side ---- */

int mpl_slot_begin(mpl_region *r, uint32_t slot, uint64_t seq) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Acquire pairs with the parent's release store in mpl_slot_assign: the seq,
     * offset and capacity the parent wrote are visible from here on. */
    if (atomic_load_explicit(&h->state, memory_order_acquire) != MPL_ASSIGNED || h->meta.seq != seq)
        return MPL_ESTATE;
    return MPL_OK;
}

int mpl_slot_grow(mpl_region *r, uint32_t slot, uint64_t need, uint64_t preserve) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Acquire: the caller must hold the slot ASSIGNED (pairs with E1's release). */
    if (atomic_load_explicit(&h->state, memory_order_acquire) != MPL_ASSIGNED)
        return MPL_ESTATE;
    mpl_slot_meta *m = &h->meta;
    if (preserve > m->capacity)
        preserve = m->capacity;
    if (preserve > need)
        preserve = need;
    int err = MPL_OK;
    uint64_t off = carve(r, need, &err);
    if (off == 0)
        return err;
    if (preserve)
        memcpy(r->base + off, r->base + m->offset, preserve);
    /* Give the old range's memory back to the kernel; the file keeps its size. No
     * lease can point into it: leases only exist for LEASED slots, and this one is
     * ASSIGNED to us. */
    if (m->capacity)
        (void)fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)m->offset, (off_t)m->capacity);
    m->offset = off;
    m->capacity = round_up(need ? need : MPL_PAGE, MPL_PAGE);
    m->grow_count++;
    mpl_region_note_size(r, need);
    return MPL_OK;
}

int mpl_slot_publish(mpl_region *r, uint32_t slot, uint32_t kind, uint32_t flags, uint64_t used, uint64_t desc_off,
                     uint64_t desc_len) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Only the worker holding the slot ASSIGNED may write its header: check before
     * writing (acquire pairs with E1's release).  Nobody else can move the slot out
     * of ASSIGNED meanwhile except E5, which happens only after we are dead. */
    if (atomic_load_explicit(&h->state, memory_order_acquire) != MPL_ASSIGNED)
        return MPL_ESTATE;
    if (used > h->meta.capacity || desc_off > used || desc_len > used - desc_off)
        return MPL_EINVAL;
    h->meta.kind = kind;
    h->meta.flags = flags;
    h->meta.used = used;
    h->meta.desc_off = desc_off;
    h->meta.desc_len = desc_len;
    h->meta.worker_pid = (int32_t)getpid();
    uint32_t expect = MPL_ASSIGNED;
    /* E2: release on success publishes the payload and every meta field above to
     * the parent's acquire CAS in take_ready. */
    if (!atomic_compare_exchange_strong_explicit(&h->state, &expect, MPL_READY, memory_order_release,
                                                 memory_order_relaxed))
        return MPL_ESTATE;
    futex(&h->state, FUTEX_WAKE, 1, NULL);
    return MPL_OK;
}

int mpl_set_pdeathsig(int sig, pid_t expected_ppid) {
    if (prctl(PR_SET_PDEATHSIG, sig) != 0)
        return MPL_ESYS;
    /* The parent may have died between fork() and prctl(): then we were already
     * re-parented and no signal will come. */
    if (getppid() != expected_ppid)
        _exit(1);
    return MPL_OK;
}
