# cython: language_level=3, boundscheck=False, wraparound=False
"""The per-batch steps that are pure bookkeeping, at C speed (issue 13).

* The task wire format of docs/design.md ("Wire protocol"): :func:`frame_task`
  encodes one framed task record, :class:`TaskReader` reads and decodes them in
  the worker, several per ``read()``.  This module is the only encoder and the only
  decoder of that format.
* :func:`dispatch`, :func:`flush`, :func:`pull`, :func:`hand_off` and the other
  steps of the parent's scheduler that an interrupt must not split: each is one call
  that runs no Python bytecode between its first change and its last
  (docs/design.md, "Faults").
* :func:`write_all` (a pipe, blocking) / :func:`send_upto` (a socket, never blocking):
  framed records, without the GIL.
"""
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLong
from cpython.ref cimport Py_INCREF

import os
import pickle

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


cdef int _write_loop(int fd, const char *p, Py_ssize_t n, Py_ssize_t *done, bint nonblocking) noexcept nogil:
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
        err = _write_loop(fd, p, n, &done, False)
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
        err = _write_loop(fd, p, n, &done, True)
    return done, err


# ---- the parent's steps that an interrupt must not split (docs/design.md, "Faults") ----
#
# A signal handler that raises (Ctrl-C's KeyboardInterrupt, a SIGTERM or SIGALRM
# handler) runs in the main thread at its next bytecode, whichever thread the kernel
# delivered the signal to: any thread that does not block it (a BLAS pool, a logging
# thread, tqdm's monitor), where CPython's C handler only sets a flag.  No signal mask
# of one thread keeps the handler out of a section.  So each change of the
# scheduler's state that must not be split is one call here: between its first
# change and its last it runs no Python bytecode (only C: the ring's methods, and
# list, deque, dict, set and attribute operations on objects without Python-level
# hooks), and an interrupt lands before it or after it.  The scheduler
# (mploader/_scheduler.py) owns the state and decides; these are its steps.

cdef inline _buffer(dict pending, worker, task, bytes frame):
    """Queue ``frame`` (``task``'s record; None: a RETIRE) for ``worker``."""
    items = pending.get(worker)
    if items is None:
        pending[worker] = [(task, frame)]
    else:
        (<list>items).append((task, frame))


def dispatch(sched, run, task, bytes frame, region, retire):
    """Dispatch ``task`` (made from the head of ``run.pushback``; ``frame`` its task
    record) in one step: E1 on ``task.slot`` when it is a slot (``region.assign``,
    which raises SlotStateError before anything changed), ``sched.seq`` past the
    task's, the record buffered in ``sched.pending``, the task appended to
    ``run.inflight`` and to its worker's ``outstanding``, the head of
    ``run.pushback`` dropped, the worker's ``sent`` counted; ``retire`` (a RETIRE
    record, or None) is buffered after the record and marks the worker retiring."""
    worker = task.worker
    cdef Py_ssize_t slot = task.slot
    if slot >= 0:
        region.assign(slot, task.seq)   # E1
    sched.seq = task.seq + 1
    cdef dict pending = sched.pending
    _buffer(pending, worker, task, frame)
    run.inflight.append(task)
    worker.outstanding.append(task)
    run.pushback.popleft()
    worker.sent += 1
    if retire is not None:
        worker.retiring = True
        _buffer(pending, worker, None, retire)


def hand_over(sched, task, worker, bytes frame, list items):
    """Give ``task``, whose record ``frame`` (``items[0]``, a dead worker's unsent
    records) never reached its worker, to ``worker`` in one step: the task's worker,
    ``worker.outstanding`` and ``sent``, the record buffered in ``sched.pending``, and
    ``items[0]`` dropped."""
    task.worker = worker
    worker.outstanding.append(task)
    worker.sent += 1
    _buffer(sched.pending, worker, task, frame)
    del items[0]


def flush(sched):
    """Send each worker's buffered records (``sched.pending``: ``{worker: [(task,
    frame), ...]}``) with one non-blocking ``send()``, and record what was sent in
    the same step: what a full socket did not take goes back to ``sched.pending``
    (the tail of a record the worker has begun to receive as an item without a task:
    that task is the worker's already), what a closed socket (a dead worker) did not
    take whole goes to ``sched.unsent``.  The sends release the GIL."""
    cdef dict pending = sched.pending
    cdef dict unsent = sched.unsent
    cdef dict left = {}
    cdef list items
    cdef bytes data, frame
    cdef const char *p
    cdef Py_ssize_t n, sent, start, end, k
    cdef int fd, err
    sched.pending = left
    for worker, items in pending.items():
        data = items[0][1] if len(items) == 1 else b"".join([item[1] for item in items])
        fd = worker.fd
        p = PyBytes_AS_STRING(data)
        n = len(data)
        with nogil:
            err = _write_loop(fd, p, n, &sent, True)
        if not err:
            continue
        end = 0
        for k in range(len(items)):
            frame = items[k][1]
            start = end
            end = end + len(frame)
            if end > sent:
                if err == EAGAIN:  # (EWOULDBLOCK on Linux)
                    if start >= sent:
                        left[worker] = items[k:]
                    else:
                        left[worker] = [(None, frame[sent - start:])] + items[k + 1:]
                else:
                    rest = unsent.get(worker)
                    if rest is None:
                        unsent[worker] = items[k:]
                    else:
                        (<list>rest).extend(items[k:])
                break


