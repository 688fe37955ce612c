"""The wire format between the parent and a worker (docs/design.md, "Wire protocol").

Parent -> worker, on the worker's task pipe, one framed record per task:

    frame        <!i length> (as multiprocessing.connection, so the parent and a
                 spawned worker agree on framing)
    TASK header  <q seq> <q slot> <q epoch> <q batch_index> <I flags> <I count>
    payload      count int64 sample indices (INDICES_INT64), or count bytes of
                 pickled indices (INDICES_PICKLE)

``slot == -1``: no slot was free, send the batch back through the pipe.  A record
with the RETIRE flag (and no payload) asks the worker to exit after the tasks
before it.  The encoder (:func:`frame_task`, :func:`frame_retire`) and the decoder
(:class:`TaskReader`, which takes every queued record with one ``read``) are C, in
``mploader/_hot.pyx``; the parent writes the records it has for a worker with one
``send`` (:func:`send_upto`, never blocking: a burst of small batches costs one system call
per worker).

Worker -> parent, on the same pipe, only what does not travel in a slot:

    PIPE header  <q seq> <I kind>, then the pickled batch (kind SLOT/PIPE) or
                 :class:`~mploader._errors.BatchFailure` (kind ERROR), or a bad
                 sample's report record (kind 16, ``mploader._bad_samples.KIND_REPORT``:
                 sent before the batch ``seq`` is published)

A slot's own metadata (seq, kind, flags, used, descriptor range) lives in its
header in shared memory (csrc/ring.h, ``mpl_slot_meta``).
"""
from __future__ import annotations

import struct

from ._hot import (
                   TASK_FRAME_BYTES,
                   TASK_HEADER_BYTES,
                   TaskReader,
                   decode_task,
                   frame_retire,
                   frame_task,
                   send_upto,
                   write_all,
)

__all__ = ["PIPE_HEADER", "TASK_FRAME_BYTES", "TASK_HEADER_BYTES", "TaskReader", "decode_task", "frame_retire",
           "frame_task", "write_all", "send_upto"]

PIPE_HEADER = struct.Struct("<qI")
