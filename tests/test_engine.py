"""The engine's own interface (mploader._engine.Engine) and its wire protocol."""
from __future__ import annotations

import collections
import os
import pickle
import signal
import struct
import threading
import time

import numpy as np
import pytest

from mploader import _protocol, _ring
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


# The record layout written from docs/design.md ("Wire protocol"), independently of
# mploader._protocol: frame length (big-endian), header, payload.
_SPEC_HEADER = struct.Struct("<qqqqII")
_INT64, _PICKLE, _RETIRE = 1, 2, 4


def spec_record(seq, slot, epoch, batch_index, indices):
    if type(indices) is list and all(type(i) is int and -2**63 <= i < 2**63 for i in indices):
        body = _SPEC_HEADER.pack(seq, slot, epoch, batch_index, _INT64, len(indices)) + \
            struct.pack(f"<{len(indices)}q", *indices)
    else:
        blob = pickle.dumps(indices, protocol=5)
        body = _SPEC_HEADER.pack(seq, slot, epoch, batch_index, _PICKLE, len(blob)) + blob
    return struct.pack("!i", len(body)) + body


@pytest.mark.parametrize("indices", [[1, 2, 3], [], [2**62, -5], [-2**63, 2**63 - 1], [[1, 2], [3]], (4, 5),
                                     np.arange(3), [2**70], [2**63], [np.int64(3), 4], [True, 2]])
def test_task_record_is_the_documented_layout_and_roundtrips(indices):
    frame = _protocol.frame_task(7, -1, 2, 11, indices)
    assert frame == spec_record(7, -1, 2, 11, indices)
    seq, slot, epoch, batch_index, got = _protocol.decode_task(frame[4:])
    assert (seq, slot, epoch, batch_index) == (7, -1, 2, 11)
    if isinstance(indices, np.ndarray):
        np.testing.assert_array_equal(got, indices)
    else:
        # the same values and the same types: numpy ints and bools are not turned into ints
        assert got == indices and type(got) is type(indices)
        assert [type(x) for x in got] == [type(x) for x in indices]


def test_int_indices_travel_as_int64_not_pickle():
    frame = _protocol.frame_task(0, 0, 0, 0, list(range(32)))
    assert len(frame) == 4 + _protocol.TASK_HEADER_BYTES + 32 * 8
    assert _SPEC_HEADER.unpack_from(frame, 4)[4] == _INT64


def test_retire_and_malformed_records():
    assert _protocol.frame_retire() == struct.pack("!i", 40) + _SPEC_HEADER.pack(-1, -1, 0, 0, _RETIRE, 0)
    assert _protocol.decode_task(_protocol.frame_retire()[4:]) is None
    good = _protocol.frame_task(0, 0, 0, 0, [1, 2])[4:]
    with pytest.raises(ValueError, match="bytes of indices"):
        _protocol.decode_task(good[:-3])
    with pytest.raises(ValueError, match="shorter than its 40-byte header"):
        _protocol.decode_task(good[:39])
    with pytest.raises(ValueError, match="unknown flags"):
        _protocol.decode_task(_SPEC_HEADER.pack(0, 0, 0, 0, 64, 0))
    with pytest.raises(ValueError, match="pickled indices, header says"):
        _protocol.decode_task(_SPEC_HEADER.pack(0, 0, 0, 0, _PICKLE, 9) + b"x")


def test_task_reader_reads_queued_records_in_one_read():
    r, w = os.pipe()
    try:
        for k in range(5):
            _protocol.write_all(w, _protocol.frame_task(k, k, 0, k, [k] * 3))
        reader = _protocol.TaskReader(r)
        assert reader.next()[0] == 0
        # the other four came with the same read(): the pipe is empty now
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
        os.set_blocking(r, True)
        assert [reader.next()[0] for _ in range(4)] == [1, 2, 3, 4]
        # records larger than the read chunk (16 bytes here), several queued
        small_chunks = _protocol.TaskReader(r, 16)
        for k in range(3):
            _protocol.write_all(w, _protocol.frame_task(k, 1, 0, k, list(range(100 * k, 100 * k + 50))))
        assert [small_chunks.next()[4][-1] for _ in range(3)] == [49, 149, 249]
        os.close(w)
        w = -1
        with pytest.raises(EOFError):
            small_chunks.next()
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_write_all_to_a_closed_pipe_raises_broken_pipe():
    r, w = os.pipe()
    os.close(r)
    try:
        with pytest.raises(BrokenPipeError):
            _protocol.write_all(w, _protocol.frame_retire())
    finally:
        os.close(w)


# ---- engine ----


