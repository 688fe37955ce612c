"""``mploader bench``: the benchmark's command line (also ``python -m mploader_bench``).

``mploader bench ARGS`` (the library's :mod:`mploader.cli`) imports this module
only when the ``bench`` sub-command runs and hands it ``ARGS``.  It runs the
images benchmark (an ImageNet-style training input pipeline on real
photographs, :mod:`mploader_bench.images`) and/or the synthetic transport
benchmark (:mod:`mploader_bench.transport`), prints a table per suite and
writes JSON (and a PNG chart) to ``--out``.

Exit status: 0 on success, 2 for a bad argument (one line on stderr naming the
argument), 3 when transports delivered different batches, 1 for other errors.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["main", "build_parser"]

PROG = "mploader bench"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH = 0, 1, 2, 3
DEFAULT_OUT = os.path.join("bench", "results")


class UsageError(Exception):
    """A bad command-line argument; the message names it."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors raised as :class:`UsageError` (no usage dump, no exit)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be >= 1")
        return value
    parse.__name__ = name
    return parse


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a non-negative integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be >= 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a finite number > 0")
    return value


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mploader bench``.

    Returns
    -------
    argparse.ArgumentParser
        Parses the arguments that follow ``mploader bench``; a bad one raises
        :class:`UsageError` naming it.
    """
    from . import images

    b = _Parser(
        prog=PROG,
        description=("Benchmark an image-training input pipeline on real photographs "
                     "(suite 'images') and/or synthetic batches (suite 'transport') across "
                     "transports: mploader (shared-memory ring), pickle (multiprocessing.Pool), "
                     "torch (torch.utils.data.DataLoader), inline (no worker). Prints a table, "
                     "writes JSON and a PNG chart to --out."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--data", metavar="DIR", default=None,
                   help="ImageFolder (one subfolder per class of JPEG/PNG files); default: "
                        "photographs from scikit-image, built once into the cache directory")
    b.add_argument("--format", default="jpeg,raw", metavar="jpeg|raw",
                   help="image format(s), comma-separated: jpeg (decode each file) and/or raw "
                        "(pre-decoded 256x256x3 uint8 .npy)")
    b.add_argument("--suite", default="images", choices=("images", "transport", "startup", "all"),
                   help="which benchmark to run ('all': images and transport; 'startup': time to the first "
                        "batch and workers' memory under fork/forkserver/spawn, mploader.torch against torch)")
    b.add_argument("--workers", type=_positive_int("workers"), default=_cpu_count(),
                   metavar="N", help="worker processes per transport (default: CPU count)")
    b.add_argument("--batch-size", type=_positive_int("batch size"), default=256, metavar="B",
                   help="images per batch")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--batches", type=_positive_int("batches"), default=None, metavar="N",
                   help="batches per timed run (default: from --seconds)")
    g.add_argument("--seconds", type=_positive_float, default=None, metavar="S",
                   help=f"target seconds per timed run (default {images.DEFAULT_SECONDS:g} for "
                        f"images, the transport suite's own default otherwise)")
    b.add_argument("--repeats", type=_positive_int("repeats"), default=images.DEFAULT_REPEATS,
                   metavar="R", help="repetitions; each runs every transport once, same order")
    b.add_argument("--transports", default=None, metavar="LIST",
                   help="comma-separated transports (default: mploader,pickle,torch,inline, "
                        "those available)")
    b.add_argument("--cache", default="cold", choices=("cold", "resident", "both"),
                   help="transport suite: data not in the CPU cache (cold: a pool of at least 4 x "
                        "the last-level cache), cache-resident (4 distinct samples; rows named "
                        "'<size>-resident'), or both in one run")
    b.add_argument("--sizes", default="tiny,small,large", metavar="LIST",
                   help="transport suite: comma-separated sizes (tiny, small, large)")
    b.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help="directory for the JSON report and PNG chart")
    b.add_argument("--seed", type=_nonneg_int, default=0, help="seed of batch order and augmentation")
    b.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where generated data is kept (default: $MPLOADER_CACHE_DIR, else "
                        "~/.cache/mploader)")
    b.add_argument("--images", type=_positive_int("images"), default=None, metavar="N",
                   help="number of images of the default data (default 2000)")
    b.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return b


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the bench arguments beyond argparse; raise UsageError naming the argument."""
    from . import data, images

    formats = _split(args.format)
    if args.format.strip() == "all":
        formats = list(images.FORMATS)
    bad = [f for f in formats if f not in images.FORMATS]
    if not formats or bad:
        raise UsageError(f"argument --format: invalid value {args.format!r}: expected jpeg, raw "
                         f"or jpeg,raw")
    formats = [f for f in images.FORMATS if f in formats]

    folder = None
    if args.data is not None and args.suite in ("images", "all"):
        try:
            folder = data.scan_imagefolder(args.data, what="folder")
        except data.DataError as exc:
            raise UsageError(f"argument --data: {exc}") from None
    if args.images is not None and args.data is not None:
        raise UsageError("argument --images: only applies to the default data, not with --data")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"argument --out: {args.out!r} exists and is not a directory")
    if args.cache_dir is not None:
        cd = os.path.abspath(os.path.expanduser(args.cache_dir))
        if os.path.exists(cd) and not os.path.isdir(cd):
            raise UsageError(f"argument --cache-dir: {args.cache_dir!r} exists and is not a "
                             f"directory")
    from . import peers

    if args.transports is None:
        transports = peers.available_transports("images")
    else:
        names = ", ".join(peers.transport_names())
        transports = list(dict.fromkeys(_split(args.transports)))
        if not transports:
            raise UsageError(f"argument --transports: invalid value {args.transports!r}: "
                             f"expected a comma-separated list of {names}")
        for t in transports:
            if t in ("collate-limit", "copy-limit") and args.suite in ("transport", "all"):
                continue  # the transport suite's in-process reference (always measured there)
            if t not in peers.transport_names():
                raise UsageError(f"argument --transports: unknown transport {t!r}: expected "
                                 f"some of {names}")
            missing = peers.missing_requirements(t)
            if missing:
                raise UsageError(f"argument --transports: transport {t!r} is not available here "
                                 f"(cannot import {', '.join(missing)}; `make bench` installs "
                                 f"the harness's dependencies)")

    from . import synthetic

    sizes = list(dict.fromkeys(_split(args.sizes)))
    bad = [x for x in sizes if x not in synthetic.SIZES]
    if not sizes or bad:
        raise UsageError(f"argument --sizes: invalid value {args.sizes!r}: expected a comma-separated "
                         f"list of {', '.join(synthetic.SIZES)}")

    return {"formats": formats, "transports": transports, "folder": folder, "out": out, "sizes": sizes}


