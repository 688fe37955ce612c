"""Where training jobs run (issue 26): closed standard streams, seccomp without
``pidfd_open``, ``RLIMIT_NOFILE``, workers that fail to start, tensors that require
grad.  Each case runs in its own child process with a hard time limit (as in
tests/test_faults.py); the child reports through a file, since some cases close
its standard streams.  After each case the child's process group must be gone.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from test_faults import _assert_group_gone

import mploader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mploader.__file__)))

#: Written next to the case as ``limits_ds.py``: spawned workers import it.
DATASETS = '''
import os
import numpy as np

MARK = "printed-by-getitem"


def stdio_targets():
    """What fds 0..2 point at in this process (closed ones left out)."""
    out = {}
    for fd in (0, 1, 2):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


class Printing:
    """Sample i is np.full(4, i, int64); __getitem__ prints, and fails if one of
    fds 0..2 is open in the worker on something mploader could have made (a memfd,
    socket, pipe, pidfd; files the parent opened there are inherited as they are)."""

    def __init__(self, n=64, check_stdio=True):
        self.n = n
        self.check_stdio = check_stdio

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        bad = {fd: t for fd, t in stdio_targets().items()
               if t.startswith(("/memfd:", "socket:", "pipe:", "anon_inode:"))}
        if bad and self.check_stdio and os.getpid() != PARENT[0]:
            raise AssertionError(f"worker {os.getpid()} holds standard streams {bad}")
        print(f"{MARK} {i}", flush=True)
        return np.full(4, i, np.int64)


PARENT = [os.getpid()]


class Unloadable:
    """Pickles, but cannot be unpickled: a spawned worker dies before it starts."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.full(4, i, np.int64)

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("this dataset cannot be loaded in a worker")


def failing_init(worker_id):
    raise ValueError(f"worker_init_fn fails in worker {worker_id}")
'''

PRELUDE = '''
import collections, errno, gc, os, signal, sys, time, traceback
import numpy as np
OUT = os.environ["MPL_TEST_OUT"]

def report(text):
    fd = os.open(OUT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)

def fd_targets():
    """{fd: what it points at} for this process's descriptors."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # (the one listdir used, closed since)
            pass
    return out

def fd_kinds():
    """{kind: count} of this process's descriptors (memfd names, socket, anon_inode, pipe, ...)."""
    return collections.Counter(t.split("[")[0].split(" (")[0].rstrip(":") for t in fd_targets().values())

def cloexec(fd):
    with open(f"/proc/self/fdinfo/{fd}") as f:
        flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
    return bool(flags & 0o2000000)

def firsts(batches):
    return [int(b[0]) for batch in batches for b in batch]
'''

WRAP = '''
try:
{body}
    report("OK\\n")
except BaseException:
    report("FAIL\\n" + traceback.format_exc())
    os._exit(1)
'''


def _case(body: str, tmp_path, close_stdio: bool = False, env_extra: dict | None = None) -> tuple[list, dict]:
    (tmp_path / "limits_ds.py").write_text(DATASETS)
    out = tmp_path / "outcome.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               PYTHONFAULTHANDLER="1", MPL_TEST_OUT=str(out), **(env_extra or {}))
    code = PRELUDE + WRAP.format(body=textwrap.indent(textwrap.dedent(body), "    "))
    argv = [sys.executable, "-c", code]
    if close_stdio:  # as daemon(3) leaves a process: fds 0, 1 and 2 closed
        argv = ["/bin/sh", "-c", 'exec "$@" <&- >&- 2>&-', "sh", *argv]
    return argv, env


def run_case(body: str, tmp_path, timeout_s: float = 120, close_stdio: bool = False,
             env_extra: dict | None = None) -> str:
    """Run ``body`` in a new session; its outcome file must end with "OK"."""
    argv, env = _case(body, tmp_path, close_stdio, env_extra)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                            start_new_session=True, cwd=str(tmp_path))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"case hung for {timeout_s} s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        _assert_group_gone(proc.pid)
    outcome = (tmp_path / "outcome.txt").read_text() if (tmp_path / "outcome.txt").exists() else ""
    assert proc.returncode == 0 and outcome.endswith("OK\n"), \
        f"exit {proc.returncode}\noutcome:\n{outcome}\nstdout:\n{out}\nstderr:\n{err}"
    return out


# 1 ---- closed standard streams ------------------------------------------------

CLOSED_STDIO = '''
import limits_ds
face, start_method = sys.argv[1], sys.argv[2]
assert limits_ds.stdio_targets() == {}, limits_ds.stdio_targets()
if face == "gluon":
    import mploader
    def make():
        return mploader.DataLoader(limits_ds.Printing(), batch_size=4, num_workers=2, seed=0, timeout=60,
                                   start_method=start_method)
