"""Checkpoints of the PyTorch face (issue 11): ``mploader.torch.DataLoader.state_dict()``
/ ``load_state_dict()`` with torchdata 0.11 ``StatefulDataLoader`` semantics.

Map-style datasets use :class:`mploader._state.MapState` (the position is the
epoch and the batches received; any ``num_workers`` on resume).  torch's
``RandomSampler`` draws its order lazily from a generator (its own, or torch's
global one): that generator's state is part of the checkpoint (see
``MapState``'s ``rng``).  IterableDatasets: the position lives in each worker's
replica, so the state records the worker count and the batches received, a loader
with another ``num_workers`` refuses it (as torchdata), and resuming replays the
replicas and drops the batches already received (torchdata's fallback for datasets
without ``state_dict``).

Torch's per-worker seeding (no ``seed=``; issue 11): worker ``i`` seeds its RNGs
once from ``base_seed + i`` and each batch it builds draws from where its previous
batch left them, so the state also holds, under ``"worker_rng"``, the base seed and
each worker's RNG states after its last batch the user received
(:class:`WorkerStreams`; the worker sends them with every batch), and which worker
each batch in flight was given (``_Dispatch.in_flight`` of the face's round robin,
settled by the engine's tags: each result comes with its worker and batch index).  Resuming
with the same ``num_workers`` starts each worker from its saved states and gives
the batches that were in flight to the workers that had them, then goes on with the
saved round-robin position: every batch is built by the same worker from the same
RNG states as in the uninterrupted run.  Another ``num_workers`` starts the workers
from the saved base seed (as torchdata restores every worker), so the indices and
order are exact and the augmentations are not.  IterableDatasets replay the epoch
from its start, so they hold the workers' states as the epoch started.
"""
from __future__ import annotations

import copy
from collections.abc import Container, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, RandomSampler
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from . import _rng_state, _state
from ._options import check_int

__all__ = ["LoaderState", "Position", "WorkerStreams", "begin", "state_dict", "load_state_dict", "SingleIter",
           "check_snapshot_every", "next_counted", "worker_resume", "track_workers"]

#: A ``mploader.torch.DataLoader`` (not imported: that module imports this one).
DataLoader = Any


class LoaderState:
    """Everything mploader keeps on one ``mploader.torch.DataLoader`` (its ``_mpl``),
    in one object with one owner: the loader makes and closes the engine
    (``engine``, the ``engine_key`` it was made for, its ``WorkerInit`` ``init``, the
    CUDA ``host_pinner`` and whether batches come out ``pinned``), this module keeps
    the checkpoint (``ckpt``, ``gen_at_iter``); ``epoch`` counts the loader's
    epochs; ``auto_prefetch``: ``prefetch_factor`` was left to its default;
    ``report``: ``log_stats_every``'s (seconds, logger) for each new engine;
    ``bad_loaded``: a checkpoint's bad samples, for the next engine."""

    __slots__ = ("auto_prefetch", "bad_loaded", "ckpt", "engine", "engine_key", "epoch", "gen_at_iter",
                 "host_pinner", "init", "pinned", "report")

    def __init__(self, auto_prefetch: bool) -> None:
        self.auto_prefetch = auto_prefetch
        self.bad_loaded: tuple | None = None
        self.ckpt: Any = None
        self.engine: Any = None
        self.engine_key: tuple | None = None
        self.epoch = 0
        self.gen_at_iter: list | None = None   # the base-seed generator as the last iterator started
        self.host_pinner: Any = None
        self.init: Any = None
        self.pinned = False
        self.report: tuple | None = None

    def next_epoch(self) -> int:
        """The number of the epoch an iterator starts now."""
        epoch = self.epoch
        self.epoch += 1
        return epoch

    def detached(self) -> LoaderState:
        """A copy for a pickled loader: no engine, pinner or checkpoint (the copy
        starts its own workers)."""
        other = LoaderState(self.auto_prefetch)
        other.bad_loaded, other.epoch, other.report = self.bad_loaded, self.epoch, self.report
        return other


