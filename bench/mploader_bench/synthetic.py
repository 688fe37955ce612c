"""The transport suite's synthetic data: datasets, the batch list, the collate limit
(split from :mod:`.transport` to keep modules under ~600 lines).

A dataset's samples come from a *pool* of distinct pre-built arrays (views of one
contiguous block).  By default (``cache="cold"``) the pool holds at least
:data:`~mploader_bench.cachesize.POOL_FACTOR` times the last-level cache, so the
samples are not in the CPU cache when a batch reads them (docs/bench.md, "The cache
rule"); ``cache="resident"`` keeps the suite's former 4 distinct arrays, which stay
in the cache.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .cachesize import CacheInfo, PoolPlan, last_level_cache, plan_pool
from .checks import BatchCheck

__all__ = ["SIZES", "CACHE_MODES", "RESIDENT_DISTINCT", "SyntheticDataset", "CollateLimit",
           "make_dataset", "case_name"]

#: The synthetic datasets: batch size, sample layout, dataset length (at least; a cold
#: pool with more distinct samples makes the dataset that long).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=32, shape=(16,), dtype="float32", label_first=True, length=1 << 16),
    "small": dict(batch_size=256, shape=(32, 32, 3), dtype="uint8", label_first=False, length=1 << 16),
    "large": dict(batch_size=256, shape=(224, 224, 3), dtype="uint8", label_first=False, length=1 << 14),
}

#: ``cold``: a pool of at least 4 x the LLC (the default); ``resident``: 4 distinct arrays.
CACHE_MODES = ("cold", "resident")
#: Distinct arrays of the cache-resident variant (the suite's data before issue 24).
RESIDENT_DISTINCT = 4
#: Distinct labels (``np.int64(i % LABELS)``): few objects, cheap to fetch.
LABELS = 1024


def case_name(size: str, cache: str) -> str:
    """The report's key for one size and cache mode: ``"large"`` (cold) or ``"large-resident"``."""
    return size if cache == "cold" else f"{size}-{cache}"


class SyntheticDataset:
    """A dataset whose samples are pre-built arrays: indexing costs a list lookup.

    Parameters
    ----------
    shape : tuple of int
        Shape of the array field of each sample.
    dtype : str or numpy.dtype
        Its dtype.
    length : int
        ``len()`` of the dataset.
    label_first : bool, optional
        Samples are ``(label, array)`` instead of ``(array, label)``.
    distinct : int, optional
        Number of distinct arrays (the pool); sample ``i`` returns array
        ``i % distinct`` and the pre-built label ``np.int64(i % 1024)`` (few label
        objects, so that fetching stays cheap).

    Attributes
    ----------
    pool : numpy.ndarray of shape (distinct, *shape)
        The distinct arrays, one C-contiguous block (random bytes, or floats in [0, 1)).
    check : BatchCheck
        The expected fingerprint of a batch (:mod:`mploader_bench.checks`).
    plan : PoolPlan or None
        Set by :func:`make_dataset` for a cold pool.
    """

    def __init__(self, shape: Sequence[int], dtype: Any, length: int, *,
                 label_first: bool = False, distinct: int = RESIDENT_DISTINCT) -> None:
        if distinct < 1:
            raise ValueError(f"SyntheticDataset: distinct={distinct!r}: expected >= 1")
        rng = np.random.default_rng(1234)
        dtype = np.dtype(dtype)
        self.length = int(length)
        self.label_first = bool(label_first)
        full = (int(distinct), *map(int, shape))
        if dtype.kind == "f":
            pool = rng.random(full, dtype=dtype)
        else:
            pool = rng.integers(0, 255, size=full, dtype=dtype)
        self.pool = pool
        self._arrays = list(pool)  # pre-built views: no per-access view creation
        self._labels = [np.int64(i) for i in range(min(self.length, LABELS))]
        self.plan: PoolPlan | None = None
        self.llc: CacheInfo | None = None
        row = pool.reshape(len(pool), -1).view(np.uint8)
        tags = np.ascontiguousarray(row[:, :8]).view(np.uint64).ravel()
        self.check = BatchCheck(tags, row.shape[1], len(self._labels), self.label_first)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple:
        x = self._arrays[i % len(self._arrays)]
        y = self._labels[i % len(self._labels)]
        return (y, x) if self.label_first else (x, y)


def header_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of one pre-built sample view's Python object (its array header)."""
    return sys.getsizeof(np.zeros((2, *shape), dtype)[0])


