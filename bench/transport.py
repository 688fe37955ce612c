"""Synthetic transport benchmark: mploader against pickle, queue and torch loaders.

Usage: ``python bench/transport.py [--repeats N] [--out DIR] [--seconds S]``
(``--help`` for the rest).  The work is done by :mod:`mploader_bench.transport`
(this folder is on ``sys.path`` when the script runs); the JSON report goes to
``bench/results/`` unless ``--out`` says otherwise.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _main() -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # mploader from a source checkout without installing
    from mploader_bench.transport import main

    return main(default_out=str(ROOT / "bench" / "results"))


if __name__ == "__main__":
    sys.exit(_main())