class _GeneratorRNG:
    """A ``torch.Generator``'s state as a list of ints (JSON-safe)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def get(self) -> list:
        return self.generator.get_state().tolist()

    def snapshot(self) -> torch.Tensor:
        """The state now, as the uint8 tensor ``get_state()`` copies it into; the list
        only when a checkpoint asks (:meth:`to_state`): an epoch's first pull takes one,
        and the 5,056-int list cost ~90 us there with cold caches."""
        return self.generator.get_state()

    def to_state(self, snap: Any) -> list:
        return _rng_list(snap)

    def set(self, state: list) -> None:
        self.generator.set_state(torch.tensor(state, dtype=torch.uint8))

    def check(self, state: Any, name: str) -> None:
        _check_generator_state(state, name, self.generator.get_state().numel())


class _GlobalRNG:
    """torch's global CPU generator (what ``RandomSampler(generator=None)`` draws from).

    ``before_iter``: when a mid-epoch state is resumed, the generator's state as the
    resumed iterator started, before it drew its base seed.  ``MapState`` reads the
    state to put back after the sampler's first pull with :meth:`get`, which then
    returns this one (once): the draws of the resumed epoch's ``iter()`` were made
    before the checkpoint in the uninterrupted run, so a trainer that restores the
    global RNG with the checkpoint (Lightning) sees the later epochs' seeds drawn
    from where the uninterrupted run drew them."""

    shared = True   # the training loop draws from it too

    def __init__(self) -> None:
        self.before_iter: list | None = None

    def get(self) -> list:
        before, self.before_iter = self.before_iter, None
        if before is not None:
            return before
        return torch.random.get_rng_state().tolist()

    def snapshot(self) -> Any:
        """:meth:`get`, with the list made only when a checkpoint asks (:meth:`to_state`)."""
        before, self.before_iter = self.before_iter, None
        return before if before is not None else torch.random.get_rng_state()

    def to_state(self, snap: Any) -> list:
        return _rng_list(snap)

    def set(self, state: list) -> None:
        torch.random.set_rng_state(torch.tensor(state, dtype=torch.uint8))

    def check(self, state: Any, name: str) -> None:
        _check_generator_state(state, name, torch.random.get_rng_state().numel())


def _rng_list(snap: Any) -> list:
    """A generator's state as ``get()`` gives it (a list of ints) from a ``snapshot()``
    (a uint8 tensor) or from such a list (a loaded state): a new list either way."""
    return snap.tolist() if isinstance(snap, torch.Tensor) else _state.snapshot(snap)


def _check_generator_state(state: Any, name: str, nbytes: int) -> None:
    """A ``torch.Generator`` state as a state dict holds it: ``nbytes`` ints in [0, 255].

    Raises
    ------
    StateMismatchError
        Not a list of that many such ints (the message names ``name``).
    """
    if not isinstance(state, list) or len(state) != nbytes or not all(
            type(b) is int and 0 <= b <= 255 for b in state):
        raise _state.StateMismatchError(f"cannot load the state: {name} must be a torch generator state, a list of "
                                        f"{nbytes} ints in [0, 255], got {state!r:.80}")


def _rng_of(sampler: Any) -> Any:
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        return _GeneratorRNG(generator)
    if isinstance(sampler, RandomSampler):
        return _GlobalRNG()
    return None


class WorkerStreams:
    """The RNG streams of one set of torch-seeded workers (they live as long as the
    workers: one epoch, or every epoch with ``persistent_workers``).

    ``after[i]``: worker ``i``'s RNG states after its last batch the user received --
    the ``bytes`` its ``Fetch`` sent (:func:`mploader._rng_state.capture`), a loaded
    JSON state it started from, or None (it has not built a batch received yet: it
    starts from ``base_seed + i``).  ``at_epoch_start``: ``after`` as the current
    epoch started (an IterableDataset's resume replays the epoch from there)."""

    __slots__ = ("base_seed", "after", "at_epoch_start")

    def __init__(self, base_seed: int, num_workers: int, states: list | None = None) -> None:
        self.base_seed = base_seed
        self.after: list[Any] = list(states) if states is not None else [None] * num_workers
        self.at_epoch_start: list[Any] = list(self.after)

    def received(self, worker_id: int, rng: Any) -> None:
        """Worker ``worker_id``'s batch (or its exception) reached the user, with the
        states it sent (None: not sent -- an exception that could not carry them)."""
        if rng is not None and 0 <= worker_id < len(self.after):
            self.after[worker_id] = rng

    def new_epoch(self) -> None:
        self.at_epoch_start = list(self.after)

    @staticmethod
    def to_json(states: list) -> list:
        return [_rng_state.to_json(s) if isinstance(s, bytes) else copy.deepcopy(s) for s in states]


class _IterableState:
    """The position of a loader over an IterableDataset (see the module docstring)."""

    def __init__(self) -> None:
        self.progress: _state.MapProgress | None = None
        self.per_worker: list[tuple[int, int]] | None = None   # Position.per_worker (the running epoch)
        self.dataset_iter: Any = None   # num_workers=0: the running epoch's iter(dataset) (SingleIter)
        self.pending: dict | None = None
        self.workers: tuple | None = None   # (WorkerStreams, _Dispatch) of the running iterator


def _checkpoint(loader: DataLoader) -> Any:
    mpl = loader._mpl
    ckpt = mpl.ckpt
    if ckpt is None:
        if isinstance(loader.dataset, IterableDataset):
            ckpt = _IterableState()
        else:
            ckpt = _state.MapState("torch", loader.dataset, loader._index_sampler, rng=_rng_of(loader.sampler))
        mpl.ckpt = ckpt
    return ckpt


def _base_seed_generator(loader: DataLoader) -> torch.Generator | None:
    """``loader.generator`` when the iterators draw their base seeds from it but the
    sampler does not (shuffle off, or a sampler without it): its state is then saved
    apart from the sampler's (:class:`MapState`'s ``rng`` covers a shared one)."""
    generator = loader.generator
    if not isinstance(generator, torch.Generator) or getattr(loader.sampler, "generator", None) is generator:
        return None
    return generator


def iterator_starting(loader: DataLoader) -> None:
    """``DataLoader._get_iterator``: a new iterator is about to draw its base seed;
    the base-seed generator's state before that draw is what a mid-epoch state
    restores (the resumed iterator then draws the same base seed)."""
    generator = _base_seed_generator(loader)
    loader._mpl.gen_at_iter = generator.get_state().tolist() if generator is not None else None
    ckpt: Any = loader._mpl.ckpt
    rng = getattr(ckpt, "rng", None)
    if isinstance(rng, _GlobalRNG):
        pending = ckpt.pending
        resuming = isinstance(pending, dict) and pending.get("rng_at") == "first_pull"
        rng.before_iter = torch.random.get_rng_state().tolist() if resuming else None


def _generator_state(loader: DataLoader, mid_epoch: bool) -> list | None:
    generator = _base_seed_generator(loader)
    if generator is None:
        return None
    if mid_epoch and loader._mpl.gen_at_iter is not None:
        return copy.deepcopy(loader._mpl.gen_at_iter)
    return generator.get_state().tolist()


def _load_generator(loader: DataLoader, state: Any) -> None:
    saved = state.get("base_seed_generator") if isinstance(state, dict) else None
    generator = _base_seed_generator(loader)
    if saved is not None and generator is not None:
        _check_generator_state(saved, "base_seed_generator", generator.get_state().numel())
        try:
            generator.set_state(torch.tensor(saved, dtype=torch.uint8))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _state.StateMismatchError(f"cannot load the state: base_seed_generator is not a generator "
                                            f"state ({exc})") from exc


def worker_resume(loader: DataLoader) -> dict | None:
    """Before the workers of a new iterator start: the loaded state's ``"worker_rng"``
    when the next epoch resumes one with torch's seeding (None otherwise), with
    ``states`` and ``assigned`` emptied when the state was saved with another
    ``num_workers`` (the workers then start from the saved base seed)."""
    ckpt = _checkpoint(loader)
    pending = ckpt.pending
    if pending is None or loader.seed is not None:
        return None
    saved = pending.get("worker_rng")
    if saved is None:
        return None
    saved = copy.deepcopy(saved)
    if pending.get("num_workers") != loader.num_workers:
        saved.update(states=None, assigned=[], next_worker=0)
    return saved


def global_rng_to_keep(loader: DataLoader) -> torch.Tensor | None:
    """Before a new multi-worker iterator draws its base seed: torch's global RNG
    state, to put back once the iterator is made, when the iterator resumes a state's
    workers with torch's seeding (:func:`worker_resume`); None otherwise.  The state's
    base seed replaces that draw, which the uninterrupted run made before the state
    was taken: a trainer that restores the global RNG with the checkpoint (HF's
    ``Trainer``; Lightning 2.6 does not) then sees the later epochs' base seeds drawn
    where the uninterrupted run drew them (``loader.generator`` has its own state)."""
    if loader.generator is not None or worker_resume(loader) is None:
        return None
    return torch.random.get_rng_state()


def track_workers(loader: DataLoader, streams: WorkerStreams | None, dispatch: Any) -> None:
    """The running iterator's worker streams and round robin (``_Dispatch``), which
    :func:`state_dict` reads; None for loaders with ``seed=``."""
    _checkpoint(loader).workers = (streams, dispatch) if streams is not None else None


def _worker_rng(loader: DataLoader, ckpt: Any, mid_epoch: bool) -> dict | None:
    """The ``"worker_rng"`` entry of a state (None: nothing to restore -- a loader with
    ``seed=`` or without workers, or between epochs when the next epoch makes new
    workers)."""
    if ckpt.workers is None or loader.seed is not None or (not mid_epoch and not loader.persistent_workers):
        return None
    streams, dispatch = ckpt.workers
    if isinstance(ckpt, _IterableState):
        states = streams.at_epoch_start if mid_epoch else streams.after
        return {"base_seed": streams.base_seed, "states": WorkerStreams.to_json(states), "assigned": [],
                "next_worker": 0}
    assigned: list = []
    next_worker = 0
    if mid_epoch and dispatch is not None:
        assigned = dispatch.assigned()
        next_worker = dispatch.cycle
    return {"base_seed": streams.base_seed, "states": WorkerStreams.to_json(streams.after),
            "assigned": assigned, "next_worker": next_worker}


def _check_worker_rng(saved: Any, num_workers: Any = None) -> None:
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise _state.StateMismatchError(f"cannot load the state: worker_rng must be a dict or None, got {saved!r:.80}")
    # torch draws a base seed in [0, 2**63); worker i seeds from base_seed + i
    _state.check_field_int("worker_rng['base_seed']", saved.get("base_seed"), maximum=_state.INT64_MAX - 4096)
    _state.check_field_int("worker_rng['next_worker']", saved.get("next_worker"))
    states = saved.get("states")
    if not isinstance(states, list):
        raise _state.StateMismatchError(f"cannot load the state: worker_rng['states'] must be a list, got "
                                        f"{states!r:.80}")
    if num_workers is not None and len(states) != num_workers:
        raise _state.StateMismatchError(f"cannot load the state: worker_rng['states'] must hold one entry per worker "
                                        f"(num_workers={num_workers}), got {len(states)}")
    for i, st in enumerate(states):
        if st is not None:
            _check_rng_json(st, f"worker_rng['states'][{i}]")
    assigned = saved.get("assigned")
    if not isinstance(assigned, list) or not all(isinstance(a, list) and len(a) == 2 for a in assigned):
        raise _state.StateMismatchError(f"cannot load the state: worker_rng['assigned'] must be a list of "
                                        f"[batch_index, worker_id] pairs, got {assigned!r:.80}")
    for k, (batch_index, worker_id) in enumerate(assigned):
        _state.check_field_int(f"worker_rng['assigned'][{k}][0] (a batch index)", batch_index)
        _state.check_field_int(f"worker_rng['assigned'][{k}][1] (a worker id)", worker_id,
                               maximum=max(len(states) - 1, 0))


def _check_worker_batches(saved: Any, num_workers: int) -> None:
    """An IterableDataset state's ``worker_batches``: None (no workers, or a state
    without them) or one count per worker.

    Raises
    ------
    StateMismatchError
        Not None nor a list of ``num_workers`` non-negative ints (the message names it).
    """
    if saved is None:
        return
    if not isinstance(saved, list) or len(saved) != num_workers:
        raise _state.StateMismatchError(f"cannot load the state: worker_batches must be a list of {num_workers} "
                                        f"counts (one per worker) or None, got {saved!r:.80}")
    for w, count in enumerate(saved):
        _state.check_field_int(f"worker_batches[{w}]", count)


def _check_rng_json(st: Any, name: str) -> None:
    """One worker's RNG states (``_rng_state.to_json``), every value in its range.

    Raises
    ------
    StateMismatchError
        A field is missing or out of range (the message names it).
    """
    _rng_state.check_json(st, name)   # the shape

    def words(field: str, values: list, bound: int) -> None:
        if not all(type(v) is int and 0 <= v < bound for v in values):
            raise _state.StateMismatchError(f"cannot load the state: {name}[{field}] must hold ints in [0, {bound}), "
                                            f"got {values!r:.80}")

    words("'python']['state'", st["python"]["state"][:-1], 1 << 32)
    _state.check_field_int(f"{name}['python']['state'][-1] (the position)", st["python"]["state"][-1],
                           maximum=624)
    gauss = st["python"].get("gauss_next")
    if gauss is not None and not isinstance(gauss, float):
        raise _state.StateMismatchError(f"cannot load the state: {name}['python']['gauss_next'] must be a float or "
                                        f"None, got {gauss!r:.80}")
    words("'numpy']['key'", st["numpy"]["key"], 1 << 32)
    _state.check_field_int(f"{name}['numpy']['pos']", st["numpy"]["pos"], maximum=624)
    _state.check_field_int(f"{name}['numpy']['has_gauss']", st["numpy"].get("has_gauss", 0), maximum=1)
    if not isinstance(st["numpy"].get("gauss", 0.0), (float, int)) or isinstance(st["numpy"].get("gauss"), bool):
        raise _state.StateMismatchError(f"cannot load the state: {name}['numpy']['gauss'] must be a float, got "
                                        f"{st['numpy'].get('gauss')!r:.80}")
    if st.get("torch") is not None:
        _check_generator_state(st["torch"], f"{name}['torch']", torch.random.get_rng_state().numel())


class Position:
    """What one iterator reports to the checkpoint: ``pairs`` (``(batch_index,
    indices)`` to load), :meth:`received`, :meth:`finish`; ``skip`` (IterableDataset
    resume without workers: batch indices already received, rebuilt and dropped);
    ``current`` (the batch index of the last pair taken).  An IterableDataset with
    workers counts the batches received from each worker instead (``per_worker[w]``:
    ``(count, batch index of the last one)``) and drops the first
    ``skip_per_worker[w]`` batches worker ``w``'s replica builds again
    (:meth:`from_worker`)."""

    __slots__ = ("progress", "pairs", "skip", "current", "per_worker", "skip_per_worker")

    def __init__(self, progress: _state.MapProgress, pairs: Iterator[tuple], skip: Container[int],
                 per_worker: list[tuple[int, int]] | None = None, skip_per_worker: list[int] | None = None) -> None:
        self.progress = progress
        self.pairs = pairs
        self.skip = skip
        self.current = -1
        self.per_worker = per_worker
        self.skip_per_worker = skip_per_worker

    def indices(self) -> Iterator[Any]:
        """The indices alone (for torch's single-process iterator), recording ``current``."""
        for i, index in self.pairs:
            self.current = i
            yield index

    def received(self, batch_index: int) -> None:
        self.progress.received(batch_index)

    def from_worker(self, worker_id: int, batch_index: int) -> bool:
        """Worker ``worker_id``'s batch ``batch_index`` (or its exception) arrived:
        False when it is to be dropped unseen (an IterableDataset's resume: its
        replica built it before the checkpoint and the user received it then).

        A replica's batches are its own sequence whatever batch indices they get
        (an exhausted replica uses up indices, ``in_order=False`` hands them out by
        timing), so the position of an IterableDataset is what each worker
        delivered, as torchdata's per-worker snapshots; with ``in_order=True`` the
        round robin over the replicas then gives the uninterrupted run's order.

        Idempotent: the same result reported again (the face's record after an
        interrupt) changes nothing -- a worker's batch indices grow, and its count
        and last index change in one store."""
        per_worker = self.per_worker
        if per_worker is None:
            if batch_index in self.skip:
                return False
            self.progress.received(batch_index)
            return True
        count, last = per_worker[worker_id]
        if batch_index != last:
            count += 1
            per_worker[worker_id] = (count, batch_index)
        self.progress.received(batch_index)
        skip = self.skip_per_worker
        return skip is None or count > skip[worker_id]

    def exhausted(self, batch_index: int) -> None:
        """An IterableDataset replica answered ``batch_index`` with its end (the index
        is used up, no batch delivered)."""
        if self.per_worker is not None:
            self.progress.received(batch_index)

    def finish(self) -> None:
        self.progress.finished = True


def _tasks_to_pairs(tasks: Iterator[tuple]) -> Iterator[tuple]:
    for _, i, index in tasks:
        yield i, index



def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _dataset_states(dataset: Any, dataset_iter: Any) -> tuple[Any, Any]:
    """torchdata's single-process ``dataset_state`` and ``dataset_iter_state``: the
    ``state_dict()`` of the dataset and of ``iter(dataset)`` where they have one
    (the iterator's only when it is not the dataset itself), deep-copied."""
    dataset_state = copy.deepcopy(dataset.state_dict()) if _stateful(dataset) else None
    iter_state = None
    if dataset_iter is not None and dataset_iter is not dataset and _stateful(dataset_iter):
        iter_state = copy.deepcopy(dataset_iter.state_dict())
    return dataset_state, iter_state


def _has_dataset_states(state: dict) -> bool:
    return state.get("dataset_state") is not None or state.get("dataset_iter_state") is not None


def begin(loader: DataLoader, epoch: int, sampler_iter: Iterator, iterators_per_epoch: int = 1) -> Position:
    """Start an epoch of ``loader`` whose iterator made ``sampler_iter`` (after
    ``iterators_per_epoch - 1`` others: see :meth:`mploader._state.MapState.start_epoch`)."""
    ckpt = _checkpoint(loader)
    if isinstance(ckpt, _IterableState):
        pending, ckpt.pending = ckpt.pending, None
        skip: Container[int] = frozenset()
        progress = _state.MapProgress(epoch, 0, set(), None, None, None)
        num_workers = loader.num_workers
        per_worker = [(0, -1)] * num_workers if num_workers > 0 else None
        skip_per_worker = None
        start = 0
        if pending is not None:
            if per_worker is not None:
                skip_per_worker = list(pending.get("worker_batches") or [0] * num_workers)
            elif _has_dataset_states(pending):
                # torchdata's single-process resume: the dataset's and its iterator's
                # own states put it where it stood (restored by SingleIter), nothing
                # is replayed, and the count goes on from the saved one
                start = pending["batches_consumed"]
                progress.consumed = start
            else:
                skip = range(pending["batches_consumed"])   # (a range: any count fits in memory)
        ckpt.progress = progress
        ckpt.per_worker = per_worker
        ckpt.dataset_iter = None
        return Position(progress, enumerate(sampler_iter, start), skip, per_worker, skip_per_worker)
    progress, tasks = ckpt.start_epoch(epoch, sampler_iter, iterators_per_epoch)
    return Position(progress, _tasks_to_pairs(tasks), frozenset())


def state_dict(loader: DataLoader) -> dict:
    """``mploader.torch.DataLoader.state_dict`` (see its docstring)."""
    ckpt = _checkpoint(loader)
    seed = loader.seed
    if isinstance(ckpt, _IterableState):
        if ckpt.pending is not None:
            return copy.deepcopy(ckpt.pending)
        progress = ckpt.progress
        mid_epoch = progress is not None and not progress.finished
        worker_batches = [0] * loader.num_workers if loader.num_workers > 0 else None
        if progress is None or progress.finished:
            epoch, consumed = loader._mpl.epoch, 0
        else:
            epoch, consumed = progress.epoch, progress.consumed
            if ckpt.per_worker is not None and len(ckpt.per_worker) == loader.num_workers:
                worker_batches = [count for count, _ in ckpt.per_worker]
                consumed = sum(worker_batches)
        dataset_state = dataset_iter_state = None
        if loader.num_workers == 0 and seed is None and progress is not None and not progress.finished:
            dataset_state, dataset_iter_state = _dataset_states(loader.dataset, ckpt.dataset_iter)
        return {"version": _state.VERSION, "kind": "iterable", "face": "torch",
                "dataset_type": _state.type_name(loader.dataset), "num_workers": loader.num_workers,
                "epoch": epoch, "batches_consumed": consumed, "worker_batches": worker_batches, "seed": seed,
                "dataset_state": dataset_state, "dataset_iter_state": dataset_iter_state,
                "worker_rng": _worker_rng(loader, ckpt, mid_epoch),
                "base_seed_generator": _generator_state(loader, mid_epoch)}
    if ckpt.pending is not None:
        return ckpt.state(loader._mpl.epoch, seed)
    mid_epoch = ckpt.progress is not None and not ckpt.progress.finished
    state = ckpt.state(loader._mpl.epoch, seed, {"num_workers": loader.num_workers,
                                                 "sampler_type": _state.type_name(loader.sampler),
                                                 "worker_rng": _worker_rng(loader, ckpt, mid_epoch),
                                                 "base_seed_generator": _generator_state(loader, mid_epoch)})
    if not mid_epoch and loader._iterator is not None and state["rng_at"] == "epoch_start":
        # Persistent workers: the next epoch reuses the iterator, which draws no base
        # seed, but a fresh loader's first iter() does -- so the sampler's generator
        # is set at its first pull, after that draw.
        state["rng_at"] = "first_pull"
    return state


def load_state_dict(loader: DataLoader, state: Any) -> None:
    """``mploader.torch.DataLoader.load_state_dict`` (see its docstring)."""
    ckpt = _checkpoint(loader)
    if isinstance(ckpt, _IterableState):
        _state.check_state(state, "iterable")
        _state.check_same("dataset_type", state.get("dataset_type"), _state.type_name(loader.dataset))
        if state.get("num_workers") != loader.num_workers:
            raise _state.StateMismatchError(
                f"cannot load the state: it was saved with num_workers={state.get('num_workers')!r}, this loader "
                f"has num_workers={loader.num_workers} (an IterableDataset's position lives in each worker's "
                f"replica, so it resumes only with the same number of workers)")
        _state.check_field_int("epoch", state.get("epoch"), maximum=_state.INT64_MAX - 1)
        _state.check_field_int("batches_consumed", state.get("batches_consumed"))
        _check_worker_batches(state.get("worker_batches"), loader.num_workers)
        if (loader.num_workers > 0 or state.get("seed") is not None) and _has_dataset_states(state):
            field = "dataset_state" if state.get("dataset_state") is not None else "dataset_iter_state"
            raise _state.StateMismatchError(f"cannot load the state: {field} is saved only without workers and "
                                            f"seed (torch's single-process iterator), got {state.get(field)!r:.80}")
        _state.check_field_int("seed", state.get("seed"), maximum=None, none_ok=True)
        _check_worker_rng(state.get("worker_rng"), loader.num_workers)
        ckpt.pending = copy.deepcopy(dict(state))
        ckpt.progress = None
        loaded = ckpt.pending
    else:
        if isinstance(state, dict) and state.get("sampler_type") is not None:
            # The batch sampler's type is checked by MapState; the sampler it draws
            # from decides the order too (a RandomSampler's state loaded into a loader
            # with a SequentialSampler resumed the sequential order; torchdata asserts).
            _state.check_same("sampler_type", state.get("sampler_type"), _state.type_name(loader.sampler))
        if isinstance(state, dict):
            saved_workers = state.get("num_workers")
            _check_worker_rng(state.get("worker_rng"), saved_workers if isinstance(saved_workers, int) else None)
        loaded = ckpt.load(state, seed_none_ok=True)
    _load_generator(loader, loaded)
    if isinstance(ckpt, _IterableState):
        # the dataset's own state, as MapState restores it (the next iter(dataset) starts there)
        try:
            _state.restore(loader.dataset, loaded.get("dataset_state"), "dataset", "dataset_state")
        except _state.StateMismatchError:
            ckpt.pending = None
            raise
    loader._mpl.epoch = loaded["epoch"]
    seed = loaded.get("seed")
    if seed is not None:
        seed = _state.check_field_int("seed", seed, maximum=None)
    if seed != loader.seed or isinstance(ckpt, _IterableState):
        loader.seed = seed
        # The engine was built for the other seeding, or its workers' replicas have
        # moved on: the next iter() makes new ones.
        loader.close()
    iterator = loader._iterator
    if iterator is not None and loader.persistent_workers:
        loader._iterator = None   # persistent workers: the next iter() starts a new pass from the state


def check_snapshot_every(value: Any) -> int | None:
    """torchdata's ``snapshot_every_n_steps``: accepted (a non-negative int or None;
    torchdata 0.11 takes 0 as "no periodic snapshot") and ignored -- the parent knows
    the position after every batch, so every step is a snapshot and the value never
    changes which batches come out."""
    return check_int("snapshot_every_n_steps", value, minimum=0, none_ok=True)


def next_counted(pos: Position, load: Any) -> Any:
    """``load()`` (one batch of a single-process iterator), reporting it to ``pos``;
    batches ``pos.skip`` names are loaded and dropped."""
    while True:
        try:
            data = load()
        except StopIteration:
            pos.finish()
            raise
        except Exception:
            pos.received(pos.current)   # the dataset's exception used up its batch
            raise
        if pos.current in pos.skip:
            continue   # IterableDataset resume: received before the checkpoint
        pos.received(pos.current)
        return data


class SingleIter(_SingleProcessDataLoaderIter):
    """torch's single-process iterator (``num_workers=0`` without ``seed``), taking
    its indices from the checkpoint's stream and reporting the batches received."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)   # (iter(dataset): the dataset's state was restored by load_state_dict)
        ckpt = _checkpoint(loader)
        dataset_iter = getattr(self._dataset_fetcher, "dataset_iter", None)
        iter_state = None
        if isinstance(ckpt, _IterableState) and ckpt.pending is not None:
            iter_state = ckpt.pending.get("dataset_iter_state")
            if iter_state is not None and not _stateful(dataset_iter):
                # iter(dataset) has no state to restore (another dataset type's, or a
                # tampered field): the replica is fast-forwarded instead
                ckpt.pending["dataset_iter_state"] = iter_state = None
        self._mpl_pos = begin(loader, loader._mpl.next_epoch(), self._sampler_iter)
        self._sampler_iter: Any = self._mpl_pos.indices()
        if isinstance(ckpt, _IterableState):
            ckpt.dataset_iter = dataset_iter
            _state.restore(dataset_iter, iter_state, "dataset iterator", "dataset_iter_state")

    def _next_data(self) -> Any:
        return next_counted(self._mpl_pos, super()._next_data)
