"""Errors: worker exceptions, dead workers, timeouts and PR_SET_PDEATHSIG.

* An exception in ``dataset[i]`` or in batchify is re-raised in the parent with its
  type and message, the batch's sample indices and the worker's traceback; the
  iteration goes on with the next batch.
* A worker that dies makes ``next()`` raise ``mploader.WorkerError`` naming the pid
  and the signal or exit code, within 1 s of the death.
* ``timeout`` raises ``TimeoutError`` naming the batch and the worker.
* Workers die with their parent.

Blocking datasets wait on a fresh ``threading.Event`` nobody sets: the worker
blocks until it is killed.  Nothing here sleeps to synchronise; where the test
waits for a process to go away it polls that condition against a deadline.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import psutil
import pytest

import mploader

pytestmark = pytest.mark.timeout(60)


def block_forever():
    threading.Event().wait()


def sample(i):
    return np.arange(4, dtype=np.int64) + 10 * i, i


class FailsAt:
    """``dataset[bad]`` raises ValueError; every other index is ``sample(i)``."""

    def __init__(self, n, bad):
        self.n = n
        self.bad = bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return sample(i)


class CollateError(Exception):
    pass


def failing_batchify(samples):
    if any(s[1] == 6 for s in samples):
        raise CollateError(f"cannot batch {len(samples)} samples")
    return mploader.default_batchify(samples)


class Plain:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return sample(i)


def check_batch(batch, indices):
    np.testing.assert_array_equal(batch[0], np.stack([sample(i)[0] for i in indices]))
    np.testing.assert_array_equal(batch[1], np.array(indices))


def full_text(exc):
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_dataset_exception_reraised_then_iteration_continues(num_workers):
    with mploader.DataLoader(FailsAt(40, 13), batch_size=4, num_workers=num_workers, seed=0) as dl:
        it = iter(dl)
        for k in range(3):
            check_batch(next(it), range(4 * k, 4 * k + 4))
        with pytest.raises(ValueError) as info:
            next(it)
        exc = info.value
        assert type(exc) is ValueError
        assert exc.args == ("bad sample 13",)
        text = full_text(exc)
        assert "ValueError: bad sample 13" in text
        assert "__getitem__" in text and 'raise ValueError(f"bad sample {i}")' in text
        if num_workers:
            assert "[12, 13, 14, 15]" in text, text  # the batch's sample indices
            assert "worker" in text
            pids = dl.worker_pids()
            assert any(f"pid {p}" in text for p in pids), text
        # The loader goes on with the next batch.
        for k in range(4, 10):
            check_batch(next(it), range(4 * k, 4 * k + 4))
        with pytest.raises(StopIteration):
            next(it)
        del it, exc, info
        if num_workers:
            assert dl.stats()["errors"] == 1
        # And a later epoch meets the same error at the same place.
        with pytest.raises(ValueError, match="bad sample 13"):
            list(dl)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batchify_exception_reraised_then_iteration_continues(num_workers):
    with mploader.DataLoader(Plain(20), batch_size=4, num_workers=num_workers, batchify_fn=failing_batchify,
                             seed=0) as dl:
        it = iter(dl)
        check_batch(next(it), range(0, 4))
        with pytest.raises(CollateError) as info:
            next(it)
        exc = info.value
        assert type(exc) is CollateError
        assert exc.args == ("cannot batch 4 samples",)
        text = full_text(exc)
        assert "in failing_batchify" in text and "raise CollateError" in text
        if num_workers:
            assert "[4, 5, 6, 7]" in text, text
        for k in range(2, 5):
            check_batch(next(it), range(4 * k, 4 * k + 4))
        with pytest.raises(StopIteration):
            next(it)


def test_unpicklable_exception_keeps_type_name_message_and_traceback():
    class LocalError(Exception):  # a local class: pickling it by reference fails
        pass

    class Raises:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise LocalError(f"local failure at {i}")
            return sample(i)

    with mploader.DataLoader(Raises(), batch_size=2, num_workers=1, seed=0) as dl:
        it = iter(dl)
        check_batch(next(it), [0, 1])
        check_batch(next(it), [2, 3])
        with pytest.raises(Exception) as info:
            next(it)
        text = full_text(info.value)
        assert "LocalError" in text and "local failure at 5" in text
        assert "[4, 5]" in text
        assert 'raise LocalError(f"local failure at {i}")' in text


class BlocksAfterFirstBatch:
    """Batch 0 loads; every later sample blocks forever while ``block`` is set
    (read in the worker, i.e. as it was when the worker was forked)."""

    def __init__(self, n, batch_size):
        self.n = n
        self.batch_size = batch_size
        self.block = True

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.block and i >= self.batch_size:
            block_forever()
        return sample(i)


def live_children():
    """Pids of this process's children that are not zombies."""
    out = set()
    for c in psutil.Process().children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                out.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_a_blocked_worker(dl):
    """SIGKILL a worker while the next batch waits on the workers (blocked for ever):
    the WorkerError and the seconds next() took to raise it."""
    it = iter(dl)
    check_batch(next(it), [0, 1])
    pids = dl.worker_pids()
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(mploader.WorkerError) as info:
        next(it)
    return it, pids[0], info.value, time.monotonic() - start


