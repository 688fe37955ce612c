"""``mploader.MultiprocessIterator``: Chainer 7.8.1's MultiprocessIterator on the slot ring.

The iteration state -- ``(current_position, epoch, is_new_epoch, order)`` plus
``previous_epoch_detail`` -- lives in the calling process and advances only when a
batch is handed to the caller.  To keep batches in flight, a planner runs the same
state machine ahead of the caller: every planned batch becomes one engine task
``(epoch, position, indices)`` and the state reached after it is queued beside it.
When the engine yields the batch, the iterator adopts that queued state.  Anything
that moves the state by hand (``reset``, ``serialize`` with new values,
unpickling) throws the plan away and starts a new engine run from the new state,
exactly as Chainer's prefetch thread restarts from a reset state.

docs/faces.md describes how this face maps onto the engine.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _diagnose, _engine, _metrics, _state, _steps
from ._chainer_inline import InlineLoader, InlineRun, fetch_examples
from ._chainer_state import OrderSampler, ShuffleOrderSampler, State, plan
from ._errors import is_batch_error, warn_at_caller
from ._options import MAX_SLOT_BYTES, LoaderOptions, check_callable, check_dataset, check_int
from ._run import Body

__all__ = ["MultiprocessIterator", "OrderSampler", "ShuffleOrderSampler"]


#: Slot bytes per example beyond ``shared_mem`` (64-byte alignment, the example's
#: entry in the pickled layout), and per slot (the rest of the layout).
_EXAMPLE_LAYOUT_BYTES = 128
_SLOT_LAYOUT_BYTES = 4096
#: The engine options under Chainer's argument names, for messages.
_CHAINER_NAMES = {"num_workers": "n_processes", "prefetch": "n_prefetch", "slow_after_s": "dataset_timeout"}


def _warn_stalled(waited_s: float) -> None:
    """Issue ``TimeoutWarning``, attributed to the first frame outside the mploader
    package (the caller of ``next()``), however deep the engine's frames are."""
    warn_at_caller(
        f"a batch of the dataset has been loading for {waited_s:.1f} s (dataset_timeout): the dataset may be "
        "stalled (a dead lock in OpenCV or OpenMP after fork is a common cause; try OMP_NUM_THREADS=1 or "
        "cv2.setNumThreads(0)); raise dataset_timeout, or pass None to silence this warning",
        MultiprocessIterator.TimeoutWarning)


def _on_slow(seq: int, waited_s: float) -> None:
    _warn_stalled(waited_s)


class _Run:
    """One run: its records, the states planned for them, a planning failure.

    ``batches`` yields ``(worker_id, batch_index, value, failed, side)`` for each task (a
    tagged engine run, or :class:`~mploader._chainer_inline.InlineRun`): the batch,
    or with ``failed`` the dataset's exception, which used up the batch's task (the
    next call goes on with the following batch; an engine's failure that is not the
    dataset's -- a batch that cannot be read -- is loaded again by a new run).  What
    ``next(batches)`` raises (a dead worker, a timeout, closing, an interruption
    while waiting) leaves the batch owed.  ``states[k]``: the state after the k-th
    record not yet taken."""

    __slots__ = ("batches", "states", "failure")

    def __init__(self, batches: Any, states: collections.deque, failure: list) -> None:
        self.batches = batches
        self.states = states
        self.failure = failure


