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
 * The state word also carries MPL_WAITER (ring.h): set by the parent, in state
 * ASSIGNED, before it sleeps in FUTEX_WAIT; the worker's E2 is a CAS that reads the
 * word it replaces, so it sees the bit exactly when the parent may be asleep and
 * only then makes the FUTEX_WAKE system call.  Both are read-modify-writes of the
 * same word, so one of the two always observes the other (no lost wake-up).
 *
 * The region itself (create/attach/populate, the layout, the bump allocator) is in
 * region.c; the cached pid and the parent watch in proc.c.
 */
#define _GNU_SOURCE
#include "ring_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    /* Shared (not FUTEX_PRIVATE) futexes: the word lives in a MAP_SHARED mapping
     * used by several processes. */
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* ---- parent side ---- */

int mpl_find_free(mpl_region *r, uint32_t start) {
    for (uint32_t k = 0; k < r->nslots; k++) {
        uint32_t i = (start + k) % r->nslots;
        /* Acquire pairs with the release CAS of E4 (lease death, possibly on
         * another thread of the parent): the slot's previous use is over.  A FREE
         * word never carries MPL_WAITER. */
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
    /* E3: acquire on success pairs with the worker's release CAS in E2 and makes
     * the payload and meta it wrote visible to the parent.  (A READY word never
     * carries MPL_WAITER: E2 stores plain READY.) */
    if (atomic_compare_exchange_strong_explicit(&h->state, &expect, MPL_LEASED, memory_order_acquire,
                                                memory_order_relaxed))
        return MPL_OK;
    return (expect & MPL_STATE_MASK) == MPL_ASSIGNED ? MPL_ETIMEDOUT : MPL_ESTATE;
}

static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int wait_ready(mpl_slot_hdr *h, int64_t timeout_ns, int64_t spin_ns) {
    int rc = take_ready(h);
    if (rc != MPL_ETIMEDOUT || timeout_ns == 0)
        return rc;
    int64_t start = mono_ns();
    int64_t deadline = timeout_ns > 0 ? start + timeout_ns : INT64_MAX;
    if (spin_ns > 0) {
        /* Spin first (only worth it with a spare core: the caller decides), without
         * the waiter bit, so a publish during the spin costs the worker no wake. */
        int64_t spin_end = spin_ns < deadline - start ? start + spin_ns : deadline;
        do {
            for (int i = 0; i < 64; i++) {
                /* Relaxed: only a hint to try the acquire CAS of take_ready. */
                uint32_t w = atomic_load_explicit(&h->state, memory_order_relaxed);
                if ((w & MPL_STATE_MASK) != MPL_ASSIGNED) {
                    rc = take_ready(h);
                    if (rc != MPL_ETIMEDOUT)
                        return rc;
                }
                cpu_relax();
            }
        } while (mono_ns() < spin_end);
    }
    for (;;) {
        struct timespec rel;
        const struct timespec *tsp = NULL;
        if (timeout_ns > 0) {
            int64_t left = deadline - mono_ns();
            if (left <= 0)
                return MPL_ETIMEDOUT;
            rel.tv_sec = left / 1000000000;
            rel.tv_nsec = left % 1000000000;
            tsp = &rel;
        }
        /* Announce the sleeper: ASSIGNED -> ASSIGNED|WAITER.  Relaxed: the bit
         * carries no data; what matters is that this RMW and the worker's E2 CAS
         * are ordered in the word's modification order, so either E2 came first
         * (this CAS fails, we see READY below) or E2 reads the bit and wakes us. */
        uint32_t cur = MPL_ASSIGNED;
        if (atomic_compare_exchange_strong_explicit(&h->state, &cur, MPL_ASSIGNED | MPL_WAITER,
                                                    memory_order_relaxed, memory_order_relaxed) ||
            cur == (MPL_ASSIGNED | MPL_WAITER)) {
            /* Sleeps only while the word still reads ASSIGNED|WAITER (the kernel
             * compares atomically with the sleep), so a publish between the CAS
             * and here cannot be missed. */
            if (futex(&h->state, FUTEX_WAIT, MPL_ASSIGNED | MPL_WAITER, tsp) != 0 && errno != EAGAIN &&
                errno != EINTR && errno != ETIMEDOUT)
                return MPL_ESYS;
        }
        rc = take_ready(h);
        if (rc != MPL_ETIMEDOUT)
            return rc;
    }
}

int mpl_slot_wait(mpl_region *r, uint32_t slot, int64_t timeout_ns) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    return wait_ready(hdr_of(r, slot), timeout_ns, 0);
}