def make_dataset(size: str, cache: str = "cold", *, llc: CacheInfo | None = None,
                 processes: int = 0, cap_bytes: int | None = None) -> SyntheticDataset:
    """The synthetic dataset of one of :data:`SIZES`.

    Parameters
    ----------
    size : str
        ``"tiny"``, ``"small"`` or ``"large"``.
    cache : {"cold", "resident"}, optional
        ``"cold"`` (a pool sized by :func:`mploader_bench.cachesize.plan_pool`: not
        in the cache) or ``"resident"`` (4 distinct arrays, which stay in the cache).
    llc : CacheInfo, optional
        The last-level cache; default :func:`~mploader_bench.cachesize.last_level_cache`.
    processes : int, optional
        Processes that will hold the pool besides this one (for the memory cap).
    cap_bytes : int, optional
        The pool's memory cap (default :func:`~mploader_bench.cachesize.default_cap_bytes`).

    Returns
    -------
    SyntheticDataset
        With ``plan`` and ``llc`` set for a cold pool; its length is at least the
        number of distinct samples.

    Raises
    ------
    ValueError
        If `size` or `cache` is unknown.
    """
    if size not in SIZES:
        raise ValueError(f"make_dataset: size={size!r}: expected one of {tuple(SIZES)}")
    if cache not in CACHE_MODES:
        raise ValueError(f"make_dataset: cache={cache!r}: expected one of {CACHE_MODES}")
    spec = SIZES[size]
    shape, dtype = tuple(spec["shape"]), np.dtype(spec["dtype"])
    if cache == "resident":
        return SyntheticDataset(shape, dtype, spec["length"], label_first=spec["label_first"])
    llc = last_level_cache() if llc is None else llc
    plan = plan_pool(math.prod(shape) * dtype.itemsize, header_bytes(shape, dtype), llc.bytes,
                     processes=processes, cap_bytes=cap_bytes)
    ds = SyntheticDataset(shape, dtype, max(spec["length"], plan.samples),
                          label_first=spec["label_first"], distinct=plan.samples)
    ds.plan, ds.llc = plan, llc
    return ds


def describe_sample(size: str) -> str:
    spec = SIZES[size]
    arr = f"{spec['dtype']} {tuple(spec['shape'])}"
    return f"(np.int64, {arr})" if spec["label_first"] else f"({arr}, np.int64)"


class Batches:
    """Prefixes of one growing random batch list (same indices for every transport),
    with each batch's expected fingerprint (:class:`~mploader_bench.checks.BatchCheck`).

    Parameters
    ----------
    length : int
        Indices are drawn from ``range(length)``.
    batch_size : int
        Indices per batch.
    seed : int
        Seed of the draw.
    check : BatchCheck, optional
        Computes :meth:`expected`.
    """

    def __init__(self, length: int, batch_size: int, seed: int, check: BatchCheck | None = None) -> None:
        self._rng = np.random.default_rng(seed)
        self._length = length
        self._bs = batch_size
        self._list: list[list[int]] = []
        self._check = check
        self._expected: list[int] = []

    def take(self, n: int) -> list[list[int]]:
        """The first `n` batches."""
        if n > len(self._list):
            more = max(n - len(self._list), len(self._list))
            self._list.extend(self._rng.integers(0, self._length, size=(more, self._bs)).tolist())
        return self._list[:n]

    def expected(self, n: int) -> list[int]:
        """The fingerprints of the first `n` batches.

        Raises
        ------
        RuntimeError
            If the list was made without a `check`.
        """
        if self._check is None:
            raise RuntimeError("Batches.expected: this batch list has no check")
        have = len(self._expected)
        if n > have:
            self._expected.extend(self._check.expected(self.take(n)[have:n]))
        return self._expected[:n]


class CollateLimit:
    """Single-process :func:`numpy.stack` into pre-allocated, pre-faulted buffers.

    Same ``epoch``/``close`` interface as :class:`mploader_bench.peers.Transport`,
    so it runs in the same loop.  The batch size and sample structure are taken
    from the first batch; the output buffers are written once up front, so no
    page fault is counted.  One buffer is written again and again, so it stays
    partly in the cache: a one-core collation cost, not the memory bus's limit
    (that is :class:`mploader_bench.copylimit.CopyLimit`).

    Parameters
    ----------
    dataset : object
        Map-style dataset whose samples are arrays, numbers or tuples of those.
    max_batch : int
        Largest batch size to allocate for.
    """

    name = "collate-limit"

    def __init__(self, dataset: Any, max_batch: int) -> None:
        self.dataset = dataset
        first = dataset[0]
        self._tuple = isinstance(first, (tuple, list))
        fields = list(first) if self._tuple else [first]
        self._bufs = []
        self._stack = []  # per field: np.stack (arrays) or element-wise assignment (numbers)
        for f in fields:
            a = np.asarray(f)
            buf = np.empty((max_batch,) + a.shape, dtype=a.dtype)
            buf.fill(1)  # fault every page in now
            self._bufs.append(buf)
            self._stack.append(isinstance(f, np.ndarray) and f.ndim > 0)

    def epoch(self, batches: Sequence[Sequence[int]]) -> Iterator[Any]:
        """Collate each batch into the buffers; yields the buffers' views.

        Array fields are stacked with ``np.stack(..., out=buffer)``; number
        fields are assigned element-wise (as ``np.asarray`` would collate them).

        Parameters
        ----------
        batches : list of list of int
            Indices of each batch.

        Yields
        ------
        tuple of numpy.ndarray or numpy.ndarray
            Views of the output buffers (overwritten by the next batch).
        """
        ds = self.dataset
        fields = list(zip(range(len(self._bufs)), self._bufs, self._stack))
        for indices in batches:
            samples = [ds[i] for i in indices]
            n = len(samples)
            if not self._tuple:
                samples = [(s,) for s in samples]
            out = []
            for k, buf, stack in fields:
                view = buf[:n]
                column = [s[k] for s in samples]
                if stack:
                    np.stack(column, out=view)
                else:
                    view[...] = column
                out.append(view)
            yield tuple(out) if self._tuple else out[0]

    def close(self) -> None:
        """Nothing to stop; present for the common interface."""

    def __enter__(self) -> CollateLimit:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
