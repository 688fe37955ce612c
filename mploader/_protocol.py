"""The wire format between the parent and a worker (docs/design.md, "Wire protocol").

Parent -> worker, on the worker's task pipe, one framed message per task:

    TASK header  <q seq> <q slot> <q epoch> <q batch_index> <I flags> <I count>
    payload      count int64 sample indices (INDICES_INT64), or count bytes of
                 pickled indices (INDICES_PICKLE)

``slot == -1``: no slot was free, send the batch back through the pipe.  A message
with the RETIRE flag (and no payload) asks the worker to exit after the tasks
before it.  Messages use ``multiprocessing.connection``'s framing (a 4-byte
big-endian length, then the bytes), so the parent sends with ``send_bytes`` and
the worker may read several queued messages with one ``read``
(:class:`TaskReader`).

Worker -> parent, on the same pipe, only what does not travel in a slot:

    PIPE header  <q seq> <I kind>, then the pickled batch (kind SLOT/PIPE) or
                 :class:`~mploader._errors.BatchFailure` (kind ERROR)

A slot's own metadata (seq, kind, flags, used, descriptor range) lives in its
header in shared memory (csrc/ring.h, ``mpl_slot_meta``).
"""
from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Task", "TASK", "PIPE_HEADER", "encode_task", "encode_retire", "TaskReader",
           "INDICES_INT64", "INDICES_PICKLE", "RETIRE", "frame_task"]

TASK = struct.Struct("<qqqqII")
PIPE_HEADER = struct.Struct("<qI")
_FRAME = struct.Struct("!i")

INDICES_INT64 = 1
INDICES_PICKLE = 2
RETIRE = 4


@dataclass(slots=True)
class Task:
    """One batch as the worker sees it."""

    seq: int
    slot: int
    epoch: int
    batch_index: int
    indices: Any


def encode_task(seq: int, slot: int, epoch: int, batch_index: int, indices: Any) -> bytes:
    """The message for one task: int64 indices when ``indices`` is a list of ints,
    a pickle otherwise (shards, tuples, arbitrary sampler output)."""
    if type(indices) is list and all(type(i) is int for i in indices):
        n = len(indices)
        try:
            return TASK.pack(seq, slot, epoch, batch_index, INDICES_INT64, n) + struct.pack(f"<{n}q", *indices)
        except struct.error:
            pass  # an index beyond int64: pickle it
    blob = pickle.dumps(indices, protocol=5)
    return TASK.pack(seq, slot, epoch, batch_index, INDICES_PICKLE, len(blob)) + blob


def frame_task(seq: int, slot: int, epoch: int, batch_index: int, indices: Any) -> bytes:
    """:func:`encode_task` with its frame header (for one ``os.write``)."""
    msg = encode_task(seq, slot, epoch, batch_index, indices)
    return _FRAME.pack(len(msg)) + msg


def encode_retire() -> bytes:
    return TASK.pack(-1, -1, 0, 0, RETIRE, 0)


def decode_task(msg: memoryview) -> Task | None:
    """The task in ``msg``; None for RETIRE.  Raises ValueError on a malformed message."""
    seq, slot, epoch, batch_index, flags, count = TASK.unpack_from(msg)
    if flags & RETIRE:
        return None
    body = msg[TASK.size:]
    if flags & INDICES_INT64:
        if len(body) != 8 * count:
            raise ValueError(f"task {seq}: {len(body)} bytes of indices for {count} int64")
        indices: Any = list(struct.unpack(f"<{count}q", body))
    elif flags & INDICES_PICKLE:
        if len(body) != count:
            raise ValueError(f"task {seq}: {len(body)} bytes of pickled indices, header says {count}")
        indices = pickle.loads(body)
    else:
        raise ValueError(f"task {seq}: unknown flags {flags:#x}")
    return Task(seq, slot, epoch, batch_index, indices)


class TaskReader:
    """Reads framed messages from a pipe fd, several per ``read`` when they are queued.

    ``next()`` blocks until a whole message is there and returns it (a memoryview
    valid until the following call); raises EOFError when the parent closed its end.
    """

    __slots__ = ("fd", "buf", "pos", "chunk")

    def __init__(self, fd: int, chunk: int = 1 << 16) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.pos = 0
        self.chunk = chunk

    def _fill(self, need: int) -> None:
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        while len(self.buf) < need:
            data = os.read(self.fd, max(self.chunk, need - len(self.buf)))
            if not data:
                raise EOFError("the parent closed the task pipe")
            self.buf += data

    def next(self) -> bytes:
        if len(self.buf) - self.pos < 4:
            self._fill(4)
        (n,) = _FRAME.unpack_from(self.buf, self.pos)
        if n < 0:
            raise ValueError(f"bad frame length {n}")
        if len(self.buf) - self.pos < 4 + n:
            self._fill(4 + n)
        start = self.pos + 4
        self.pos = start + n
        return bytes(self.buf[start:start + n])
