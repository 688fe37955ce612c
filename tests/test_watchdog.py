"""The watchdog (issue 23): a worker stuck on one batch is replaced and the batch
loaded again.  Each hang runs in its own child process with a hard time limit
(tests/test_faults.py's ``run_case``); the child's assertions print "OK" last.
"""
from __future__ import annotations

import math
import textwrap

import pytest
from test_faults import COLLECT_LOG, run_case

from mploader import _metrics, _watchdog
from mploader._options import LoaderOptions

# A dataset that sleeps for ever on one index (the first ``hangs`` times it is asked
# for it: the worker leaves a mark per try in a directory), with a random
# augmentation, so that "bit-identical" covers the per-batch seeding.
HANGING = COLLECT_LOG + """
import logging, tempfile
MARKS = tempfile.mkdtemp()

def sleep_forever():
    time.sleep(10 ** 6)

class Hanging:
    def __init__(self, n=96, hang_on=37, hangs=1):
        self.n, self.hang_on, self.hangs = n, hang_on, hangs
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i == self.hang_on and len(os.listdir(MARKS)) < self.hangs:
            open(os.path.join(MARKS, str(os.getpid())), "w").close()
            sleep_forever()
        return np.full(4, i, np.float64) + np.random.random()

"""


def hang_case(body: str, timeout_s: float) -> None:
    run_case(HANGING + textwrap.dedent(body), timeout_s=timeout_s)


def test_a_worker_sleeping_for_ever_is_replaced_and_the_epoch_is_identical():
    """Gluon face, seed=: the epoch with a worker stuck on sample 37 is bit-identical
    to the undisturbed one; one stall, one respawn; the logged stack, taken inside
    the worker, names the sleeping frame; the slots end FREE, two workers live.

    The next epoch is not staged here: its tasks queue behind this epoch's in every
    worker, so the worker that finished its share first could meet sample 37 in a
    staged task and hang there (a hang the next epoch would meet, never this one's)
    while the other built this epoch's 37 unhindered -- no stall in this epoch (CI,
    2026-11-27, once equally loaded workers took tasks in turn).  The staged case is
    ``test_a_worker_stuck_on_a_batch_staged_for_the_next_epoch_is_replaced``."""
    hang_case("""
        import mploader._scheduler
        mploader._scheduler.STAGE_NEXT_EPOCH = False

        def epoch(hangs):
            loader = mploader.DataLoader(Hanging(hangs=hangs), batch_size=4, shuffle=True, num_workers=2, seed=5,
                                         stall_timeout=1.5)
            batches = [b.copy() for b in loader]
            stats = loader.stats()
            assert slots_free(loader)
            assert len(loader.worker_pids()) == 2, loader.worker_pids()
            loader.close()
            return batches, stats

        undisturbed, calm = epoch(0)
        assert calm["stalls"] == calm["respawns"] == 0 and not log.messages
        disturbed, stats = epoch(1)
        assert len(disturbed) == len(undisturbed) == 24
        assert all(np.array_equal(a, b) for a, b in zip(disturbed, undisturbed))
        assert stats["stalls"] == 1 and stats["respawns"] == 1, stats
        assert len(log.messages) == 1, log.messages
        message = log.messages[0]
        assert "has worked on batch" in message and "sample indices" in message and "37" in message, message
        assert "in sleep_forever" in message and "in __getitem__" in message, message
        assert "watchdog found 1 stuck batch" in mploader.diagnose(stats).message or stats["epoch_batches"] < 8
        print("OK")
    """, timeout_s=90)


