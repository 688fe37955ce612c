# cython: language_level=3, boundscheck=False, wraparound=False
"""The opcode scan of :func:`mploader._inband.check_pickle`, at C speed.

``scan(data)`` walks a pickle's opcode stream with the argument layout table that
``_inband`` builds from :mod:`pickletools` (``set_table``) and reports the first
problem as a tuple ``(code, pos, value, extra)``, or None when the stream is sound:
every opcode known, every declared length and frame within the data, every memo
index at most the number of memo stores before it, and a STOP.  ``_inband`` turns
a problem into the :class:`CorruptDescriptor` message.  No Python object is made
per opcode; the scan allocates nothing.
"""
from libc.stdint cimport int64_t, uint64_t

# problem codes (mploader._inband turns them into messages)
cdef enum:
    UNKNOWN_OPCODE = 1
    RUNS_PAST = 2
    LENGTH_PAST = 3
    LINE_NO_END = 4
    MEMO_INDEX = 5
    FRAME_PAST = 6
    NO_STOP = 7
    BAD_MEMO_TEXT = 8

cdef signed char _kind[256]      # -1 not an opcode; 0 fixed; 1 length-prefixed; 2 one line; 3 two lines
cdef unsigned char _size[256]    # fixed size, or the length prefix's size
cdef unsigned char _role[256]    # 0 none; 1 binary put; 2 binary get; 3 text put; 4 text get; 5 FRAME;
                                 # 6 MEMOIZE; 7 STOP; 8 signed length prefix
cdef bint _ready = False


def set_table(table, roles):
    """``table[op]``: (kind, size) or None; ``roles``: {op: role} (see the module)."""
    global _ready
    cdef int op
    for op in range(256):
        spec = table[op]
        if spec is None:
            _kind[op] = -1
            _size[op] = 0
        else:
            _kind[op] = spec[0]
            _size[op] = spec[1]
        _role[op] = roles.get(op, 0)
    _ready = True


cdef inline uint64_t _le(const unsigned char *p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(n - 1, -1, -1):
        v = (v << 8) | p[k]
    return v


def scan(const unsigned char[::1] data):
    """The first problem of the pickle ``data`` as (code, pos, value, extra), or None."""
    if not _ready:
        raise RuntimeError("mploader._pickle_scan.set_table was not called")
    cdef Py_ssize_t n = data.shape[0]
    cdef const unsigned char *b = &data[0] if n else NULL
    cdef Py_ssize_t pos = 0, at, end, left
    cdef uint64_t stores = 0, value
    cdef int64_t length
    cdef int op, kind, size, role, line
    while pos < n:
        op = b[pos]
        kind = _kind[op]
        if kind < 0:
            return (UNKNOWN_OPCODE, pos, op, 0)
        size = _size[op]
        role = _role[op]
        at = pos
        pos += 1
        if kind == 0:
            if size > n - pos:
                return (RUNS_PAST, at, op, n)
            if role == 1 or role == 2 or role == 5:
                value = _le(b + pos, size)
                if role == 5:
                    if value > <uint64_t>(n - pos - size):
                        return (FRAME_PAST, at, value, n - pos - size)
                elif value > stores or (role == 2 and value == stores):
                    return (MEMO_INDEX, at, value, stores)
                elif role == 1:
                    stores += 1
            elif role == 6:
                stores += 1
            elif role == 7:
                return None
            pos += size
        elif kind == 1:
            if size > n - pos:
                return (RUNS_PAST, at, op, n)
            value = _le(b + pos, size)
            pos += size
            left = n - pos
            if role == 8 and size == 4 and value >= <uint64_t>0x80000000:
                return (LENGTH_PAST, at, <int64_t>value - <int64_t>0x100000000, left)
            if value > <uint64_t>left:
                return (LENGTH_PAST, at, value, left)
            pos += <Py_ssize_t>value
        else:
            for line in range(kind - 1):
                end = pos
                while end < n and b[end] != 10:
                    end += 1
                if end >= n:
                    return (LINE_NO_END, at, 0, 0)
                if role == 3 or role == 4:
                    if end == pos or end - pos > 18:
                        return (BAD_MEMO_TEXT, at, end - pos, 0)
                    value = 0
                    while pos < end:
                        if b[pos] < 48 or b[pos] > 57:
                            return (BAD_MEMO_TEXT, at, end - pos, 0)
                        value = value * 10 + (b[pos] - 48)
                        pos += 1
                    if value > stores or (role == 4 and value == stores):
                        return (MEMO_INDEX, at, value, stores)
                    if role == 3:
                        stores += 1
                pos = end + 1
    return (NO_STOP, n, 0, 0)
