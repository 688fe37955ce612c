"""Which worker builds a batch: torch's round robin against the engine's least-loaded
pick, in the transport suite's ``large`` case (issue 24).

Usage: ``PYTHONPATH=.:bench python bench/torch_assignment_ab.py [transport suite options]``
(e.g. ``--sizes large --repeats 5 --cache cold --no-json``; unless ``--transports``
is given: ``mploader``, ``mploader.torch``, ``mploader.torch-seed``, ``copy-limit``).

``mploader.torch`` gives batch ``i`` to the worker torch's ``_try_put_index`` names
(round robin with ``in_order=True``: ``i % num_workers``), as torch 2.13 does, so that
each worker's random stream sees torch's batches (docs/faces.md).  The Gluon face
(``mploader``) lets the engine give each task to the worker with the least work left
(``Dispatch._pick_worker``), and so does the torch face with ``seed=``
(``mploader.torch-seed``), where a batch does not depend on the worker that builds
it.  Everything else -- the suite's cold pool, the bracketing by copy-limit blocks,
the checks of every batch -- is the transport suite's (:mod:`mploader_bench.transport`).
Results: docs/bench-log.md, "Seventh session: the torch face's round robin on two
cores" and "Ninth session: the torch face's worker assignment under seed=" (in the
first, ``mploader.torch-free`` was the same pick made by a patch in the benchmark's
process).
"""
from __future__ import annotations

import sys

from mploader_bench import transport


def main(argv: list[str]) -> int:
    args = list(argv)
    if "--transports" not in args:
        args += ["--transports", "mploader,mploader.torch,mploader.torch-seed,copy-limit"]
    return transport.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
