"""The engine's own interface (mploader._engine.Engine) and its wire protocol."""
from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np
import pytest

from mploader import _protocol
from mploader._engine import Engine
from mploader._errors import WorkerTraceback, is_batch_error


class Arange:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return np.full(3, i, np.int64)


def fetch_stack(dataset, indices, alloc):
    out = alloc((len(indices), 3), np.int64)
    for k, i in enumerate(indices):
        out[k] = dataset[i]
    return out


_WORKER = {}


def remember_worker(worker_id, num_workers):
    _WORKER["id"] = worker_id
    _WORKER["n"] = num_workers


def fetch_worker_id(dataset, indices, alloc):
    return np.array([_WORKER["id"], _WORKER["n"], os.getpid()], np.int64)


def failing_init(worker_id, num_workers):
    raise KeyError(f"init of worker {worker_id}")


def make(fetch=fetch_stack, dataset=None, **kw):
    opts = dict(num_workers=2, prefetch=4, shared_mem=None, timeout_s=30, seed=0)
    opts.update(kw)
    return Engine(Arange() if dataset is None else dataset, fetch, **opts)


def tasks(n, size=2, **extra):
    return [(0, b, list(range(b * size, b * size + size))) for b in range(n)]


# ---- wire protocol ----


@pytest.mark.parametrize("indices", [[1, 2, 3], [], [2**62, -5], [[1, 2], [3]], (4, 5), np.arange(3), [2**70]])
def test_task_roundtrip(indices):
    msg = _protocol.encode_task(7, 3, 2, 11, indices)
    task = _protocol.decode_task(memoryview(msg))
    assert (task.seq, task.slot, task.epoch, task.batch_index) == (7, 3, 2, 11)
    if isinstance(indices, np.ndarray):
        np.testing.assert_array_equal(task.indices, indices)
    else:
        assert task.indices == indices and type(task.indices) is type(indices)


def test_int_indices_travel_as_int64_not_pickle():
    msg = _protocol.encode_task(0, 0, 0, 0, list(range(32)))
    assert len(msg) == _protocol.TASK.size + 32 * 8
    assert _protocol.TASK.unpack_from(msg)[4] == _protocol.INDICES_INT64


def test_retire_and_malformed_messages():
    assert _protocol.decode_task(memoryview(_protocol.encode_retire())) is None
    bad = bytearray(_protocol.encode_task(0, 0, 0, 0, [1, 2]))
    with pytest.raises(ValueError, match="bytes of indices"):
        _protocol.decode_task(memoryview(bytes(bad[:-3])))


def test_task_reader_reads_queued_messages_in_one_read():
    import multiprocessing
    a, b = multiprocessing.Pipe()
    try:
        for k in range(5):
            a.send_bytes(_protocol.encode_task(k, k, 0, k, [k] * 3))
        reader = _protocol.TaskReader(b.fileno())
        first = _protocol.decode_task(memoryview(reader.next()))
        assert first.seq == 0
        # the other four came with the same read(): they are already buffered
        assert len(reader.buf) - reader.pos == 4 * (4 + _protocol.TASK.size + 24)
        assert [_protocol.decode_task(memoryview(reader.next())).seq for _ in range(4)] == [1, 2, 3, 4]
        a.close()
        with pytest.raises(EOFError):
            reader.next()
    finally:
        a.close()
        b.close()


# ---- engine ----


