"""Datasets of Python objects that forked workers can read without copying them.

A worker forked from the training process shares the parent's memory copy-on-write.
Reading a Python object changes its reference count, which writes to the page the
object lives in, so the kernel copies that page into the worker: a list of
annotation dicts (COCO-style) is copied, page by page, into every worker as the
epochs go by -- each worker's private memory grows towards the size of the list
(pytorch issue 13246; torch's DataLoader does the same, and so does mploader with a
plain list).  :class:`SharedList` keeps the items pickled in one NumPy buffer
instead: reading item ``i`` unpickles a fresh copy from bytes that nobody's
reference count touches, so the buffer's pages stay shared by every worker.
``mploader.diagnose`` says when workers' private memory grows epoch over epoch.
"""
from __future__ import annotations

import collections.abc
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["SharedList"]


class SharedList(collections.abc.Sequence):
    """A read-only list whose items are stored pickled in one contiguous buffer.

    Parameters
    ----------
    items : iterable
        The items, each picklable.  They are pickled once, here (protocol
        ``pickle.HIGHEST_PROTOCOL``); the objects themselves are not kept.

    Notes
    -----
    ``shared[i]`` returns a new object unpickled from item ``i``'s bytes (a change
    to it does not reach the list); ``shared[a:b]`` a list of them.  Memory: the
    pickled bytes (one ``uint8`` array) plus 8 bytes of offset per item; forked
    workers share both without copying, however often they read.  Pickling a
    ``SharedList`` (spawn and forkserver workers) sends the two arrays.  Costs one
    ``pickle.loads`` per read: about 1-5 µs for a small dict.

    Raises
    ------
    TypeError
        An index that is not an int or a slice (from ``[]``).
    pickle.PicklingError
        An item cannot be pickled (from the constructor); the message names its
        position and type, the cause is ``pickle.dumps``'s exception.
    IndexError
        An index out of range.
    """

    __slots__ = ("_data", "_offsets")

    def __init__(self, items: Iterable[Any]) -> None:
        blobs = []
        for i, item in enumerate(items):
            try:
                blobs.append(pickle.dumps(item, pickle.HIGHEST_PROTOCOL))
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise pickle.PicklingError(
                    f"SharedList item {i} ({type(item).__name__}) cannot be pickled: {exc}") from exc
        offsets = np.zeros(len(blobs) + 1, np.int64)
        np.cumsum([len(b) for b in blobs], out=offsets[1:])
        self._offsets = offsets
        self._data = np.frombuffer(b"".join(blobs), np.uint8) if blobs else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"SharedList indices must be integers or slices, not {type(index).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"SharedList index {index} out of range for {n} items")
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        return pickle.loads(self._data[a:b].data)

    @property
    def nbytes(self) -> int:
        """Bytes held: the pickled items and their offsets."""
        return int(self._data.nbytes + self._offsets.nbytes)

    def __repr__(self) -> str:
        return f"<SharedList of {len(self)} items, {self.nbytes} bytes>"

    def __reduce__(self) -> tuple:
        return (_rebuild, (self._data, self._offsets))


def _rebuild(data: np.ndarray, offsets: np.ndarray) -> SharedList:
    shared = SharedList.__new__(SharedList)
    shared._data = data
    shared._offsets = offsets
    return shared
