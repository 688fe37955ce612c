"""No gap between epochs (issue 27; docs/design.md, "No gap between epochs"): where the
next epoch's order is fixed in advance, the engine dispatches its first batches while
the current epoch ends, and the next epoch takes them over only if it asks for the
same.  Every case compares the batches, in order, with the same loader without the
staging (``mploader._scheduler.STAGE_NEXT_EPOCH = False``) and with the loader without
workers (``num_workers=0``, an independent path: no engine), and reads the engine's
own counters (``stats()``: ``staged``, ``staged_used``, ``staged_dropped``), so that a
test fails when the staging is off.  The suite's autouse fixture checks that no
process, fd or shared mapping is left behind.
"""
from __future__ import annotations

import gc
import os
import select

import numpy as np
import psutil
import pytest
from test_engine import fetch_stack

import mploader
import mploader._scheduler
from mploader import DistributedBatchSampler
from mploader._ring import STATE_FREE
from mploader.sampler import BatchSampler, RandomSampler

EPOCHS = 4


class Augmented:
    """Sample ``i``: ``[i, a draw from NumPy's global RNG]`` -- a random augmentation,
    so a batch built with another seed than its own (epoch, batch index) shows."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


@pytest.fixture
def unstaged(monkeypatch):
    """A context in which runs stage nothing (the reference)."""
    def off():
        monkeypatch.setattr(mploader._scheduler, "STAGE_NEXT_EPOCH", False)

    def on():
        monkeypatch.setattr(mploader._scheduler, "STAGE_NEXT_EPOCH", True)
    return off, on


def _epochs(loader, epochs=EPOCHS, between=None):
    out = []
    for e in range(epochs):
        if between is not None:
            between(e)
        out.append([np.array(b, copy=True).tolist() for b in loader])
    return out


def _staging(loader) -> dict:
    st = loader.stats()
    return {k: st[k] for k in ("staged", "staged_used", "staged_dropped")}


def _slots_accounted(loader) -> None:
    """Every slot is FREE or holds a batch staged for the next epoch, and the engine's
    counters add up: dispatched ahead = taken over + dropped + still staged."""
    engine = loader._engine
    staged = engine.staged_slots()
    region = engine.region
    st = _staging(loader)
    assert st["staged"] == st["staged_used"] + st["staged_dropped"] + len(staged), st
    assert [s for s in range(region.nslots) if region.state(s) != STATE_FREE and s not in staged] == []


def _assert_as_unstaged_and_inline(got: list, off, kw: dict) -> None:
    """``got`` (each epoch's batches) is what the loader without the staging (``off``
    turns it off) and the loader without workers give."""
    off()
    with _gluon(2, **kw) as loader:
        ref = _epochs(loader, len(got))
    with _gluon(0, **kw) as loader:
        inline = _epochs(loader, len(got))
    assert got == ref == inline


def _gluon(num_workers, **kw):
    kw.setdefault("batch_size", 4)
    return mploader.DataLoader(kw.pop("dataset", Augmented()), num_workers=num_workers, seed=11, **kw)


@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(shuffle=True, last_batch="rollover"),
                                dict(batch_size=3, last_batch="discard")],
                         ids=["shuffle", "rollover", "sequential-discard"])
def test_gluon_epochs_identical_to_unstaged_and_in_process(unstaged, kw):
    off, on = unstaged
    with _gluon(2, **kw) as loader:
        got = _epochs(loader)
        st = _staging(loader)
        _slots_accounted(loader)
    off()
    with _gluon(2, **kw) as loader:
        ref = _epochs(loader)
        assert _staging(loader)["staged"] == 0
    with _gluon(0, **kw) as loader:
        inline = _epochs(loader)
    assert got == ref == inline
    assert st["staged_used"] > 0 and st["staged_dropped"] == 0, st


class Bad(Augmented):
    """Augmented, but samples 3, 17 and 41 raise ValueError."""

    def __getitem__(self, i: int) -> np.ndarray:
        if i in (3, 17, 41):
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


@pytest.mark.parametrize("on_error", ["skip", "substitute"])
def test_gluon_bad_samples_in_staged_batches_as_unstaged(unstaged, on_error):
    """Bad samples (on_error="skip"/"substitute") in batches staged for the next epoch:
    the batches, their order and the bad-sample report (which sample, epoch, batch,
    substitute) are those of the loader without the staging (bad samples need worker
    processes: no in-process reference), and every epoch reports exactly the 3 bad
    samples (with "skip", every epoch holds every other sample once)."""
    off, on = unstaged

    def run():
        with _gluon(2, dataset=Bad(), shuffle=True, on_error=on_error, max_bad_samples=100) as loader:
            got = _epochs(loader)
            st = loader.stats()
        return got, st

    got, st = run()
    off()
    ref, ref_st = run()
    assert got == ref
    assert st["bad_samples"] == ref_st["bad_samples"]
    for e in range(EPOCHS):
        assert sorted(r["index"] for r in st["bad_samples"] if r["epoch"] == e) == [3, 17, 41]
        if on_error == "skip":
            assert sorted(row[0] for batch in got[e] for row in batch) == sorted(set(range(50)) - {3, 17, 41})
    assert st["staged_used"] > 0 and ref_st["staged"] == 0, st


def test_gluon_user_sampler_set_epoch_between_epochs_drops_the_staged_batches(unstaged):
    """The user moves a seeded sampler back between epochs (repeats epoch 0): the
    batches staged for epoch 1's order are dropped, the epoch is epoch 0's again."""
    off, on = unstaged

    def make(num_workers):
        sampler = RandomSampler(50, seed=3)
        return sampler, _gluon(num_workers, batch_sampler=BatchSampler(sampler, 4), batch_size=None)

    def run(num_workers):
        sampler, loader = make(num_workers)
        with loader:
            out = _epochs(loader, between=lambda e: sampler.set_epoch(0) if e == 2 else None)
            return out, (_staging(loader) if num_workers else None), loader
    got, st, _ = run(2)
    off()
    ref, _, _ = run(2)
    inline, _, _ = run(0)
    assert got == ref == inline
    indices = [[[row[0] for row in b] for b in epoch] for epoch in got]
    assert indices[2] == indices[0] != indices[1]
    assert st["staged_dropped"] > 0 and st["staged_used"] > 0, st


def test_gluon_distributed_batch_sampler_with_and_without_set_epoch(unstaged):
    """``DistributedBatchSampler``: staged for ``epoch + 1`` -- taken over when the user
    calls ``set_epoch`` as documented, dropped when the pass repeats the epoch."""
    off, on = unstaged

    def run(num_workers, set_epoch):
        bs = DistributedBatchSampler(50, 8, seed=5, rank=1, world_size=2)
        with _gluon(num_workers, batch_sampler=bs, batch_size=None) as loader:
            out = _epochs(loader, between=(lambda e: bs.set_epoch(e)) if set_epoch else None)
            return out, (_staging(loader) if num_workers else None)
    for set_epoch in (True, False):
        on()
        got, st = run(2, set_epoch)
        off()
        ref, _ = run(2, set_epoch)
        inline, _ = run(0, set_epoch)
        assert got == ref == inline
        if set_epoch:
            assert st["staged_used"] > 0 and st["staged_dropped"] == 0, st
        else:
            assert st["staged_used"] == 0 and st["staged_dropped"] > 0, st


@pytest.mark.parametrize("taken", [1, 11])
def test_gluon_break_mid_epoch_then_new_epochs(unstaged, taken):
    """``break`` after ``taken`` batches of epoch 1 (before and after its tasks were all
    dispatched), then whole epochs: as the unstaged loader."""
    off, on = unstaged

    def run():
        with _gluon(2, shuffle=True) as loader:
            out = _epochs(loader, 1)
            it = iter(loader)
            out.append([next(it).tolist() for _ in range(taken)])
            del it
            out += _epochs(loader, 2)
            _slots_accounted(loader)
            return out, _staging(loader)
    got, st = run()
    off()
    ref, _ = run()
    assert got == ref
    assert st["staged_used"] > 0


def test_gluon_state_dict_around_the_epoch_boundary_as_unstaged(unstaged):
    """A checkpoint at the end of an epoch (staged batches in flight) and one a few
    batches into the next (staged batches taken over) equal the unstaged loader's, and
    resuming from them gives the same batches."""
    off, on = unstaged

    def run():
        with _gluon(2, shuffle=True) as loader:
            first = _epochs(loader, 1)
            assert loader.stats()["staged"] > 0 or not mploader._scheduler.STAGE_NEXT_EPOCH
            at_end = loader.state_dict()
            it = iter(loader)
            head = [next(it).tolist() for _ in range(3)]
            mid = loader.state_dict()
            rest = [b.tolist() for b in it]
            return first, at_end, head, mid, rest
    got = run()
    off()
    ref = run()
    assert got == ref
    _, at_end, head, mid, rest = got
    on()
    for state, expect in ((at_end, head + rest), (mid, rest)):
        with _gluon(2, shuffle=True) as resumed:
            resumed.load_state_dict(state)
            assert [b.tolist() for b in resumed] == expect


def test_gluon_close_and_drop_while_staged_leave_nothing():
    """Closing, or dropping, a loader whose next epoch is staged stops its workers (the
    autouse fixture also checks fds and shared memory)."""
    loader = _gluon(2, shuffle=True)
    _epochs(loader, 1)
    assert loader._engine.staged_slots()
    pids = loader.worker_pids()
    loader.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    loader = _gluon(2, shuffle=True)
    _epochs(loader, 1)
    assert loader._engine.staged_slots()
    pids = loader.worker_pids()
    del loader
    gc.collect()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_gluon_load_state_dict_between_epochs_drops_or_reuses_only_equal_tasks(unstaged):
    """A checkpoint loaded between epochs (here: one from mid-epoch 0, so the next
    iter() resumes it) makes the next epoch's first tasks other than the staged ones:
    dropped, and the resumed epoch is exactly the rest of epoch 0."""
    with _gluon(2, shuffle=True) as loader:
        it = iter(loader)
        [next(it) for _ in range(4)]
        state = loader.state_dict()
        rest = [b.tolist() for b in it]
        loader.load_state_dict(state)
        assert [b.tolist() for b in loader] == rest
        st = _staging(loader)
        assert st["staged_dropped"] > 0 and st["staged_used"] == 0, st
        _slots_accounted(loader)


class DiesOn:
    """Sample ``bad`` ends its worker (``os._exit``) while ``armed`` is set."""

    def __init__(self, armed, bad: int = 0, n: int = 48) -> None:
        self.armed, self.bad, self.n = armed, bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.bad and self.armed.is_set():
            os._exit(3)
        return np.array([i, i], dtype=np.int64)


def test_a_worker_dying_on_a_staged_batch_fails_the_next_epoch_as_unstaged(unstaged):
    """A batch staged for the next epoch ends its worker: the current epoch is whole
    and raises nothing (the staging is dropped), and the next epoch meets the worker's
    death at that batch, as without the staging; the epoch after is whole again."""
    import multiprocessing
    off, on = unstaged

    def run(staged):
        armed = multiprocessing.Event()
        with _gluon(2, dataset=DiesOn(armed)) as loader:
            it = iter(loader)
            got = [next(it).tolist()]
            armed.set()          # from here on sample 0 (epoch 1's first batch) kills its worker
            got += [b.tolist() for b in it]
            if staged:   # the worker building the staged batch has died before the next iter()
                poller = select.poll()
                fds = [os.pidfd_open(pid) for pid in loader.worker_pids()]
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                try:
                    assert poller.poll(60_000), "no worker died on the staged batch"
                finally:
                    for fd in fds:
                        os.close(fd)
            with pytest.raises(mploader.WorkerError, match="sample indices \\[0, 1, 2, 3\\]"):
                next(iter(loader))
            armed.clear()
            after = [b.tolist() for b in loader]
            return got, after, _staging(loader)
    got, after, st = run(True)
    off()
    ref, ref_after, _ = run(False)
    assert got == ref and after == ref_after
    assert [b[0][0] for b in got] == list(range(0, 48, 4))
    assert st["staged_dropped"] > 0, st


class Slow:
    """Sample ``i`` is ``width`` copies of ``i`` (int64) after ``cpu_s`` of CPU, so that
    tasks wait in the workers' queues."""

    def __init__(self, n: int = 48, width: int = 2, cpu_s: float = 0.002) -> None:
        self.n, self.width, self.cpu_s = n, width, cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        import time
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return np.full(self.width, i, dtype=np.int64)