def test_in_order_false_delivers_every_batch_once():
    class Uneven(Arange):
        def __getitem__(self, i):
            if i < 2:
                time.sleep(0.2)  # batch 0 is slow: later batches overtake it
            return super().__getitem__(i)

    engine = make(dataset=Uneven())
    try:
        got = [int(b[0, 0]) // 2 for b in engine.run(tasks(12), in_order=False)]
        assert sorted(got) == list(range(12))
        assert got[0] != 0
    finally:
        engine.close()


def test_worker_init_runs_in_each_worker_and_pinned_tasks_run_there():
    engine = make(fetch=fetch_worker_id, worker_init=remember_worker, num_workers=3)
    try:
        pinned = [(0, b, [b], b % 3) for b in range(9)]
        out = [b.tolist() for b in engine.run(pinned)]
        assert [o[0] for o in out] == [b % 3 for b in range(9)]
        assert {o[1] for o in out} == {3}
        pid_of = {o[0]: o[2] for o in out}
        assert sorted(pid_of.values()) == sorted(engine.worker_pids())
    finally:
        engine.close()


def test_worker_init_exception_is_raised_with_its_type_for_each_batch():
    engine = make(worker_init=failing_init, num_workers=1)
    try:
        run = engine.run(tasks(2))
        for _ in range(2):
            with pytest.raises(KeyError, match="init of worker 0") as info:
                next(run)
            assert is_batch_error(info.value)
            cause = info.value.__cause__
            assert isinstance(cause, WorkerTraceback) and cause.worker_id == 0 and "worker_init" in cause.stage
        with pytest.raises(StopIteration):
            next(run)
    finally:
        engine.close()


def test_worker_exception_cause_names_worker_batch_and_indices():
    class Bad(Arange):
        def __getitem__(self, i):
            if i == 5:
                raise IndexError("sample five")
            return super().__getitem__(i)

    engine = make(dataset=Bad(), num_workers=1)
    try:
        run = engine.run(tasks(4))
        assert next(run)[0, 0] == 0 and next(run)[0, 0] == 2
        with pytest.raises(IndexError, match="sample five") as info:
            next(run)
        cause = info.value.__cause__
        assert (cause.worker_id, cause.batch, cause.indices) == (0, 2, [4, 5])
        assert "IndexError: sample five" in cause.traceback
        assert next(run)[0, 0] == 6  # the error consumed only its own batch
    finally:
        engine.close()


def test_stop_workers_then_next_run_starts_new_ones():
    engine = make()
    try:
        assert [int(b[0, 0]) for b in engine.run(tasks(4))] == [0, 2, 4, 6]
        before = set(engine.worker_pids())
        engine.stop_workers()
        assert engine.worker_pids() == []
        assert [int(b[0, 0]) for b in engine.run(tasks(4))] == [0, 2, 4, 6]
        assert not before & set(engine.worker_pids())
    finally:
        engine.close()


def test_prefetch_beyond_the_ring_is_refused_at_construction():
    with pytest.raises(ValueError, match="prefetch must be at most"):
        make(prefetch=5000)


def test_close_racing_next_raises_only_the_documented_error():
    """close() from another thread while next() waits or was just woken: next()
    returns a batch, ends the epoch, or raises RuntimeError -- never another error."""
    outcomes: collections.Counter = collections.Counter()
    for trial in range(200):
        engine = make(num_workers=1, prefetch=2)
        run = engine.run(tasks(50))
        errors = []

        def consume(run=run, errors=errors):
            try:
                for _ in run:
                    pass
                outcomes["finished"] += 1
            except RuntimeError as e:
                assert "closed" in str(e), e
                outcomes["closed"] += 1
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
                errors.append(e)

        t = threading.Thread(target=consume)
        t.start()
        if trial % 2:
            time.sleep(0.0005 * (trial % 7))  # vary where in the epoch close() lands
        engine.close()
        t.join(10)
        assert not t.is_alive()
        assert not errors, errors
    assert outcomes["closed"] > 0


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_workers_map_the_region_and_give_the_same_batches(method, request):
    """spawn/forkserver: the dataset and fetch are pickled, the region's memfd is passed
    and attached; the batches equal the forked workers' (zero-copy views of the slot)."""
    engine = make(start_method=method, worker_init=remember_worker)
    # multiprocessing's fork server and resource tracker (started by spawn) stay
    # children of this process for the rest of the session: stop them afterwards, so
    # later tests that count children see none.
    import multiprocessing.forkserver as fs
    import multiprocessing.resource_tracker as rt
    request.addfinalizer(getattr(rt._resource_tracker, "_stop", lambda: None))
    request.addfinalizer(getattr(fs._forkserver, "_stop", lambda: None))
    try:
        got = [b.copy() for b in engine.run(tasks(6))]
        np.testing.assert_array_equal(np.concatenate(got)[:, 0], np.arange(12))
        batch = next(engine.run(tasks(1)))
        root = batch
        while isinstance(root, np.ndarray):
            root = root.base
        assert type(root).__name__ == "SlotLease"
    finally:
        engine.close()


def test_parent_spins_only_where_a_core_is_spare(monkeypatch):
    from mploader import _waiting
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert _waiting.spin_for(15) == _waiting.SPIN_S
    assert _waiting.spin_for(16) == 0.0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert _waiting.spin_for(1) == _waiting.SPIN_S and _waiting.spin_for(2) == 0.0
