"""A worker's Python stack, taken inside it, for the parent (the watchdog's log).

The worker registers ``faulthandler`` for SIGUSR1 at its start (:func:`install`),
writing into a memfd of its own; the parent sends SIGUSR1 and reads what was
written through ``/proc/<pid>/fd`` (:func:`take_stack`).  ``faulthandler`` writes
from its C signal handler: it needs neither the GIL nor a responsive interpreter,
so the stack of a worker stuck in C code (a decoder's loop, a lock, a read from a
stalled filesystem) is taken too.  Nothing is passed at the worker's start, and the
file goes with the worker's process.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time

from . import _fds

__all__ = ["install", "take_stack", "STACK_FILE", "DUMP_WAIT_S"]

#: The name of the worker's memfd that faulthandler writes into.
STACK_FILE = "mploader-stack"
#: How long the parent waits for a stack dump (seconds).
DUMP_WAIT_S = 2.0

_installed_fd = -1


def install() -> None:
    """In a worker, before user code runs: dump every thread's Python stack into a
    memfd of this process on SIGUSR1 (``faulthandler``, which needs neither the GIL
    nor the interpreter to be responsive).  Nothing is done where memfds or
    ``faulthandler.register`` do not exist."""
    global _installed_fd
    if _installed_fd >= 0:  # a worker's worker (a loader inside a worker): not the inherited file
        os.close(_installed_fd)
        _installed_fd = -1
    try:
        fd = _fds.off_stdio(os.memfd_create(STACK_FILE, os.MFD_CLOEXEC))  # never fd 0-2
    except (AttributeError, OSError):
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        os.close(fd)
        return
    _installed_fd = fd


def _stack_path(pid: int) -> str | None:
    """``/proc/<pid>/fd/<n>`` of the worker's stack memfd, or None."""
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(f"{base}/{name}").startswith(f"/memfd:{STACK_FILE}"):
                return f"{base}/{name}"
        except OSError:
            continue
    return None


def take_stack(pid: int, wait_s: float = DUMP_WAIT_S) -> str:
    """The Python stack of every thread of worker ``pid``, taken inside it (SIGUSR1:
    see :func:`install`); a sentence in parentheses when it could not be taken."""
    path = _stack_path(pid)
    if path is None:
        return "(no stack: the worker has no stack file; it had not finished starting)"
    try:
        before = os.stat(path).st_size
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        return f"(no stack: {exc})"
    deadline = time.monotonic() + wait_s
    size, stable = before, 0
    # The dump is a handful of write()s from a signal handler: done once the file
    # stops growing.  Bounded: a worker in uninterruptible sleep never answers.
    while time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            now = os.stat(path).st_size
        except OSError:
            break
        if now > before and now == size:
            stable += 1
            if stable >= 2:
                break
        else:
            stable = 0
        size = now
    try:
        with open(path, "rb") as f:
            f.seek(before)
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(no stack: {exc})"
    return text.strip() or f"(no stack: the worker did not answer SIGUSR1 within {wait_s} s)"
