/*
 * Standalone C11 test of the slot ring (csrc/ring.h, csrc/ring.c); no Python.
 *
 *   test_ring WORKERS BATCHES SEED [key=value ...]
 *
 * keys: phase=all|contract|stress (all)   mode=fork|thread (fork)
 *       slots=N (4)   slot_bytes=N (0)   max_need=N (98304)   grow_pct=P (12)
 *       watchdog=SECONDS (60)
 *
 * phase "contract": single-process (plus a few short-lived children) checks of
 * every edge's error returns, find_free, grow/ENOSPACE, reclaim after a worker
 * died, populate, watch_parent (survives its forking thread, dies with its parent
 * process), the waiter bit (no FUTEX_WAKE without a sleeper), shrink and the size
 * hint, header validation at take (each corrupt field), attach with its magic and
 * version checks, the cached pid after fork.  Failures there are all reported (the run goes on),
 * and the exit status is 1 if any occurred.
 *
 * phase "stress": the parent creates a region, starts WORKERS workers (forked
 * processes, or threads with mode=thread), hands them (seq, slot) tasks over pipes
 * and waits for the batches in seq order, holding a random number of leases and
 * releasing them out of order.  Each worker begins the slot, sometimes grows it
 * (once or twice, preserving what it already wrote), fills the payload with a
 * pattern derived from (SEED, seq) and publishes.  Everything a worker does for a
 * seq is a pure function of (SEED, seq) and the slot's capacity, so the parent
 * predicts and checks the whole header and payload (grow_count is read as the
 * slot's running total, as ring.h words it).  Leases are re-checked byte for byte
 * before release, ranges of FREE/LEASED slots must stay disjoint, and a wait that
 * returns more than WAKE_LATENCY_NS after the worker's publish is reported as a
 * lost wake-up (ring.c's timed futex wait would otherwise hide one).  The first
 * failure ends the run with "test_ring FAIL ..." on stderr, non-zero exit status.
 *
 * On success the last line on stdout is "test_ring OK: ..." (one line).
 * No sleeps are used for synchronisation: pipes, waitpid and the ring itself.
 */
#define _GNU_SOURCE
#include "ring.h"
#include "ring_impl.h" /* white-box: contract_span breaks a slot's span (hdr_of) */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MS 1000000ll
#define STRESS_WAIT_NS (5000 * MS) /* a batch not READY after this: dead or stuck worker */
#define WAKE_LATENCY_NS (2000 * MS) /* woke this long after the publish: lost wake-up */
#define JUNK_TAIL 8192u             /* bytes past `used` a worker scribbles on */
#define TASK_MAGIC 0x7461736bu

/* ------------------------------------------------------------------------- */
/* failure reporting                                                          */

static int g_is_child;                /* forked process: _exit on failure */
static pthread_t g_main_thread;
static _Thread_local char g_who[64] = "parent";
static int g_soft;                    /* contract phase: count failures, go on */
static int g_soft_failures;
static atomic_ulong g_checks;
static pid_t g_notify_pid;            /* stress workers: SIGUSR1 the parent on failure */
/* When each slot's batch was published (CLOCK_MONOTONIC ns), written by the worker
 * just before mpl_slot_publish: test bookkeeping in its own shared mapping, not
 * part of the ring.  The parent reads it after its wait to time the wake-up. */
static int64_t *g_pub_ns;

static const char *rc_name(int rc) {
    switch (rc) {
    case MPL_OK: return "MPL_OK";
    case MPL_ETIMEDOUT: return "MPL_ETIMEDOUT";
    case MPL_ESTATE: return "MPL_ESTATE";
    case MPL_ENOSPACE: return "MPL_ENOSPACE";
    case MPL_ESYS: return "MPL_ESYS";
    case MPL_EINVAL: return "MPL_EINVAL";
    default: return "(unknown rc)";
    }
}

static const char *state_name(uint32_t s) {
    switch (s) {
    case MPL_FREE: return "FREE";
    case MPL_ASSIGNED: return "ASSIGNED";
    case MPL_READY: return "READY";
    case MPL_LEASED: return "LEASED";
    default: return "(bad state)";
    }
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void fail_at(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "test_ring FAIL [%s] %s:%d: %s\n", g_who, file, line, msg);
    fflush(stderr);
    int main_thread = pthread_equal(pthread_self(), g_main_thread);
    if (g_soft && !g_is_child && main_thread) {
        g_soft_failures++;
        return;
    }
    if (g_is_child) {
        if (g_notify_pid > 0)
            kill(g_notify_pid, SIGUSR1);
        _exit(3);
    }
    if (!main_thread)
        _exit(1);
    exit(1);
}

