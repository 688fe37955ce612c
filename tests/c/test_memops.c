/*
 * Standalone C11 test of csrc/memops.h (streaming copies, MADV_DOFORK); no Python.
 *
 *   test_memops
 *
 * copy: mpl_stream_copy against memcpy for every destination and source
 * misalignment 0..16 and lengths around the 16-byte head, the 64-byte rounds and
 * the tail (0 .. 1 MiB + 7): the destination buffer, guard bytes on both sides
 * included, must be byte for byte what memcpy makes of an identical buffer (the
 * fast path and the fallback give the same bits; nothing outside [dst, dst + n) is
 * written).
 * copy at the mapping's end: copies that end at the last mapped page, with unmapped
 * pages after it, where the copy's destination prefetches (two pages ahead) point;
 * no fault, memcpy's bytes.
 * dofork: a MAP_SHARED range marked MADV_DONTFORK, then mpl_madvise_dofork: a
 * forked child reads and writes it (without the call the child would fault), and
 * the parent sees the child's write; the documented failures: an address that is
 * not page-aligned (-1, EINVAL), a range with an unmapped page (-1, ENOMEM).
 *
 * Prints "test_memops OK: copies=N dofork=1" and exits 0, or prints each failure
 * as "test_memops FAIL ..." on stderr and exits 1.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MADV_DONTFORK */
#include "memops.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "test_memops FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            failures++;                                                    \
        }                                                                  \
    } while (0)

enum { GUARD = 64, ALIGN_MAX = 16 };

static long test_copy(void)
{
    static const size_t lengths[] = {0, 1, 2, 15, 16, 17, 31, 63, 64, 65, 79, 127, 128, 129,
                                     255, 1000, 4096 + 13, (1u << 20) + 7};
    const size_t max_n = (1u << 20) + 7;
    /* a multiple of 64 (aligned_alloc's rule) */
    const size_t size = (GUARD + ALIGN_MAX + max_n + GUARD + 63) & ~(size_t)63;
    /* 64-byte aligned bases, so the offsets below are the misalignments */
    unsigned char *src = aligned_alloc(64, size);
    unsigned char *got = aligned_alloc(64, size);
    unsigned char *want = aligned_alloc(64, size);
    if (!src || !got || !want) {
        fprintf(stderr, "test_memops FAIL: out of memory\n");
        exit(1);
    }
    uint64_t x = 0x9E3779B97F4A7C15u;
    for (size_t k = 0; k < size; k++) { /* xorshift64: every byte value, no period of 16 */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        src[k] = (unsigned char)x;
    }
    long copies = 0;
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        size_t n = lengths[li];
        size_t step = n > 4096 ? 5 : 1; /* the large lengths at a few offsets only */
        for (size_t d = 0; d <= ALIGN_MAX; d += step) {
            for (size_t s = 0; s <= ALIGN_MAX; s += step) {
                memset(got, 0xA5, size);
                memset(want, 0xA5, size);
                mpl_stream_copy((char *)got + GUARD + d, (const char *)src + s, n);
                mpl_stream_fence();
                memcpy(want + GUARD + d, src + s, n);
                if (memcmp(got, want, size) != 0) {
                    size_t k = 0;
                    while (got[k] == want[k])
                        k++;
                    CHECK(0, "n=%zu dst_misalign=%zu src_misalign=%zu: byte %zd differs from memcpy's",
                          n, d, s, (ssize_t)k - (ssize_t)(GUARD + d));
                }
                copies++;
            }
        }
    }
    free(src);
    free(got);
    free(want);
    return copies;
}

/* A copy that ends where the mapping ends, with unmapped pages after it: the copy's
 * prefetches two pages ahead of its stores point there, and must not fault (a
 * prefetch never does).  Several destination offsets within the first page (64-byte
 * aligned, 16-byte aligned, unaligned), so that the once-per-page prefetch fires at
 * a page's first line for each; the bytes must be memcpy's. */
static long test_copy_at_mapping_end(void)
{
    long page = sysconf(_SC_PAGESIZE);
    size_t span = 3 * (size_t)page; /* the mapped pages; 3 more after them are not */
    char *p = mmap(NULL, 2 * span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "test_memops FAIL: mmap: %s\n", strerror(errno));
        exit(1);
    }
    CHECK(munmap(p + span, span) == 0, "munmap: %s", strerror(errno));
    char *src = malloc(span);
    if (!src) {
        fprintf(stderr, "test_memops FAIL: out of memory\n");
        exit(1);
    }
    for (size_t k = 0; k < span; k++)
        src[k] = (char)(k * 7 + 3);
    static const size_t offsets[] = {0, 48, 64, 5, 4032};
    long copies = 0;
    for (size_t oi = 0; oi < sizeof offsets / sizeof offsets[0]; oi++) {
        size_t off = offsets[oi], n = span - off;
        memset(p, 0, span);
        mpl_stream_copy(p + off, src, n);
        mpl_stream_fence();
        CHECK(memcmp(p + off, src, n) == 0, "a copy to the mapping's end at offset %zu: bytes differ", off);
        for (size_t k = 0; k < off; k++)
            if (p[k] != 0) {
                CHECK(0, "a copy at offset %zu wrote byte %zu before it", off, k);
                break;
            }
        copies++;
    }
    free(src);
    munmap(p, span);
    return copies;
}

static void test_dofork(void)
{
    long page = sysconf(_SC_PAGESIZE);
    size_t n = 4 * (size_t)page;
    unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "test_memops FAIL: mmap: %s\n", strerror(errno));
        exit(1);
    }
    memset(p, 7, n);
    CHECK(madvise(p, n, MADV_DONTFORK) == 0, "madvise(MADV_DONTFORK): %s", strerror(errno));
    errno = 0;
    CHECK(mpl_madvise_dofork(p, n) == 0, "mpl_madvise_dofork on a mapped range: -1, errno %d", errno);
    pid_t pid = fork();
    if (pid == 0) { /* the child: the pages must be there (a DONTFORK range is not) */
        int ok = p[n - 1] == 7;
        p[0] = 42;
        _exit(ok ? 0 : 3);
    }
    CHECK(pid > 0, "fork: %s", strerror(errno));
    if (pid > 0) {
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid, "waitpid: %s", strerror(errno));
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the forked child did not inherit the range (status %#x)", status);
        CHECK(p[0] == 42, "the child's write to the shared range is not visible (%d)", p[0]);
    }

    errno = 0;
    CHECK(mpl_madvise_dofork(p + 1, (size_t)page) == -1 && errno == EINVAL,
          "an address not page-aligned: want -1 EINVAL, got errno %d", errno);
    CHECK(munmap(p + 2 * page, (size_t)page) == 0, "munmap: %s", strerror(errno));
    errno = 0;
    CHECK(mpl_madvise_dofork(p, n) == -1 && errno == ENOMEM,
          "a range with an unmapped page: want -1 ENOMEM, got errno %d", errno);
    munmap(p, 2 * (size_t)page);
    munmap(p + 3 * page, (size_t)page);
}

int main(void)
{
    long copies = test_copy();
    copies += test_copy_at_mapping_end();
    test_dofork();
    if (failures) {
        fprintf(stderr, "test_memops: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_memops OK: copies=%ld stream=%d dofork=1\n", copies, MPL_HAVE_STREAM);
    return 0;
}
