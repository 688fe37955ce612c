"""The leak check of every test (tests/_leaks.py, applied by conftest.py's autouse fixture).

Each kind of leak is planted and must be named by ``Snapshot.leaks``; what other
processes do in /dev/shm, and multiprocessing's long-lived helper daemons, must not be
counted.  The last test runs a small suite in a child pytest with this conftest and
checks that a leaking test fails there whatever its module is called.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from multiprocessing import shared_memory

import psutil
import pytest
from _leaks import SHM_DIR, Snapshot, check

HERE = os.path.dirname(os.path.abspath(__file__))
needs_shm = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def one_problem(before: Snapshot, kind: str) -> str:
    """The single problem ``check(before)`` reports, which must start with ``kind``."""
    problems = check(before)
    assert len(problems) == 1 and problems[0].startswith(kind), problems
    return problems[0]


def test_nothing_new_is_nothing_reported():
    before = Snapshot()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert check(before) == []


def test_a_child_process_left_running_is_reported():
    before = Snapshot()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        problems = check(before)
        assert any(p.startswith("child processes left behind") and str(child.pid) in p for p in problems), problems
        # its stdin pipe is ours too
        assert any(p.startswith("file descriptors left open") and str(child.stdin.fileno()) in p
                   for p in problems), problems
    finally:
        child.stdin.close()
        child.wait()
    assert check(before) == []


def test_an_unreaped_child_is_reported():
    before = Snapshot()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    try:
        assert f"{pid} (zombie" in one_problem(before, "child processes left behind")
    finally:
        os.waitpid(pid, 0)
    assert check(before) == []


def test_an_open_descriptor_is_reported():
    before = Snapshot()
    r, w = os.pipe()
    try:
        text = one_problem(before, "file descriptors left open")
        assert f"{r}: 'pipe:[" in text and f"{w}: 'pipe:[" in text
    finally:
        os.close(r)
        os.close(w)


def test_a_descriptor_reopened_under_the_same_number_and_name_is_reported():
    """A memfd closed and another one opened under the same fd number and name: told
    apart by the inode."""
    fd = os.memfd_create("leaks-test")
    before = Snapshot()
    os.close(fd)
    again = os.memfd_create("leaks-test")
    try:
        assert again == fd
        assert "memfd:leaks-test" in one_problem(before, "file descriptors left open")
    finally:
        os.close(again)


def test_a_shared_mapping_whose_fd_is_closed_is_reported():
    """Mapped with libc's mmap (Python's mmap keeps a dup of the fd), then the fd closed:
    only the mapping is left, as the ring's region would be."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    before = Snapshot()
    fd = os.memfd_create("leaks-test-map")
    os.ftruncate(fd, mmap.PAGESIZE)
    addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        assert "memfd:leaks-test-map" in one_problem(before, "shared mappings left")
    finally:
        assert libc.munmap(addr, mmap.PAGESIZE) == 0
    assert check(before) == []


def test_a_mapping_that_grows_is_not_a_new_one():
    fd = os.memfd_create("leaks-test-grow")
    os.ftruncate(fd, 4 * mmap.PAGESIZE)
    m = mmap.mmap(fd, mmap.PAGESIZE)
    try:
        before = Snapshot()
        m.resize(4 * mmap.PAGESIZE)
        assert check(before) == []
    finally:
        m.close()
        os.close(fd)


@needs_shm
def test_shared_memory_left_unlinked_is_reported():
    """multiprocessing.shared_memory, closed but never unlinked: this process registered it."""
    before = Snapshot()
    shm = shared_memory.SharedMemory(create=True, size=mmap.PAGESIZE)
    shm.close()
    try:
        assert shm.name.lstrip("/") in one_problem(before, "/dev/shm entries left behind")
    finally:
        shm.unlink()
    assert check(before) == []


@needs_shm
def test_a_shm_entry_named_after_this_process_is_reported():
    """torch names its segments ``torch_<pid>_...``: such an entry is ours even when
    nothing holds it open."""
    before = Snapshot()
    name = f"leaks_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with open(os.path.join(SHM_DIR, name), "wb"):
        pass
    try:
        assert name in one_problem(before, "/dev/shm entries left behind")
    finally:
        os.unlink(os.path.join(SHM_DIR, name))