#define FAIL(...) fail_at(__FILE__, __LINE__, __VA_ARGS__)
#define CHECK(cond, ...)                                                                                               \
    do {                                                                                                               \
        atomic_fetch_add_explicit(&g_checks, 1, memory_order_relaxed);                                                 \
        if (!(cond))                                                                                                   \
            FAIL("check `" #cond "` failed: " __VA_ARGS__);                                                            \
    } while (0)
#define CHECK_RC(expr, want)                                                                                           \
    do {                                                                                                               \
        atomic_fetch_add_explicit(&g_checks, 1, memory_order_relaxed);                                                 \
        int rc_ = (expr);                                                                                              \
        if (rc_ != (want))                                                                                             \
            FAIL("%s returned %s (%d), expected %s (errno %d: %s)", #expr, rc_name(rc_), rc_, rc_name(want), errno,   \
                 strerror(errno));                                                                                     \
    } while (0)
#define CHECK_STATE(r, slot, want)                                                                                     \
    do {                                                                                                               \
        uint32_t st_ = mpl_slot_state((r), (slot));                                                                    \
        atomic_fetch_add_explicit(&g_checks, 1, memory_order_relaxed);                                                 \
        if (st_ != (uint32_t)(want))                                                                                   \
            FAIL("slot %u is %s, expected %s", (unsigned)(slot), state_name(st_), state_name(want));                   \
    } while (0)

static void die_sys(const char *what) {
    FAIL("%s: %s", what, strerror(errno));
    exit(1); /* FAIL may return in the soft phase; a failed syscall here is fatal */
}

static void on_worker_failed(int sig) {
    (void)sig;
    static const char msg[] = "test_ring FAIL [parent]: a worker process failed (its message is above)\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(1);
}

static void on_watchdog(int sig) {
    (void)sig;
    static const char msg[] = "test_ring FAIL [watchdog]: the run took longer than watchdog= seconds (hang?)\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(1);
}

/* ------------------------------------------------------------------------- */
/* PRNG and payload pattern                                                   */

static inline uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct { uint64_t s; } rng_t; /* splitmix64 */

static inline uint64_t rng_next(rng_t *g) {
    g->s += 0x9e3779b97f4a7c15ull;
    uint64_t z = g->s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rng_below(rng_t *g, uint64_t n) { return n ? rng_next(g) % n : 0; }

static inline uint64_t pat_key(uint64_t seed, uint64_t seq) { return mix64(mix64(seed) ^ (seq * 0x100000001b3ull)); }

/* Byte i of the pattern `key` is byte (i % 8) of mix64(key + i / 8). */
static void pat_fill(uint8_t *p, uint64_t from, uint64_t to, uint64_t key) {
    uint64_t i = from;
    while (i < to) {
        uint64_t w = mix64(key + (i >> 3));
        do {
            p[i] = (uint8_t)(w >> ((i & 7) * 8));
            i++;
        } while (i < to && (i & 7));
    }
}

/* Index of the first byte in [from, to) that differs from the pattern, or -1. */
static int64_t pat_bad(const uint8_t *p, uint64_t from, uint64_t to, uint64_t key) {
    uint64_t i = from;
    while (i < to) {
        uint64_t w = mix64(key + (i >> 3));
        do {
            if (p[i] != (uint8_t)(w >> ((i & 7) * 8)))
                return (int64_t)i;
            i++;
        } while (i < to && (i & 7));
    }
    return -1;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static uint64_t u64min(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t u64max(uint64_t a, uint64_t b) { return a > b ? a : b; }

static int fd_count(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        die_sys("opendir /proc/self/fd");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

/* End of the slot headers (offset from base): no payload may start below it. */
static uint64_t headers_end(mpl_region *r) {
    uint64_t end = 0;
    for (uint32_t s = 0; s < r->nslots; s++) {
        uint64_t e = (uint64_t)((uint8_t *)mpl_slot_meta_of(r, s) - r->base) + sizeof(mpl_slot_meta);
        end = u64max(end, e);
    }
    return end;
}

static int ranges_overlap(uint64_t a_off, uint64_t a_len, uint64_t b_off, uint64_t b_len) {
    if (a_len == 0 || b_len == 0)
        return 0;
    return a_off < b_off + b_len && b_off < a_off + a_len;
}

/* ------------------------------------------------------------------------- */
/* what a worker does for one batch                                           */

typedef struct {
    int workers;
    uint64_t batches;
    uint64_t seed;
    uint32_t nslots;
    uint64_t slot_bytes;
    uint64_t max_need;
    uint64_t grow_pct; /* percent of batches that grow even if the slot is big enough */
    int threads;
    int do_contract, do_stress;
    unsigned watchdog;
} cfg_t;

typedef struct {
    uint64_t need;     /* bytes published (meta.used) */
    uint64_t extra;    /* a forced grow asks for need + extra */
    uint64_t prefix_pm;/* per-mille of min(capacity, need) written before the first grow */
    int force_grow;    /* grow even if the slot is big enough */
    int two_grows;     /* grow to a midpoint first, then to the target */
    uint32_t kind, flags;
    uint64_t desc_off, desc_len;
    int shrink;        /* shrink the slot to shrink_to first (keeps its span: a later grow is in place) */
    uint64_t shrink_to;
} plan_t;

static plan_t make_plan(uint64_t seed, uint64_t seq, uint64_t max_need, uint64_t grow_pct) {
    rng_t g = {mix64(seed ^ mix64(seq + 0x5151))};
    plan_t p;
    uint64_t c = rng_below(&g, 100);
    if (c < 8)
        p.need = 0;
    else if (c < 55)
        p.need = 1 + rng_below(&g, 512);
    else if (c < 85)
        p.need = 1 + rng_below(&g, 8192);
    else
        p.need = 1 + rng_below(&g, max_need);
    p.need = u64min(p.need, max_need);
    p.force_grow = rng_below(&g, 100) < grow_pct;
    p.two_grows = rng_below(&g, 4) == 0;
    p.extra = rng_below(&g, 5000);
    p.prefix_pm = rng_below(&g, 1001);
    p.kind = (uint32_t)rng_below(&g, 4);
    p.flags = rng_below(&g, 2) ? MPL_FLAG_INBAND : 0;
    p.desc_off = rng_below(&g, p.need + 1);
    p.desc_len = rng_below(&g, p.need - p.desc_off + 1);
    p.shrink = rng_below(&g, 100) < 15;
    p.shrink_to = rng_below(&g, 3 * 4096);
    return p;
}

static uint64_t page_up(uint64_t n) { return (n + 4095) / 4096 * 4096; }

/* The capacity a worker grows from for `pl`: the slot's after the planned shrink. */
static uint64_t cap_after_shrink(const plan_t *pl, uint64_t cap) {
    return pl->shrink && pl->shrink_to < cap ? page_up(pl->shrink_to) : cap;
}

/* The grows a worker does for `pl` on a slot of capacity `cap`: 0, 1 or 2. */
static uint32_t planned_grows(const plan_t *pl, uint64_t cap) {
    if (!(pl->need > cap || pl->force_grow))
        return 0;
    return pl->two_grows ? 2u : 1u;
}

static uint64_t grow_target(const plan_t *pl) { return pl->force_grow ? pl->need + pl->extra : pl->need; }

static void do_grow(mpl_region *r, uint32_t slot, uint64_t seq, uint64_t need, uint64_t preserve, uint64_t key) {
    mpl_slot_meta *m = mpl_slot_meta_of(r, slot);
    uint32_t gc = m->grow_count;
    int rc = mpl_slot_grow(r, slot, need, preserve);
    if (rc != MPL_OK) {
        FAIL("mpl_slot_grow(slot %u, need %" PRIu64 ", preserve %" PRIu64 ") for seq %" PRIu64
             " returned %s (errno %d: %s)",
             slot, need, preserve, seq, rc_name(rc), errno, strerror(errno));
        return;
    }
    CHECK(m->capacity >= need, "seq %" PRIu64 ": capacity %" PRIu64 " after grow to %" PRIu64, seq, m->capacity,
          need);
    CHECK(m->offset + m->capacity <= r->reserve_bytes, "seq %" PRIu64 ": grown range past the reservation", seq);
    CHECK(m->offset + m->capacity <= mpl_region_file_bytes(r),
          "seq %" PRIu64 ": grown range [%" PRIu64 ", +%" PRIu64 ") past file end %" PRIu64, seq, m->offset,
          m->capacity, mpl_region_file_bytes(r));
    CHECK(m->grow_count == gc + 1, "seq %" PRIu64 ": grow_count %u -> %u", seq, gc, m->grow_count);
    CHECK(mpl_slot_payload(r, slot) == r->base + m->offset, "payload pointer is not base + offset");
    int64_t bad = pat_bad(mpl_slot_payload(r, slot), 0, preserve, key);
    CHECK(bad < 0, "seq %" PRIu64 ": grow(need %" PRIu64 ", preserve %" PRIu64 ") lost preserved byte %" PRId64,
          seq, need, preserve, bad);
}

/* Worker side of one batch: begin, maybe grow, write, publish.  Returns the grows. */
static uint32_t run_batch(mpl_region *r, const cfg_t *cfg, uint64_t seq, uint32_t slot) {
    CHECK_RC(mpl_slot_begin(r, slot, seq), MPL_OK);
    CHECK_RC(mpl_slot_begin(r, slot, seq + 1), MPL_ESTATE); /* not this batch's seq */
    mpl_slot_meta *m = mpl_slot_meta_of(r, slot);
    CHECK(m->seq == seq, "worker sees meta.seq %" PRIu64 " for seq %" PRIu64, m->seq, seq);
    plan_t pl = make_plan(cfg->seed, seq, cfg->max_need, cfg->grow_pct);
    uint64_t key = pat_key(cfg->seed, seq);
    uint64_t cap = m->capacity;
    CHECK(mpl_slot_payload(r, slot) == r->base + m->offset, "payload pointer is not base + offset");
    if (pl.shrink) {
        uint64_t off = m->offset, span = mpl_slot_span(r, slot);
        CHECK_RC(mpl_slot_shrink(r, slot, pl.shrink_to), MPL_OK);
        CHECK(m->capacity == cap_after_shrink(&pl, cap) && m->offset == off && mpl_slot_span(r, slot) == span,
              "seq %" PRIu64 ": shrink(%" PRIu64 ") of %" PRIu64 "/span %" PRIu64 " left %" PRIu64 "/span %" PRIu64
              " at offset %+" PRId64,
              seq, pl.shrink_to, cap, span, m->capacity, mpl_slot_span(r, slot), (int64_t)(m->offset - off));
        cap = m->capacity;
    }
    uint32_t grows = planned_grows(&pl, cap);
    uint64_t written = 0;
    if (grows) {
        uint64_t target = grow_target(&pl);
        written = u64min(cap, pl.need) * pl.prefix_pm / 1000;
        pat_fill(mpl_slot_payload(r, slot), 0, written, key);
        if (grows == 2) {
            uint64_t mid = written + (target - written) / 2;
            do_grow(r, slot, seq, mid, written, key);
            uint64_t upto = u64min(mid, pl.need);
            pat_fill(mpl_slot_payload(r, slot), written, upto, key);
            written = upto;
        }
        do_grow(r, slot, seq, target, written, key);
    }
    uint8_t *p = mpl_slot_payload(r, slot);
    CHECK(m->capacity >= pl.need, "seq %" PRIu64 ": capacity %" PRIu64 " < need %" PRIu64, seq, m->capacity, pl.need);
    pat_fill(p, written, pl.need, key);
    /* Scribble past `used`, inside the capacity: if the ring handed out overlapping
     * ranges this corrupts some other batch's checked bytes. */
    pat_fill(p, pl.need, u64min(m->capacity, pl.need + JUNK_TAIL), ~key);
    mpl_region_note_size(r, pl.need);
    uint32_t flags = pl.flags | (grows ? MPL_FLAG_GROWN : 0u);
    if (g_pub_ns)
        g_pub_ns[slot] = now_ns();
    CHECK_RC(mpl_slot_publish(r, slot, pl.kind, flags, pl.need, pl.desc_off, pl.desc_len), MPL_OK);
    return grows;
}

/* ------------------------------------------------------------------------- */
/* workers                                                                    */

typedef struct {
    uint64_t seq;
    uint32_t slot;
    uint32_t magic;
} task_t;

typedef struct {
    mpl_region *r;
    const cfg_t *cfg;
    int idx;
    int rfd;
    pthread_t tid;
} worker_arg_t;

static void worker_loop(mpl_region *r, const cfg_t *cfg, int rfd) {
    for (;;) {
        task_t t;
        ssize_t n = read(rfd, &t, sizeof t);
        if (n == 0)
            return;
        if (n < 0 && errno == EINTR)
            continue;
        if (n != (ssize_t)sizeof t)
            FAIL("short read on the task pipe: %zd (%s)", n, n < 0 ? strerror(errno) : "");
        CHECK(t.magic == TASK_MAGIC, "garbled task");
        CHECK(t.slot < r->nslots, "task slot %u out of range", t.slot);
        run_batch(r, cfg, t.seq, t.slot);
    }
}

static void *worker_thread(void *arg) {
    worker_arg_t *a = arg;
    snprintf(g_who, sizeof g_who, "worker thread %d", a->idx);
    worker_loop(a->r, a->cfg, a->rfd);
    return NULL;
}

/* ------------------------------------------------------------------------- */
/* contract phase                                                             */

static void expect_timeout(mpl_region *r, uint32_t slot, int64_t timeout_ns) {
    int64_t t0 = now_ns();
    CHECK_RC(mpl_slot_wait(r, slot, timeout_ns), MPL_ETIMEDOUT);
    int64_t dt = now_ns() - t0;
    /* Not before the deadline (1 ms slack for clock granularity), and promptly after it. */
    CHECK(dt >= timeout_ns - 1 * MS, "wait(%" PRId64 " ns) timed out early, after %" PRId64 " ns", timeout_ns, dt);
    CHECK(dt <= timeout_ns + 1000 * MS, "wait(%" PRId64 " ns) took %" PRId64 " ns to time out", timeout_ns, dt);
}

/* Every out-of-range slot index is refused (EINVAL, or ESTATE) without touching memory. */
static void contract_out_of_range(mpl_region *r) {
    uint32_t bad[2] = {r->nslots, UINT32_MAX};
    for (int i = 0; i < 2; i++) {
        uint32_t s = bad[i];
        int rcs[7] = {
            mpl_slot_assign(r, s, 1),     mpl_slot_wait(r, s, 0),          mpl_slot_release(r, s),
            mpl_slot_reclaim(r, s),       mpl_slot_begin(r, s, 1),         mpl_slot_grow(r, s, 4096, 0),
            mpl_slot_publish(r, s, MPL_KIND_SLOT, 0, 0, 0, 0),
        };
        static const char *names[7] = {"assign", "wait", "release", "reclaim", "begin", "grow", "publish"};
        for (int k = 0; k < 7; k++)
            CHECK(rcs[k] == MPL_EINVAL || rcs[k] == MPL_ESTATE, "%s(slot %u) of %u slots returned %s", names[k], s,
                  r->nslots, rc_name(rcs[k]));
    }
}

static void contract_states(void) {
    snprintf(g_who, sizeof g_who, "contract/states");
    int fd0 = fd_count();
    mpl_region r;
    int rc = mpl_region_create(&r, 4, 1000, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(4, 1000, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    CHECK(r.base != NULL && r.fd >= 0 && r.nslots == 4, "region handle not filled in");
    CHECK(fd_count() == fd0 + 1, "create opened %d fds", fd_count() - fd0);
    uint64_t hend = headers_end(&r), fbytes = mpl_region_file_bytes(&r);
    CHECK(fbytes <= r.reserve_bytes, "file bytes %" PRIu64 " > reserve %" PRIu64, fbytes, r.reserve_bytes);
    for (uint32_t s = 0; s < 4; s++) {
        mpl_slot_meta *m = mpl_slot_meta_of(&r, s);
        CHECK_STATE(&r, s, MPL_FREE);
        CHECK(m->capacity >= 1000, "slot %u capacity %" PRIu64, s, m->capacity);
        CHECK(m->grow_count == 0, "slot %u grow_count %u", s, m->grow_count);
        CHECK(mpl_slot_payload(&r, s) == r.base + m->offset, "payload != base + offset");
        CHECK(m->offset >= hend, "slot %u payload at %" PRIu64 " overlaps the headers (end %" PRIu64 ")", s,
              m->offset, hend);
        CHECK(m->offset + m->capacity <= fbytes, "slot %u payload past the file end", s);
        for (uint32_t t = 0; t < s; t++) {
            mpl_slot_meta *n = mpl_slot_meta_of(&r, t);
            CHECK(!ranges_overlap(m->offset, m->capacity, n->offset, n->capacity), "slots %u and %u overlap", s, t);
        }
        /* The payload is writable in this process. */
        pat_fill(mpl_slot_payload(&r, s), 0, 1000, s);
    }
    CHECK_RC(mpl_region_populate(&r), MPL_OK);
    for (uint32_t s = 0; s < 4; s++)
        CHECK(pat_bad(mpl_slot_payload(&r, s), 0, 1000, s) < 0, "populate changed slot %u's payload", s);

    /* size hint: a running maximum */
    mpl_region_note_size(&r, 5000);
    CHECK(mpl_region_size_hint(&r) >= 5000, "size hint %" PRIu64 " after note_size(5000)", mpl_region_size_hint(&r));
    uint64_t h = mpl_region_size_hint(&r);
    mpl_region_note_size(&r, 10);
    CHECK(mpl_region_size_hint(&r) == h, "size hint went from %" PRIu64 " to %" PRIu64 " after note_size(10)", h,
          mpl_region_size_hint(&r));

    for (uint32_t s = 0; s < 4; s++)
        CHECK(mpl_find_free(&r, s) == (int)s, "find_free(%u) = %d with every slot FREE", s, mpl_find_free(&r, s));
    contract_out_of_range(&r);

    /* Edges out of FREE other than E1 are refused. */
    CHECK_RC(mpl_slot_release(&r, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_wait(&r, 0, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_wait(&r, 0, -1), MPL_ESTATE); /* must not block on a FREE slot */
    CHECK_RC(mpl_slot_begin(&r, 0, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 0, 0, 0), MPL_ESTATE);
    CHECK_STATE(&r, 0, MPL_FREE);

    /* E1 and what may not follow it */
    CHECK_RC(mpl_slot_assign(&r, 0, 7), MPL_OK);
    CHECK_STATE(&r, 0, MPL_ASSIGNED);
    CHECK(mpl_slot_meta_of(&r, 0)->seq == 7, "meta.seq %" PRIu64 " after assign(7)", mpl_slot_meta_of(&r, 0)->seq);
    CHECK_RC(mpl_slot_assign(&r, 0, 8), MPL_ESTATE);
    CHECK(mpl_slot_meta_of(&r, 0)->seq == 7, "a refused assign(8) changed meta.seq to %" PRIu64,
          mpl_slot_meta_of(&r, 0)->seq);
    CHECK(mpl_find_free(&r, 0) == 1, "find_free(0) = %d with slot 0 ASSIGNED", mpl_find_free(&r, 0));
    CHECK(mpl_find_free(&r, 3) == 3, "find_free(3) = %d", mpl_find_free(&r, 3));
    CHECK_RC(mpl_slot_release(&r, 0), MPL_ESTATE);
    expect_timeout(&r, 0, 0);
    expect_timeout(&r, 0, 30 * MS);
    CHECK_STATE(&r, 0, MPL_ASSIGNED);
    CHECK_RC(mpl_slot_begin(&r, 0, 8), MPL_ESTATE);
    CHECK_RC(mpl_slot_begin(&r, 0, 7), MPL_OK);

    /* E2 */
    uint64_t key = pat_key(99, 7);
    pat_fill(mpl_slot_payload(&r, 0), 0, 800, key);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, MPL_FLAG_INBAND, 800, 16, 64), MPL_OK);
    CHECK_STATE(&r, 0, MPL_READY);
    /* A second publish (a confused or stale worker) is refused and must not touch the header. */
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_ERROR, 0, 5, 1, 1), MPL_ESTATE);
    CHECK_RC(mpl_slot_assign(&r, 0, 9), MPL_ESTATE);
    CHECK_RC(mpl_slot_release(&r, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_begin(&r, 0, 7), MPL_ESTATE);
    CHECK_STATE(&r, 0, MPL_READY);

    /* E3: already READY, so even a zero timeout succeeds */
    CHECK_RC(mpl_slot_wait(&r, 0, 0), MPL_OK);
    CHECK_STATE(&r, 0, MPL_LEASED);
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    CHECK(m->seq == 7 && m->used == 800 && m->kind == MPL_KIND_SLOT && m->flags == MPL_FLAG_INBAND &&
              m->desc_off == 16 && m->desc_len == 64 && m->worker_pid == (int32_t)getpid() && m->grow_count == 0,
          "READY header wrong (after a refused second publish?): seq %" PRIu64 " used %" PRIu64
          " kind %u flags %u desc %" PRIu64 "+%" PRIu64 " pid %d grow_count %u",
          m->seq, m->used, m->kind, m->flags, m->desc_off, m->desc_len, (int)m->worker_pid, m->grow_count);
    CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, 800, key) < 0, "payload changed between publish and wait");

    /* Nothing but E4 leaves LEASED; a stale publish must not touch the lease's header. */
    CHECK_RC(mpl_slot_wait(&r, 0, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_wait(&r, 0, -1), MPL_ESTATE);
    CHECK_RC(mpl_slot_assign(&r, 0, 10), MPL_ESTATE);
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_begin(&r, 0, 7), MPL_ESTATE);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_PIPE, 0, 3, 0, 0), MPL_ESTATE);
    CHECK(m->used == 800 && m->kind == MPL_KIND_SLOT && m->flags == MPL_FLAG_INBAND && m->desc_off == 16 &&
              m->desc_len == 64,
          "a refused publish on a LEASED slot rewrote its header: used %" PRIu64 " kind %u flags %u desc %" PRIu64
          "+%" PRIu64,
          m->used, m->kind, m->flags, m->desc_off, m->desc_len);
    CHECK_STATE(&r, 0, MPL_LEASED);

    /* E4 */
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    CHECK_STATE(&r, 0, MPL_FREE);
    CHECK_RC(mpl_slot_release(&r, 0), MPL_ESTATE);
    CHECK_STATE(&r, 0, MPL_FREE);

    /* E5 from ASSIGNED; from READY the header says ESTATE, ring.c frees it: accept either, consistently. */
    CHECK_RC(mpl_slot_assign(&r, 1, 11), MPL_OK);
    CHECK_RC(mpl_slot_reclaim(&r, 1), MPL_OK);
    CHECK_STATE(&r, 1, MPL_FREE);
    CHECK_RC(mpl_slot_reclaim(&r, 1), MPL_ESTATE);
    CHECK_RC(mpl_slot_begin(&r, 1, 11), MPL_ESTATE); /* the abandoned batch's worker is refused */
    CHECK_RC(mpl_slot_assign(&r, 1, 12), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 1, 12), MPL_OK);
    CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_SLOT, 0, 0, 0, 0), MPL_OK);
    rc = mpl_slot_reclaim(&r, 1);
    if (rc == MPL_OK) {
        CHECK_STATE(&r, 1, MPL_FREE);
    } else {
        CHECK(rc == MPL_ESTATE, "reclaim of a READY slot returned %s", rc_name(rc));
        CHECK_STATE(&r, 1, MPL_READY);
        CHECK_RC(mpl_slot_wait(&r, 1, 0), MPL_OK);
        CHECK_RC(mpl_slot_release(&r, 1), MPL_OK);
    }

    /* find_free is cyclic from `start` */
    for (uint32_t s = 0; s < 4; s++)
        CHECK_RC(mpl_slot_assign(&r, s, 20 + s), MPL_OK);
    for (uint32_t s = 0; s < 4; s++)
        CHECK(mpl_find_free(&r, s) == -1, "find_free(%u) = %d with no slot FREE", s, mpl_find_free(&r, s));
    CHECK_RC(mpl_slot_reclaim(&r, 2), MPL_OK);
    CHECK(mpl_find_free(&r, 3) == 2, "find_free(3) = %d, only slot 2 FREE", mpl_find_free(&r, 3));
    CHECK(mpl_find_free(&r, 0) == 2, "find_free(0) = %d, only slot 2 FREE", mpl_find_free(&r, 0));
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_OK);
    CHECK(mpl_find_free(&r, 1) == 2, "find_free(1) = %d, slots 0 and 2 FREE", mpl_find_free(&r, 1));
    CHECK(mpl_find_free(&r, 3) == 0, "find_free(3) = %d, slots 0 and 2 FREE", mpl_find_free(&r, 3));
    CHECK_RC(mpl_slot_reclaim(&r, 1), MPL_OK);
    CHECK_RC(mpl_slot_reclaim(&r, 3), MPL_OK);
    for (uint32_t s = 0; s < 4; s++)
        CHECK_STATE(&r, s, MPL_FREE);

    mpl_region_close_fd(&r);
    CHECK(r.fd == -1, "fd %d after close_fd", r.fd);
    mpl_region_close_fd(&r);
    CHECK(fd_count() == fd0, "%d fds left open after close_fd", fd_count() - fd0);
    mpl_region_unmap(&r);
    mpl_region_unmap(&r);
}

static void contract_grow(void) {
    snprintf(g_who, sizeof g_who, "contract/grow");
    mpl_region r;
    int rc = mpl_region_create(&r, 3, 0, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(3, 0, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    uint64_t hend = headers_end(&r);
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 1);
    uint64_t key = pat_key(5, 1);
    CHECK_RC(mpl_slot_assign(&r, 1, 1), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 1, 1), MPL_OK);
    uint32_t gc0 = m->grow_count;
    do_grow(&r, 1, 1, 100, 0, key);
    pat_fill(mpl_slot_payload(&r, 1), 0, 100, key);
    do_grow(&r, 1, 1, 300000, 100, key);
    pat_fill(mpl_slot_payload(&r, 1), 100, 300000, key);
    uint64_t off300k = m->offset;
    do_grow(&r, 1, 1, 5000, 5000, key); /* smaller than the current capacity: in place, the tail given back */
    CHECK(m->offset == off300k && m->capacity == 8192 && mpl_slot_span(&r, 1) == page_up(300000),
          "grow to 5000 from 300000: [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64 ", expected [%" PRIu64
          ", +8192) span %" PRIu64,
          m->offset, m->capacity, mpl_slot_span(&r, 1), off300k, page_up(300000));
    CHECK(m->grow_count == gc0 + 3, "grow_count %u after 3 grows from %u", m->grow_count, gc0);
    CHECK(m->offset >= hend, "grown payload overlaps the headers");
    CHECK(mpl_region_size_hint(&r) >= 300000, "size hint %" PRIu64 " after a grow to 300000",
          mpl_region_size_hint(&r));
    for (uint32_t s = 0; s < 3; s++)
        for (uint32_t t = 0; t < s; t++) {
            mpl_slot_meta *a = mpl_slot_meta_of(&r, s), *b = mpl_slot_meta_of(&r, t);
            CHECK(!ranges_overlap(a->offset, a->capacity, b->offset, b->capacity), "slots %u and %u overlap", s, t);
        }
    CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_SLOT, MPL_FLAG_GROWN, 5000, 0, 5000), MPL_OK);
    CHECK_RC(mpl_slot_wait(&r, 1, 1000 * MS), MPL_OK);
    CHECK(m->used == 5000 && m->capacity >= 5000 && m->grow_count == gc0 + 3 && m->flags == MPL_FLAG_GROWN,
          "header after grows: used %" PRIu64 " capacity %" PRIu64 " grow_count %u flags %u", m->used, m->capacity,
          m->grow_count, m->flags);
    CHECK(pat_bad(mpl_slot_payload(&r, 1), 0, 5000, key) < 0, "grown payload wrong at the parent");
    uint64_t off = m->offset, cap = m->capacity;
    CHECK_RC(mpl_slot_release(&r, 1), MPL_OK);
    /* The slot keeps its size for the next batch (it was sized on first use). */
    CHECK_RC(mpl_slot_assign(&r, 1, 2), MPL_OK);
    CHECK(m->offset == off && m->capacity == cap, "assign moved the payload (%" PRIu64 "+%" PRIu64 " -> %" PRIu64
          "+%" PRIu64 ")", off, cap, m->offset, m->capacity);
    CHECK_RC(mpl_slot_reclaim(&r, 1), MPL_OK);
    mpl_region_unmap(&r);
}

