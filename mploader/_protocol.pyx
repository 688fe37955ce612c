# cython: language_level=3, boundscheck=False, wraparound=False
"""The wire format between the parent and a worker (docs/design.md, "Wire protocol").

Parent -> worker, on the worker's task pipe, one framed record per task:

    frame        <!i length> (as multiprocessing.connection, so the parent and a
                 spawned worker agree on framing)
    TASK header  <q seq> <q slot> <q epoch> <q batch_index> <I flags> <I count>
    payload      count int64 sample indices (INDICES_INT64), or count bytes of
                 pickled indices (INDICES_PICKLE)

``slot == -1``: no slot was free, send the batch back through the pipe.  A record
with the RETIRE flag (and no payload) asks the worker to exit after the tasks
before it.  This module is the only encoder (:func:`frame_task`,
:func:`frame_retire`) and the only decoder (:class:`TaskReader`, which takes every
queued record with one ``read``; :func:`decode_task`) of that format.  The parent
writes the records it has for a worker with one ``send`` (:func:`send_upto`, never
blocking: a burst of small batches costs one system call per worker; the
scheduler's ``flush`` step, mploader/_steps.pyx, calls :c:func:`write_loop` through
mploader/_protocol.pxd); :func:`write_all` writes to a blocking pipe.

Worker -> parent, on the same pipe, only what does not travel in a slot:

    PIPE header  <q seq> <I kind> (:data:`PIPE_HEADER`), then the pickled batch
                 (kind SLOT/PIPE) or :class:`~mploader._errors.BatchFailure` (kind
                 ERROR), or a bad sample's report record (kind 16,
                 ``mploader._bad_samples.KIND_REPORT``: sent before the batch ``seq``
                 is published)

A slot's own metadata (seq, kind, flags, used, descriptor range) lives in its
header in shared memory (csrc/ring.h, ``mpl_slot_meta``).
"""
from libc.errno cimport EINTR, errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLong
from cpython.ref cimport Py_INCREF

import os
import pickle
import struct

cdef extern from "<unistd.h>" nogil:
    ssize_t c_write "write"(int fd, const void *buf, size_t n)
    ssize_t c_read "read"(int fd, void *buf, size_t n)

cdef extern from "<sys/socket.h>" nogil:
    ssize_t c_send "send"(int fd, const void *buf, size_t n, int flags)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL

# ---- task records (docs/design.md, "Wire protocol") ----

cdef enum:
    INDICES_INT64 = 1    # flag: count int64 sample indices follow
    INDICES_PICKLE = 2   # flag: count bytes of pickled indices follow
    RETIRE = 4           # flag: exit after the tasks before this one (no payload)
    HEADER_BYTES = 40    # <q seq> <q slot> <q epoch> <q batch_index> <I flags> <I count>
    FRAME_BYTES = 4      # the frame length before each record (big-endian, as multiprocessing.connection)

#: Bytes of a task record's header, and of the frame length before it.
TASK_HEADER_BYTES = HEADER_BYTES
TASK_FRAME_BYTES = FRAME_BYTES

cdef inline void _put_le(char *p, uint64_t v, int n) noexcept nogil:
    cdef int k
    for k in range(n):
        p[k] = <char>(v & 0xFF)
        v >>= 8


cdef inline uint64_t _get_le(const unsigned char *p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(n - 1, -1, -1):
        v = (v << 8) | p[k]
    return v


cdef bytes _frame(int64_t seq, int64_t slot, int64_t epoch, int64_t batch_index, uint32_t flags,
                  uint32_t count, Py_ssize_t payload):
    """A framed record with ``payload`` bytes left to fill after the header."""
    cdef Py_ssize_t body = HEADER_BYTES + payload
    if body > 0x7FFFFFFF:
        raise ValueError(f"a task of {body} bytes does not fit a frame (at most 2 GiB)")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, FRAME_BYTES + body)
    cdef char *p = PyBytes_AS_STRING(out)
    cdef uint32_t be = <uint32_t>body
    p[0] = <char>(be >> 24)
    p[1] = <char>(be >> 16)
    p[2] = <char>(be >> 8)
    p[3] = <char>be
    p += FRAME_BYTES
    _put_le(p, <uint64_t>seq, 8)
    _put_le(p + 8, <uint64_t>slot, 8)
    _put_le(p + 16, <uint64_t>epoch, 8)
    _put_le(p + 24, <uint64_t>batch_index, 8)
    _put_le(p + 32, flags, 4)
    _put_le(p + 36, count, 4)
    return out


