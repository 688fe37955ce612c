"""Input-pipeline metrics and the stall diagnosis (issue 12).

The references are independent of the loader: the test times each ``next()`` itself
(the loader's ``wait_s`` lies inside that interval), a dataset that sleeps S seconds
per sample makes the workers' busy time at least S per sample (``time.sleep`` never
returns early), and a consumer that keeps every batch holds exactly that many slots.
Timing bounds are loose (3x or more) for a busy 2-core machine; the cost of the
metrics is measured in bench/metrics_cost.py, not here.  Sleeps in datasets and
consumers stand for work, never for synchronisation.
"""
from __future__ import annotations

import gc
import io
import logging
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import mploader
from mploader import _diagnose, _metrics
from mploader._engine import Engine

SAMPLE_S = 0.02   # a slow sample
WORK_S = 0.03     # a slow training step


class SlowData:
    """``n`` samples of ``size`` float32, each taking ``SAMPLE_S`` seconds to load."""

    def __init__(self, n: int, size: int = 4, delay_s: float = SAMPLE_S) -> None:
        self.n, self.size, self.delay_s = n, size, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s)
        return np.full(self.size, i, np.float32)


FACES = ["gluon", "torch"]


def make_loader(face: str, dataset, batch_size: int, num_workers: int, prefetch: int | None = None):
    """A loader of ``face`` with ``prefetch`` batches in flight (default 2 per worker)."""
    if face == "gluon":
        return mploader.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, prefetch=prefetch)
    pytest.importorskip("torch")
    from mploader.torch import DataLoader
    if num_workers == 0:
        return DataLoader(dataset, batch_size=batch_size)
    factor = 2 if prefetch is None else prefetch // num_workers
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, prefetch_factor=factor)


def timed_epoch(loader, work_s: float = 0.0, keep: bool = False):
    """Run one epoch timing each ``next()``; returns (total wait, wall, batches kept)."""
    it = iter(loader)
    kept = []
    wait = 0.0
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            wait += time.perf_counter() - t0
            break
        wait += time.perf_counter() - t0
        if keep:
            kept.append(batch)
        if work_s:
            time.sleep(work_s)
        del batch
    return wait, time.perf_counter() - start, kept


# ---- the three verdicts, Gluon and torch faces ----


@pytest.mark.parametrize("face", FACES)
def test_slow_dataset_fast_consumer_is_input_bound(no_leaks, face):
    n, batch_size = 48, 2
    with make_loader(face, SlowData(n), batch_size, 2) as dl:
        ref_wait, ref_wall, _ = timed_epoch(dl)
        s = dl.stats()
        verdict = mploader.diagnose(dl)
    assert verdict.kind == "input-bound", s
    assert str(verdict) == verdict.message
    assert verdict.message.startswith("input-bound: the loop waited ")
    assert "2 workers were" in verdict.message and "add workers" in verdict.message
    # wait_s is most of wall_s; both lie inside the test's own intervals.
    assert s["wait_s"] > 0.5 * s["wall_s"]
    assert s["wait_s"] <= ref_wait and s["wall_s"] <= ref_wall
    assert s["wait_s"] > ref_wait / 3 and s["wall_s"] > ref_wall / 3
    assert s["epoch_batches"] == n // batch_size
    # Every sample slept SAMPLE_S inside a worker during the epoch.
    assert len(s["worker_busy"]) == 2 and all(0.0 <= b <= 1.0 for b in s["worker_busy"])
    assert sum(s["worker_busy"]) * s["wall_s"] >= n * SAMPLE_S * 0.99
    assert verdict.worker_busy >= _diagnose.BUSY_WORKERS


@pytest.mark.parametrize("face", FACES)
def test_fast_dataset_slow_consumer_is_compute_bound(no_leaks, face):
    n = 24
    with make_loader(face, SlowData(n, delay_s=0), 1, 2) as dl:
        ref_wait, ref_wall, _ = timed_epoch(dl, work_s=WORK_S)
        s = dl.stats()
        verdict = mploader.diagnose(dl)
    assert verdict.kind == "compute-bound", s
    assert verdict.message.startswith("compute-bound: the loop waited ")
    assert verdict.message.endswith("of the time; loading is not the bottleneck")
    assert s["wall_s"] >= (n - 1) * WORK_S          # the consumer's own sleeps are inside the epoch
    assert s["wait_s"] <= ref_wait and s["wall_s"] <= ref_wall
    assert verdict.wait_fraction < _diagnose.INPUT_WAIT
    assert max(s["worker_busy"]) < 0.5
    # A step of at least WORK_S between batches bounds the recent rate.
    assert 0 < s["batches_per_s"] <= 1.5 / WORK_S