/* ENOSPACE leaves the slot (and the reservation) as it was. */
static void contract_enospace(void) {
    snprintf(g_who, sizeof g_who, "contract/enospace");
    mpl_region r;
    uint64_t reserve = 1ull << 20;
    int rc = mpl_region_create(&r, 2, 4096, reserve);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 4096, 1 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    CHECK(r.reserve_bytes >= reserve, "reserve %" PRIu64 " < requested %" PRIu64, r.reserve_bytes, reserve);
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    uint64_t key = pat_key(6, 1);
    CHECK_RC(mpl_slot_assign(&r, 0, 1), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 0, 1), MPL_OK);
    pat_fill(mpl_slot_payload(&r, 0), 0, 4096, key);
    uint64_t needs[4] = {r.reserve_bytes + 1, r.reserve_bytes, UINT64_MAX, UINT64_MAX - 100};
    for (int i = 0; i < 4; i++) {
        uint64_t off = m->offset, cap = m->capacity, fb = mpl_region_file_bytes(&r);
        uint32_t gc = m->grow_count;
        rc = mpl_slot_grow(&r, 0, needs[i], 4096);
        CHECK(rc == MPL_ENOSPACE || (rc == MPL_EINVAL && needs[i] > (UINT64_MAX >> 1)),
              "grow(need %" PRIu64 ") in a %" PRIu64 "-byte reservation returned %s (errno %d: %s), expected "
              "MPL_ENOSPACE",
              needs[i], r.reserve_bytes, rc_name(rc), errno, strerror(errno));
        CHECK(m->offset == off && m->capacity == cap && m->grow_count == gc,
              "a refused grow(need %" PRIu64 ") changed the slot", needs[i]);
        CHECK(mpl_region_file_bytes(&r) == fb, "a refused grow(need %" PRIu64 ") used up %" PRIu64 " bytes", needs[i],
              mpl_region_file_bytes(&r) - fb);
        CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, 4096, key) < 0, "a refused grow changed the payload");
    }
    /* The slot still works: a grow that fits, then publish and lease. */
    do_grow(&r, 0, 1, 100000, 4096, key);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, MPL_FLAG_GROWN, 4096, 0, 0), MPL_OK);
    CHECK_RC(mpl_slot_wait(&r, 0, 0), MPL_OK);
    CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, 4096, key) < 0, "payload wrong after grow");
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    mpl_region_unmap(&r);
}

/* create: bad arguments fail and leave no fd behind. */
static void contract_create(void) {
    snprintf(g_who, sizeof g_who, "contract/create");
    int fd0 = fd_count();
    mpl_region r;
    int rc = mpl_region_create(&r, 0, 4096, 0);
    CHECK(rc == MPL_EINVAL, "create with 0 slots returned %s", rc_name(rc));
    /* Absurd slot sizes must fail (not wrap around to a small region). */
    uint64_t huge[2] = {UINT64_MAX, UINT64_MAX - 4000};
    for (int i = 0; i < 2; i++) {
        rc = mpl_region_create(&r, 2, huge[i], 0);
        CHECK(rc == MPL_EINVAL || rc == MPL_ESYS, "create(2 slots, slot_bytes %" PRIu64 ") returned %s", huge[i],
              rc_name(rc));
        if (rc == MPL_OK)
            mpl_region_unmap(&r);
    }
    CHECK(fd_count() == fd0, "failed creates left %d fds open", fd_count() - fd0);
}

/* A worker that began (and grew) its slot dies without publishing: the parent times
 * out, reaps it, reclaims the slot, and the slot works again. */
static void contract_dead_worker(void) {
    snprintf(g_who, sizeof g_who, "contract/dead-worker");
    mpl_region r;
    int rc = mpl_region_create(&r, 3, 0, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(3, 0, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    /* slot 2: a lease the parent holds throughout; the dead worker must not touch it */
    uint64_t k2 = pat_key(7, 50);
    CHECK_RC(mpl_slot_assign(&r, 2, 50), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 2, 50), MPL_OK);
    do_grow(&r, 2, 50, 20000, 0, k2);
    pat_fill(mpl_slot_payload(&r, 2), 0, 20000, k2);
    CHECK_RC(mpl_slot_publish(&r, 2, MPL_KIND_SLOT, MPL_FLAG_GROWN, 20000, 0, 0), MPL_OK);
    CHECK_RC(mpl_slot_wait(&r, 2, 0), MPL_OK);

    CHECK_RC(mpl_slot_assign(&r, 0, 100), MPL_OK);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        die_sys("fork");
    if (pid == 0) {
        g_is_child = 1;
        snprintf(g_who, sizeof g_who, "contract/dead-worker child");
        CHECK_RC(mpl_region_populate(&r), MPL_OK);
        CHECK_RC(mpl_slot_begin(&r, 0, 100), MPL_OK);
        do_grow(&r, 0, 100, 50000, 0, pat_key(7, 100));
        pat_fill(mpl_slot_payload(&r, 0), 0, 30000, pat_key(7, 100));
        _exit(0); /* dies holding the slot ASSIGNED */
    }
    int status;
    if (waitpid(pid, &status, 0) != pid)
        die_sys("waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "dead-worker child failed (status 0x%x)", status);
    CHECK_STATE(&r, 0, MPL_ASSIGNED);
    expect_timeout(&r, 0, 0);
    expect_timeout(&r, 0, 20 * MS);
    CHECK_RC(mpl_slot_release(&r, 0), MPL_ESTATE);
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_OK);
    CHECK_STATE(&r, 0, MPL_FREE);
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_ESTATE);
    CHECK(mpl_find_free(&r, 0) == 0, "reclaimed slot not found free");
    /* reuse: this process plays the worker */
    uint64_t key = pat_key(7, 101);
    CHECK_RC(mpl_slot_assign(&r, 0, 101), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 0, 100), MPL_ESTATE);
    CHECK_RC(mpl_slot_begin(&r, 0, 101), MPL_OK);
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    if (m->capacity < 70000)
        do_grow(&r, 0, 101, 70000, 0, key);
    pat_fill(mpl_slot_payload(&r, 0), 0, 70000, key);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 70000, 0, 0), MPL_OK);
    CHECK_RC(mpl_slot_wait(&r, 0, 1000 * MS), MPL_OK);
    CHECK(m->seq == 101 && m->used == 70000, "reused slot header: seq %" PRIu64 " used %" PRIu64, m->seq, m->used);
    CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, 70000, key) < 0, "reused slot payload wrong");
    mpl_slot_meta *m2 = mpl_slot_meta_of(&r, 2);
    CHECK(!ranges_overlap(m->offset, m->capacity, m2->offset, m2->capacity), "reused slot overlaps a lease");
    CHECK(pat_bad(mpl_slot_payload(&r, 2), 0, 20000, k2) < 0, "the held lease (slot 2) was clobbered");
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    CHECK_RC(mpl_slot_release(&r, 2), MPL_OK);
    mpl_region_unmap(&r);
}

/* grow(need, preserve) with preserve > need: the copy must stay inside the new range
 * (clamped) or the call must be refused.  Run in a child: an overflow past the file
 * end is a SIGBUS. */
static void contract_preserve_gt_need(void) {
    snprintf(g_who, sizeof g_who, "contract/preserve>need");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 0, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 0, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    CHECK_RC(mpl_slot_assign(&r, 0, 1), MPL_OK);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        die_sys("fork");
    if (pid == 0) {
        g_is_child = 1;
        snprintf(g_who, sizeof g_who, "contract/preserve>need child");
        uint64_t key = pat_key(8, 1);
        mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
        CHECK_RC(mpl_slot_begin(&r, 0, 1), MPL_OK);
        do_grow(&r, 0, 1, 65536, 0, key);
        pat_fill(mpl_slot_payload(&r, 0), 0, 65536, key);
        uint64_t off = m->offset, cap = m->capacity;
        rc = mpl_slot_grow(&r, 0, 100, 32768);
        if (rc == MPL_OK) {
            CHECK(m->capacity >= 100, "capacity %" PRIu64, m->capacity);
            CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, 100, key) < 0, "preserved bytes lost");
        } else {
            CHECK(rc == MPL_EINVAL, "grow(100, preserve 32768) returned %s", rc_name(rc));
            CHECK(m->offset == off && m->capacity == cap, "a refused grow changed the slot");
        }
        /* a later carve must not find its pages written by the earlier copy */
        uint32_t gc = m->grow_count;
        rc = mpl_slot_grow(&r, 0, 65536, 0);
        CHECK(rc == MPL_OK && m->grow_count == gc + 1, "grow after that returned %s", rc_name(rc));
        _exit(0);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid)
        die_sys("waitpid");
    if (WIFSIGNALED(status))
        FAIL("mpl_slot_grow(need 100, preserve 32768) on a 64 KiB slot killed the worker with signal %d (%s): the "
             "preserve copy is not clamped to the new range",
             WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit status 0x%x", status);
    mpl_region_unmap(&r);
}

static uint64_t file_alloc_bytes(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        die_sys("fstat memfd");
    return (uint64_t)st.st_blocks * 512u;
}

/* mpl_region_populate: must not bring back memory grow gave back, and must work
 * while another process grows slots. */
static void contract_populate(void) {
    snprintf(g_who, sizeof g_who, "contract/populate");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 0, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 0, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    CHECK_RC(mpl_slot_assign(&r, 0, 1), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 0, 1), MPL_OK);
    do_grow(&r, 0, 1, 4u << 20, 0, 0);
    do_grow(&r, 0, 1, 4096, 0, 0); /* gives the 4 MiB range back */
    uint64_t before = file_alloc_bytes(r.fd);
    CHECK_RC(mpl_region_populate(&r), MPL_OK);
    uint64_t after = file_alloc_bytes(r.fd);
    CHECK(after < before + (1u << 20),
          "mpl_region_populate re-allocated %" PRIu64 " KiB of payload ranges that mpl_slot_grow had released "
          "(memfd allocation %" PRIu64 " -> %" PRIu64 " KiB)",
          (after - before) >> 10, before >> 10, after >> 10);

    /* populate in one process while another grows (a worker starting while others work) */
    int ready[2], stop[2];
    if (pipe(ready) != 0 || pipe(stop) != 0)
        die_sys("pipe");
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        die_sys("fork");
    if (pid == 0) {
        g_is_child = 1;
        snprintf(g_who, sizeof g_who, "contract/populate child");
        close(ready[0]);
        close(stop[1]);
        char c = 1;
        if (write(ready[1], &c, 1) != 1)
            _exit(5);
        for (int i = 0; i < 20000; i++) {
            rc = mpl_region_populate(&r);
            if (rc != MPL_OK)
                FAIL("mpl_region_populate returned %s (errno %d: %s) on iteration %d while another process grows "
                     "a slot",
                     rc_name(rc), errno, strerror(errno), i);
            struct pollfd pf = {stop[0], POLLIN, 0};
            if (poll(&pf, 1, 0) > 0)
                break;
        }
        _exit(0);
    }
    close(ready[1]);
    close(stop[0]);
    char c;
    if (read(ready[0], &c, 1) != 1)
        die_sys("read ready");
    for (int i = 0; i < 4000; i++)
        do_grow(&r, 0, 1, 4096u * (1u + (uint32_t)i % 3u), 0, 0);
    close(stop[1]);
    int status;
    if (waitpid(pid, &status, 0) != pid)
        die_sys("waitpid");
    if (WIFSIGNALED(status))
        FAIL("populate child killed by signal %d (%s) while another process grew a slot", WTERMSIG(status),
             strsignal(WTERMSIG(status)));
    else
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "mpl_region_populate failed while another process grew a slot (child status 0x%x)", status);
    close(ready[0]);
    mpl_region_unmap(&r);
}

/* ---- watch_parent ------------------------------------------------------ */

typedef struct {
    int life_w;   /* the worker holds it open: EOF on the read end = the worker is dead */
    int hold_r;   /* the worker blocks reading it */
    int ping_r;   /* byte from the middle process: "your forking thread is gone, answer" */
    int pong_w;   /* the worker's answer */
    int info_w;   /* middle -> test: the worker's pid */
    int from_thread;
    int line_r;   /* lifeline mode: the parent's lifeline (read end), else -1 */
    int line_w;   /* lifeline mode: its write end, which the worker closes */
} watch_args_t;

static void watch_worker(watch_args_t *a, pid_t parent) {
    if (a->line_w >= 0)
        close(a->line_w);
    if (mpl_watch_parent(parent, a->line_r) != MPL_OK)
        _exit(10);
    char c = 1;
    if (a->from_thread) {
        /* The thread that forked us has exited by the time the ping comes. */
        if (read(a->ping_r, &c, 1) != 1)
            _exit(12);
        if (write(a->pong_w, &c, 1) != 1)
            _exit(13);
    }
    ssize_t n = read(a->hold_r, &c, 1); /* blocks until killed, or the test gives up */
    (void)n;
    _exit(11);
}

static void *watch_fork_thread(void *arg) {
    watch_args_t *a = arg;
    pid_t parent = getpid();
    pid_t b = fork();
    if (b == 0)
        watch_worker(a, parent);
    if (b < 0 || write(a->info_w, &b, sizeof b) != (ssize_t)sizeof b)
        _exit(8);
    return NULL; /* the forking thread ends: PR_SET_PDEATHSIG would fire here */
}

/* watch_parent: the worker survives the exit of the *thread* that forked it, dies
 * (SIGKILL) within 1 s of its parent *process*, and exits at once when the parent is
 * already gone (reaped, or a zombie).
 * mode 0: pidfd.  mode 1: pidfd_open refused (MPLOADER_TEST_REFUSE_PIDFD), the
 * parent's lifeline pipe instead.  mode 2: as 1, and another child of the parent
 * (a "stray") holds the lifeline's write end too: getppid() must catch the exit. */
