"""Is the training loop waiting for data?  ``mploader.diagnose`` and its reports.

:func:`diagnose` reads a loader's ``stats()`` (docs/metrics.md) and names the
bottleneck of the current epoch; :func:`log_stats_every` emits the numbers and the
verdict through :mod:`logging` every N seconds; :func:`set_postfix` puts them into
a tqdm progress bar.  Nothing here imports tqdm.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._options import check_seconds

__all__ = ["Diagnosis", "diagnose", "format_stats", "postfix", "set_postfix", "log_stats_every",
           "KINDS", "MIN_BATCHES", "INPUT_WAIT", "BUSY_WORKERS", "TRANSPORT_FALLBACK", "HELD_SLOTS"]

KINDS = ("input-bound", "compute-bound", "transport-bound", "unknown")
#: Batches of the epoch needed for a verdict (the first one is start-up, not steady state).
MIN_BATCHES = 8
#: Steady-state fraction of the time the loop waits in ``next()`` from which loading
#: is a bottleneck (below it, the loop computes at least 90 % of the time).
INPUT_WAIT = 0.10
#: Mean worker busy fraction from which a waiting loop is blamed on the workers
#: (below it the workers idle while the loop waits: the batches are slow in transit).
BUSY_WORKERS = 0.5
#: Fraction of the epoch's batches dispatched while every slot was held (they travel
#: pickled through a pipe) from which the loop is transport-bound.
TRANSPORT_FALLBACK = 0.05
#: Fraction of the epoch's batches (or of the ring's slots, when the epoch is longer)
#: that the loop still holds from which a waiting loop is transport-bound whatever the
#: workers' busy time: a loop keeping its batches makes each new one take a slot grown
#: and faulted in afresh (or the pipe, once none is free), work the workers do instead
#: of loading samples.  A loop keeping every batch of 100
#: batches of 1.6 MB (2 workers) took 0.42 s against 0.044 s dropping them, with the
#: workers 65 % busy: "add workers" was the wrong advice.
HELD_SLOTS = 0.5

_LOG = logging.getLogger("mploader")


@dataclass(frozen=True)
class Diagnosis:
    """The verdict of :func:`diagnose`; ``str()`` is ``message``.

    Attributes
    ----------
    kind : str
        ``"input-bound"`` (the loop waits for the workers), ``"compute-bound"`` (it
        rarely waits), ``"transport-bound"`` (batches are slow in transit: every slot
        held, the loop holding most slots while it waits, or workers idle while the
        loop waits) or ``"unknown"`` (fewer than
        ``MIN_BATCHES`` batches in the epoch, or no worker processes).
    message : str
        One sentence that starts with ``kind`` and says what to do.
    wait_fraction : float or None
        Steady-state fraction of the epoch's wall time spent blocked in ``next()``
        (the first batch, which includes worker start-up, left out); None if unknown.
    worker_busy : float or None
        Mean busy fraction of the workers over the epoch; None if not measured
        (no workers, or none started yet).
    fallback_fraction : float or None
        Fraction of the epoch's batches dispatched while every slot was held.
    """

    kind: str
    message: str
    wait_fraction: float | None = None
    worker_busy: float | None = None
    fallback_fraction: float | None = None

    def __str__(self) -> str:
        return self.message


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _stats_of(loader: Any) -> Mapping[str, Any]:
    if isinstance(loader, Mapping):
        return loader
    stats = getattr(loader, "stats", None)
    if not callable(stats):
        raise TypeError(f"loader must be an mploader loader (with a stats() method) or its stats() dict, "
                        f"got {type(loader).__name__}")
    return stats()


def diagnose(loader: Any) -> Diagnosis:
    """Name the bottleneck of the current epoch of ``loader``.

    Parameters
    ----------
    loader : mploader loader or dict
        Any face with ``stats()`` (``DataLoader``, ``ShardedDataLoader``,
        ``MultiprocessIterator``, ``mploader.torch.DataLoader``), or a dict that
        ``stats()`` returned.

    Returns
    -------
    Diagnosis
        ``kind`` and a one-sentence ``message`` (also ``str()`` of the result).  The
        rules, in order: fewer than ``MIN_BATCHES`` batches -> unknown; at least
        ``TRANSPORT_FALLBACK`` of the batches dispatched with every slot held ->
        transport-bound; the loop waited at least ``INPUT_WAIT`` of the steady-state
        time (after the first batch) -> transport-bound if the loop still holds at least
        ``HELD_SLOTS`` of the epoch's batches (of the slots, if there are fewer; at
        least 2), else input-bound if there are no worker
        processes (the loop loads in-process) or the workers were at least
        ``BUSY_WORKERS`` busy (or busy time is not measured), transport-bound if they
        idled; otherwise compute-bound.

        Whatever the verdict, the message ends with what the long-run machinery did
        (README, "Long runs"): the stuck batches the watchdog loaded again and the
        workers it replaced (``stalls``, ``respawns``), and the bad samples met
        (``bad_sample_count``).

    Raises
    ------
    TypeError
        ``loader`` has no ``stats()`` method and is not a dict.
    """
    s = _stats_of(loader)
    d = _verdict(s)
    notes = _long_run_notes(s) + _private_memory_note(s)
    return dataclasses.replace(d, message=d.message + notes) if notes else d


#: Growth of the workers' private memory over the sampled epochs (at least 3 samples,
#: never falling) from which :func:`diagnose` names copy-on-write: bytes, and a
#: fraction of the first sample.
PRIVATE_GROWTH_BYTES = 16 << 20
PRIVATE_GROWTH_FRACTION = 0.10


def _private_memory_note(s: Mapping[str, Any]) -> str:
    """A hint when forked workers' private memory grows epoch over epoch ('' if not)."""
    samples = list(s.get("worker_private_bytes") or [])
    if len(samples) < 3 or any(b < a for a, b in zip(samples, samples[1:])):
        return ""
    grown = samples[-1] - samples[0]
    if grown < max(PRIVATE_GROWTH_BYTES, PRIVATE_GROWTH_FRACTION * samples[0]):
        return ""
    return (f"; the workers' private memory grew from {samples[0] / 2**20:.0f} to {samples[-1] / 2**20:.0f} MiB "
            f"over {len(samples)} epochs: reading the dataset's Python objects copies their pages into each "
            "worker (copy-on-write of reference counts, pytorch issue 13246); keep them in an "
            "mploader.SharedList or in NumPy arrays")


