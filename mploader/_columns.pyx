# cython: language_level=3, boundscheck=False, wraparound=False
"""Columns of a batch, in C (docs/design.md, "Collate into the slot", "Batch plans").

* The collation checks of mploader/_collate.py and the torch face's collate:
  :func:`uniform_arrays`, :func:`number_column_dtype`, :func:`fill_numbers`.
* :func:`copy_rows`: sample rows copied into a column, ``memcpy`` or, from
  :data:`STREAM_MIN_BYTES` on, streaming stores (csrc/memops.c).
* :class:`BatchPlan`: one structure's collation, verified and written in one call.
"""
cimport numpy as cnp
from cpython.bytes cimport PyBytes_AS_STRING
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongLong
from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.tuple cimport PyTuple_GET_SIZE
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from mploader._memops cimport MPL_HAVE_STREAM, mpl_stream_copy, mpl_stream_fence

import numpy as np

# ---- collation checks (mploader/_collate.py) ----


cnp.import_array()
_BOOL, _INT64, _FLOAT64 = np.dtype("bool"), np.dtype("int64"), np.dtype("float64")
_NUMERIC_SCALARS = (np.bool_, np.integer, np.floating, np.complexfloating)


def uniform_arrays(list samples):
    """Whether ``samples`` (non-empty) are all exactly ``numpy.ndarray`` of one shape
    and one dtype (``==``, as NumPy compares dtypes) that holds no objects."""
    cdef Py_ssize_t n = len(samples), k, d
    if n == 0:
        return False
    first = samples[0]
    if type(first) is not cnp.ndarray:
        return False
    cdef cnp.ndarray a0 = <cnp.ndarray>first, a
    cdef cnp.dtype d0 = a0.dtype
    if d0.hasobject:
        return False
    cdef int nd = cnp.PyArray_NDIM(a0)
    cdef cnp.npy_intp *dims0 = cnp.PyArray_DIMS(a0)
    cdef cnp.npy_intp *dims
    for k in range(1, n):
        s = samples[k]
        if type(s) is not cnp.ndarray:
            return False
        a = <cnp.ndarray>s
        if cnp.PyArray_NDIM(a) != nd:
            return False
        dims = cnp.PyArray_DIMS(a)
        for d in range(nd):
            if dims[d] != dims0[d]:
                return False
        if <void *>cnp.PyArray_DESCR(a) != <void *>cnp.PyArray_DESCR(a0) and not cnp.PyArray_EquivTypes(a.dtype, d0):
            return False
    return True


def number_column_dtype(list samples):
    """The dtype ``np.asarray(samples)`` gives when every sample is of one exact type:
    ``bool`` -> bool, ``int`` -> int64, ``float`` -> float64, one NumPy boolean,
    integer, floating or complex scalar type -> its dtype; None otherwise (mixed
    types, ``np.timedelta64`` whose unit each value carries, other objects: the
    caller asks NumPy)."""
    cdef Py_ssize_t n = len(samples), k
    if n == 0:
        return None
    t = type(samples[0])
    for k in range(1, n):
        if type(samples[k]) is not t:
            return None
    if t is bool:
        return _BOOL
    if t is int:
        try:
            for k in range(n):
                PyLong_AsLongLong(samples[k])
        except OverflowError:
            return None  # beyond int64: NumPy picks uint64 or object
        return _INT64
    if t is float:
        return _FLOAT64
    if t is np.timedelta64:
        return None  # its unit is in the value, not the type: NumPy converts mixed units
    if isinstance(samples[0], _NUMERIC_SCALARS):
        return cnp.PyArray_DescrFromScalar(samples[0])
    return None