static void contract_watch_parent_mode(int mode) {
    snprintf(g_who, sizeof g_who, "contract/watch-parent/%s", mode == 0 ? "pidfd" : mode == 1 ? "lifeline" : "stray");
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
        die_sys("prctl(PR_SET_CHILD_SUBREAPER)");
    int info[2], life[2], hold[2], ping[2], pong[2], go[2], stray_go[2];
    if (pipe(info) != 0 || pipe(life) != 0 || pipe(hold) != 0 || pipe(ping) != 0 || pipe(pong) != 0 ||
        pipe(go) != 0 || pipe(stray_go) != 0)
        die_sys("pipe");
    fflush(NULL);
    pid_t a = fork();
    if (a < 0)
        die_sys("fork");
    if (a == 0) { /* middle process: the worker's parent; forks it from a helper thread */
        g_is_child = 1;
        close(info[0]);
        close(life[0]);
        close(hold[1]);
        close(pong[0]);
        close(go[1]);
        close(stray_go[1]);
        int line[2] = {-1, -1};
        if (mode > 0) {
            if (pipe2(line, O_CLOEXEC) != 0)
                _exit(5);
            if (setenv("MPLOADER_TEST_REFUSE_PIDFD", mode == 1 ? "EPERM" : "ENOSYS", 1) != 0)
                _exit(5);
        }
        if (mode == 2) { /* the stray: holds the lifeline's write end until told to go */
            pid_t s = fork();
            if (s < 0)
                _exit(5);
            if (s == 0) {
                close(life[1]); /* the test sees the worker's end by EOF on life[0] */
                char c;
                ssize_t n = read(stray_go[0], &c, 1);
                (void)n;
                _exit(0);
            }
        }
        close(stray_go[0]);
        watch_args_t wa = {life[1], hold[0], ping[0], pong[1], info[1], 1, line[0], line[1]};
        pthread_t t;
        if (pthread_create(&t, NULL, watch_fork_thread, &wa) != 0 || pthread_join(t, NULL) != 0)
            _exit(6);
        char c = 1;
        if (write(ping[1], &c, 1) != 1)
            _exit(7);
        if (read(go[0], &c, 1) < 0) /* the test closes go[1] when it wants us dead */
            _exit(9);
        _exit(0);
    }
    close(info[1]);
    close(life[1]);
    close(hold[0]);
    close(ping[0]);
    close(ping[1]);
    close(pong[1]);
    close(go[0]);
    close(stray_go[0]);
    pid_t b = -1;
    if (read(info[0], &b, sizeof b) != (ssize_t)sizeof b) {
        FAIL("no worker pid from the middle process");
    }
    /* 1. The forking thread has exited (joined) before the ping: the worker answers. */
    struct pollfd pf = {pong[0], POLLIN, 0};
    char c = 0;
    int answered = poll(&pf, 1, 5000) > 0 && read(pong[0], &c, 1) == 1;
    CHECK(answered, "the worker did not survive the exit of the thread that forked it");
    /* 2. The parent process exits: the worker dies within 1 s. */
    close(go[1]);
    int status;
    if (waitpid(a, &status, 0) != a)
        die_sys("waitpid middle");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "middle process status 0x%x", status);
    int64_t t0 = now_ns();
    pf.fd = life[0];
    int dead = poll(&pf, 1, 1000) > 0 && read(life[0], &c, 1) == 0;
    int64_t dt = now_ns() - t0;
    if (!dead) {
        close(hold[1]); /* let it go */
        hold[1] = -1;
    }
    if (b > 0) {
        if (waitpid(b, &status, 0) != b)
            die_sys("waitpid worker");
        CHECK(dead && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
              "worker of a dead parent not killed within 1 s (after %" PRId64 " ms; status 0x%x)", (int64_t)(dt / MS), status);
    }
    close(stray_go[1]); /* the stray (mode 2) exits; it was re-parented to us */
    if (mode == 2 && waitpid(-1, &status, 0) < 0)
        die_sys("waitpid stray");
    close(info[0]);
    close(life[0]);
    close(pong[0]);
    if (hold[1] >= 0)
        close(hold[1]);
    if (prctl(PR_SET_CHILD_SUBREAPER, 0) != 0)
        die_sys("prctl(PR_SET_CHILD_SUBREAPER, 0)");
}

/* A parent already gone: exit(1) at once -- reaped (ESRCH) or a zombie (pidfd
 * readable); with pidfd_open refused, a lifeline whose write end is closed.  And a
 * refusal without a lifeline is an error (MPL_ESYS, the refusal's errno). */
static void contract_watch_parent_gone(void) {
    snprintf(g_who, sizeof g_who, "contract/watch-parent/gone");
    int status;
    fflush(NULL);
    pid_t gone = fork();
    if (gone < 0)
        die_sys("fork");
    if (gone == 0)
        _exit(0);
    siginfo_t si;
    if (waitid(P_PID, (id_t)gone, &si, WEXITED | WNOWAIT) != 0) /* a zombie now, not reaped */
        die_sys("waitid");
    for (int reaped = 0; reaped < 2; reaped++) {
        if (reaped && waitpid(gone, &status, 0) != gone)
            die_sys("waitpid");
        pid_t w = fork();
        if (w < 0)
            die_sys("fork");
        if (w == 0) {
            g_is_child = 1;
            int rc = mpl_watch_parent(gone, -1);
            _exit(rc == MPL_OK ? 20 : 21);
        }
        if (waitpid(w, &status, 0) != w)
            die_sys("waitpid");
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1,
              "mpl_watch_parent of a %s parent: status 0x%x, expected exit status 1", reaped ? "reaped" : "zombie",
              status);
    }
    /* Refused, lifeline closed by the parent: gone at once.  Refused, no lifeline:
     * MPL_ESYS with the refusal's errno (ENOSYS, or EPERM as seccomp answers). */
    for (int k = 0; k < 3; k++) {
        int line[2];
        if (pipe2(line, O_CLOEXEC) != 0)
            die_sys("pipe2");
        fflush(NULL);
        pid_t w = fork();
        if (w < 0)
            die_sys("fork");
        if (w == 0) {
            g_is_child = 1;
            close(line[1]);
            if (setenv("MPLOADER_TEST_REFUSE_PIDFD", k == 2 ? "EPERM" : "1", 1) != 0)
                _exit(24);
            errno = 0;
            int rc = mpl_watch_parent(getppid(), k == 0 ? line[0] : -1);
            int want = k == 2 ? EPERM : ENOSYS;
            _exit(rc == MPL_OK ? 20 : rc == MPL_ESYS && errno == want ? 22 : 23);
        }
        close(line[0]);
        close(line[1]); /* k == 0: the lifeline's only write end is gone */
        if (waitpid(w, &status, 0) != w)
            die_sys("waitpid");
        int want = k == 0 ? 1 : 22;
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == want,
              "mpl_watch_parent refused, %s: status 0x%x, expected exit status %d",
              k == 0 ? "lifeline closed" : "no lifeline", status, want);
    }
}

static void contract_watch_parent(void) {
    for (int mode = 0; mode < 3; mode++)
        contract_watch_parent_mode(mode);
    contract_watch_parent_gone();
}

/* ---- descriptors kept off the standard streams --------------------------- */

static int fd_cloexec(int fd) { return (fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0; }

/* With fds 0..2 closed (a daemonised process), every descriptor the ring creates
 * -- the region's memfd, an attached region's duplicate, a pidfd, the watcher's
 * lifeline duplicate -- is >= 3 and close-on-exec; mpl_fd_off_stdio moves a low one
 * and leaves a high one alone.  Run in a child: it closes its standard streams. */
static void contract_fds(void) {
    snprintf(g_who, sizeof g_who, "contract/fds");
    fflush(NULL);
    pid_t c = fork();
    if (c < 0)
        die_sys("fork");
    if (c == 0) {
        g_is_child = 1;
        int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (devnull < 0)
            _exit(40);
        int err = fcntl(2, F_DUPFD_CLOEXEC, 3); /* keep a stderr for failures below */
        close(0);
        close(1);
        close(2);
        mpl_region r, att;
        if (mpl_region_create(&r, 2, 4096, 0) != MPL_OK)
            _exit(41);
        if (r.fd < 3 || !fd_cloexec(r.fd))
            _exit(42);
        uint64_t magic;
        uint32_t version;
        if (mpl_region_attach(&att, r.fd, &magic, &version) != MPL_OK)
            _exit(43);
        if (att.fd < 3 || !fd_cloexec(att.fd))
            _exit(44);
        int pfd = mpl_pidfd_open(getpid());
        if (pfd < 3 || !fd_cloexec(pfd))
            _exit(45);
        int low = dup(devnull); /* 0: the lowest free */
        if (low != 0)
            _exit(46);
        int moved = mpl_fd_off_stdio(low);
        if (moved < 3 || !fd_cloexec(moved) || fcntl(0, F_GETFD) != -1 || errno != EBADF)
            _exit(47);
        if (mpl_fd_off_stdio(moved) != moved || mpl_fd_off_stdio(-1) != -1)
            _exit(48);
        /* The lifeline's duplicate: the watcher thread polls it; nothing at 0..2. */
        int line[2];
        if (pipe2(line, O_CLOEXEC) != 0 || setenv("MPLOADER_TEST_REFUSE_PIDFD", "1", 1) != 0)
            _exit(49);
        if (mpl_watch_parent(getppid(), line[0]) != MPL_OK)
            _exit(50);
        for (int fd = 0; fd < 3; fd++)
            if (fcntl(fd, F_GETFD) != -1 && fd != line[0] && fd != line[1])
                _exit(51 + fd);
        (void)err;
        mpl_region_unmap(&att);
        mpl_region_unmap(&r);
        _exit(0);
    }
    int status;
    if (waitpid(c, &status, 0) != c)
        die_sys("waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "descriptors with fds 0..2 closed: child status 0x%x (see the _exit codes in contract_fds)", status);
}

/* ---- waiter bit --------------------------------------------------------- */

typedef struct {
    mpl_region *r;
    uint32_t slot;
    int rc;
} waiter_arg_t;

static void *waiter_thread(void *arg) {
    waiter_arg_t *w = arg;
    w->rc = mpl_slot_wait(w->r, w->slot, 5000 * MS);
    return NULL;
}

/* E2 makes the FUTEX_WAKE system call only when the parent announced itself with
 * MPL_WAITER; a timed-out wait leaves the bit, which every edge tolerates. */
static void contract_waiter(void) {
    snprintf(g_who, sizeof g_who, "contract/waiter");
    mpl_region r;
    int rc = mpl_region_create(&r, 3, 4096, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(3, 4096, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    uint64_t w0 = mpl_region_wake_count(&r);
    /* nobody waits: no wake */
    CHECK_RC(mpl_slot_assign(&r, 0, 1), MPL_OK);
    CHECK(mpl_slot_word(&r, 0) == MPL_ASSIGNED, "word 0x%x after assign", mpl_slot_word(&r, 0));
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 0, 0, 0), MPL_OK);
    CHECK(mpl_region_wake_count(&r) == w0, "publish with no waiter made %" PRIu64 " FUTEX_WAKE calls",
          mpl_region_wake_count(&r) - w0);
    CHECK_RC(mpl_slot_wait(&r, 0, 0), MPL_OK);
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    /* a sleeping waiter: the bit is set before it sleeps, publish wakes it once */
    CHECK_RC(mpl_slot_assign(&r, 1, 2), MPL_OK);
    waiter_arg_t wa = {&r, 1, -100};
    pthread_t t;
    if (pthread_create(&t, NULL, waiter_thread, &wa) != 0)
        die_sys("pthread_create");
    int64_t t0 = now_ns();
    while (!(mpl_slot_word(&r, 1) & MPL_WAITER) && now_ns() - t0 < 5000 * MS)
        sched_yield(); /* the waiter sets the bit before it sleeps (the condition, not a delay) */
    CHECK(mpl_slot_word(&r, 1) == (MPL_ASSIGNED | MPL_WAITER), "word 0x%x while the parent waits",
          mpl_slot_word(&r, 1));
    CHECK_STATE(&r, 1, MPL_ASSIGNED); /* the bit is masked for everyone else */
    CHECK_RC(mpl_slot_begin(&r, 1, 2), MPL_OK);
    CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_SLOT, 0, 0, 0, 0), MPL_OK);
    pthread_join(t, NULL);
    CHECK(wa.rc == MPL_OK, "the waiter got %s", rc_name(wa.rc));
    CHECK(mpl_region_wake_count(&r) == w0 + 1, "publish to a sleeping waiter made %" PRIu64 " FUTEX_WAKE calls",
          mpl_region_wake_count(&r) - w0);
    CHECK(mpl_slot_word(&r, 1) == MPL_LEASED, "word 0x%x after the wait", mpl_slot_word(&r, 1));
    CHECK_RC(mpl_slot_release(&r, 1), MPL_OK);
    /* a wait that timed out leaves the bit; begin, grow, shrink, reclaim and publish cope */
    CHECK_RC(mpl_slot_assign(&r, 2, 3), MPL_OK);
    expect_timeout(&r, 2, 5 * MS);
    CHECK(mpl_slot_word(&r, 2) == (MPL_ASSIGNED | MPL_WAITER), "word 0x%x after a timed-out wait",
          mpl_slot_word(&r, 2));
    CHECK_RC(mpl_slot_begin(&r, 2, 3), MPL_OK);
    CHECK_RC(mpl_slot_grow(&r, 2, 20000, 0), MPL_OK);
    CHECK_RC(mpl_slot_shrink(&r, 2, 100), MPL_OK);
    CHECK_RC(mpl_slot_reclaim(&r, 2), MPL_OK);
    CHECK(mpl_slot_word(&r, 2) == MPL_FREE, "word 0x%x after reclaiming a waited-on slot", mpl_slot_word(&r, 2));
    CHECK_RC(mpl_slot_assign(&r, 2, 4), MPL_OK);
    expect_timeout(&r, 2, 1 * MS);
    uint64_t w1 = mpl_region_wake_count(&r);
    CHECK_RC(mpl_slot_publish(&r, 2, MPL_KIND_SLOT, 0, 0, 0, 0), MPL_OK);
    CHECK(mpl_slot_word(&r, 2) == MPL_READY, "word 0x%x after publish", mpl_slot_word(&r, 2));
    CHECK(mpl_region_wake_count(&r) == w1 + 1, "a stale waiter bit must still wake (it cannot tell)");
    CHECK_RC(mpl_slot_wait(&r, 2, 0), MPL_OK);
    CHECK_RC(mpl_slot_release(&r, 2), MPL_OK);
    mpl_region_unmap(&r);
}

/* ---- shrink, size hint ---------------------------------------------------- */

static uint64_t file_alloc_bytes(int fd);

static void contract_trim(void) {
    snprintf(g_who, sizeof g_who, "contract/trim");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 2u << 20, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 2 MiB, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    uint64_t key = pat_key(12, 1);
    uint64_t off = m->offset, cap = m->capacity, fb = mpl_region_file_bytes(&r), alloc = file_alloc_bytes(r.fd);
    CHECK_RC(mpl_slot_trim(&r, 2, 0), MPL_EINVAL);          /* out of range */
    CHECK_RC(mpl_slot_assign(&r, 1, 1), MPL_OK);
    CHECK_RC(mpl_slot_trim(&r, 1, 0), MPL_ESTATE);          /* ASSIGNED: a worker's */
    CHECK_RC(mpl_slot_trim(&r, 0, 5000), MPL_OK);           /* FREE: the parent's */
    CHECK(m->offset == off && m->capacity == cap, "trim moved the range: offset %" PRIu64 "->%" PRIu64
          " capacity %" PRIu64 "->%" PRIu64, off, m->offset, cap, m->capacity);
    CHECK(mpl_region_file_bytes(&r) == fb, "trim used address space");
    uint64_t alloc2 = file_alloc_bytes(r.fd);
    CHECK(alloc2 + (2u << 20) - 8192 <= alloc, "trim to 8 KiB returned only %" PRIu64 " of ~2 MiB", alloc - alloc2);
    CHECK_RC(mpl_slot_trim(&r, 0, 1u << 30), MPL_OK);       /* above the capacity: nothing */
    /* the trimmed slot is written again in full, without a grow */
    CHECK_RC(mpl_slot_assign(&r, 0, 2), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 0, 2), MPL_OK);
    pat_fill(mpl_slot_payload(&r, 0), 0, cap, key);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, cap, 0, 0), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad = 99;
    CHECK_RC(mpl_slot_take(&r, 0, 0, 0, &snap, &bad), MPL_OK);
    CHECK(bad == MPL_FIELD_NONE && snap.offset == off, "take after trim");
    CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, cap, key) < 0, "the rewritten payload after trim is wrong");
    CHECK_RC(mpl_slot_trim(&r, 0, 0), MPL_ESTATE);          /* LEASED: a view may read it */
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    CHECK_RC(mpl_slot_trim(&r, 0, 0), MPL_OK);
    CHECK_RC(mpl_slot_reclaim(&r, 1), MPL_OK);
    mpl_region_unmap(&r);
}