else:
    import torch.utils.data
    import mploader.torch
    cls = torch.utils.data.DataLoader if face == "torch-reference" else mploader.torch.DataLoader
    def make():
        # torch's own workers hold multiprocessing's pipes at fds 0..2: not checked there
        return cls(limits_ds.Printing(check_stdio=face != "torch-reference"), batch_size=4, num_workers=2,
                   multiprocessing_context=start_method,
                   persistent_workers=True)
want = list(range(64))

def epoch(loader):
    got = firsts(loader)
    assert got == want, ("batches", got)

strict = face != "torch-reference"  # torch's own loader: batches and prints only

def check_descriptors(where):
    if strict:
        low = limits_ds.stdio_targets()
        assert not low, (where, "descriptors at 0..2", low)
        for fd, target in fd_targets().items():
            if target.startswith(("/memfd:mploader", "socket:", "anon_inode:[pidfd]")):
                assert cloexec(fd), (where, fd, target, "not close-on-exec")

loader = make()
for _ in range(2):
    epoch(loader)
    check_descriptors("after an epoch")
# A metrics file opened now takes fd 0: nothing the workers print may reach it.
metrics = open("metrics.txt", "w")
assert metrics.fileno() == 0 or not strict, metrics.fileno()
metrics.write("metrics 1\\n"); metrics.flush()
epoch(loader)
# Workers started while files sit at fds 0 and 1: the parent has no sys.stdout, so a
# print in them is a no-op (as in torch's workers), not a write into fd 1.
other = open("other.txt", "w")
assert other.fileno() == 1 or not strict, other.fileno()
second = make()
epoch(second)
metrics.write("metrics 2\\n"); metrics.flush()
for closing in (loader, second):
    if strict:
        closing.close()
    elif closing._iterator is not None:  # torch's persistent workers end with their iterator
        closing._iterator._shutdown_workers()
del loader, second, closing
gc.collect()
metrics.close(); other.close()
with open("metrics.txt") as f:
    lines = f.read().splitlines()
with open("other.txt") as f:
    lines_other = f.read().splitlines()
assert lines == ["metrics 1", "metrics 2"] and lines_other == [], (lines[:8], lines_other[:8])
'''


@pytest.mark.parametrize("face,start_method", [("gluon", "fork"), ("gluon", "spawn"), ("torch", "fork"),
                                               ("torch-reference", "fork")])
def test_closed_standard_streams(tmp_path, face, start_method):
    """A daemonised job (fds 0, 1, 2 closed) whose dataset prints: every batch is
    right, nothing mploader creates lands on fds 0..2 (parent and workers), all of it
    is close-on-exec, and files opened afterwards (at fds 0 and 1) hold none of the
    prints.  Before: the ring's memfd took fd 0 and the task sockets fds 1 and 2 (a
    worker's print then failed with EBADF, or, as in the issue, wrote into the ring).
    torch's own DataLoader passes the same case (``torch-reference``)."""
    if face != "gluon":
        pytest.importorskip("torch")
    body = CLOSED_STDIO.replace("sys.argv[1], sys.argv[2]", f"{face!r}, {start_method!r}")
    run_case(body, tmp_path, close_stdio=True)


# 2 ---- seccomp without pidfd_open -------------------------------------------------

SECCOMP = '''
import ctypes, platform, struct

