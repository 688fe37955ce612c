"""Argument validation shared by every face, the samplers and the CLI.

One convention everywhere (Python's): a value of the wrong type raises ``TypeError``,
a value of the right type but out of range raises ``ValueError``, and the message
names the argument as the user spelled it, the value, and what was expected::

    num_workers must be a non-negative integer, got -1
    prefetch must be at most 4093 (the ring holds at most 4096 slots and the engine uses prefetch + 3), got 5000

Nothing is clamped silently: a value the engine cannot honour is refused at
construction, before any process or shared memory exists.

:class:`LoaderOptions` is the frozen, validated set of engine-facing options of one
loader; the faces build it from their own arguments (``arg_names`` maps its fields to
the face's argument names, e.g. Chainer's ``n_processes``) and hand
:meth:`LoaderOptions.engine_kwargs` to the engine.
"""
from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _ring

#: The most slots one ring can have (the C core's MPL_MAX_SLOTS).
MAX_SLOTS: int = _ring.MAX_SLOTS
#: The largest payload one slot can be created with, in bytes.
MAX_SLOT_BYTES: int = int(getattr(_ring, "MAX_SLOT_BYTES", 1 << 40))
#: Slots beyond ``prefetch`` the engine adds (the batch the caller holds, the previous
#: one and a spare; docs/design.md, "The lease rule").
EXTRA_SLOTS = 3
#: The largest ``prefetch`` (batches in flight) the ring can serve.
MAX_PREFETCH = MAX_SLOTS - EXTRA_SLOTS
#: With the default ``prefetch`` (None) the engine keeps more batches in flight while
#: batches are small: up to this many per worker, as long as they take at most
#: SMALL_BATCHES_BYTES together (docs/design.md, "Batches in flight").
AUTO_PREFETCH_PER_WORKER = 64
SMALL_BATCHES_BYTES = 1 << 20

_BOUNDS = {0: "a non-negative integer", 1: "a positive integer"}


def _type_name(value: Any) -> str:
    return type(value).__name__


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              none_ok: bool = False, why_max: str = "") -> Any:
    """``value`` as an ``int`` (Python and NumPy integers; not ``bool``).

    Parameters
    ----------
    name : str
        The argument's name as the user spelled it.
    minimum, maximum : int or None
        Inclusive bounds.
    none_ok : bool
        Whether ``None`` is accepted (and returned unchanged).
    why_max : str
        Appended to the message when ``maximum`` is exceeded (the limit's reason).

    Raises
    ------
    TypeError
        ``value`` is not an integer (or None when ``none_ok``).
    ValueError
        ``value`` is outside ``[minimum, maximum]``.
    """
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value   # the common case, first: set_epoch() runs at every epoch's start
    if value is None and none_ok:
        return None
    if minimum is None:
        expected = "an integer"
    else:
        expected = _BOUNDS.get(minimum, f"an integer >= {minimum}")
    if none_ok:
        expected += " or None"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {expected}, got {value!r} (bool)")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {value!r} ({_type_name(value)})") from None
    if minimum is not None and as_int < minimum:
        raise ValueError(f"{name} must be {expected}, got {as_int}")
    if maximum is not None and as_int > maximum:
        raise ValueError(f"{name} must be at most {maximum}{why_max}, got {as_int}")
    return as_int


