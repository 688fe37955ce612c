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

The transports are those of :mod:`mploader_bench.peers` (``mploader``,
``pickle``, ``queue``, ``torch`` when installed; ``inline`` on request), all
with the same number of workers, plus ``collate-limit``: the calling process
alone stacks each batch's samples with :func:`numpy.stack` into a pre-allocated,
pre-faulted output buffer (labels, being numbers, are assigned element-wise).
That is the physical reference: the single-core cost of the one copy that any
loader has to make.

Method
------
Per size, every transport is opened once and warmed up (one short epoch, then
epochs of doubling length until one lasts 0.1 s, which estimates its rate).
Each transport then gets a fixed number of batches per run, about `seconds`
worth at that rate, so every timed run is a whole epoch (no in-flight work
spills into the next transport's run).  For each repetition the transports run
in the same order, one after the other; the reported rate is the median over
repetitions, and the ratio of mploader to a peer is the ratio of their
medians (the median of the per-repetition ratios is in the JSON too).  The
consumer does nothing with a batch but drop it.  GB/s is decimal (1e9 bytes
per second) of collated payload.

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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import peers

__all__ = ["SIZES", "TARGETS", "REFERENCE", "CollateLimit", "SyntheticDataset",
           "make_dataset", "run", "main"]

SUITE = "transport"
SCHEMA_VERSION = 1

#: The synthetic datasets: batch size, sample layout, dataset length.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=32, shape=(16,), dtype="float32", label_first=True, length=1 << 16),
    "small": dict(batch_size=256, shape=(32, 32, 3), dtype="uint8", label_first=False, length=1 << 16),
    "large": dict(batch_size=256, shape=(224, 224, 3), dtype="uint8", label_first=False, length=1 << 14),
}

#: Targets for mploader, as (size, peer, minimum ratio, strict): mploader's
#: median rate divided by the peer's must be >= (or > when strict) the minimum.
TARGETS: tuple[tuple[str, str, float, bool], ...] = (
    ("large", "torch", 4.0, False),
    ("small", "torch", 3.0, False),
    ("tiny", "torch", 10.0, False),
    ("tiny", "queue", 2.5, False),
)

#: Issue 13's targets for mploader's rows: (size, minimum share of the collate limit).
SHARE_TARGETS: tuple[tuple[str, float], ...] = (("tiny", 0.5), ("small", 0.7), ("large", 0.71))

#: Peers' rates (batches per second) measured earlier on the 2-core development
#: machine with 2 workers; shown beside this run's numbers to spot drift.
REFERENCE: dict[str, dict[str, float]] = {
    "large": {"pickle": 6, "torch": 42, "collate-limit": 296},
    "small": {"pickle": 270, "torch": 565, "collate-limit": 6200},
    "tiny": {"pickle": 3400, "queue": 7500, "torch": 620},
}

COLLATE_LIMIT = "collate-limit"
DEFAULT_SECONDS = 1.0

_CALIBRATE_SECONDS = 0.1
_MIN_BATCHES = 10
_MAX_BATCHES = 500_000


# --------------------------------------------------------------------------
# datasets


class SyntheticDataset:
    """A dataset whose samples are pre-built arrays: indexing costs ~nothing.

    Parameters
    ----------
    shape : tuple of int
        Shape of the array field of each sample.
    dtype : str or numpy.dtype
        Its dtype.
    length : int
        ``len()`` of the dataset.
    label_first : bool, optional
        Samples are ``(label, array)`` instead of ``(array, label)``.
    distinct : int, optional
        Number of distinct pre-built arrays; sample ``i`` returns array
        ``i % distinct`` and the pre-built label ``np.int64(i % 1024)`` (few
        label objects, so that fetching stays cache-resident and cheap).
    """

    def __init__(self, shape: Sequence[int], dtype: Any, length: int, *,
                 label_first: bool = False, distinct: int = 4) -> None:
        rng = np.random.default_rng(1234)
        dtype = np.dtype(dtype)
        self.length = int(length)
        self.label_first = bool(label_first)
        if dtype.kind == "f":
            arrays = [rng.random(shape, dtype=dtype) for _ in range(distinct)]
        else:
            arrays = [rng.integers(0, 255, size=shape, dtype=dtype) for _ in range(distinct)]
        self._arrays = arrays
        self._labels = [np.int64(i) for i in range(min(self.length, 1024))]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple:
        x = self._arrays[i % len(self._arrays)]
        y = self._labels[i % len(self._labels)]
        return (y, x) if self.label_first else (x, y)