uint32_t mpl_slot_check_range(mpl_region *r, uint64_t offset, uint64_t capacity) {
    if (offset % MPL_PAGE != 0 || offset < r->payload_off || offset > r->reserve_bytes)
        return MPL_FIELD_OFFSET;
    if (capacity % MPL_PAGE != 0 || capacity > r->reserve_bytes - offset)
        return MPL_FIELD_CAPACITY;
    uint64_t end = offset + capacity;
    /* Relaxed: a process-local high-water mark of a size that only grows; a stale
     * value only costs one fstat. */
    uint64_t seen = atomic_load_explicit(&r->seen_bytes, memory_order_relaxed);
    if (end > seen) {
        /* The file only grows (fallocate mode 0; holes keep its size), and a worker
         * fallocates a range before publishing it: read the true size from the
         * kernel, not from the shared control block a stray writer could change. */
        struct stat st;
        if (r->fd < 0)
            return MPL_FIELD_UNCHECKED;
        if (fstat(r->fd, &st) == 0 && (uint64_t)st.st_size > seen) {
            seen = (uint64_t)st.st_size;
            /* Relaxed store: see above (racing updaters store sizes that are all true). */
            atomic_store_explicit(&r->seen_bytes, seen, memory_order_relaxed);
        }
        if (offset > seen)
            return MPL_FIELD_OFFSET;
        if (end > seen)
            return MPL_FIELD_CAPACITY;
    }
    return MPL_FIELD_NONE;
}

uint32_t mpl_slot_check(mpl_region *r, const mpl_slot_meta *m) {
    if (m->kind != MPL_KIND_SLOT && m->kind != MPL_KIND_PIPE && m->kind != MPL_KIND_ERROR)
        return MPL_FIELD_KIND;
    uint32_t bad = mpl_slot_check_range(r, m->offset, m->capacity);
    if (bad != MPL_FIELD_NONE)
        return bad;
    if (m->used > m->capacity)
        return MPL_FIELD_USED;
    if (m->desc_off > m->used)
        return MPL_FIELD_DESC_OFF;
    if (m->desc_len > m->used - m->desc_off)
        return MPL_FIELD_DESC_LEN;
    return MPL_FIELD_NONE;
}

int mpl_slot_take(mpl_region *r, uint32_t slot, int64_t timeout_ns, int64_t spin_ns, mpl_slot_meta *snap,
                  uint32_t *bad_field) {
    *bad_field = MPL_FIELD_NONE;
    if (slot >= r->nslots)
        return MPL_EINVAL;
    int rc = wait_ready(hdr_of(r, slot), timeout_ns, spin_ns);
    if (rc != MPL_OK)
        return rc;
    /* LEASED: the header is ours (E3's acquire made the worker's writes visible);
     * a stray writer could still change it, so check the copy we will use. */
    mpl_slot_hdr *h = hdr_of(r, slot);
    *snap = h->meta;
    uint32_t bad = mpl_slot_check(r, snap);
    if (bad == MPL_FIELD_NONE)
        return MPL_OK;
    if (bad == MPL_FIELD_UNCHECKED) {
        (void)mpl_slot_release(r, slot); /* E4: not read, given back as it is */
        errno = EBADF;
        return MPL_ESYS;
    }
    *bad_field = bad;
    if (bad == MPL_FIELD_OFFSET || bad == MPL_FIELD_CAPACITY) {
        /* The range cannot be trusted (nor given back): start the slot over empty;
         * its next worker grows it.  Offset payload_off with capacity 0 is valid. */
        h->meta.offset = r->payload_off;
        h->meta.capacity = 0;
        h->span = 0;
    }
    h->meta.used = 0;
    h->meta.desc_off = 0;
    h->meta.desc_len = 0;
    h->meta.kind = MPL_KIND_NONE;
    (void)mpl_slot_release(r, slot); /* E4: the header writes above are published by it */
    return MPL_ECORRUPT;
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
    /* E5: the worker holding the slot is dead (the parent reaped it first), so no
     * write can race; acquire load and acq_rel CAS order any of its writes we might
     * have observed.  ASSIGNED may carry MPL_WAITER (a wait that timed out). */
    uint32_t cur = atomic_load_explicit(&h->state, memory_order_acquire);
    for (;;) {
        uint32_t st = cur & MPL_STATE_MASK;
        if (st != MPL_ASSIGNED && st != MPL_READY) /* READY: published, then died; abandoned too */
            return MPL_ESTATE;
        if (atomic_compare_exchange_weak_explicit(&h->state, &cur, MPL_FREE, memory_order_acq_rel,
                                                  memory_order_acquire))
            return MPL_OK;
    }
}

