/*
 * Internal to csrc/: the shared layout (control block, slot headers) and helpers
 * used by region.c (create/attach/populate, the file's bump allocator) and ring.c
 * (the slot protocol).  Not part of the API (ring.h); no Python.h.
 */
#ifndef MPLOADER_RING_IMPL_H
#define MPLOADER_RING_IMPL_H

#include "ring.h"

#include <stdatomic.h>
#include <stdint.h>

#define MPL_CACHE_LINE 64
#define MPL_PAGE 4096ull
#define MPL_POOL_ENTRIES 256u

/* One slot header: the state word on the first cache line (the only word both
 * sides touch concurrently), the metadata on the second.
 *
 * `span` shares the state word's line: the bytes of address space the slot owns
 * at meta.offset (docs/design.md, "Growth": capacity <= span; the pages in
 * [offset + capacity, offset + span) are holes).  It is not atomic: like the meta,
 * only the holder of the slot's write right (the state word) writes it, and only
 * when the slot takes a fresh range or its range is reset, which is rare, so it
 * adds no traffic to the state word's line in the steady state.  It is kept out of
 * mpl_slot_meta because the parent never reads it through a lease. */
typedef struct mpl_slot_hdr {
    _Alignas(MPL_CACHE_LINE) _Atomic uint32_t state;
    uint32_t pad0_;
    uint64_t span;
    char pad_[MPL_CACHE_LINE - 2 * sizeof(uint64_t)];
    _Alignas(MPL_CACHE_LINE) mpl_slot_meta meta;
} mpl_slot_hdr;

_Static_assert(sizeof(mpl_slot_hdr) == 2 * MPL_CACHE_LINE, "slot header is two cache lines");

/* The control block at offset 0.  magic and layout_version come first and stay
 * first in every future layout, so any version can recognise any other. */
typedef struct mpl_ctl {
    uint64_t magic;          /* MPL_MAGIC */
    uint32_t layout_version; /* MPL_LAYOUT_VERSION */
    uint32_t nslots;
    uint64_t reserve_bytes;
    uint64_t headers_off;
    /* Bump allocator for payload ranges: the file's size.  Workers and the parent
     * allocate from it concurrently, so it is an atomic RMW counter on its own line. */
    _Alignas(MPL_CACHE_LINE) _Atomic uint64_t file_end;
    /* Largest payload any batch needed (a sizing hint for later slots). */
    _Alignas(MPL_CACHE_LINE) _Atomic uint64_t size_hint;
    /* FUTEX_WAKE calls made by publishers (statistics; only touched when waking). */
    _Alignas(MPL_CACHE_LINE) _Atomic uint64_t wakes;
    /* 1 once mpl_region_set_pinned was called: a punched range is never faulted in
     * again (mpl_slot_grow takes fresh ranges only).  Written once by the parent. */
    _Alignas(MPL_CACHE_LINE) _Atomic uint32_t pinned;
    /* Spare ranges (docs/design.md, "Growth"): address space a slot gave up (a grow
     * that moved it, mpl_slot_park), all holes, for the next grow that needs a fresh
     * range.  Each entry is 0 (empty) or mpl__pool_pack(offset, bytes). */
    _Alignas(MPL_CACHE_LINE) _Atomic uint64_t pool[MPL_POOL_ENTRIES];
} mpl_ctl;

_Static_assert(sizeof(mpl_ctl) <= MPL_PAGE, "control block fits its page");

static inline mpl_ctl *ctl_of(const mpl_region *r) { return (mpl_ctl *)r->base; }

static inline mpl_slot_hdr *hdr_of(const mpl_region *r, uint32_t slot) {
    return (mpl_slot_hdr *)(r->base + ctl_of(r)->headers_off) + slot;
}

static inline uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

static inline uint64_t payload_start(uint32_t nslots) {
    return round_up(MPL_PAGE + (uint64_t)nslots * sizeof(mpl_slot_hdr), MPL_PAGE);
}

/* Fault in [p, p+n) for writing in this process (region.c).  Returns 0 or MPL_ESYS. */
int mpl__populate(uint8_t *p, uint64_t n);

/* Put the spare range [off, off + n) (page-aligned, all holes, given up by its
 * owner) into the region's pool, for mpl__pool_take.  Best effort: a full pool or a
 * range too long to pack (>= 4 TiB) loses its address space, as before pools.
 * Never in a pinned region (the caller checks). */
void mpl__pool_put(mpl_region *r, uint64_t off, uint64_t n);

/* Take from the pool the shortest spare range of at least `need` and at most `most`
 * bytes that is a sane range of this mapping (mpl_slot_check_range).  On success
 * returns its offset and sets *n to its length; 0 if there is none. */
uint64_t mpl__pool_take(mpl_region *r, uint64_t need, uint64_t most, uint64_t *n);

/* Carve a fresh page-aligned range of round_up(n, page) bytes (a page for 0) from
 * the file, allocate and fault in its first round_up(alloc, page) bytes (alloc <= n)
 * and leave the rest holes, the file's size covering the whole range (region.c).
 * On success returns its offset; on failure 0 (never a valid payload offset) with
 * *err set to MPL_ENOSPACE (the reservation cannot hold it; nothing used up) or
 * MPL_ESYS (errno set). */
uint64_t mpl__carve(mpl_region *r, uint64_t n, uint64_t alloc, int *err);

#endif /* MPLOADER_RING_IMPL_H */
