# make test  : venv in .venv, install mploader with its test extras (compiles the C core), run pytest
# make bench : venv in .venv, install mploader with its bench extras, run `mploader bench`
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test bench venv install-test install-bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

install-test: $(PY)
	$(PY) -m pip install -e '.[test]'

install-bench: $(PY)
	$(PY) -m pip install -e '.[bench]'

test: install-test
	$(PY) -m pytest tests

bench: install-bench
	$(VENV)/bin/mploader bench

clean:
	rm -rf build $(VENV) *.egg-info mploader/_ring.c mploader/*.so tests/c/test_ring
