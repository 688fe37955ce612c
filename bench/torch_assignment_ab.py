"""Which worker builds a batch: torch's round robin against the engine's least-loaded
pick, in the transport suite's ``large`` case (issue 24).

Usage: ``PYTHONPATH=.:bench python bench/torch_assignment_ab.py [transport suite options]``
(e.g. ``--sizes large --repeats 5 --cache cold --no-json``; the transports are fixed:
``mploader``, ``mploader.torch``, ``mploader.torch-free``, ``copy-limit``).

``mploader.torch`` gives batch ``i`` to the worker torch's ``_try_put_index`` names
(round robin with ``in_order=True``: ``i % num_workers``), as torch 2.13 does, so that
each worker's random stream sees torch's batches (docs/faces.md).  The Gluon face
(``mploader``) lets the engine give each task to the worker with the least work left
(``Dispatch._pick_worker``).  ``mploader.torch-free`` is the torch face with that
pinning dropped for this experiment only: the worker of each task the face's
``_Dispatch`` yields is replaced by None while its epochs run (a patch in this
process; the library's files are not changed, and its checkpoint bookkeeping, which
this breaks, is not used here).  Everything else -- the suite's cold pool, the
bracketing by copy-limit blocks, the checks of every batch -- is the transport
suite's (:mod:`mploader_bench.transport`).  Results: docs/bench-log.md, "Seventh
session: the torch face's round robin on two cores".
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import mploader.torch as mploader_torch
from mploader_bench import peers, peers_torch, transport

_FREE = [False]   # True while mploader.torch-free iterates
_tasks = mploader_torch._Dispatch.tasks


def _unpinned_tasks(self: Any, epoch: int, pairs: Any, iterable: bool) -> Iterator[tuple]:
    for task in _tasks(self, epoch, pairs, iterable):
        yield task[:3] + (None,) if _FREE[0] else task


class _MPLTorchFree(peers_torch._MPLTorch):
    """``mploader.torch`` with the engine's least-loaded pick instead of torch's round robin."""

    name = "mploader.torch-free"
    suites = ()

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:
        _FREE[0] = True
        try:
            yield from super()._epoch(batches)
        finally:
            _FREE[0] = False


def main(argv: list[str]) -> int:
    mploader_torch._Dispatch.tasks = _unpinned_tasks
    peers.register(_MPLTorchFree)
    args = list(argv)
    if "--transports" not in args:
        args += ["--transports", "mploader,mploader.torch,mploader.torch-free,copy-limit"]
    return transport.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
