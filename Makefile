# make test  : venv in .venv, install mploader with its test extras (compiles the C core)
#              and the benchmark harness (bench/), versions pinned by constraints.txt; run pytest
# make bench : venv in .venv, install mploader and the harness, run `mploader bench`
#              (BENCH_ARGS="--suite transport --repeats 1" and the like pass options through)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_INSTALL := $(PY) -m pip install -c constraints.txt
BENCH_ARGS ?=

.PHONY: test bench venv install-test install-bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

install-test: $(PY)
	$(PIP_INSTALL) -e '.[test]' -e ./bench

install-bench: $(PY)
	$(PIP_INSTALL) -e . -e ./bench

test: install-test
	$(PY) -m pytest tests

bench: install-bench
	$(VENV)/bin/mploader bench $(BENCH_ARGS)

clean:
	rm -rf build bench/build $(VENV) *.egg-info bench/*.egg-info mploader/_ring.c mploader/*.so tests/c/test_ring