def make_dataset(size: str) -> SyntheticDataset:
    """The synthetic dataset of one of :data:`SIZES`.

    Parameters
    ----------
    size : str
        ``"tiny"``, ``"small"`` or ``"large"``.

    Returns
    -------
    SyntheticDataset
    """
    spec = SIZES[size]
    return SyntheticDataset(spec["shape"], spec["dtype"], spec["length"],
                            label_first=spec["label_first"])


def _describe_sample(size: str) -> str:
    spec = SIZES[size]
    arr = f"{spec['dtype']} {tuple(spec['shape'])}"
    return f"(np.int64, {arr})" if spec["label_first"] else f"({arr}, np.int64)"


# --------------------------------------------------------------------------
# the physical reference


class CollateLimit:
    """Single-process :func:`numpy.stack` into pre-allocated, pre-faulted buffers.

    Same ``epoch``/``close`` interface as :class:`mploader_bench.peers.Transport`,
    so it runs in the same loop.  The batch size and sample structure are taken
    from the first batch; the output buffers are written once up front, so no
    page fault is counted.

    Parameters
    ----------
    dataset : object
        Map-style dataset whose samples are arrays, numbers or tuples of those.
    max_batch : int
        Largest batch size to allocate for.
    """

    name = COLLATE_LIMIT

    def __init__(self, dataset: Any, max_batch: int) -> None:
        self.dataset = dataset
        first = dataset[0]
        self._tuple = isinstance(first, (tuple, list))
        fields = list(first) if self._tuple else [first]
        self._bufs = []
        self._stack = []  # per field: np.stack (arrays) or element-wise assignment (numbers)
        for f in fields:
            a = np.asarray(f)
            buf = np.empty((max_batch,) + a.shape, dtype=a.dtype)
            buf.fill(1)  # fault every page in now
            self._bufs.append(buf)
            self._stack.append(isinstance(f, np.ndarray) and f.ndim > 0)

    def epoch(self, batches: Sequence[Sequence[int]]) -> Iterator[Any]:
        """Collate each batch into the buffers; yields the buffers' views.

        Array fields are stacked with ``np.stack(..., out=buffer)``; number
        fields are assigned element-wise (as ``np.asarray`` would collate them).

        Parameters
        ----------
        batches : list of list of int
            Indices of each batch.

        Yields
        ------
        tuple of numpy.ndarray or numpy.ndarray
            Views of the output buffers (overwritten by the next batch).
        """
        ds = self.dataset
        fields = list(zip(range(len(self._bufs)), self._bufs, self._stack))
        for indices in batches:
            samples = [ds[i] for i in indices]
            n = len(samples)
            if not self._tuple:
                samples = [(s,) for s in samples]
            out = []
            for k, buf, stack in fields:
                view = buf[:n]
                column = [s[k] for s in samples]
                if stack:
                    np.stack(column, out=view)
                else:
                    view[...] = column
                out.append(view)
            yield tuple(out) if self._tuple else out[0]

    def close(self) -> None:
        """Nothing to stop; present for the common interface."""

    def __enter__(self) -> CollateLimit:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------
# machine description


