"""The Chainer face with ``n_processes=0``: batches loaded in the calling process.

With a ``dataset_timeout``, one long-lived helper thread per iterator
(:class:`InlineLoader`) loads the batches while ``next()`` watches the clock, so a
stalled dataset is reported from ``next()``; without one, the batch is loaded in the
calling thread.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import _engine
from ._face import Face

__all__ = ["InlineLoader", "InlineRun", "fetch_examples"]


class _Examples(Face):
    """The Chainer face's worker contract (:class:`mploader._face.Face`): a batch is
    the list of examples exactly as the dataset returns them (nothing collated)."""

    __slots__ = ()

    def load(self, dataset: Any, indices: list) -> list:
        return [dataset[i] for i in indices]

    def collate(self, samples: list, alloc: Callable) -> list:
        return samples


#: The Chainer face's ``fetch(dataset, indices, alloc) -> list of examples``.
fetch_examples = _Examples()


def _serve(requests: queue.SimpleQueue) -> None:
    """The loop of an :class:`InlineLoader` thread: run each request, until None."""
    while True:
        item = requests.get()
        if item is None:
            return
        fn, future = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)
        del item, fn, future


class InlineLoader:
    """One long-lived daemon thread that loads the in-process batches of one iterator.

    Started at the first request and reused for every later batch and run; it holds
    only its request queue, so it never keeps the iterator alive.  :meth:`close` lets
    it end after the request it is running (a daemon thread: a dataset stuck forever
    cannot block interpreter exit).
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._requests,),
                                            name="mploader-chainer-inline", daemon=True)
            self._thread.start()
        self._requests.put((fn, future))
        return future

    def close(self) -> None:
        """Let the thread end once its current request is done.  Idempotent."""
        if self._thread is not None:
            self._requests.put(None)
            self._thread = None


class InlineRun:
    """``n_processes=0``: load each batch in this process when asked for.

    Yields ``(-1, -1, value, failed, None)`` per task, as a tagged engine run (no
    worker, no batch index, no side record): the batch, or with ``failed`` the exception the dataset raised,
    which used up the task; an interruption (KeyboardInterrupt) propagates and leaves
    the batch owed.  With a ``dataset_timeout``, the iterator's :class:`InlineLoader`
    thread loads the batch while this one watches the clock (as Chainer does for its
    first, measuring batch), so the TimeoutWarning is issued from ``next()``.
    """

    def __init__(self, dataset: Any, tasks: Iterator[tuple], seed: int, timeout_s: float | None,
                 loader: InlineLoader | None, on_stall: Callable[[float], None]) -> None:
        self._inline = _engine.InlineRun(dataset, fetch_examples, tasks, seed)
        self._timeout_s = timeout_s
        self._loader = loader
        self._on_stall = on_stall

    def __iter__(self) -> InlineRun:
        return self

    def __next__(self) -> tuple[int, int, Any, bool, None]:
        if self._timeout_s is None or self._loader is None:
            try:
                return (-1, -1, next(self._inline), False, None)
            except StopIteration:
                raise
            except Exception as exc:  # noqa: BLE001 - the dataset's: it used up its batch
                return (-1, -1, exc, True, None)
        future = self._loader.submit(self._inline.__next__)
        done, _ = concurrent.futures.wait([future], self._timeout_s)
        if not done:
            self._on_stall(self._timeout_s)
        error = future.exception()
        if error is not None:
            if isinstance(error, Exception) and not isinstance(error, StopIteration):
                return (-1, -1, error, True, None)
            raise error
        return (-1, -1, future.result(), False, None)