def fill_numbers(list samples, cnp.ndarray out):
    """Write the numbers ``samples`` (all of the type :func:`number_column_dtype`
    accepted) into the 1-D, C-contiguous ``out`` of that dtype.  Raises ValueError
    when ``out`` does not fit them."""
    cdef Py_ssize_t n = len(samples), k
    if cnp.PyArray_NDIM(out) != 1 or cnp.PyArray_DIMS(out)[0] != n or not cnp.PyArray_ISCARRAY(out):
        raise ValueError("fill_numbers: out must be a writable C-contiguous array of len(samples)")
    cdef char *p = <char *>cnp.PyArray_DATA(out)
    cdef Py_ssize_t size = cnp.PyArray_ITEMSIZE(out)
    t = type(samples[0])
    if t is int:
        if size != 8:
            raise ValueError("fill_numbers: int samples need an int64 out")
        for k in range(n):
            (<int64_t *>p)[k] = PyLong_AsLongLong(samples[k])
        return True
    if t is float:
        if size != 8:
            raise ValueError("fill_numbers: float samples need a float64 out")
        for k in range(n):
            (<double *>p)[k] = PyFloat_AS_DOUBLE(samples[k])
        return True
    if t is bool:
        for k in range(n):
            p[k] = 1 if samples[k] is True else 0
        return True
    if cnp.PyArray_DescrFromScalar(samples[0]).itemsize != size:
        raise ValueError("fill_numbers: out's dtype is not the samples'")
    for k in range(n):
        cnp.PyArray_ScalarAsCtype(samples[k], p + k * size)
    return True


# ---- copying samples into the slot (mploader/_collate.py) ----

#: Output arrays at least this large (bytes) are written with streaming stores by
#: :func:`copy_rows` (docs/design.md, "Collate into the slot").
STREAM_MIN_BYTES = 4 << 20
#: Whether this build has streaming stores (x86 SSE2); elsewhere copy_rows uses memcpy.
HAVE_STREAM = bool(MPL_HAVE_STREAM)


def copy_rows(list samples, cnp.ndarray out):
    """Copy the uniform arrays ``samples`` (see :func:`uniform_arrays`) into the rows
    of ``out`` -- sample i at ``out[i]`` -- and return True; False, having written
    nothing, when this does not apply and the caller copies with NumPy: ``out`` not
    C-contiguous or not the samples' dtype in native byte order, a sample not an
    ndarray (subclasses count) or not C-contiguous or not one row long.

    Rows are copied with ``memcpy`` (32 rows of 64 bytes: 0.2 us, where
    ``np.concatenate`` takes 2.5 us); an ``out`` of at least :data:`STREAM_MIN_BYTES`
    is written with streaming stores, the GIL released, then fenced (docs/design.md,
    "Collate into the slot")."""
    cdef Py_ssize_t n = len(samples), k
    if n == 0:
        return False
    if not cnp.PyArray_IS_C_CONTIGUOUS(out) or not cnp.PyArray_ISWRITEABLE(out) or not out.dtype.isnative:
        return False
    cdef Py_ssize_t total = cnp.PyArray_NBYTES(out)
    cdef Py_ssize_t row = total // n
    if row * n != total:
        return False
    cdef cnp.ndarray a
    cdef void *out_descr = <void *>cnp.PyArray_DESCR(out)
    for k in range(n):
        if not isinstance(samples[k], cnp.ndarray):
            return False
        a = <cnp.ndarray>samples[k]
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_NBYTES(a) != row:
            return False
        if <void *>cnp.PyArray_DESCR(a) != out_descr and not (
                cnp.PyArray_EquivTypes(a.dtype, out.dtype) and a.dtype.isnative):
            return False
    cdef char *dst = <char *>cnp.PyArray_DATA(out)
    if not MPL_HAVE_STREAM or total < STREAM_MIN_BYTES:
        for k in range(n):
            memcpy(dst + k * row, <const char *>cnp.PyArray_DATA(<cnp.ndarray>samples[k]), <size_t>row)
        return True
    # The GIL is released once for all rows (not once a row: 256 releases cost 2-3 % of
    # a worker's CPU per 38.5 MB batch); `held` keeps the sources alive meanwhile, should
    # another thread change `samples`.
    cdef list held = list(samples)
    cdef const char **srcs = <const char **>malloc(n * sizeof(char *))
    if srcs == NULL:
        raise MemoryError()
    for k in range(n):
        srcs[k] = <const char *>cnp.PyArray_DATA(<cnp.ndarray>held[k])
    with nogil:
        for k in range(n):
            mpl_stream_copy(dst + k * row, srcs[k], <size_t>row)
        mpl_stream_fence()  # the stores are visible before the slot is published (E2 releases after this)
    free(srcs)
    return True


