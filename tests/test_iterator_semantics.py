"""Iterator semantics training code relies on (issue 26): an exhausted iterator stays
exhausted, a peek inside the loop leaves the training iterator alone, a ``break``
stops the abandoned iterator's work, threads sharing an iterator get every batch
once, and a daemon thread iterating at interpreter exit exits quietly.  Where torch
runs the same case, torch 2.13's DataLoader is the reference.
"""
from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest
from test_faults import run_case

import mploader
from mploader import _ring

try:
    import torch
    from torch.utils.data import DataLoader as TorchDataLoader

    from mploader.torch import DataLoader as MplTorchDataLoader
except ImportError:  # the core suite runs without torch: the torch face's cases skip
    torch = None


@pytest.fixture(autouse=True)
def _torch_cases_need_torch(request):
    if torch is None and "torch" in request.node.name:
        pytest.skip("the torch face's case needs torch")

N, B = 40, 4   # samples, batch size: 10 batches an epoch


class Arange:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.full(3, i, np.int64)


def firsts(batches):
    return [int(b[0][0]) for b in batches]


def first(batch):
    return int(batch[0][0])


def torch_faces(persistent):
    kw = dict(batch_size=B, num_workers=2, persistent_workers=persistent)
    return TorchDataLoader(Arange(), **kw), MplTorchDataLoader(Arange(), **kw)


# ---- an exhausted iterator raises StopIteration again ----

def stop_iteration_twice(it):
    batches = list(it)
    outcome = []
    for _ in range(2):
        try:
            next(it)
            outcome.append("batch")
        except StopIteration:
            outcome.append("StopIteration")
    return firsts(batches), outcome


@pytest.mark.parametrize("persistent", [False, True])
def test_exhausted_torch_face_iterator_raises_stop_iteration_again_as_torch(persistent):
    ref_loader, loader = torch_faces(persistent)
    with loader:
        expected = stop_iteration_twice(iter(ref_loader))
        assert expected == (list(range(0, N, B)), ["StopIteration", "StopIteration"])
        assert stop_iteration_twice(iter(loader)) == expected
        # ... also after a newer iterator of the same loader took the workers (with
        # persistent workers both are one iterator, reset: it yields the new epoch)
        assert exhausted_then_newer(loader) == exhausted_then_newer(ref_loader)


def exhausted_then_newer(loader):
    it = iter(loader)
    list(it)
    newer = iter(loader)
    try:
        old = first(next(it))
    except StopIteration:
        old = "StopIteration"
    return old, firsts(newer)


def test_exhausted_gluon_iterator_raises_stop_iteration_again():
    with mploader.DataLoader(Arange(), batch_size=B, num_workers=2) as loader:
        it = iter(loader)
        assert stop_iteration_twice(it) == (list(range(0, N, B)), ["StopIteration", "StopIteration"])
        newer = iter(loader)
        with pytest.raises(StopIteration):
            next(it)
        assert firsts(newer) == list(range(0, N, B))


# ---- a peek inside the training loop ----

def loop_with_peek(loader, peek_at=2):
    """The first sample of every batch of one epoch, with ``next(iter(loader))``'s
    batch recorded as ("peek", first sample) after batch ``peek_at``."""
    got = []
    for k, batch in enumerate(loader):
        got.append(first(batch))
        if k == peek_at:
            got.append(("peek", first(next(iter(loader)))))
    return got


@pytest.mark.parametrize("persistent", [False, True])
def test_peek_mid_epoch_torch_face_as_torch(persistent):
    """Without persistent workers each torch iterator has workers of its own, so the
    training iterator goes on; with them ``iter()`` resets the one iterator (the
    training loop then continues from the peek's epoch, as in torch)."""
    ref_loader, loader = torch_faces(persistent)
    with loader:
        expected = loop_with_peek(ref_loader)
        got = loop_with_peek(loader)
        assert got == expected
        if not persistent:
            assert expected == [0, 4, 8, ("peek", 0), *range(12, N, B)]
            assert firsts(loader) == list(range(0, N, B))   # the loader's workers serve the next epoch


def test_peek_mid_epoch_torch_face_shuffled_as_torch():
    """The peek draws its order from the loader's generator, as torch's."""
    kw = dict(batch_size=B, num_workers=2, shuffle=True)
    ref = TorchDataLoader(Arange(), generator=torch.Generator().manual_seed(5), **kw)
    with MplTorchDataLoader(Arange(), generator=torch.Generator().manual_seed(5), **kw) as loader:
        assert loop_with_peek(loader) == loop_with_peek(ref)


def test_peek_mid_epoch_gluon_leaves_the_training_iterator_alone():
    """Gluon's iterators share the loader's worker pool and coexist; here the newer one
    runs on workers of its own while the older is under way (docs/faces.md)."""
    with mploader.DataLoader(Arange(), batch_size=B, num_workers=2) as loader:
        assert loop_with_peek(loader) == [0, 4, 8, ("peek", 0), *range(12, N, B)]
        pids = set(loader.worker_pids())
        assert firsts(loader) == list(range(0, N, B))
        assert set(loader.worker_pids()) == pids   # the loader kept its workers