class MultiprocessIterator:
    """Dataset iterator that loads examples in forked workers, as Chainer 7.8.1's.

    Each batch is built by one worker: it reads ``dataset[i]`` for the batch's
    indices and writes the examples into a slot of the shared-memory ring; the
    returned batch is a ``list`` of the examples exactly as the dataset returned them
    (tuples, dicts, arrays, numbers, any picklable object).  Every ndarray inside is
    a zero-copy view of the slot (examples may differ in shape); the slot is reused
    only after every such view has been garbage-collected, so a returned batch never
    changes later.

    Iteration follows Chainer: ``repeat=False`` ends with a partial batch and then
    raises ``StopIteration`` on every call; with ``repeat=True`` a batch that crosses
    the end of an epoch is completed from the next epoch's order.  ``epoch``,
    ``is_new_epoch``, ``epoch_detail``, ``previous_epoch_detail`` and
    ``current_position`` describe the last batch returned, never the prefetched ones.

    Parameters
    ----------
    dataset : Dataset
        Anything with ``__getitem__`` and ``__len__``.  Workers inherit it at fork
        time: it is never pickled.
    batch_size : int
        Examples per batch.
    repeat : bool
        Loop over the dataset forever (True) or stop after one epoch.
    shuffle : bool or None
        True: a new random order every epoch (``ShuffleOrderSampler``); False: index
        order.  None (default): shuffle unless an ``order_sampler`` is given.
    n_processes : int or None
        Worker processes; None uses ``os.cpu_count()``.  0 loads in the calling
        process (an mploader extension: Chainer treats 0 like None).
    n_prefetch : int
        Batches requested ahead of the caller: at least 1 with workers (0 is a
        ValueError, not raised silently to 1), at most 4093 (the ring's slot limit
        minus 3).  Because each worker builds whole batches,
        ``max(n_prefetch, n_processes)`` batches are in flight so that every worker
        is busy.
    shared_mem : int or None
        Bytes of shared memory per example; a slot holds ``batch_size`` of them
        plus room for the batch's layout.  None sizes slots from the first batch.
        A batch that does not fit grows its slot (Chainer warned and pickled).
    order_sampler : callable or None
        ``order_sampler(order, current_position) -> next order``, called at start,
        at ``reset()`` and at the end of every epoch (ahead of time, while planning
        prefetched batches).  The length of the order must stay constant.  Only with
        ``shuffle=None``.  It runs in the calling process, so it need not be
        picklable (lambdas work).
    dataset_timeout : float or None
        Seconds a batch may be awaited before ``MultiprocessIterator.TimeoutWarning``
        is issued from inside ``next()`` (once per batch); None disables the warning.
        Turn it into an error with ``warnings.simplefilter('error',
        MultiprocessIterator.TimeoutWarning)``.
    stall_timeout, max_retries, on_error, max_bad_fraction, max_bad_samples, bad_sample_log
        mploader's long-run keywords (README, "Long runs"; as ``mploader.DataLoader``),
        keyword-only.  ``stall_timeout`` is None by default here: Chainer's own
        ``dataset_timeout`` warning stays the default, and the watchdog (a stuck worker
        killed, replaced and its batch loaded again) runs only when asked.
        ``on_error="substitute"`` keeps every batch ``batch_size`` examples long.
        The serializer does not carry the bad-sample report (``stats()`` does).
    maxtasksperchild : int or None
        Replace a worker after it has built this many batches (Chainer counted
        examples).  The replacement is forked when the retiring worker receives its
        last batch, so the iterator never waits for it.
    seed : int, optional (keyword only; mploader extension)
        Before each batch the worker seeds ``random``, NumPy's global RNG and
        torch's (if imported) from (seed, epoch, position of the batch's first
        example), so random augmentation is reproducible and independent of
        ``n_processes``.  None: the rule of every face,
        :func:`mploader._options.default_seed` (read from NumPy's global random state
        without advancing it: ``np.random.seed`` makes it reproducible, and the
        stream ``ShuffleOrderSampler`` draws its orders from is Chainer's).

    Raises
    ------
    ValueError
        An argument is out of range, or ``shuffle`` and ``order_sampler`` are both
        given (the message names the argument, its value and the limit).
    TypeError
        An argument has the wrong type: ``dataset`` lacks ``__getitem__``/``__len__``,
        ``order_sampler`` is not callable, an integer argument is not an integer.

    Notes
    -----
    ``finalize()`` (or leaving a ``with`` block) stops the workers; it is
    idempotent, returns promptly and may be called from another thread, in which
    case a ``next()`` waiting there raises ``RuntimeError``.  The shared memory is
    released once the last batch view is gone.  If the iterator is dropped without
    ``finalize()``, the same happens when it is garbage-collected.
    """

    class TimeoutWarning(RuntimeWarning):
        """A batch waited longer than ``dataset_timeout`` seconds."""

    def __init__(self, dataset: Any, batch_size: int, repeat: bool = True, shuffle: bool | None = None,
                 n_processes: int | None = None, n_prefetch: int = 1, shared_mem: int | None = None,
                 order_sampler: Callable | None = None, dataset_timeout: float | None = 30.0,
                 maxtasksperchild: int | None = None, *, seed: int | None = None,
                 stall_timeout: float | str | None = None, max_retries: int = 1, on_error: str = "raise",
                 max_bad_fraction: float | None = 0.01, max_bad_samples: int | None = None,
                 bad_sample_log: Any = None) -> None:
        check_dataset(dataset)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        if n_processes is None:
            n_processes = os.cpu_count() or 1
        # a slot holds batch_size examples of shared_mem bytes, plus room for the layout
        check_int("shared_mem", shared_mem, minimum=0, none_ok=True,
                  maximum=(MAX_SLOT_BYTES - _SLOT_LAYOUT_BYTES) // batch_size - _EXAMPLE_LAYOUT_BYTES,
                  why_max=f" bytes per example with batch_size={batch_size} (a slot holds at most "
                          f"{MAX_SLOT_BYTES} bytes)")
        check_callable("order_sampler", order_sampler, none_ok=True)
        if shuffle is not None:
            if order_sampler is not None:
                raise ValueError(f"shuffle must be None when an order_sampler is given, got shuffle={shuffle!r} "
                                 f"and order_sampler={order_sampler!r}; pass shuffle=None to use the order sampler")
            if shuffle:
                order_sampler = ShuffleOrderSampler()
        elif order_sampler is None:
            order_sampler = ShuffleOrderSampler()
        self._configure(dataset=dataset, batch_size=batch_size, repeat=bool(repeat), shuffle=shuffle,
                        n_processes=n_processes, n_prefetch=n_prefetch, shared_mem=shared_mem,
                        order_sampler=order_sampler, dataset_timeout=dataset_timeout,
                        maxtasksperchild=maxtasksperchild, seed=seed, long_runs=dict(
                            stall_timeout=stall_timeout, max_retries=max_retries, on_error=on_error,
                            max_bad_fraction=max_bad_fraction, max_bad_samples=max_bad_samples,
                            bad_sample_log=bad_sample_log))
        self.reset()

    def _configure(self, *, dataset: Any, batch_size: int, repeat: bool, shuffle: bool | None,
                   n_processes: int, n_prefetch: int, shared_mem: int | None, order_sampler: Callable | None,
                   dataset_timeout: float | None, maxtasksperchild: int | None, seed: int | None,
                   long_runs: dict | None = None) -> None:
        """Validate the engine options, set the construction parameters and the
        machinery; not the state."""
        slot_bytes = None
        if shared_mem is not None:
            slot_bytes = batch_size * (int(shared_mem) + _EXAMPLE_LAYOUT_BYTES) + _SLOT_LAYOUT_BYTES
        self._options = options = LoaderOptions(
            num_workers=n_processes, prefetch=n_prefetch, shared_mem=slot_bytes, seed=seed,
            maxtasksperchild=maxtasksperchild, slow_after_s=dataset_timeout, busy_workers=True,
            arg_names=_CHAINER_NAMES, **(long_runs or {}))   # (the watchdog and on_error: README, "Long runs")
        self._long_runs = dict(long_runs or {})
        self.dataset = dataset
        self.batch_size = batch_size
        self.repeat = repeat
        self.shuffle = shuffle
        self.n_processes = options.num_workers
        self.n_prefetch = options.prefetch
        self.shared_mem = None if shared_mem is None else int(shared_mem)
        self.order_sampler = order_sampler
        self.dataset_timeout = options.slow_after_s
        self.maxtasksperchild = options.maxtasksperchild
        self._seed = options.base_seed
        self._engine_lock = threading.Lock()   # making and closing the engine
        # One next() at a time (threads sharing the iterator: each batch once, in
        # order), by _steps.serial_next: _mpl_next with _lock held, released in C.
        self._lock = threading.Lock()
        self._gen = Body(self)
        self._progress = None
        # [record, its planned state] taken from the run (_steps.take) until the batch
        # is the caller's (serial_next empties it): an interrupt in between leaves it here.
        self._held: list = []
        self._engine: _engine.Engine | None = None
        self._inline_loader: InlineLoader | None = None
        self._run: _Run | None = None
        self._report: tuple | None = None  # log_stats_every's (seconds, logger), for the engine to come
        self._finalized = False
        self._state = State(0, 0, False, None)
        self._previous_epoch_detail = -1.0

    def _init_args(self) -> dict:
        return dict(dataset=self.dataset, batch_size=self.batch_size, repeat=self.repeat, shuffle=self.shuffle,
                    n_processes=self.n_processes, n_prefetch=self.n_prefetch, shared_mem=self.shared_mem,
                    order_sampler=self.order_sampler, dataset_timeout=self.dataset_timeout,
                    maxtasksperchild=self.maxtasksperchild, seed=self._seed, long_runs=dict(self._long_runs))

    # ---- state ----

    @property
    def current_position(self) -> int:
        """int: position in the current epoch's order after the last batch returned."""
        return self._state.current_position

    @property
    def epoch(self) -> int:
        """int: number of completed epochs."""
        return self._state.epoch

    @property
    def is_new_epoch(self) -> bool:
        """bool: whether the last batch returned reached the end of an epoch."""
        return self._state.is_new_epoch

    @property
    def _epoch_size(self) -> int:
        order = self._state.order
        return len(self.dataset) if order is None else len(order)

    @property
    def epoch_detail(self) -> float:
        """float: ``epoch + current_position / epoch_size``."""
        return self.epoch + self.current_position / self._epoch_size

    @property
    def previous_epoch_detail(self) -> float | None:
        """float or None: ``epoch_detail`` before the last ``next()``; None before the first."""
        if self._previous_epoch_detail < 0:
            return None
        return self._previous_epoch_detail

    def _set_state(self, state: State) -> None:
        """Move to ``state``; batches planned from the old state are discarded."""
        if self._finalized:
            raise NotImplementedError("Reset of finalized MultiProcessIterator is currently not supported.")
        self._drop_run()
        self._state = state

    def _drop_run(self) -> None:
        # The engine discards the old run's batches in flight when the next run starts.
        self._run = None
        del self._held[:]

    def reset(self) -> None:
        """Go back to the start: epoch 0, position 0, a new order from the order sampler.

        Raises
        ------
        NotImplementedError
            The iterator was finalized (as Chainer).
        """
        if self._finalized:
            raise NotImplementedError("Reset of finalized MultiProcessIterator is currently not supported.")
        order = None
        if self.order_sampler is not None:
            order = np.asarray(self.order_sampler(np.arange(len(self.dataset)), 0))
        self._set_state(State(0, 0, False, order))
        self._previous_epoch_detail = -1.0

    # ---- iteration ----

    def _start_run(self) -> _Run:
        states: collections.deque = collections.deque()
        failure: list = []
        tasks = plan(self._state, self.batch_size, self.repeat, self.order_sampler, len(self.dataset),
                      states, failure)
        if self.n_processes == 0:
            loader = None
            if self.dataset_timeout is not None:
                if self._inline_loader is None:
                    self._inline_loader = InlineLoader()
                    weakref.finalize(self, self._inline_loader.close)
                loader = self._inline_loader
            batches: Any = InlineRun(self.dataset, tasks, self._seed, self.dataset_timeout, loader, _warn_stalled)
        else:
            with self._engine_lock:
                if self._finalized:
                    raise RuntimeError("this MultiprocessIterator was finalized")
                if self._engine is None:
                    self._engine = _engine.Engine(self.dataset, fetch_examples, on_slow=_on_slow,
                                                  **self._options.engine_kwargs())
                    # The engine and its current run refer to each other; stop the
                    # workers as soon as this iterator is gone, not at the next cyclic GC.
                    weakref.finalize(self, self._engine.close)
                    if self._report is not None:
                        _diagnose.log_stats_every(self._engine, *self._report)
                engine = self._engine
            batches = engine.run(tasks, tagged=True)
        self._run = _Run(batches, states, failure)
        return self._run

    #: :meth:`_mpl_next` with the iterator's lock held (threads sharing the iterator
    #: get each batch once, in order); the lock is released in C.
    __next__ = _steps.serial_next

    def _ended(self, exc: BaseException) -> None:
        """(``_steps.serial_next``'s hook for the run's exceptions: nothing to do here.)"""

    def _mpl_next(self) -> list:
        """``next(iterator)``: return the next batch (a list of ``batch_size`` examples, fewer at the end
        of a non-repeating epoch).

        Raises
        ------
        StopIteration
            After the last batch of a non-repeating iterator, on every call.
        ValueError
            The order sampler changed the size of the order (raised when the batch
            that needed the new order is due; the state does not move).
        RuntimeError
            The iterator was finalized (possibly by another thread while waiting).
        mploader.WorkerError
            A worker died; the next call restarts the workers and retries the batch.
        Exception
            Whatever ``dataset[i]`` raised in the worker, with the indices attached.
        """
        if self._finalized:
            raise RuntimeError("this MultiprocessIterator was finalized")
        run = self._run if self._run is not None else self._start_run()
        held = self._held
        try:
            # The record and its planned state, in one step; they stay in ``held``
            # until serial_next has handed the batch to the caller, so an interrupt
            # below is followed by the same record again (_adopt is idempotent).
            _steps.take(run.batches, held, run.states)
        except StopIteration:
            if run.failure:
                self._drop_run()
                raise run.failure[0] from None
            self._previous_epoch_detail = self.epoch_detail
            raise
        except BaseException:
            if self._run is run:
                self._drop_run()   # the batch is owed: a new run plans it again from the state
            raise
        (_, _, value, failed, _), state = held
        if failed and not isinstance(run.batches, InlineRun) and not is_batch_error(value):
            self._drop_run()   # the batch cannot be read (a corrupt slot): a new run loads it again
            raise value
        self._adopt(state)
        if failed:   # the dataset's exception used up its batch
            del held[:]
            raise value
        return value

    def _adopt(self, state: State) -> None:
        """Move to ``state``, the one planned after the batch being returned (again
        after an interrupt: then nothing changes)."""
        if self._state is not state:
            self._previous_epoch_detail, self._state = self.epoch_detail, state

    next = _steps.serial_next

    def __iter__(self) -> MultiprocessIterator:
        return self

    # ---- metrics ----

    def stats(self) -> dict:
        """Transport counters and input-pipeline metrics, as
        :meth:`mploader.DataLoader.stats` (docs/metrics.md); the "epoch" of the
        metrics is the current run: since the first ``next()`` after construction,
        ``reset()`` or a restored state (``repeat=True`` runs through epochs).  Zeros
        before the first batch and with ``n_processes=0``."""
        engine = self._engine
        if engine is None:
            out = _metrics.idle_transport_stats()
            out.update(_metrics.empty_stats())
            return out
        return engine.stats()

    def log_stats_every(self, seconds: float | None, logger: Any = None) -> None:
        """As :meth:`mploader.DataLoader.log_stats_every`.

        Raises
        ------
        ValueError
            ``seconds`` is negative or NaN, or ``n_processes=0``.
        TypeError
            ``seconds`` is not a number, or ``logger`` not a ``logging.Logger``.
        """
        if self.n_processes == 0:
            raise ValueError("log_stats_every needs worker processes, got n_processes=0")
        _diagnose.check_report(seconds, logger)
        self._report = (seconds, logger)
        if self._engine is not None:
            _diagnose.log_stats_every(self._engine, seconds, logger)

    # ---- lifecycle ----

    def finalize(self) -> None:
        """Stop the workers.  Idempotent; safe to call from another thread, where a
        waiting ``next()`` then raises ``RuntimeError``.  Batches already returned
        stay valid."""
        with self._engine_lock:
            if self._finalized:
                return
            self._finalized = True
            engine, self._engine = self._engine, None
            loader, self._inline_loader = self._inline_loader, None
        if engine is not None:
            engine.close()
        if loader is not None:
            loader.close()
        self._run = None

    def __enter__(self) -> MultiprocessIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finalize()

    def __copy__(self) -> MultiprocessIterator:
        """A new iterator over the same dataset, standing where this one stands
        (it starts its own workers).  The order sampler is shared, not called."""
        other = type(self).__new__(type(self))
        other._configure(**self._init_args())
        pos, epoch, is_new_epoch, order = self._state
        other._state = State(pos, epoch, is_new_epoch, None if order is None else order.copy())
        other._previous_epoch_detail = self._previous_epoch_detail
        return other

    # ---- checkpoints ----

    def serialize(self, serializer: Callable) -> None:
        """Save or restore the iteration state with Chainer's serializer protocol.

        ``serializer(key, value)`` returns the value to adopt: a serializer stores
        ``value`` and returns it, a deserializer returns the stored value (or copies a
        stored array into ``value`` in place and returns it).  Keys:
        ``current_position``, ``epoch``, ``is_new_epoch``, ``order`` (only when the
        iterator has an order; ``_order`` is read from old snapshots that lack it)
        and ``previous_epoch_detail`` (``-1`` stands for None; guessed from the other
        values, as Chainer does, for snapshots that lack it).  Restoring a different
        state discards the prefetched batches; saving keeps them.
        """
        current_position = serializer("current_position", self.current_position)
        epoch = serializer("epoch", self.epoch)
        is_new_epoch = serializer("is_new_epoch", self.is_new_epoch)
        order = self._state.order
        if order is not None:
            buffer = order.copy()
            try:
                got = serializer("order", buffer)
            except KeyError:
                got = serializer("_order", buffer)
            order = buffer if got is None else np.asarray(got)
        state = State(int(current_position), int(epoch), bool(is_new_epoch), order)
        old = self._state
        if (state[:3] != old[:3] or (order is not old.order
                                     and (order is None or old.order is None or not np.array_equal(order, old.order)))):
            self._set_state(state)
        try:
            self._previous_epoch_detail = float(serializer("previous_epoch_detail", self._previous_epoch_detail))
        except KeyError:
            guess = self.epoch + (self.current_position - self.batch_size) / self._epoch_size
            self._previous_epoch_detail = max(guess, 0.0) if self.epoch_detail > 0 else -1.0

    def state_dict(self) -> dict:
        """The iteration state as a versioned, JSON-safe dict (mploader extension).

        The keys :meth:`serialize` writes -- ``current_position``, ``epoch``,
        ``is_new_epoch``, ``order`` (a list of ints, or None without an order
        sampler) and ``previous_epoch_detail`` (``-1.0`` for None) -- plus
        ``version`` (1), ``kind`` (``"chainer"``), ``dataset_length``, ``batch_size``,
        ``order_sampler_type`` and ``seed``.  Batches prefetched but not returned are
        not part of it.  Like Chainer's snapshot it does not hold the order sampler's
        random state: the orders of later epochs come from the order sampler of the
        iterator that loads the state.
        """
        out: dict = {}

        def saver(key: str, value: Any) -> Any:
            out[key] = value.tolist() if isinstance(value, np.ndarray) else value
            return value

        self.serialize(saver)
        return {"version": _state.VERSION, "kind": "chainer", "dataset_length": len(self.dataset),
                "batch_size": self.batch_size, "order_sampler_type": self._order_sampler_type(), "seed": self._seed,
                "current_position": int(out["current_position"]), "epoch": int(out["epoch"]),
                "is_new_epoch": bool(out["is_new_epoch"]), "order": out.get("order"),
                "previous_epoch_detail": float(out["previous_epoch_detail"])}

    def _order_sampler_type(self) -> str | None:
        return None if self.order_sampler is None else _state.type_name(self.order_sampler)

    def load_state_dict(self, state: dict) -> None:
        """Resume from a :meth:`state_dict` (any ``n_processes``; the batches that follow
        are those the saved iterator would have returned, per-batch seeding included).
        The iterator adopts the saved seed.

        Raises
        ------
        TypeError
            ``state`` is not a dict.
        mploader._state.StateMismatchError
            (a ValueError) Another version or kind, ``dataset_length``, ``batch_size``
            or order sampler type (both values printed), or an order of another length.
        NotImplementedError
            The iterator was finalized (as ``reset``).
        """
        _state.check_state(state, "chainer", "iterator")
        for name, here in (("dataset_length", len(self.dataset)), ("batch_size", self.batch_size),
                           ("order_sampler_type", self._order_sampler_type())):
            _state.check_same(name, state.get(name), here, "iterator")
        self._check_fields(state)
        seed = state["seed"]
        if seed != self._seed:
            self._seed = seed
            self._options = dataclasses.replace(self._options, seed=seed)
            with self._engine_lock:
                if self._engine is not None:
                    self._engine.set_seed(seed)
            self._drop_run()

        def loader(key: str, value: Any) -> Any:
            if key not in state:
                raise KeyError(key)
            return np.asarray(state[key]) if isinstance(value, np.ndarray) else state[key]

        self.serialize(loader)

    def _check_fields(self, state: dict) -> None:
        """Every field :meth:`load_state_dict` reads, in its range, before anything is
        restored.

        Raises
        ------
        mploader._state.StateMismatchError
            The first field out of range, named with its value and the range.
        """
        missing = [k for k in ("current_position", "epoch", "is_new_epoch", "order", "previous_epoch_detail", "seed")
                   if k not in state]
        if missing:
            raise _state.StateMismatchError(f"cannot load the state: it lacks {', '.join(missing)}")
        size = self._epoch_size
        _state.check_field_int("seed", state.get("seed"), maximum=None)
        _state.check_field_int("current_position", state.get("current_position"), maximum=max(size - 1, 0))
        _state.check_field_int("epoch", state.get("epoch"), maximum=_state.INT64_MAX - 1)
        if type(state.get("is_new_epoch")) is not bool:
            raise _state.StateMismatchError(f"cannot load the state: is_new_epoch must be a bool, got "
                                            f"{state.get('is_new_epoch')!r:.80}")
        order = state.get("order")
        if self._state.order is None:   # no order sampler: no order
            if order is not None:
                raise _state.StateMismatchError(f"cannot load the state: order must be None for an iterator "
                                                f"without order sampler, got {order!r:.80}")
        else:
            if not isinstance(order, list):
                raise _state.StateMismatchError(f"cannot load the state: order must be a list of dataset indices, "
                                                f"got {order!r:.80}")
            _state.check_same("len(order)", len(order), size, "iterator")
            n = len(self.dataset)
            if not all(type(i) is int and 0 <= i < n for i in order):
                raise _state.StateMismatchError(f"cannot load the state: order must hold dataset indices, ints in "
                                                f"[0, {n - 1}], got {order!r:.80}")
        detail = state.get("previous_epoch_detail")
        if isinstance(detail, bool) or not isinstance(detail, (int, float)) or not (
                detail == -1.0 or 0.0 <= detail <= _state.INT64_MAX):
            raise _state.StateMismatchError(f"cannot load the state: previous_epoch_detail must be -1.0 (none) or a "
                                            f"finite float >= 0, got {detail!r:.80}")

    def __getstate__(self) -> dict:
        """The construction parameters and the iteration state; not the workers."""
        pos, epoch, is_new_epoch, order = self._state
        return {"version": 1, "init": self._init_args(), "current_position": pos, "epoch": epoch,
                "is_new_epoch": is_new_epoch, "order": order,
                "previous_epoch_detail": self._previous_epoch_detail}

    def __setstate__(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"cannot unpickle a MultiprocessIterator state of version {state.get('version')!r}, "
                             "expected 1")
        self._configure(**state["init"])
        self._state = State(state["current_position"], state["epoch"], state["is_new_epoch"], state["order"])
        self._previous_epoch_detail = state["previous_epoch_detail"]
