#!/bin/sh
# The core suite (no torch) on another CPython, with mploader installed from the sdist:
#   matrix.sh PYTHON NUMPY_REQUIREMENT dist/mploader-<v>.tar.gz
# The tests run from a copy of tests/ (and of what they read from the checkout: csrc/ for
# the C core's own test, pyproject.toml for the pytest configuration, the docs and
# top-level files some tests check) outside the source tree, so the installed package
# is the one imported.  Tests that need torch skip.
set -eu
python=$1 numpy_req=$2 sdist=$3
root=$(pwd)
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=$root/build/matrix-$version
work=$root/build/matrix-$version-tests
rm -rf "$venv" "$work"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$numpy_req" "$sdist[testcore]"
mkdir -p "$work"
if [ -n "${MATRIX_FROM_HEAD:-}" ]; then  # the committed tests only (a checkout with work in progress)
  git -C "$root" archive HEAD tests csrc docs bench pyproject.toml README.md CHANGELOG.md Makefile constraints.txt \
    | tar -x -C "$work"
else
  cp -r "$root/tests" "$root/csrc" "$root/docs" "$root/bench" "$root/pyproject.toml" "$root/README.md" \
    "$root/CHANGELOG.md" "$root/Makefile" "$root/constraints.txt" "$work/"
fi
rm -rf "$work/tests/release"
cd "$work"
"$venv/bin/python" -c 'import mploader, numpy, sys; print("matrix:", sys.version.split()[0], "numpy", numpy.__version__, mploader.__file__)'
"$venv/bin/python" -m pytest tests -q -p no:cacheprovider -m "not timing and not source_tree"
