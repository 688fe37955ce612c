"""Shared fixtures: every test must leave no child process, fd, mapping or shm entry behind.

``no_leaks`` is autouse for the core suite (modules named ``test_core_*``) and can be
requested explicitly by any other test.  It snapshots, after ``gc.collect()``:

* the children of this process (``psutil.Process().children(recursive=True)``),
* the open file descriptors (``/proc/self/fd``, each with its ``readlink`` target),
* the ``memfd:`` mappings of this process (``/proc/self/maps``; a leaked region
  stays mapped even when its fd is closed),
* the entries of ``/dev/shm``,

and after the test (and another ``gc.collect()``) asserts that nothing new is there.
Children, fds and mappings are compared at once: ``close()`` and garbage
collection release them synchronously.  ``/dev/shm`` is shared with every other
process on the machine, so an entry that appears there is only blamed on the test
if it is still present after a short deadline (others' transient segments vanish;
a leak does not).
"""
from __future__ import annotations

import gc
import os
import time

import psutil
import pytest

SHM_DIR = "/dev/shm"
#: How long a new /dev/shm entry may take to vanish before it counts as a leak (s).
SHM_SETTLE_S = 1.0


def open_fds() -> dict[int, str]:
    """``{fd: target}`` for this process's open file descriptors."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd listdir itself used, closed by now
            pass
    return out


def memfd_mappings() -> list[str]:
    """Lines of ``/proc/self/maps`` that map a memfd (the ring's shared region)."""
    with open("/proc/self/maps") as f:
        return sorted(line.split(None, 5)[-1].strip() for line in f if "memfd:" in line)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


class Snapshot:
    """What a test may not leave behind, taken after a full garbage collection."""

    def __init__(self) -> None:
        gc.collect()
        self.children = child_pids()
        self.fds = open_fds()
        self.maps = memfd_mappings()
        self.shm = shm_entries()

    def leaks(self, before: Snapshot) -> list[str]:
        problems = []
        new_children = self.children - before.children
        if new_children:
            desc = []
            for pid in sorted(new_children):
                try:
                    p = psutil.Process(pid)
                    desc.append(f"{pid} ({p.status()}: {' '.join(p.cmdline())[:80]})")
                except psutil.Error:
                    desc.append(str(pid))
            problems.append(f"child processes left behind: {', '.join(desc)}")
        new_fds = {fd: t for fd, t in self.fds.items() if before.fds.get(fd) != t}
        if new_fds:
            problems.append(f"file descriptors left open: {new_fds}")
        if len(self.maps) > len(before.maps):
            problems.append(f"memfd mappings left: {len(before.maps)} before, {len(self.maps)} after: {self.maps}")
        new_shm = self.shm - before.shm
        if new_shm:
            problems.append(f"/dev/shm entries left behind: {sorted(new_shm)}")
        return problems


def lasting_new_shm(before: set[str]) -> set[str]:
    """Entries of /dev/shm not in ``before`` that are still there after ``SHM_SETTLE_S``
    (other processes' transient entries, e.g. multiprocessing's ``sem.*``, vanish)."""
    deadline = time.monotonic() + SHM_SETTLE_S
    new = shm_entries() - before
    while new and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition with a deadline, not synchronising
        new &= shm_entries()
    return new


def settle_shm(before: Snapshot, after: Snapshot) -> None:
    """Drop from ``after`` the new /dev/shm entries that do not last."""
    after.shm = before.shm | lasting_new_shm(before.shm)


def assert_no_leaks(before: Snapshot) -> None:
    after = Snapshot()
    settle_shm(before, after)
    problems = after.leaks(before)
    assert not problems, "\n".join(problems)


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves a child process, fd, memfd mapping or /dev/shm entry."""
    before = Snapshot()
    yield before
    assert_no_leaks(before)


@pytest.fixture(autouse=True)
def _core_no_leaks(request):
    """``no_leaks`` for every test of the core suite (``tests/test_core_*.py``)."""
    if not request.module.__name__.rpartition(".")[2].startswith("test_core_"):
        yield
        return
    before = Snapshot()
    yield
    assert_no_leaks(before)