class _Batches:
    """Prefixes of one growing random batch list (same indices for every transport)."""

    def __init__(self, length: int, batch_size: int, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._length = length
        self._bs = batch_size
        self._list: list[list[int]] = []

    def take(self, n: int) -> list[list[int]]:
        if n > len(self._list):
            more = max(n - len(self._list), len(self._list))
            self._list.extend(self._rng.integers(0, self._length, size=(more, self._bs)).tolist())
        return self._list[:n]


def _children_cpu() -> tuple[list, float]:
    """This process's descendants and their summed user+system CPU seconds."""
    try:
        import psutil
    except ImportError:
        return [], float("nan")
    kids = psutil.Process().children(recursive=True)
    return kids, _cpu_of(kids)


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


def _time_epoch(t: Any, batches: list[list[int]], *, workers_cpu: bool = False
                ) -> tuple[float, float, int, float | None]:
    """Consume one epoch.

    Returns
    -------
    tuple
        (wall seconds, parent CPU seconds, batches, worker CPU seconds or None);
        the worker CPU is the summed CPU of all descendant processes, measured
        only when `workers_cpu` is true.
    """
    kids, k0 = _children_cpu() if workers_cpu else ([], 0.0)
    c0 = time.process_time()
    t0 = time.perf_counter()
    count = sum(1 for _ in t.epoch(batches))  # holds no batch past its turn
    t1 = time.perf_counter()
    c1 = time.process_time()
    wcpu = _cpu_of(kids) - k0 if workers_cpu else None
    if wcpu is not None and math.isnan(wcpu):
        wcpu = None
    if count != len(batches):
        raise RuntimeError(f"{t.name}: got {count} batches, expected {len(batches)}")
    return t1 - t0, c1 - c0, count, wcpu


def _check_batch(name: str, batch: Any, want: Any) -> None:
    got = batch if isinstance(batch, tuple) else (batch,)
    want = want if isinstance(want, tuple) else (want,)
    if len(got) != len(want) or any(
            np.asarray(g).shape != w.shape or np.asarray(g).dtype != w.dtype
            or not np.array_equal(g, w) for g, w in zip(got, want)):
        raise RuntimeError(f"{name}: first batch differs from the inline reference")


def _open(name: str, ds: Any, workers: int, batch_size: int, seed: int) -> Any:
    if name == COLLATE_LIMIT:
        return CollateLimit(ds, batch_size)
    return peers.open_transport(name, ds, workers=workers, seed=seed)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _bound_by(verdict: str | None) -> str:
    """A table cell for a verdict: "input", "compute", "transport", "unknown" or ""."""
    return "" if verdict is None else verdict.replace("-bound", "")


def _most_common(xs: Sequence[str | None]) -> str | None:
    """The most frequent of the values that are not None (the first on a tie)."""
    counts = collections.Counter(x for x in xs if x is not None)
    return counts.most_common(1)[0][0] if counts else None


def run(*, workers: int = 2, repeats: int = 5, seconds: float = DEFAULT_SECONDS,
        transports: Sequence[str] | None = None,
        sizes: Sequence[str] = ("tiny", "small", "large"),
        out_dir: str | os.PathLike | None = None, console: Any = None,
        seed: int = 0, quiet: bool = False) -> dict[str, Any]:
    """Run the transport benchmark and report it.

    Parameters
    ----------
    workers : int, optional
        Worker processes of every multi-process transport.
    repeats : int, optional
        Repetitions; each runs every transport once, in the same order.
    seconds : float, optional
        Target duration of one timed run, in seconds (the batch count per run is
        fixed per transport from its warm-up rate, at least 10 batches).
    transports : sequence of str, optional
        Names from :func:`mploader_bench.peers.transport_names` and/or
        ``"collate-limit"``.  Default: the ``transport`` suite's transports
        available here (mploader, pickle, queue, torch if importable), then
        collate-limit.
    sizes : sequence of str, optional
        Keys of :data:`SIZES`.
    out_dir : path, optional
        Directory for the JSON report (created if needed); None writes none.
    console : rich.console.Console, optional
        Where to print; default a new rich console, or plain ``print``
        without rich.
    seed : int, optional
        Seed of the batch indices (and mploader's ``seed``).
    quiet : bool, optional
        Print only the final tables.

    Returns
    -------
    dict
        The report: ``config``, ``machine``, ``sizes`` (per-size description),
        ``runs`` (one record per repetition and transport: batches, seconds,
        batches_per_s, gb_per_s, parent_cpu_s), ``medians``, ``ratios``
        (mploader's median rate over each peer's), ``paired_ratios`` (median of
        per-repetition ratios), ``targets``, ``reference``, ``errors`` and,
        when written, ``json_path``.
    """
    out = _Out(console)
    available = set(peers.available_transports()) | {COLLATE_LIMIT}
    if transports is None:
        names = [*peers.available_transports("transport"), COLLATE_LIMIT]
    else:
        # collate-limit is always measured: every row's share of the limit needs it
        names = list(dict.fromkeys([*transports, COLLATE_LIMIT]))
        known = [*peers.transport_names(), COLLATE_LIMIT]
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
        raise ValueError("repeats must be >= 1")

    started = time.time()
    report: dict[str, Any] = {
        "suite": SUITE,
        "schema": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": dict(workers=workers, repeats=repeats, seconds=seconds,
                       transports=names, sizes=sizes, seed=seed),
        "machine": machine_info(with_torch="torch" in names),
        "sizes": {},
        "runs": [],
        "calibration": {},
        "medians": {},
        "ratios": {},
        "paired_ratios": {},
        "targets": [],
        "share_targets": [],
        "reference": REFERENCE,
        "errors": {},
    }
    m = report["machine"]
    if not quiet:
        out.line(f"transport benchmark: {m['cpu_model']}, {m['usable_cores']} usable cores, "
                 f"python {m['python']}, numpy {m['numpy']}, torch {m['torch']}; "
                 f"workers={workers}, repeats={repeats}, ~{seconds:g} s per run")
    busy = m["cpu_busy_before_pct"] = cpu_busy_percent(1.0)
    if busy is not None and busy > 20:
        out.line(f"note: the CPUs were {busy:.0f}% busy just before the run; other work on the "
                 "machine will depress and scatter the rates")

    for size in sizes:
        _run_size(size, names, report, out, workers=workers, repeats=repeats,
                  seconds=seconds, seed=seed, quiet=quiet)

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


