/*
 * mploader ring: the region itself -- create, attach, populate, close -- and the
 * bump allocator that carves payload ranges from its file.  See ring.h for the API
 * and ring.c for the slot protocol.
 *
 * Layout of the region (one memfd, mapped MAP_SHARED before fork):
 *   [mpl_ctl: 1 page][slot headers: nslots x 128 B, page-rounded][payloads ...]
 * Payload ranges are carved from the file by a bump allocator (ctl->file_end) so a
 * slot can be given a bigger range later (mpl_slot_grow) without moving the
 * mapping: the whole reservation is mapped once, the file only grows inside it,
 * and every process that inherited the mapping sees the new pages.  A range, once
 * carved, stays its slot's (hdr->span) until the slot needs a bigger one, so a
 * slot shrunk after an outlier grows again in place (ring.c, mpl_slot_grow).
 */
#define _GNU_SOURCE
#include "ring_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Fault in [p, p+n) for writing in this process.  MADV_POPULATE_WRITE (Linux 5.14)
 * when available, else a touch loop (a read is not enough for shmem: it would map
 * the zero page). */
int mpl__populate(uint8_t *p, uint64_t n) {
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

uint64_t mpl__carve(mpl_region *r, uint64_t n, uint64_t alloc, int *err) {
    mpl_ctl *c = ctl_of(r);
    if (n > r->reserve_bytes) { /* also keeps round_up below from wrapping */
        *err = MPL_ENOSPACE;
        return 0;
    }
    n = round_up(n ? n : MPL_PAGE, MPL_PAGE);
    alloc = alloc < n ? round_up(alloc ? alloc : MPL_PAGE, MPL_PAGE) : n;
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
     * concurrent carves in several processes cannot undo one another.  A range
     * allocated only in part gets its last page allocated (the file's size then
     * covers it: the span checks of ring.c compare with the size) and punched out. */
    if (fallocate(r->fd, 0, (off_t)off, (off_t)alloc) != 0) {
        *err = MPL_ESYS;
        return 0;
    }
    if (alloc < n && (fallocate(r->fd, 0, (off_t)(off + n - MPL_PAGE), (off_t)MPL_PAGE) != 0 ||
                      fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(off + n - MPL_PAGE),
                                (off_t)MPL_PAGE) != 0)) {
        *err = MPL_ESYS;
        return 0;
    }
    if (mpl__populate(r->base + off, alloc) != MPL_OK) {
        *err = MPL_ESYS;
        return 0;
    }
    return off;
}

/* A pool entry: the offset's page number in the high 34 bits (a reservation is at
 * most 2^46 bytes), the length's in the low 30 (< 4 TiB); 0 is no range (no
 * payload starts at offset 0). */
#define POOL_LEN_BITS 30
static inline uint64_t pool_pack(uint64_t off, uint64_t n) {
    return (off / MPL_PAGE) << POOL_LEN_BITS | n / MPL_PAGE;
}

void mpl__pool_put(mpl_region *r, uint64_t off, uint64_t n) {
    if (n == 0 || n / MPL_PAGE >= (1ull << POOL_LEN_BITS))
        return;
    mpl_ctl *c = ctl_of(r);
    uint64_t v = pool_pack(off, n);
    for (uint32_t i = 0; i < MPL_POOL_ENTRIES; i++) {
        uint64_t empty = 0;
        /* Release: the taker's acquire CAS sees the range as the putter left it (its
         * pages punched; the range is no longer any slot's).  Relaxed on failure:
         * the entry is taken, try the next. */
        if (atomic_compare_exchange_strong_explicit(&c->pool[i], &empty, v, memory_order_release,
                                                    memory_order_relaxed))
            return;
    }
}