def test_peek_iterator_run_to_its_end_closes_its_own_workers():
    with mploader.DataLoader(Arange(), batch_size=B, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        peek = iter(loader)
        assert firsts(peek) == list(range(0, N, B))
        assert peek._own_engine is not None and peek._own_engine.closed
        assert firsts(it) == list(range(B, N, B))


# ---- threads sharing one iterator ----

@pytest.mark.parametrize("face", ["gluon", "torch"])
def test_two_threads_sharing_an_iterator_get_every_batch_once_in_order(face):
    n = 400
    data = np.arange(n, dtype=np.int64).reshape(n, 1)
    if face == "gluon":
        loader = mploader.DataLoader(data, batch_size=2, num_workers=2)
    else:
        loader = MplTorchDataLoader(data, batch_size=2, num_workers=2)
    got: dict[int, list] = {0: [], 1: []}
    errors = []
    with loader:
        it = iter(loader)
        start = threading.Barrier(2)

        def take(k):
            start.wait()
            try:
                for batch in it:
                    got[k].append(int(batch[0][0]))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=take, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(got[0] + got[1]) == list(range(0, n, 2))   # every batch exactly once
    assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])   # each thread's in order


# ---- a daemon thread iterating at interpreter exit ----

@pytest.mark.parametrize("face", ["gluon", "torch"])
def test_daemon_thread_iterating_at_exit_exits_quietly(face):
    """The main thread returns while a daemon thread waits in ``next()``; the
    engine's finalizer stops the workers at exit.  Before the fix the daemon thread
    printed ``OSError: wait slot ...: Bad file descriptor`` (or ``AttributeError:
    'NoneType' object has no attribute 'wait'``) on stderr."""
    loader = "mploader.torch.DataLoader" if face == "torch" else "mploader.DataLoader"
    proc = run_case(f"""
        {"import mploader.torch" if face == "torch" else ""}
        class Slow(Arange):
            def __getitem__(self, i):
                time.sleep(0.002)
                return super().__getitem__(i)
        loader = {loader}(Slow(10**6), batch_size=4, num_workers=2)
        started = threading.Event()
        def loop():
            for b in loader:
                started.set()
        threading.Thread(target=loop, daemon=True).start()
        assert started.wait(30)
        print("OK")
    """)
    assert proc.stdout.splitlines()[-1] == "OK"
    assert proc.stderr == ""


# ---- break: the abandoned iterator's work stops at once ----

class Counted:
    """Batch ``b`` (samples ``b*B .. b*B+B-1``) counts one build in shared memory when
    its first sample is loaded; each sample takes a while, so tasks queue up."""

    def __init__(self):
        self.builds = multiprocessing.Array("q", N // B, lock=False)

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i % B == 0:
            self.builds[i // B] += 1
        time.sleep(0.005)   # (makes loading slow, so that tasks queue; synchronises nothing)
        return np.full(3, i, np.int64)


def wait_all_published(engine, deadline_s=30):
    """Poll the ring until no slot is ASSIGNED (every task sent has been published,
    built or skipped), against a deadline."""
    region = engine.region
    end = time.monotonic() + deadline_s
    while any(region.state(s) == _ring.STATE_ASSIGNED for s in range(region.nslots)):
        assert time.monotonic() < end, "the workers never finished the tasks they were sent"
        time.sleep(0.01)   # polling shared state against a deadline, not synchronising


@pytest.mark.parametrize("face", ["gluon", "torch"])
def test_break_stops_the_abandoned_iterators_work(face):
    """After ``break`` the workers build at most the batch each was loading (before:
    every batch in flight, 8 here; torch's non-persistent iterator stops its workers
    at once).  Counted in shared memory, not timed."""
    ds = Counted()
    workers = 2
    if face == "gluon":
        loader = mploader.DataLoader(ds, batch_size=B, num_workers=workers, prefetch=8)
    else:
        loader = MplTorchDataLoader(ds, batch_size=B, num_workers=workers, prefetch_factor=4)
    with loader:
        for k, _ in enumerate(loader):
            if k == 2:
                break
        at_break = sum(ds.builds)
        engine = loader._engine if face == "gluon" else loader._mpl_engine
        wait_all_published(engine)
        assert sum(ds.builds) - at_break <= workers, list(ds.builds)
        assert len(engine.worker_pids()) == workers   # the workers stay, idle
        assert firsts(loader) == list(range(0, N, B))   # and serve the next epoch


def test_two_threads_sharing_a_chainer_iterator_get_every_batch_once_in_order():
    n = 400
    it = mploader.MultiprocessIterator(np.arange(n), 2, repeat=False, shuffle=False, n_processes=2)
    got: dict[int, list] = {0: [], 1: []}
    errors = []
    start = threading.Barrier(2)

    def take(k):
        start.wait()
        try:
            for batch in it:
                got[k].append(int(batch[0]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=take, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        it.finalize()
    assert errors == []
    assert sorted(got[0] + got[1]) == list(range(0, n, 2))   # every batch exactly once
    assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])   # each thread's in order