def _long_run_notes(s: Mapping[str, Any]) -> str:
    """The watchdog's and the bad-sample policy's part of the verdict ('' if idle)."""
    notes = ""
    stalls, respawns = int(s.get("stalls", 0)), int(s.get("respawns", 0))
    if stalls:
        notes += (f"; the watchdog found {stalls} stuck batch{'es' if stalls != 1 else ''} and replaced "
                  f"{respawns} worker{'s' if respawns != 1 else ''} (their stacks are in the 'mploader' log: a "
                  "__getitem__ that blocks)")
    bad = int(s.get("bad_sample_count", 0))
    if bad:
        notes += (f"; {bad} bad sample{'s' if bad != 1 else ''} raised in __getitem__ (stats()['bad_samples'] "
                  "names them)")
    return notes


def _verdict(s: Mapping[str, Any]) -> Diagnosis:
    n = int(s.get("epoch_batches", 0))
    if n < MIN_BATCHES:
        return Diagnosis("unknown", f"unknown: {n} batches measured in this epoch, {MIN_BATCHES} needed for a "
                                    "verdict")
    full = int(s.get("epoch_no_free_slot", 0)) / n
    busy_list = [b for b in s.get("worker_busy", []) if b is not None]
    busy = sum(busy_list) / len(busy_list) if busy_list else None
    wall = float(s["wall_s"]) - float(s.get("first_batch_s", 0.0))
    wait = float(s["wait_s"]) - float(s.get("first_batch_s", 0.0))
    frac = min(1.0, max(0.0, wait / wall)) if wall > 0 else None
    if full >= TRANSPORT_FALLBACK:
        return Diagnosis("transport-bound", f"transport-bound: {_pct(full)} of batches fell back to pickle because "
                                            "every slot was held; drop references to old batches or pass copy=True",
                         frac, busy, full)
    if frac is None:
        return Diagnosis("unknown", "unknown: the epoch's wall time is not measured yet", None, busy, full)
    if frac >= INPUT_WAIT:
        workers = len(s.get("worker_busy", []))
        held, slots = int(s.get("held_slots", 0)), int(s.get("num_slots", 0))
        if workers and slots and held >= max(2, HELD_SLOTS * min(slots, n)):
            return Diagnosis("transport-bound", f"transport-bound: the loop waited {_pct(frac)} of the time and holds "
                                                f"{held} of the {slots} slots (batches it still refers to), so each "
                                                "new batch needs a slot grown afresh, or the pipe once none is free; "
                                                "drop references to old batches or pass copy=True", frac, busy, full)
        if not workers:
            return Diagnosis("input-bound", f"input-bound: the loop waited {_pct(frac)} of the time loading batches "
                                            "in this process (num_workers=0 or thread_pool=True); use worker "
                                            "processes or make `__getitem__` cheaper", frac, busy, full)
        if busy is None:
            return Diagnosis("input-bound", f"input-bound: the loop waited {_pct(frac)} of the time (worker busy time "
                                            "is not measured); add workers or make "
                                            "`__getitem__` cheaper", frac, busy, full)
        if busy >= BUSY_WORKERS:
            return Diagnosis("input-bound", f"input-bound: the loop waited {_pct(frac)} of the time while the "
                                            f"{workers} workers were {_pct(busy)} busy; add workers or make "
                                            "`__getitem__` cheaper", frac, busy, full)
        pipe = int(s.get("epoch_fallback_pipe", 0)) / n
        return Diagnosis("transport-bound", f"transport-bound: the loop waited {_pct(frac)} of the time while the "
                                            f"{workers} workers were only {_pct(busy)} busy ({_pct(pipe)} of batches "
                                            "came through a pipe); raise prefetch, or return arrays instead of "
                                            "Python objects", frac, busy, full)
    return Diagnosis("compute-bound", f"compute-bound: the loop waited {_pct(frac)} of the time; loading is not "
                                      "the bottleneck", frac, busy, full)