def check_seconds(name: str, value: Any, *, none_ok: bool = True) -> float | None:
    """A duration in seconds: a non-negative real number (``inf`` allowed), or None.

    Raises
    ------
    TypeError
        Not a real number (``bool`` included) nor None.
    ValueError
        Negative or NaN.
    """
    expected = "a non-negative number of seconds" + (" or None" if none_ok else "")
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({_type_name(value)})")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (strings, compared exactly).

    Raises
    ------
    ValueError
        Anything else (the message lists the choices).
    """
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def check_callable(name: str, value: Any, *, none_ok: bool = False) -> Any:
    """``value`` if it is callable (or None when ``none_ok``); else TypeError."""
    if (value is None and none_ok) or callable(value):
        return value
    raise TypeError(f"{name} must be callable{' or None' if none_ok else ''}, got {value!r}")


def check_dataset(dataset: Any, *, needs_len: bool = True) -> Any:
    """``dataset`` if it has ``__getitem__`` (and ``__len__`` when ``needs_len``).

    Raises
    ------
    TypeError
        The methods are missing (the message names the dataset's type).
    """
    if not hasattr(dataset, "__getitem__") or (needs_len and not hasattr(dataset, "__len__")):
        raise TypeError(f"dataset must support __getitem__{' and __len__' if needs_len else ''}, "
                        f"got {_type_name(dataset)}")
    return dataset


def default_seed() -> int:
    """The base seed of a loader created with ``seed=None``, the same rule for every face.

    It is the 63-bit integer NumPy's global random state would draw next
    (``np.random.randint(0, 2**63 - 1, dtype=np.int64)``), computed on a copy of that
    state: the global RNG does not advance, and no other thread's draw can be lost or
    repeated.  So ``np.random.seed(s)`` at the top of a script makes every loader's
    seed (hence its shuffling and the workers' random augmentation) reproducible,
    while the stream that upstream code draws from -- Chainer's
    ``ShuffleOrderSampler``, Gluon's unseeded ``RandomSampler`` -- is exactly the one
    upstream would see.  Two loaders created with no NumPy draw in between get the
    same seed; pass ``seed=`` to tell them apart.
    """
    peek = np.random.RandomState(0)
    peek.set_state(np.random.get_state())
    return int(peek.randint(0, 2**63 - 1, dtype=np.int64))


def check_seed(name: str, seed: Any) -> int:
    """``seed`` as a non-negative int, or :func:`default_seed` for None.

    Raises
    ------
    TypeError
        Not an integer nor None.
    ValueError
        Negative.
    """
    if seed is None:
        return default_seed()
    return check_int(name, seed, minimum=0, none_ok=True)


@dataclass(frozen=True, slots=True)
class LoaderOptions:
    """The engine-facing options of one loader, validated once at construction.

    Parameters
    ----------
    num_workers : int
        Worker processes (threads with ``thread_pool``); 0 loads in the calling process.
    prefetch : int or None
        Batches in flight; None means ``2 * num_workers`` (Gluon's default), raised by
        the engine while batches are small (up to :data:`AUTO_PREFETCH_PER_WORKER` per
        worker and :data:`SMALL_BATCHES_BYTES` in all; ``auto_prefetch`` is then the
        most).  Must be positive when ``num_workers > 0`` and at most :data:`MAX_PREFETCH`.
    shared_mem : int or None
        Payload bytes per slot, at most :data:`MAX_SLOT_BYTES`; None sizes slots from
        the first batch.
    timeout_s : float or None
        Seconds one batch may take once awaited; 0 and None disable (stored as None).
    seed : int or None
        Base seed; None is resolved with :func:`default_seed` (stored as an int).
    copy : bool
        Return owned arrays instead of slot views.
    thread_pool : bool
        Threads instead of processes (no shared memory).
    maxtasksperchild : int or None
        Batches a worker builds before it is replaced (positive) or None.
    slow_after_s : float or None
        Seconds after which the engine reports a slow batch (Chainer's
        ``dataset_timeout``); None disables.
    busy_workers : bool
        Keep every worker busy: ``max(prefetch, num_workers)`` batches in flight
        (Chainer's face, where each worker builds whole batches).
    deep_queue : bool
        Whether the default ``prefetch`` may rise while batches are small (False:
        Gluon's ``2 * num_workers`` always, for a batch sampler whose pass leaves
        state to the next one -- ``last_batch='rollover'``'s carry -- which after a
        ``break`` depends on how far the pass was pulled).
    stall_timeout : float, "auto" or None
        The watchdog (docs/design.md, "The watchdog"): seconds a worker may work on
        one batch before it is replaced and the batch loaded again; "auto":
        ``max(60, 10 x p99 batch time)``; None: off (a forked worker that does not
        start within 10 s of its fork is replaced either way).  Positive.
    max_retries : int
        Times a stalled batch is loaded again before ``StallError`` (>= 0).
    on_error : {"raise", "skip", "substitute"}
        What a sample whose ``dataset[i]`` raises becomes (docs/design.md, "Bad
        samples"); other than "raise" needs worker processes.
    max_bad_fraction : float or None
        The most bad samples an epoch may have, as a fraction in [0, 1] of the
        samples it delivered so far; None: no limit.
    max_bad_samples : int or None
        The most distinct bad samples over the run; None: no limit.
    bad_sample_log : str, path or None
        A JSON-lines file that gets one line per bad sample.
    arg_names : mapping
        Field name -> the face's argument name, for messages (e.g.
        ``{"num_workers": "n_processes"}``).  Not part of equality.

    Raises
    ------
    TypeError, ValueError
        As :func:`check_int` / :func:`check_seconds`, naming the face's argument.
    """

    num_workers: int = 0
    prefetch: int | None = None
    shared_mem: int | None = None
    timeout_s: float | None = None
    seed: int | None = None
    copy: bool = False
    thread_pool: bool = False
    maxtasksperchild: int | None = None
    slow_after_s: float | None = None
    busy_workers: bool = False
    deep_queue: bool = True
    stall_timeout: float | str | None = None
    max_retries: int = 1
    on_error: str = "raise"
    max_bad_fraction: float | None = 0.01
    max_bad_samples: int | None = None
    bad_sample_log: str | None = None
    arg_names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    auto_prefetch: int | None = field(default=None, init=False)

    def _name(self, field_name: str) -> str:
        return self.arg_names.get(field_name, field_name)

    def __post_init__(self) -> None:
        put = object.__setattr__
        n = self._name
        num_workers = check_int(n("num_workers"), self.num_workers, minimum=0)
        put(self, "num_workers", num_workers)
        prefetch = self.prefetch
        auto = prefetch is None and self.deep_queue and not self.busy_workers and num_workers > 0
        why = f" (the ring holds at most {MAX_SLOTS} slots and the engine uses {n('prefetch')} + {EXTRA_SLOTS})"
        if prefetch is None:
            # the default is Gluon's 2 * num_workers: a limit it exceeds is num_workers'
            check_int(n("num_workers"), num_workers, maximum=MAX_PREFETCH // 2,
                      why_max=f" with the default {n('prefetch')} of 2 * {n('num_workers')}{why}")
            prefetch = 2 * num_workers
        prefetch = check_int(n("prefetch"), prefetch, minimum=0, maximum=MAX_PREFETCH, why_max=why)
        if num_workers > 0 and prefetch == 0:
            raise ValueError(f"{n('prefetch')} must be a positive integer when {n('num_workers')} > 0 "
                             f"(the engine keeps at least one batch in flight; Gluon's 0 loaded each batch "
                             f"only when asked for it), got 0")
        if self.busy_workers and num_workers > MAX_PREFETCH:
            raise ValueError(f"{n('num_workers')} must be at most {MAX_PREFETCH} (each worker keeps one batch "
                             f"in flight{why}), got {num_workers}")
        put(self, "prefetch", prefetch)
        if auto:
            put(self, "auto_prefetch", max(prefetch, min(AUTO_PREFETCH_PER_WORKER * num_workers, MAX_PREFETCH)))
        put(self, "shared_mem", check_int(n("shared_mem"), self.shared_mem, minimum=0, maximum=MAX_SLOT_BYTES,
                                          none_ok=True, why_max=" bytes (the largest slot the ring can make)"))
        put(self, "timeout_s", check_seconds(n("timeout_s"), self.timeout_s) or None)
        put(self, "seed", check_seed(n("seed"), self.seed))
        put(self, "copy", bool(self.copy))
        put(self, "thread_pool", bool(self.thread_pool))
        put(self, "busy_workers", bool(self.busy_workers))
        put(self, "maxtasksperchild", check_int(n("maxtasksperchild"), self.maxtasksperchild, minimum=1,
                                                none_ok=True))
        put(self, "slow_after_s", check_seconds(n("slow_after_s"), self.slow_after_s))
        self._check_long_runs(put, n)

    def _check_long_runs(self, put: Any, n: Any) -> None:
        """The watchdog's and the bad-sample policy's options (docs/design.md)."""
        stall = self.stall_timeout
        if stall != "auto":
            if isinstance(stall, str):
                raise ValueError(f"{n('stall_timeout')} must be a positive number of seconds, 'auto' or None, "
                                 f"got {stall!r}")
            stall = check_seconds(n("stall_timeout"), stall)
            if stall is not None and not stall > 0:
                raise ValueError(f"{n('stall_timeout')} must be a positive number of seconds, 'auto' or None, "
                                 f"got {stall!r}")
            put(self, "stall_timeout", stall)
        put(self, "max_retries", check_int(n("max_retries"), self.max_retries, minimum=0))
        on_error = check_choice(n("on_error"), self.on_error, ("raise", "skip", "substitute"))
        if on_error != "raise" and (self.num_workers == 0 or self.thread_pool):
            raise ValueError(f"{n('on_error')}={on_error!r} needs worker processes ({n('num_workers')} > 0, "
                             f"thread_pool=False), got {n('num_workers')}={self.num_workers}, "
                             f"thread_pool={self.thread_pool}")
        frac = self.max_bad_fraction
        if frac is not None:
            if isinstance(frac, (bool, np.bool_)) or not isinstance(frac, numbers.Real):
                raise TypeError(f"{n('max_bad_fraction')} must be a fraction in [0, 1] or None, got {frac!r} "
                                f"({_type_name(frac)})")
            if not 0 <= frac <= 1:
                raise ValueError(f"{n('max_bad_fraction')} must be a fraction in [0, 1] or None, got {frac!r}")
            put(self, "max_bad_fraction", float(frac))
        put(self, "max_bad_samples", check_int(n("max_bad_samples"), self.max_bad_samples, minimum=0,
                                               none_ok=True))
        log = self.bad_sample_log
        if log is not None:
            try:
                put(self, "bad_sample_log", os.fspath(log))
            except TypeError:
                raise TypeError(f"{n('bad_sample_log')} must be a path or None, got {log!r} "
                                f"({_type_name(log)})") from None

    @property
    def base_seed(self) -> int:
        """The resolved base seed (``seed``, or :func:`default_seed` for None)."""
        assert self.seed is not None  # resolved in __post_init__
        return self.seed

    @property
    def in_flight(self) -> int:
        """Batches the engine keeps in flight (``prefetch``, or ``max(prefetch,
        num_workers)`` with ``busy_workers``)."""
        assert self.prefetch is not None
        return max(self.prefetch, self.num_workers) if self.busy_workers else self.prefetch

    @property
    def num_slots(self) -> int:
        """Slots of the ring: ``in_flight + 3`` (``auto_prefetch + 3`` where set)."""
        return (self.auto_prefetch or self.in_flight) + EXTRA_SLOTS

    def engine_kwargs(self) -> dict:
        """Keyword arguments of ``mploader._engine.Engine`` (besides dataset and fetch)."""
        return dict(num_workers=self.num_workers, prefetch=self.in_flight, auto_prefetch=self.auto_prefetch,
                    shared_mem=self.shared_mem, timeout_s=self.timeout_s, seed=self.seed, copy=self.copy,
                    maxtasksperchild=self.maxtasksperchild, slow_after_s=self.slow_after_s,
                    stall_timeout=self.stall_timeout, max_retries=self.max_retries, on_error=self.on_error,
                    max_bad_fraction=self.max_bad_fraction, max_bad_samples=self.max_bad_samples,
                    bad_sample_log=self.bad_sample_log)