def test_dropping_the_staging_mid_epoch_leaves_the_current_epochs_batches():
    """Trouble on a worker that holds staged tasks (it died, or the watchdog found it
    stuck) drops the staging while the current epoch has tasks queued in the workers:
    those stay wanted.  Regression: dropping used the workers' cancel word, which
    covers every task below the staged ones -- the current epoch's queued batches came
    out as None (seen in test_watchdog.py's stuck-worker case)."""
    with mploader.DataLoader(Slow(), batch_size=4, num_workers=2, prefetch=16, seed=0) as loader:
        it = iter(loader)
        got = [next(it).tolist()]
        assert loader._engine.staged_slots(), "nothing staged: the epoch's tasks were all dispatched at once"
        loader._engine._scheduler.drop_staged()
        got += [b.tolist() for b in it]
        assert got == [[[i, i] for i in range(b, b + 4)] for b in range(0, 48, 4)]
        st = _staging(loader)
        assert st["staged_dropped"] > 0 and st["staged_used"] == 0, st
        assert [b.tolist() for b in loader][0] == [[i, i] for i in range(4)]   # (reaps the dropped ones)
        _slots_accounted(loader)


def test_the_call_that_takes_staged_batches_over_stages_nothing(unstaged):
    """The first ``next()`` of an epoch whose batches were staged only takes them over:
    the following epoch's prediction and dispatch wait for the next call (they queue
    behind this epoch's tasks either way), so that the epoch's first batch does not pay
    for them.  The batches are the unstaged loader's and the in-process loader's, and
    the following epoch still takes its staged batches over."""
    off, on = unstaged
    kw = dict(dataset=Augmented(16), shuffle=True)   # 4 batches: the whole epoch at the first fill
    with _gluon(2, **kw) as loader:
        got = [[np.array(b, copy=True).tolist() for b in loader]]
        before = _staging(loader)
        assert before["staged"] > 0, before
        it = iter(loader)
        epoch = [np.array(next(it), copy=True).tolist()]
        first = _staging(loader)
        assert first["staged_used"] > before["staged_used"], first   # taken over...
        assert first["staged"] == before["staged"], (before, first)    # ...and nothing staged
        epoch += [np.array(b, copy=True).tolist() for b in it]
        got.append(epoch)
        got += _epochs(loader, 2)
        after = _staging(loader)
        assert after["staged"] > first["staged"] and after["staged_used"] > first["staged_used"], after
        assert after["staged_dropped"] == 0, after
        _slots_accounted(loader)
    _assert_as_unstaged_and_inline(got, off, kw)


