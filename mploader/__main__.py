"""``python -m mploader bench``: the same as the ``mploader`` console script."""
import sys

from mploader.cli import main

if __name__ == "__main__":
    sys.exit(main())