def _bench(args: argparse.Namespace) -> int:
    r = _resolve(args)
    from . import data, images

    console = images._console()
    progress = not args.no_progress
    status = EXIT_OK
    if args.suite in ("images", "all"):
        cfg = images.ImagesConfig(
            data=r["folder"].root if r["folder"] is not None else None,
            formats=r["formats"], transports=[t for t in r["transports"] if t != "collate-limit"],
            workers=args.workers,
            batch_size=args.batch_size, batches=args.batches,
            seconds=args.seconds if args.seconds is not None else images.DEFAULT_SECONDS,
            repeats=args.repeats, seed=args.seed,
            cache_dir=os.path.abspath(os.path.expanduser(args.cache_dir)) if args.cache_dir else None,
            count=args.images if args.images is not None else data.DEFAULT_COUNT,
            progress=progress)
        try:
            images.run(cfg, console=console, out_dir=r["out"])
        except images.VerificationError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_MISMATCH
        except data.DataError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
    if args.suite == "startup":
        from . import startup

        startup.run(repeats=args.repeats, out_dir=r["out"])
    if args.suite in ("transport", "all"):
        from . import transport

        kw: dict[str, Any] = {}
        if args.seconds is not None:
            kw["seconds"] = args.seconds
        names = r["transports"] if args.transports is not None else None
        report = transport.run(workers=args.workers, repeats=args.repeats, transports=names,
                               sizes=r["sizes"], cache=args.cache, out_dir=r["out"], console=console,
                               seed=args.seed, **kw)
        if report.get("mismatches"):
            print(f"{PROG}: error: wrong batches: " + "; ".join(
                f"[{m['size']}] {m['error']}" for m in report["mismatches"]), file=sys.stderr)
            status = EXIT_MISMATCH
        elif report.get("errors"):
            status = EXIT_ERROR
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mploader bench``.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``mploader bench`` (default ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status: 0 success, 1 error, 2 bad argument (one line on stderr
        naming it), 3 batches differ.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        return _bench(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