@pytest.mark.parametrize("face", FACES)
def test_consumer_holding_every_batch_is_transport_bound(no_leaks, face):
    n = 32
    # 4 KiB samples: no small leaf, which the torch face would deliver as a copy that
    # holds no slot (mploader.torch.SMALL_LEAF_BYTES, test_torch_small_leaves.py)
    with make_loader(face, SlowData(n, size=1024, delay_s=0), 1, 2, prefetch=2) as dl:
        if face == "torch":   # torch's DataLoader prints nothing: the full ring is an INFO line
            _, _, kept = timed_epoch(dl, keep=True)
        else:
            with pytest.warns(RuntimeWarning, match="slots are held"):
                _, _, kept = timed_epoch(dl, keep=True)
        s = dl.stats()
        verdict = mploader.diagnose(dl)
        num_slots = s["num_slots"]
        assert s["held_slots"] == num_slots  # every slot is one of ours
        del kept
        gc.collect()
        assert dl.stats()["held_slots"] == 0
    assert verdict.kind == "transport-bound", s
    assert s["epoch_no_free_slot"] >= n - num_slots - 2  # held slots are not reused
    assert s["epoch_fallback_pipe"] == s["epoch_no_free_slot"]
    assert verdict.message == (f"transport-bound: {verdict.fallback_fraction * 100:.0f} % of batches fell back to "
                               "pickle because every slot was held; drop references to old batches or pass copy=True")


# ---- the other keys against references ----


@pytest.mark.parametrize("face", FACES)
def test_keys_before_any_batch_and_without_workers(face):
    for dl in (make_loader(face, SlowData(4), 2, 1), make_loader(face, SlowData(4, delay_s=0), 2, 0)):
        with dl:
            assert set(_metrics.METRIC_KEYS) <= set(dl.stats())
            s = dl.stats()
            for key in ("wait_s", "wall_s", "first_batch_s", "batches_per_s", "bytes_per_s"):
                assert s[key] == 0.0, key
            assert s["epoch_batches"] == s["ready_batches"] == s["held_slots"] == 0
            assert mploader.diagnose(dl).kind == "unknown"
            assert "0 batches measured" in str(mploader.diagnose(dl))


def test_held_slots_counts_the_batches_the_caller_keeps(no_leaks):
    with mploader.DataLoader(SlowData(40, delay_s=0), batch_size=2, num_workers=2) as dl:
        it = iter(dl)
        kept = [next(it) for _ in range(3)]
        assert dl.stats()["held_slots"] == 3
        del kept[0]
        assert dl.stats()["held_slots"] == 2
        kept.clear()
        assert dl.stats()["held_slots"] == 0
        assert dl.stats()["epoch_batches"] == 3


def test_ready_batches_reaches_the_batches_in_flight(no_leaks):
    prefetch = 3
    with mploader.DataLoader(SlowData(40, delay_s=0), batch_size=2, num_workers=2, prefetch=prefetch) as dl:
        it = iter(dl)
        next(it)  # dispatched `prefetch`, returned one: prefetch - 1 in flight
        deadline = time.monotonic() + 30
        seen = []
        while time.monotonic() < deadline:  # polling a condition with a deadline
            seen.append(dl.stats()["ready_batches"])
            if seen[-1] == prefetch - 1:
                break
            time.sleep(0.005)
        assert seen[-1] == prefetch - 1 and max(seen) <= prefetch - 1
        batch = next(it)
        assert dl.stats()["ready_batches"] <= prefetch - 1
        del batch


def test_bytes_per_batch_is_the_slot_bytes(no_leaks):
    size = 2048  # float32: 8 KiB a sample
    batch_size = 4
    with mploader.DataLoader(SlowData(64, size=size, delay_s=0), batch_size=batch_size, num_workers=2) as dl:
        timed_epoch(dl, work_s=0.005)
        s = dl.stats()
    data = batch_size * size * 4
    per_batch = s["bytes_per_s"] / s["batches_per_s"]
    assert data <= per_batch <= data + 4096  # the arrays plus their descriptor