def pull(run, Py_ssize_t n):
    """Append up to ``n`` items of ``run.source`` (the sampler's task stream) to
    ``run.pushback``; returns how many (fewer than ``n``: the source is exhausted).
    Each item is appended in the step that takes it from the source.  An exception
    raised by the source (a handler's KeyboardInterrupt included: the source is
    Python code) is recorded in ``run.source_error`` in the same step, then
    propagates: a generator it passed through is finished, and the run must not
    take the StopIteration that follows for the end of the pass."""
    source = run.source
    pushback = run.pushback
    cdef Py_ssize_t k = 0
    try:
        while k < n:
            item = next(source)
            pushback.append(item)
            k += 1
    except StopIteration:
        pass
    except BaseException as exc:
        run.source_error = exc
        raise
    return k


def hand_off(run, task, value, bint failed, mailbox):
    """The consume tail in one step: ``run.handoff`` = ``value`` (``failed``: an
    exception that ``next()`` raises -- the worker's, or the reason the batch cannot
    be read), ``task`` consumed and off its worker's ``outstanding``, then the
    batch's message out of ``mailbox`` (the pipe; None for a slot) and the lease out
    of ``task.box`` (E4 when nothing else holds it; last, as a lease's release hook
    may run Python code)."""
    run.handoff = value
    run.failed = failed
    task.consumed = True
    worker = task.worker
    out = worker.outstanding
    if out and out[0] is task:
        out.popleft()
        if worker.done > 0:
            worker.done -= 1
    elif task in out:
        out.remove(task)
        worker.done = 0
    if mailbox is not None:
        (<dict>mailbox).pop(task.seq, None)
    del (<list>task.box)[:]


def follow_pipe(task):
    """``task``'s batch did not fit the region and follows on its worker's pipe (its
    slot holds a PIPE record): in one step the task waits on the pipe from now on and
    the lease leaves ``task.box`` (E4)."""
    task.via_pipe = True
    del (<list>task.box)[:]


def drop_stale(task, pipe_seqs):
    """A stale ``task`` (of an abandoned run) whose batch is there (its lease in
    ``task.box``) or comes by pipe, in one step: its seq joins ``pipe_seqs`` (the
    scheduler's set of pipe messages to drop; None when nothing comes by pipe), the
    task is marked done (``consumed``) and the lease leaves ``task.box`` (E4)."""
    if pipe_seqs is not None:
        (<set>pipe_seqs).add(task.seq)
    task.consumed = True
    del (<list>task.box)[:]


def serial_next(it):
    """A face iterator's ``__next__`` (the Gluon face's ``_LoaderIter``): the next
    batch of ``it._gen`` (a :class:`~mploader._scheduler.Run`, or an in-process run)
    with ``it._lock`` held (threads sharing the iterator get each batch once, in
    order), counted in ``it._progress.consumed`` (when not None); an exception of the
    run goes to ``it._ended(exc)`` first, then propagates.  Written here, not in
    Python: from the run's ``__next__`` to the caller the batch passes through C only.
    CPython runs pending signal handlers when a call returns into Python code (3.10:
    every call, and every jump; 3.11+: calls of C functions, such as a ``with``'s
    ``__exit__``), and one raising there dropped the batch on its way out."""
    with it._lock:
        try:
            batch = next(it._gen)
        except BaseException as exc:
            it._ended(exc)
            raise
        progress = it._progress
        if progress is not None:
            progress.consumed += 1
        return batch


def abandon_runs(sched):
    """Make the batches in flight of the runs superseded or dropped since the last
    call stale, in one step: ``sched.dropped`` lists their weak references (a run's
    death appends its own, a C call), ``sched.runs`` maps each to the run's
    ``inflight`` deque; the tasks of the current ``sched.generation`` not yet
    consumed join ``sched.stale`` (freed by the reaper as they complete) and the
    deque is emptied.  A reference listed twice finds its deque empty."""
    cdef list dropped = sched.dropped
    cdef dict runs = sched.runs
    cdef list stale = sched.stale
    generation = sched.generation
    while dropped:
        inflight = runs.pop(dropped[len(dropped) - 1], None)
        if inflight is not None:
            for t in inflight:
                if t.generation == generation and not t.consumed:
                    t.stale = True
                    stale.append(t)
            inflight.clear()
        dropped.pop()


# ---- generator states: per-batch seeding and the torch face's capture ----
# (docs/design.md, "Per-batch seeding"; mploader/_rng_state.py finds the offsets)
#
# No function here takes an address.  A field is named by the object that holds it
# and an offset that must lie inside that object's own struct (``tp_basicsize`` of
# its type: memory the object owns whatever the offset's meaning), so a wrong
# offset can garble that generator's state but never touch other memory.  The
# caller (mploader/_rng_state.py) checks the interpreter before calling any of these
# and uses only offsets it found and checked against the public getters.