def test_in_order_false_delivers_every_batch_once():
    import multiprocessing

    class Uneven(Arange):
        """Batch 0 waits until another batch reached the parent: later batches overtake it."""

        overtaken = multiprocessing.get_context("fork").Event()

        def __getitem__(self, i):
            if i < 2:
                assert self.overtaken.wait(60), "no batch overtook batch 0"
            return super().__getitem__(i)

    engine = make(dataset=Uneven())
    try:
        got = []
        for b in engine.run(tasks(12), in_order=False):
            got.append(int(b[0, 0]) // 2)
            Uneven.overtaken.set()
        assert sorted(got) == list(range(12))
        assert got[0] != 0
    finally:
        Uneven.overtaken.set()
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


def run_leaving_a_record_unsent(engine):
    """A run over 12 tasks after two batches, whose last refill's record is still
    buffered, as an interrupt between the dispatch and the send leaves it."""
    it = engine.run(tasks(12))
    assert int(next(it)[0, 0]) == 0
    sched = engine._scheduler
    sched._send_pending = lambda: None      # as if interrupted before the send
    assert int(next(it)[0, 0]) == 2         # sent by an earlier refill
    del sched._send_pending
    assert sched.pending, "the refill's record should still be buffered"
    return it


def assert_all_slots_free(engine):
    region = engine.region
    assert [region.state(s) for s in range(region.nslots)] == [_ring.STATE_FREE] * region.nslots


def test_stop_workers_forgets_task_records_not_yet_sent():
    """Task records an interrupted refill left buffered belong to the workers that
    stop_workers ends: sent to the next run's workers they would have written batches
    of the abandoned run into slots given to new tasks."""
    engine = make()
    try:
        it = run_leaving_a_record_unsent(engine)  # noqa: F841 - the run stays current until stop_workers
        sched = engine._scheduler
        engine.stop_workers()
        assert not sched.pending and not sched.unsent
        assert [int(b[0, 0]) for b in engine.run(tasks(8))] == [0, 2, 4, 6, 8, 10, 12, 14]
        assert_all_slots_free(engine)
    finally:
        engine.close()


def test_a_dead_workers_unsent_records_of_an_abandoned_run_are_dropped_with_it():
    """A worker dies with records of an abandoned run still buffered for it: the next
    run replaces it and reclaims those batches' slots, so the records must go too
    (given to another worker they would write into slots handed to new tasks)."""
    from mploader._executors import exited

    engine = make()
    try:
        it = run_leaving_a_record_unsent(engine)
        (victim,) = engine._scheduler.pending
        del it                                  # abandoned: its batches in flight are stale
        os.kill(victim.pid, signal.SIGKILL)
        assert exited([victim], 10) == [victim]
        assert [int(b[0, 0]) for b in engine.run(tasks(8))] == [0, 2, 4, 6, 8, 10, 12, 14]
        assert victim.pid not in engine.worker_pids()
        assert_all_slots_free(engine)
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


def test_send_upto_never_blocks_and_reports_how_much_reached_the_socket():
    """The scheduler sends a burst of records with one send_upto and needs to know
    which records the worker was given: all of them, what a full socket took (it
    must not block: the worker may itself be blocked sending a batch to the parent),
    or none (reader gone)."""
    import errno
    import socket

    frames = b"".join(_protocol.frame_task(k, k, 0, k, [k] * 3) for k in range(4))
    a, b = socket.socketpair()  # what multiprocessing.Pipe(duplex=True) is
    try:
        assert _protocol.send_upto(a.fileno(), frames) == (len(frames), 0)
        reader = _protocol.TaskReader(b.fileno())
        assert [reader.next()[0] for _ in range(4)] == [0, 1, 2, 3]
        big = bytes(range(256)) * (32 << 10)  # 8 MiB: far more than the socket buffers hold
        sent, err = _protocol.send_upto(a.fileno(), big)
        assert err in (errno.EAGAIN, errno.EWOULDBLOCK)
        assert 0 < sent < len(big)
        got = bytearray()
        while len(got) < sent:
            got.extend(b.recv(sent - len(got)))
        assert bytes(got) == big[:sent]          # exactly the bytes it reported, in order
        more, err = _protocol.send_upto(a.fileno(), big[sent:])
        assert more > 0                           # room again once the reader took some
        b.close()
        assert _protocol.send_upto(a.fileno(), frames) == (0, errno.EPIPE)
    finally:
        a.close()
        if b.fileno() >= 0:
            b.close()


def test_equally_loaded_workers_take_tasks_in_turn():
    """A tie in the least-loaded pick goes to the worker after the one picked last, so
    workers with equal loads take tasks in turn.  Before, it went to the first worker:
    refilled one task at a time, with workers that publish as fast as they are fed (no
    task unpublished), worker 0 got every task; with workers as the bottleneck and
    batches of equal cost, the first got a second task while the other ran dry, and the
    training loop's mean wait in the start-up suite's epoch setting was 0.41-0.55 ms
    against 0.16-0.17 in turn (docs/bench-log.md, "Ninth session: ties in the
    least-loaded pick")."""
    import collections
    import types

    from mploader._scheduler import Scheduler

    class Task:
        def __init__(self, published):
            self.is_published = published

        def published(self, region):
            return self.is_published

    workers = [types.SimpleNamespace(wid=i, retiring=False, status=None, done=0, outstanding=collections.deque())
               for i in range(3)]
    sched = Scheduler.__new__(Scheduler)
    sched.res = types.SimpleNamespace(workers=workers, region=None)
    sched.engine = types.SimpleNamespace(num_workers=3, prefetch=4)
    sched.depth = 4       # (any depth: the unpublished tasks decide)
    sched.pick_from = 0

    def pick(n, published):
        out = []
        for _ in range(n):
            w = sched._running_worker(None)
            out.append(w.wid)
            w.outstanding.append(Task(published))
        return out

    assert pick(7, published=True) == [0, 1, 2, 0, 1, 2, 0]   # every load 0 throughout: in turn
    workers[2].outstanding.append(Task(False))                # worker 2 has one task in progress
    assert pick(4, published=True) == [1, 0, 1, 0]            # it is skipped; 0 and 1 in turn
    assert pick(2, published=False) == [1, 0]                 # now all three have one unpublished
    assert pick(3, published=False) == [1, 2, 0]                # in turn from the one after the last picked


def test_a_task_goes_to_the_worker_with_the_fewest_unpublished_tasks():
    """The next task goes to the worker with the fewest tasks not yet published: a
    worker whose batches only wait to be consumed is idle (counting them as owed gave
    the task to the busy worker while the other slept).  In burst mode (a deep queue
    of small batches) too: there the count of tasks owed kept the tasks in turn when
    one worker fell behind, and the loop waited on its batches (docs/bench-log.md,
    "Twenty-second session")."""
    import collections
    import types

    from mploader._scheduler import Scheduler

    class Region:
        def __init__(self):
            self.states = {}

        def state(self, slot):
            return self.states[slot]

    class Task:
        def __init__(self, slot):
            self.slot, self.box, self.via_pipe = slot, [], False

        def published(self, region):
            return region.state(self.slot) == _ring.STATE_READY

    def worker(wid, slots):
        return types.SimpleNamespace(wid=wid, retiring=False, status=None, done=0,
                                     outstanding=collections.deque(Task(s) for s in slots))

    region = Region()
    busy, idle = worker(0, [0, 1]), worker(1, [2, 3, 4])
    region.states.update({0: _ring.STATE_READY, 1: _ring.STATE_ASSIGNED,                 # 1 unpublished
                          2: _ring.STATE_READY, 3: _ring.STATE_READY, 4: _ring.STATE_READY})  # all published
    sched = Scheduler.__new__(Scheduler)
    sched.res = types.SimpleNamespace(workers=[busy, idle], region=region)
    sched.engine = types.SimpleNamespace(num_workers=2, prefetch=4)
    sched.depth = 4
    sched.pick_from = 0
    assert sched._running_worker(None) is idle
    assert (busy.done, idle.done) == (1, 3)          # the published prefixes, cached
    region.states[1] = _ring.STATE_READY
    region.states[4] = _ring.STATE_ASSIGNED           # cannot happen in order; the cache holds
    assert sched._running_worker(None) is busy        # 0 unpublished against idle's cached 0: a tie, and
    #                                                   the pick after idle's wraps round to busy
    sched.depth = 64                                  # burst mode: still the unpublished tasks
    slow, fast = worker(0, [5, 6]), worker(1, [7, 8, 9])
    region.states.update({5: _ring.STATE_ASSIGNED, 6: _ring.STATE_ASSIGNED,
                          7: _ring.STATE_READY, 8: _ring.STATE_READY, 9: _ring.STATE_READY})
    sched.res.workers = [slow, fast]
    sched.pick_from = 0
    assert sched._running_worker(None) is fast        # 0 unpublished against 2 (owed: 3 against 2)
    retiring = worker(2, [])
    retiring.retiring = True
    sched.res.workers = [slow, fast, retiring]        # a worker retiring: the general path's pick
    assert sched._running_worker(None) is None
    assert sched._pick_worker(None) is fast