def test_wall_and_wait_restart_each_epoch(no_leaks):
    with mploader.DataLoader(SlowData(8, delay_s=0), batch_size=2, num_workers=1) as dl:
        timed_epoch(dl, work_s=0.05)
        first = dl.stats()
        assert first["wall_s"] >= 3 * 0.05 and first["epoch_batches"] == 4
        assert dl.stats()["wall_s"] == first["wall_s"]  # frozen at StopIteration
        start = time.monotonic()
        it = iter(dl)
        assert dl.stats()["epoch_batches"] == 0 and dl.stats()["wall_s"] == 0.0
        next(it)
        second = dl.stats()
        assert second["epoch_batches"] == 1 and 0.0 < second["wall_s"] <= time.monotonic() - start
        assert second["batches"] == 5  # the transport counters do not restart


def test_busy_survives_worker_replacement(no_leaks):
    """maxtasksperchild=1: every batch on a new process, several alive at once."""
    n = 12
    engine = Engine(SlowData(n * 2), _fetch_pairs, num_workers=2, prefetch=4, shared_mem=None, timeout_s=60,
                    seed=0, maxtasksperchild=1)
    try:
        got = sum(1 for _ in engine.run([(0, b, [2 * b, 2 * b + 1]) for b in range(n)]))
        s = engine.stats()
    finally:
        engine.close()
    assert got == s["epoch_batches"] == n
    # Per worker id the fraction may exceed 1: a retiring process and its successor overlap.
    assert all(b >= 0.0 for b in s["worker_busy"])
    assert sum(s["worker_busy"]) * s["wall_s"] >= 2 * n * SAMPLE_S * 0.99


def _fetch_pairs(dataset, indices, alloc):
    return np.stack([dataset[i] for i in indices])


@pytest.fixture
def mp_helpers():
    """multiprocessing's resource tracker and resource sharer (which passes the ring's
    and the busy cells' memfds to spawned workers) are per-process daemons that live
    until exit: start them before ``no_leaks`` takes its snapshot."""
    import multiprocessing.reduction
    import multiprocessing.resource_tracker
    import os
    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.reduction.DupFd(os.dup(0))  # starts the sharer's listener


def test_spawned_workers_report_busy_through_a_passed_memfd(mp_helpers, no_leaks):
    import multiprocessing
    n = 6
    engine = Engine(SlowData(n), _fetch_pairs, num_workers=1, prefetch=2, shared_mem=None, timeout_s=120, seed=0,
                    start_method="spawn")
    try:
        got = sum(1 for _ in engine.run([(0, b, [b]) for b in range(n)]))
        s = engine.stats()
    finally:
        engine.close()
        multiprocessing.active_children()  # multiprocessing's own record of the last Process
    assert got == s["epoch_batches"] == n
    assert len(s["worker_busy"]) == 1 and s["worker_busy"][0] is not None
    assert s["worker_busy"][0] * s["wall_s"] >= n * SAMPLE_S * 0.99


# ---- diagnose's rules, from stats dicts ----


def _stats(**kw):
    s = dict(epoch_batches=100, wait_s=0.0, wall_s=10.0, first_batch_s=0.0, worker_busy=[0.5, 0.5],
             epoch_no_free_slot=0, epoch_fallback_pipe=0)
    s.update(kw)
    return s


