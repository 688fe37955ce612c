"""Synthetic transport benchmark: how fast does each loader move batches?

The datasets' ``__getitem__`` returns pre-built arrays, so almost all the time
goes into collating and moving the batch from the workers to the consumer:

========  ==========  ===================================  ===============
size      batch size  sample                               bytes per batch
========  ==========  ===================================  ===============
tiny      32          ``(np.int64 scalar, float32 (16,))``  2,304
small     256         ``(uint8 (32, 32, 3), np.int64)``     788,480
large     256         ``(uint8 (224, 224, 3), np.int64)``   38,537,216
========  ==========  ===================================  ===============

The data are not in the CPU cache (``cache="cold"``, the default): the arrays
come from a pool of distinct samples totalling at least 4 times the last-level
cache read from the OS (:mod:`mploader_bench.cachesize`, :mod:`.synthetic`).
``cache="resident"`` runs the suite's former data, 4 distinct arrays that stay in
the cache; its rows are named ``<size>-resident``.

The transports are those of :mod:`mploader_bench.peers` (``mploader``,
``mploader.torch``, ``mploader.torch-seed``, ``pickle``, ``queue``, ``torch`` when installed; ``inline``
on request), all with the same number of workers, plus two references:

``copy-limit``
    as many processes as workers copy distinct samples of the same pool into
    rotating buffers, all at once, each byte read once and written once
    (:mod:`mploader_bench.copylimit`): the memory bus's limit for a loader that
    collates.  Every row's *share of copy-limit* is its rate over the copy-limit
    measured around its own blocks (below).
``collate-limit``
    the calling process alone stacks each batch's samples with
    :func:`numpy.stack` into one pre-allocated, pre-faulted buffer: the
    single-core cost of the collation (its buffer stays partly in the cache).

Method
------
Per size and cache mode, every transport is opened once and warmed up (one short
epoch, then epochs of doubling length until one lasts 0.1 s, which estimates its
rate).  Each transport then gets a fixed number of batches per run, about
`seconds` worth at that rate, so every timed run is a whole epoch (no in-flight
work spills into the next transport's run).  For each repetition the transports
run in the same order, one after the other (interleaved); the report gives the
median over repetitions with the slowest and fastest beside it.  Where rows get a
share of copy-limit (small and large), a repetition is *bracketed*
(:mod:`.transport_blocks`): each transport's run is split into `blocks` epochs (4),
each run just after a copy-limit block, with one more copy-limit block after the
last, and a row's share is its rate over the mean of the copy-limit blocks beside
its own; the other work on a shared machine then weighs on both alike.  Ratios
(share of copy-limit, x torch) are taken per repetition and summarised the same way.  The
consumer checks every batch's fingerprint (:mod:`mploader_bench.checks`: the
first 8 bytes of each row and the labels) and drops it; a wrong batch stops that
transport and fails the run.  GB/s is decimal (1e9 bytes per second) of collated
payload.

Run it with ``python bench/transport.py`` (or ``mploader bench --suite
transport``); :func:`run` is the entry point for code.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as _dt
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import peers
from .cachesize import last_level_cache
from .checks import BatchMismatch
from .copylimit import COPY_LIMIT, CopyLimit
from .synthetic import (
    CACHE_MODES,
    SIZES,
    Batches,
    CollateLimit,
    SyntheticDataset,
    case_name,
    describe_sample,
    make_dataset,
)
from .transport_blocks import bracket_rate, bracket_values, merge, plan

__all__ = ["SIZES", "CACHE_MODES", "TARGETS", "REFERENCE", "CollateLimit", "CopyLimit",
           "SyntheticDataset", "make_dataset", "run", "main"]

SUITE = "transport"
SCHEMA_VERSION = 3  # 3: bracketed runs (blocks, copy_limit_batches_per_s, others_cpu_s, span_s)

#: Targets for mploader, as (size, peer, minimum ratio, strict): mploader's
#: median rate divided by the peer's must be >= (or > when strict) the minimum.
TARGETS: tuple[tuple[str, str, float, bool], ...] = (
    ("large", "torch", 4.0, False),
    ("small", "torch", 3.0, False),
    ("tiny", "torch", 10.0, False),
    ("tiny", "queue", 2.5, False),
)

#: Issue 13's targets for mploader's rows: (size, minimum share of the collate limit).
#: Its large-batch target (0.71) is replaced by issue 24's share of copy-limit: the
#: collate limit is not the memory bus's limit for large batches.
SHARE_TARGETS: tuple[tuple[str, float], ...] = (("tiny", 0.5), ("small", 0.7))

#: Issue 24's targets for both faces, met only if met in every repetition:
#: (size, what, minimum) with what "copy-limit" (share of it) or "torch" (x torch).
EVERY_RUN_TARGETS: tuple[tuple[str, str, float], ...] = (
    ("large", COPY_LIMIT, 0.85),
    ("large", "torch", 4.0),
)
FACES = ("mploader", "mploader.torch", "mploader.torch-seed")
#: Sizes whose rows get a share of copy-limit: for tiny batches (2 kB) copy-limit
#: measures numpy's per-call cost, not the memory bus.
COPY_SHARE_SIZES = ("small", "large")

#: Peers' rates (batches per second) measured earlier on the 2-core development
#: machine with 2 workers, on cache-resident data; kept in the JSON to spot drift.
REFERENCE: dict[str, dict[str, float]] = {
    "large": {"pickle": 6, "torch": 42, "collate-limit": 296},
    "small": {"pickle": 270, "torch": 565, "collate-limit": 6200},
    "tiny": {"pickle": 3400, "queue": 7500, "torch": 620},
}

COLLATE_LIMIT = CollateLimit.name
LIMITS = (COLLATE_LIMIT, COPY_LIMIT)
DEFAULT_SECONDS = 1.0
#: Epochs per transport and repetition in the bracketed cases (:mod:`.transport_blocks`).
DEFAULT_BLOCKS = 4

_CALIBRATE_SECONDS = 0.1
_MIN_BATCHES = 10
_MIN_BLOCK_BATCHES = 32
_MAX_BATCHES = 500_000
_Batches = Batches  # the former private name (bench/two_collators.py)


def _children_cpu() -> tuple[list, float]:
    """This process's descendants and their summed user+system CPU seconds."""
    try:
        import psutil
    except ImportError:
        return [], float("nan")
    kids = psutil.Process().children(recursive=True)
    return kids, _cpu_of(kids)


