"""The ``copy-limit`` row: what the memory bus lets the workers copy.

``workers`` forked processes (as many as the loaders' workers) copy batches of
distinct samples, drawn at random from the suite's pool (not in the CPU cache,
:mod:`mploader_bench.cachesize`), into rotating pre-faulted buffers that together
exceed the last-level cache, all at once.  Each byte of a batch is read once and
written once, with no Python per sample: the physical limit of a loader that
collates (one copy) on this machine with that many processes.  The rate is in
batches per second of the suite's batch size; its GB/s counts the samples' array
payload (the labels, 8 bytes a sample, are not copied).

Two ways to copy are measured and the faster one is the limit:

``take``
    :func:`numpy.take` of the batch's rows (``mode="clip"``: unbuffered), a
    ``memcpy`` per row with ordinary stores;
``stream``
    only for batches of at least ``mploader._columns.STREAM_MIN_BYTES`` (4 MiB): the
    rows copied with streaming stores by ``mploader._columns.copy_rows``, as the ring's
    workers write such batches.  Streaming stores skip reading the destination's
    lines first, so the faster copy is the fair limit where a loader uses them.
"""
from __future__ import annotations

import math
import mmap
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["COPY_LIMIT", "CopyLimit", "copy_batches", "shared_arena", "stream_min_bytes"]

COPY_LIMIT = "copy-limit"
_FORK = multiprocessing.get_context("fork")
_REPLY_TIMEOUT_S = 300.0


def stream_min_bytes() -> int | None:
    """Batch bytes from which mploader writes with streaming stores (None: it does not here)."""
    try:
        from mploader import _columns
    except ImportError:
        return None
    if not getattr(_columns, "HAVE_STREAM", True):
        return None
    return int(getattr(_columns, "STREAM_MIN_BYTES", 4 << 20))


def copy_batches(rows: np.ndarray, indices: np.ndarray, arena: np.ndarray, count: int, *,
                 method: str = "take", start: int = 0, views: list | None = None) -> None:
    """Copy `count` batches of `rows` into the rotating buffers of `arena`.

    Batch ``k`` (from ``start``) gathers ``rows[indices[k % len(indices)]]`` into
    ``arena[k % len(arena)]``.

    Parameters
    ----------
    rows : numpy.ndarray of shape (distinct, row_bytes), dtype uint8
        The pool, one sample's bytes per row.
    indices : numpy.ndarray of shape (n, B), dtype int64
        Row numbers of each batch (used in turn, round and round).
    arena : numpy.ndarray of shape (buffers, B, row_bytes), dtype uint8
        The rotating output buffers (C-contiguous).
    count : int
        Batches to copy.
    method : {"take", "stream"}, optional
        See the module's docstring.
    start : int, optional
        Number of the first batch (picks its indices and its buffer).
    views : list of numpy.ndarray, optional
        ``list(rows)``, for ``"stream"`` (built once by the caller).

    Raises
    ------
    ValueError
        If `method` is unknown, or ``"stream"`` cannot copy these rows.
    """
    n_idx, n_buf = len(indices), len(arena)
    if method == "take":
        for k in range(start, start + count):
            np.take(rows, indices[k % n_idx], axis=0, out=arena[k % n_buf], mode="clip")
    elif method == "stream":
        from mploader import _columns

        vs = list(rows) if views is None else views
        for k in range(start, start + count):
            if not _columns.copy_rows([vs[i] for i in indices[k % n_idx].tolist()], arena[k % n_buf]):
                raise ValueError("copy_batches: method='stream': mploader._columns.copy_rows declined "
                                 f"rows of shape {rows.shape[1:]} dtype {rows.dtype}")
    else:
        raise ValueError(f"copy_batches: method={method!r}: expected 'take' or 'stream'")


def shared_arena(buffers: int, batch_size: int, row_bytes: int) -> np.ndarray:
    """``buffers`` batch buffers, uint8 of shape ``(buffers, batch_size, row_bytes)``, in
    shared memory (an anonymous ``MAP_SHARED`` mapping) and written once (faulted in).

    Shared, as every loader's output must be: a batch built in a worker reaches the
    training process through shared pages (mploader's ring is a memfd, torch's tensors
    go to ``/dev/shm``).  Private memory would make the limit one no multi-process
    loader can reach where the kernel gives private memory transparent huge pages and
    shared memory none (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``: "never"
    by default): numpy asks for huge pages for its large arrays, and on the suite's
    2-core machine such an arena made copy-limit 6-14 % faster (docs/bench-log.md).
    """
    nbytes = buffers * batch_size * row_bytes
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    arena = np.frombuffer(region, np.uint8, count=nbytes).reshape(buffers, batch_size, row_bytes)
    arena.fill(1)
    return arena