@pytest.mark.parametrize("stats, kind, message", [
    (_stats(epoch_batches=7), "unknown",
     "unknown: 7 batches measured in this epoch, 8 needed for a verdict"),
    (_stats(wait_s=3.0, worker_busy=[]), "input-bound",
     "input-bound: the loop waited 30 % of the time loading batches in this process (num_workers=0 or "
     "thread_pool=True); use worker processes or make `__getitem__` cheaper"),
    (_stats(wait_s=3.8, worker_busy=[0.97, 0.97]), "input-bound",
     "input-bound: the loop waited 38 % of the time while the 2 workers were 97 % busy; add workers or make "
     "`__getitem__` cheaper"),
    (_stats(wait_s=0.1), "compute-bound",
     "compute-bound: the loop waited 1 % of the time; loading is not the bottleneck"),
    (_stats(epoch_no_free_slot=12, epoch_fallback_pipe=12), "transport-bound",
     "transport-bound: 12 % of batches fell back to pickle because every slot was held; drop references to old "
     "batches or pass copy=True"),
    (_stats(wait_s=5.0, worker_busy=[0.1, 0.2], epoch_fallback_pipe=30), "transport-bound",
     "transport-bound: the loop waited 50 % of the time while the 2 workers were only 15 % busy (30 % of batches "
     "came through a pipe); raise prefetch, or return arrays instead of Python objects"),
    (_stats(wait_s=5.0, worker_busy=[None]), "input-bound",
     "input-bound: the loop waited 50 % of the time (worker busy time is not measured); add "
     "workers or make `__getitem__` cheaper"),
    # The first batch (worker start-up) is left out: 2 s of a 2 s wait, 10 s wall.
    (_stats(wait_s=2.0, first_batch_s=2.0), "compute-bound",
     "compute-bound: the loop waited 0 % of the time; loading is not the bottleneck"),
])
def test_diagnose_rules(stats, kind, message):
    d = mploader.diagnose(stats)
    assert (d.kind, d.message, str(d)) == (kind, message, message)
    assert d.kind in _diagnose.KINDS


def test_diagnose_refuses_what_is_not_a_loader():
    with pytest.raises(TypeError, match=r"loader must be an mploader loader \(with a stats\(\) method\) or its "
                                        r"stats\(\) dict, got int"):
        mploader.diagnose(3)


@pytest.mark.parametrize("thread_pool", [False, True])
def test_in_process_loading_is_measured_too(thread_pool):
    """num_workers=0 / thread_pool=True (Gluon face): the loop's wait is the loading."""
    n = 16
    workers = 2 if thread_pool else 0
    with mploader.DataLoader(SlowData(n), batch_size=1, num_workers=workers, thread_pool=thread_pool) as dl:
        ref_wait, ref_wall, _ = timed_epoch(dl)
        s = dl.stats()
        slow = mploader.diagnose(dl)
    with mploader.DataLoader(SlowData(n, delay_s=0), batch_size=1, num_workers=workers,
                             thread_pool=thread_pool) as dl:
        timed_epoch(dl, work_s=WORK_S)
        fast = mploader.diagnose(dl)
    assert s["epoch_batches"] == n and s["worker_busy"] == []
    assert s["wait_s"] <= ref_wait and s["wall_s"] <= ref_wall
    if not thread_pool:  # every sample was loaded inside next()
        assert s["wait_s"] >= n * SAMPLE_S * 0.99
    assert s["wait_s"] > 0.5 * s["wall_s"]
    assert slow.kind == "input-bound" and "loading batches in this process" in slow.message
    assert fast.kind == "compute-bound", fast


# ---- reports ----


def test_periodic_report_through_logging(no_leaks, caplog):
    logger = logging.getLogger("test_metrics.report")
    with mploader.DataLoader(SlowData(24, delay_s=0), batch_size=1, num_workers=1) as dl:
        dl.log_stats_every(0.05, logger=logger)
        with caplog.at_level(logging.INFO, logger="test_metrics.report"):
            _, wall, _ = timed_epoch(dl, work_s=WORK_S)
        records = [r for r in caplog.records if r.name == "test_metrics.report"]
        # 24 steps of >= 30 ms: at most one report per 50 ms of the epoch, at least a few.
        assert 2 <= len(records) <= wall / 0.05 + 2
        assert all(r.levelno == logging.INFO and r.getMessage().startswith("mploader: ") for r in records)
        # The verdict itself depends on timing (a loaded machine made this one
        # "transport-bound"): test_diagnose_* pin the rules; here, that one is given.
        last = records[-1].getMessage()
        assert "batches/s" in last and sum(f" -- {kind}: " in last for kind in _diagnose.KINDS) == 1, last
        caplog.clear()
        dl.log_stats_every(None)
        with caplog.at_level(logging.INFO, logger="test_metrics.report"):
            timed_epoch(dl, work_s=0.01)
        assert not [r for r in caplog.records if r.name == "test_metrics.report"]


def test_periodic_report_arguments():
    with mploader.DataLoader(SlowData(4), batch_size=2, num_workers=1) as dl:
        with pytest.raises(ValueError, match=r"seconds must be a non-negative number of seconds or None, got -1"):
            dl.log_stats_every(-1)
        with pytest.raises(TypeError, match=r"logger must be a logging.Logger or None, got 'x' \(str\)"):
            dl.log_stats_every(1, logger="x")
    with mploader.DataLoader(SlowData(4), batch_size=2, num_workers=0) as dl:
        with pytest.raises(ValueError, match=r"log_stats_every needs worker processes .* num_workers=0"):
            dl.log_stats_every(1)


