"""The engine's teardown goes through the scheduler (issue 21 s1): ``close()`` and the
engine's ``weakref.finalize`` stop the workers by ``Receive.teardown``, the one writer
of the list of workers being the scheduler; the finalizer holds the scheduler, which
must not keep the engine alive."""
from __future__ import annotations

import gc
import os
import weakref

from test_engine import Arange, fetch_stack

from mploader._diagnose import log_stats_every
from mploader._engine import CLOSE_GRACE_S, Engine


def tasks(n, size=2):
    return [(0, b, list(range(b * size, b * size + size))) for b in range(n)]


def reaped(pid: int) -> bool:
    """Whether ``pid``, a child of this process, has exited and been reaped."""
    try:
        os.waitpid(pid, os.WNOHANG)   # (returns: still a child of ours, running or not reaped)
    except ChildProcessError:
        return True
    return False


def test_close_stops_the_workers_through_the_schedulers_teardown():
    engine = Engine(Arange(), fetch_stack, num_workers=2, prefetch=4, shared_mem=None, timeout_s=30, seed=0)
    sched = engine._scheduler
    calls = []
    real = sched.teardown

    def teardown(grace_s):
        calls.append((grace_s, sorted(engine.worker_pids())))
        return real(grace_s)

    sched.teardown = teardown
    try:
        assert [int(b[0, 0]) for b in engine.run(tasks(4))] == [0, 2, 4, 6]
        pids = sorted(engine.worker_pids())
        assert len(pids) == 2
    finally:
        engine.close()
    assert calls == [(CLOSE_GRACE_S, pids)]
    assert engine.worker_pids() == []
    assert all(reaped(pid) for pid in pids)
    engine.close()   # idempotent: no second teardown
    assert len(calls) == 1


def test_a_dropped_engine_is_collected_and_its_workers_stopped():
    """Every part of the scheduler in use (the watchdog, the bad samples' ledger, a
    periodic report, a run dropped mid-epoch): the engine still dies when dropped,
    and its finalizer -- which holds the scheduler -- stops the workers."""
    engine = Engine(Arange(), fetch_stack, num_workers=2, prefetch=4, shared_mem=None, timeout_s=30, seed=0,
                    stall_timeout=60.0, on_error="skip", max_bad_fraction=0.5)
    log_stats_every(engine, 3600.0)
    it = engine.run(tasks(8))
    assert int(next(it)[0, 0]) == 0
    pids = engine.worker_pids()
    assert len(pids) == 2
    ref = weakref.ref(engine)
    del engine, it
    gc.collect()
    assert ref() is None
    assert all(reaped(pid) for pid in pids)
