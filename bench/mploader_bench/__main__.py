"""``python -m mploader_bench ARGS``: the same as ``mploader bench ARGS``."""
import sys

from mploader_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
