"""The images benchmark: an ImageNet-style training input pipeline on real photographs.

Every transport of :mod:`mploader_bench.peers` (``mploader``, ``pickle``,
``torch``, ``inline``) runs the same datasets of :mod:`mploader_bench.pipeline`
over the same batches, with the same number of workers:

``jpeg``
    JPEG/PNG files decoded with Pillow, RandomResizedCrop to 224, flip.
``raw``
    The same images pre-decoded to ``(N, 256, 256, 3)`` uint8 in one
    memory-mapped ``.npy``: crop, nearest-neighbour resize and flip only, so
    that moving the batch dominates.

Method
------
Per format the batch list is fixed once: the first ``N`` batches of an endless
stream of shuffled passes over the images (pass ``p`` indexes images
``p * n .. p * n + n - 1`` so each pass gets new augmentations).  ``N`` comes
from ``--batches`` or from ``--seconds``: the ``inline`` transport runs a few
batches to calibrate the single-core rate ``r1`` and a run gets
``seconds * r1 * workers`` images, a multiple of ``workers`` batches; ``inline``
itself runs the prefix worth ``seconds`` at ``r1``.  Each transport is opened
once per format and warmed up with ``2 * workers`` batches; then, for each
repetition, the transports run one after the other in the same order (a timed
run is one whole epoch, so no work spills into the next transport's run).

The consumer takes each batch with ``next()`` (the time spent there is the
*wait*), checks shapes and dtypes (``(B, 224, 224, 3)`` uint8, ``(B,)`` int64),
touches it as a training step's host side would (float32 mean of channel 0,
normalised with ImageNet's mean and std: it reads every page of the batch) and
computes a checksum of the image bytes and the labels (:func:`batch_checksum`:
xxh3-64 when the ``xxhash`` package is installed, else CRC-32).  The checksums of every
batch must agree across transports and repetitions, else :class:`VerificationError`.

Metrics of a run (the table shows medians over repetitions):

* images/s and MB/s (1e6 bytes of collated images and labels per second);
* wait %: time the consumer spent inside ``next()``, as % of the run's wall time;
* wait ms/batch: the same time per batch, in milliseconds (the stall a training
  step sees; unlike wait %, it does not grow with the consumer's share of a
  faster run);
* CPU s / 1k img: user + system CPU seconds of the parent and of this
  transport's worker processes (psutil) during the run, per 1,000 images;
* peak PSS: largest sum of the proportional set size of the parent and the
  transport's workers, sampled every 0.5 s in a background thread (MB = 1e6 B); the CPU time of
  that thread is subtracted from the parent's;
* x pickle, x torch: ratios of median images/s;
* scaling: images/s / (workers x inline images/s).

Each run also records ``other_cpu_pct``: the CPU that other processes on the
machine took during the run (system-wide busy time minus this tree's), as % of
all cores; a table whose runs saw more than 10 % says so under it.
"""
from __future__ import annotations

import collections
import datetime as _dt
import math
import os
import statistics
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import data as _data
from . import peers
from . import pipeline as _pipeline

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_SECONDS",
    "FORMATS",
    "ImagesConfig",
    "VerificationError",
    "batch_checksum",
    "consume",
    "plot_png",
    "print_tables",
    "run",
    "write_json",
]

SUITE = "images"
SCHEMA_VERSION = 1
#: The formats, in report order.
FORMATS = ("jpeg", "raw")
#: Default target duration of one timed run of a worker transport, in seconds.
DEFAULT_SECONDS = 5.0
#: Default number of repetitions.
DEFAULT_REPEATS = 5
#: ImageNet's mean and std of the red channel (0-255 scale), used by the consumer.
_MEAN_R, _STD_R = 123.675, 58.395
_PSS_INTERVAL = 0.5
_MAX_BATCHES = 100_000

#: Targets of the issue, as (format, peer, minimum ratio of mploader's images/s).
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("raw", "pickle", 3.0),
    ("raw", "torch", 1.5),
    ("jpeg", "pickle", 1.0),
    ("jpeg", "torch", 1.0),
)


class VerificationError(RuntimeError):
    """A transport delivered a batch that differs from the reference.

    Attributes
    ----------
    results : dict
        The report so far (with ``verification`` filled in).
    """

    def __init__(self, message: str, results: dict | None = None) -> None:
        super().__init__(message)
        self.results = results


