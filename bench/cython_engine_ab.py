"""Would compiling the engine's Python modules with Cython shorten the epoch boundary?
(issue 27)

Usage (repository root, extensions built, Cython installed):
``python bench/cython_engine_ab.py [--rounds N] [--modes spin,sleep]``

Copies ``mploader/`` to a temporary directory and compiles there, unchanged, the pure
Python modules on the staged epoch boundary's path (``MODULES``: the scheduler, the
checkpoint state, dispatch, receive, run, engine, the Gluon face, its samplers, the
channel and the metrics) into extension modules with ``cythonize`` (an extension is
found before a ``.py`` of the same name).  Then runs ``bench/epoch_boundary_footprint.py``
against the tree as it is and against the compiled copy, alternating, ``--rounds``
times per mode, each run in a fresh process, and prints each run's medians (µs) of
``iter()`` + the first ``next()`` and of a steady ``next()``, and the median ratio
compiled / as is.  Nothing in the repository is changed.  Results: docs/bench-log.md,
"Sixteenth session: the engine compiled with Cython".
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The pure Python modules on the staged boundary's path (bench/epoch_boundary_breakdown.py).
MODULES = ["_scheduler", "_state", "_dispatch", "_receive", "_run", "_engine", "dataloader", "sampler",
           "_channel", "_metrics"]

_BUILD = """\
import sys
from Cython.Build import cythonize
from setuptools import Extension, setup
mods = sys.argv[1:]
sys.argv[1:] = ["build_ext", "--inplace", "-t", "build-tmp"]
setup(ext_modules=cythonize([Extension(f"mploader.{m}", [f"mploader/{m}.py"]) for m in mods],
                            language_level=3, quiet=True))
"""

_LINE = re.compile(r"iter\(\)\+first next\(\) ([\d.]+) us .* steady next\(\) ([\d.]+) us")


def build(dest: Path) -> None:
    shutil.copytree(ROOT / "mploader", dest / "mploader", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "build_hot.py").write_text(_BUILD)
    subprocess.run([sys.executable, "build_hot.py", *MODULES], cwd=dest, check=True, capture_output=True)
    missing = [m for m in MODULES if not list((dest / "mploader").glob(f"{m}.*.so"))]
    if missing:
        raise SystemExit(f"not compiled: {missing}")


def footprint(tree: Path, mode: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "epoch_boundary_footprint.py"), mode],
                         cwd=tree, env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    m = _LINE.search(out)
    if m is None:
        raise SystemExit(f"unexpected output: {out!r}")
    return float(m.group(1)), float(m.group(2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="spin,sleep")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mploader-cy-") as tmp:
        compiled = Path(tmp)
        build(compiled)
        for mode in args.modes.split(","):
            ratios = []
            for r in range(args.rounds):
                plain = footprint(ROOT, mode)
                comp = footprint(compiled, mode)
                ratios.append(comp[0] / plain[0])
                print(f"{mode} round {r + 1}: boundary {plain[0]:.1f} as is / {comp[0]:.1f} compiled us, "
                      f"steady next() {plain[1]:.1f} / {comp[1]:.1f} us", flush=True)
            print(f"{mode}: boundary compiled / as is, median {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
