"""The ``mploader`` command line (also ``python -m mploader``).

One sub-command, ``bench``: the benchmark harness, a separate package
(``mploader_bench``, in the source tree's ``bench/``).  It is imported only when
``mploader bench`` runs, so ``import mploader`` and ``mploader --help`` load
nothing of it (nor torch, scikit-image or matplotlib).

Exit status: 0 on success, 2 for a bad argument (one line on stderr naming it),
1 when the harness is not installed or fails, 3 when transports delivered
different batches (see ``mploader bench --help``).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from ._version import __version__

__all__ = ["main", "build_parser"]

PROG = "mploader"
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

#: Printed when ``mploader bench`` cannot import the harness.
NOT_INSTALLED = (
    "the benchmark harness (package mploader_bench) is not installed: in a source "
    "checkout run `make bench`, or `pip install -c constraints.txt -e ./bench`")


class UsageError(Exception):
    """A bad command-line argument; the message names it."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors raised as :class:`UsageError` (no usage dump, no exit)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser of the ``mploader`` command (``--help``, ``--version``).

    The ``bench`` sub-command's own arguments belong to the harness
    (``mploader_bench.cli.build_parser``): :func:`main` hands everything after
    ``bench`` to it.

    Returns
    -------
    argparse.ArgumentParser
    """
    parser = _Parser(prog=PROG, description="mploader: shared-memory ring data loader.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("bench", add_help=False,
                   help="benchmark mploader against pickle transport and PyTorch "
                        "(`mploader bench --help` for its options)")
    return parser


def _bench(argv: list[str]) -> int:
    try:
        from mploader_bench import cli as bench_cli
    except ModuleNotFoundError as exc:
        if exc.name not in ("mploader_bench", "mploader_bench.cli"):
            raise
        print(f"{PROG} bench: error: {NOT_INSTALLED}", file=sys.stderr)
        return EXIT_ERROR
    return int(bench_cli.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mploader`` command.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status: 0 success, 1 error, 2 bad argument, 3 batches differ
        (``bench`` only).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    raise AssertionError(f"unhandled command {args.command!r}")  # pragma: no cover