def test_the_take_over_compares_every_task_and_refuses_an_elementwise_equality():
    """``_steps.adopt`` (the take-over's step): the staged tasks whose sources equal the
    run's pulled task tuples, in order, up to the first that differs or is of other
    workers, stale or consumed, move to the run, and as many pulls leave its pushback;
    a tuple whose ``==`` is elementwise (an index array) is taken as different, without
    raising."""
    from collections import deque
    from types import SimpleNamespace

    from mploader import _steps

    def task(source: tuple, generation: int = 7, stale: bool = False, consumed: bool = False) -> SimpleNamespace:
        return SimpleNamespace(source=source, generation=generation, stale=stale, consumed=consumed)

    def take(pulled: list, staged: list) -> tuple[int, list, list, list]:
        run = SimpleNamespace(pushback=deque(pulled), inflight=deque())
        ahead = SimpleNamespace(inflight=deque(staged))
        n = _steps.adopt(run, ahead, 7)
        return n, list(run.inflight), list(ahead.inflight), list(run.pushback)

    staged = [task((1, i, [2 * i, 2 * i + 1])) for i in range(3)]
    pulled = [(1, 0, [0, 1]), (1, 1, [2, 3]), (1, 2, [4, 5])]
    assert take(pulled, staged) == (3, staged, [], [])
    assert take(pulled[:2], staged) == (2, staged[:2], staged[2:], [])   # fewer pulled than staged
    assert take(pulled + [(1, 3, [6, 7])], staged) == (3, staged, [], [(1, 3, [6, 7])])   # more pulled
    assert take(pulled[:2] + [(1, 2, [4, 6])], staged) == (2, staged[:2], staged[2:], [(1, 2, [4, 6])])
    swapped = [pulled[0], pulled[2], pulled[1]]   # the order differs
    assert take(swapped, staged) == (1, staged[:1], staged[1:], swapped[1:])
    other_epoch = [(2, i, t[2]) for i, t in enumerate(pulled)]
    assert take(other_epoch, staged) == (0, [], staged, other_epoch)
    for bad in (task(staged[1].source, generation=6), task(staged[1].source, stale=True),
                task(staged[1].source, consumed=True)):   # of other workers, stale, consumed
        assert take(pulled, [staged[0], bad, staged[2]])[:3] == (1, staged[:1], [bad, staged[2]])
    arrays = [task((1, 0, np.array([0, 1]))), task((1, 1, [2, 3]))]
    n, moved, left, pushback = take([(1, 0, np.array([0, 1])), (1, 1, [2, 3])], arrays)
    assert (n, moved, left, len(pushback)) == (0, [], arrays, 2)


