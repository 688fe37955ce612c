"""Synthetic transport benchmark: mploader against pickle, queue and torch loaders.

Usage: ``python bench/transport.py [--repeats N] [--out DIR] [--seconds S]``
(``--help`` for the rest).  The work is done by :mod:`mploader._bench.transport`;
the JSON report goes to ``bench/results/`` unless ``--out`` says otherwise.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a source checkout without installing

from mploader._bench.transport import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_out=str(ROOT / "bench" / "results")))