def _busy_cpu() -> float | None:
    """CPU seconds the whole machine has been busy (all cores: user, nice, system,
    irq, softirq and steal) since boot, or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _cpu_of(procs: list) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # exited meanwhile
            pass
    return total


def _time_epoch(t: Any, batches: list[list[int]], *, expected: Sequence[int] | None = None,
                workers_cpu: bool = False) -> tuple[float, float, int, float | None]:
    """Consume one epoch, checking every batch's fingerprint against `expected`.

    A :class:`CopyLimit` copies ``len(batches)`` batches instead (nothing to check).

    Returns
    -------
    tuple
        (wall seconds, parent CPU seconds, batches, worker CPU seconds or None);
        the worker CPU is the summed CPU of all descendant processes, measured
        only when `workers_cpu` is true.

    Raises
    ------
    BatchMismatch
        If a batch does not have its expected fingerprint.
    """
    # The harness's copy of the batch list (Transport.epoch: lists of ints) is made
    # before the clock starts: a sampler hands a loader its indices batch by batch.
    epoch = None if isinstance(t, CopyLimit) else t.epoch(batches)
    kids, k0 = _children_cpu() if workers_cpu else ([], 0.0)
    c0 = time.process_time()
    t0 = time.perf_counter()
    if epoch is None:
        wall = t.run(len(batches))
        t1, count = t0 + wall, len(batches)
    elif expected is None:
        count = sum(1 for _ in epoch)  # holds no batch past its turn
        t1 = time.perf_counter()
    else:
        check = t.dataset.check
        count = 0
        for batch in epoch:
            check.check(t.name, count, batch, expected[count])
            count += 1
            del batch  # holds no batch past its turn
        t1 = time.perf_counter()
    c1 = time.process_time()
    wcpu = _cpu_of(kids) - k0 if workers_cpu else None
    if wcpu is not None and math.isnan(wcpu):
        wcpu = None
    if count != len(batches):
        raise BatchMismatch(f"{t.name}: got {count} batches, expected {len(batches)}")
    return t1 - t0, c1 - c0, count, wcpu


def _check_batch(name: str, batch: Any, want: Any) -> None:
    got = batch if isinstance(batch, tuple) else (batch,)
    want = want if isinstance(want, tuple) else (want,)
    if len(got) != len(want) or any(
            np.asarray(g).shape != w.shape or np.asarray(g).dtype != w.dtype
            or not np.array_equal(g, w) for g, w in zip(got, want)):
        raise BatchMismatch(f"{name}: first batch differs from the inline reference")


def _open(name: str, ds: SyntheticDataset, workers: int, batch_size: int, seed: int,
          llc_bytes: int) -> Any:
    if name == COLLATE_LIMIT:
        return CollateLimit(ds, batch_size)
    if name == COPY_LIMIT:
        return CopyLimit(ds.pool, batch_size, workers=max(1, workers), llc_bytes=llc_bytes, seed=seed)
    return peers.open_transport(name, ds, workers=workers, seed=seed)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _spread(xs: Sequence[float]) -> dict[str, float] | None:
    """``{"median", "min", "max"}`` of `xs`, or None when empty."""
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs)) if xs else None


def _bound_by(verdict: str | None) -> str:
    """A table cell for a verdict: "input", "compute", "transport", "unknown" or ""."""
    return "" if verdict is None else verdict.replace("-bound", "")


def _most_common(xs: Sequence[str | None]) -> str | None:
    """The most frequent of the values that are not None (the first on a tie)."""
    counts = collections.Counter(x for x in xs if x is not None)
    return counts.most_common(1)[0][0] if counts else None


def _cache_modes(cache: str | Sequence[str]) -> list[str]:
    modes = ["resident", "cold"] if cache == "both" else [cache] if isinstance(cache, str) else list(cache)
    bad = [m for m in modes if m not in CACHE_MODES]
    if not modes or bad:
        raise ValueError(f"cache={cache!r}: expected 'cold', 'resident', 'both' or a list of "
                         f"{CACHE_MODES}")
    return list(dict.fromkeys(modes))


def _touches_samples(name: str) -> bool:
    """Whether transport `name` has worker processes that take the samples' objects
    (and so copy the pages of their headers, by reference counting)."""
    return name not in (COLLATE_LIMIT, COPY_LIMIT, "inline")


def run(*, workers: int = 2, repeats: int = 5, seconds: float = DEFAULT_SECONDS,
        transports: Sequence[str] | None = None,
        sizes: Sequence[str] = ("tiny", "small", "large"), cache: str | Sequence[str] = "cold",
        out_dir: str | os.PathLike | None = None, console: Any = None,
        seed: int = 0, quiet: bool = False, blocks: int = DEFAULT_BLOCKS) -> dict[str, Any]:
    """Run the transport benchmark and report it.

    Parameters
    ----------
    workers : int, optional
        Worker processes of every multi-process transport (and of copy-limit).
    repeats : int, optional
        Repetitions; each runs every transport once, in the same order.
    seconds : float, optional
        Target duration of one timed run, in seconds (the batch count per run is
        fixed per transport from its warm-up rate, at least 10 batches).
    transports : sequence of str, optional
        Names from :func:`mploader_bench.peers.transport_names`, ``"copy-limit"``
        and/or ``"collate-limit"``.  Default: the ``transport`` suite's transports
        available here (mploader, mploader.torch, pickle, queue, torch if
        importable), then copy-limit and collate-limit.  collate-limit is always
        measured; copy-limit by default or when named.
    sizes : sequence of str, optional
        Keys of :data:`SIZES`.
    cache : {"cold", "resident", "both"} or list of those, optional
        ``"cold"``: data not in the CPU cache (a pool of at least 4 x the LLC);
        ``"resident"``: 4 distinct arrays, in the cache (rows ``<size>-resident``);
        ``"both"``: resident, then cold, for each size.
    out_dir : path, optional
        Directory for the JSON report (created if needed); None writes none.
    console : rich.console.Console, optional
        Where to print; default a new rich console, or plain ``print``
        without rich.
    seed : int, optional
        Seed of the batch indices (and mploader's ``seed``).
    quiet : bool, optional
        Print only the final tables.
    blocks : int, optional
        For the cases whose rows get a share of copy-limit (small and large, when
        copy-limit runs): each transport's run is split into this many epochs, each
        between two copy-limit blocks, and its share is taken against them
        (:mod:`.transport_blocks`); 0 runs every transport once, whole, in order.

    Returns
    -------
    dict
        The report: ``config``, ``machine``, ``sizes`` (per case -- size and cache
        mode -- its description and pool), ``runs`` (one record per repetition and
        transport: batches, seconds, batches_per_s, gb_per_s, parent_cpu_s, cache),
        ``medians`` (per case and transport, with min/max, shares and x torch as
        median/min/max), ``ratios`` (mploader's median rate over each peer's),
        ``paired_ratios`` (median of per-repetition ratios), ``targets``,
        ``every_run_targets``, ``reference``, ``errors``, ``mismatches`` and, when
        written, ``json_path``.

    Raises
    ------
    ValueError
        If a transport, size or cache mode is unknown, or `repeats` < 1.
    """
    out = _Out(console)
    available = set(peers.available_transports()) | set(LIMITS)
    if transports is None:
        names = [*peers.available_transports("transport"), COPY_LIMIT, COLLATE_LIMIT]
    else:
        # collate-limit is always measured: every row's share of the limit needs it
        names = list(dict.fromkeys([*transports, COLLATE_LIMIT]))
        known = [*peers.transport_names(), *LIMITS]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown transports {unknown}; choose from {known}")
        missing = [n for n in names if n not in available]
        if missing:
            raise ValueError(f"transports not available here: {missing}")
    sizes = list(sizes)
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise ValueError(f"unknown sizes {bad}; choose from {tuple(SIZES)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be >= 1")
    if blocks < 0:
        raise ValueError(f"blocks={blocks!r}: must be >= 0")
    modes = _cache_modes(cache)

    started = time.time()
    llc = last_level_cache()
    report: dict[str, Any] = {
        "suite": SUITE,
        "schema": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": dict(workers=workers, repeats=repeats, seconds=seconds,
                       transports=names, sizes=sizes, cache=modes, seed=seed, blocks=blocks),
        "machine": machine_info(with_torch="torch" in names),
        "llc": dict(bytes=llc.bytes, level=llc.level, source=llc.source),
        "sizes": {},
        "runs": [],
        "calibration": {},
        "medians": {},
        "ratios": {},
        "paired_ratios": {},
        "targets": [],
        "share_targets": [],
        "every_run_targets": [],
        "reference": REFERENCE,
        "errors": {},
        "mismatches": [],
    }
    m = report["machine"]
    if hasattr(os, "getloadavg"):
        m["load_avg_start"] = list(os.getloadavg())
    if not quiet:
        out.line(f"transport benchmark: {m['cpu_model']}, {m['usable_cores']} usable cores, "
                 f"python {m['python']}, numpy {m['numpy']}, torch {m['torch']}; "
                 f"workers={workers}, repeats={repeats}, ~{seconds:g} s per run; "
                 f"last-level cache {llc.bytes / 2**20:g} MiB ({llc.source}); data: {', '.join(modes)}")
    busy = m["cpu_busy_before_pct"] = cpu_busy_percent(1.0)
    if busy is not None and busy > 20:
        out.line(f"note: the CPUs were {busy:.0f}% busy just before the run; other work on the "
                 "machine will depress and scatter the rates")

    processes = workers * sum(_touches_samples(n) for n in names)
    for size in sizes:
        for mode in modes:
            _run_case(size, mode, names, report, out, workers=workers, repeats=repeats,
                      seconds=seconds, seed=seed, quiet=quiet, llc=llc, processes=processes,
                      blocks=blocks)

    _summarise(report)
    report["elapsed_s"] = round(time.time() - started, 3)
    if hasattr(os, "getloadavg"):
        report["machine"]["load_avg_end"] = list(os.getloadavg())
    _print_report(report, out)
    if out_dir is not None:
        path = _write_json(report, Path(out_dir))
        report["json_path"] = str(path)
        out.line(f"wrote {path}")
    return report


def _fail(report: dict, errors: dict, case: str, name: str, stage: str, exc: Exception, out: _Out) -> None:
    errors[name] = f"{stage}: {type(exc).__name__}: {exc}"
    if isinstance(exc, BatchMismatch):
        report["mismatches"].append(dict(size=case, transport=name, error=str(exc)))
    out.line(f"[{case}] {name}: failed in {stage} ({errors[name]})")


def _run_case(size: str, cache: str, names: list[str], report: dict, out: _Out, *, workers: int,
              repeats: int, seconds: float, seed: int, quiet: bool, llc: Any, processes: int,
              blocks: int) -> None:
    spec = SIZES[size]
    case = case_name(size, cache)
    bs = spec["batch_size"]
    t_build = time.perf_counter()
    ds = make_dataset(size, cache, llc=llc, processes=processes)
    batches = Batches(len(ds), bs, seed, ds.check)
    warm = batches.take(max(8, 2 * workers + 2))
    with peers.open_transport("inline", ds, workers=0) as ref:
        reference = next(iter(ref.epoch(warm[:1])))
    nbytes = int(sum(a.nbytes for a in (reference if isinstance(reference, tuple) else (reference,))))
    plan = ds.plan
    report["sizes"][case] = dict(
        size=size, cache=cache, batch_size=bs, sample=describe_sample(size), bytes_per_batch=nbytes,
        dataset_length=len(ds), distinct_samples=len(ds.pool), pool_bytes=int(ds.pool.nbytes),
        pool=None if plan is None else dict(
            samples=plan.samples, sample_bytes=plan.sample_bytes, header_bytes=plan.header_bytes,
            llc_bytes=plan.llc_bytes, target_bytes=plan.target_bytes, total_bytes=plan.total_bytes,
            worst_bytes=plan.worst_bytes, cap_bytes=plan.cap_bytes, capped=plan.capped,
            cache_multiple=plan.cache_multiple),
        build_s=round(time.perf_counter() - t_build, 3))
    if not quiet:
        what = (f"{len(ds.pool):,} distinct samples, {ds.pool.nbytes / 1e6:,.1f} MB"
                + ("" if plan is None else f" + {len(ds.pool) * plan.header_bytes / 1e6:,.1f} MB of headers"
                   f" = {plan.cache_multiple:.1f} x the LLC" + (" (CAPPED)" if plan.capped else "")))
        out.line(f"[{case}] data {cache}: {what}")
    errors = report["errors"].setdefault(case, {})
    counts: dict[str, int] = {}

    with contextlib.ExitStack() as stack:
        # Opened in order and closed in reverse: a transport forked later may hold
        # descriptors inherited from an earlier one, so it goes first.
        live: dict[str, Any] = {}
        for name in names:
            try:
                live[name] = stack.enter_context(_open(name, ds, workers, bs, seed, llc.bytes))
            except Exception as exc:  # noqa: BLE001 - reported; the others still run
                _fail(report, errors, case, name, "open", exc, out)
        for name, t in list(live.items()):
            try:
                if not isinstance(t, CopyLimit):
                    first = next(iter(t.epoch(warm[:1])))
                    _check_batch(name, first, reference)
                    del first
                _time_epoch(t, warm, expected=batches.expected(len(warm)))  # warm-up
                k = len(warm)
                while True:  # doubling calibration epochs until one lasts long enough
                    wall, _, _, _ = _time_epoch(t, batches.take(k), expected=batches.expected(k))
                    if wall >= _CALIBRATE_SECONDS or k >= _MAX_BATCHES:
                        break
                    k = min(_MAX_BATCHES, k * 2 if wall <= 0 else
                            max(2 * k, int(k * _CALIBRATE_SECONDS / wall * 1.2)))
                rate = k / wall
                counts[name] = int(min(_MAX_BATCHES, max(_MIN_BATCHES, math.ceil(rate * seconds))))
                batches.expected(counts[name])  # computed before any timed run
                report["calibration"].setdefault(case, {})[name] = dict(
                    batches=k, seconds=wall, batches_per_s=rate, run_batches=counts[name])
                if not quiet:
                    out.line(f"[{case}] {name}: warm, ~{_fmt_rate(rate)} batches/s, "
                             f"{counts[name]} batches per run")
            except Exception as exc:  # noqa: BLE001 - reported; the others still run
                _fail(report, errors, case, name, "warm-up", exc, out)
                live.pop(name).close()

        bracket = blocks if COPY_LIMIT in live and size in COPY_SHARE_SIZES else 0
        report["sizes"][case]["blocks"] = bracket
        # a transport's blocks are epochs of at least _MIN_BLOCK_BATCHES batches (torch's
        # large batches: one block), so that an epoch's start weighs little in each
        fewer = {name: max(1, n // _MIN_BLOCK_BATCHES) for name, n in counts.items()
                 if name not in LIMITS}
        report["sizes"][case]["blocks_of"] = {name: min(bracket, k) for name, k in fewer.items()}
        step_counts = {name: n if not bracket or name == COLLATE_LIMIT else
                       max(_MIN_BATCHES, math.ceil(n / min(bracket, fewer.get(name, bracket))))
                       for name, n in counts.items()}
        for rep in range(repeats):
            _repetition(rep, case, cache, live, report, errors, out, batches=batches, nbytes=nbytes,
                        counts=step_counts, bracket=bracket, fewer=fewer, repeats=repeats, quiet=quiet)
    if not errors:
        report["errors"].pop(case)


def _repetition(rep: int, case: str, cache: str, live: dict[str, Any], report: dict, errors: dict,
                out: _Out, *, batches: Batches, nbytes: int, counts: dict[str, int], bracket: int,
                fewer: dict[str, int], repeats: int, quiet: bool) -> None:
    """One repetition: the timed epochs of :func:`.transport_blocks.plan`, one record
    per transport (its blocks merged) appended to ``report["runs"]``."""
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    steps = plan(list(live), copy_limit=COPY_LIMIT, unbracketed=(COLLATE_LIMIT,), blocks=bracket, fewer=fewer)
    done: list[tuple[str, float | None]] = []
    recs: list[dict | None] = []
    failed: set[str] = set()
    for name in steps:
        t = live.get(name)
        if t is None:
            done.append((name, None))
            recs.append(None)
            continue
        gc.collect()
        n = counts[name]
        busy0, span0 = _busy_cpu(), time.perf_counter()
        try:
            wall, cpu, n, wcpu = _time_epoch(t, batches.take(n), expected=batches.expected(n), workers_cpu=True)
            busy1, span = _busy_cpu(), time.perf_counter() - span0
        except Exception as exc:  # noqa: BLE001 - reported; the others still run
            _fail(report, errors, case, name, f"repeat {rep}", exc, out)
            live.pop(name).close()
            failed.add(name)
            done.append((name, None))
            recs.append(None)
            continue
        bps = n / wall
        verdict = t.verdict() if isinstance(t, peers.Transport) else None
        rec: dict[str, Any] = dict(size=case, cache=cache, transport=name, repeat=rep, batches=n,
                                   seconds=wall, parent_cpu_s=cpu, workers_cpu_s=wcpu, batches_per_s=bps,
                                   gb_per_s=bps * nbytes / 1e9, verdict=verdict, load_avg=load,
                                   # CPU seconds of work outside this suite's processes meanwhile,
                                   # over span_s (copy-limit's `seconds` is its fastest method's)
                                   others_cpu_s=None if busy0 is None or busy1 is None or wcpu is None
                                   else max(0.0, busy1 - busy0 - cpu - wcpu), span_s=span)
        if isinstance(t, CopyLimit):
            rec["methods_batches_per_s"] = dict(t.last)
            rec["workers_cpu_s"] = None  # its processes' CPU is the copy, not a loader's
        done.append((name, bps))
        recs.append(rec)
    by_name: dict[str, list[dict]] = {}
    for i, got in enumerate(recs):
        if got is None or got["transport"] in failed:
            continue
        if bracket and got["transport"] not in LIMITS:
            got["copy_limit_batches_per_s"] = bracket_rate(done, i, COPY_LIMIT)
            got["copy_limit_around"] = bracket_values(done, i, COPY_LIMIT)
        by_name.setdefault(got["transport"], []).append(got)
    rates = []
    for name, rs in by_name.items():
        merged = merge(rs)
        report["runs"].append(merged)
        rates.append(f"{name} {_fmt_rate(merged['batches_per_s'])}" + _share_note(merged))
    others = [r for rs in by_name.values() for r in rs if r.get("others_cpu_s") is not None]
    if not quiet:
        busy = ("" if not others else f"; other work on the machine: "
                f"{sum(r['others_cpu_s'] for r in others) / sum(r['span_s'] for r in others):.2f} cores")
        out.line(f"[{case}] repeat {rep + 1}/{repeats}: " + ", ".join(rates) + " batches/s" + busy)


def _share_note(rec: dict) -> str:
    """A repetition line's share of copy-limit for one record: over its steady blocks
    when bracketed (``" (0.91 of copy-limit, 2 of 4 blocks steady)"``), else over the
    copy-limit around it; "" without a reference."""
    held = rec.get("steady")
    n = len(rec.get("blocks") or ())
    if held is not None:
        share = _steady_share(held)
        if share is None:
            return f" (no steady block of {n}: the bus changed level beside each)"
        return f" ({share:.2f} of copy-limit" + (f", {held['blocks']} of {n} blocks steady)" if held["blocks"] < n
                                                  else ")")
    around = rec.get("copy_limit_batches_per_s")
    return f" ({rec['batches_per_s'] / around:.2f} of copy-limit)" if around else ""


def _steady_share(held: dict) -> float | None:
    """A record's share of copy-limit over its steady blocks (its ``steady``:
    :func:`.transport_blocks.merge`); None when it had none."""
    return held["batches_per_s"] / held["copy_limit_batches_per_s"] if held["copy_limit_batches_per_s"] else None


def _paired(by: dict, case: str, name: str, ref: str) -> list[float]:
    """Per-repetition ratios of `name`'s rate over `ref`'s (repetitions where both ran).

    Over copy-limit, a record that ran bracketed is divided by the copy-limit measured
    around its own steady blocks (:func:`_paired_records`), not by the repetition's."""
    return [ratio for _, ratio in _paired_records(by, case, name, ref)]


