/* mploader memops: see memops.h.  C11, no Python.h. */
#define _DEFAULT_SOURCE /* MADV_DOFORK in <sys/mman.h> */
#include "memops.h"

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#if MPL_HAVE_STREAM
#include <emmintrin.h>

void mpl_stream_copy(char *dst, const char *src, size_t n)
{
    /* byte by byte up to a 16-byte aligned destination: _mm_stream_si128 needs one */
    while (((uintptr_t)dst & 15) && n) {
        *dst++ = *src++;
        n--;
    }
    size_t i = 0;
    for (; i + 64 <= n; i += 64) { /* one cache line per round: four 16-byte stores */
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
