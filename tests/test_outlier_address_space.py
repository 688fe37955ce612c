"""Rare outliers over a long run (issue 26) must not use up the ring's address space.

A worker shrinks a slot after an outlier (docs/design.md, "Slot sizing").  Before,
the next outlier in that slot took a fresh range of the reservation, so every
outlier used its size of address space once: ~270 outliers of 48 MiB exhausted the
default 16 GiB, and under ``RLIMIT_AS`` (a reservation of a quarter of the room) a few
dozen did; every batch that did not fit its slot then went through the pipe.  Now a
shrunk slot keeps its range and grows again in place ("Growth"), so the address space
used follows the largest batches the slots held, not the number of outliers.

The case runs in its own child process (its own session, a hard timeout) under a
small ``RLIMIT_AS``, so that a regression costs a failed assertion, not the machine's
memory.  Sizes: 320 outliers of 2 MiB (2.5 MiB slots) would need 800 MiB of fresh
ranges; the reservation is 128 MiB.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_faults import _assert_group_gone

import mploader
from mploader import _pinning, _ring

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

OUTLIERS = 320
BIG_MIB = 2
ROOM_MIB = 512     # RLIMIT_AS above the interpreter's size: the ring reserves a quarter, 128 MiB

SCRIPT = textwrap.dedent('''
    import resource, sys
    import numpy as np
    import _leaks
    import mploader
    from mploader import _memory
    MiB = 1 << 20
    outliers, big, period, room = (int(a) for a in sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_AS, (_memory._vm_size_bytes() + room, resource.RLIM_INFINITY))

    class Sizes:
        """Batch i (batch_size=1): `big` bytes when i % period == 0, else 64; all i % 251."""
        def __len__(self):
            return outliers * period
        def __getitem__(self, i):
            return np.full(big if i % period == 0 else 64, i % 251, np.uint8)

    before = _leaks.Snapshot()
    n = 0
    with mploader.DataLoader(Sizes(), batch_size=1, num_workers=2) as loader:
        for i, b in enumerate(loader):
            want = big if i % period == 0 else 64
            if b.shape != (1, want) or int(b.min()) != i % 251 or int(b.max()) != i % 251:
                raise AssertionError(f"batch {i}: shape {b.shape}, values {int(b.min())}..{int(b.max())}, "
                                     f"expected (1, {want}) of {i % 251}")
            del b
            n += 1
        reserve, used = loader._engine.region.reserve_bytes, loader._engine.region.file_bytes
        stats = loader.stats()
    problems = _leaks.check(before)
    assert not problems, problems
    print("result", n, reserve, used, stats["fallback_pipe"], stats["grown"])
''')


# One outlier every PERIOD batches (a tenth or less, so no worker's sizing takes it as
# typical).  Every 10th: the engine keeps its depth down after each large batch and
# large batches take the lowest FREE slots, so the outliers visit a few slots; every
# 100th: the depth rises between them, the ring goes round robin and the outliers
# land in ever other slots (their ranges must move between slots: Region.park).
@pytest.mark.parametrize("period", [10, 100])
def test_many_outliers_reuse_their_slots_ranges(tmp_path, period):
    """320 outliers of 2 MiB among 64-byte batches, 2 workers, a 128 MiB reservation:
    every batch arrives exact and in order, none through the pipe, and the ring's
    file (the address space its ranges took) stays far below the reservation.
    Before: the reservation was used up after ~50 outliers and 1,313 of the 3,200
    batches went through the pipe (fallback_pipe), small ones included; with ranges
    kept per slot but not moved between slots, every 100th: 162 of 32,000."""
    script = tmp_path / "outliers.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]),
               PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen([sys.executable, str(script), str(OUTLIERS), str(BIG_MIB * MiB), str(period),
                             str(ROOM_MIB * MiB)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True, cwd=str(tmp_path))
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"case hung for 150 s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        _assert_group_gone(proc.pid)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    word, n, reserve, used, fallback_pipe, grown = out.split()[-6:]
    assert word == "result", out
    n, reserve, used, fallback_pipe, grown = int(n), int(reserve), int(used), int(fallback_pipe), int(grown)
    assert n == OUTLIERS * period
    # the case means something: fresh ranges for every outlier would not fit the reservation
    assert OUTLIERS * BIG_MIB * MiB > 4 * reserve, (reserve, OUTLIERS)
    assert fallback_pipe == 0, f"{fallback_pipe} batches went through the pipe; the ring's file is {used >> 20} MiB"
    assert used <= reserve // 2, f"the ring's ranges took {used >> 20} MiB of its {reserve >> 20} MiB reservation"
    assert grown >= OUTLIERS, grown           # the outliers' slots were shrunk and grew again, in place


class _Registrar:
    """A CUDA runtime that registers everything (records nothing; no GPU needed)."""

    def cudaHostRegister(self, ptr, nbytes, flags):
        return 0

    def cudaHostUnregister(self, ptr):
        return 0


class _Outliers:
    """Batch i (batch_size=1): 1 MiB when i % 8 == 0, else 64 bytes; all i % 251."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(MiB if i % 8 == 0 else 64, i % 251, np.uint8)


@pytest.mark.parametrize("pin", [False, True])
def test_only_a_pinned_loaders_region_is_marked_pinned(monkeypatch, pin):
    """A pinned loader's pages are page-locked: the pin holds the physical pages, so a
    slot must not grow again into pages it gave back (the device would read the old
    ones).  The engine marks its region pinned before the first registration; then
    grows past a slot's capacity take fresh ranges, and batches stay exact."""
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (_Registrar(), contextlib.nullcontext))
    with mploader.DataLoader(_Outliers(), batch_size=1, num_workers=2, pin_memory=pin) as loader:
        for i, b in enumerate(loader):
            want = MiB if i % 8 == 0 else 64
            assert b.shape == (1, want) and int(b.min()) == int(b.max()) == i % 251, i
            del b
        assert loader._engine.region.pinned is pin


def test_park_gives_a_free_slots_range_to_the_next_grow_only_in_the_creator():
    """``Region.park``: the parent gives a FREE slot's pages and range back (the slot is
    left empty); another slot's grow takes that range instead of new address space.
    Refused (False, nothing changed) for a slot that is not FREE and in a pinned region;
    a forked child gets SlotStateError."""
    region = _ring.create_region(2, 0)
    try:
        region.assign(0, 1)
        region.begin(0, 1)
        assert region.grow(0, MiB) is True
        off0 = region.meta(0).offset
        assert region.park(0) is False                   # ASSIGNED: a worker may be writing it
        region.reclaim(0)
        blocks = os.fstat(region.fd).st_blocks * 512
        file_bytes = region.file_bytes
        assert region.park(0) is True
        assert (region.meta(0).capacity, region.span(0)) == (0, 0)
        assert blocks - os.fstat(region.fd).st_blocks * 512 >= MiB   # its pages are given back
        region.assign(1, 2)
        region.begin(1, 2)
        assert region.grow(1, MiB - 4096) is True
        assert (region.meta(1).offset, region.span(1)) == (off0, MiB)  # slot 0's range
        assert region.file_bytes == file_bytes                         # no new address space
        region.reclaim(1)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                region.park(1)
            except _ring.SlotStateError:
                os._exit(0)
            os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
        assert region.pinned is False
        region.set_pinned()
        assert region.pinned is True
        assert region.park(1) is False                   # pinned: punched pages are never reused
        assert (region.meta(1).offset, region.span(1)) == (off0, MiB)
    finally:
        region.close()
