# cython: language_level=3, boundscheck=False, wraparound=False
"""Generator states in place: per-batch seeding and the torch face's capture
(docs/design.md, "Per-batch seeding"; mploader/_rng_state.py finds the offsets).

No function here takes an address.  A field is named by the object that holds it
and an offset that must lie inside that object's own struct (``tp_basicsize`` of
its type: memory the object owns whatever the offset's meaning), so a wrong
offset can garble that generator's state but never touch other memory.  The
caller (mploader/_rng_state.py) checks the interpreter before calling any of these
and uses only offsets it found and checked against the public getters.
"""
from cpython.object cimport Py_TYPE as _type_of, PyObject as _PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.string cimport memcmp, memset
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

# NumPy's own header (numpy/random/bitgen.h); only the first member is read.  Declared
# here rather than cimported from numpy.random, whose .pxd makes the module import
# numpy.random's extension types at load and check their sizes against the NumPy built
# with (NumPy 2), where the installed one may be 1.24.
cdef extern from "numpy/random/bitgen.h":
    ctypedef struct bitgen_t:
        void *state

import sys

#: Bytes of one MT19937 state as :func:`mt_seed` writes it: 624 uint32 words and an
#: int position (CPython's ``RandomObject`` after its header; NumPy's ``mt19937_state``).
MT_STATE_BYTES = 4 + 4 * 624


cdef char *_field(object obj, Py_ssize_t offset, Py_ssize_t n) except NULL:
    """``obj``'s bytes [offset, offset + n), checked to lie inside its struct."""
    cdef Py_ssize_t size = _type_of(obj).tp_basicsize
    if offset < 0 or n < 0 or offset > size - n:
        raise ValueError(f"offset must leave {n} bytes inside a {type(obj).__name__} ({size} bytes), "
                         f"got {offset}")
    return <char *><_PyObject *>obj + offset


cdef inline uint64_t _splitmix_next(uint64_t *x) noexcept nogil:
    x[0] += <uint64_t>0x9E3779B97F4A7C15
    cdef uint64_t z = x[0]
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)


cdef void _splitmix_words(uint64_t seed, uint32_t *words) noexcept nogil:
    cdef uint64_t x = seed, z
    cdef int k
    for k in range(0, 624, 2):
        z = _splitmix_next(&x)
        words[k] = <uint32_t>z
        words[k + 1] = <uint32_t>(z >> 32)


def mt_words(uint64_t seed):
    """The 624 MT19937 words of the state seeded from ``seed`` (docs/design.md,
    "Per-batch seeding"): word pair ``k`` is the low and high half of the ``k``-th
    splitmix64 output from ``seed``.  bytes of 2,496 (uint32, native byte order), for
    the public ``setstate`` / ``set_state`` of the fallback."""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 4 * 624)
    _splitmix_words(seed, <uint32_t *>PyBytes_AS_STRING(out))
    return out


def mt_seed(object obj, Py_ssize_t offset, uint64_t seed, bint index_first):
    """Write the state of :func:`mt_words` (position 624: the next draw regenerates the
    block) into ``obj`` at ``offset``: ``index_first``, the int32 position before the
    words (CPython's ``RandomObject``), else after them (NumPy's ``mt19937_state``).
    Raises ValueError when the 2,500 bytes are not inside ``obj``."""
    cdef char *p = _field(obj, offset, 4 + 4 * 624)
    _splitmix_words(seed, <uint32_t *>(p + 4 if index_first else p))
    (<int *>(p if index_first else p + 4 * 624))[0] = 624


def state_offset(object bitgen):
    """Where a NumPy bit generator's state struct lies inside ``bitgen`` (its
    ``capsule``'s ``bitgen_t.state``, NumPy's documented C interface), as an offset.
    Raises ValueError when the state is not inside the object (a bit generator that
    keeps it elsewhere)."""
    cdef bitgen_t *head = <bitgen_t *>PyCapsule_GetPointer(bitgen.capsule, "BitGenerator")
    cdef Py_ssize_t offset = <char *>head.state - <char *><_PyObject *>bitgen
    _field(bitgen, offset, 0)
    return offset


def object_bytes(object obj):
    """A copy of ``obj``'s struct (``type(obj).__basicsize__`` bytes)."""
    return PyBytes_FromStringAndSize(<char *><_PyObject *>obj, _type_of(obj).tp_basicsize)


def field_bytes(object obj, Py_ssize_t offset, Py_ssize_t n):
    """A copy of ``obj``'s bytes [offset, offset + n).  Raises ValueError when they
    are not inside ``obj``."""
    return PyBytes_FromStringAndSize(_field(obj, offset, n), n)


def field_clear(object obj, Py_ssize_t offset, Py_ssize_t n):
    """Zero ``obj``'s bytes [offset, offset + n) (NumPy's ``has_gauss``/``gauss``, as
    seeding clears them).  Raises ValueError when they are not inside ``obj``."""
    memset(_field(obj, offset, n), 0, <size_t>n)


def field_equal(object obj, Py_ssize_t offset, bytes data, Py_ssize_t at, Py_ssize_t n):
    """Whether ``obj``'s bytes [offset, offset + n) are ``data[at:at + n]`` (``memcmp``,
    nothing copied).  Raises ValueError when either range is not inside its object."""
    if at < 0 or n < 0 or at > len(data) - n:
        raise ValueError(f"at must leave {n} bytes inside {len(data)} bytes of data, got {at}")
    return memcmp(_field(obj, offset, n), PyBytes_AS_STRING(data) + at, <size_t>n) == 0


def tensor_equal(object tensor, bytes data, Py_ssize_t at):
    """Whether the bytes of ``tensor`` -- a ``torch.Tensor`` on the CPU, contiguous
    (a generator's ``get_state()``) -- are ``data[at:at + tensor.nbytes]`` (``memcmp``;
    the tensor's memory found through its own ``data_ptr()``, which never leaves this
    function).  Raises TypeError for another object, ValueError for a tensor on another
    device or not contiguous, or when the range is not inside ``data``."""
    torch = sys.modules.get("torch")
    if torch is None or type(tensor) is not torch.Tensor:
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError(f"tensor must be a contiguous CPU tensor, got one on {tensor.device} "
                         f"(contiguous: {tensor.is_contiguous()})")
    cdef Py_ssize_t n = tensor.nbytes
    if at < 0 or at > len(data) - n:
        raise ValueError(f"at must leave {n} bytes inside {len(data)} bytes of data, got {at}")
    cdef uintptr_t address = tensor.data_ptr()
    return n == 0 or memcmp(<const void *>address, PyBytes_AS_STRING(data) + at, <size_t>n) == 0