from cpython.object cimport Py_TYPE as _type_of, PyObject as _PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport uintptr_t
from libc.string cimport memset

import sys

cdef extern from *:
    """
    /* The first member of NumPy's bitgen_t (numpy/random/bitgen.h), the only one read. */
    typedef struct { void *state; } mpl_bitgen_head;
    """
    ctypedef struct mpl_bitgen_head:
        void *state

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
    cdef mpl_bitgen_head *head = <mpl_bitgen_head *>PyCapsule_GetPointer(bitgen.capsule, "BitGenerator")
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


# ---- collation checks (mploader/_collate.py) ----

cimport numpy as cnp
import numpy as np
from cpython.float cimport PyFloat_AS_DOUBLE

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

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    /* Copy n bytes with non-temporal (streaming) stores: the destination bypasses the
     * caches, so a batch far larger than the cache does not evict the worker's working
     * set to write lines nobody in this process reads again.  The caller fences. */
    static void mpl_stream_copy(char *d, const char *s, size_t n) {
        while (((uintptr_t)d & 15) && n) { *d++ = *s++; n--; }
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + i, s + i, n - i);
    }
    static void mpl_stream_fence(void) { _mm_sfence(); }
    #define MPL_HAVE_STREAM 1
    #else
    static void mpl_stream_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }
    static void mpl_stream_fence(void) {}
    #define MPL_HAVE_STREAM 0
    #endif
    """
    void mpl_stream_copy(char *d, const char *s, size_t n) nogil
    void mpl_stream_fence() nogil
    int MPL_HAVE_STREAM

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
    cdef const char *src
    if not MPL_HAVE_STREAM or total < STREAM_MIN_BYTES:
        for k in range(n):
            memcpy(dst + k * row, <const char *>cnp.PyArray_DATA(<cnp.ndarray>samples[k]), <size_t>row)
        return True
    for k in range(n):
        src = <const char *>cnp.PyArray_DATA(<cnp.ndarray>samples[k])
        with nogil:
            mpl_stream_copy(dst + k * row, src, <size_t>row)
    mpl_stream_fence()  # the stores are visible before the slot is published (E2 releases after this)
    return True


# ---- batch plans: one structure's collation, verified and written in one call ----

from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.tuple cimport PyTuple_GET_SIZE
from cpython.exc cimport PyErr_Occurred, PyErr_Clear
from libc.stdlib cimport malloc, free

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
        cdef Py_ssize_t n = len(samples), i, j, d
        cdef PyObject *s
        cdef PyObject *leaf
        cdef plan_field *p
        cdef char *dst
        cdef long long v
        if n != self.batch_size or capacity < self.total or base == 0:
            return False
        for i in range(n):
            s = PyList_GET_ITEM_raw(samples, i)
            if self.in_tuple and (<PyTypeObject *>Py_TYPE(<object>s) != &PyTuple_Type
                                  or PyTuple_GET_SIZE(<object>s) != self.nfields):
                return False
            for j in range(self.nfields):
                p = &self.f[j]
                leaf = PyTuple_GET_ITEM_raw(<object>s, j) if self.in_tuple else s
                if <PyTypeObject *>Py_TYPE(<object>leaf) != p.type:
                    return False
                dst = <char *>base + p.offset + i * p.row
                if p.kind == PLAN_ARRAY:
                    if cnp.PyArray_NDIM(<cnp.ndarray>leaf) != p.nd or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>leaf):
                        return False
                    for d in range(p.nd):
                        if cnp.PyArray_DIMS(<cnp.ndarray>leaf)[d] != p.dims[d]:
                            return False
                    if cnp.PyArray_DESCR(<cnp.ndarray>leaf) != p.descr and not PyArray_EquivTypes_raw(
                            cnp.PyArray_DESCR(<cnp.ndarray>leaf), p.descr):
                        return False
                    if p.stream:
                        with nogil:
                            mpl_stream_copy(dst, <const char *>cnp.PyArray_DATA(<cnp.ndarray>leaf), <size_t>p.row)
                    else:
                        memcpy(dst, cnp.PyArray_DATA(<cnp.ndarray>leaf), <size_t>p.row)
                elif p.kind == PLAN_INT:
                    v = PyLong_AsLongLong_raw(leaf)
                    if v == -1 and PyErr_Occurred() != NULL:
                        PyErr_Clear()  # beyond int64: NumPy would choose another dtype
                        return False
                    (<int64_t *>dst)[0] = v
                elif p.kind == PLAN_FLOAT:
                    (<double *>dst)[0] = PyFloat_AS_DOUBLE_raw(leaf)
                elif p.kind == PLAN_BOOL:
                    dst[0] = 1 if leaf == Py_True_raw else 0
                elif p.kind == PLAN_SCALAR:
                    cnp.PyArray_ScalarAsCtype(<object>leaf, dst)
                # PLAN_OTHER: the caller fills the column (its type was checked above)
        memcpy(<char *>base + self.desc_off, PyBytes_AS_STRING(self.descriptor), len(self.descriptor))
        if self.any_stream:
            mpl_stream_fence()  # the streaming stores are visible before the slot is published
        return True
