"""Batches in flight under the default ``prefetch`` (docs/design.md, "Batches in flight").

The reference is the documented rule, observed from outside: how far the batch
sampler has been pulled ahead of the batches the caller has received.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import mploader
from mploader import _options


class Rows:
    """Sample i: a row of ``width`` uint8 equal to i % 251."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.width, i % 251, np.uint8)


class CountingBatches:
    """A batch sampler that records how many batches were taken from it."""

    def __init__(self, n_batches: int, batch_size: int) -> None:
        self.n_batches, self.batch_size = n_batches, batch_size
        self.taken = 0

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self):
        for b in range(self.n_batches):
            self.taken += 1
            yield list(range(b * self.batch_size, (b + 1) * self.batch_size))


def ahead_after(loader, sampler, received: int) -> tuple[int, list]:
    """The most batches taken from the sampler and not yet returned once a ``next()``
    call returned, during the last half of the first ``received`` calls, and every
    batch's first value.  At upstream's depth that is ``prefetch``, as torch's and
    Gluon's iterators (docs/design.md, "Batches in flight", *When the sampler is
    pulled*); a deeper queue pulls as it dispatches: ``depth`` batches in flight while
    ``next()`` waits, one of them returned, so ``depth - 1``."""
    it = iter(loader)
    firsts, ahead = [], 0
    for k in range(received):
        firsts.append(int(next(it)[0, 0]))
        if k >= received // 2:
            ahead = max(ahead, sampler.taken - (k + 1))
    rest = [int(b[0, 0]) for b in it]
    return ahead, firsts + rest


@pytest.mark.parametrize("num_workers", [1, 2])
def test_small_batches_get_deeper_queues_with_the_default_prefetch(num_workers):
    deepest = _options.AUTO_PREFETCH_PER_WORKER * num_workers
    # the depth rises by one batch per batch: it is at its deepest after `deepest` batches
    batch_size, n_batches = 8, 6 * deepest
    sampler = CountingBatches(n_batches, batch_size)
    with mploader.DataLoader(Rows(batch_size * n_batches, 16), batch_sampler=sampler,
                             num_workers=num_workers) as dl:
        ahead, firsts = ahead_after(dl, sampler, 4 * deepest)
    assert ahead == deepest - 1
    # nothing lost, nothing reordered
    assert firsts == [(b * batch_size) % 251 for b in range(n_batches)]


def test_an_explicit_prefetch_is_kept_exactly():
    sampler = CountingBatches(200, 8)
    with mploader.DataLoader(Rows(1600, 16), batch_sampler=sampler, num_workers=2, prefetch=4) as dl:
        ahead, _ = ahead_after(dl, sampler, 100)
    assert ahead == 4


def test_large_batches_keep_the_default_prefetch():
    # 4 x 256 KiB already fill SMALL_BATCHES_BYTES: the queue stays at 2 * num_workers
    width = _options.SMALL_BATCHES_BYTES // 4 // 2
    sampler = CountingBatches(30, 2)
    with mploader.DataLoader(Rows(60, width), batch_sampler=sampler, num_workers=2) as dl:
        ahead, firsts = ahead_after(dl, sampler, 20)
    assert ahead == 4
    assert firsts == [(2 * b) % 251 for b in range(30)]


def test_the_queue_shrinks_back_when_batches_grow():
    class Growing(Rows):
        def __getitem__(self, i):
            # batches 0..99 tiny, then 384 KiB a batch (2 samples of 192 KiB)
            return np.full(16 if i < 200 else 192 << 10, i % 251, np.uint8)

    deepest = _options.AUTO_PREFETCH_PER_WORKER * 2
    sampler = CountingBatches(100 + deepest + 28, 2)
    with mploader.DataLoader(Growing(2 * sampler.n_batches, 0), batch_sampler=sampler, num_workers=2) as dl:
        it = iter(dl)
        ahead = 0
        for k in range(100 + deepest + 8):
            next(it)
            if k >= 100 + deepest:  # the queue of small batches (up to `deepest`) has drained by then
                ahead = max(ahead, sampler.taken - (k + 1))
        rest = list(it)
    assert ahead == 4   # 2 * num_workers again: 1 MiB holds 2 such batches
    assert len(rest) == 20


@pytest.mark.parametrize("kw, depth", [({}, None), ({"prefetch_factor": 2}, 4), ({"in_order": False}, 3),
                                       ({"persistent_workers": True}, 4)])
