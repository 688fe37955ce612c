"""How a loader's :class:`~mploader._worker.WorkerSpec` reaches spawn and forkserver
workers: pickled once, its large buffers in a memfd every worker maps copy-on-write.

* :func:`pack` pickles the spec (dataset, fetch, worker_init) with protocol 5.  Its
  out-of-band buffers -- NumPy arrays, torch CPU storages, ``bytes``/``bytearray`` of
  at least :data:`OUT_OF_BAND_BYTES` -- and the pickle stream are written once into
  one memfd (:class:`Packed`).
* :func:`unpack`, in a worker, maps that memfd ``MAP_PRIVATE`` (read and write) and
  unpickles the spec around views of the mapping: N workers share one copy of the
  arrays' pages, and a worker that writes into an array gets private pages, as
  under fork.  (``bytes`` and ``bytearray`` own their memory: they are copied out of
  the mapping, so they travel once but each worker holds its own.)
* A memory-mapped array (``np.memmap``, ``np.load(..., mmap_mode=...)``, or a view of
  one) is not copied at all: it is mapped again from its file in each worker, with
  the same mode (``r+``: writes reach the file, as under fork).
* What the standard pickler refuses (a lambda, a local class) or would pickle by a
  reference no worker can import (anything defined in ``__main__``, e.g. a notebook)
  is pickled by value with ``cloudpickle``.  Where that fails too for an object of
  ``__main__`` (a method there uses a global lock or open file) and the main script
  is a file or a ``-m`` module, it is pickled by reference, as spawn does: the
  workers import the script as ``__mp_main__`` (:data:`MAIN` among the modules).
  What none of these can pickle raises :class:`pickle.PicklingError` naming the
  attribute path (``dataset.transform.fn``).
* :class:`Transport` is one loader's packed spec: packed at the first start of a
  generation of workers (every start of all the workers: the first ``iter()``, each
  epoch without persistent workers), and kept while the new pickle is the same.

docs/design.md, "Workers", gives the reasons.
"""
from __future__ import annotations

import errno
import functools
import io
import mmap
import os
import pickle
import struct
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _fds

#: Buffers (and ``bytes``/``bytearray``) of at least this many bytes travel out of
#: band, in the memfd; smaller ones stay in the pickle stream.
OUT_OF_BAND_BYTES = 64 * 1024

_MAGIC = b"MPLSPEC1"
_HEAD = struct.Struct("<8sQQQ")   # magic, stream offset, stream bytes, number of buffers
_ENTRY = struct.Struct("<QQQ")    # one buffer: offset, bytes, 1 if a persistent id names it (else NEXT_BUFFER)
_PAGE = mmap.PAGESIZE             # every buffer starts on a page: copy-on-write per array
#: Among a packed spec's modules: the workers import the main script (or ``-m``
#: module) as ``__mp_main__``, aliased ``__main__``, as spawn's children do
#: (``multiprocessing.spawn.prepare``), since part of the spec names ``__main__``.
MAIN = "__mp_main__"


class _ByValue(Exception):
    """Raised by the standard pickler for an object it would pickle by a reference
    that no worker can import (defined in ``__main__``): pickle by value instead."""