def test_torch_face_replaces_a_stuck_worker_same_batches_in_the_same_order():
    """Torch face: with seed= the batches are bit-identical; under torch's per-worker
    seeding the samples and their order are the same (the replacement's RNGs start
    afresh from base_seed + id: only the random part of that worker's batches may
    differ -- docs/faces.md)."""
    pytest.importorskip("torch")
    hang_case("""
        import torch
        import mploader.torch as mt

        def epoch(hangs, seed):
            g = torch.Generator().manual_seed(3)
            loader = mt.DataLoader(Hanging(hangs=hangs), batch_size=4, shuffle=True, num_workers=2, seed=seed,
                                   generator=g, stall_timeout=1.5)
            batches = [b.clone() for b in loader]
            stats = loader.stats()
            loader.close()
            return batches, stats

        for seed in (11, None):
            for name in os.listdir(MARKS):
                os.remove(os.path.join(MARKS, name))
            undisturbed, _ = epoch(0, seed)
            disturbed, stats = epoch(1, seed)
            assert stats["stalls"] == 1 and stats["respawns"] == 1, stats
            assert len(disturbed) == len(undisturbed) == 24
            same_samples = [torch.equal(a.floor(), b.floor()) for a, b in zip(disturbed, undisturbed)]
            assert all(same_samples), same_samples
            if seed is not None:
                assert all(torch.equal(a, b) for a, b in zip(disturbed, undisturbed))
        print("OK")
    """, timeout_s=120)


def test_a_worker_stuck_on_a_batch_staged_for_the_next_epoch_is_replaced():
    """Seeded Gluon face, whose next epoch is dispatched while an epoch ends (docs/design.md,
    "No gap between epochs"): the first batch of epoch 1 hangs once, in a staged task.
    The watchdog replaces that worker, the staged batches are still taken over, and the
    three epochs are bit-identical to the loader without workers (num_workers=0)."""
    hang_case("""
        def epochs(loader):
            return [[b.copy() for b in loader] for _ in range(3)]

        reference = epochs(mploader.DataLoader(Hanging(hangs=0), batch_size=4, shuffle=True, seed=3))
        target = int(reference[1][0][0][0])   # the first sample of epoch 1
        loader = mploader.DataLoader(Hanging(hang_on=target), batch_size=4, shuffle=True, num_workers=2, seed=3,
                                     stall_timeout=1.0)
        got = epochs(loader)
        stats = loader.stats()
        loader.close()
        assert len(os.listdir(MARKS)) == 1
        assert all(np.array_equal(a, b) for e, f in zip(got, reference) for a, b in zip(e, f))
        assert [len(e) for e in got] == [len(e) for e in reference] == [24] * 3
        assert stats["stalls"] == 1 and stats["respawns"] == 1, stats
        assert stats["staged_used"] > 0, stats
        print("OK")
    """, timeout_s=90)


def test_a_batch_that_hangs_on_every_try_raises_with_both_stacks():
    """Sample 37 hangs on every try: with max_retries=1 the second stall raises
    StallError (a TimeoutError) carrying both stacks, each naming the sleeping
    frame, within (max_retries + 1) x (stall_timeout + check interval) plus the stack
    dumps (the child's hard limit bounds it here); the next epoch, with the dataset
    mended, is whole."""
    hang_case("""
        loader = mploader.DataLoader(Hanging(hangs=10 ** 6), batch_size=4, num_workers=2, seed=1,
                                     stall_timeout=1.0, max_retries=1)
        try:
            list(loader)
        except mploader.StallError as exc:
            err = exc
        else:
            raise AssertionError("no StallError")
        assert isinstance(err, TimeoutError)
        assert len(err.stacks) == 2, err.stacks
        assert all("in sleep_forever" in s for s in err.stacks), err.stacks
        assert "got its worker stuck 2 times" in str(err) and "max_retries=1" in str(err), str(err)
        assert "--- stall 1 ---" in str(err) and "--- stall 2 ---" in str(err)
        assert 37 in err.indices, err.indices
        assert loader.stats()["stalls"] == 2, loader.stats()
        loader._dataset.hangs = 0          # mended: the next epoch's workers fork it as it is now
        assert firsts(list(loader)) == list(range(96))
        assert slots_free(loader)
        loader.close()
        print("OK")
    """, timeout_s=90)


