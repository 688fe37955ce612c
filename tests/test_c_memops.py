"""Build tests/c/test_memops.c with csrc/memops.c under ASan + UBSan and run it.

The C program (see its header comment) checks ``mpl_stream_copy`` against ``memcpy``
byte for byte, guard bytes included, for every misalignment of either pointer and
lengths around each branch of the copy; and ``mpl_madvise_dofork``: a range marked
MADV_DONTFORK is inherited by a forked child after the call, and its documented
failures (EINVAL, ENOMEM) return -1 with that errno.  No Python extension is involved.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "c" / "test_memops.c", ROOT / "csrc" / "memops.c"]
CFLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
          "-g", "-O1", "-I" + str(ROOT / "csrc")]
SAN_ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=1:detect_leaks=1",
    "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=1:print_stacktrace=1",
}
RUN_TIMEOUT = 60  # seconds; the run takes ~0.5 s


def test_c_memops(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found on PATH: tests/test_c_memops.py builds tests/c/test_memops.c with "
                    "-fsanitize=address,undefined (install gcc with libasan/libubsan)", pytrace=False)
    binary = tmp_path / "test_memops"
    cmd = [gcc, *CFLAGS, *map(str, SOURCES), "-o", str(binary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"compiling the C memops test failed:\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env=dict(os.environ, **SAN_ENV))
    report = f"$ {binary}\nexit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert "FAIL" not in proc.stderr and "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, report
    summary = [line for line in proc.stdout.splitlines() if line.startswith("test_memops OK:")]
    assert len(summary) == 1, report
    stats = dict(kv.split("=", 1) for kv in summary[0].split(": ", 1)[1].split())
    assert int(stats["copies"]) > 4000 and stats["dofork"] == "1", report


def test_madvise_dofork_binding_returns_the_errno() -> None:
    """mploader._memops.madvise_dofork (what the CUDA pinning calls on each registered
    range): 0 on a mapped, page-aligned range; the errno of madvise(2) otherwise,
    without raising (the caller's best effort)."""
    import ctypes
    import errno
    import mmap

    from mploader import _memops

    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    try:
        view = (ctypes.c_char * (2 * page)).from_buffer(m)
        address = ctypes.addressof(view)
        m.madvise(mmap.MADV_DONTFORK)
        assert _memops.madvise_dofork(address, 2 * page) == 0
        assert _memops.madvise_dofork(address + 1, page) == errno.EINVAL
        del view
    finally:
        m.close()
    assert _memops.madvise_dofork(0, page) == errno.ENOMEM  # page 0 is never mapped (vm.mmap_min_addr)