class _Hooks:
    """What both picklers add: buffers out of band, memory maps re-opened, modules noted."""

    buffers: list[Any]
    modules: set[str]
    _ids: dict[int, int]
    _storages: dict[tuple, Any]

    keep_buffers = True

    def _start(self) -> None:
        self.buffers = []
        self.modules = set()
        self._ids = {}
        self._storages = {}

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if (t is bytes or t is bytearray) and len(obj) >= OUT_OF_BAND_BYTES:
            k = self._ids.get(id(obj))
            if k is None:
                k = self._ids[id(obj)] = len(self.buffers)
                self.buffers.append(obj)  # (kept alive, so its id stays its own)
            return ("bytes" if t is bytes else "bytearray", k)
        return None

    def _reduce(self, obj: Any, by_value_main: bool) -> Any:
        """A reduction of ours for ``obj``, or None.  Notes the modules a worker needs:
        those of classes and functions pickled by reference, of modules (cloudpickle
        pickles a function's global ``torch`` as a reference to the module) and of
        objects whose reduction names no class (``torch.float32``)."""
        if isinstance(obj, (type, types.FunctionType)):
            module = getattr(obj, "__module__", None)
            if isinstance(module, str):
                if module == "__main__" and by_value_main:
                    raise _ByValue(obj)
                self.modules.add(module)
            return None
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
            return None
        module = type(obj).__module__
        if module != "builtins" and isinstance(module, str):
            self.modules.add(module)
        if isinstance(obj, np.ndarray):
            return _memmap_reduce(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
            # torch makes a new storage object for each tensor pickled (``tensor.storage()``):
            # views of one storage would each carry a copy of it.  One per storage here,
            # as torch.save does, so they share it in the worker as in this process.
            key = _storage_key(obj, torch)
            if key is not None:
                first = self._storages.setdefault(key, obj)   # (kept alive: its memo entry stays valid)
                if first is not obj:
                    return (_same, (first,))
            return _storage_reduce(obj, torch)
        return None

    def _buffer_callback(self, buf: pickle.PickleBuffer) -> bool:
        """Out of band (False) from :data:`OUT_OF_BAND_BYTES` on."""
        with buf.raw() as raw:
            if raw.nbytes < OUT_OF_BAND_BYTES:
                return True
        if self.keep_buffers:
            self.buffers.append(buf)
        return False


class _Pickler(_Hooks, pickle.Pickler):
    def __init__(self, file: Any, by_value_main: bool = True) -> None:
        self._start()
        self.by_value_main = by_value_main
        super().__init__(file, protocol=5, buffer_callback=self._buffer_callback)

    def reducer_override(self, obj: Any) -> Any:
        r = self._reduce(obj, by_value_main=self.by_value_main)
        return NotImplemented if r is None else r


def _cloud_pickler(file: Any, keep_buffers: bool = True) -> Any:
    """A cloudpickle pickler with our hooks (cloudpickle is imported at the first use:
    most specs never need it)."""
    import cloudpickle  # type: ignore[import-untyped]

    class _CloudPickler(_Hooks, cloudpickle.Pickler):
        def __init__(self, file: Any) -> None:
            self._start()
            self.keep_buffers = keep_buffers
            super().__init__(file, protocol=5, buffer_callback=self._buffer_callback)

        def reducer_override(self, obj: Any) -> Any:
            r = self._reduce(obj, by_value_main=False)
            return super().reducer_override(obj) if r is None else r

    return _CloudPickler(file)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, buffers: list[memoryview], out_of_band: list[memoryview]) -> None:
        super().__init__(file, buffers=out_of_band)
        self._bufs = buffers
        self._made: dict[int, Any] = {}   # one object per buffer, as many references as pickled

    def persistent_load(self, pid: Any) -> Any:
        kind, k = pid
        if k in self._made:
            return self._made[k]
        if kind == "bytes":
            obj: Any = bytes(self._bufs[k])
        elif kind == "bytearray":
            obj = bytearray(self._bufs[k])
        else:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a worker spec")
        self._made[k] = obj
        return obj


# ---- memory-mapped arrays: mapped again from their file --------------------------------

def _memmap_reduce(arr: np.ndarray) -> Any:
    """``arr`` (an ndarray or np.memmap) as a view of a file mapping to re-open, or None."""
    if type(arr) is not np.ndarray and type(arr) is not np.memmap:
        return None
    owner: Any = arr
    while owner is not None and not (isinstance(owner, np.memmap) and getattr(owner, "_mmap", None) is not None
                                     and getattr(owner, "filename", None)):
        owner = owner.base if isinstance(owner, np.ndarray) else None
    if owner is None or not arr.size:
        return None
    found: Any = owner
    mm = found._mmap
    try:
        start = np.frombuffer(mm, np.uint8).__array_interface__["data"][0]
    except (ValueError, TypeError, BufferError):  # closed
        return None
    offset = arr.__array_interface__["data"][0] - start
    file_offset = int(found.offset or 0)
    map_start = file_offset - file_offset % mmap.ALLOCATIONGRANULARITY
    return (_remap, (str(found.filename), found.mode, map_start, len(mm), arr.dtype, arr.shape,
                     arr.strides, offset, type(arr) is np.memmap, file_offset, bool(arr.flags.writeable)))