# ---- batch plans: one structure's collation, verified and written in one call ----

cdef extern from "Python.h":
    PyObject *PyTuple_GET_ITEM_raw "PyTuple_GET_ITEM" (object t, Py_ssize_t i)
    PyObject *PyList_GET_ITEM_raw "PyList_GET_ITEM" (object l, Py_ssize_t i)
    long long PyLong_AsLongLong_raw "PyLong_AsLongLong" (PyObject *o)
    double PyFloat_AS_DOUBLE_raw "PyFloat_AS_DOUBLE" (PyObject *o)
    PyObject *Py_True_raw "Py_True"
    PyTypeObject PyTuple_Type

cdef extern from "numpy/arrayobject.h":
    bint PyArray_EquivTypes_raw "PyArray_EquivTypes" (cnp.PyArray_Descr *a, cnp.PyArray_Descr *b)

cdef enum:
    PLAN_ARRAY = 0     # an ndarray of one dtype and shape -> its bytes, row i at offset + i * row
    PLAN_INT = 1       # a Python int within int64 -> int64
    PLAN_FLOAT = 2     # a Python float -> float64
    PLAN_BOOL = 3      # a Python bool -> bool (1 byte)
    PLAN_SCALAR = 4    # a NumPy scalar of one type -> its dtype's bytes
    PLAN_OTHER = 5     # a leaf of one type that the caller writes (only its type is checked here)
    PLAN_MAX_DIMS = 8

#: Field kinds of :class:`BatchPlan` (``fields`` entries' first item).
PLAN_KINDS = {"array": PLAN_ARRAY, "int": PLAN_INT, "float": PLAN_FLOAT, "bool": PLAN_BOOL,
              "scalar": PLAN_SCALAR, "other": PLAN_OTHER}
#: The most dimensions an array field of a plan may have.
PLAN_DIMS = PLAN_MAX_DIMS

cdef struct plan_field:
    int kind
    PyTypeObject *type          # every sample's leaf is exactly of this type
    cnp.PyArray_Descr *descr    # ARRAY: the leaves' dtype
    int nd                      # ARRAY: their ndim and shape
    cnp.npy_intp dims[PLAN_MAX_DIMS]
    Py_ssize_t row              # bytes one sample's leaf takes in the column
    Py_ssize_t offset           # the column's offset in the slot payload
    bint stream                 # ARRAY: the column is written with streaming stores


cdef struct stream_row:         # one row of a streaming column, copied once every check passed
    char *dst
    const char *src
    size_t n


