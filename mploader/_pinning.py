"""CUDA pinning of the shared region (the Gluon and GluonNLP faces' ``pin_memory``).

The region's file grows inside a fixed address reservation (docs/design.md,
"Growth"), so pinning it is incremental: each time the engine reports that a
delivered batch made the region larger (``Engine(on_grow=...)``), :class:`HostPinner`
page-locks (``cudaHostRegister``, portable) the bytes not registered yet, before the
batch reaches the caller.  One registration per growth, nothing per batch.
"""
from __future__ import annotations

import collections
import ctypes
import os
import warnings
from collections.abc import Callable
from typing import Any

from . import _memops

#: cudaHostRegisterPortable: the registration counts for every CUDA context.
CUDA_HOST_REGISTER_PORTABLE = 1


def cuda_runtime(device_id: int) -> tuple[Any, Callable[[], Any]] | None:
    """torch's CUDA runtime bindings and a context manager factory selecting
    ``device_id``, when torch with a usable CUDA device is installed; else None.

    Importing torch happens here, only when ``pin_memory=True`` asks for it."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.cudart(), lambda: torch.cuda.device(device_id)
    except Exception:  # noqa: BLE001 - a broken CUDA setup means: do not pin
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _file_size(fd: int) -> int:
    """The size of the region's file in bytes (``fstat``; 0 for a closed region)."""
    try:
        return os.fstat(fd).st_size
    except (OSError, TypeError, ValueError):
        return 0


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration.

    The runtime keeps the error of a failed ``cudaHostRegister`` as the thread's
    "last error", and torch checks that after every kernel launch: the user's next
    CUDA op would raise ``CUDA error: invalid argument`` for our call (seen on an
    H200, bench/device_check.py).  ``torch.cuda.cudart()`` has no ``cudaGetLastError``,
    so it is called in the libcudart this process has loaded (found in
    ``/proc/self/maps``; a statically linked runtime is not reachable: then nothing
    is done)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError, IndexError):
        pass


def _default_event() -> Any:
    """A new ``torch.cuda.Event`` (torch is imported: pinning needed it already)."""
    import torch

    return torch.cuda.Event()


