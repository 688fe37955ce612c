"""One reset path (issue 21 s1): every way the engine gives workers up goes through
``Receive.reset(reason)`` -- "stop" (``Engine.stop_workers``), "failure" (a worker died
owing a batch) and "dead" (an idle worker's death, found by ``replace_dead``) -- and
leaves every slot FREE and no task record behind."""
from __future__ import annotations

import os
import signal

import pytest
from test_engine import Arange, fetch_stack

from mploader import _ring
from mploader._engine import Engine
from mploader._errors import WorkerError
from mploader._executors import exited


def fetch_dying_on_7(dataset, indices, alloc):
    if 7 in indices:
        os.kill(os.getpid(), signal.SIGKILL)
    return fetch_stack(dataset, indices, alloc)


def make(fetch=fetch_stack, start_method="fork"):
    return Engine(Arange(), fetch, num_workers=2, prefetch=4, shared_mem=None, timeout_s=30, seed=0,
                  start_method=start_method)


def tasks(n, size=2):
    return [(0, b, list(range(b * size, b * size + size))) for b in range(n)]


def spy_resets(engine):
    """Record every reset of ``engine``'s scheduler as (reason, pid of the dead worker or None)."""
    sched = engine._scheduler
    calls = []
    real = sched.reset

    def reset(reason, dead=None):
        calls.append((reason, dead.pid if dead is not None else None))
        return real(reason, dead)

    sched.reset = reset
    return calls


def assert_clean(engine):
    region = engine.region
    assert [region.state(s) for s in range(region.nslots)] == [_ring.STATE_FREE] * region.nslots
    sched = engine._scheduler
    assert not sched.pending and not sched.unsent


def firsts(run):
    return [int(b[0, 0]) for b in run]


def test_stop_workers_resets_with_reason_stop():
    engine = make()
    try:
        it = engine.run(tasks(8))
        assert int(next(it)[0, 0]) == 0
        calls = spy_resets(engine)
        engine.stop_workers()
        assert calls == [("stop", None)]
        assert_clean(engine)
        assert firsts(engine.run(tasks(4))) == [0, 2, 4, 6]
    finally:
        engine.close()


def test_a_worker_dying_owing_a_batch_resets_with_reason_failure():
    engine = make(fetch_dying_on_7)
    try:
        calls = spy_resets(engine)
        got = []
        with pytest.raises(WorkerError, match=r"while loading batch 3 \(sample indices \[6, 7\]\)"):
            for b in engine.run(tasks(8)):
                got.append(int(b[0, 0]))
                del b   # (a batch still referred to holds its slot LEASED)
        assert got == [0, 2, 4]
        assert calls == [("failure", None)]
        assert_clean(engine)
        assert engine.worker_pids() == []
    finally:
        engine.close()


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_an_idle_workers_death_resets_that_worker_with_reason_dead(method):
    """``replace_dead`` (at each run's start) under each start method (forked workers,
    the zygote's under forkserver and spawn): with every worker alive it resets no
    one; once one was killed, it resets exactly that one (the dispatch to a dead
    worker would find it too, later: asked here directly)."""
    engine = make(start_method=method)
    try:
        assert firsts(engine.run(tasks(4))) == [0, 2, 4, 6]
        calls = spy_resets(engine)
        before = list(engine._res.workers)
        engine._scheduler.replace_dead()
        assert calls == [] and engine._res.workers == before
        victim = engine._res.workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert exited([victim], 10) == [victim]
        engine._scheduler.replace_dead()
        assert calls == [("dead", victim.pid)]
        assert firsts(engine.run(tasks(4))) == [0, 2, 4, 6]
        assert calls == [("dead", victim.pid)]
        assert victim.pid not in engine.worker_pids() and len(engine.worker_pids()) == 2
        assert_clean(engine)
    finally:
        engine.close()


def test_an_unknown_reason_is_refused_by_name():
    engine = make()
    try:
        with pytest.raises(ValueError, match=r"reason must be one of stop, failure, dead .*got 'restart'"):
            engine._scheduler.reset("restart")
    finally:
        engine.close()
