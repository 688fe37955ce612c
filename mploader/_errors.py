"""Errors the engine raises, and how a worker's exception travels to the parent.

A worker that catches an exception while loading a batch sends a
:class:`BatchFailure` (a plain, picklable record); the parent turns it back into
the original exception with :meth:`BatchFailure.to_exception`, whose ``__cause__``
is a :class:`WorkerTraceback` carrying the context (worker, pid, batch, sample
indices, the worker's formatted traceback).  ``is_batch_error(exc)`` tells a face
whether an exception consumed its batch (a worker exception) or left it owed (a
dead worker, a timeout, an interrupt).
"""
from __future__ import annotations

import os
import pickle
import signal as _signal
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerError", "WorkerTraceback", "BatchFailure", "ExitStatus", "is_batch_error", "warn_at_caller",
           "add_note"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (PEP 678, Python 3.11+); on 3.10 the note goes into
    ``exc.__notes__`` all the same (where the exception takes attributes), which
    pytest's ``match`` and tools that read notes see, though 3.10's traceback
    printing does not."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    try:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside the
    mploader package (the user's ``next()`` or ``for`` line), however deep the
    engine's frames are -- never a hard-coded ``stacklevel``, which breaks when a
    call is added between."""
    frame = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of the caller's frame (1 is this function)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)


class WorkerError(RuntimeError):
    """A worker process died (signal or exit) while the loader needed it.

    Attributes
    ----------
    pid : int
        The worker's process id.
    worker_id : int or None
        Its id, 0..num_workers-1.
    exitcode : int or None
        Its exit status; None when it died by a signal or the status is unknown.
    signal : int or None
        The signal that killed it, if any.
    batch : int or None
        Sequence number of the batch it was loading when it died.
    indices : object or None
        Sample indices of that batch.
    """

    def __init__(self, message: str, *, pid: int, exitcode: int | None, signal: int | None,
                 batch: int | None, indices: Any, worker_id: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.worker_id = worker_id
        self.exitcode = exitcode
        self.signal = signal
        self.batch = batch
        self.indices = indices


class WorkerTraceback(Exception):
    """The ``__cause__`` of an exception re-raised from a worker: where it happened.

    Attributes
    ----------
    worker_id : int
        The worker's id (0..num_workers-1), -1 for the calling process.
    pid : int
        Process id of the worker.
    batch : int
        Sequence number of the batch.
    indices : object
        The batch's sample indices.
    stage : str
        What the worker was doing ("loading", "worker_init", "serialising ...").
    traceback : str
        The worker's formatted traceback.
    """

    def __init__(self, message: str, *, worker_id: int, pid: int, batch: int, indices: Any, stage: str,
                 traceback: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.batch = batch
        self.indices = indices
        self.stage = stage
        self.traceback = traceback


def is_batch_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the dataset or collation in a worker (it consumed
    its batch: the next ``next()`` goes on with the following batch)."""
    return isinstance(exc.__cause__, WorkerTraceback)


@dataclass(slots=True)
class BatchFailure:
    """A picklable description of an exception raised while a worker loaded a batch."""

    exc_pickle: bytes | None  # the exception itself, when it pickles and unpickles
    type_name: str
    message: str
    traceback: str
    indices: Any
    seq: int
    pid: int
    worker_id: int
    stage: str = "loading"

    @classmethod
    def capture(cls, exc: BaseException, seq: int, indices: Any, worker_id: int,
                stage: str = "loading") -> BatchFailure:
        try:
            data = pickle.dumps(exc, protocol=5)
            pickle.loads(data)  # some exceptions pickle but cannot be rebuilt
            blob: bytes | None = data
        except Exception:  # noqa: BLE001 - any failure means: send the type name and message
            blob = None
        return cls(blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc),
                   "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                   indices, seq, os.getpid(), worker_id, stage)

    def context(self) -> str:
        return (f"raised in mploader worker {self.worker_id} (pid {self.pid}) while {self.stage} "
                f"batch {self.seq}, sample indices {self.indices!r}")

    def to_exception(self) -> BaseException:
        """The original exception (or a RuntimeError naming its type when it could not
        be rebuilt) with the context as a note and a :class:`WorkerTraceback` cause."""
        exc: BaseException | None = None
        if self.exc_pickle is not None:
            try:
                exc = pickle.loads(self.exc_pickle)
            except Exception:  # noqa: BLE001 - rebuilt as a RuntimeError naming the type
                exc = None
        if exc is None:
            exc = RuntimeError(f"{self.type_name}: {self.message}")
        context = self.context()
        add_note(exc, context)
        exc.__cause__ = WorkerTraceback(f"{context}\n\nWorker traceback:\n{self.traceback}",
                                        worker_id=self.worker_id, pid=self.pid, batch=self.seq,
                                        indices=self.indices, stage=self.stage, traceback=self.traceback)
        return exc


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a worker process ended: ``exitcode`` or ``signal``, or neither when the
    status is unknown (SIGCHLD ignored: the kernel discards children's statuses)."""

    exitcode: int | None
    signal: int | None

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(None, os.WTERMSIG(status))
        if os.WIFEXITED(status):
            return cls(os.WEXITSTATUS(status), None)
        return cls(None, None)

    @classmethod
    def from_exitcode(cls, code: int | None) -> ExitStatus:
        """From ``multiprocessing.Process.exitcode`` (negative: killed by ``-code``)."""
        if code is None:
            return cls(None, None)
        return cls(None, -code) if code < 0 else cls(code, None)

    @property
    def clean(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = _signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"was killed by signal {self.signal} ({name})"
        if self.exitcode is not None:
            return f"exited with code {self.exitcode}"
        return ("exited; its exit status is unknown (SIGCHLD is ignored in this process, so the kernel "
                "discarded it)")


UNKNOWN_STATUS = ExitStatus(None, None)