uint32_t mpl_slot_state(const mpl_region *r, uint32_t slot) {
    /* Acquire: diagnostics read the meta after this, as the parent would. */
    return atomic_load_explicit(&hdr_of(r, slot)->state, memory_order_acquire) & MPL_STATE_MASK;
}

uint32_t mpl_slot_word(const mpl_region *r, uint32_t slot) {
    /* Relaxed: tests look at the bits only. */
    return atomic_load_explicit(&hdr_of(r, slot)->state, memory_order_relaxed);
}

mpl_slot_meta *mpl_slot_meta_of(mpl_region *r, uint32_t slot) { return &hdr_of(r, slot)->meta; }

uint64_t mpl_slot_span(const mpl_region *r, uint32_t slot) { return hdr_of(r, slot)->span; }

uint8_t *mpl_slot_payload(mpl_region *r, uint32_t slot) { return r->base + hdr_of(r, slot)->meta.offset; }

/* ---- worker side ---- */

int mpl_slot_begin(mpl_region *r, uint32_t slot, uint64_t seq) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Acquire pairs with the parent's release CAS in mpl_slot_assign: the seq,
     * offset and capacity the parent wrote are visible from here on. */
    uint32_t st = atomic_load_explicit(&h->state, memory_order_acquire) & MPL_STATE_MASK;
    if (st != MPL_ASSIGNED || h->meta.seq != seq)
        return MPL_ESTATE;
    /* Writing through a range a stray writer changed would crash the worker (SIGBUS
     * past the file) or overwrite memory outside the slot: check it; reset a bad one
     * to empty (we hold the slot, so the header is ours to write) so the worker can
     * still grow the slot and report. */
    if (mpl_slot_check_range(r, h->meta.offset, h->meta.capacity) != MPL_FIELD_NONE) {
        h->meta.offset = r->payload_off;
        h->meta.capacity = 0;
        h->span = 0;
        return MPL_ECORRUPT;
    }
    return MPL_OK;
}

static int held_assigned(mpl_slot_hdr *h) {
    /* Acquire: the caller must hold the slot ASSIGNED (pairs with E1's release). */
    return (atomic_load_explicit(&h->state, memory_order_acquire) & MPL_STATE_MASK) == MPL_ASSIGNED;
}

/* The range the slot owns, for a grow in place: its span when that is a sane range
 * of this mapping (a stray writer may have changed it; then only the capacity, which
 * mpl_slot_begin checked, is trusted), and never more than the capacity in a pinned
 * region.  The caller holds the slot ASSIGNED. */
static uint64_t own_span(mpl_region *r, const mpl_slot_hdr *h, int pinned) {
    const mpl_slot_meta *m = &h->meta;
    if (pinned)
        return m->capacity;
    uint64_t span = h->span;
    if (span <= m->capacity || span % MPL_PAGE != 0 ||
        mpl_slot_check_range(r, m->offset, span) != MPL_FIELD_NONE)
        return m->capacity;
    return span;
}