# ---- the take-over, step by step (an engine with a prediction of its own) ----


def _epoch_tasks(epoch: int, n: int, size: int = 2) -> list[tuple]:
    return [(epoch, b, list(range(b * size, b * size + size))) for b in range(n)]


class Counted:
    """An iterator over ``items`` that counts its pulls (the batch sampler's, as a face's
    source pulls it)."""

    def __init__(self, items) -> None:
        self.items = iter(items)
        self.pulls = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.items)
        self.pulls += 1
        return item


def _engine(**kw):
    from mploader._engine import Engine

    opts = dict(num_workers=1, prefetch=3, auto_prefetch=10, shared_mem=None, timeout_s=60, seed=0)
    opts.update(kw)
    return Engine(Slow(1000, width=3, cpu_s=0.005), fetch_stack, **opts)


@pytest.mark.parametrize("differs_at", [None, 1, 4, 9])
def test_staged_tasks_are_taken_over_as_the_run_pulls_and_a_later_difference_drops_only_the_rest(differs_at):
    """A deep queue (small batches: the depth rises from ``prefetch`` 3 towards 10) stages
    the next run's first tasks.  The next run pulls its own tasks as upstream's iterator
    does -- ``prefetch`` at its first ``next()``, one more after each batch -- and takes
    each staged task over once its own pull equals it; where the prediction differs (at
    batch ``differs_at``), the staged tasks from there on are dropped, and the run's
    batches are its own, in order.  Those dropped after some were taken over go without
    the workers' cancel word: the run's tasks taken over and still queued in the one
    worker (busy on the one before) are below it, and with it they came out empty."""
    n = 12
    engine = _engine()
    try:
        first = [np.array(b, copy=True).tolist() for b in engine.run(_epoch_tasks(0, n))]   # the depth rises
        predicted = _epoch_tasks(1, n)
        if differs_at is not None:
            predicted[differs_at] = (1, differs_at, [999, 998])
        run = engine.run(_epoch_tasks(0, n), lookahead=lambda: iter(predicted))
        got = [np.array(b, copy=True).tolist() for b in run]
        staged = engine.stats()["staged"]
        assert got == first and staged >= 10, staged   # (the depth reached 10: 10 staged)
        source = Counted(_epoch_tasks(1, n))
        run = engine.run(source, upstream_pulls=True)
        assert source.pulls == 0   # the first pulls wait for the first next()
        got, pulls = [], []
        for b in run:
            got.append(np.array(b, copy=True).tolist())
            pulls.append(source.pulls)
        st = engine.stats()
    finally:
        engine.close()
    expected = [[[i, i, i] for i in range(2 * b, 2 * b + 2)] for b in range(n)]
    assert got == expected
    used = staged if differs_at is None else differs_at
    assert (st["staged_used"], st["staged_dropped"]) == (used, staged - used), st
    # upstream's count while staged tasks are taken over: prefetch + k after k batches
    assert pulls[:max(used - 3, 0)] == [3 + k for k in range(1, max(used - 3, 0) + 1)], pulls