def _remap(filename: str, mode: str, map_start: int, map_bytes: int, dtype: np.dtype, shape: tuple,
           strides: tuple, offset: int, as_memmap: bool, file_offset: int, writeable: bool) -> np.ndarray:
    """In a worker: the array :func:`_memmap_reduce` described, on a new mapping of its file."""
    access = {"r": mmap.ACCESS_READ, "c": mmap.ACCESS_COPY}.get(mode, mmap.ACCESS_WRITE)
    with open(filename, "rb" if access != mmap.ACCESS_WRITE else "r+b") as f:
        mm = mmap.mmap(f.fileno(), map_bytes, access=access, offset=map_start)
    arr: Any = np.ndarray.__new__(np.memmap if as_memmap else np.ndarray, shape, dtype=dtype, buffer=mm,
                                  offset=offset, strides=strides)
    if as_memmap:
        arr._mmap, arr.filename, arr.offset, arr.mode = mm, filename, file_offset, mode
    if not writeable and arr.flags.writeable:
        arr.flags.writeable = False
    return arr


# ---- torch CPU storages: out of band --------------------------------------------------

def _storage_key(storage: Any, torch: Any) -> tuple | None:
    """What identifies a CPU storage's memory (None: not one we send out of band)."""
    typed = isinstance(storage, torch.storage.TypedStorage)
    untyped = storage._untyped_storage if typed else storage
    if untyped.device.type != "cpu" or untyped.nbytes() < OUT_OF_BAND_BYTES:
        return None
    return (untyped.data_ptr(), untyped.nbytes(), str(storage.dtype) if typed else None)


def _same(obj: Any) -> Any:
    return obj


def _storage_reduce(storage: Any, torch: Any) -> Any:
    typed = isinstance(storage, torch.storage.TypedStorage)
    untyped = storage._untyped_storage if typed else storage
    if untyped.device.type != "cpu" or untyped.nbytes() < OUT_OF_BAND_BYTES:
        return None
    raw = torch.empty(0, dtype=torch.uint8).set_(untyped).numpy()
    buf = pickle.PickleBuffer(raw)
    if typed:
        return (_typed_storage, (buf, storage.dtype))
    return (_untyped_storage, (buf,))


def _untyped_storage(buf: Any) -> Any:
    import torch

    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


def _typed_storage(buf: Any, dtype: Any) -> Any:
    import torch

    return torch.storage.TypedStorage(wrap_storage=_untyped_storage(buf), dtype=dtype, _internal=True)


# ---- packing -------------------------------------------------------------------------

def _raw(buf: Any) -> memoryview:
    if isinstance(buf, pickle.PickleBuffer):
        return buf.raw()
    return memoryview(buf).cast("B")


def _persistent(bufs: list[Any]) -> list[bool]:
    """Which buffers a persistent id names (``bytes``, ``bytearray``): the others are
    the pickle stream's out-of-band buffers, in the order it takes them."""
    return [not isinstance(b, pickle.PickleBuffer) for b in bufs]


def _dump(obj: Any) -> tuple[bytes, list[memoryview], list[bool], frozenset[str], bool]:
    """(stream, buffers, which of them persistent ids name, modules named, by value?) of ``obj``."""
    f = io.BytesIO()
    p: Any = _Pickler(f)
    try:
        p.dump(obj)
        by_value = False
    except (_ByValue, pickle.PicklingError, TypeError, AttributeError) as exc:
        first = exc
        f = io.BytesIO()
        p = _cloud_pickler(f)
        try:
            p.dump(obj)
            by_value = True
        except Exception as exc2:  # noqa: BLE001 - named below
            if not (isinstance(first, _ByValue) and main_preparation()):
                raise unpicklable(obj, exc2) from (first if not isinstance(first, _ByValue) else exc2)
            # By reference to a main script the workers import, as spawn's children do.
            f = io.BytesIO()
            p = _Pickler(f, by_value_main=False)
            try:
                p.dump(obj)
            except Exception:  # noqa: BLE001 - the by-value attempt's error names the part
                raise unpicklable(obj, exc2) from exc2
            by_value = False
            p.modules.add(MAIN)
    modules = frozenset(m for m in p.modules if m != "__main__")
    return f.getvalue(), [_raw(b) for b in p.buffers], _persistent(p.buffers), modules, by_value