def frame_task(int64_t seq, int64_t slot, int64_t epoch, int64_t batch_index, indices):
    """One framed task record: int64 indices when ``indices`` is a list of Python ints
    (exactly ``int``, each within int64), else the indices pickled (shards, tuples,
    numpy integers, whatever a sampler yields arrives as it was)."""
    cdef Py_ssize_t n, k
    cdef bytes out
    cdef char *p
    cdef int64_t v
    if type(indices) is list:
        n = len(<list>indices)
        for k in range(n):
            if type((<list>indices)[k]) is not int:
                break
        else:
            if n <= 0xFFFFFFFF:
                out = _frame(seq, slot, epoch, batch_index, INDICES_INT64, <uint32_t>n, 8 * n)
                p = PyBytes_AS_STRING(out) + FRAME_BYTES + HEADER_BYTES
                try:
                    for k in range(n):
                        v = PyLong_AsLongLong((<list>indices)[k])
                        _put_le(p + 8 * k, <uint64_t>v, 8)
                    return out
                except OverflowError:
                    pass  # an index beyond int64: pickle it
    blob = pickle.dumps(indices, protocol=5)
    if len(blob) > 0xFFFFFFFF:
        raise ValueError(f"the pickled indices of task {seq} take {len(blob)} bytes (at most 4 GiB)")
    out = _frame(seq, slot, epoch, batch_index, INDICES_PICKLE, <uint32_t>len(blob), len(blob))
    memcpy(PyBytes_AS_STRING(out) + FRAME_BYTES + HEADER_BYTES, <char *>blob, len(blob))
    return out


def frame_retire():
    """The framed RETIRE record: the worker exits after the tasks before it."""
    return _frame(-1, -1, 0, 0, RETIRE, 0, 0)


cdef class TaskReader:
    """Reads the framed task records of one pipe fd, every queued one with one ``read()``.

    ``next()`` blocks until a whole record is there and returns ``(seq, slot, epoch,
    batch_index, indices)`` -- ``indices`` a list of ints, or whatever was pickled --
    or None for RETIRE.  Raises EOFError when the parent closed its end, ValueError
    for a malformed record, OSError from ``read()``.
    """

    cdef int fd
    cdef bytearray buf
    cdef Py_ssize_t pos
    cdef Py_ssize_t chunk

    def __init__(self, int fd, Py_ssize_t chunk=1 << 16):
        self.fd = fd
        self.buf = bytearray()
        self.pos = 0
        self.chunk = chunk

    cdef int _fill(self, Py_ssize_t need) except -1:
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        while len(self.buf) < need:
            data = os.read(self.fd, max(self.chunk, need - len(self.buf)))
            if not data:
                raise EOFError("the parent closed the task pipe")
            self.buf += data
        return 0

    def next(self):
        cdef Py_ssize_t have = len(self.buf) - self.pos
        if have < FRAME_BYTES:
            self._fill(FRAME_BYTES)
        cdef const unsigned char *p = <const unsigned char *>PyByteArray_AS_STRING(self.buf) + self.pos
        cdef Py_ssize_t n = (<Py_ssize_t>p[0] << 24) | (p[1] << 16) | (p[2] << 8) | p[3]
        if p[0] & 0x80:
            raise ValueError(f"bad frame length {n - (1 << 32)}")
        if len(self.buf) - self.pos < FRAME_BYTES + n:
            self._fill(FRAME_BYTES + n)
        p = <const unsigned char *>PyByteArray_AS_STRING(self.buf) + self.pos + FRAME_BYTES
        self.pos += FRAME_BYTES + n
        return _decode(p, n)


