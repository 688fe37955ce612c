/* mploader memops: see memops.h.  C11, no Python.h. */
#define _DEFAULT_SOURCE /* MADV_DOFORK in <sys/mman.h> */
#include "memops.h"

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#if MPL_HAVE_STREAM
#include <emmintrin.h>

/* How far ahead of the stores the destination is touched: two 4 KiB pages.
 *
 * A streaming store that misses the TLB waits for the page walk, and the stores
 * behind it wait too.  A slot lies in shared memory (a memfd), whose pages are 4 KiB
 * wherever shmem huge pages are off (the default: shmem_enabled "never"), so a
 * 38.5 MB batch crosses 9,400 pages.  One prefetch per destination page, two pages
 * ahead, does the walk before the stores get there (a prefetch never faults, so
 * addresses past the end of dst are harmless; it reads one line of the page, 1.6 %
 * more traffic).  Measured on the 2-core AMD EPYC VM, one process, a 38.5 MB batch of
 * 256 rows from a pool not in the cache into memfd slots: 3.2-3.3 ms -> 2.1-2.3 ms,
 * the time the same copy takes into 2 MiB-page (anonymous, THP) buffers, which it
 * leaves unchanged (docs/bench-log.md, issue 24). */
#define MPL_STREAM_AHEAD_BYTES 8192

/* A prefetch of the line at address a (formed as an integer: a may lie past dst's end). */
static inline void mpl__prefetch(uintptr_t a)
{
    _mm_prefetch((const char *)a, _MM_HINT_NTA);
}

void mpl_stream_copy(char *dst, const char *src, size_t n)
{
    /* byte by byte up to a 16-byte aligned destination: _mm_stream_si128 needs one */
    while (((uintptr_t)dst & 15) && n) {
        *dst++ = *src++;
        n--;
    }
    size_t i = 0;
    for (; i + 64 <= n; i += 64) { /* one cache line per round: four 16-byte stores */
        /* once per destination page, at its first line (rows copied one after the
         * other: the previous row's prefetches covered this one's first two pages) */
        if (((uintptr_t)(dst + i) & 4095) < 64)
            mpl__prefetch((uintptr_t)dst + i + MPL_STREAM_AHEAD_BYTES);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i); /* the tail, under 64 bytes, through the cache */
}

void mpl_stream_fence(void)
{
    _mm_sfence();
}

#else

void mpl_stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

void mpl_stream_fence(void)
{
}

#endif

int mpl_madvise_dofork(void *addr, size_t n)
{
    return madvise(addr, n, MADV_DOFORK);
}