def test_a_run_taking_a_whole_staged_pass_over_stages_the_following_epoch_before_its_end(unstaged):
    """An epoch whose whole pass was staged compares it as it pulls, so its own source
    ends only near the epoch's end; the following epoch is staged as soon as the next
    call, not then, so that the workers' queues do not run dry meanwhile.  The
    batches are the unstaged loader's and the in-process loader's."""
    off, on = unstaged
    kw = dict(dataset=Augmented(64), shuffle=True)   # 16 batches of 4: small, a deep queue
    with _gluon(2, **kw) as loader:
        got = _epochs(loader, 2)   # the depth rises above an epoch; epoch 2 is staged whole
        before = _staging(loader)
        it = iter(loader)
        epoch = [np.array(next(it), copy=True).tolist() for _ in range(2)]
        run = loader._engine._current()
        during = _staging(loader)
        assert run.staged is not None and not run.exhausted, "the take-over is over already"
        assert during["staged"] > before["staged"], (before, during)   # epoch 3's, already
        epoch += [np.array(b, copy=True).tolist() for b in it]
        got.append(epoch)
        got += _epochs(loader, 1)
        after = _staging(loader)
        assert after["staged_dropped"] == 0 and after["staged_used"] > during["staged_used"], after
        _slots_accounted(loader)
    _assert_as_unstaged_and_inline(got, off, kw)