uint64_t mpl__pool_take(mpl_region *r, uint64_t need, uint64_t most, uint64_t *n) {
    mpl_ctl *c = ctl_of(r);
    for (int attempt = 0; attempt < 4; attempt++) {
        uint32_t best = MPL_POOL_ENTRIES;
        uint64_t best_v = 0, best_n = UINT64_MAX;
        for (uint32_t i = 0; i < MPL_POOL_ENTRIES; i++) {
            /* Relaxed: only picks a candidate; the CAS below takes it with acquire. */
            uint64_t v = atomic_load_explicit(&c->pool[i], memory_order_relaxed);
            uint64_t len = (v & ((1ull << POOL_LEN_BITS) - 1)) * MPL_PAGE;
            if (v && len >= need && len <= most && len < best_n) {
                best = i;
                best_v = v;
                best_n = len;
            }
        }
        if (best == MPL_POOL_ENTRIES)
            return 0;
        /* Acquire pairs with mpl__pool_put's release.  An entry holds a range only
         * while nobody owns it, so a CAS that still finds best_v takes a free range
         * (even if it left and came back meanwhile). */
        if (atomic_compare_exchange_strong_explicit(&c->pool[best], &best_v, 0, memory_order_acquire,
                                                    memory_order_relaxed)) {
            uint64_t off = (best_v >> POOL_LEN_BITS) * MPL_PAGE;
            /* The pool lives in shared memory a stray writer could change: use only a
             * sane range of this mapping; drop a broken entry. */
            if (off < r->payload_off || mpl_slot_check_range(r, off, best_n) != MPL_FIELD_NONE)
                continue;
            *n = best_n;
            return off;
        }
    }
    return 0;
}

static void region_init(mpl_region *r) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

int mpl_region_create(mpl_region *r, uint32_t nslots, uint64_t slot_bytes, uint64_t reserve_bytes) {
    region_init(r);
    if (nslots == 0 || nslots > MPL_MAX_SLOTS || slot_bytes > MPL_MAX_SLOT_BYTES ||
        reserve_bytes > MPL_MAX_RESERVE_BYTES) {
        errno = EINVAL;
        return MPL_EINVAL;
    }
    /* No wrap below: nslots <= 2^12, slot_stride <= 2^40. */
    uint64_t headers_off = MPL_PAGE;
    uint64_t first_payload = payload_start(nslots);
    uint64_t slot_stride = round_up(slot_bytes, MPL_PAGE);
    uint64_t initial = first_payload + (uint64_t)nslots * slot_stride;
    if (initial > MPL_MAX_RESERVE_BYTES / 4) {
        errno = EINVAL;
        return MPL_EINVAL;
    }
    /* fallocate on a memfd is not limited by anything but memory: refuse an initial
     * size the machine cannot hold instead of waking the OOM killer. */
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0 && initial > (uint64_t)pages * (uint64_t)psz) {
        errno = ENOMEM;
        return MPL_ENOSPACE;
    }
    if (reserve_bytes == 0)
        reserve_bytes = MPL_DEFAULT_RESERVE_BYTES;
    if (reserve_bytes < 4 * initial)
        reserve_bytes = 4 * initial;
    reserve_bytes = round_up(reserve_bytes, MPL_PAGE);

    int fd = mpl_fd_off_stdio(memfd_create("mploader-ring", MFD_CLOEXEC));
    if (fd < 0)
        return MPL_ESYS;
    uint8_t *base = mmap(NULL, reserve_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        close(fd);
        errno = e;
        return MPL_ESYS;
    }
    if (fallocate(fd, 0, 0, (off_t)initial) != 0 || mpl__populate(base, initial) != MPL_OK) {
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
    r->payload_off = first_payload;
    atomic_init(&r->seen_bytes, initial);
    (void)mpl_self_pid(); /* installs the atfork handler before any worker forks */

    /* Fresh memfd pages are zero: every state word already reads MPL_FREE.  No
     * other process exists yet (workers fork later), so plain initialisation is
     * enough; fork() itself orders it before anything a child does. */
    mpl_ctl *c = ctl_of(r);
    c->magic = MPL_MAGIC;
    c->layout_version = MPL_LAYOUT_VERSION;
    c->nslots = nslots;
    c->reserve_bytes = reserve_bytes;
    c->headers_off = headers_off;
    atomic_init(&c->file_end, initial);
    atomic_init(&c->size_hint, slot_bytes);
    atomic_init(&c->wakes, 0);
    for (uint32_t i = 0; i < nslots; i++) {
        mpl_slot_hdr *h = hdr_of(r, i);
        atomic_init(&h->state, MPL_FREE);
        h->meta.offset = first_payload + (uint64_t)i * slot_stride;
        h->meta.capacity = slot_stride;
        h->span = slot_stride;
    }
    atomic_init(&c->pinned, 0);
    for (uint32_t i = 0; i < MPL_POOL_ENTRIES; i++)
        atomic_init(&c->pool[i], 0);
    return MPL_OK;
}