def _paired_records(by: dict, case: str, name: str, ref: str) -> list[tuple[dict, float]]:
    """(:func:`_paired`) Each of `name`'s records with its ratio.  Over copy-limit, a
    bracketed record's ratio is taken over its steady blocks only (``steady``:
    :func:`.transport_blocks.merge`), and a repetition without one has none."""
    theirs = {r["repeat"]: r["batches_per_s"] for r in by.get((case, ref), [])}
    out = []
    for r in by.get((case, name), []):
        held = r.get("steady") if ref == COPY_LIMIT else None
        if held is not None:
            share = _steady_share(held)
            if share is not None:
                out.append((r, share))
            continue
        around = r.get("copy_limit_batches_per_s") if ref == COPY_LIMIT else None
        if around:
            out.append((r, r["batches_per_s"] / around))
        elif theirs.get(r["repeat"]):
            out.append((r, r["batches_per_s"] / theirs[r["repeat"]]))
    return out


def _below(by: dict, case: str, name: str, ref: str, minimum: float) -> list[dict]:
    """The repetitions where `name`'s ratio over `ref` fell below `minimum`, or (over
    copy-limit) had no steady block to take it from: ``repeat`` (counted from 0),
    ``value`` (None: no steady block), and over copy-limit, for a bracketed record,
    ``steady_blocks`` and ``blocks`` (how many of its blocks had copy-limit
    neighbours that agree, of how many) and ``copy_limit_range`` (the slowest and the
    fastest copy-limit block beside any of its blocks)."""
    got = {id(r): ratio for r, ratio in _paired_records(by, case, name, ref)}
    out = []
    for r in by.get((case, name), []):
        ratio = got.get(id(r))
        held = r.get("steady") if ref == COPY_LIMIT else None
        if ratio is None and held is None:
            continue   # (no reference in this repetition at all: not a repetition of the target)
        if ratio is not None and ratio >= minimum:
            continue
        entry: dict[str, Any] = dict(repeat=r["repeat"], value=ratio)
        if held is not None:
            entry.update(steady_blocks=held["blocks"], blocks=len(r.get("blocks") or ()),
                         copy_limit_range=r.get("copy_limit_range"))
        out.append(entry)
    return out