def test_without_the_watchdog_a_hang_is_the_users_timeout():
    """stall_timeout=None: nothing is replaced; the loader's own timeout ends the wait.
    (The next epoch is not staged, so that sample 37 hangs in this epoch: see
    ``test_a_worker_sleeping_for_ever_is_replaced_and_the_epoch_is_identical``.)"""
    hang_case("""
        import mploader._scheduler
        mploader._scheduler.STAGE_NEXT_EPOCH = False

        loader = mploader.DataLoader(Hanging(), batch_size=4, num_workers=2, seed=1, stall_timeout=None, timeout=1.0)
        try:
            list(loader)
        except mploader.StallError:
            raise AssertionError("the watchdog ran")
        except TimeoutError as exc:
            assert "took more than 1.0 s" in str(exc), exc
        else:
            raise AssertionError("no TimeoutError")
        assert loader.stats()["stalls"] == 0
        loader.close()
        print("OK")
    """, timeout_s=60)


# ---- the default rule and the options (in process: nothing hangs) ----


class _Busy:
    def __init__(self, timed: int, p99: float) -> None:
        self.result = (timed, p99)

    def p99(self) -> tuple[int, float]:
        return self.result


class _Sched:
    def __init__(self, busy: _Busy) -> None:
        self.res = type("Res", (), {"busy": busy})()


@pytest.mark.parametrize(("timed", "p99", "limit"), [
    (0, 0.0, _watchdog.WARMUP_FLOOR_S),          # nothing timed yet: the warm-up floor
    (19, 100.0, _watchdog.WARMUP_FLOOR_S),       # fewer than WARMUP_BATCHES
    (20, 0.001, _watchdog.FLOOR_S),              # fast batches: the floor
    (1000, 16.0, 160.0),                         # slow batches: 10 x p99
])
def test_the_default_stall_limit_is_max_of_the_floor_and_ten_p99(timed, p99, limit):
    dog = _watchdog.Watchdog("auto", 1)
    assert dog.limit(_Sched(_Busy(timed, p99)), 1.0) == limit  # type: ignore[arg-type]
    assert _watchdog.Watchdog(2.5, 1).limit(_Sched(_Busy(timed, p99)), 1.0) == 2.5  # type: ignore[arg-type]


def test_the_p99_comes_from_the_workers_histograms():
    """99 batches of ~3 ms and one of ~5 s: the p99 is the 3 ms bucket's upper end
    (2**-8 s); with two slow ones among 100 it is the 5 s bucket's (8 s)."""
    cells = _metrics.BusyCells(2)
    try:
        worker = _metrics.WorkerBusy(cells.boot(0))
        fast, slow = 0.003, 5.0
        for took, times in ((fast, 99), (slow, 1)):
            k = math.frexp(took)[1] + _metrics.HIST_SHIFT
            worker.hist[k] = worker.hist[k] + times
        assert cells.p99() == (100, 2.0 ** -8)
        other = _metrics.WorkerBusy(cells.boot(1))
        k = math.frexp(slow)[1] + _metrics.HIST_SHIFT
        other.hist[k] = 1.0
        assert cells.p99() == (101, 8.0)
        del worker, other
    finally:
        cells.close()


@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"stall_timeout": 0}, ValueError, "stall_timeout must be a positive number of seconds, 'auto' or None, got 0"),
    ({"stall_timeout": "soon"}, ValueError, "stall_timeout must be a positive number of seconds, 'auto' or None, "
                                            "got 'soon'"),
    ({"stall_timeout": -1.0}, ValueError, "stall_timeout must be a non-negative number of seconds or None, got -1.0"),
    ({"max_retries": -1}, ValueError, "max_retries must be a non-negative integer, got -1"),
    ({"max_retries": 1.5}, TypeError, "max_retries must be a non-negative integer, got 1.5"),
])
def test_watchdog_options_are_checked(kwargs, error, text):
    with pytest.raises(error) as info:
        LoaderOptions(num_workers=2, **kwargs)
    assert text in str(info.value)
