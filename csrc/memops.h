/*
 * mploader memops: byte copies into slots and advice about the region's pages,
 * outside the slot protocol.  C11, no Python.h.
 *
 * Must match mploader/_memops.pxd.
 *
 * mpl_stream_copy writes a large column of a batch with non-temporal (streaming)
 * stores: the destination bypasses the caches, so a batch far larger than the
 * cache does not evict the worker's working set to write lines nobody in this
 * process reads again (docs/design.md, "Collate into the slot").  It gives the
 * same bytes as memcpy; only the cache traffic differs.
 */
#ifndef MPLOADER_MEMOPS_H
#define MPLOADER_MEMOPS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 where mpl_stream_copy uses streaming stores (x86 with SSE2), 0 where it is
 * memcpy.  A constant of the build, not of the CPU: every x86-64 CPU has SSE2. */
#if defined(__SSE2__)
#define MPL_HAVE_STREAM 1
#else
#define MPL_HAVE_STREAM 0
#endif

/* Copy n bytes from src to dst (the ranges must not overlap), with streaming
 * stores where MPL_HAVE_STREAM, else memcpy.  Any alignment of either pointer and
 * any n (0 included).  The stores are weakly ordered: call mpl_stream_fence before
 * another process may read dst (before the slot is published).  Cannot fail. */
void mpl_stream_copy(char *dst, const char *src, size_t n);

/* Order the streaming stores made so far by this thread before its later stores
 * (sfence; nothing where MPL_HAVE_STREAM is 0).  Cannot fail. */
void mpl_stream_fence(void);

/* madvise(addr, n, MADV_DOFORK): child processes forked from now on inherit the
 * pages [addr, addr + n) again (undoes MADV_DONTFORK, which some CUDA drivers set
 * on the memory they page-lock; the region is MAP_SHARED, so a worker inheriting
 * it is what the ring needs).  addr must be page-aligned.
 * On success returns 0; on failure -1, errno set (EINVAL: addr not page-aligned,
 * ENOMEM: part of the range is not mapped; madvise(2)), and the pages' advice is
 * as it was. */
int mpl_madvise_dofork(void *addr, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* MPLOADER_MEMOPS_H */
