"""What a worker of :class:`mploader.torch.DataLoader` runs: start-up and fetch.

Both objects are module-level classes so that spawn/forkserver workers can unpickle
them; the engine pickles them together with the dataset (one pickle), so the
dataset :class:`WorkerInit` publishes in ``get_worker_info()`` is the very object
:class:`Fetch` reads from.

The module imports torch lazily (issue 27, docs/design.md "Workers"): a
spawn/forkserver worker whose dataset, ``collate_fn`` and ``worker_init_fn`` need no
torch is forked from a zygote that never imported it, and runs without it.  What
torch's worker does to torch (one thread, ``manual_seed``, ``get_worker_info()``, a
resumed RNG state) is then done by :class:`_TorchImportHook` right after torch's own
import, if user code ever imports it, before that code gets torch back: nothing can
have drawn from torch's generator before torch existed, so the state is the one
eager seeding gives.
"""
from __future__ import annotations

import importlib.abc
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _rng_state
from . import _torch_collate as _tc
from . import _worker as _mpl_worker
from ._face import Face
from ._torch_collate import collate_into, convert_into, pack, plan_tensor_column, stock_default_collate

_MASK32 = 0xFFFFFFFF


def _torch() -> Any:
    """torch, where this process has imported it (completely), else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "default_generator") else None


class _Loader(importlib.abc.Loader):
    """torch's own loader, and :meth:`_TorchImportHook.fired` right after it executed
    the module (the loader, spec and ``__loader__`` are torch's again by then)."""

    def __init__(self, loader: Any, hook: _TorchImportHook) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
        self.hook.fired()

    def __getattr__(self, name: str) -> Any:   # (get_resource_reader, is_package ...)
        return getattr(self.loader, name)


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that wraps torch's loader so that, right after
    torch's ``__init__`` ran and before the importing code gets the module, this
    module is bound to torch (:func:`mploader._torch_collate.bind`: the stock collate
    map, taken before user code can extend it) and the worker's torch start-up
    (``then``) runs.  It removes itself once torch is imported."""

    #: The one hook of this process (None: none is installed).
    installed: _TorchImportHook | None = None

    def __init__(self) -> None:
        self.then: list[Callable[[Any], None]] = []

    @classmethod
    def ensure(cls) -> _TorchImportHook:
        hook = cls.installed
        if hook is None:
            hook = cls.installed = cls()
            sys.meta_path.insert(0, hook)
        return hook

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module") and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def fired(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if _TorchImportHook.installed is self:
            _TorchImportHook.installed = None
        torch = sys.modules["torch"]
        _tc.bind()
        then, self.then = self.then, []
        for fn in then:
            fn(torch)


def on_torch_import(fn: Callable[[Any], None]) -> None:
    """Call ``fn(torch)`` right after torch is imported in this process (now, if it is)."""
    torch = _torch()
    if torch is not None:
        _tc.bind()
        fn(torch)
    else:
        _TorchImportHook.ensure().then.append(fn)


def numpy_seed_state(base_seed: int, worker_id: int) -> list[int]:
    """The four uint32 words torch's worker passes to ``np.random.seed``: NumPy's
    ``SeedSequence`` hashing of ``[worker_id, base_seed & MASK32, base_seed >> 32, 0]``
    (torch's ``_generate_state``; constants from numpy/random/bit_generator.pyx)."""
    init_a, mult_a, init_b, mult_b = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
    mix_l, mix_r, xshift = 0xCA01F9DD, 0x4973F715, 16
    hash_const = init_a

    def hashmix(value: int) -> int:
        nonlocal hash_const
        value = (value ^ hash_const) & _MASK32
        hash_const = (hash_const * mult_a) & _MASK32
        value = (value * hash_const) & _MASK32
        return (value ^ (value >> xshift)) & _MASK32

    def mix(x: int, y: int) -> int:
        r = (((mix_l * x) & _MASK32) - ((mix_r * y) & _MASK32)) & _MASK32
        return (r ^ (r >> xshift)) & _MASK32

    pool = [hashmix(v) for v in (worker_id, base_seed & _MASK32, base_seed >> 32, 0)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    out, hash_b = [], init_b
    for v in pool:
        v = (v ^ hash_b) & _MASK32
        hash_b = (hash_b * mult_b) & _MASK32
        v = (v * hash_b) & _MASK32
        out.append((v ^ (v >> xshift)) & _MASK32)
    return out


class WorkerInit:
    """The engine's ``worker_init``: what torch's ``_worker_loop`` does before its
    first task.

    ``torch.set_num_threads(1)``; unless batches are seeded by the engine
    (``per_batch``), ``random`` and torch are seeded with ``base_seed + worker_id``
    and NumPy's global RNG with :func:`numpy_seed_state`; ``get_worker_info()``
    returns torch's ``WorkerInfo(id, num_workers, seed, dataset)``; then the user's
    ``worker_init_fn(worker_id)``.  ``base_seed`` is set by the parent before the
    workers of an epoch start (torch draws a new one for every iterator).

    ``rng_states`` (set by the parent with ``base_seed``; issue 11): a resumed
    checkpoint's RNG states per worker id, a :func:`mploader._rng_state.to_json`
    dict or None.  A worker with a state restores it after ``worker_init_fn``, so
    it goes on drawing where the saved loader's worker ``i`` stood after its last
    batch the user received.

    In a worker without torch (a spawn/forkserver worker whose spec needs none) the
    torch part waits for torch's import (:func:`on_torch_import`): one thread, the
    ``WorkerInfo``, ``manual_seed(base_seed + worker_id)`` -- or, per batch, the
    current batch's seed -- and a resumed state's torch part, in that order, as
    eager seeding leaves them.  Until then the RNG states a :class:`CapturingFetch`
    sends carry the torch state torch would have (:attr:`torch_states`, computed in
    the parent for ``num_workers`` workers when it pickles this object; the resumed
    state's), so a checkpoint is the same whether the worker imported torch or not.
    """

    def __init__(self, dataset: Any, worker_init_fn: Callable[[int], None] | None, per_batch: bool,
                 num_workers: int = 0) -> None:
        self.dataset = dataset
        self.worker_init_fn = worker_init_fn
        self.per_batch = per_batch
        self.num_workers = num_workers
        self.base_seed = 0
        self.rng_states: list[dict | None] | None = None
        #: per worker id, torch's CPU generator state after ``manual_seed(base_seed + id)``
        #: (``bytes``), set by :meth:`__getstate__`; None: not known (torch is then imported
        #: eagerly where a state must be captured).
        self.torch_states: list[bytes] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        torch = _torch()
        if torch is not None and not self.per_batch and self.num_workers > 0:
            # What a worker that never imports torch reports as torch's state: where
            # torch is, a generator seeded as the worker's would be (about 20 us each).
            state["torch_states"] = [
                torch.Generator().manual_seed(self.base_seed + i).get_state().numpy().tobytes()
                for i in range(self.num_workers)]
        return state

    def __call__(self, worker_id: int, num_workers: int) -> None:
        seed = self.base_seed + worker_id
        if not self.per_batch:
            random.seed(seed)
            np.random.seed(numpy_seed_state(self.base_seed, worker_id))
        state = self.rng_states[worker_id] if self.rng_states and worker_id < len(self.rng_states) else None
        if state is not None and self.per_batch:
            state = None
        lazy = _TorchStart(self, worker_id, num_workers, seed, eager=_torch() is not None)
        if _torch() is None and not self.per_batch and self._known_torch_state(worker_id) is None:
            _need_torch_now()   # no state to report without torch: import it (as before issue 27)
        on_torch_import(lazy)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        if state is not None:
            _rng_state.restore(state)
            if _torch() is None and state.get("torch") is not None:
                restored = bytes(state["torch"])   # applied at torch's import
                want = self._known_torch_state(worker_id)
                if want is not None and len(restored) != len(want):   # (torch's set_state would refuse it here)
                    raise RuntimeError(f"cannot restore worker {worker_id}'s torch RNG state: it has "
                                       f"{len(restored)} bytes, torch's CPU generator state has {len(want)}")
                lazy.restored = restored
        _Pending.start = lazy if _torch() is None and not self.per_batch else None

    def _known_torch_state(self, worker_id: int) -> bytes | None:
        states = self.torch_states
        return states[worker_id] if states is not None and worker_id < len(states) else None


def _need_torch_now() -> None:
    import torch  # noqa: F401 - the import hook binds it


class _TorchStart:
    """One worker's torch start-up (see :class:`WorkerInit`), called with torch as
    soon as it is imported: at once where it already is."""

    def __init__(self, init: WorkerInit, worker_id: int, num_workers: int, seed: int, eager: bool) -> None:
        self.init, self.worker_id, self.num_workers, self.seed = init, worker_id, num_workers, seed
        self.eager = eager   # torch was imported when the worker started (no batch seed to catch up on)
        self.restored: bytes | None = None   # a resumed state's torch part, set while torch was not imported

    def __call__(self, torch: Any) -> None:
        from torch.utils.data._utils import worker as torch_worker

        torch.set_num_threads(1)
        if not self.init.per_batch:
            torch.manual_seed(self.seed)
            if self.restored is not None:
                torch.default_generator.set_state(torch.frombuffer(bytearray(self.restored), dtype=torch.uint8))
        else:
            seed64 = _mpl_worker.seeded_with
            if seed64 is not None and not self.eager:   # imported inside a batch: seeded as seed_rngs does
                torch.default_generator.manual_seed(seed64 & 0x7FFFFFFFFFFFFFFF)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=self.worker_id, num_workers=self.num_workers, seed=self.seed, dataset=self.init.dataset)
        if _Pending.start is self:
            _Pending.start = None

    def torch_state(self) -> bytes:
        """The torch state to report while torch is not imported."""
        if self.restored is not None:
            return self.restored
        known = self.init._known_torch_state(self.worker_id)
        assert known is not None   # (else WorkerInit imported torch)
        return known


class _Pending:
    #: This worker's torch start-up while torch is not imported (torch-seeded workers only).
    start: _TorchStart | None = None


def _capture() -> bytes:
    """:func:`mploader._rng_state.capture`, with the torch state torch would have
    where it is not imported."""
    blob = _rng_state.capture()
    start = _Pending.start
    if start is not None and _torch() is None:
        blob += start.torch_state()
    return blob


#: What a worker's payload is (the second item of a :class:`Fetch` batch).
ARRAYS, PACKED, EXHAUSTED = 0, 1, 2

#: How a batch's samples become what the worker returns (see :class:`Fetch`).
DEFAULT, CONVERT, CUSTOM = "default", "convert", "custom"


class Fetch(Face):
    """The torch face's worker contract (:class:`mploader._face.Face`).

    The batch is ``(payload, kind)`` (which worker built it, the engine says:
    ``Engine.run(tagged=True)``): ``kind`` ARRAYS -- the batch with
    arrays where torch has tensors (the parent applies
    :func:`~mploader._torch_collate.to_tensors`); PACKED -- a
    :func:`~mploader._torch_collate.pack` result (the parent unpacks it); EXHAUSTED
    -- no batch, this worker's IterableDataset replica is exhausted (payload None).

    For a map-style dataset ``indices`` is what the (batch) sampler yielded and the
    samples are ``dataset.__getitems__(indices)`` when the dataset has it, else
    ``[dataset[i] for i in indices]`` (``dataset[indices]`` without auto-batching),
    as torch's ``_MapDatasetFetcher``.

    For an IterableDataset ``indices`` is ``("iter", epoch, n)``: the worker takes
    the next ``n`` samples (one sample for ``n=None``) from its own iterator over its
    copy of the dataset, a new iterator whenever ``epoch`` changes; once that
    iterator is exhausted (or, with ``drop_last``, cannot fill a batch) the kind is
    EXHAUSTED, as torch's ``_IterableDatasetFetcher`` raises StopIteration.

    ``mode``: DEFAULT (:func:`collate_into`, or ``default_collate`` + :func:`pack`
    when ``default_collate_fn_map`` was extended), CONVERT (:func:`convert_into`),
    CUSTOM (``collate_fn`` + :func:`pack`).  A map-style batch collated by torch's
    own ``default_collate`` is plannable (tensor columns: :func:`plan_tensor_column`).

    No :meth:`side` here; :class:`CapturingFetch` sends the worker's RNG states
    beside the batch.
    """

    other_columns = staticmethod(plan_tensor_column)

    def __init__(self, mode: str, collate_fn: Callable, auto_collation: bool, drop_last: bool) -> None:
        self.mode = mode
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._epoch: Any = None
        self._iter: Any = None
        self._ended = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.mode == DEFAULT:
            # torch's default_collate is this module's to find (by reference it would make
            # the zygote import torch for a NumPy dataset); CONVERT keeps default_convert:
            # converting NumPy samples needs torch, so the zygote imports it before the fork
            state["collate_fn"] = None
        if _torch() is not None:
            state["_numpy_facts"] = _tc.numpy_facts()
        return state

    def __setstate__(self, state: dict) -> None:
        facts = state.pop("_numpy_facts", None)
        if facts is not None and _tc.torch is None:
            _tc.learn(facts)
        self.__dict__.update(state)

    def load(self, dataset: Any, indices: Any) -> Any:
        if _iterable(dataset):
            return self._next_samples(dataset, indices)   # (_END when the replica has no batch left)
        if self.auto_collation:
            return _map_samples(dataset, indices)
        return dataset[indices]

    def collate(self, samples: Any, alloc: Callable) -> Any:
        """The payload, or :class:`_Packed` around it, or ``_END``."""
        if samples is _END:
            return _END
        if self.mode == DEFAULT and stock_default_collate():
            return collate_into(samples, alloc)
        if self.mode == CONVERT:
            return convert_into(samples)
        collate_fn = self.collate_fn
        if collate_fn is None:   # DEFAULT, with default_collate_fn_map extended: torch is imported
            collate_fn = _tc.torch.utils.data.default_collate
        return _Packed(pack(collate_fn(samples)))

    def plannable(self, dataset: Any, samples: Any) -> bool:
        return (self.mode == DEFAULT and self.auto_collation and not _iterable(dataset)
                and stock_default_collate())

    def wrap(self, collated: Any) -> tuple[Any, int]:
        if collated is _END:
            return (None, EXHAUSTED)
        if type(collated) is _Packed:
            return (collated.packed, PACKED)
        return (collated, ARRAYS)

    def _next_samples(self, dataset: Any, indices: Any) -> Any:
        _, epoch, n = indices
        if epoch != self._epoch:
            self._epoch, self._iter, self._ended = epoch, None, False
            self._iter = iter(dataset)
        if self._ended:
            return _END
        if n is None:
            try:
                return next(self._iter)
            except StopIteration:
                self._ended = True
                return _END
        data = []
        for _ in range(n):
            try:
                data.append(next(self._iter))
            except StopIteration:
                self._ended = True
                break
        if not data or (self.drop_last and len(data) < n):
            return _END
        return data


class CapturingFetch(Fetch):
    """:class:`Fetch` for torch's per-worker seeding: the batch's :meth:`side`
    record, ``rng``, is the worker's RNG states after the batch -- after collation,
    which may draw too -- (:func:`mploader._rng_state.capture`, ``bytes``), which a
    checkpoint needs (docs/design.md, "Checkpoint state").  An exception raised by
    the batch carries them as its ``mploader_rng`` attribute, when its type can take
    one.

    ``rng`` is None when the states are those this worker sent with its previous
    batch of the same run (the task's epoch): a dataset that draws no random numbers
    then sends its ~10 KB of states once per run instead of with every batch.  The
    parent keeps the last states it received per worker, and receives every batch of
    a run in the worker's order; a run's first batch always carries them (a batch of
    an abandoned run may have been dropped unseen)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent: bytes | None = None   # the states sent with this run's previous batch
        self._sent_epoch = -1

    def _new_run(self) -> None:
        epoch = _mpl_worker.task_epoch
        if epoch != self._sent_epoch or epoch < 0:
            self._sent, self._sent_epoch = None, epoch

    def _failed(self, exc: BaseException) -> None:
        """``exc`` carries the states as ``mploader_rng`` when its type can take them;
        whether they reach the parent depends on the exception: the next batch sends them."""
        self._sent = None
        try:
            exc.mploader_rng = _capture()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an exception type without attributes: the state is not known
            pass

    def load(self, dataset: Any, indices: Any) -> Any:
        self._new_run()
        try:
            return super().load(dataset, indices)
        except Exception as exc:
            self._failed(exc)
            raise

    def collate(self, samples: Any, alloc: Callable) -> Any:
        try:
            return super().collate(samples, alloc)
        except Exception as exc:
            self._failed(exc)
            raise

    def side(self) -> bytes | None:
        # Taken after collation, which may draw too, or, for a plannable batch, before
        # it: torch's own default_collate (the only rule with plans) draws nothing.
        start = _Pending.start
        if start is not None and _torch() is None:   # torch's state: the one it would have (WorkerInit)
            tail = start.torch_state()
            last = self._sent
            head = last[:-len(tail)] if last is not None and last.endswith(tail) else None
            rng = _rng_state.capture_if_changed(head) if head is not None else _rng_state.capture()
            if rng is not None:
                rng += tail
        else:
            rng = _rng_state.capture_if_changed(self._sent)
        if rng is not None:
            self._sent = rng
        return rng


class _Packed:
    """:meth:`Fetch.collate`'s result for a PACKED batch."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


#: ``_next_samples``' answer when the replica has no (full) batch left.
_END = object()


def _iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is a torch ``IterableDataset`` (never, where torch's
    dataset module is not imported)."""
    module = sys.modules.get("torch.utils.data.dataset")
    return module is not None and isinstance(dataset, module.IterableDataset)


def _map_samples(dataset: Any, indices: Any) -> Any:
    """A map-style dataset's samples of one batch, as torch's ``_MapDatasetFetcher``:
    ``dataset.__getitems__(indices)`` when the dataset has it, else one
    ``dataset[i]`` per index."""
    getitems = getattr(dataset, "__getitems__", None)
    return getitems(indices) if getitems else [dataset[i] for i in indices]


if _torch() is None:
    # A zygote or a worker without torch: bind _torch_collate at torch's import, if any,
    # before a user module imported with it can extend default_collate_fn_map.
    _TorchImportHook.ensure()