static void contract_shrink(void) {
    snprintf(g_who, sizeof g_who, "contract/shrink");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 0, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 0, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    uint64_t key = pat_key(11, 1);
    CHECK_RC(mpl_slot_shrink(&r, 0, 0), MPL_ESTATE); /* FREE: not ours */
    CHECK_RC(mpl_slot_assign(&r, 0, 1), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 0, 1), MPL_OK);
    do_grow(&r, 0, 1, 2u << 20, 0, key);
    pat_fill(mpl_slot_payload(&r, 0), 0, 2u << 20, key);
    uint64_t off = m->offset, fb = mpl_region_file_bytes(&r), alloc = file_alloc_bytes(r.fd);
    uint32_t gc = m->grow_count;
    CHECK_RC(mpl_slot_shrink(&r, 0, 5000), MPL_OK);
    CHECK(m->offset == off && m->capacity == 8192 && m->grow_count == gc,
          "shrink to 5000: offset %" PRIu64 "->%" PRIu64 " capacity %" PRIu64 " grow_count %u->%u", off, m->offset,
          m->capacity, gc, m->grow_count);
    CHECK(pat_bad(mpl_slot_payload(&r, 0), 0, 5000, key) < 0, "shrink changed the kept bytes");
    CHECK(mpl_region_file_bytes(&r) == fb, "shrink used address space");
    uint64_t alloc2 = file_alloc_bytes(r.fd);
    CHECK(alloc2 + (2u << 20) - 8192 <= alloc, "shrink to 8 KiB returned only %" PRIu64 " of ~2 MiB",
          alloc - alloc2);
    CHECK_RC(mpl_slot_shrink(&r, 0, 1u << 30), MPL_OK); /* above the capacity: nothing */
    CHECK(m->capacity == 8192 && m->offset == off, "shrink above the capacity changed the slot");
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 9000, 0, 0), MPL_EINVAL); /* past the new capacity */
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 5000, 0, 10), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad = 99;
    CHECK_RC(mpl_slot_take(&r, 0, 0, 0, &snap, &bad), MPL_OK);
    CHECK(bad == MPL_FIELD_NONE && snap.used == 5000 && snap.capacity == 8192, "take after shrink");
    CHECK_RC(mpl_slot_shrink(&r, 0, 0), MPL_ESTATE); /* LEASED: not the worker's */
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    /* to zero, then grown again */
    CHECK_RC(mpl_slot_assign(&r, 0, 2), MPL_OK);
    CHECK_RC(mpl_slot_shrink(&r, 0, 0), MPL_OK);
    CHECK(m->capacity == 0, "shrink to 0: capacity %" PRIu64, m->capacity);
    do_grow(&r, 0, 2, 3000, 0, key);
    CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 3000, 0, 0), MPL_OK);
    CHECK_RC(mpl_slot_take(&r, 0, 0, 0, &snap, &bad), MPL_OK);
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    /* size hint: note_size only raises, set_size_hint lowers */
    mpl_region_note_size(&r, 1000);
    CHECK(mpl_region_size_hint(&r) == (2u << 20), "note_size lowered the hint to %" PRIu64,
          mpl_region_size_hint(&r));
    mpl_region_set_size_hint(&r, 4096);
    CHECK(mpl_region_size_hint(&r) == 4096, "set_size_hint(4096) left %" PRIu64, mpl_region_size_hint(&r));
    mpl_region_unmap(&r);
}

/* ---- spans: a shrunk slot grows again in place --------------------------------- */

/* One batch in slot 0 of `r` for seq: begin, optionally shrink to `shrink_to` first
 * (UINT64_MAX: no shrink), grow to `need`, fill, publish, take, check, release. */
static void span_batch(mpl_region *r, uint64_t seq, uint64_t shrink_to, uint64_t need) {
    uint64_t key = pat_key(21, seq);
    mpl_slot_meta *m = mpl_slot_meta_of(r, 0);
    CHECK_RC(mpl_slot_assign(r, 0, seq), MPL_OK);
    CHECK_RC(mpl_slot_begin(r, 0, seq), MPL_OK);
    if (shrink_to != UINT64_MAX)
        CHECK_RC(mpl_slot_shrink(r, 0, shrink_to), MPL_OK);
    if (need > m->capacity)
        do_grow(r, 0, seq, need, 0, key);
    pat_fill(mpl_slot_payload(r, 0), 0, need, key);
    CHECK_RC(mpl_slot_publish(r, 0, MPL_KIND_SLOT, 0, need, 0, 0), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad = 99;
    CHECK_RC(mpl_slot_take(r, 0, 0, 0, &snap, &bad), MPL_OK);
    CHECK(bad == MPL_FIELD_NONE && snap.used == need, "seq %" PRIu64 ": take refused field %u", seq, bad);
    CHECK(pat_bad(mpl_slot_payload(r, 0), 0, need, key) < 0, "seq %" PRIu64 ": payload wrong at the parent", seq);
    CHECK_RC(mpl_slot_release(r, 0), MPL_OK);
}

/* Issue 26: each outlier used to take a fresh range of the reservation, because the
 * slot was shrunk after it and grown again for the next one.  Now the slot keeps its
 * range (span) through shrink and trim and grows in place up to it: 150 outliers in a
 * 16 MiB reservation, which 150 fresh ranges of 256 KiB would overflow twice. */
static void contract_span(void) {
    snprintf(g_who, sizeof g_who, "contract/span");
    const uint64_t BIG = 256u << 10;
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 0, 16u << 20);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 0, 16 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    CHECK(mpl_slot_span(&r, 0) == 0 && m->capacity == 0, "fresh empty slot: span %" PRIu64, mpl_slot_span(&r, 0));
    span_batch(&r, 1, UINT64_MAX, BIG); /* the first outlier: a fresh range */
    uint64_t off = m->offset, span = mpl_slot_span(&r, 0), fb = mpl_region_file_bytes(&r);
    CHECK(span == BIG && m->capacity == span, "after a 256 KiB grow: capacity %" PRIu64 " span %" PRIu64,
          m->capacity, span);
    /* 300 batches, not more: under TSan each costs ~10 ms here */
    for (uint64_t seq = 2; seq < 302; seq++) {
        /* odd: a small batch after shrinking the outlier's slot (the worker's policy);
         * even: the next outlier, grown in place (the parent trims before, sometimes) */
        int outlier = seq % 2 == 0;
        if (outlier && seq % 6 == 0)
            CHECK_RC(mpl_slot_trim(&r, 0, 0), MPL_OK);
        uint64_t alloc = file_alloc_bytes(r.fd);
        span_batch(&r, seq, outlier ? UINT64_MAX : 4096, outlier ? BIG - 4096 * (seq % 4) : 100);
        CHECK(m->offset == off && mpl_slot_span(&r, 0) == span, "seq %" PRIu64 ": range moved to [%" PRIu64
              ", span %" PRIu64 ") from [%" PRIu64 ", span %" PRIu64 ")", seq, m->offset, mpl_slot_span(&r, 0),
              off, span);
        if (!outlier)
            CHECK(m->capacity == 4096 && file_alloc_bytes(r.fd) + BIG - 4 * 4096 <= alloc,
                  "seq %" PRIu64 ": shrink kept capacity %" PRIu64 " and gave back %" PRId64 " bytes", seq,
                  m->capacity, (int64_t)alloc - (int64_t)file_alloc_bytes(r.fd));
    }
    CHECK(mpl_region_file_bytes(&r) == fb, "150 outliers used %" PRIu64 " bytes of address space",
          mpl_region_file_bytes(&r) - fb);
    /* just beyond the span: a fresh range of 1.5 x the span, the pages past the capacity
     * holes; then a grow up to it is in place */
    uint64_t alloc0 = file_alloc_bytes(r.fd);
    span_batch(&r, 850, 4096, BIG + 4096);
    CHECK(m->capacity == BIG + 4096 && mpl_slot_span(&r, 0) == BIG + BIG / 2 && m->offset >= off + span,
          "grow just past the span %" PRIu64 ": [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64 ", expected span %" PRIu64,
          span, m->offset, m->capacity, mpl_slot_span(&r, 0), BIG + BIG / 2);
    CHECK(file_alloc_bytes(r.fd) <= alloc0 + m->capacity, "the fresh range's holes hold memory: %" PRIu64 " -> %" PRIu64
          " for a capacity of %" PRIu64, alloc0, file_alloc_bytes(r.fd), m->capacity);
    off = m->offset;
    span = mpl_slot_span(&r, 0);
    span_batch(&r, 851, 4096, BIG + BIG / 2);
    CHECK(m->offset == off && m->capacity == span, "a grow to the new span moved the slot");
    /* far beyond the span: a fresh range of exactly the new capacity, the old range given back */
    uint64_t alloc = file_alloc_bytes(r.fd);
    span_batch(&r, 900, 4096, (2u << 20) + 1);
    CHECK(m->offset >= off + span && mpl_slot_span(&r, 0) == (2u << 20) + 4096 && m->capacity == (2u << 20) + 4096,
          "grow past the span: [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64, m->offset, m->capacity,
          mpl_slot_span(&r, 0));
    CHECK(file_alloc_bytes(r.fd) <= alloc + (2u << 20) + 4096, "the old range was not given back");
    /* the reservation used up: a grow in place still works, a fresh range is refused */
    uint64_t span2 = mpl_slot_span(&r, 0), off2 = m->offset;
    CHECK_RC(mpl_slot_assign(&r, 1, 901), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 1, 901), MPL_OK);
    uint64_t left = r.reserve_bytes - mpl_region_file_bytes(&r);
    if (left)
        do_grow(&r, 1, 901, left, 0, 0);
    CHECK_RC(mpl_slot_grow(&r, 1, 2 * left + 4096, 0), MPL_ENOSPACE);
    CHECK_RC(mpl_slot_reclaim(&r, 1), MPL_OK);
    span_batch(&r, 902, 0, span2);
    CHECK(m->offset == off2 && m->capacity == span2, "grow in place in a full reservation moved the slot");
    CHECK_RC(mpl_slot_assign(&r, 0, 903), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 0, 903), MPL_OK);
    CHECK_RC(mpl_slot_grow(&r, 0, span2 + 1, 0), MPL_ENOSPACE);
    CHECK(m->offset == off2 && m->capacity == span2 && mpl_slot_span(&r, 0) == span2, "a refused grow changed the slot");
    /* a span a stray writer broke is not trusted: the grow takes a fresh range (refused here: full) */
    CHECK_RC(mpl_slot_shrink(&r, 0, 0), MPL_OK);
    hdr_of(&r, 0)->span = r.reserve_bytes * 4;     /* past the reservation */
    CHECK_RC(mpl_slot_grow(&r, 0, span2, 0), MPL_ENOSPACE);
    hdr_of(&r, 0)->span = span2 + 1;               /* not page-aligned */
    CHECK_RC(mpl_slot_grow(&r, 0, 4096, 0), MPL_ENOSPACE);
    hdr_of(&r, 0)->span = span2;
    CHECK_RC(mpl_slot_grow(&r, 0, span2, 0), MPL_OK);
    CHECK(m->offset == off2 && m->capacity == span2, "grow in place after the span was restored moved the slot");
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_OK);
    mpl_region_unmap(&r);

    /* 1.5 x the span does not fit the reservation, the capacity does: exactly the capacity */
    rc = mpl_region_create(&r, 1, 0, 1u << 20);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(1, 0, 1 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    m = mpl_slot_meta_of(&r, 0);
    span_batch(&r, 1, UINT64_MAX, 480u << 10);     /* file end 488 KiB of 1 MiB */
    span_batch(&r, 2, 0, 500u << 10);              /* 720 KiB would not fit, 500 KiB does */
    CHECK(m->capacity == (500u << 10) && mpl_slot_span(&r, 0) == (500u << 10),
          "near a full reservation: capacity %" PRIu64 " span %" PRIu64, m->capacity, mpl_slot_span(&r, 0));
    mpl_region_unmap(&r);

    /* pinned: a punched range is never faulted in again, the grow takes a fresh range */
    rc = mpl_region_create(&r, 1, 0, 64u << 20);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(1, 0, 64 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    m = mpl_slot_meta_of(&r, 0);
    CHECK(mpl_region_pinned(&r) == 0, "a new region is pinned");
    span_batch(&r, 1, UINT64_MAX, 1u << 20);
    mpl_region_set_pinned(&r);
    mpl_region_set_pinned(&r);
    CHECK(mpl_region_pinned(&r) == 1, "set_pinned did not stick");
    off = m->offset;
    span_batch(&r, 2, 8192, 100);                  /* shrinking stays in place */
    CHECK(m->offset == off && m->capacity == 8192, "shrink in a pinned region moved the slot");
    fb = mpl_region_file_bytes(&r);
    span_batch(&r, 3, UINT64_MAX, 1u << 20);       /* regrow: fresh */
    CHECK(m->offset >= off + (1u << 20) && mpl_region_file_bytes(&r) == fb + (1u << 20),
          "a regrow in a pinned region reused its punched range (offset %" PRIu64 ", was %" PRIu64 ")", m->offset,
          off);
    mpl_region_unmap(&r);
}

/* One batch of `need` bytes in `slot` (seq): assign, begin, grow to fit, fill,
 * publish, take, check, release; then park the slot when `park`. */
static void pool_batch(mpl_region *r, uint32_t slot, uint64_t seq, uint64_t need, int park) {
    uint64_t key = pat_key(31, seq);
    mpl_slot_meta *m = mpl_slot_meta_of(r, slot);
    CHECK_RC(mpl_slot_assign(r, slot, seq), MPL_OK);
    CHECK_RC(mpl_slot_begin(r, slot, seq), MPL_OK);
    if (need > m->capacity)
        do_grow(r, slot, seq, need, 0, key);
    pat_fill(mpl_slot_payload(r, slot), 0, need, key);
    CHECK_RC(mpl_slot_publish(r, slot, MPL_KIND_SLOT, 0, need, 0, 0), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad = 99;
    CHECK_RC(mpl_slot_take(r, slot, 0, 0, &snap, &bad), MPL_OK);
    CHECK(bad == MPL_FIELD_NONE, "seq %" PRIu64 ": take refused field %u", seq, bad);
    CHECK(pat_bad(mpl_slot_payload(r, slot), 0, need, key) < 0, "seq %" PRIu64 ": payload wrong at the parent", seq);
    CHECK_RC(mpl_slot_release(r, slot), MPL_OK);
    if (park)
        CHECK_RC(mpl_slot_park(r, slot), MPL_OK);
}

/* The pool of spare ranges: a range a slot gave up (mpl_slot_park after an outlier,
 * or a grow that moved it) serves the next grow of any slot, so outliers that land
 * in ever other slots use the address space of those in flight, not of every slot
 * they ever visited: 16 slots take turns with 1 MiB outliers in an 8 MiB
 * reservation, which spans kept per slot (16 MiB) would overflow. */
static void contract_pool(void) {
    snprintf(g_who, sizeof g_who, "contract/pool");
    mpl_region r;
    int rc = mpl_region_create(&r, 16, 0, 8u << 20);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(16, 0, 8 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    const uint64_t BIG = 1u << 20;
    mpl_slot_meta *m0 = mpl_slot_meta_of(&r, 0), *m1 = mpl_slot_meta_of(&r, 1);
    pool_batch(&r, 0, 1, BIG, 0);
    uint64_t off0 = m0->offset, fb = mpl_region_file_bytes(&r), alloc = file_alloc_bytes(r.fd);
    CHECK_RC(mpl_slot_park(&r, 0), MPL_OK);
    CHECK(m0->offset == r.payload_off && m0->capacity == 0 && mpl_slot_span(&r, 0) == 0,
          "parked slot 0: [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64, m0->offset, m0->capacity, mpl_slot_span(&r, 0));
    CHECK(file_alloc_bytes(r.fd) + BIG <= alloc, "park kept the pages: %" PRIu64 " -> %" PRIu64,
          alloc, file_alloc_bytes(r.fd));
    CHECK_RC(mpl_slot_park(&r, 0), MPL_OK); /* empty: nothing to give */
    pool_batch(&r, 1, 2, BIG - 4096, 0);    /* another slot's outlier takes the parked range */
    CHECK(m1->offset == off0 && m1->capacity == BIG - 4096 && mpl_slot_span(&r, 1) == BIG &&
              mpl_region_file_bytes(&r) == fb,
          "slot 1 took [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64 " (file %" PRIu64 " -> %" PRIu64
          "), expected the parked range at %" PRIu64,
          m1->offset, m1->capacity, mpl_slot_span(&r, 1), fb, mpl_region_file_bytes(&r), off0);
    /* a small need does not take a large spare range */
    CHECK_RC(mpl_slot_park(&r, 1), MPL_OK);
    pool_batch(&r, 2, 3, 4096, 0);
    CHECK(mpl_slot_meta_of(&r, 2)->offset != off0, "a 4 KiB batch took the 1 MiB spare range");
    /* a grow that moves a slot gives its old range to the pool: the next small need takes it */
    uint64_t off2 = mpl_slot_meta_of(&r, 2)->offset;
    pool_batch(&r, 2, 4, BIG, 0);
    CHECK(mpl_slot_meta_of(&r, 2)->offset == off0, "slot 2's outlier did not take the spare range");
    fb = mpl_region_file_bytes(&r);
    pool_batch(&r, 3, 5, 100, 0);
    CHECK(mpl_slot_meta_of(&r, 3)->offset == off2 && mpl_region_file_bytes(&r) == fb,
          "slot 3's 100 bytes went to %" PRIu64 ", not slot 2's old range at %" PRIu64,
          mpl_slot_meta_of(&r, 3)->offset, off2);
    /* park refuses a slot that is not FREE */
    CHECK_RC(mpl_slot_assign(&r, 4, 6), MPL_OK);
    CHECK_RC(mpl_slot_park(&r, 4), MPL_ESTATE);
    CHECK_RC(mpl_slot_reclaim(&r, 4), MPL_OK);
    CHECK_RC(mpl_slot_park(&r, 16), MPL_EINVAL);
    /* outliers taking turns over the 16 slots, each parked once FREE (the parent's
     * budget), small batches between: the address space stops growing */
    uint64_t seq = 100;
    for (uint32_t i = 0; i < 16; i++)
        pool_batch(&r, i, seq++, 4096, i == 2); /* slot 2 holds the 1 MiB range: parked */
    fb = mpl_region_file_bytes(&r);
    /* 80 rounds: each slot takes 5 outliers; spans kept per slot would overflow the
     * reservation within the first 16 rounds */
    for (uint32_t round = 0; round < 80; round++) {
        uint32_t s = (round * 5) % 16;
        pool_batch(&r, s, seq++, BIG - 4096 * (round % 3), 1);
        pool_batch(&r, s, seq++, 4096, 0);
        pool_batch(&r, (s + 1) % 16, seq++, 2048, 0);
    }
    CHECK(mpl_region_file_bytes(&r) <= fb + 2 * BIG, "80 outliers over 16 slots used %" PRIu64 " KiB of address "
          "space (file %" PRIu64 " -> %" PRIu64 ")", (mpl_region_file_bytes(&r) - fb) >> 10, fb,
          mpl_region_file_bytes(&r));
    mpl_region_unmap(&r);

    /* pinned: park refuses (punched pages are never faulted in again) */
    rc = mpl_region_create(&r, 1, 4096, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(1, 4096, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    mpl_region_set_pinned(&r);
    uint64_t off = mpl_slot_meta_of(&r, 0)->offset;
    CHECK_RC(mpl_slot_park(&r, 0), MPL_ESTATE);
    CHECK(mpl_slot_meta_of(&r, 0)->offset == off && mpl_slot_meta_of(&r, 0)->capacity == 4096,
          "a refused park changed the slot");
    mpl_region_unmap(&r);
}

/* ---- take: header validation ---------------------------------------------- */

typedef struct {
    const char *what;
    int field;        /* which meta field to overwrite */
    uint64_t value;
    uint32_t want;    /* MPL_FIELD_* expected */
} corrupt_t;

enum { F_KIND, F_OFFSET, F_CAPACITY, F_USED, F_DESC_OFF, F_DESC_LEN };

static void contract_take(void) {
    snprintf(g_who, sizeof g_who, "contract/take");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 3 * 4096, 1ull << 24);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 12 KiB, 16 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 1);
    uint64_t good_off = m->offset, fsize = mpl_region_file_bytes(&r);
    corrupt_t cases[] = {
        {"kind NONE", F_KIND, MPL_KIND_NONE, MPL_FIELD_KIND},
        {"kind 7", F_KIND, 7, MPL_FIELD_KIND},
        {"offset not page-aligned", F_OFFSET, good_off + 8, MPL_FIELD_OFFSET},
        {"offset in the headers", F_OFFSET, 0, MPL_FIELD_OFFSET},
        {"offset past the file", F_OFFSET, fsize + (1u << 20), MPL_FIELD_OFFSET},
        {"offset past the reservation", F_OFFSET, r.reserve_bytes + 4096, MPL_FIELD_OFFSET},
        {"offset 2^63", F_OFFSET, 1ull << 63, MPL_FIELD_OFFSET},
        {"capacity past the file", F_CAPACITY, 1u << 20, MPL_FIELD_CAPACITY},
        {"capacity 2^62", F_CAPACITY, 1ull << 62, MPL_FIELD_CAPACITY},
        {"capacity not page-aligned", F_CAPACITY, 4097, MPL_FIELD_CAPACITY},
        {"used > capacity", F_USED, 3 * 4096 + 1, MPL_FIELD_USED},
        {"used 2^40", F_USED, 1ull << 40, MPL_FIELD_USED},
        {"desc_off > used", F_DESC_OFF, 101, MPL_FIELD_DESC_OFF},
        {"desc_len past used", F_DESC_LEN, 91, MPL_FIELD_DESC_LEN},
        {"desc_len 2^64-1", F_DESC_LEN, UINT64_MAX, MPL_FIELD_DESC_LEN},
    };
    uint64_t seq = 10;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++, seq++) {
        corrupt_t *k = &cases[i];
        CHECK_RC(mpl_slot_assign(&r, 1, seq), MPL_OK);
        CHECK_RC(mpl_slot_begin(&r, 1, seq), MPL_OK);
        if (m->capacity < 3 * 4096) /* a previous case reset the range */
            do_grow(&r, 1, seq, 3 * 4096, 0, 0);
        CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_SLOT, 0, 100, 10, 80), MPL_OK);
        switch (k->field) { /* a stray writer, after the publish */
        case F_KIND: m->kind = (uint32_t)k->value; break;
        case F_OFFSET: m->offset = k->value; break;
        case F_CAPACITY: m->capacity = k->value; break;
        case F_USED: m->used = k->value; break;
        case F_DESC_OFF: m->desc_off = k->value; break;
        default: m->desc_len = k->value; break;
        }
        mpl_slot_meta snap;
        uint32_t bad = 99;
        rc = mpl_slot_take(&r, 1, 0, 0, &snap, &bad);
        CHECK(rc == MPL_ECORRUPT && bad == k->want, "%s: take returned %s, field %u (expected MPL_ECORRUPT, %u)",
              k->what, rc_name(rc), bad, k->want);
        CHECK_STATE(&r, 1, MPL_FREE);
        if (k->want == MPL_FIELD_OFFSET || k->want == MPL_FIELD_CAPACITY)
            CHECK(m->capacity == 0 && m->offset == r.payload_off, "%s: range not reset (%" PRIu64 "+%" PRIu64 ")",
                  k->what, m->offset, m->capacity);
        CHECK(m->used == 0 && m->kind == MPL_KIND_NONE, "%s: header not cleared", k->what);
    }
    /* the slot works again after every repair */
    CHECK_RC(mpl_slot_assign(&r, 1, seq), MPL_OK);
    CHECK_RC(mpl_slot_begin(&r, 1, seq), MPL_OK);
    do_grow(&r, 1, seq, 200000, 0, 0);
    CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_ERROR, 0, 200000, 5, 7), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad = 99;
    CHECK_RC(mpl_slot_take(&r, 1, 0, 0, &snap, &bad), MPL_OK);
    CHECK(bad == MPL_FIELD_NONE && memcmp(&snap, m, sizeof snap) == 0, "snapshot differs from the header");
    CHECK_RC(mpl_slot_take(&r, 1, 0, 0, &snap, &bad), MPL_ESTATE); /* LEASED: no second lease */
    CHECK_RC(mpl_slot_release(&r, 1), MPL_OK);
    /* a grown range cannot be checked once the memfd is closed: EBADF, slot FREE */
    CHECK_RC(mpl_slot_assign(&r, 1, seq + 1), MPL_OK);
    do_grow(&r, 1, seq + 1, 400000, 0, 0);
    CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_SLOT, 0, 10, 0, 0), MPL_OK);
    mpl_region_close_fd(&r);
    errno = 0;
    CHECK_RC(mpl_slot_take(&r, 1, 0, 0, &snap, &bad), MPL_ESYS);
    CHECK(errno == EBADF, "errno %d after take on a closed region", errno);
    CHECK_STATE(&r, 1, MPL_FREE);
    mpl_region_unmap(&r);
}

