"""The worker loop: receive a task, load its samples, collate into the slot, publish.

A worker is a forked child of the parent; it inherits the dataset, the batchify
function and the slot region.  Tasks arrive on its end of a socketpair as pickled
tuples ``(seq, slot, epoch, batch_index, indices)``; ``slot == -1`` means "no slot
was free: send the batch through this pipe".  The pipe also carries batches that
cannot be placed in the region at all (KIND_PIPE) and nothing else.
"""
from __future__ import annotations

import os
import pickle
import random
import signal
import struct
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import _ring
from ._descriptor import SlotWriter

RETIRE = b"retire"
#: Header of a batch sent through the pipe: (seq, kind), then the pickled batch.
PIPE_HEADER = struct.Struct("<qI")
_MASK64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def batch_seed(seed: int, epoch: int, batch_index: int) -> int:
    """The 64-bit seed of one batch, a pure function of (seed, epoch, batch_index)."""
    return _splitmix(_splitmix(_splitmix(seed & _MASK64) ^ (epoch & _MASK64)) ^ (batch_index & _MASK64))


def seed_rngs(seed64: int) -> None:
    """Seed ``random``, NumPy's global RNG and (if already imported) torch's."""
    random.seed(seed64)
    np.random.seed(seed64 & 0xFFFFFFFF)
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator only: torch.manual_seed also seeds every accelerator
        # backend (~130 us a call), and a forked worker cannot use CUDA anyway.
        torch.default_generator.manual_seed(seed64 & 0x7FFFFFFFFFFFFFFF)


def error_record(exc: BaseException, seq: int, indices: Any) -> dict:
    """A picklable description of an exception raised while loading a batch."""
    try:
        blob = pickle.dumps(exc, protocol=5)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    return {
        "exc": blob,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "indices": indices,
        "pid": os.getpid(),
        "seq": seq,
        "stage": "loading",
    }


@dataclass
class WorkerContext:
    """Everything a worker inherits from the parent at fork time."""

    worker_id: int
    region: _ring.Region
    conn: Any                      # multiprocessing.connection.Connection (worker end)
    dataset: Any
    fetch: Callable[[Any, Any, Callable], Any]   # (dataset, indices, alloc) -> batch
    seed: int
    parent_pid: int
    drop: Callable[[], None]       # closes resources this child must not hold


def worker_main(ctx: WorkerContext) -> None:
    """Run the worker loop; never returns (the process exits)."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _ring.set_pdeathsig(signal.SIGKILL, ctx.parent_pid)
        ctx.drop()
        ctx.region.populate()
        _loop(ctx)
    except BaseException:  # noqa: BLE001 - the process is about to exit; report why
        code = 1
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _loop(ctx: WorkerContext) -> None:
    conn, region, dataset, fetch, conn_send = ctx.conn, ctx.region, ctx.dataset, ctx.fetch, ctx.conn.send_bytes
    base_seed = ctx.seed
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if msg == RETIRE:
            return
        seq, slot, epoch, batch_index, indices = pickle.loads(msg)
        seed_rngs(batch_seed(base_seed, epoch, batch_index))
        writer = SlotWriter(region, slot, seq) if slot >= 0 else None
        alloc = writer.alloc if writer is not None else np.empty
        try:
            batch = fetch(dataset, indices, alloc)
            kind = _ring.KIND_SLOT
        except Exception as exc:  # noqa: BLE001 - re-raised in the parent
            batch = error_record(exc, seq, indices)
            kind = _ring.KIND_ERROR
            exc = None
        try:
            _deliver(conn_send, writer, seq, kind, batch)
        except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
            # The batch cannot be serialised (a lambda, a generator, ...): report
            # that to the parent as this batch's error instead of dying.
            record = error_record(exc, seq, indices)
            record["stage"] = "serialising (the batch could not be serialised)"
            _deliver(conn_send, writer, seq, _ring.KIND_ERROR, record)
        del batch, writer, alloc


def _deliver(conn_send: Callable[[bytes], None], writer: SlotWriter | None, seq: int, kind: int,
             obj: Any) -> None:
    """Publish ``obj`` in the writer's slot, or send it through the pipe."""
    if writer is not None:
        data = writer.finish(obj, kind)
        if data is not None:
            conn_send(PIPE_HEADER.pack(seq, kind) + data)
    else:
        conn_send(PIPE_HEADER.pack(seq, kind) + pickle.dumps(obj, protocol=5))