def refuse_pidfd_open():
    """A seccomp filter (prctl, classic BPF): pidfd_open (434) -> EPERM, as older
    Docker default profiles answer; every other call allowed.  x86-64 only."""
    libc = ctypes.CDLL(None, use_errno=True)
    def ins(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)
    prog = b"".join([
        ins(0x20, 0, 0, 4),                          # ld seccomp_data.arch
        ins(0x15, 1, 0, 0xC000003E),                 # jeq AUDIT_ARCH_X86_64
        ins(0x06, 0, 0, 0x7FFF0000),                 # ret ALLOW
        ins(0x20, 0, 0, 0),                          # ld seccomp_data.nr
        ins(0x15, 0, 1, 434),                        # jeq __NR_pidfd_open
        ins(0x06, 0, 0, 0x00050000 | errno.EPERM),   # ret ERRNO(EPERM)
        ins(0x06, 0, 0, 0x7FFF0000),                 # ret ALLOW
    ])
    buf = ctypes.create_string_buffer(prog, len(prog))
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
    try:
        os.pidfd_open(os.getpid())
    except PermissionError:
        return
    raise AssertionError("the filter did not refuse pidfd_open")
'''

NO_PIDFD = '''
import mploader, limits_ds
start_method = sys.argv[1]
if sys.argv[2] == "seccomp":
    refuse_pidfd_open()
loader = mploader.DataLoader(limits_ds.Printing(16, False), batch_size=4, num_workers=2, seed=0, timeout=60,
                             start_method=start_method)
assert firsts(loader) == list(range(16))
pidfds = [fd for fd, target in fd_targets().items() if target == "anon_inode:[pidfd]"]
assert not pidfds, pidfds  # the fallback is in use
# The parent sees a worker's death through its pipe: a killed idle worker is
# replaced, and the next epoch is whole.
first = loader._engine.worker_pids()
from mploader import _executors
dead = next(w for w in loader._engine._res.workers if w.pid == first[0])
os.kill(first[0], signal.SIGKILL)
assert _executors.exited([dead], 60) == [dead]  # its fallback watch (a pipe) reports the death
assert firsts(loader) == list(range(16))
pids = loader._engine.worker_pids()
assert first[0] not in pids and len(pids) == 2, (first, pids)
sys.stdout.write("PIDS " + " ".join(map(str, pids)) + "\\n")
sys.stdout.flush()
signal.pause()  # the test SIGKILLs this process now
'''


#: The parent-death guarantee (docs/design.md, "Workers"): a worker is gone within
#: this long after its parent died, pidfd or not.
PARENT_DEATH_S = 1.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("refusal", ["seccomp", "EPERM", "ENOSYS"])
def test_without_pidfd_open(tmp_path, refusal, start_method):
    """pidfd_open refused -- by a real seccomp filter (x86-64) or by the test switch
    MPLOADER_TEST_REFUSE_PIDFD (EPERM as seccomp answers, ENOSYS as an old kernel):
    the loader works (the parent holds no pidfd: the fallback pipes are used), sees
    a killed worker and replaces it, and after a SIGKILL of the parent its workers
    are gone within the 1 s guarantee.  Before: ``PermissionError: watch_parent(...)``
    and a zombie."""
    if refusal == "seccomp" and os.uname().machine != "x86_64":
        pytest.skip("the hand-written seccomp filter checks for x86-64 system call numbers")
    body = (SECCOMP + NO_PIDFD).replace("sys.argv[1]", repr(start_method)).replace(
        "sys.argv[2]", repr(refusal))
    env = {} if refusal == "seccomp" else {"MPLOADER_TEST_REFUSE_PIDFD": refusal}
    argv, env = _case(body, tmp_path, env_extra=env)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True, cwd=str(tmp_path))
    try:
        seen, deadline = b"", time.monotonic() + 90
        while not re.search(rb"PIDS [0-9 ]+\n", seen) and time.monotonic() < deadline:  # the dataset prints too
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(proc.stdout.fileno(), 65536) if ready else b""
            if ready and not chunk:
                break
            seen += chunk
        found = re.search(rb"PIDS ([0-9 ]+)\n", seen)
        if found is None:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            outcome = (tmp_path / "outcome.txt").read_text() if (tmp_path / "outcome.txt").exists() else ""
            pytest.fail(f"no worker pids from the case: {seen[-300:]!r}\noutcome:\n{outcome}\nstderr:\n{err!r}")
        line = "PIDS " + found.group(1).decode()
        workers = [int(p) for p in line.split()[1:]]
        assert all(psutil.Process(p).ppid() == proc.pid for p in workers if start_method == "fork")
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + PARENT_DEATH_S
        while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the OS against the guarantee, not synchronising
        left = [p for p in workers if not _gone(p)]
        assert not left, f"workers {left} outlived their SIGKILLed parent by {PARENT_DEATH_S} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        _assert_group_gone(proc.pid)


def test_watch_parent_refused_without_lifeline_says_so(tmp_path):
    """pidfd_open refused and no lifeline to fall back on: an OSError that says both
    (not a bare PermissionError)."""
    run_case('''
        from mploader import _ring
        pid = os.fork()
        if pid == 0:
            try:
                _ring.watch_parent(os.getppid())
            except PermissionError as exc:
                ok = "pidfd_open was refused" in str(exc) and "no lifeline_fd" in str(exc)
                os._exit(0 if ok else 2)
            os._exit(3)
        assert os.waitpid(pid, 0)[1] == 0
    ''', tmp_path, env_extra={"MPLOADER_TEST_REFUSE_PIDFD": "EPERM"})


# 3 ---- RLIMIT_NOFILE ---------------------------------------------------------------

NOFILE = '''
import resource
import mploader, limits_ds
from mploader import _executors, _fds, _zygote
start_method = sys.argv[1]
how = _executors.descriptor_kind(start_method)
if how == "zygote":  # the zygote's socket: one descriptor per process, from its start
    _zygote.warm()