@dataclass
class ImagesConfig:
    """Settings of one images benchmark.

    Attributes
    ----------
    data : str or None
        ImageFolder to use; None builds/uses the default photo folder.
    formats : list of str
        Subset of :data:`FORMATS`.
    transports : list of str
        Names from :func:`mploader_bench.peers.transport_names` (default: those of
        the ``images`` suite available here, in registration order).
    workers : int
        Worker processes of every multi-process transport, >= 1.
    batch_size : int
        Images per batch, >= 1.
    batches : int or None
        Batches per timed run (every transport); None: from `seconds`.
    seconds : float
        Target duration of a timed run when `batches` is None, in seconds.
    repeats : int
        Repetitions, >= 1.
    seed : int
        Seed of the batch order, the augmentation and the default data.
    cache_dir : str or None
        Cache directory (default :func:`mploader_bench.data.default_cache_dir`).
    count : int
        Number of images of the default data.
    prefetch : int or None
        Batches in flight per transport (None: each transport's default).
    progress : bool
        Show tqdm progress bars.
    """

    data: str | None = None
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    transports: list[str] = field(default_factory=lambda: peers.available_transports("images"))
    workers: int = 2
    batch_size: int = 256
    batches: int | None = None
    seconds: float = DEFAULT_SECONDS
    repeats: int = DEFAULT_REPEATS
    seed: int = 0
    cache_dir: str | None = None
    count: int = _data.DEFAULT_COUNT
    prefetch: int | None = None
    progress: bool = True


# --------------------------------------------------------------------------
# the consumer


_xxhash: Any
try:  # ~35 GB/s against zlib's ~4: the checksum is the bench's, not the pipeline's, work
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - optional
    _xxhash = None

#: Name of the checksum :func:`batch_checksum` computes.
CHECKSUM = "xxh3_64" if _xxhash is not None else "crc32"


def batch_checksum(images: np.ndarray, labels: np.ndarray) -> int:
    """Checksum of a batch: the image bytes (C order), then the label bytes.

    xxh3-64 (``xxhash`` package) when installed, else zlib's CRC-32; the name
    is :data:`CHECKSUM`.  It costs the consumer about 1 ms (xxh3) or 9 ms
    (CRC-32) per 38.5 MB batch on the 2-core development machine.

    Parameters
    ----------
    images : numpy.ndarray
        ``(B, H, W, 3)`` uint8.
    labels : numpy.ndarray
        ``(B,)`` int64.

    Returns
    -------
    int
        Unsigned 64-bit (xxh3) or 32-bit (CRC-32) checksum.
    """
    images = np.ascontiguousarray(images)
    labels = np.ascontiguousarray(labels)
    if _xxhash is not None:
        h = _xxhash.xxh3_64()
        h.update(images.data)  # .data: the array's buffer (a memoryview), not a copy
        h.update(labels.data)
        return h.intdigest()
    return zlib.crc32(labels.data, zlib.crc32(images.data))


def consume(batch: Any, batch_size: int, size: int = _pipeline.OUTPUT_SIZE) -> tuple[int, float, str | None]:
    """What the benchmark's training loop does with one batch.

    Checks the layout, touches the batch (float32 mean of channel 0,
    normalised with ImageNet's mean and std: reads every page of the batch) and
    checksums it.

    Parameters
    ----------
    batch : tuple
        ``(images, labels)``: ``(B, size, size, 3)`` uint8 and ``(B,)`` int64.
    batch_size : int
        Expected ``B``.
    size : int, optional
        Expected image side.

    Returns
    -------
    (int, float, str or None)
        The checksum (:func:`batch_checksum`), the normalised channel mean, and
        a description of what is wrong with the layout (None when right).
    """
    try:
        images, labels = batch
    except (TypeError, ValueError):
        return 0, 0.0, f"expected (images, labels), got {type(batch).__name__}"
    images = np.asarray(images)
    labels = np.asarray(labels)
    problem = None
    if images.shape != (batch_size, size, size, 3) or images.dtype != np.uint8:
        problem = (f"images {images.shape} {images.dtype}, expected "
                   f"({batch_size}, {size}, {size}, 3) uint8")
    elif labels.shape != (batch_size,) or labels.dtype != np.int64:
        problem = f"labels {labels.shape} {labels.dtype}, expected ({batch_size},) int64"
    if images.ndim == 4 and images.shape[-1] >= 1 and images.size:
        mean = (float(images[..., 0].mean(dtype=np.float32)) - _MEAN_R) / _STD_R
    else:
        mean = 0.0
    return batch_checksum(images, labels), mean, problem


# --------------------------------------------------------------------------
# batches