def main_preparation() -> dict[str, str]:
    """How a spawned child of this process imports its main module, as
    ``multiprocessing.spawn.get_preparation_data`` gives it: ``{"init_main_from_name":
    module}`` (run with ``-m``) or ``{"init_main_from_path": file}`` (a script); empty
    where there is none to import (a notebook, ``-c``, standard input)."""
    import multiprocessing.spawn

    data = multiprocessing.spawn.get_preparation_data("mploader")
    return {k: data[k] for k in ("init_main_from_name", "init_main_from_path") if k in data}


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:1000]:
            yield f"[{k!r}]", v
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:1000]):
            yield f"[{i}]", v
        return
    if isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
        return
    if isinstance(obj, types.FunctionType) and obj.__closure__:
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__):
            try:
                yield f".{name}", cell.cell_contents
            except ValueError:  # an empty cell
                pass
        return
    if isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from ((f".{k}", v) for k, v in list(d.items()))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), tuple) else ():
            if hasattr(obj, name) and name != "__dict__":
                yield f".{name}", getattr(obj, name)


def _fails(obj: Any) -> BaseException | None:
    p = _cloud_pickler(io.BytesIO(), keep_buffers=False)  # (only whether it pickles matters)
    try:
        p.dump(obj)
    except Exception as exc:  # noqa: BLE001 - the caller names it
        return exc
    return None


def culprit(obj: Any, path: str = "", depth: int = 0) -> tuple[str, Any]:
    """The deepest attribute path below ``obj`` (``dataset.transform.fn``) whose value
    cannot be pickled even by value, and that value; ``(path, obj)`` if no part of it
    alone fails."""
    if depth >= 12:
        return path, obj
    for name, child in _children(obj):
        if _fails(child) is not None:
            sub = f"{path}{name}" if path else name.lstrip(".")
            return culprit(child, sub, depth + 1)
    return path, obj


def unpicklable(spec: Any, exc: BaseException) -> pickle.PicklingError:
    """The error for a spec that cannot be pickled at all, naming the attribute path."""
    path, value = culprit(spec)
    try:
        shown = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails is no reason to hide the error
        shown = f"<{type(value).__name__} object>"
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return pickle.PicklingError(
        f"{path or 'the dataset'} = {shown} cannot be sent to spawn/forkserver workers: it cannot be "
        f"pickled, by reference nor by value with cloudpickle ({type(exc).__name__}: {exc}).  Make it "
        f"picklable (create it in the worker: lazily in __getitem__, or in worker_init_fn), or use the "
        f"'fork' start method")


def _equal(a: memoryview, b: memoryview, chunk_bytes: int = 1 << 20) -> bool:
    """Whether two byte buffers of one length are equal: compared 8 bytes at a time, a
    MiB at a time (128 MiB: 32 ms; one ``np.array_equal``, with its 128 M-element
    temporary, took 99 ms; ``memoryview ==`` 476 ms)."""
    x, y = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    n8 = len(x) // 8 * 8
    x8, y8 = x[:n8].view(np.uint64), y[:n8].view(np.uint64)
    step = chunk_bytes // 8
    for i in range(0, len(x8), step):
        if not np.array_equal(x8[i:i + step], y8[i:i + step]):
            return False
    return bool(np.array_equal(x[n8:], y[n8:]))


def _pwrite_all(fd: int, data: memoryview, offset: int, chunk_bytes: int = 64 << 20) -> None:
    """Write all of ``data`` (a 1-D byte view) at ``offset`` of ``fd``, in pieces of
    at most ``chunk_bytes`` (one ``pwrite`` may write less than asked)."""
    done = 0
    while done < data.nbytes:
        n = os.pwrite(fd, data[done:done + chunk_bytes], offset + done)
        if n <= 0:   # (never for a memfd; no endless loop if it were)
            raise OSError(errno.ENOSPC, f"pwrite wrote nothing at offset {offset + done} of descriptor {fd}")
        done += n