int mpl_slot_grow(mpl_region *r, uint32_t slot, uint64_t need, uint64_t preserve) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    if (!held_assigned(h))
        return MPL_ESTATE;
    mpl_slot_meta *m = &h->meta;
    if (need > r->reserve_bytes) /* no range can hold it; also keeps round_up from wrapping */
        return MPL_ENOSPACE;
    uint64_t cap = round_up(need ? need : MPL_PAGE, MPL_PAGE);
    /* Acquire: pairs with the release store of mpl_region_set_pinned, which the
     * parent makes before it registers the first page (region.c). */
    int pinned = (int)atomic_load_explicit(&ctl_of(r)->pinned, memory_order_acquire);
    uint64_t span = own_span(r, h, pinned);
    if (cap <= span) {
        /* In place (docs/design.md, "Growth"): [offset, offset + span) is ours and
         * inside the file (own_span checked it against the file's size), so mode 0
         * allocates the holes past the capacity and never extends the file; the first
         * min(capacity, cap) bytes, hence the preserved ones, do not move. */
        if (cap > m->capacity) {
            uint64_t from = m->offset + m->capacity, n = cap - m->capacity;
            if (fallocate(r->fd, 0, (off_t)from, (off_t)n) != 0)
                return MPL_ESYS;
            if (mpl__populate(r->base + from, n) != MPL_OK) {
                int e = errno;
                (void)fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)from, (off_t)n);
                errno = e;
                return MPL_ESYS;
            }
        } else if (cap < m->capacity) {
            /* Past the new capacity the span holds holes only (the invariant a
             * later grow relies on to find zero cost there); a failed punch only
             * keeps memory. */
            (void)fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(m->offset + cap),
                            (off_t)(m->capacity - cap));
        }
        m->capacity = cap;
        m->grow_count++;
        mpl_region_note_size(r, need);
        return MPL_OK;
    }
    if (preserve > m->capacity)
        preserve = m->capacity;
    if (preserve > need)
        preserve = need;
    /* A slot that outgrows a range close to what it needs now takes half as much
     * again (address space only: the pages past `cap` stay holes), so batches that
     * creep up in size re-carve a geometric number of times, not once per new
     * largest batch; if that does not fit the reservation, exactly `cap`. */
    uint64_t want = cap;
    if (!pinned && span && cap < span + span / 2)
        want = round_up(span + span / 2, MPL_PAGE);
    /* A spare range another slot gave up first (not in a pinned region: its pages
     * were punched), at most twice what we would carve, so that a small batch does
     * not take the range a large one will need; else a fresh one. */
    uint64_t off = 0, got = 0;
    if (!pinned) {
        off = mpl__pool_take(r, cap, 2 * want, &got);
        if (off && (fallocate(r->fd, 0, (off_t)off, (off_t)cap) != 0 || mpl__populate(r->base + off, cap) != MPL_OK)) {
            int e = errno;
            (void)fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)cap);
            mpl__pool_put(r, off, got);
            errno = e;
            return MPL_ESYS;
        }
    }
    if (off == 0) {
        int err = MPL_OK;
        off = mpl__carve(r, want, cap, &err);
        if (off == 0 && err == MPL_ENOSPACE && want > cap) {
            want = cap;
            off = mpl__carve(r, want, cap, &err);
        }
        if (off == 0)
            return err;
        got = want;
    }
    if (preserve)
        memcpy(r->base + off, r->base + m->offset, preserve);
    /* Give the old range's memory back to the kernel; the file keeps its size. No
     * lease can point into it: leases only exist for LEASED slots, and this one is
     * ASSIGNED to us.  Its address space goes to the pool (not in a pinned region,
     * where punched pages are never faulted in again). */
    if (span && fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)m->offset, (off_t)span) == 0 &&
        !pinned)
        mpl__pool_put(r, m->offset, span);
    m->offset = off;
    m->capacity = cap;
    h->span = got;
    m->grow_count++;
    mpl_region_note_size(r, need);
    return MPL_OK;
}