@needs_shm
def test_a_shm_entry_held_open_is_reported_with_its_descriptor():
    before = Snapshot()
    path = os.path.join(SHM_DIR, f"leaks-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        problems = check(before)
        assert [p.split(":")[0] for p in problems] == ["file descriptors left open", "/dev/shm entries left behind"]
        assert all(os.path.basename(path) in p for p in problems), problems
    finally:
        os.close(fd)
        os.unlink(path)


@needs_shm
def test_other_processes_shm_entries_are_not_counted():
    """What a shared CI runner's other jobs do in /dev/shm (here: a process that is not
    ours makes a semaphore-like entry and a segment, keeps them while we look, and removes
    one) is theirs, even when it appears during the test."""
    before = Snapshot()
    tag = uuid.uuid4().hex
    code = textwrap.dedent(f"""
        import os, sys
        for name in ("sem.mp-{tag}", "psm_{tag}"):
            open(os.path.join({SHM_DIR!r}, name), "wb").close()
        print("made", flush=True)
        sys.stdin.read()
        os.unlink(os.path.join({SHM_DIR!r}, "sem.mp-{tag}"))
    """)
    # start_new_session and a grandchild would hide nothing: the entries must not be
    # counted because nothing of ours made them, not because their maker is gone.
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "made\n"
        assert {f"sem.mp-{tag}", f"psm_{tag}"} <= set(os.listdir(SHM_DIR))
        after = Snapshot()
        # the running process is our child (and its pipes are ours), its entries are not
        assert [p.split(":")[0] for p in after.leaks(before)] == ["child processes left behind",
                                                                  "file descriptors left open"]
    finally:
        other.stdin.close()
        other.wait()
        other.stdout.close()
    try:
        assert f"psm_{tag}" in os.listdir(SHM_DIR)
        assert check(before) == []
    finally:
        os.unlink(os.path.join(SHM_DIR, f"psm_{tag}"))


def test_multiprocessing_helper_daemons_are_not_leaks():
    """The fork server and resource tracker started inside a test stay until exit: not
    counted; a process the fork server starts for us is."""
    import multiprocessing
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker
    before = Snapshot()
    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.forkserver.ensure_running()
    assert check(before) == []
    ctx = multiprocessing.get_context("forkserver")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_echo_once, args=(child_end,))
    p.start()
    child_end.close()
    try:
        problems = check(before)
        assert any(p_.startswith("child processes left behind") and str(p.pid) in p_ for p_ in problems), problems
    finally:
        parent_end.send("bye")
        p.join(30)
        parent_end.close()
        p.close()  # the sentinel fd
    assert check(before) == []


def test_multiprocessing_shared_heap_is_not_a_leak():
    """multiprocessing.Value lives in the shared heap's arenas, which multiprocessing keeps
    until exit (a /dev/shm file, open twice and mapped): not counted, wherever made."""
    import multiprocessing
    before = Snapshot()
    values = [multiprocessing.get_context("fork").Value("i", k, lock=False) for k in range(3)]
    assert [v.value for v in values] == [0, 1, 2]
    assert check(before) == []


def test_mploaders_zygote_is_not_a_leak():
    """The zygote (spawn/forkserver workers' parent) lives as long as this process: not
    counted when a test starts it."""
    zygote = pytest.importorskip("mploader._zygote")
    if not zygote.enabled():
        pytest.skip(f"the zygote is turned off ({zygote.ENV}=0)")
    before = Snapshot()
    zygote.warm()
    assert zygote.zygote_pid() in {c.pid for c in psutil.Process().children()}
    assert check(before) == []


def _echo_once(conn):
    conn.recv()


def test_a_leaking_test_fails_in_any_module(tmp_path):
    """The autouse fixture itself: a child pytest with this directory's conftest runs a
    module not named test_core_*; its leaking test errors at teardown naming the leak,
    the clean one passes, and so do one that starts its helpers in ``mp_helpers`` and
    one whose fixture value holds a mapping until it is collected; a failing test is
    reported once (not again for what its traceback holds)."""
    for name in ("conftest.py", "_leaks.py"):
        shutil.copy(os.path.join(HERE, name), tmp_path / name)
    (tmp_path / "test_planted.py").write_text(textwrap.dedent("""
        import os
        import pytest

        KEPT = []

        def test_clean():
            r, w = os.pipe()
            os.close(r)
            os.close(w)

        def test_leaks_a_pipe():
            KEPT.append(os.pipe())

        @pytest.fixture
        def mp_helpers():
            KEPT.append(os.dup(0))   # kept for the session, made before the snapshot

        def test_with_helpers(mp_helpers):
            pass

        class Held:  # a shared mapping released only when collected (as a closed Region's)
            def __init__(self):
                import mmap
                fd = os.memfd_create("held")
                os.ftruncate(fd, mmap.PAGESIZE)
                self.m = mmap.mmap(fd, mmap.PAGESIZE)
                os.close(fd)

        @pytest.fixture
        def held():
            yield Held()

        def test_with_a_value_released_when_collected(held):
            pass

        def test_fails_holding_a_pipe_in_its_frame():
            r, w = os.pipe()
            reader, writer = open(r, "rb"), open(w, "wb")
            assert reader is writer, "the planted failure"
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:randomly",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "1 failed, 4 passed, 1 error" in out, out  # the leaking test passes, its teardown errs
    assert "ERROR at teardown of test_leaks_a_pipe" in out and "file descriptors left open" in out, out
    # a failed test is reported once: its traceback holds its frame's pipe, not a leak
    assert "ERROR at teardown of test_fails_holding" not in out and "the planted failure" in out, out