def test_a_take_over_that_differs_drops_the_staging_made_for_the_next_run_too():
    """A run taking a whole staged pass over stages its successor's first tasks early;
    when its own tasks then differ from the staged ones, it dispatches them after its
    successor's staged tasks, and its cancel word when a ``break`` supersedes it would
    cover those (they came out empty when the successor took them over): the
    successor's staging is dropped with the rest, and every batch is the run's own."""
    n = 8
    expected = [[[i, i, i] for i in range(2 * b, 2 * b + 2)] for b in range(n)]
    engine = _engine()
    try:
        assert [np.array(b, copy=True).tolist() for b in engine.run(_epoch_tasks(0, n))] == expected
        predicted = _epoch_tasks(1, n)
        predicted[5] = (1, 5, [999, 998])
        run = engine.run(_epoch_tasks(0, n), lookahead=lambda: iter(predicted))
        assert [np.array(b, copy=True).tolist() for b in run] == expected
        run = engine.run(_epoch_tasks(1, n), lookahead=lambda: iter(_epoch_tasks(2, n)))
        got = [np.array(next(run), copy=True).tolist() for _ in range(4)]   # the difference, then a break
        st = engine.stats()
        after = [np.array(b, copy=True).tolist() for b in engine.run(_epoch_tasks(2, n))]
    finally:
        engine.close()
    assert got == expected[:4] and after == expected
    # the next run's first tasks were staged too, then dropped with the rest
    assert st["staged"] > n and (st["staged_used"], st["staged_dropped"]) == (5, st["staged"] - 5), st