def _summarise(report: dict) -> None:
    by: dict[tuple[str, str], list[dict]] = {}
    for r in report["runs"]:
        by.setdefault((r["size"], r["transport"]), []).append(r)
    for (case, name), rs in by.items():
        bps = [r["batches_per_s"] for r in rs]
        gbs = [r["gb_per_s"] for r in rs]
        med = report["medians"].setdefault(case, {})[name] = dict(
            batches_per_s=_median(bps), gb_per_s=_median(gbs), min_batches_per_s=min(bps),
            max_batches_per_s=max(bps), parent_cpu_per_batch_s=_median(
                [r["parent_cpu_s"] / r["batches"] for r in rs]),
            workers_cpu_per_batch_s=_median(
                [r["workers_cpu_s"] / r["batches"] for r in rs if r["workers_cpu_s"] is not None]),
            repeats=len(rs), verdict=_most_common([r.get("verdict") for r in rs]),
            others_cores=_spread([r["others_cpu_s"] / r["span_s"] for r in rs
                                  if r.get("others_cpu_s") is not None and r.get("span_s")]))
        methods: dict[str, list[float]] = {}
        for r in rs:
            for method, rate in (r.get("methods_batches_per_s") or {}).items():
                methods.setdefault(method, []).append(rate)
        if methods:
            med["methods"] = {k: _spread(v) for k, v in methods.items()}
    cores = min(report["config"]["workers"], report["machine"].get("usable_cores") or 1)
    report["limit_cores"] = cores
    for case, meds in report["medians"].items():
        one_core = meds.get(COLLATE_LIMIT, {}).get("batches_per_s")
        for name, med in meds.items():
            # the share of what `cores` cores could collate (collate-limit's rate x cores)
            med["share_of_limit"] = (med["batches_per_s"] / (one_core * cores)
                                     if one_core and name not in LIMITS else None)
            size = report["sizes"].get(case, {}).get("size", case)
            med["share_of_copy_limit"] = (None if name in LIMITS or size not in COPY_SHARE_SIZES else
                                          _spread(_paired(by, case, name, COPY_LIMIT)))
            med["x_torch"] = (None if name in LIMITS or name == "torch" else
                              _spread(_paired(by, case, name, "torch")))
    for case, meds in report["medians"].items():
        if "mploader" not in meds:
            continue
        mine = meds["mploader"]["batches_per_s"]
        for name, med in meds.items():
            if name == "mploader":
                continue
            report["ratios"].setdefault(case, {})[name] = mine / med["batches_per_s"]
            paired = _paired(by, case, "mploader", name)
            if paired:
                report["paired_ratios"].setdefault(case, {})[name] = statistics.median(paired)
    for size, peer, minimum, strict in TARGETS:
        if size not in report["sizes"]:
            continue
        ratio = report["ratios"].get(size, {}).get(peer)
        met = None if ratio is None else (ratio > minimum if strict else ratio >= minimum)
        report["targets"].append(dict(size=size, peer=peer, minimum=minimum, strict=strict,
                                      ratio=ratio, met=met))
    for size, minimum in SHARE_TARGETS:
        for name in FACES:
            share = report["medians"].get(size, {}).get(name, {}).get("share_of_limit")
            if size in report["sizes"] and name in report["config"]["transports"]:
                report["share_targets"].append(dict(size=size, transport=name, minimum=minimum, share=share,
                                                    met=None if share is None else share >= minimum))
    for size, what, minimum in EVERY_RUN_TARGETS:
        key = "share_of_copy_limit" if what == COPY_LIMIT else "x_torch"
        for name in FACES:
            if size not in report["sizes"] or name not in report["config"]["transports"]:
                continue
            got = report["medians"].get(size, {}).get(name, {}).get(key)
            below = _below(by, size, name, what, minimum)   # (what: copy-limit or torch)
            report["every_run_targets"].append(dict(
                size=size, transport=name, what=what, minimum=minimum, value=got,
                met=None if got is None else got["min"] >= minimum and all(b["value"] is not None for b in below),
                below=below))