cdef object _decode(const unsigned char *p, Py_ssize_t n):
    if n < HEADER_BYTES:
        raise ValueError(f"a task record of {n} bytes is shorter than its {HEADER_BYTES}-byte header")
    cdef int64_t seq = <int64_t>_get_le(p, 8)
    cdef int64_t slot = <int64_t>_get_le(p + 8, 8)
    cdef int64_t epoch = <int64_t>_get_le(p + 16, 8)
    cdef int64_t batch_index = <int64_t>_get_le(p + 24, 8)
    cdef uint32_t flags = <uint32_t>_get_le(p + 32, 4)
    cdef uint64_t count = _get_le(p + 36, 4)
    cdef Py_ssize_t body = n - HEADER_BYTES
    cdef Py_ssize_t k
    cdef list indices
    cdef object v
    if flags & RETIRE:
        return None
    p += HEADER_BYTES
    if flags & INDICES_INT64:
        if <uint64_t>body != 8 * count:
            raise ValueError(f"task {seq}: {body} bytes of indices for {count} int64")
        indices = PyList_New(<Py_ssize_t>count)
        for k in range(<Py_ssize_t>count):
            v = <int64_t>_get_le(p + 8 * k, 8)
            Py_INCREF(v)
            PyList_SET_ITEM(indices, k, v)
        return (seq, slot, epoch, batch_index, indices)
    if flags & INDICES_PICKLE:
        if <uint64_t>body != count:
            raise ValueError(f"task {seq}: {body} bytes of pickled indices, header says {count}")
        return (seq, slot, epoch, batch_index, pickle.loads(PyBytes_FromStringAndSize(<const char *>p, body)))
    raise ValueError(f"task {seq}: unknown flags {flags:#x}")


def decode_task(data):
    """The task of one record ``data`` (bytes, without its frame length): as
    :meth:`TaskReader.next`."""
    cdef const unsigned char[::1] view = data
    if view.shape[0] == 0:
        raise ValueError("an empty task record")
    return _decode(&view[0], view.shape[0])


cdef int write_loop(int fd, const char *p, Py_ssize_t n, Py_ssize_t *done, bint nonblocking) noexcept nogil:
    """Write ``n`` bytes from ``p``, continuing writes cut short (a full pipe, a
    signal); ``done[0]`` = bytes written.  Returns 0 or the failing call's errno.
    ``nonblocking``: ``send(MSG_DONTWAIT)`` on a socket (EAGAIN once it is full)
    instead of a blocking ``write``."""
    cdef ssize_t r
    done[0] = 0
    while done[0] < n:
        if nonblocking:
            r = c_send(fd, p + done[0], <size_t>(n - done[0]), MSG_DONTWAIT | MSG_NOSIGNAL)
        else:
            r = c_write(fd, p + done[0], <size_t>(n - done[0]))
        if r < 0:
            if errno == EINTR:
                continue
            return errno
        done[0] += r
    return 0


def write_all(int fd, bytes data):
    """Write all of ``data`` to ``fd`` (a blocking pipe), the GIL released; a write
    cut short (a full pipe, a signal) is continued.  Raises OSError (BrokenPipeError
    when the reader is gone)."""
    cdef Py_ssize_t done
    cdef int err
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = len(data)
    with nogil:
        err = write_loop(fd, p, n, &done, False)
    if err:
        raise OSError(err, os.strerror(err))


def send_upto(int fd, bytes data):
    """Send as much of ``data`` as the socket ``fd`` takes now, without blocking and
    without the GIL: ``(sent, error)`` -- the bytes of ``data`` that reached the
    socket and the errno that stopped the rest (0 when all of it was sent; EAGAIN
    when the socket is full: the reader is behind).  The scheduler sends a burst of
    task records to a worker with it: it needs to know which records the worker was
    given, and it must never block on a worker that is itself blocked sending a batch
    to the parent (docs/design.md, "Wire protocol")."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = len(data)
    cdef Py_ssize_t done
    cdef int err
    with nogil:
        err = write_loop(fd, p, n, &done, True)
    return done, err


#: The header of a message on a worker's pipe (worker -> parent): seq, kind.
PIPE_HEADER = struct.Struct("<qI")