def make_batches(n: int, batch_size: int, count: int, seed: int) -> list[list[int]]:
    """The first `count` batches of the endless shuffled stream over `n` images.

    Pass ``p`` is a permutation of ``range(n)`` from
    ``default_rng([seed, 0x5EED, p])``, offset by ``p * n`` (so the dataset
    sees epoch ``p``); the passes are concatenated and cut into batches.

    Parameters
    ----------
    n : int
        Number of images.
    batch_size : int
        Indices per batch.
    count : int
        Number of batches.
    seed : int
        Seed of the order.

    Returns
    -------
    list of list of int
        `count` batches of `batch_size` indices; a prefix of the list for a
        larger `count`.
    """
    total = batch_size * count
    passes = -(-total // n)
    order = np.concatenate([p * n + np.random.default_rng([seed, 0x5EED, p]).permutation(n)
                            for p in range(passes)])[:total]
    return order.reshape(count, batch_size).tolist()


# --------------------------------------------------------------------------
# process-tree measurements


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # pragma: no cover
        return os.cpu_count() or 1


def _median(xs: Sequence[float | None]) -> float | None:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else None


def _run_format(fmt: str, folder: _data.ImageFolder, cfg: ImagesConfig, tree: _Tree,
                log: Callable[[str], None]) -> dict:
    B, W = cfg.batch_size, cfg.workers
    ncpu = _usable_cores()
    image_bytes = _pipeline.OUTPUT_SIZE * _pipeline.OUTPUT_SIZE * 3 + 8
    verifier = _Verifier(fmt)
    names = list(cfg.transports)

    # Fix the number of batches: --batches, or calibrate inline's single-core rate.
    n_batches_max = _MAX_BATCHES
    epochs_max = -(-n_batches_max * B // len(folder))
    ds = _open_dataset(fmt, folder, cfg, epochs_max, log)
    calib: dict[str, Any] = {}
    if cfg.batches is not None:
        n_batches = n_inline = cfg.batches
    else:
        with peers.open_transport("inline", ds, workers=0, seed=cfg.seed) as t:
            done, spent = 0, 0.0
            target = min(1.0, cfg.seconds / 4)
            while done < 2 or spent < target:
                k = done
                wall, _ = _run_epoch(t, make_batches(len(folder), B, k + 1, cfg.seed)[k:], k,
                                     verifier, "inline (calibration)", B, None)
                if k > 0:  # the first batch warms caches
                    spent += wall
                done += 1
                if done >= 64:
                    break
        r1 = (done - 1) * B / spent if spent > 0 else 1.0
        per_worker = max(1, math.ceil(cfg.seconds * r1 / B))
        n_batches = min(_MAX_BATCHES, per_worker * W)
        n_inline = min(n_batches, max(1, math.ceil(cfg.seconds * r1 / B)))
        calib = {"inline_images_per_s": r1, "batches": done}
    batches = make_batches(len(folder), B, n_batches, cfg.seed)
    # Warm-up: the prefetch depth (2 x workers by default) of every transport,
    # so that forks, imports, allocator growth and first page faults are not timed.
    warm = batches[:max(1, min(2 * W, n_batches))]

    fmt_report: dict[str, Any] = {
        "batches_per_run": n_batches, "batches_per_run_inline": n_inline, "warmup_batches": len(warm),
        "images_per_run": n_batches * B, "calibration": calib, "transports": {},
    }
    opened: dict[str, Any] = {}
    pids: dict[str, set[int]] = {}
    total_ticks = cfg.repeats * sum(n_inline if n == "inline" else n_batches for n in names)
    bar = _data._tqdm(total=total_ticks, desc=f"{fmt}", unit="batch", disable=not cfg.progress)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for name in names:
            before = tree.children()
            bar.set_description_str(f"{fmt}: starting {name}")
            workers = 0 if name == "inline" else W
            opened[name] = peers.open_transport(name, ds, workers=workers, seed=cfg.seed,
                                                prefetch=cfg.prefetch)
            if name != "inline":
                _run_epoch(opened[name], warm, 0, verifier, f"{name} (warm-up)", B, None)
            pids[name] = tree.children() - before
            if verifier.problems:
                break
        for rep in range(cfg.repeats):
            if verifier.problems:
                break
            for name in names:
                nb = n_inline if name == "inline" else n_batches
                bar.set_description_str(f"{fmt}: {name} {rep + 1}/{cfg.repeats}")
                tree.track(pids[name])
                cpu0, busy0 = tree.cpu(), tree.system_busy()
                sampler = _PssSampler(tree)
                sampler.start()
                wall, wait = _run_epoch(opened[name], batches[:nb], 0, verifier,
                                        f"{name} (repetition {rep + 1})", B, bar.update)
                verdict = opened[name].verdict()
                peak = sampler.stop()
                cpu1, busy1 = tree.cpu(), tree.system_busy()
                images = nb * B
                cpu_s = other_pct = None
                if cpu0 is not None and cpu1 is not None:
                    tree_s = sum(v - cpu0.get(pid, 0.0) for pid, v in cpu1.items())
                    cpu_s = max(0.0, tree_s - sampler.cpu_s)
                    if busy0 is not None and busy1 is not None:
                        # CPU that other processes on the machine took during the run.
                        other_pct = max(0.0, 100.0 * (busy1 - busy0 - tree_s) / (wall * ncpu))
                runs[name].append({
                    "repetition": rep + 1, "batches": nb, "images": images, "wall_s": wall,
                    "wait_s": wait, "images_per_s": images / wall,
                    "mb_per_s": images * image_bytes / wall / 1e6,
                    "wait_pct": 100.0 * wait / wall,
                    "wait_ms_per_batch": 1000.0 * wait / nb,
                    "cpu_s": cpu_s,
                    "cpu_s_per_1k_images": None if cpu_s is None else 1000.0 * cpu_s / images,
                    "peak_pss_mb": None if peak is None else peak / 1e6,
                    "processes": 1 + len(pids[name]),
                    "other_cpu_pct": other_pct,
                    "verdict": verdict,
                })
                if verifier.problems:
                    break
    finally:
        bar.close()
        for t in opened.values():
            try:
                t.close()
            except Exception:  # noqa: BLE001 - close the others; the run's own error propagates
                pass

    metrics = ("images_per_s", "mb_per_s", "wait_pct", "wait_ms_per_batch",
               "cpu_s_per_1k_images", "peak_pss_mb")
    for name in names:
        med: dict[str, Any] = {m: _median([r[m] for r in runs[name]]) for m in metrics}
        verdicts = collections.Counter(r["verdict"] for r in runs[name] if r.get("verdict"))
        med["verdict"] = verdicts.most_common(1)[0][0] if verdicts else None
        fmt_report["transports"][name] = {"runs": runs[name], "median": med}
    _add_ratios(fmt_report, W)
    others = [r["other_cpu_pct"] for rs in runs.values() for r in rs if r["other_cpu_pct"] is not None]
    fmt_report["other_cpu_pct_max"] = max(others) if others else None
    fmt_report["verification"] = {
        "batches_checked": len(verifier.ref),
        "ok": not verifier.problems,
        "problems": verifier.problems[:50],
        "checksums": [f"{verifier.ref[k][0]:08x}" for k in sorted(verifier.ref)][:n_batches],
    }
    return fmt_report


def _add_ratios(fmt_report: dict, workers: int) -> None:
    ts = fmt_report["transports"]

    def rate(name: str) -> float | None:
        return ts.get(name, {}).get("median", {}).get("images_per_s")

    inline, pickle, torch = rate("inline"), rate("pickle"), rate("torch")
    for name, rec in ts.items():
        r = rate(name)
        rec["x_pickle"] = r / pickle if r and pickle else None
        rec["x_torch"] = r / torch if r and torch else None
        rec["scaling_efficiency"] = (r / (workers * inline)
                                     if r and inline and name != "inline" else None)


def _targets(report: dict) -> list[dict]:
    """The issue targets, checked for each of mploader's transports in the run
    (``mploader``, and ``mploader.torch``: issue 10 states the same targets for the
    PyTorch face); each entry names its ``transport``."""
    out = []
    for fmt, peer, want in TARGETS:
        ts = report["formats"].get(fmt, {}).get("transports", {})
        for name in ("mploader", "mploader.torch"):
            if name not in ts or peer not in ts:
                continue
            got = ts[name][f"x_{peer}"]
            out.append({"format": fmt, "transport": name, "peer": peer, "metric": "images/s ratio",
                        "target": want, "measured": got, "met": got is not None and got >= want})
            if fmt == "jpeg":
                m, p = ts[name]["median"], ts[peer]["median"]
                for metric, label in (("cpu_s_per_1k_images", "CPU s / 1k images"),
                                      ("wait_pct", "consumer wait %"),
                                      ("wait_ms_per_batch", "consumer wait ms/batch")):
                    if m[metric] is not None and p[metric] is not None:
                        out.append({"format": fmt, "transport": name, "peer": peer,
                                    "metric": f"{label} lower", "target": p[metric],
                                    "measured": m[metric], "met": m[metric] < p[metric]})
    return out


def run(cfg: ImagesConfig, *, console: Any = None, out_dir: str | os.PathLike | None = None,
        log: Callable[[str], None] | None = None) -> dict:
    """Run the images benchmark, print its tables, write JSON and PNG.

    Parameters
    ----------
    cfg : ImagesConfig
        What to run.
    console : rich.console.Console, optional
        Where to print the tables (default a new console on stdout).
    out_dir : path, optional
        Directory for ``images-<time>.json``, ``images-latest.json``,
        ``images-<time>.png`` and ``images-latest.png``; None writes nothing.
    log : callable, optional
        Called with progress lines (default: print to the console).

    Returns
    -------
    dict
        The report: ``config``, ``machine``, ``decoder``, ``data``,
        ``formats`` (per format: ``batches_per_run``, ``transports`` with
        ``runs``, ``median``, ``x_pickle``, ``x_torch``,
        ``scaling_efficiency``; ``verification``), ``targets`` and, when
        written, ``json_path`` and ``png_path``.

    Raises
    ------
    mploader_bench.data.DataError
        If the data cannot be built or read.
    VerificationError
        If any batch differs between transports or repetitions (after the JSON
        is written); ``.results`` holds the report.
    """
    from .transport import machine_info

    console = console if console is not None else _console()
    if log is None:
        def log(line: str) -> None:
            _print(console, line)

    started = _dt.datetime.now(_dt.timezone.utc)
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = None
    if cfg.data is None:
        root = _data.ensure_default_data(cfg.cache_dir, count=cfg.count, seed=cfg.seed,
                                         progress=cfg.progress, log=log)
    else:
        root = cfg.data
    folder = _data.scan_imagefolder(root, what="argument --data: folder")
    decoder = _pipeline.decoder_info()
    report: dict[str, Any] = {
        "suite": SUITE,
        "schema_version": SCHEMA_VERSION,
        "started_utc": started.isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "machine": machine_info(with_torch="torch" in cfg.transports),
        "decoder": decoder,
        "data": {"root": folder.root, "images": len(folder), "classes": len(folder.classes),
                 "file_bytes": folder.bytes, "default": cfg.data is None},
        "pipeline": {"output": [_pipeline.OUTPUT_SIZE, _pipeline.OUTPUT_SIZE, 3],
                     "scale": list(_pipeline.SCALE), "ratio": list(_pipeline.RATIO),
                     "jpeg_resample": "bilinear (Pillow, antialiased)",
                     "raw_resample": "nearest (gather)", "raw_size": _data.RAW_SIZE,
                     "flip_p": 0.5, "consumer": "float32 mean of channel 0, normalised; "
                                                f"{CHECKSUM} of images + labels"},
                     "checksum": CHECKSUM,
        "formats": {},
    }
    log(f"images benchmark: {len(folder)} images in {len(folder.classes)} classes from "
        f"{folder.root}; decoder Pillow {decoder['version']} (libjpeg {decoder['libjpeg']}"
        f"{', turbo' if decoder['libjpeg_turbo'] else ''}); {cfg.workers} workers, batch "
        f"{cfg.batch_size}, transports {', '.join(cfg.transports)}")
    # torch's default collate warns (once per worker) that the samples, read-only
    # views of Pillow images, are not writable; it only reads them.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    report["load_average_before"] = load
    cores = _usable_cores()
    if load is not None and load > 0.5:
        log(f"note: load average {load:.2f} on {cores} cores before the run; other work on the "
            f"machine depresses and scatters the rates")
    tree = _Tree()
    problems: list[str] = []
    for fmt in cfg.formats:
        fr = _run_format(fmt, folder, cfg, tree, log)
        report["formats"][fmt] = fr
        problems += fr["verification"]["problems"]
        if problems:
            break
    report["targets"] = _targets(report)
    report["verification"] = {"ok": not problems, "problems": problems[:50]}
    report["finished_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    print_tables(report, console)
    if out_dir is not None:
        stamp = started.astimezone().strftime("%Y%m%d-%H%M%S")
        report["json_path"] = str(write_json(report, Path(out_dir), stamp))
        png = plot_png(report, Path(out_dir), stamp)
        if png is not None:
            report["png_path"] = str(png)
            write_json(report, Path(out_dir), stamp)
        log(f"wrote {report['json_path']}" + (f" and {png}" if png else ""))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise VerificationError(f"batches differ between transports: {problems[0]}{more}", report)
    return report


# --------------------------------------------------------------------------
# output


# Split out to keep modules under ~600 lines; imported last (they use this module's names).
from .images_measure import _open_dataset, _PssSampler, _run_epoch, _Tree, _Verifier  # noqa: E402
from .images_report import _console, _print, plot_png, print_tables, write_json  # noqa: E402