elif how != "fork":  # multiprocessing's resource tracker: the same
    import multiprocessing.resource_tracker
    multiprocessing.resource_tracker.ensure_running()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
base = _fds.open_count()
loaders, error = [], None
for k in range(40):
    loader = mploader.DataLoader(limits_ds.Printing(16, False), batch_size=4, num_workers=2, seed=0, timeout=60,
                                 start_method=start_method)
    before = _fds.open_count()
    try:
        got = firsts(loader)
    except OSError as exc:
        error = exc
        break
    assert got == list(range(16)), got
    if k == 0:  # the figure the message gives is what a loader holds
        held = _fds.open_count() - before
        assert held == _fds.per_loader(2, how), (held, _fds.per_loader(2, how), fd_kinds())
    loaders.append(loader)
assert error is not None, "64 descriptors never ran out"
msg = str(error)
assert error.errno == errno.EMFILE, repr(error)
for part in ("out of file descriptors", "RLIMIT_NOFILE allows 64", "ulimit -n", "resource.setrlimit",
             f"{_fds.per_loader(2, how)} with num_workers=2", "num_workers=2"):
    assert part in msg, (part, msg)
assert len(loaders) >= 3, (len(loaders), msg)
# The loaders made before keep working; the failed one works once descriptors are freed.
for earlier in loaders:
    assert firsts(earlier) == list(range(16))
loaders.pop().close()
loaders.pop().close()
assert firsts(loader) == list(range(16))
for x in loaders + [loader]:
    x.close()