cdef class BatchPlan:
    """How batches of one structure and batch size are collated and described: where
    each field's column lies in the slot payload and the descriptor bytes that the
    generic path (collate through ``alloc``, then ``SlotWriter.finish``) wrote for
    such a batch -- the same bytes for every batch that matches (docs/design.md,
    "Batch plans").

    Parameters
    ----------
    batch_size : int
        Samples per batch (B).
    in_tuple : bool
        Samples are ``tuple`` (exactly) of ``len(fields)`` leaves; else each sample
        is the one leaf.
    fields : list of tuple
        Per leaf: ``(kind, leaf_type, dtype, shape, row, offset)`` -- kind one of
        :data:`PLAN_KINDS`' values, the leaves' exact type, their dtype (ARRAY) or
        None, their shape (ARRAY) or ``()``, the bytes one leaf takes in the column,
        and the column's offset in the payload.  An ``"other"`` field's leaves are
        only checked for their type: the caller writes that column after ``fill``.
    descriptor : bytes
        The descriptor bytes, written at ``desc_off``.
    desc_off : int
        Offset of the descriptor in the payload; ``desc_off + len(descriptor)`` is
        the payload's used bytes (``total``).

    Raises ValueError for a field that does not fit before ``desc_off`` or an
    array field with more than :data:`PLAN_DIMS` dimensions.
    """

    cdef readonly Py_ssize_t batch_size, desc_off, total
    cdef readonly bytes descriptor
    cdef bint in_tuple
    cdef Py_ssize_t nfields
    cdef plan_field *f
    cdef list keep        # the types and dtypes the fields point to, kept alive
    cdef bint any_stream

    def __cinit__(self, Py_ssize_t batch_size, bint in_tuple, list fields, bytes descriptor, Py_ssize_t desc_off):
        cdef Py_ssize_t j, d
        cdef plan_field *p
        self.f = NULL
        if batch_size <= 0 or not fields or desc_off < 0:
            raise ValueError("BatchPlan: batch_size and fields must not be empty, desc_off >= 0")
        self.batch_size, self.in_tuple, self.nfields = batch_size, in_tuple, len(fields)
        if not in_tuple and self.nfields != 1:
            raise ValueError("BatchPlan: a plan without tuples has one field")
        self.descriptor, self.desc_off = descriptor, desc_off
        self.total = desc_off + len(descriptor)
        self.keep = []
        self.f = <plan_field *>malloc(self.nfields * sizeof(plan_field))
        if self.f == NULL:
            raise MemoryError()
        self.any_stream = False
        for j in range(self.nfields):
            kind, leaf_type, dtype, shape, row, offset = fields[j]
            p = &self.f[j]
            p.kind, p.row, p.offset = kind, row, offset
            if not isinstance(leaf_type, type) or kind not in PLAN_KINDS.values():
                raise ValueError(f"BatchPlan: field {j} has no kind or type")
            if row < 0 or offset < 0 or offset + row * batch_size > desc_off:
                raise ValueError(f"BatchPlan: field {j}'s column [{offset}, {offset + row * batch_size}) "
                                 f"does not lie before the descriptor at {desc_off}")
            self.keep.append(leaf_type)
            p.type = <PyTypeObject *>leaf_type
            p.descr, p.nd, p.stream = NULL, 0, False
            if kind == PLAN_ARRAY:
                dtype = np.dtype(dtype)
                if len(shape) > PLAN_MAX_DIMS:
                    raise ValueError(f"BatchPlan: field {j} has more than {PLAN_MAX_DIMS} dimensions")
                self.keep.append(dtype)
                p.descr = <cnp.PyArray_Descr *>dtype
                p.nd = len(shape)
                for d in range(p.nd):
                    p.dims[d] = shape[d]
                p.stream = MPL_HAVE_STREAM and row * batch_size >= STREAM_MIN_BYTES
                self.any_stream |= p.stream

    def __dealloc__(self):
        free(self.f)

    def fill(self, list samples, Py_ssize_t base, Py_ssize_t capacity):
        """Write ``samples`` and the descriptor into the payload at address ``base``
        (``capacity`` bytes); True once done.  False -- the caller collates as usual,
        into the same slot -- when the batch is not of this plan: another batch
        size, ``capacity`` below :attr:`total`, a sample not a tuple of the plan's
        length, a leaf not of its field's exact type, dtype, shape (and C-contiguous),
        or an int beyond int64.  Bytes already written are then garbage that the
        usual path overwrites."""
        cdef Py_ssize_t n = len(samples), i, nrows = 0
        if n != self.batch_size or capacity < self.total or base == 0:
            return False
        cdef list held = samples
        cdef stream_row *rows = NULL
        if self.any_stream:
            held = list(samples)  # the leaves stay alive while the GIL is released below
            rows = <stream_row *>malloc(n * self.nfields * sizeof(stream_row))
            if rows == NULL:
                raise MemoryError()
        try:
            if not self._write(held, base, rows, &nrows):
                return False
            memcpy(<char *>base + self.desc_off, PyBytes_AS_STRING(self.descriptor), len(self.descriptor))
            if self.any_stream:
                # The GIL is released once for the batch's streaming rows, not once a
                # row (256 releases cost 2-3 % of a worker's CPU per 38.5 MB batch).
                with nogil:
                    for i in range(nrows):
                        mpl_stream_copy(rows[i].dst, rows[i].src, rows[i].n)
                    mpl_stream_fence()  # the streaming stores are visible before the slot is published
            return True
        finally:
            free(rows)

    cdef int _write(self, list samples, Py_ssize_t base, stream_row *rows, Py_ssize_t *nrows) except -1:
        """:meth:`fill`'s checks and its copies but the streaming ones, which go to
        ``rows`` (``nrows[0]`` of them) for :meth:`fill` to copy; 1 once every sample
        passed, 0 at the first that does not."""
        cdef Py_ssize_t n = len(samples), i, j, d
        cdef PyObject *s
        cdef PyObject *leaf
        cdef plan_field *p
        cdef char *dst
        cdef long long v
        for i in range(n):
            s = PyList_GET_ITEM_raw(samples, i)
            if self.in_tuple and (<PyTypeObject *>Py_TYPE(<object>s) != &PyTuple_Type
                                  or PyTuple_GET_SIZE(<object>s) != self.nfields):
                return 0
            for j in range(self.nfields):
                p = &self.f[j]
                leaf = PyTuple_GET_ITEM_raw(<object>s, j) if self.in_tuple else s
                if <PyTypeObject *>Py_TYPE(<object>leaf) != p.type:
                    return 0
                dst = <char *>base + p.offset + i * p.row
                if p.kind == PLAN_ARRAY:
                    if cnp.PyArray_NDIM(<cnp.ndarray>leaf) != p.nd or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>leaf):
                        return 0
                    for d in range(p.nd):
                        if cnp.PyArray_DIMS(<cnp.ndarray>leaf)[d] != p.dims[d]:
                            return 0
                    if cnp.PyArray_DESCR(<cnp.ndarray>leaf) != p.descr and not PyArray_EquivTypes_raw(
                            cnp.PyArray_DESCR(<cnp.ndarray>leaf), p.descr):
                        return 0
                    if p.stream:  # fill copies it once every sample passed its checks
                        rows[nrows[0]].dst = dst
                        rows[nrows[0]].src = <const char *>cnp.PyArray_DATA(<cnp.ndarray>leaf)
                        rows[nrows[0]].n = <size_t>p.row
                        nrows[0] += 1
                    else:
                        memcpy(dst, cnp.PyArray_DATA(<cnp.ndarray>leaf), <size_t>p.row)
                elif p.kind == PLAN_INT:
                    v = PyLong_AsLongLong_raw(leaf)
                    if v == -1 and PyErr_Occurred() != NULL:
                        PyErr_Clear()  # beyond int64: NumPy would choose another dtype
                        return 0
                    (<int64_t *>dst)[0] = v
                elif p.kind == PLAN_FLOAT:
                    (<double *>dst)[0] = PyFloat_AS_DOUBLE_raw(leaf)
                elif p.kind == PLAN_BOOL:
                    dst[0] = 1 if leaf == Py_True_raw else 0
                elif p.kind == PLAN_SCALAR:
                    cnp.PyArray_ScalarAsCtype(<object>leaf, dst)
                # PLAN_OTHER: the caller fills the column (its type was checked above)
        return 1
