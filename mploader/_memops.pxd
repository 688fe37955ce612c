# Declarations of csrc/memops.h (keep in sync: the header documents each function).
# cimported by mploader/_memops.pyx and mploader/_columns.pyx.

cdef extern from "memops.h" nogil:
    enum:
        MPL_HAVE_STREAM     # 1: streaming stores (x86 SSE2); 0: mpl_stream_copy is memcpy

    void mpl_stream_copy(char *dst, const char *src, size_t n)
    void mpl_stream_fence()
    int mpl_madvise_dofork(void *addr, size_t n)
