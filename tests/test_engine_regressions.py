"""Regression tests for engine bugs found during development (one test per bug)."""
import gc
import multiprocessing

import numpy as np
import psutil
import pytest

import mploader
from mploader import _ring
from mploader._engine import Engine
from mploader.dataloader import make_fetch


class Gated:
    """Item 0 blocks until the gate is set; every item is a small array."""

    def __init__(self, gate):
        self.gate = gate

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 0:
            self.gate.wait(30)
        return np.full(3, i, np.int64)


def test_interrupt_while_waiting_keeps_the_batch_owed():
    """An exception raised while waiting (here from on_slow) must not leak the slot:
    the batch stays owed, the next next() returns it, and every slot ends FREE."""
    gate = multiprocessing.Event()

    def on_slow(seq, waited):
        raise KeyboardInterrupt

    engine = Engine(Gated(gate), make_fetch(None), num_workers=1, prefetch=2, shared_mem=None,
                    timeout_s=None, seed=0, on_slow=on_slow, slow_after_s=0.01)
    try:
        run = engine.run((0, i, [i]) for i in range(4))
        with pytest.raises(KeyboardInterrupt):
            next(run)
        gate.set()
        got = [b[0, 0] for b in run]
        assert got == [0, 1, 2, 3]
        del got, run
        gc.collect()
        region = engine._res.region
        assert [region.state(s) for s in range(region.nslots)] == [_ring.STATE_FREE] * region.nslots
    finally:
        engine.close()


def test_dropped_loader_stops_workers_without_cyclic_gc():
    """Engine and Run must not form a cycle: dropping the loader and its iterator
    stops the workers even with the cyclic garbage collector off."""
    class DS:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.zeros(3)

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    gc.disable()
    try:
        loader = mploader.DataLoader(DS(), batch_size=4, num_workers=2, seed=0)
        it = iter(loader)
        next(it)
        assert len({p.pid for p in me.children()} - before) == 2
        del loader, it
        assert {p.pid for p in me.children()} - before == set()
    finally:
        gc.enable()


@pytest.mark.parametrize("shape", [(1, 0), (0,), (0, 3), (2, 0, 4)])
def test_zero_size_samples_stack(shape):
    """Zero-size samples: np.concatenate's reshape must not be ambiguous."""
    samples = [np.zeros(shape, np.float32) for _ in range(3)]
    out = mploader.default_batchify(samples)
    assert out.shape == (3,) + shape and out.dtype == np.float32


def test_abandoned_iteration_frees_its_slots():
    """Breaking out of an epoch leaves batches in flight; they are freed as they
    complete, so later epochs never run short of slots (no pipe fallback)."""
    class DS:
        def __len__(self):
            return 200

        def __getitem__(self, i):
            return np.full(8, i, np.int32)

    with mploader.DataLoader(DS(), batch_size=4, num_workers=2, seed=0) as loader:
        for _ in range(5):
            for k, _batch in enumerate(loader):
                if k == 3:
                    break
            del _batch  # the abandoned run's last batch
        whole = [b[:, 0].copy() for b in loader]
        assert np.array_equal(np.concatenate(whole), np.arange(200))
        stats = loader.stats()
        assert stats["fallback_pipe"] == 0 and stats["no_free_slot"] == 0


class KillsItself:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        import os
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def test_dead_worker_detected_with_more_than_1024_fds_open():
    """Worker pidfds numbered above FD_SETSIZE must still be watched (poll, not select)."""
    import os
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        # The worker dies while it owes the batch (killed by sample 0 itself): a worker
        # killed while idle owes nothing and is replaced instead (test_faults.py).
        with mploader.DataLoader(KillsItself(), batch_size=1, num_workers=1, seed=0, timeout=30) as loader:
            it = iter(loader)
            (pid,) = loader.worker_pids()
            with pytest.raises(mploader.WorkerError, match=str(pid)) as info:
                next(it)
            assert info.value.signal == signal.SIGKILL and info.value.indices == [0]
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class CrashOn:
    """Sample ``bad`` kills its worker (os._exit) -- but only while ``armed`` is set."""

    def __init__(self, bad, armed):
        self.bad = bad
        self.armed = armed

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.bad and self.armed.is_set():
            import os
            os._exit(7)
        return np.full(2, i, np.int64)


def test_worker_crashing_on_an_abandoned_batch_frees_its_slot():
    """A worker that dies on a batch nobody waits for any more (its epoch was
    abandoned) is replaced at the next epoch, and the slot it held is freed."""
    armed = multiprocessing.Event()
    armed.set()
    with mploader.DataLoader(CrashOn(5, armed), batch_size=1, num_workers=1, prefetch=6, seed=0) as loader:
        it = iter(loader)
        next(it)          # batches 1..5 are in flight; batch 5 kills the worker
        (pid,) = loader.worker_pids()
        import os
        # the worker is dead (not reaped) before the epoch is abandoned: since issue 26
        # an abandoned epoch's tasks that no worker has started are skipped, so batch 5
        # would never be loaded (and never kill it) once the iterator is gone
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        del it            # abandon the epoch
        armed.clear()
        got = [int(b[0, 0]) for b in loader]
        assert got == list(range(64))
        region = loader._engine._res.region
        staged = loader._engine.staged_slots()   # the next epoch's first batches (docs/design.md)
        assert all(region.state(s) != _ring.STATE_ASSIGNED for s in range(region.nslots) if s not in staged)
        assert loader.stats()["no_free_slot"] == 0


class Unpicklable:
    """Samples that carry a lambda: they cannot be pickled into the descriptor."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": np.full(2, i), "fn": (lambda: i) if i == 5 else None}


@pytest.mark.parametrize("num_workers", [1, 2])
def test_unserialisable_batch_is_an_error_not_a_dead_worker(num_workers):
    """A batch the worker cannot pickle is re-raised in the parent for that batch
    (naming the problem); the worker survives and the next batches arrive."""
    with mploader.DataLoader(Unpicklable(), batch_size=2, num_workers=num_workers, seed=0,
                             batchify_fn=lambda samples: samples) as loader:
        it = iter(loader)
        assert [int(s["x"][0]) for s in next(it)] == [0, 1]
        assert [int(s["x"][0]) for s in next(it)] == [2, 3]
        with pytest.raises(Exception, match="could not be serialised"):
            next(it)
        assert [int(s["x"][0]) for s in next(it)] == [6, 7]
        assert loader.stats()["errors"] == 1