/* begin refuses (and resets) a payload range a stray writer broke, so the worker
 * never writes outside its slot or past the file. */
static void contract_begin_corrupt(void) {
    snprintf(g_who, sizeof g_who, "contract/begin-corrupt");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 4096, 1ull << 24);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 4096, 16 MiB) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    mpl_slot_meta *m = mpl_slot_meta_of(&r, 0);
    uint64_t fsize = mpl_region_file_bytes(&r);
    struct { const char *what; int off; uint64_t value; } cases[] = {
        {"offset not page-aligned", 1, m->offset + 8},
        {"offset in the headers", 1, 0},
        {"offset past the file", 1, fsize + (1u << 20)},
        {"offset past the reservation", 1, r.reserve_bytes + 4096},
        {"capacity past the file", 0, 1u << 22},
        {"capacity 2^62", 0, 1ull << 62},
    };
    for (uint64_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint64_t seq = 100 + i;
        CHECK_RC(mpl_slot_assign(&r, 0, seq), MPL_OK);
        if (cases[i].off)
            m->offset = cases[i].value;
        else
            m->capacity = cases[i].value;
        rc = mpl_slot_begin(&r, 0, seq);
        CHECK(rc == MPL_ECORRUPT, "%s: begin returned %s", cases[i].what, rc_name(rc));
        CHECK(m->offset == r.payload_off && m->capacity == 0, "%s: range not reset", cases[i].what);
        CHECK(mpl_slot_check_range(&r, m->offset, m->capacity) == MPL_FIELD_NONE, "%s: reset range refused",
              cases[i].what);
        CHECK_RC(mpl_slot_begin(&r, 0, seq), MPL_OK); /* the reset range is sane */
        do_grow(&r, 0, seq, 5000, 0, 0);
        CHECK_RC(mpl_slot_publish(&r, 0, MPL_KIND_ERROR, 0, 5000, 0, 5000), MPL_OK);
        mpl_slot_meta snap;
        uint32_t bad;
        CHECK_RC(mpl_slot_take(&r, 0, 0, 0, &snap, &bad), MPL_OK);
        CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    }
    mpl_region_unmap(&r);
}

typedef struct {
    mpl_region *r;
    uint32_t slot;
    int64_t timeout_ns, spin_ns;
    int rc;
} spinner_arg_t;

static void *spinner_thread(void *arg) {
    spinner_arg_t *a = arg;
    mpl_slot_meta snap;
    uint32_t bad;
    a->rc = mpl_slot_take(a->r, a->slot, a->timeout_ns, a->spin_ns, &snap, &bad);
    return NULL;
}

/* Spinning before sleeping: a publish during the spin needs no wake; the spin never
 * outlasts the timeout. */