class Packed:
    """A spec pickled into a memfd.

    ``fd``: the memfd (close-on-exec, >= 3), passed to each worker; ``modules``: the
    modules its classes and functions come from (a zygote imports them before it
    forks); ``by_value``: cloudpickle was needed.  The parent keeps a shared
    read-write mapping of the memfd while it holds the object.  :meth:`close` (or
    :meth:`forget`, in a forked child) lets go of both; workers keep their own
    mappings.
    """

    def __init__(self, stream: bytes, raws: list[memoryview], persistent: list[bool], modules: frozenset[str],
                 by_value: bool) -> None:
        entries = []
        pos = _HEAD.size + _ENTRY.size * len(raws)
        for raw in raws:
            pos = -(-pos // _PAGE) * _PAGE
            entries.append((pos, raw.nbytes))
            pos += raw.nbytes
        stream_at = pos
        self.nbytes = max(stream_at + len(stream), 1)
        self.stream = stream
        self.modules = modules
        self.by_value = by_value
        self.fd = _fds.off_stdio(os.memfd_create("mploader-spec", os.MFD_CLOEXEC))
        self.map: mmap.mmap | None = None
        try:
            os.ftruncate(self.fd, self.nbytes)
            head = bytearray(_HEAD.size + _ENTRY.size * len(raws))
            _HEAD.pack_into(head, 0, _MAGIC, stream_at, len(stream), len(raws))
            for i, ((at, n), named) in enumerate(zip(entries, persistent)):
                _ENTRY.pack_into(head, _HEAD.size + _ENTRY.size * i, at, n, int(named))
            # Written with pwrite, not through the mapping: no page fault and no zeroing
            # per page (128 MiB: 60-69 ms against 99-129 ms, issue 27).
            _pwrite_all(self.fd, memoryview(head), 0)
            for (at, _), raw in zip(entries, raws):
                _pwrite_all(self.fd, raw, at)
            _pwrite_all(self.fd, memoryview(stream), stream_at)
            self.map = _fds.mmap_fd(self.fd, self.nbytes)  # (its duplicate of fd: off 0..2 too)
        except BaseException:
            self.close()
            raise
        self.entries = entries
        self.persistent = persistent

    def same(self, stream: bytes, raws: list[memoryview], persistent: list[bool]) -> bool:
        """Whether ``stream`` and ``raws`` are byte for byte what this memfd holds."""
        if stream != self.stream or persistent != self.persistent or self.map is None:
            return False
        with memoryview(self.map) as view:
            for (at, n), raw in zip(self.entries, raws):
                if raw.nbytes != n or not _equal(raw, view[at:at + n]):
                    return False
        return True

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # pragma: no cover - a view of it is alive; it goes with it
                pass
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    forget = close  # in a forked child: the same (the mapping and fd are that child's copies)


def pack(spec: Any) -> Packed:
    """``spec`` pickled into a new memfd (:class:`Packed`).

    Raises
    ------
    pickle.PicklingError
        Some part of ``spec`` cannot be pickled, by reference nor by value; the
        message names its attribute path and value.
    """
    return Packed(*_dump(spec))


def unpack(fd: int) -> Any:
    """In a worker: the spec held by memfd ``fd`` (the caller closes ``fd``), its
    arrays views of a private (copy-on-write) mapping of it."""
    nbytes = os.fstat(fd).st_size
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    magic, stream_at, stream_bytes, nbuf = _HEAD.unpack_from(mm, 0)
    if magic != _MAGIC:
        raise pickle.UnpicklingError(f"descriptor {fd} does not hold a worker spec (magic {magic!r})")
    view = memoryview(mm)
    bufs, named = [], []
    for i in range(nbuf):
        at, n, persistent = _ENTRY.unpack_from(mm, _HEAD.size + _ENTRY.size * i)
        bufs.append(view[at:at + n])
        named.append(persistent)
    stream = bytes(view[stream_at:stream_at + stream_bytes])
    view.release()
    return _Unpickler(io.BytesIO(stream), bufs, [b for b, p in zip(bufs, named) if not p]).load()


class Transport:
    """One loader's spec as its spawn/forkserver workers receive it.

    :meth:`get` packs the spec at the first start of each generation of workers
    (after :meth:`renew`); where the new pickle is byte for byte the one already in
    the memfd, that memfd is kept.  Workers of a generation see the dataset as it
    was when the generation started (a replacement started later too).
    """

    def __init__(self) -> None:
        self.packed: Packed | None = None
        self.fresh = False

    def renew(self) -> None:
        """The next :meth:`get` pickles the spec again."""
        self.fresh = False

    def get(self, spec: Any) -> Packed:
        if self.packed is not None and self.fresh:
            return self.packed
        stream, raws, persistent, modules, by_value = _dump(spec)
        if self.packed is None or not self.packed.same(stream, raws, persistent):
            old, self.packed = self.packed, Packed(stream, raws, persistent, modules, by_value)
            if old is not None:
                old.close()
        self.fresh = True
        return self.packed

    def close(self) -> None:
        if self.packed is not None:
            self.packed.close()
            self.packed = None

    forget = close