def _child(conn: Any, rows: np.ndarray, batch_size: int, buffers: int, block: int, seed: int) -> None:
    arena = shared_arena(buffers, batch_size, rows.shape[1])
    indices = np.random.default_rng(seed).integers(0, len(rows), size=(block, batch_size))
    views: list | None = None
    done = 0
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, count = msg
        if method == "stream" and views is None:
            views = list(rows)
        conn.send("ready")
        conn.recv()  # go
        t0 = time.perf_counter()
        copy_batches(rows, indices, arena, count, method=method, start=done, views=views)
        conn.send(time.perf_counter() - t0)
        done += count
    conn.close()


class CopyLimit:
    """``workers`` processes copying the pool's samples into rotating buffers at once.

    Parameters
    ----------
    pool : numpy.ndarray of shape (distinct, *sample_shape)
        The distinct samples' arrays, C-contiguous (the suite's pool).
    batch_size : int
        Samples per batch.
    workers : int
        Processes copying at once (>= 1).
    llc_bytes : int
        Last-level cache: the rotating buffers total at least twice it, and each
        process's batch indices span at least 4 times it.
    seed : int, optional
        Seed of the processes' random rows.
    methods : sequence of str, optional
        Default ``("take",)``, plus ``"stream"`` for batches that mploader writes with
        streaming stores.

    Raises
    ------
    ValueError
        If an argument is out of range.
    """

    name = COPY_LIMIT

    def __init__(self, pool: np.ndarray, batch_size: int, *, workers: int, llc_bytes: int,
                 seed: int = 0, methods: Sequence[str] | None = None) -> None:
        if workers < 1:
            raise ValueError(f"CopyLimit: workers={workers!r}: expected >= 1")
        if batch_size < 1:
            raise ValueError(f"CopyLimit: batch_size={batch_size!r}: expected >= 1")
        if not pool.flags.c_contiguous or len(pool) < 1:
            raise ValueError("CopyLimit: pool: expected a non-empty C-contiguous array")
        rows = pool.reshape(len(pool), -1).view(np.uint8)
        self.row_bytes = rows.shape[1]
        self.batch_bytes = batch_size * self.row_bytes
        if methods is None:
            stream = stream_min_bytes()
            methods = ("take", "stream") if stream is not None and self.batch_bytes >= stream else ("take",)
        self.methods = tuple(methods)
        self.workers = int(workers)
        self.last: dict[str, float] = {}  # batches/s of each method in the last run()
        buffers = max(4, math.ceil(2 * llc_bytes / (self.workers * self.batch_bytes)))
        block = max(64, math.ceil(4 * llc_bytes / self.batch_bytes))
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        try:
            for w in range(self.workers):
                parent, child = _FORK.Pipe()
                p = _FORK.Process(target=_child, args=(child, rows, batch_size, buffers, block,
                                                       seed * 1000 + w), daemon=True)
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
        except BaseException:
            self.close()
            raise

    def _recv(self, conn: Any) -> Any:
        if not conn.poll(_REPLY_TIMEOUT_S):
            raise RuntimeError(f"{COPY_LIMIT}: a copying process gave no answer in {_REPLY_TIMEOUT_S:g} s")
        return conn.recv()

    def run_method(self, method: str, batches: int) -> float:
        """Copy `batches` batches, split over the processes, all at once, with `method`.

        Returns
        -------
        float
            Wall seconds from the start signal until the last process finished.
        """
        counts = [batches // self.workers + (w < batches % self.workers) for w in range(self.workers)]
        for conn, count in zip(self._conns, counts):
            conn.send((method, count))
        for conn in self._conns:
            self._recv(conn)
        t0 = time.perf_counter()
        for conn in self._conns:
            conn.send("go")
        for conn in self._conns:
            self._recv(conn)
        return time.perf_counter() - t0

    def run(self, batches: int) -> float:
        """One timed run of every method; the wall seconds of the fastest.

        Each method's batches/s is left in :attr:`last`.

        Parameters
        ----------
        batches : int
            Batches per method (>= 1).

        Returns
        -------
        float
            Seconds the fastest method took for `batches` batches.
        """
        if not self._procs:
            raise RuntimeError(f"{COPY_LIMIT} is closed")
        walls = {m: self.run_method(m, batches) for m in self.methods}
        self.last = {m: batches / w if w > 0 else float("inf") for m, w in walls.items()}
        return min(walls.values())

    def close(self) -> None:
        """Stop the processes; idempotent."""
        procs, self._procs = self._procs, []
        conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in conns:
            conn.close()

    def __enter__(self) -> CopyLimit:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
