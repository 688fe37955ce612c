"""Build tests/c/test_ring.c together with csrc/ring.c under ASan + UBSan and run it.

The C program is a standalone test of the slot protocol (see its header comment):
``phase=contract`` checks every edge's error returns, grow/ENOSPACE, reclaim after a
dead worker, populate, watch_parent, the waiter bit, shrink, header validation at
take, attach (magic/version) and the cached pid; ``phase=stress`` runs forked (or threaded)
workers against the parent through many batches and checks every header and
payload byte.  No Python extension is involved.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "c" / "test_ring.c", *(ROOT / "csrc" / f for f in ("ring.c", "region.c", "proc.c"))]
CFLAGS = [
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-g",
    "-O1",
    "-I" + str(ROOT / "csrc"),
]
SAN_ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=1:detect_leaks=1",
    "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=1:print_stacktrace=1",
}
RUN_TIMEOUT = 90  # seconds per run; each set below takes ~1-3 s on 2 cores

# (id, argv after the program name).  Positional: WORKERS BATCHES SEED.
RUNS = [
    ("contract", ["2", "0", "1", "phase=contract"]),
    # slots sized on first use: every slot starts at 0 bytes and is grown by workers
    ("fork-grow-from-0", ["3", "12000", "1", "phase=stress", "slots=4", "slot_bytes=0"]),
    # two slots, big enough for most batches: assignment blocks on leases a lot
    ("fork-2-slots", ["2", "8000", "2", "phase=stress", "slots=2", "slot_bytes=65536"]),
    # more slots and workers, bigger payloads, frequent forced grows
    ("fork-grow-heavy", ["4", "6000", "3", "phase=stress", "slots=8", "slot_bytes=4096",
                         "max_need=300000", "grow_pct=30"]),
    # workers as threads of the parent (same protocol, one process)
    ("threads", ["3", "12000", "4", "phase=stress", "mode=thread", "slots=3", "slot_bytes=0",
                 "grow_pct=25"]),
]


#: ThreadSanitizer runs (workers as threads: TSan sees threads, not processes).
TSAN_RUNS = [
    ("tsan-contract", ["2", "0", "1", "phase=contract"]),
    ("tsan-threads", ["3", "4000", "4", "phase=stress", "mode=thread", "slots=3", "slot_bytes=0", "grow_pct=25"]),
]
# die_after_fork=0: the contract phase forks from a thread and starts a thread in the
# child (watch_parent does that in every worker); TSan refuses it by default.
TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1:die_after_fork=0"}


@pytest.fixture(scope="module")
def ring_binary(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail(
            "gcc not found on PATH: tests/test_c_ring.py builds tests/c/test_ring.c with csrc/ring.c "
            "using gcc with -fsanitize=address,undefined (install gcc with libasan/libubsan)",
            pytrace=False,
        )
    for src in SOURCES:
        if not src.exists():
            pytest.fail(f"missing source {src}", pytrace=False)
    out = tmp_path_factory.mktemp("c_ring") / "test_ring"
    cmd = [gcc, *CFLAGS, "-pthread", *map(str, SOURCES), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"compiling the C ring test failed:\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}",
                    pytrace=False)
    return out


@pytest.mark.parametrize("argv", [r[1] for r in RUNS], ids=[r[0] for r in RUNS])
def test_c_ring(ring_binary: Path, argv: list[str]) -> None:
    env = dict(os.environ, **SAN_ENV)
    cmd = [str(ring_binary), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {RUN_TIMEOUT} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}",
                    pytrace=False)
    report = f"$ {' '.join(cmd)}\nexit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    workers, batches, seed = argv[:3]
    phase = next(a.split("=", 1)[1] for a in argv if a.startswith("phase="))
    summary = [line for line in proc.stdout.splitlines() if line.startswith("test_ring OK:")]
    assert len(summary) == 1, report
    assert re.search(rf"\bphase={phase}\b.*\bworkers={workers}\b.*\bbatches={batches}\b.*\bseed={seed}\b",
                     summary[0]), report
    assert "FAIL" not in proc.stderr and "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, report
    if phase == "stress":
        # the run really exercised grows, held leases and out-of-order releases
        stats = dict(kv.split("=", 1) for kv in summary[0].split(": ", 1)[1].split())
        assert int(stats["grows"]) > 0, report
        assert int(stats["out_of_order_releases"]) > 0, report
        assert int(stats["max_held"]) >= 2, report


@pytest.fixture(scope="module")
def tsan_binary(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found on PATH (needed for the ThreadSanitizer build)", pytrace=False)
    out = tmp_path_factory.mktemp("c_ring_tsan") / "test_ring_tsan"
    flags = [f for f in CFLAGS if not f.startswith("-fsanitize")] + ["-fsanitize=thread", "-pthread"]
    cmd = [gcc, *flags, *map(str, SOURCES), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "tsan" in proc.stderr:
        pytest.skip(f"this gcc cannot link ThreadSanitizer (libtsan missing): {proc.stderr.strip()[-200:]}")
    if proc.returncode != 0:
        pytest.fail(f"compiling the TSan build failed:\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}",
                    pytrace=False)
    return out


@pytest.mark.parametrize("argv", [r[1] for r in TSAN_RUNS], ids=[r[0] for r in TSAN_RUNS])
def test_c_ring_tsan(tsan_binary: Path, argv: list[str]) -> None:
    """The same protocol under ThreadSanitizer: no data race, no lock-order problem."""
    env = dict(os.environ, **TSAN_ENV)
    cmd = [str(tsan_binary), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {RUN_TIMEOUT} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}",
                    pytrace=False)
    report = f"$ {' '.join(cmd)}\nexit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    if "unexpected memory mapping" in proc.stderr:  # TSan vs. high-entropy ASLR on some kernels
        pytest.skip(f"ThreadSanitizer cannot run on this kernel's address layout:\n{proc.stderr[-300:]}")
    assert proc.returncode == 0, report
    assert "ThreadSanitizer" not in proc.stderr and "FAIL" not in proc.stderr, report
    assert sum(line.startswith("test_ring OK:") for line in proc.stdout.splitlines()) == 1, report