def test_sigkill_worker_raises_worker_error_without_a_timeout():
    """The death is noticed as such: there is no timeout to run out (timeout=None, the
    workers block for ever), and the error names the process and its batch."""
    ds = BlocksAfterFirstBatch(20, 2)
    with mploader.DataLoader(ds, batch_size=2, num_workers=2, timeout=None, seed=0) as dl:
        it, victim, exc, _ = kill_a_blocked_worker(dl)
        assert exc.pid == victim
        assert exc.signal == signal.SIGKILL and exc.exitcode is None
        msg = str(exc)
        assert f"pid {victim}" in msg
        assert "signal 9" in msg and "SIGKILL" in msg
        assert exc.batch is not None and f"batch {exc.batch}" in msg
        assert exc.indices == [2 * exc.batch, 2 * exc.batch + 1]
        # gone, or a zombie not reaped yet (only a child of ours is looked at: a pid can come back)
        assert victim not in live_children()
        del it, exc

        # The loader recovers: the next epoch forks new workers (which no longer block).
        ds.block = False
        for k, batch in enumerate(dl):
            check_batch(batch, [2 * k, 2 * k + 1])
        del batch
        assert k == 9
        assert victim not in dl.worker_pids() and len(dl.worker_pids()) == 2


@pytest.mark.timing
def test_sigkill_worker_raises_worker_error_within_1s():
    with mploader.DataLoader(BlocksAfterFirstBatch(20, 2), batch_size=2, num_workers=2, timeout=30, seed=0) as dl:
        it, _, _, elapsed = kill_a_blocked_worker(dl)
        assert elapsed < 1.0, f"WorkerError took {elapsed:.3f} s after the kill"
        del it


class DiesAt:
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 5:
            if self.how == "exit":
                os._exit(3)
            ctypes.string_at(0)  # SIGSEGV
        return sample(i)


@pytest.mark.parametrize("how", ["exit", "segv"])
def test_worker_death_names_exit_code_or_signal_and_batch(how):
    with mploader.DataLoader(DiesAt(how), batch_size=2, num_workers=1, timeout=30, seed=0) as dl:
        it = iter(dl)
        check_batch(next(it), [0, 1])
        check_batch(next(it), [2, 3])
        pid = dl.worker_pids()[0]
        with pytest.raises(mploader.WorkerError) as info:
            next(it)
        exc = info.value
        assert exc.pid == pid and f"pid {pid}" in str(exc)
        assert exc.batch == 2 and exc.indices == [4, 5]
        assert "batch 2" in str(exc) and "[4, 5]" in str(exc)
        if how == "exit":
            assert exc.exitcode == 3 and exc.signal is None
            assert "code 3" in str(exc)
        else:
            assert exc.signal == signal.SIGSEGV and exc.exitcode is None
            assert "SIGSEGV" in str(exc)


def test_timeout_names_batch_and_worker():
    ds = BlocksAfterFirstBatch(20, 2)
    with mploader.DataLoader(ds, batch_size=2, num_workers=2, timeout=0.5, seed=0) as dl:
        it = iter(dl)
        check_batch(next(it), [0, 1])
        pids = dl.worker_pids()
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            next(it)
        elapsed = time.monotonic() - start
        assert elapsed >= 0.5, elapsed  # never early (a hang is the module's timeout)
        msg = str(info.value)
        assert "batch 1" in msg and "[2, 3]" in msg, msg
        assert "0.5 s" in msg
        assert "worker" in msg and any(f"pid {p}" in msg for p in pids), msg


PDEATHSIG_CHILD = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import mploader

    class Data:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            if BUSY and i >= 2:
                threading.Event().wait()
            return np.full(3, i)

    BUSY = sys.argv[1] == "busy"
    loader = mploader.DataLoader(Data(), batch_size=2, num_workers=2, timeout=None)
    it = iter(loader)
    next(it)
    print(" ".join(map(str, loader.worker_pids())), flush=True)
    threading.Event().wait()
""")


def alive(proc):
    """True while ``proc`` (a psutil.Process) runs; a zombie has died."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("state", ["idle", "busy"])
def test_workers_die_with_sigkilled_parent(state):
    root = os.path.dirname(os.path.dirname(os.path.abspath(mploader.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", PDEATHSIG_CHILD, state], stdout=subprocess.PIPE,
                              env=env, text=True)
    workers = []
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        workers = [psutil.Process(p) for p in pids]
        assert all(w.ppid() == parent.pid and alive(w) for w in workers)
        parent.kill()
        parent.wait()
        # The workers go on their own (the kernel tells them); the deadline only stops a
        # test whose workers stay, and is generous for a busy machine.
        deadline = time.monotonic() + 30
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the OS against a deadline, not synchronising
        survivors = [w.pid for w in workers if alive(w)]
        assert not survivors, f"workers {survivors} outlived their SIGKILLed parent by 30 s"
    finally:
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