int mpl_slot_shrink(mpl_region *r, uint32_t slot, uint64_t need) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    if (!held_assigned(h))
        return MPL_ESTATE;
    mpl_slot_meta *m = &h->meta;
    if (need >= m->capacity)
        return MPL_OK;
    uint64_t keep = round_up(need, MPL_PAGE); /* <= capacity, which is page-aligned */
    if (keep < m->capacity &&
        fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(m->offset + keep),
                  (off_t)(m->capacity - keep)) != 0)
        return MPL_ESYS;
    m->capacity = keep;
    return MPL_OK;
}

int mpl_slot_park(mpl_region *r, uint32_t slot) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Acquire: as in mpl_slot_trim (pairs with the release of E4/E5); our own E1's
     * release later publishes the emptied header to the slot's next worker. */
    if ((atomic_load_explicit(&h->state, memory_order_acquire) & MPL_STATE_MASK) != MPL_FREE)
        return MPL_ESTATE;
    /* Acquire: pairs with mpl_region_set_pinned's release (the same process). */
    if (atomic_load_explicit(&ctl_of(r)->pinned, memory_order_acquire))
        return MPL_ESTATE;
    mpl_slot_meta *m = &h->meta;
    uint64_t span = own_span(r, h, 0);
    if (span) {
        if (fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)m->offset, (off_t)span) != 0)
            return MPL_ESYS;
        mpl__pool_put(r, m->offset, span);
    }
    m->offset = r->payload_off; /* empty (a valid range); the next grow takes one */
    m->capacity = 0;
    h->span = 0;
    return MPL_OK;
}

int mpl_slot_trim(mpl_region *r, uint32_t slot, uint64_t keep) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Acquire: pairs with the release of E4/E5 (a lease dropped in another thread of
     * this process); after it, no view of the payload is left and no worker holds the
     * slot, and none will before our own E1 publishes what we write below. */
    if ((atomic_load_explicit(&h->state, memory_order_acquire) & MPL_STATE_MASK) != MPL_FREE)
        return MPL_ESTATE;
    mpl_slot_meta *m = &h->meta;
    uint64_t kept = round_up(keep, MPL_PAGE);
    if (kept >= m->capacity)
        return MPL_OK;
    if (fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(m->offset + kept),
                  (off_t)(m->capacity - kept)) != 0)
        return MPL_ESYS;
    return MPL_OK;
}

int mpl_slot_publish(mpl_region *r, uint32_t slot, uint32_t kind, uint32_t flags, uint64_t used, uint64_t desc_off,
                     uint64_t desc_len) {
    if (slot >= r->nslots)
        return MPL_EINVAL;
    mpl_slot_hdr *h = hdr_of(r, slot);
    /* Only the worker holding the slot ASSIGNED may write its header: check before
     * writing (acquire pairs with E1's release).  Nobody else can move the slot out
     * of ASSIGNED meanwhile except E5, which happens only after we are dead; the
     * parent may only add MPL_WAITER. */
    uint32_t cur = atomic_load_explicit(&h->state, memory_order_acquire);
    if ((cur & MPL_STATE_MASK) != MPL_ASSIGNED)
        return MPL_ESTATE;
    if (used > h->meta.capacity || desc_off > used || desc_len > used - desc_off)
        return MPL_EINVAL;
    h->meta.kind = kind;
    h->meta.flags = flags;
    h->meta.used = used;
    h->meta.desc_off = desc_off;
    h->meta.desc_len = desc_len;
    h->meta.worker_pid = (int32_t)mpl_self_pid();
    /* E2: release on success publishes the payload and every meta field above to
     * the parent's acquire CAS in take_ready.  On failure `cur` is reloaded
     * (relaxed: we only look at the bits) and we retry while the only change is the
     * parent's MPL_WAITER. */
    while (!atomic_compare_exchange_weak_explicit(&h->state, &cur, MPL_READY, memory_order_release,
                                                  memory_order_relaxed)) {
        if ((cur & MPL_STATE_MASK) != MPL_ASSIGNED)
            return MPL_ESTATE;
    }
    if (cur & MPL_WAITER) {
        /* Relaxed: a statistics counter. */
        atomic_fetch_add_explicit(&ctl_of(r)->wakes, 1, memory_order_relaxed);
        futex(&h->state, FUTEX_WAKE, INT_MAX, NULL);
    }
    return MPL_OK;
}