static void contract_spin(void) {
    snprintf(g_who, sizeof g_who, "contract/spin");
    mpl_region r;
    int rc = mpl_region_create(&r, 2, 4096, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(2, 4096, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    uint64_t w0 = mpl_region_wake_count(&r);
    CHECK_RC(mpl_slot_assign(&r, 1, 1), MPL_OK);
    spinner_arg_t sa = {&r, 1, 10000 * MS, 5000 * MS, -100};
    pthread_t t;
    if (pthread_create(&t, NULL, spinner_thread, &sa) != 0)
        die_sys("pthread_create");
    CHECK_RC(mpl_slot_publish(&r, 1, MPL_KIND_SLOT, 0, 0, 0, 0), MPL_OK);
    pthread_join(t, NULL);
    CHECK(sa.rc == MPL_OK, "spinning take returned %s", rc_name(sa.rc));
    CHECK(mpl_region_wake_count(&r) == w0, "a publish during the spin made %" PRIu64 " wakes",
          mpl_region_wake_count(&r) - w0);
    CHECK_RC(mpl_slot_release(&r, 1), MPL_OK);
    /* spin budget above the timeout: still ETIMEDOUT at the timeout */
    CHECK_RC(mpl_slot_assign(&r, 0, 2), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad;
    int64_t t0 = now_ns();
    CHECK_RC(mpl_slot_take(&r, 0, 20 * MS, 5000 * MS, &snap, &bad), MPL_ETIMEDOUT);
    int64_t dt = now_ns() - t0;
    CHECK(dt >= 19 * MS && dt < 2000 * MS, "take(20 ms, spin 5 s) returned after %" PRId64 " ms",
          (int64_t)(dt / MS));
    CHECK(mpl_slot_word(&r, 0) == MPL_ASSIGNED, "spin to the timeout must not announce a sleeper (0x%x)",
          mpl_slot_word(&r, 0));
    /* spin shorter than the timeout, then sleep: the bit is set */
    CHECK_RC(mpl_slot_take(&r, 0, 30 * MS, 5 * MS, &snap, &bad), MPL_ETIMEDOUT);
    CHECK(mpl_slot_word(&r, 0) == (MPL_ASSIGNED | MPL_WAITER), "word 0x%x after spin then sleep",
          mpl_slot_word(&r, 0));
    CHECK_RC(mpl_slot_reclaim(&r, 0), MPL_OK);
    mpl_region_unmap(&r);
}

/* ---- attach, magic, version ---------------------------------------------- */

static void contract_attach(void) {
    snprintf(g_who, sizeof g_who, "contract/attach");
    int fd0 = fd_count();
    mpl_region r, a;
    int rc = mpl_region_create(&r, 5, 4096, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(5, 4096, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    uint64_t magic = 0;
    uint32_t version = 0;
    CHECK_RC(mpl_region_attach(&a, r.fd, &magic, &version), MPL_OK);
    CHECK(a.nslots == 5 && a.reserve_bytes == r.reserve_bytes && a.fd >= 0 && a.fd != r.fd &&
              a.payload_off == r.payload_off,
          "attached handle: nslots %u reserve %" PRIu64 " fd %d", a.nslots, a.reserve_bytes, a.fd);
    /* the same memory through both mappings */
    CHECK_RC(mpl_slot_assign(&r, 3, 77), MPL_OK);
    CHECK_RC(mpl_slot_begin(&a, 3, 77), MPL_OK);
    memcpy(mpl_slot_payload(&a, 3), "attached", 8);
    CHECK_RC(mpl_slot_publish(&a, 3, MPL_KIND_SLOT, 0, 8, 0, 0), MPL_OK);
    mpl_slot_meta snap;
    uint32_t bad;
    CHECK_RC(mpl_slot_take(&r, 3, 0, 0, &snap, &bad), MPL_OK);
    CHECK(memcmp(mpl_slot_payload(&r, 3), "attached", 8) == 0, "payload not shared");
    CHECK_RC(mpl_slot_release(&r, 3), MPL_OK);
    CHECK_RC(mpl_region_populate(&a), MPL_OK);
    mpl_region_unmap(&a);
    CHECK(a.fd == -1 && a.base == NULL, "unmap of an attached region");
    /* version and magic: attach and populate refuse */
    uint32_t *ver = (uint32_t *)(r.base + 8);
    uint64_t *mag = (uint64_t *)r.base;
    *ver = MPL_LAYOUT_VERSION + 1;
    CHECK_RC(mpl_region_attach(&a, r.fd, &magic, &version), MPL_EVERSION);
    CHECK(version == MPL_LAYOUT_VERSION + 1 && a.fd == -1 && a.base == NULL, "EVERSION: version %u", version);
    CHECK_RC(mpl_region_populate(&r), MPL_EVERSION);
    *ver = MPL_LAYOUT_VERSION;
    *mag ^= 1;
    CHECK_RC(mpl_region_attach(&a, r.fd, &magic, &version), MPL_EMAGIC);
    CHECK(magic == (MPL_MAGIC ^ 1), "EMAGIC: found %" PRIx64, magic);
    CHECK_RC(mpl_region_populate(&r), MPL_EMAGIC);
    *mag ^= 1;
    uint32_t *ns = (uint32_t *)(r.base + 12);
    *ns = 0;
    CHECK_RC(mpl_region_attach(&a, r.fd, &magic, &version), MPL_EINVAL);
    *ns = MPL_MAX_SLOTS + 1;
    CHECK_RC(mpl_region_attach(&a, r.fd, &magic, &version), MPL_EINVAL);
    *ns = 5;
    /* not a region: an empty file, a zero-filled file */
    int e = memfd_create("not-a-region", MFD_CLOEXEC);
    if (e < 0)
        die_sys("memfd_create");
    CHECK_RC(mpl_region_attach(&a, e, &magic, &version), MPL_EMAGIC);
    if (ftruncate(e, 65536) != 0)
        die_sys("ftruncate");
    CHECK_RC(mpl_region_attach(&a, e, &magic, &version), MPL_EMAGIC);
    CHECK(magic == 0, "zero file: magic %" PRIx64, magic);
    close(e);
    errno = 0;
    CHECK_RC(mpl_region_attach(&a, e, &magic, &version), MPL_ESYS); /* closed fd */
    CHECK(errno == EBADF, "attach of a closed fd: errno %d", errno);
    mpl_region_unmap(&r);
    CHECK(fd_count() == fd0, "attach left %d fds open", fd_count() - fd0);
}

/* ---- cached pid ------------------------------------------------------------- */

static void contract_pid(void) {
    snprintf(g_who, sizeof g_who, "contract/pid");
    mpl_region r;
    int rc = mpl_region_create(&r, 1, 4096, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(1, 4096, 0) returned %s (errno %d)", rc_name(rc), errno);
        return;
    }
    CHECK(mpl_self_pid() == getpid(), "cached pid %d, getpid %d", (int)mpl_self_pid(), (int)getpid());
    CHECK_RC(mpl_slot_assign(&r, 0, 1), MPL_OK);
    fflush(NULL);
    pid_t c = fork();
    if (c < 0)
        die_sys("fork");
    if (c == 0) { /* the atfork handler refreshed the cache: publish names the child */
        g_is_child = 1;
        if (mpl_self_pid() != getpid())
            _exit(30);
        _exit(mpl_slot_publish(&r, 0, MPL_KIND_SLOT, 0, 0, 0, 0) == MPL_OK ? 0 : 31);
    }
    int status;
    if (waitpid(c, &status, 0) != c)
        die_sys("waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status 0x%x (30: stale cached pid)", status);
    mpl_slot_meta snap;
    uint32_t bad;
    CHECK_RC(mpl_slot_take(&r, 0, 0, 0, &snap, &bad), MPL_OK);
    CHECK(snap.worker_pid == c, "worker_pid %d, the publishing child was %d", (int)snap.worker_pid, (int)c);
    CHECK_RC(mpl_slot_release(&r, 0), MPL_OK);
    mpl_region_unmap(&r);
}

static void run_contract(void) {
    g_soft = 1;
    contract_states();
    contract_grow();
    contract_enospace();
    contract_create();
    contract_dead_worker();
    contract_preserve_gt_need();
    contract_populate();
    contract_watch_parent();
    contract_fds();
    contract_waiter();
    contract_shrink();
    contract_trim();
    contract_span();
    contract_pool();
    contract_take();
    contract_attach();
    contract_pid();
    contract_begin_corrupt();
    contract_spin();
    snprintf(g_who, sizeof g_who, "parent");
    g_soft = 0;
}

/* ------------------------------------------------------------------------- */
/* stress phase                                                               */

enum { M_FREE, M_INFLIGHT, M_LEASED };

typedef struct {
    int st;          /* M_* */
    uint64_t seq;    /* batch in the slot (INFLIGHT, LEASED) */
    int worker;      /* worker it was handed to */
    uint64_t cap;    /* capacity as of the last lease (what the next worker sees) */
    uint32_t gc;     /* grow_count as of the last lease */
    uint64_t off;    /* offset as of the last lease */
    uint64_t span;   /* span as of the last lease */
} slot_model_t;

typedef struct {
    uint64_t grows, out_of_order, max_held, probes, short_waits, short_timeouts, bytes, in_place, parks;
} stats_t;

static int model_find_free(const slot_model_t *sm, uint32_t n, uint32_t start) {
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = (start + k) % n;
        if (sm[i].st == M_FREE)
            return (int)i;
    }
    return -1;
}

static void report_workers(const cfg_t *cfg, const pid_t *pids) {
    if (cfg->threads)
        return;
    for (int w = 0; w < cfg->workers; w++) {
        int status;
        pid_t p = waitpid(pids[w], &status, WNOHANG);
        if (p == pids[w])
            fprintf(stderr, "test_ring: worker %d (pid %d) is gone: status 0x%x%s\n", w, (int)pids[w], status,
                    WIFSIGNALED(status) ? " (killed by a signal)" : "");
    }
}

/* The parent's check of a fresh lease against what the worker must have done. */
static void verify_lease(mpl_region *r, const cfg_t *cfg, slot_model_t *sm, uint32_t slot, const pid_t *pids,
                         uint64_t hend, stats_t *stats) {
    slot_model_t *x = &sm[slot];
    uint64_t seq = x->seq;
    mpl_slot_meta *m = mpl_slot_meta_of(r, slot);
    plan_t pl = make_plan(cfg->seed, seq, cfg->max_need, cfg->grow_pct);
    uint64_t cap0 = cap_after_shrink(&pl, x->cap);
    uint32_t grows = planned_grows(&pl, cap0);
    uint32_t flags = pl.flags | (grows ? MPL_FLAG_GROWN : 0u);
    pid_t pid = cfg->threads ? getpid() : pids[x->worker];
    CHECK_STATE(r, slot, MPL_LEASED);
    CHECK(m->seq == seq, "slot %u: meta.seq %" PRIu64 ", expected %" PRIu64, slot, m->seq, seq);
    CHECK(m->used == pl.need && m->kind == pl.kind && m->flags == flags && m->desc_off == pl.desc_off &&
              m->desc_len == pl.desc_len && m->worker_pid == (int32_t)pid,
          "seq %" PRIu64 " slot %u header: used %" PRIu64 "/%" PRIu64 " kind %u/%u flags %u/%u desc %" PRIu64
          "+%" PRIu64 "/%" PRIu64 "+%" PRIu64 " pid %d/%d (got/expected)",
          seq, slot, m->used, pl.need, m->kind, pl.kind, m->flags, flags, m->desc_off, m->desc_len, pl.desc_off,
          pl.desc_len, (int)m->worker_pid, (int)pid);
    CHECK(m->grow_count == x->gc + grows, "seq %" PRIu64 " slot %u: grow_count %u, expected %u + %u", seq, slot,
          m->grow_count, x->gc, grows);
    CHECK(m->capacity >= m->used && (grows == 0 || m->capacity >= grow_target(&pl)),
          "seq %" PRIu64 " slot %u: capacity %" PRIu64 " for used %" PRIu64, seq, slot, m->capacity, m->used);
    CHECK(m->offset >= hend && m->offset + m->capacity <= mpl_region_file_bytes(r) &&
              m->offset + m->capacity <= r->reserve_bytes,
          "seq %" PRIu64 " slot %u: payload [%" PRIu64 ", +%" PRIu64 ") outside [headers end %" PRIu64
          ", file end %" PRIu64 ")",
          seq, slot, m->offset, m->capacity, hend, mpl_region_file_bytes(r));
    CHECK(mpl_slot_payload(r, slot) == r->base + m->offset, "payload pointer is not base + offset");
    /* Spans (docs/design.md, "Growth"): a slot keeps its range through shrinks, grows
     * in place up to it, and takes a fresh range of exactly the new capacity beyond. */
    uint64_t span = mpl_slot_span(r, slot);
    CHECK(span >= m->capacity && (span & 4095) == 0 && m->offset + span <= mpl_region_file_bytes(r),
          "seq %" PRIu64 " slot %u: span %" PRIu64 " for payload [%" PRIu64 ", +%" PRIu64 ")", seq, slot, span,
          m->offset, m->capacity);
    if (grows == 0) {
        CHECK(m->offset == x->off && m->capacity == cap0 && span == x->span,
              "seq %" PRIu64 " slot %u, no grow: range [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64 ", expected [%" PRIu64
              ", +%" PRIu64 ") span %" PRIu64,
              seq, slot, m->offset, m->capacity, span, x->off, cap0, x->span);
    } else if (page_up(u64max(grow_target(&pl), 1)) <= x->span) {
        CHECK(m->offset == x->off && span == x->span && m->capacity == page_up(u64max(grow_target(&pl), 1)),
              "seq %" PRIu64 " slot %u: grow to %" PRIu64 " inside span %" PRIu64 " at %" PRIu64
              " moved: [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64,
              seq, slot, grow_target(&pl), x->span, x->off, m->offset, m->capacity, span);
        stats->in_place++;
    } else {
        /* carved: the new capacity, or 1.5 x a span close to it (<= 1.5 x the
         * capacity); from the pool: at most twice that */
        uint64_t cap = page_up(u64max(grow_target(&pl), 1));
        CHECK(m->capacity == cap && span >= cap && span <= 2 * page_up(cap + cap / 2) &&
                  (x->span == 0 || !ranges_overlap(m->offset, span, x->off, x->span)),
              "seq %" PRIu64 " slot %u: grow to %" PRIu64 " past span %" PRIu64 ": [%" PRIu64 ", +%" PRIu64
              ") span %" PRIu64 ", expected a fresh range for the new capacity",
              seq, slot, grow_target(&pl), x->span, m->offset, m->capacity, span);
    }
    /* The header check mpl_slot_take applies accepts every honest header, while
     * other processes grow the file (it re-reads the file size when needed). */
    mpl_slot_meta copy = *m;
    uint32_t field = mpl_slot_check(r, &copy);
    CHECK(copy.kind == MPL_KIND_NONE ? field == MPL_FIELD_KIND : field == MPL_FIELD_NONE,
          "seq %" PRIu64 " slot %u: mpl_slot_check refused field %u of an honest header", seq, slot, field);
    /* FREE and LEASED slots' ranges and spans are stable (only the parent moves
     * those slots); no two spans overlap (a grow in place stays inside its own). */
    for (uint32_t t = 0; t < r->nslots; t++) {
        if (t == slot || sm[t].st == M_INFLIGHT)
            continue;
        mpl_slot_meta *o = mpl_slot_meta_of(r, t);
        CHECK(!ranges_overlap(m->offset, span, o->offset, mpl_slot_span(r, t)),
              "seq %" PRIu64 " slot %u span [%" PRIu64 ", +%" PRIu64 ") overlaps %s slot %u's [%" PRIu64
              ", +%" PRIu64 ")",
              seq, slot, m->offset, span, sm[t].st == M_FREE ? "FREE" : "LEASED", t, o->offset,
              mpl_slot_span(r, t));
    }
    int64_t bad = pat_bad(mpl_slot_payload(r, slot), 0, m->used, pat_key(cfg->seed, seq));
    CHECK(bad < 0, "seq %" PRIu64 " slot %u: payload byte %" PRId64 " of %" PRIu64 " wrong", seq, slot, bad, m->used);
    x->cap = m->capacity;
    x->gc = m->grow_count;
    x->off = m->offset;
    x->span = span;
    stats->grows += grows;
    stats->bytes += m->used;
}

static void release_lease(mpl_region *r, const cfg_t *cfg, slot_model_t *sm, uint32_t slot, int park,
                          stats_t *stats) {
    slot_model_t *x = &sm[slot];
    mpl_slot_meta *m = mpl_slot_meta_of(r, slot);
    /* Still intact after being held while workers grew and wrote other slots. */
    CHECK(m->seq == x->seq, "held slot %u: meta.seq changed to %" PRIu64, slot, m->seq);
    int64_t bad = pat_bad(mpl_slot_payload(r, slot), 0, m->used, pat_key(cfg->seed, x->seq));
    CHECK(bad < 0, "held lease seq %" PRIu64 " slot %u: payload byte %" PRId64 " changed while leased", x->seq, slot,
          bad);
    CHECK_RC(mpl_slot_release(r, slot), MPL_OK);
    CHECK_STATE(r, slot, MPL_FREE);
    CHECK_RC(mpl_slot_release(r, slot), MPL_ESTATE);
    x->st = M_FREE;
    if (park) {
        /* the parent gives the FREE slot's range to the pool (as after an outlier):
         * the slot's next worker grows it from empty, from the pool or fresh */
        CHECK_RC(mpl_slot_park(r, slot), MPL_OK);
        CHECK(m->offset == r->payload_off && m->capacity == 0 && mpl_slot_span(r, slot) == 0,
              "parked slot %u: [%" PRIu64 ", +%" PRIu64 ") span %" PRIu64, slot, m->offset, m->capacity,
              mpl_slot_span(r, slot));
        x->cap = 0;
        x->off = m->offset;
        x->span = 0;
        stats->parks++;
    }
}

/* Error returns that are safe to provoke while workers run: only edges that must be
 * refused in the slot's current state (no reclaim of in-flight slots). */
static void probe(mpl_region *r, slot_model_t *sm, uint32_t slot, stats_t *stats) {
    stats->probes++;
    switch (sm[slot].st) {
    case M_FREE:
        CHECK_RC(mpl_slot_release(r, slot), MPL_ESTATE);
        CHECK_RC(mpl_slot_reclaim(r, slot), MPL_ESTATE);
        CHECK_RC(mpl_slot_wait(r, slot, 0), MPL_ESTATE);
        CHECK_STATE(r, slot, MPL_FREE);
        break;
    case M_LEASED:
        CHECK_RC(mpl_slot_assign(r, slot, UINT64_MAX), MPL_ESTATE);
        CHECK_RC(mpl_slot_reclaim(r, slot), MPL_ESTATE);
        CHECK_RC(mpl_slot_wait(r, slot, 0), MPL_ESTATE);
        CHECK_STATE(r, slot, MPL_LEASED);
        CHECK(mpl_slot_meta_of(r, slot)->seq == sm[slot].seq, "refused assign changed a lease's seq");
        break;
    case M_INFLIGHT: {
        CHECK_RC(mpl_slot_assign(r, slot, UINT64_MAX), MPL_ESTATE);
        CHECK_RC(mpl_slot_release(r, slot), MPL_ESTATE);
        uint32_t st = mpl_slot_state(r, slot);
        CHECK(st == MPL_ASSIGNED || st == MPL_READY, "in-flight slot %u is %s", slot, state_name(st));
        break;
    }
    }
}

static void send_task(int fd, uint64_t seq, uint32_t slot) {
    task_t t = {seq, slot, TASK_MAGIC};
    for (;;) {
        ssize_t n = write(fd, &t, sizeof t);
        if (n == (ssize_t)sizeof t)
            return;
        if (n < 0 && errno == EINTR)
            continue;
        die_sys("write task");
    }
}

static void run_stress(const cfg_t *cfg, stats_t *stats) {
    uint32_t n = cfg->nslots;
    int K = cfg->workers;
    mpl_region r;
    int rc = mpl_region_create(&r, n, cfg->slot_bytes, 0);
    if (rc != MPL_OK) {
        FAIL("mpl_region_create(%u, %" PRIu64 ", 0) returned %s (errno %d)", n, cfg->slot_bytes, rc_name(rc), errno);
        return;
    }
    uint64_t hend = headers_end(&r);
    slot_model_t *sm = calloc(n, sizeof *sm);
    uint32_t *held = calloc(n, sizeof *held);
    uint32_t *seq_slot = calloc(cfg->batches ? cfg->batches : 1, sizeof *seq_slot);
    pid_t *pids = calloc((size_t)K, sizeof *pids);
    int *wfd = calloc((size_t)K, sizeof *wfd);
    worker_arg_t *wargs = calloc((size_t)K, sizeof *wargs);
    if (!sm || !held || !seq_slot || !pids || !wfd || !wargs)
        die_sys("calloc");
    g_pub_ns = mmap(NULL, n * sizeof *g_pub_ns, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (g_pub_ns == MAP_FAILED)
        die_sys("mmap");
    signal(SIGUSR1, on_worker_failed);
    for (uint32_t s = 0; s < n; s++) {
        mpl_slot_meta *m = mpl_slot_meta_of(&r, s);
        CHECK(m->capacity >= cfg->slot_bytes, "slot %u capacity %" PRIu64 " < slot_bytes", s, m->capacity);
        sm[s].cap = m->capacity;
        sm[s].gc = m->grow_count;
        sm[s].off = m->offset;
        sm[s].span = mpl_slot_span(&r, s);
        CHECK(sm[s].span == m->capacity, "slot %u: span %" PRIu64 " at creation, capacity %" PRIu64, s, sm[s].span,
              m->capacity);
    }

    /* start the workers */
    int ready[2];
    if (pipe(ready) != 0)
        die_sys("pipe");
    pid_t parent = getpid();
    for (int w = 0; w < K; w++) {
        int p[2];
        if (pipe(p) != 0)
            die_sys("pipe");
        wfd[w] = p[1];
        if (cfg->threads) {
            wargs[w] = (worker_arg_t){&r, cfg, w, p[0], 0};
            if (pthread_create(&wargs[w].tid, NULL, worker_thread, &wargs[w]) != 0)
                die_sys("pthread_create");
            continue;
        }
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0)
            die_sys("fork");
        if (pid == 0) {
            g_is_child = 1;
            g_notify_pid = parent;
            snprintf(g_who, sizeof g_who, "worker %d pid %d", w, (int)getpid());
            for (int v = 0; v <= w; v++)
                close(wfd[v]);
            close(ready[0]);
            CHECK_RC(mpl_watch_parent(parent, -1), MPL_OK);
            CHECK_RC(mpl_region_populate(&r), MPL_OK);
            char c = 1;
            if (write(ready[1], &c, 1) != 1)
                _exit(4);
            close(ready[1]);
            worker_loop(&r, cfg, p[0]);
            _exit(0);
        }
        pids[w] = pid;
        close(p[0]);
    }
    close(ready[1]);
    if (!cfg->threads) {
        /* All workers have populated before any of them grows: mpl_region_populate
         * racing a grow is contract_populate's business, not this loop's. */
        for (int w = 0; w < K; w++) {
            char c;
            if (read(ready[0], &c, 1) != 1) {
                report_workers(cfg, pids);
                FAIL("worker %d of %d never became ready", w, K);
            }
        }
    }
    close(ready[0]);

    rng_t g = {mix64(cfg->seed ^ 0xa5a5a5a5ull)};
    uint64_t next_assign = 0, next_wait = 0;
    uint32_t nheld = 0, inflight = 0, cursor = 0;
    uint64_t max_need = 0;
    while (next_wait < cfg->batches) {
        /* hand out batches: sometimes only a few at a time */
        uint32_t limit = rng_below(&g, 8) == 0 ? 1 + (uint32_t)rng_below(&g, n) : n;
        while (next_assign < cfg->batches && inflight < limit) {
            uint32_t start = rng_below(&g, 2) ? cursor : (uint32_t)rng_below(&g, n);
            int s = mpl_find_free(&r, start), e = model_find_free(sm, n, start);
            CHECK(s == e, "find_free(%u) = %d, expected %d", start, s, e);
            if (s < 0)
                break;
            uint64_t seq = next_assign++;
            CHECK_RC(mpl_slot_assign(&r, (uint32_t)s, seq), MPL_OK);
            CHECK_STATE(&r, (uint32_t)s, MPL_ASSIGNED);
            CHECK(mpl_slot_meta_of(&r, (uint32_t)s)->seq == seq, "meta.seq after assign");
            int w = (int)rng_below(&g, (uint64_t)K);
            sm[s] = (slot_model_t){M_INFLIGHT, seq, w, sm[s].cap, sm[s].gc, sm[s].off, sm[s].span};
            seq_slot[seq] = (uint32_t)s;
            inflight++;
            cursor = ((uint32_t)s + 1) % n;
            send_task(wfd[w], seq, (uint32_t)s);
            max_need = u64max(max_need, make_plan(cfg->seed, seq, cfg->max_need, cfg->grow_pct).need);
        }
        if (rng_below(&g, 4) == 0)
            probe(&r, sm, (uint32_t)rng_below(&g, n), stats);

        /* the next batch in order */
        uint64_t seq = next_wait;
        uint32_t s = seq_slot[seq];
        CHECK(sm[s].st == M_INFLIGHT && sm[s].seq == seq, "model lost seq %" PRIu64, seq);
        rc = MPL_ETIMEDOUT;
        int64_t t_wait = now_ns();
        if (rng_below(&g, 8) == 0) {
            stats->short_waits++;
            rc = mpl_slot_wait(&r, s, (int64_t)rng_below(&g, 2) * 200000);
            if (rc == MPL_ETIMEDOUT) {
                stats->short_timeouts++;
                uint32_t st = mpl_slot_state(&r, s);
                CHECK(st == MPL_ASSIGNED || st == MPL_READY, "slot %u is %s after a timed-out wait", s,
                      state_name(st));
            } else {
                CHECK_RC(rc, MPL_OK);
            }
        }
        if (rc == MPL_ETIMEDOUT) {
            int64_t t0 = now_ns();
            rc = mpl_slot_wait(&r, s, STRESS_WAIT_NS);
            if (rc != MPL_OK) {
                uint32_t st = mpl_slot_state(&r, s);
                report_workers(cfg, pids);
                FAIL("wait for seq %" PRIu64 " (slot %u, worker %d) returned %s after %.3f s; the slot is %s%s", seq,
                     s, sm[s].worker, rc_name(rc), (double)(now_ns() - t0) / 1e9, state_name(st),
                     st == MPL_READY ? " (published but the wait never woke: lost wake-up)" : "");
            }
        }
        int64_t t_woke = now_ns(), t_pub = g_pub_ns[s];
        int64_t t_from = t_pub > t_wait ? t_pub : t_wait;
        CHECK(t_woke - t_from <= WAKE_LATENCY_NS,
              "wait for seq %" PRIu64 " (slot %u) returned %.3f s after the worker published: lost wake-up", seq, s,
              (double)(t_woke - t_pub) / 1e9);
        verify_lease(&r, cfg, sm, s, pids, hend, stats);
        sm[s].st = M_LEASED;
        held[nheld++] = s;
        inflight--;
        next_wait++;
        stats->max_held = u64max(stats->max_held, nheld);

        /* keep a random number of leases (at most n-1, so a slot stays for the
         * next batch); release the rest in random order */
        uint32_t keep = (uint32_t)rng_below(&g, n);
        while (nheld > keep) {
            uint32_t i = (uint32_t)rng_below(&g, nheld);
            if (i != 0)
                stats->out_of_order++;
            release_lease(&r, cfg, sm, held[i], rng_below(&g, 10) == 0, stats);
            memmove(&held[i], &held[i + 1], (nheld - i - 1) * sizeof *held);
            nheld--;
        }
    }
    while (nheld > 0) {
        uint32_t i = (uint32_t)rng_below(&g, nheld);
        release_lease(&r, cfg, sm, held[i], 0, stats);
        memmove(&held[i], &held[i + 1], (nheld - i - 1) * sizeof *held);
        nheld--;
    }

    /* stop the workers: EOF on their task pipes */
    for (int w = 0; w < K; w++)
        close(wfd[w]);
    for (int w = 0; w < K; w++) {
        if (cfg->threads) {
            if (pthread_join(wargs[w].tid, NULL) != 0)
                die_sys("pthread_join");
            close(wargs[w].rfd);
            continue;
        }
        int status;
        if (waitpid(pids[w], &status, 0) != pids[w])
            die_sys("waitpid worker");
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker %d (pid %d) ended with status 0x%x", w,
              (int)pids[w], status);
    }

    signal(SIGUSR1, SIG_DFL);
    for (uint32_t s = 0; s < n; s++) {
        CHECK_STATE(&r, s, MPL_FREE);
        CHECK(mpl_find_free(&r, s) == (int)s, "find_free(%u) = %d at the end", s, mpl_find_free(&r, s));
        mpl_slot_meta *a = mpl_slot_meta_of(&r, s);
        CHECK(a->offset >= hend && a->offset + a->capacity <= mpl_region_file_bytes(&r),
              "slot %u range outside the payload area at the end", s);
        for (uint32_t t = 0; t < s; t++) {
            mpl_slot_meta *b = mpl_slot_meta_of(&r, t);
            CHECK(!ranges_overlap(a->offset, mpl_slot_span(&r, s), b->offset, mpl_slot_span(&r, t)),
                  "slots %u and %u overlap at the end", s, t);
        }
    }
    /* the pool: spare ranges inside the payload area, holes only, disjoint from one
     * another and from every slot's span */
    for (uint32_t i = 0; i < MPL_POOL_ENTRIES; i++) {
        uint64_t v = atomic_load_explicit(&ctl_of(&r)->pool[i], memory_order_relaxed);
        if (!v)
            continue;
        uint64_t off = (v >> 30) * 4096, len = (v & ((1ull << 30) - 1)) * 4096;
        CHECK(off >= hend && len > 0 && off + len <= mpl_region_file_bytes(&r),
              "pool entry %u: [%" PRIu64 ", +%" PRIu64 ") outside the payload area", i, off, len);
        off_t data = lseek(r.fd, (off_t)off, SEEK_DATA);
        CHECK((data < 0 && errno == ENXIO) || (uint64_t)data >= off + len,
              "pool entry %u: [%" PRIu64 ", +%" PRIu64 ") holds memory at %" PRId64, i, off, len, (int64_t)data);
        for (uint32_t s = 0; s < n; s++)
            CHECK(!ranges_overlap(off, len, mpl_slot_meta_of(&r, s)->offset, mpl_slot_span(&r, s)),
                  "pool entry %u: [%" PRIu64 ", +%" PRIu64 ") overlaps slot %u's span", i, off, len, s);
        for (uint32_t j = 0; j < i; j++) {
            uint64_t w = atomic_load_explicit(&ctl_of(&r)->pool[j], memory_order_relaxed);
            CHECK(!w || !ranges_overlap(off, len, (w >> 30) * 4096, (w & ((1ull << 30) - 1)) * 4096),
                  "pool entries %u and %u overlap", i, j);
        }
    }
    uint64_t hint = mpl_region_size_hint(&r);
    CHECK(hint >= max_need, "size hint %" PRIu64 " < largest need %" PRIu64, hint, max_need);
    CHECK(hint <= u64max(cfg->slot_bytes, cfg->max_need + 5000),
          "size hint %" PRIu64 " larger than anything asked for", hint);
    mpl_region_unmap(&r);
    mpl_region_unmap(&r);
    free(sm);
    free(held);
    free(seq_slot);
    free(pids);
    free(wfd);
    free(wargs);
    munmap(g_pub_ns, n * sizeof *g_pub_ns);
    g_pub_ns = NULL;
}

/* ------------------------------------------------------------------------- */

static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static void usage(void) {
    fprintf(stderr, "usage: test_ring WORKERS BATCHES SEED [phase=all|contract|stress] [mode=fork|thread] "
                    "[slots=N] [slot_bytes=N] [max_need=N] [grow_pct=0..100] [watchdog=SECONDS]\n");
    exit(2);
}

int main(int argc, char **argv) {
    g_main_thread = pthread_self();
    setvbuf(stdout, NULL, _IOLBF, 0);
    cfg_t cfg = {.nslots = 4, .max_need = 98304, .grow_pct = 12, .do_contract = 1, .do_stress = 1, .watchdog = 60};
    uint64_t v;
    if (argc < 4)
        usage();
    if (parse_u64(argv[1], &v) || v < 1 || v > 64)
        usage();
    cfg.workers = (int)v;
    if (parse_u64(argv[2], &cfg.batches) || parse_u64(argv[3], &cfg.seed))
        usage();
    for (int i = 4; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "phase=all"))
            cfg.do_contract = cfg.do_stress = 1;
        else if (!strcmp(a, "phase=contract"))
            cfg.do_contract = 1, cfg.do_stress = 0;
        else if (!strcmp(a, "phase=stress"))
            cfg.do_contract = 0, cfg.do_stress = 1;
        else if (!strcmp(a, "mode=fork"))
            cfg.threads = 0;
        else if (!strcmp(a, "mode=thread"))
            cfg.threads = 1;
        else if (!strncmp(a, "slots=", 6) && !parse_u64(a + 6, &v) && v >= 2 && v <= 4096)
            cfg.nslots = (uint32_t)v;
        else if (!strncmp(a, "slot_bytes=", 11) && !parse_u64(a + 11, &v) && v <= (1ull << 30))
            cfg.slot_bytes = v;
        else if (!strncmp(a, "max_need=", 9) && !parse_u64(a + 9, &v) && v >= 1 && v <= (1ull << 30))
            cfg.max_need = v;
        else if (!strncmp(a, "grow_pct=", 9) && !parse_u64(a + 9, &v) && v <= 100)
            cfg.grow_pct = v;
        else if (!strncmp(a, "watchdog=", 9) && !parse_u64(a + 9, &v) && v <= 3600)
            cfg.watchdog = (unsigned)v;
        else
            usage();
    }
    signal(SIGPIPE, SIG_IGN);
    if (cfg.watchdog) {
        signal(SIGALRM, on_watchdog);
        alarm(cfg.watchdog);
    }
    int64_t t0 = now_ns();
    if (cfg.do_contract)
        run_contract();
    stats_t st = {0};
    if (cfg.do_stress)
        run_stress(&cfg, &st);
    if (g_soft_failures) {
        fprintf(stderr, "test_ring FAIL: %d contract check(s) failed (see above)\n", g_soft_failures);
        return 1;
    }
    printf("test_ring OK: phase=%s mode=%s workers=%d batches=%" PRIu64 " seed=%" PRIu64 " slots=%u slot_bytes=%" PRIu64
           " max_need=%" PRIu64 " grow_pct=%" PRIu64 " grows=%" PRIu64 " in_place=%" PRIu64 " parks=%" PRIu64 " max_held=%" PRIu64 " out_of_order_releases=%" PRIu64
           " probes=%" PRIu64 " short_waits=%" PRIu64 "/%" PRIu64 " MiB=%.1f checks=%lu time=%.2fs\n",
           cfg.do_contract && cfg.do_stress ? "all" : cfg.do_contract ? "contract" : "stress",
           cfg.threads ? "thread" : "fork", cfg.workers, cfg.batches, cfg.seed, cfg.nslots, cfg.slot_bytes,
           cfg.max_need, cfg.grow_pct, st.grows, st.in_place, st.parks, st.max_held, st.out_of_order, st.probes, st.short_timeouts, st.short_waits,
           (double)st.bytes / (1 << 20), (unsigned long)atomic_load(&g_checks), (double)(now_ns() - t0) / 1e9);
    return 0;
}