int mpl_region_attach(mpl_region *r, int fd, uint64_t *found_magic, uint32_t *found_version) {
    region_init(r);
    /* pread, not a mapping: a file that is not a region (or is truncated) must give
     * an error, not a SIGBUS. */
    mpl_ctl c;
    ssize_t n = pread(fd, &c, sizeof c, 0);
    if (n < 0)
        return MPL_ESYS;
    if ((size_t)n < sizeof c) {
        *found_magic = 0;
        if ((size_t)n >= sizeof c.magic)
            memcpy(found_magic, &c.magic, sizeof c.magic);
        errno = EINVAL;
        return MPL_EMAGIC;
    }
    *found_magic = c.magic;
    *found_version = c.layout_version;
    if (c.magic != MPL_MAGIC) {
        errno = EINVAL;
        return MPL_EMAGIC;
    }
    if (c.layout_version != MPL_LAYOUT_VERSION) {
        errno = EINVAL;
        return MPL_EVERSION;
    }
    struct stat st;
    if (fstat(fd, &st) != 0)
        return MPL_ESYS;
    uint64_t first_payload = c.nslots >= 1 && c.nslots <= MPL_MAX_SLOTS ? payload_start(c.nslots) : 0;
    if (first_payload == 0 || c.headers_off != MPL_PAGE || c.reserve_bytes % MPL_PAGE != 0 ||
        c.reserve_bytes < first_payload || c.reserve_bytes > MPL_MAX_RESERVE_BYTES ||
        (uint64_t)st.st_size < first_payload) {
        errno = EINVAL;
        return MPL_EINVAL;
    }
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 3); /* >= 3: never a standard stream (mpl_fd_off_stdio) */
    if (own < 0)
        return MPL_ESYS;
    uint8_t *base = mmap(NULL, c.reserve_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, own, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        close(own);
        errno = e;
        return MPL_ESYS;
    }
    r->base = base;
    r->reserve_bytes = c.reserve_bytes;
    r->fd = own;
    r->nslots = c.nslots;
    r->payload_off = first_payload;
    atomic_init(&r->seen_bytes, (uint64_t)st.st_size);
    (void)mpl_self_pid();
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
    mpl_ctl *c = ctl_of(r);
    if (c->magic != MPL_MAGIC) {
        errno = EINVAL;
        return MPL_EMAGIC;
    }
    if (c->layout_version != MPL_LAYOUT_VERSION) {
        errno = EINVAL;
        return MPL_EVERSION;
    }
    (void)mpl_self_pid();
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
        if (data < hole && mpl__populate(r->base + data, (uint64_t)(hole - data)) != MPL_OK)
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

void mpl_region_set_size_hint(mpl_region *r, uint64_t n) {
    /* Relaxed: a hint, publishes nothing else. */
    atomic_store_explicit(&ctl_of(r)->size_hint, n, memory_order_relaxed);
}

void mpl_region_set_pinned(mpl_region *r) {
    /* Release pairs with the acquire load in mpl_slot_grow (ring.c, own_span): a
     * worker that grows after reading 1 takes fresh ranges only.  The caller sets
     * it before the first page is registered, so a range a worker punched and
     * faulted in again before reading 1 was faulted in before the registration. */
    atomic_store_explicit(&ctl_of(r)->pinned, 1, memory_order_release);
}

int mpl_region_pinned(const mpl_region *r) {
    /* Acquire: pairs with the release store above (a test or diagnostic read). */
    return (int)atomic_load_explicit(&ctl_of(r)->pinned, memory_order_acquire);
}

uint64_t mpl_region_wake_count(const mpl_region *r) {
    /* Relaxed: statistics only. */
    return atomic_load_explicit(&ctl_of(r)->wakes, memory_order_relaxed);
}