def _run_size(size: str, names: list[str], report: dict, out: _Out, *, workers: int,
              repeats: int, seconds: float, seed: int, quiet: bool) -> None:
    spec = SIZES[size]
    bs = spec["batch_size"]
    ds = make_dataset(size)
    batches = _Batches(len(ds), bs, seed)
    warm = batches.take(max(8, 2 * workers + 2))
    with peers.open_transport("inline", ds, workers=0) as ref:
        reference = next(iter(ref.epoch(warm[:1])))
    nbytes = int(sum(a.nbytes for a in (reference if isinstance(reference, tuple) else (reference,))))
    report["sizes"][size] = dict(batch_size=bs, sample=_describe_sample(size),
                                 bytes_per_batch=nbytes, dataset_length=len(ds))
    errors = report["errors"].setdefault(size, {})
    counts: dict[str, int] = {}

    with contextlib.ExitStack() as stack:
        # Opened in order and closed in reverse: a transport forked later may hold
        # descriptors inherited from an earlier one, so it goes first.
        live: dict[str, Any] = {}
        for name in names:
            try:
                live[name] = stack.enter_context(_open(name, ds, workers, bs, seed))
            except Exception as exc:  # noqa: BLE001 - reported; the others still run
                errors[name] = f"open: {type(exc).__name__}: {exc}"
                out.line(f"[{size}] {name}: cannot open ({errors[name]})")
        for name, t in list(live.items()):
            try:
                first = next(iter(t.epoch(warm[:1])))
                _check_batch(name, first, reference)
                del first
                _time_epoch(t, warm)  # warm-up
                k = len(warm)
                while True:  # doubling calibration epochs until one lasts long enough
                    wall, _, _, _ = _time_epoch(t, batches.take(k))
                    if wall >= _CALIBRATE_SECONDS or k >= _MAX_BATCHES:
                        break
                    k = min(_MAX_BATCHES, k * 2 if wall <= 0 else
                            max(2 * k, int(k * _CALIBRATE_SECONDS / wall * 1.2)))
                rate = k / wall
                counts[name] = int(min(_MAX_BATCHES, max(_MIN_BATCHES, math.ceil(rate * seconds))))
                report["calibration"].setdefault(size, {})[name] = dict(
                    batches=k, seconds=wall, batches_per_s=rate, run_batches=counts[name])
                if not quiet:
                    out.line(f"[{size}] {name}: warm, ~{_fmt_rate(rate)} batches/s, "
                             f"{counts[name]} batches per run")
            except Exception as exc:  # noqa: BLE001 - reported; the others still run
                errors[name] = f"warm-up: {type(exc).__name__}: {exc}"
                out.line(f"[{size}] {name}: failed in warm-up ({errors[name]})")
                live.pop(name).close()

        for rep in range(repeats):
            rates = []
            for name, t in list(live.items()):
                gc.collect()
                try:
                    wall, cpu, n, wcpu = _time_epoch(t, batches.take(counts[name]), workers_cpu=True)
                except Exception as exc:  # noqa: BLE001 - reported; the others still run
                    errors[name] = f"repeat {rep}: {type(exc).__name__}: {exc}"
                    out.line(f"[{size}] {name}: failed ({errors[name]})")
                    live.pop(name).close()
                    continue
                bps = n / wall
                verdict = t.verdict() if isinstance(t, peers.Transport) else None
                report["runs"].append(dict(size=size, transport=name, repeat=rep, batches=n,
                                           seconds=wall, parent_cpu_s=cpu, workers_cpu_s=wcpu,
                                           batches_per_s=bps, gb_per_s=bps * nbytes / 1e9,
                                           verdict=verdict))
                rates.append(f"{name} {_fmt_rate(bps)}")
            if not quiet:
                out.line(f"[{size}] repeat {rep + 1}/{repeats}: " + ", ".join(rates) + " batches/s")
    if not errors:
        report["errors"].pop(size)


