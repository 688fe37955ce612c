"""Every batch of the transport suite is checked: a wrong batch fails the run.

The check is a fingerprint cheap enough for the timed loop (about 0.6 µs for a
tiny batch, 1.1 µs for a 256-sample one): the first 8 bytes of every sample's
array row, and every label, in batch order, hashed together.  It is compared with
the fingerprint the dataset says the batch must have.  A batch with a wrong,
missing, repeated or misplaced sample, a stale batch, a wrong shape, dtype or
batch size fails it (bytes beyond the first 8 of a row are checked on the first
batch only, by the suite's full comparison with the inline reference).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BatchMismatch", "BatchCheck"]


class BatchMismatch(RuntimeError):
    """A transport delivered a batch that is not the one asked for."""


class BatchCheck:
    """The expected fingerprint of each batch of a synthetic dataset.

    Sample ``i`` of the dataset is ``(array row i % distinct, label i % labels)``
    (or ``(label, array)``), as :class:`mploader_bench.transport.SyntheticDataset`.

    Parameters
    ----------
    tags : numpy.ndarray of shape (distinct,), dtype uint64
        The first 8 bytes of each distinct array row.
    row_bytes : int
        Bytes of one sample's array (a multiple of 8).
    labels : int
        Number of distinct labels (label of sample i: ``np.int64(i % labels)``).
    label_first : bool
        Samples are ``(label, array)``.

    Raises
    ------
    ValueError
        If `row_bytes` is not a positive multiple of 8 or `labels` < 1.
    """

    def __init__(self, tags: np.ndarray, row_bytes: int, labels: int, label_first: bool) -> None:
        if row_bytes < 8 or row_bytes % 8:
            raise ValueError(f"BatchCheck: row_bytes={row_bytes!r}: expected a positive multiple of 8")
        if labels < 1:
            raise ValueError(f"BatchCheck: labels={labels!r}: expected >= 1")
        self.tags = np.ascontiguousarray(tags, dtype=np.uint64)
        self.row_words = row_bytes // 8
        self.labels = int(labels)
        self.array_field = 1 if label_first else 0

    def expected(self, batches: Sequence[Sequence[int]]) -> list[int]:
        """The fingerprint each batch must have.

        Parameters
        ----------
        batches : list of list of int
            Dataset indices of each batch (batches of one size are vectorised).

        Returns
        -------
        list of int
            One fingerprint per batch, as :meth:`fingerprint` computes it.
        """
        out: list[int] = []
        distinct = len(self.tags)
        for indices in batches:
            idx = np.asarray(indices, dtype=np.int64)
            words = self.tags[idx % distinct]
            labels = (idx % self.labels).astype(np.int64)
            out.append(hash((words.tobytes(), labels.tobytes())))
        return out

    def fingerprint(self, batch: Any) -> int | None:
        """The fingerprint of a delivered batch, or None when it has the wrong form.

        Parameters
        ----------
        batch : tuple of numpy.ndarray
            ``(arrays (B, *shape), labels (B,) int64)`` or the reverse.
        """
        if not isinstance(batch, tuple) or len(batch) != 2:
            return None
        arrays, labels = batch[self.array_field], batch[1 - self.array_field]
        if not (isinstance(arrays, np.ndarray) and isinstance(labels, np.ndarray)) \
                or labels.dtype != np.int64 or labels.ndim != 1 \
                or arrays.ndim < 1 or arrays.shape[0] != labels.shape[0]:
            return None
        if arrays.nbytes != arrays.shape[0] * self.row_words * 8:
            return None
        if not arrays.flags.c_contiguous:
            arrays = np.ascontiguousarray(arrays)
        words = np.frombuffer(arrays, np.uint64)[::self.row_words]
        return hash((words.tobytes(), labels.tobytes()))

    def check(self, name: str, k: int, batch: Any, want: int) -> None:
        """Raise :class:`BatchMismatch` unless `batch` has the fingerprint `want`.

        Parameters
        ----------
        name : str
            The transport, for the message.
        k : int
            The batch's position in its epoch, for the message.
        batch : object
            What the transport delivered.
        want : int
            Its expected fingerprint (:meth:`expected`).
        """
        got = self.fingerprint(batch)
        if got != want:
            what = ("it is not (arrays, int64 labels) of the dataset's row size and one batch size"
                    if got is None else "other samples, labels or order than asked for (the first 8 "
                    f"bytes of each row and the labels fingerprint to {got}, expected {want})")
            raise BatchMismatch(f"{name}: batch {k} of the epoch is wrong: {what}")