class HostPinner:
    """Page-locks an engine's shared region for CUDA, so batch views are pinned memory.

    :meth:`on_grow` registers only the part of the region's file not registered yet;
    the engine calls it in the parent whenever a delivered batch made the region
    larger, before that batch is returned, so every byte a returned batch views is
    page-locked.  :meth:`release` unregisters every range (at ``close()`` or when the
    engine is collected).  The pinner holds the ``Region`` object, so the mapping
    cannot disappear before :meth:`release` has run.  Ranges the ring gives back to
    the kernel (a range a slot grew out of, the tail of a shrunk slot) are never
    reused, so no batch is ever read through a stale pinned page; they stay
    registered, hence resident, until then.  A failed registration warns once
    (``RuntimeWarning``) and pinning stops; batches are then ordinary memory.

    Parameters
    ----------
    cudart : object
        ``torch.cuda.cudart()``: ``cudaHostRegister(ptr, nbytes, flags)`` and
        ``cudaHostUnregister(ptr)``, each returning a cudaError (0 on success).
    device : callable
        Returns a context manager that selects the pinning device.
    event : callable, optional
        Makes a CUDA event (``record()``, ``query()``, ``synchronize()``); default
        ``torch.cuda.Event``.

    Asynchronous copies
    -------------------
    A copy from pinned memory (``x.cuda(non_blocking=True)``) runs later on the GPU,
    after whatever the stream holds before it; the host batch may be dropped at once.
    torch keeps its own pinned blocks from reuse until such copies are done (an event
    per use); for the ring that is :meth:`hold` and :meth:`poll`: the engine makes
    :meth:`hold` the region's ``release_hook``, so a batch whose last view is gone
    records an event on the current CUDA stream and keeps its slot LEASED until the
    event has completed; the engine calls :meth:`poll` before it looks for a free
    slot.  Copies on the current stream are covered (``.cuda()``/``.to()`` with
    ``non_blocking=True`` use it); a copy made on another stream must be waited for
    before the batch is dropped (``torch.cuda.current_stream().wait_stream(s)``), as
    with any memory torch did not allocate.  Without this, 145 of 200 batches reached
    an H200 with another batch's bytes (bench/device_check.py, ``race``).
    """

    def __init__(self, cudart: Any, device: Callable[[], Any], event: Callable[[], Any] | None = None) -> None:
        self._cudart = cudart
        self._device = device
        self._event = event
        self._region: Any = None
        self._registered_bytes = 0
        self._ranges: list[int] = []
        self._failed = False
        self._held: collections.deque[tuple[Any, int]] = collections.deque()  # (event, slot), oldest first

    @property
    def ranges(self) -> list[int]:
        """Start addresses of the registered ranges."""
        return list(self._ranges)

    def on_grow(self, region: Any) -> int | None:
        """Register ``region``'s bytes that are in its file and not registered yet.

        ``region`` is the engine's ``_ring.Region`` (``address``, ``file_bytes``,
        ``fd``).  Registration stops at the file's current size, not at
        ``file_bytes``: a worker reserves a range (``file_bytes`` grows) before it
        allocates it in the file, and the driver refuses a range that is not in the
        file yet (cudaErrorInvalidValue, seen on an H200 with 2 workers growing
        slots while the parent registered; bench/device_check.py).  Every batch
        delivered so far lies below that size: its worker allocated its range before
        publishing it.

        Returns
        -------
        int or None
            Bytes of the region registered from its start (the engine calls again
            after the next batch while that is less than ``file_bytes``); None once
            pinning has stopped (a registration failed, or :meth:`release` ran).
        """
        if self._failed or region is None:
            return None
        if self._region is None:
            self._region = region
            region.release_hook = self.hold
        end = min(region.file_bytes, _file_size(region.fd)) & ~(_PAGE - 1)
        start = self._registered_bytes
        if end <= start:
            return start
        address = region.address + start
        with self._device():
            rc = self._cudart.cudaHostRegister(address, end - start, CUDA_HOST_REGISTER_PORTABLE)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            self._failed = True
            _clear_last_cuda_error()
            warnings.warn(f"pin_memory: cudaHostRegister of {end - start} bytes of the shared region failed "
                          f"(cudaError {code}); batches are returned in unpinned memory", RuntimeWarning,
                          stacklevel=2)
            return None
        # Workers forked later must still inherit the range (some drivers mark page-locked
        # memory MADV_DONTFORK; the region is MAP_SHARED, so inheriting it is safe).  Best
        # effort: a failure (its errno returned) leaves the range as the driver made it.
        _memops.madvise_dofork(address, end - start)
        self._ranges.append(address)
        self._registered_bytes = end
        return end

    def hold(self, slot: int) -> None:
        """The region's ``release_hook``: the last view of ``slot``'s batch is gone.

        Records an event on the current CUDA stream; the slot stays LEASED until the
        event has completed (:meth:`poll`).  Raises what the event raises (the lease
        then releases the slot at once)."""
        event = (self._event or _default_event)()
        event.record()
        self._held.append((event, slot))

    @property
    def held(self) -> int:
        """Slots kept LEASED until the GPU work queued before their release is done."""
        return len(self._held)

    def poll(self, wait: bool = False) -> int:
        """Release the held slots whose event has completed, oldest first; with
        ``wait``, first wait for the oldest one.  Returns how many were released."""
        held, region = self._held, self._region
        done = 0
        while held:
            event, slot = held[0]
            if wait and not done:
                event.synchronize()
            elif not event.query():
                break
            held.popleft()
            if region is not None:
                region.release(slot)
            done += 1
        return done

    def release(self) -> None:
        """Wait for the held slots' events and release them, unregister every range
        and let go of the region.  Idempotent."""
        region = self._region
        if region is not None:
            region.release_hook = None
        while self._held:
            event, slot = self._held.popleft()
            try:
                event.synchronize()   # no GPU copy may read the pages once they are unregistered
                if region is not None:
                    region.release(slot)
            except Exception:  # noqa: BLE001 - at exit CUDA (or the mapping) may already be gone
                pass
        ranges, self._ranges = self._ranges, []
        for address in ranges:
            try:
                with self._device():
                    self._cudart.cudaHostUnregister(address)
            except Exception:  # noqa: BLE001 - at exit CUDA may already be gone
                pass
        self._region = None
        self._failed = True