def test_tqdm_postfix(no_leaks):
    tqdm = pytest.importorskip("tqdm")
    out = io.StringIO()
    with mploader.DataLoader(SlowData(16, delay_s=0), batch_size=1, num_workers=1) as dl:
        with tqdm.tqdm(dl, file=out, mininterval=0) as bar:
            for i, _ in enumerate(bar):
                if i % 4 == 3:
                    values = mploader.set_postfix(bar, dl)
        assert set(values) == {"wait", "busy", "batch/s", "verdict"}
        assert "verdict=" + values["verdict"] in bar.postfix
        values = mploader.set_postfix(bar, dl)  # the epoch ended: its numbers are frozen
        verdict = mploader.diagnose(dl)
        assert values["verdict"] == verdict.kind
        assert values["wait"] == f"{verdict.wait_fraction * 100:.0f} %"
        assert values["busy"] == f"{verdict.worker_busy * 100:.0f} %"
    with pytest.raises(TypeError, match="bar must be a tqdm progress bar"):
        mploader.set_postfix(object(), {})


def test_import_does_not_import_tqdm():
    code = "import sys, mploader; print('tqdm' in sys.modules, 'logging' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "False"


# ---- the benchmark harness ----


def test_bench_transports_report_the_verdict(no_leaks):
    """``mploader bench`` prints, per transport row, the verdict of its epochs."""
    peers = pytest.importorskip("mploader_bench.peers")
    transport = pytest.importorskip("mploader_bench.transport")
    data = SlowData(40, delay_s=0.005)
    batches = [[2 * b, 2 * b + 1] for b in range(20)]
    with peers.open_transport("mploader", data, workers=1) as t:
        assert t.verdict() == "unknown"
        assert sum(1 for _ in t.epoch(batches)) == 20
        assert t.verdict() == "input-bound"  # the harness's consumer does nothing
    assert t.verdict() is None  # closed
    with peers.open_transport("pickle", data, workers=1) as t:
        assert t.verdict() is None
    assert transport._most_common([None, "input-bound", "compute-bound", "input-bound"]) == "input-bound"
    assert transport._most_common([None]) is None
    assert [transport._bound_by(v) for v in (None, "transport-bound", "unknown")] == ["", "transport", "unknown"]


# ---- the Chainer face ----


def test_chainer_iterator_stats_and_verdict(no_leaks):
    n = 32
    it = mploader.MultiprocessIterator(SlowData(n), batch_size=2, repeat=False, shuffle=False, n_processes=2)
    with it:
        assert it.stats()["epoch_batches"] == 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in it:
                pass
        s = it.stats()
        verdict = mploader.diagnose(it)
    assert s["epoch_batches"] == n // 2
    assert verdict.kind == "input-bound", s
    assert sum(s["worker_busy"]) * s["wall_s"] >= n * SAMPLE_S * 0.99


@pytest.mark.parametrize("face", ["torch", "chainer"])
def test_report_asked_for_before_the_workers_start(no_leaks, caplog, face):
    """The torch and Chainer faces make their engine at the first iteration."""
    logger = logging.getLogger(f"test_metrics.{face}")
    if face == "torch":
        dl = make_loader("torch", SlowData(12, delay_s=0), 1, 1)
    else:
        dl = mploader.MultiprocessIterator(SlowData(12, delay_s=0), batch_size=1, repeat=False, shuffle=False,
                                           n_processes=1)
    dl.log_stats_every(0.01, logger=logger)
    with dl, caplog.at_level(logging.INFO, logger=logger.name):
        timed_epoch(dl, work_s=WORK_S)
    records = [r for r in caplog.records if r.name == logger.name]
    assert records and all("batches/s" in r.getMessage() for r in records)
    with pytest.raises(ValueError, match="log_stats_every needs worker processes"):
        if face == "torch":
            make_loader("torch", SlowData(4), 1, 0).log_stats_every(1)
        else:
            mploader.MultiprocessIterator(SlowData(4), batch_size=1, n_processes=0).log_stats_every(1)