del loaders, loader, earlier, x
gc.collect()
assert _fds.open_count() == base, (_fds.open_count(), base, fd_kinds())
'''


@pytest.mark.parametrize("start_method,zygote", [("fork", "1"), ("spawn", "1"), ("spawn", "0")])
def test_rlimit_nofile(tmp_path, start_method, zygote):
    """RLIMIT_NOFILE=64: opening loaders (2 workers each) until descriptors run out
    ends in OSError(EMFILE) that says so, what each loader holds (checked against a
    count of the descriptors the first one holds) and how to raise the limit; the
    earlier loaders keep working, and closing them all leaves nothing open.  Before:
    ``WorkerError ... exited with code 1``."""
    run_case(NOFILE.replace("sys.argv[1]", repr(start_method)), tmp_path, timeout_s=100,
             env_extra={"MPLOADER_ZYGOTE": zygote})


# 4 ---- workers that fail to start --------------------------------------------------

FAILED_STARTS = '''
import limits_ds
face = sys.argv[1]
import mploader
if face == "torch":
    import mploader.torch
    def make():
        return mploader.torch.DataLoader(limits_ds.Printing(16, False), batch_size=4, num_workers=2,
                                         worker_init_fn=limits_ds.failing_init, multiprocessing_context="spawn")
    expected = ValueError
else:
    def make():
        return mploader.DataLoader(limits_ds.Unloadable(), batch_size=4, num_workers=2, seed=0, timeout=60,
                                   start_method="spawn")
    expected = mploader.WorkerError
warm = make()  # multiprocessing's own resource tracker and the like, started once
try:
    next(iter(warm))
except expected:
    pass
warm.close()
del warm
gc.collect()
before = fd_kinds()
loader = make()
for attempt in range(6):
    try:
        next(iter(loader))
    except expected:
        pass
    else:
        raise AssertionError("the failing start went unnoticed")
loader.close()
del loader
gc.collect()
after = fd_kinds()
assert after == before, (dict(after - before), dict(before - after))
'''


@pytest.mark.parametrize("face", ["gluon", "torch"])
def test_failed_worker_starts_leave_no_descriptor(tmp_path, face):
    """Spawned workers that fail to start, six times, then close(): the parent holds
    the descriptors it held before (counted by kind).  Gluon: a dataset that cannot
    be unpickled in the worker (it dies before fetching anything); torch face:
    worker_init_fn raising.  Before: each start left a duplicate of the region's
    and the busy counters' memfds in multiprocessing's resource sharer (and its
    listening socket): 24 memfds after six starts of two workers."""
    if face == "torch":
        pytest.importorskip("torch")
    run_case(FAILED_STARTS.replace("sys.argv[1]", repr(face)), tmp_path, timeout_s=100)


# 5 ---- tensors that require grad -----------------------------------------------------

def test_tensors_requiring_grad_say_why_and_what_to_do():
    """A dataset of tensors with requires_grad=True, 2 workers: torch's DataLoader
    fails (stack(out=) refuses autograd); the torch face fails too, with an error
    that says why (a batch made in a worker cannot carry a graph) and what to do
    (detach() in __getitem__, requires_grad_() in the loop, or num_workers=0)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader as TorchLoader

    import mploader.torch as mt

    class Grad(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((3,), float(i), requires_grad=True)

    torch_it = iter(TorchLoader(Grad(), batch_size=4, num_workers=2))
    try:
        with pytest.raises(RuntimeError, match="automatic differentiation"):
            next(torch_it)
    finally:   # torch's shutdown after a worker's error waits 5 s per worker (join timeouts)
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(torch_it))
        torch_it._worker_pids_set = False
        for w in torch_it._workers:
            w.kill()
        torch_it._shutdown_workers()
    del torch_it
    class Detached(Grad):
        def __getitem__(self, i):
            return super().__getitem__(i).detach()

    with mt.DataLoader(Grad(), batch_size=4, num_workers=2) as loader:
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
    msg = str(info.value)
    for part in ("element 0 of the batch is a tensor with requires_grad=True",
                 "cannot carry an autograd graph", "tensor.detach()", ".requires_grad_()", "num_workers=0"):
        assert part in msg, (part, msg)
    # Detached samples (what the message says to do) load, and equal torch's batches.
    with mt.DataLoader(Detached(), batch_size=4, num_workers=2) as loader:
        got = list(loader)
    want = list(TorchLoader(Detached(), batch_size=4, num_workers=0))
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