def _rate(x: float, unit: str) -> str:
    for prefix in ("", "k", "M", "G"):
        if abs(x) < 1000 or prefix == "G":
            return f"{x:.1f} {prefix}{unit}"
        x /= 1000
    return f"{x:.1f} {unit}"  # pragma: no cover


def format_stats(stats: Mapping[str, Any]) -> str:
    """One line: rates, wait, worker busy, ring occupancy, fallbacks, and the verdict."""
    busy = [b for b in stats.get("worker_busy", []) if b is not None]
    busy_text = " ".join(f"{b * 100:.0f}" for b in busy) + " % busy" if busy else "busy unknown"
    wall = float(stats.get("wall_s", 0.0))
    wait = float(stats.get("wait_s", 0.0))
    return (f"{_rate(float(stats.get('batches_per_s', 0.0)), 'batches/s')}, "
            f"{_rate(float(stats.get('bytes_per_s', 0.0)), 'B/s')}; "
            f"waited {wait:.3g} s of {wall:.3g} s; workers {busy_text}; "
            f"{stats.get('ready_batches', 0)} ready, {stats.get('held_slots', 0)} held; "
            f"pipe {stats.get('fallback_pipe', 0)}, in-band {stats.get('fallback_inband', 0)}, "
            f"no free slot {stats.get('no_free_slot', 0)}; stalls {stats.get('stalls', 0)}, "
            f"bad samples {stats.get('bad_sample_count', 0)} -- {diagnose(stats).message}")


def postfix(loader: Any) -> dict[str, str]:
    """The key numbers as short strings, for ``tqdm.set_postfix``: ``wait`` (the
    fraction of the epoch blocked in ``next()``, after the first batch as
    :func:`diagnose` counts it), ``busy`` (mean worker busy fraction), ``batch/s``
    (recent rate) and ``verdict`` (:func:`diagnose`'s kind)."""
    s = _stats_of(loader)
    wall = float(s.get("wall_s", 0.0))
    busy = [b for b in s.get("worker_busy", []) if b is not None]
    d = diagnose(s)
    wait = d.wait_fraction if d.wait_fraction is not None else (
        float(s.get("wait_s", 0.0)) / wall if wall > 0 else None)
    return {"wait": "-" if wait is None else _pct(wait),
            "busy": _pct(sum(busy) / len(busy)) if busy else "-",
            "batch/s": f"{float(s.get('batches_per_s', 0.0)):.1f}",
            "verdict": d.kind}


def set_postfix(bar: Any, loader: Any, refresh: bool = False) -> dict[str, str]:
    """Put :func:`postfix` of ``loader`` into the tqdm progress bar ``bar``
    (``bar.set_postfix(..., refresh=refresh)``) and return it.  Call it every few
    batches (it reads the ring's state words: microseconds, not nanoseconds).

    Raises
    ------
    TypeError
        ``bar`` has no ``set_postfix`` method.
    """
    if not callable(getattr(bar, "set_postfix", None)):
        raise TypeError(f"bar must be a tqdm progress bar (with set_postfix), got {type(bar).__name__}")
    values = postfix(loader)
    bar.set_postfix(values, refresh=refresh)
    return values


class _Report:
    """The periodic report: ``logger.info`` of :func:`format_stats` of the engine's stats."""

    __slots__ = ("engine", "logger")

    def __init__(self, engine: Any, logger: logging.Logger) -> None:
        self.engine = weakref.ref(engine)
        self.logger = logger

    def __call__(self) -> None:
        engine = self.engine()
        if engine is not None and not engine.closed and self.logger.isEnabledFor(logging.INFO):
            self.logger.info("mploader: %s", format_stats(engine.stats()))


def check_report(seconds: Any, logger: Any) -> float | None:
    """Validate :func:`log_stats_every`'s arguments; returns the seconds."""
    every = check_seconds("seconds", seconds)
    if logger is not None and not isinstance(logger, logging.Logger):
        raise TypeError(f"logger must be a logging.Logger or None, got {logger!r} ({type(logger).__name__})")
    return every


def log_stats_every(engine: Any, seconds: float | None, logger: logging.Logger | None = None) -> None:
    """Emit ``format_stats`` of ``engine`` at INFO level on ``logger`` (default: the
    ``"mploader"`` logger) at the first ``next()`` after every ``seconds`` seconds;
    None or 0 stops the reports.

    Raises
    ------
    TypeError
        ``seconds`` is not a number, or ``logger`` is not a ``logging.Logger``.
    ValueError
        ``seconds`` is negative or NaN.
    """
    every = check_report(seconds, logger)
    if not every or math.isinf(every):
        engine.set_report(None, 0.0)
        return
    engine.set_report(_Report(engine, logger or _LOG), every)
