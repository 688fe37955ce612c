# cython: language_level=3, boundscheck=False, wraparound=False
"""Advice about the shared region's pages (csrc/memops.c), for mploader/_pinning.py."""
from libc.errno cimport errno
from libc.stdint cimport uintptr_t

# mpl_madvise_dofork: declared in mploader/_memops.pxd (this module's own, cimported implicitly)


def madvise_dofork(uintptr_t address, size_t nbytes):
    """``madvise(address, nbytes, MADV_DOFORK)``: processes forked later inherit the
    pages [address, address + nbytes) again (some CUDA drivers mark the memory they
    page-lock MADV_DONTFORK; the region is MAP_SHARED, so a worker inheriting it is
    safe and needed).  ``address`` must be page-aligned.

    Returns
    -------
    int
        0 on success; on failure the errno of ``madvise(2)`` (EINVAL: ``address``
        not page-aligned, ENOMEM: part of the range is not mapped), the pages'
        advice then unchanged.  Never raises for a failed call: the caller decides.
    """
    cdef int rc
    with nogil:
        rc = mpl_madvise_dofork(<void *>address, nbytes)
    return 0 if rc == 0 else errno