def _summarise(report: dict) -> None:
    by: dict[tuple[str, str], list[dict]] = {}
    for r in report["runs"]:
        by.setdefault((r["size"], r["transport"]), []).append(r)
    for (size, name), rs in by.items():
        bps = [r["batches_per_s"] for r in rs]
        gbs = [r["gb_per_s"] for r in rs]
        report["medians"].setdefault(size, {})[name] = dict(
            batches_per_s=_median(bps), gb_per_s=_median(gbs), min_batches_per_s=min(bps),
            max_batches_per_s=max(bps), parent_cpu_per_batch_s=_median(
                [r["parent_cpu_s"] / r["batches"] for r in rs]),
            workers_cpu_per_batch_s=_median(
                [r["workers_cpu_s"] / r["batches"] for r in rs if r["workers_cpu_s"] is not None]),
            repeats=len(rs), verdict=_most_common([r.get("verdict") for r in rs]))
    cores = min(report["config"]["workers"], report["machine"].get("usable_cores") or 1)
    report["limit_cores"] = cores
    for meds in report["medians"].values():
        one_core = meds.get(COLLATE_LIMIT, {}).get("batches_per_s")
        for name, med in meds.items():
            # the share of what `cores` cores could collate (collate-limit's rate x cores)
            med["share_of_limit"] = (med["batches_per_s"] / (one_core * cores)
                                     if one_core and name != COLLATE_LIMIT else None)
    for size, meds in report["medians"].items():
        if "mploader" not in meds:
            continue
        mine = meds["mploader"]["batches_per_s"]
        mine_runs = {r["repeat"]: r["batches_per_s"] for r in by[(size, "mploader")]}
        for name, med in meds.items():
            if name == "mploader":
                continue
            report["ratios"].setdefault(size, {})[name] = mine / med["batches_per_s"]
            paired = [mine_runs[r["repeat"]] / r["batches_per_s"]
                      for r in by[(size, name)] if r["repeat"] in mine_runs]
            if paired:
                report["paired_ratios"].setdefault(size, {})[name] = statistics.median(paired)
    for size, peer, minimum, strict in TARGETS:
        if size not in report["sizes"]:
            continue
        ratio = report["ratios"].get(size, {}).get(peer)
        met = None if ratio is None else (ratio > minimum if strict else ratio >= minimum)
        report["targets"].append(dict(size=size, peer=peer, minimum=minimum, strict=strict,
                                      ratio=ratio, met=met))
    for size, minimum in SHARE_TARGETS:
        for name in ("mploader", "mploader.torch"):
            share = report["medians"].get(size, {}).get(name, {}).get("share_of_limit")
            if size in report["sizes"] and name in report["config"]["transports"]:
                report["share_targets"].append(dict(size=size, transport=name, minimum=minimum, share=share,
                                                    met=None if share is None else share >= minimum))


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
        Exit status: 0, or 1 when mploader could not be measured for some size.
    """
    p = argparse.ArgumentParser(prog="bench/transport.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--out", default=default_out, help=f"JSON directory (default {default_out})")
    p.add_argument("--no-json", action="store_true", help="write no JSON")
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                   help=f"target seconds per timed run (default {DEFAULT_SECONDS:g})")
    p.add_argument("--workers", type=int, default=2, help="workers per transport (default 2)")
    p.add_argument("--sizes", default="tiny,small,large", help="comma-separated sizes")
    p.add_argument("--transports", default=None,
                   help="comma-separated transports (default: all available + collate-limit)")
    p.add_argument("--quiet", action="store_true", help="print only the final table")
    a = p.parse_args(argv)
    report = run(workers=a.workers, repeats=a.repeats, seconds=a.seconds,
                 transports=a.transports.split(",") if a.transports else None,
                 sizes=[s for s in a.sizes.split(",") if s],
                 out_dir=None if a.no_json else a.out, quiet=a.quiet)
    if "mploader" in report["config"]["transports"] and any(
            "mploader" not in report["medians"].get(s, {}) for s in report["config"]["sizes"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


# Split out to keep modules under ~600 lines; imported last (it uses this module's names).
from .machine import cpu_busy_percent, machine_info  # noqa: E402

# Split out to keep modules under ~600 lines; imported last (it uses this module's names).
from .transport_report import _fmt_rate, _Out, _print_report, _write_json  # noqa: E402
