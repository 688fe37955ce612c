#!/bin/sh
# Install one release artefact into a fresh venv and run tests/release/smoke.py with it.
#   fresh_venv.sh sdist PYTHON dist/mploader-<v>.tar.gz   compiles, as a user's pip would:
#                                                       without -Werror (MPLOADER_WERROR unset)
#   fresh_venv.sh wheel PYTHON dist/mploader-<v>-...manylinux....whl
#                                                       with no C compiler on PATH: only the
#                                                       venv's bin/ is on PATH, binaries only
set -eu
kind=$1 python=$2 artefact=$3
root=$(pwd)
venv=$root/build/release-$kind
rm -rf "$venv"
"$python" -m venv "$venv"
case $kind in
  sdist)
    env -u MPLOADER_WERROR "$venv/bin/python" -m pip install -q "$artefact"
    ;;
  wheel)
    for compiler in gcc cc clang; do
      if PATH="$venv/bin" command -v "$compiler" >/dev/null 2>&1; then
        echo "a C compiler ($compiler) is still on PATH=$venv/bin"; exit 1
      fi
    done
    PATH="$venv/bin" CC=false "$venv/bin/python" -m pip install -q --only-binary=:all: "$root/$artefact"
    ;;
  *) echo "usage: fresh_venv.sh sdist|wheel PYTHON ARTEFACT"; exit 2 ;;
esac
cd "$venv"
PATH="$venv/bin" MPLOADER_CHECKOUT="$root" "$venv/bin/python" "$root/tests/release/smoke.py"