def test_torch_face_default_prefetch_factor_rises_for_small_batches(kw, depth):
    """mploader.torch: with prefetch_factor left to torch's default (2), small batches
    get up to AUTO_PREFETCH_PER_WORKER per worker in flight, as many as fit
    SMALL_BATCHES_BYTES (a batch's bytes include the worker's RNG states under torch's
    seeding); an explicit prefetch_factor, in_order=False (torch's per-worker task
    cap) and persistent workers under torch's seeding (their RNG streams after a
    ``break`` depend on what was in flight: issue 22) keep torch's count (docs/faces.md).
    With ``in_order=False`` the next task is pulled when the next ``next()`` fills the
    queue, after the face has settled the result (torch's per-worker cap reads it), so
    one fewer than torch's is pulled beyond the batches returned (docs/faces.md)."""
    pytest.importorskip("torch")
    import mploader.torch

    n_batches = 12 * _options.AUTO_PREFETCH_PER_WORKER
    sampler = CountingBatches(n_batches, 8)
    kw = {"persistent_workers": False, **kw}
    with mploader.torch.DataLoader(Rows(8 * n_batches, 16), batch_sampler=sampler, num_workers=2, **kw) as dl:
        ahead, firsts = ahead_after(dl, sampler, 8 * _options.AUTO_PREFETCH_PER_WORKER)
        meter = dl._mpl_engine._scheduler.meter
        batch_bytes = meter.bytes / dl.stats()["batches"]
    if depth is None:  # the documented rule, from the bytes each batch took
        depth = min(_options.AUTO_PREFETCH_PER_WORKER * 2, int(_options.SMALL_BATCHES_BYTES // batch_bytes))
        assert depth > 4
        depth -= 1   # (the deeper queue: see ahead_after)
    assert ahead == depth
    if kw.get("in_order", True):
        assert firsts == [(b * 8) % 251 for b in range(n_batches)]
    else:
        assert sorted(firsts) == sorted((b * 8) % 251 for b in range(n_batches))


@pytest.mark.parametrize("torch_face", [False, True])
def test_large_batches_use_only_the_slots_they_need(torch_face):
    """Regression: the ring has auto_prefetch + 3 slots (35 with 2 workers) so that
    small batches can queue deep, and the allocator used to hand them out round robin:
    with large batches every one of the 35 slots was grown in turn (1.7 GB of memfd
    for 38.5 MB image batches).  The allocator takes the lowest FREE slot, so large
    batches live in the ``in_flight`` slots in flight, the one the loop holds and the
    one it just dropped (docs/design.md, "Batches in flight")."""
    batch_bytes = 2 << 20                   # 2 MiB: above SMALL_BATCHES_BYTES, depth stays 4
    sampler = CountingBatches(60, 2)
    ds = Rows(120, batch_bytes // 2)
    if torch_face:
        pytest.importorskip("torch")
        from mploader.torch import DataLoader as TorchDataLoader

        # (not persistent: persistent workers under torch's seeding keep torch's count, 7 slots)
        dl = TorchDataLoader(ds, batch_sampler=sampler, num_workers=2, persistent_workers=False)
    else:
        dl = mploader.DataLoader(ds, batch_sampler=sampler, num_workers=2)
    with dl:
        firsts = [int(b[0, 0]) for b in dl]
        stats = dl.stats()
        engine = dl._mpl_engine if torch_face else dl._engine
        # bytes the memfd holds (st_blocks: holes excluded; a grown slot's old range is
        # punched out, so stats()["shm_bytes"], the file's span, counts it still)
        held = os.fstat(engine.region.fd).st_blocks * 512
    assert firsts == [(2 * b) % 251 for b in range(60)]
    assert stats["num_slots"] == _options.AUTO_PREFETCH_PER_WORKER * 2 + 3
    # 4 in flight + 1 held + 1 just dropped, each sized to the batch (+25 % headroom at
    # most), plus the headers and the slots never grown; round robin held 35 such slots
    assert held <= 6 * batch_bytes * 1.25 + (1 << 20), (held, stats)


def test_thread_pool_pulls_at_most_prefetch_minus_one_ahead():
    """``thread_pool=True`` (docs/faces.md: a deliberate difference): a feeder thread
    pulls the batch sampler as the pool needs tasks, never more than ``prefetch - 1``
    beyond the batches taken (Gluon's thread pool pulls ``prefetch`` ahead, in
    ``next()``), and every batch comes in order."""
    sampler = CountingBatches(40, 8)
    with mploader.DataLoader(Rows(320, 16), batch_sampler=sampler, num_workers=2, prefetch=4,
                             thread_pool=True) as dl:
        it = iter(dl)
        firsts, ahead = [], []
        for k in range(30):
            firsts.append(int(next(it)[0, 0]))
            ahead.append(sampler.taken - (k + 1))
        firsts += [int(b[0, 0]) for b in it]
    assert max(ahead) <= 3, ahead
    assert firsts == [(8 * b) % 251 for b in range(40)]


class RaisingBatches(CountingBatches):
    """CountingBatches whose pull number ``at`` (1-based) raises ValueError."""

    def __init__(self, n_batches: int, batch_size: int, at: int) -> None:
        super().__init__(n_batches, batch_size)
        self.at = at

    def __iter__(self):
        for batch in super().__iter__():
            if self.taken == self.at:
                raise ValueError("sampler bug")
            yield batch


@pytest.mark.parametrize("torch_face", [False, True])
def test_a_sampler_raising_after_a_hand_off_keeps_the_batch(torch_face):
    """At upstream's depth (4) the sampler's 7th pull is made by the 3rd ``next()``,
    after its batch was handed off (docs/design.md, "Batches in flight", *When the
    sampler is pulled*): that ``next()`` raises the sampler's error, as torch's does,
    and the batch stays in the run -- the next ``next()`` returns it (torch's loses
    it) -- then the batches pulled before the error, then the pass says it cannot go
    on.  Nothing is lost or reordered."""
    sampler = RaisingBatches(10, 2, at=7)
    if torch_face:
        pytest.importorskip("torch")
        from mploader.torch import DataLoader as TorchDataLoader

        dl = TorchDataLoader(Rows(20, 4), batch_sampler=sampler, num_workers=2, prefetch_factor=2)
    else:
        dl = mploader.DataLoader(Rows(20, 4), batch_sampler=sampler, num_workers=2, prefetch=4)
    seen = []
    with dl:
        it = iter(dl)
        for _ in range(10):
            try:
                seen.append(int(next(it)[0, 0]))
            except ValueError as exc:
                seen.append(str(exc))
            except RuntimeError as exc:
                seen.append("cannot go on" if "cannot go on" in str(exc) else str(exc))
                break
    assert seen == [0, 2, "sampler bug", 4, 6, 8, 10, "cannot go on"]