def main(argv: Sequence[str] | None = None, *, default_out: str | None = "bench/results") -> int:
    """Command line: ``python bench/transport.py [--repeats N] [--out DIR] ...``.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (default ``sys.argv[1:]``).
    default_out : str or None, optional
        JSON directory when ``--out`` is not given.

    Returns
    -------
    int
        Exit status: 0; 3 when a transport delivered a wrong batch; 1 when mploader
        could not be measured for some size.
    """
    p = argparse.ArgumentParser(prog="bench/transport.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--out", default=default_out, help=f"JSON directory (default {default_out})")
    p.add_argument("--no-json", action="store_true", help="write no JSON")
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                   help=f"target seconds per timed run (default {DEFAULT_SECONDS:g})")
    p.add_argument("--workers", type=int, default=2, help="workers per transport (default 2)")
    p.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS,
                   help="small and large: split each transport's run into N epochs, each between two "
                        f"copy-limit blocks (default {DEFAULT_BLOCKS}; 0: one whole run each)")
    p.add_argument("--sizes", default="tiny,small,large", help="comma-separated sizes")
    p.add_argument("--cache", default="cold", choices=("cold", "resident", "both"),
                   help="data not in the CPU cache (cold, default), cache-resident, or both")
    p.add_argument("--transports", default=None,
                   help="comma-separated transports (default: all available + copy-limit, collate-limit)")
    p.add_argument("--quiet", action="store_true", help="print only the final table")
    a = p.parse_args(argv)
    report = run(workers=a.workers, repeats=a.repeats, seconds=a.seconds,
                 transports=a.transports.split(",") if a.transports else None,
                 sizes=[s for s in a.sizes.split(",") if s], cache=a.cache,
                 out_dir=None if a.no_json else a.out, quiet=a.quiet, blocks=a.blocks)
    if report["mismatches"]:
        return 3
    if "mploader" in report["config"]["transports"] and any(
            "mploader" not in report["medians"].get(case, {}) for case in report["sizes"]):
        return 1
    return 0


if __name__ == "__main__":
    # The package's module, not this __main__ copy: the names imported below come from
    # modules that import mploader_bench.transport themselves.
    from mploader_bench import transport as _package_module

    sys.exit(_package_module.main())


# Split out to keep modules under ~600 lines; imported last (it uses this module's names).
from .machine import cpu_busy_percent, machine_info  # noqa: E402

# Split out to keep modules under ~600 lines; imported last (it uses this module's names).
from .transport_report import _fmt_rate, _Out, _print_report, _write_json  # noqa: E402
