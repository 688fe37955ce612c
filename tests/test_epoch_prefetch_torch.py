"""No gap between epochs, the torch face (issue 27; docs/design.md, "No gap between
epochs"): with persistent workers and ``seed=``, an order fixed in advance (torch's
``SequentialSampler``, a ``RandomSampler`` with its own generator -- drawn from a copy,
so the real generator draws when torch's iterator does -- and mploader's
``DistributedBatchSampler``) has its next epoch's first batches dispatched while the
epoch ends.  Every case compares with torch's own ``DataLoader`` and with the face
without the staging, and reads the engine's counters.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mploader._scheduler  # noqa: E402
import mploader.torch as mt  # noqa: E402
from mploader import DistributedBatchSampler  # noqa: E402

EPOCHS = 4


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.tensor([i, i * i])


def _loader(cls, kind, **kw):
    ds = Indexed()
    if kind == "generator":
        return cls(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9), **kw)
    if kind == "sequential":
        return cls(ds, batch_size=3, drop_last=True, **kw)
    bs = DistributedBatchSampler(len(ds), 6, seed=2, rank=0, world_size=2)
    return cls(ds, batch_sampler=bs, **kw), bs


def _run(cls, kind, set_epoch=True, **kw):
    made = _loader(cls, kind, num_workers=2, persistent_workers=True, **kw)
    loader, bs = made if isinstance(made, tuple) else (made, None)
    out = []
    for e in range(EPOCHS):
        if bs is not None and set_epoch:
            bs.set_epoch(e)
        out.append([b.tolist() for b in loader])
    st = None
    if cls is mt.DataLoader:
        stats = loader.stats()
        st = {k: stats[k] for k in ("staged", "staged_used", "staged_dropped")}
        loader.close()
    return out, st


@pytest.mark.parametrize("kind", ["generator", "sequential", "distributed"])
def test_torch_face_epochs_identical_to_torch_and_unstaged(monkeypatch, kind):
    got, st = _run(mt.DataLoader, kind, seed=4)
    ref_torch, _ = _run(torch.utils.data.DataLoader, kind)
    monkeypatch.setattr(mploader._scheduler, "STAGE_NEXT_EPOCH", False)
    ref, st_off = _run(mt.DataLoader, kind, seed=4)
    assert got == ref == ref_torch
    assert st["staged_used"] > 0 and st["staged_dropped"] == 0, st
    assert st_off["staged"] == 0


def test_torch_face_distributed_without_set_epoch_drops_the_staged_batches():
    got, st = _run(mt.DataLoader, "distributed", set_epoch=False, seed=4)
    ref, _ = _run(torch.utils.data.DataLoader, "distributed", set_epoch=False)
    assert got == ref
    assert st["staged_used"] == 0 and st["staged_dropped"] > 0, st


@pytest.mark.parametrize("case", ["torch seeding", "global generator", "not persistent"])
def test_torch_face_stages_nothing_where_the_order_or_the_seeding_is_not_fixed(case):
    """torch's per-worker seeding (a worker's RNG stream follows the batches it builds),
    a ``RandomSampler`` drawing from torch's global RNG (which the training step draws
    from too), and workers started again every epoch: nothing staged, batches as torch."""
    kw = {"seed": None} if case == "torch seeding" else {"seed": 4}
    ds = Indexed()
    persistent = case != "not persistent"

    def epochs(cls, **extra):
        torch.manual_seed(0)
        shuffle_kw = ({"shuffle": True} if case == "global generator" else
                      {"shuffle": True, "generator": torch.Generator().manual_seed(1)})
        loader = cls(ds, batch_size=4, num_workers=2, persistent_workers=persistent, **shuffle_kw, **extra)
        out = [[b.tolist() for b in loader] for _ in range(3)]
        return out, loader
    got, loader = epochs(mt.DataLoader, **kw)
    assert loader.stats()["staged"] == 0
    loader.close()
    ref, _ = epochs(torch.utils.data.DataLoader)
    assert got == ref


def test_torch_face_break_and_state_dict_around_the_epoch_boundary(monkeypatch):
    """``break`` mid-epoch, then a new epoch; a checkpoint at an epoch's end and a few
    batches into the next: as the unstaged face (states equal), and a resumed loader
    gives the rest."""
    def run():
        loader = _loader(mt.DataLoader, "generator", num_workers=2, persistent_workers=True, seed=4)
        out = [[b.tolist() for b in loader]]
        it = iter(loader)
        out.append([next(it).tolist() for _ in range(2)])   # break
        out.append([b.tolist() for b in loader])
        at_end = loader.state_dict()
        it = iter(loader)
        head = [next(it).tolist() for _ in range(3)]
        mid = loader.state_dict()
        rest = [b.tolist() for b in it]
        used = loader.stats()["staged_used"]
        loader.close()
        return out, at_end, head, mid, rest, used
    got = run()
    monkeypatch.setattr(mploader._scheduler, "STAGE_NEXT_EPOCH", False)
    ref = run()
    # (against torch's DataLoader: test_torch_face_after_a_break_as_torch)
    assert got[:5] == ref[:5]
    assert got[5] > 0 and ref[5] == 0
    _, at_end, head, mid, rest, _ = got
    monkeypatch.setattr(mploader._scheduler, "STAGE_NEXT_EPOCH", True)
    for state, expect in ((at_end, head + rest), (mid, rest)):
        resumed = _loader(mt.DataLoader, "generator", num_workers=2, persistent_workers=True, seed=4)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == expect
        resumed.close()


@pytest.mark.parametrize("persistent", [True, False])
def test_torch_face_after_a_break_as_torch(persistent):
    """A sampler that keeps a generator (torch's ``RandomSampler``, which draws its next
    pass's ``randperm`` when its pass is pulled to the end): after a ``break`` the next
    epoch is torch's, so the face pulls it only as far as torch's iterator does (before
    the fix the deeper automatic queue pulled the whole pass, and the third epoch's
    order differed from torch's)."""
    def run(cls, **kw):
        loader = _loader(cls, "generator", num_workers=2, persistent_workers=persistent, **kw)
        out = [[b.tolist() for b in loader]]
        it = iter(loader)
        out.append([next(it).tolist() for _ in range(2)])
        out.append([b.tolist() for b in loader])
        return out
    assert run(mt.DataLoader, seed=4) == run(torch.utils.data.DataLoader)


@pytest.mark.parametrize("seed", [4, None], ids=["seed=", "torch's seeding"])
@pytest.mark.parametrize("persistent", [True, False])
def test_torch_face_after_a_break_at_every_batch_as_torch(persistent, seed):
    """A ``break`` after each possible number of batches, then a whole epoch, with a
    sampler that keeps a generator: after ``k`` batches the face has pulled the
    sampler as far as torch's iterator (``prefetch_factor * num_workers + k``), so the
    generator's state after the break, and the next epoch's order, are torch's.
    Before the fix the engine pulled one fewer: a break after batch ``len - 4 + 1``
    (7 of 10) left the pass one pull short of its end, where torch's
    ``RandomSampler`` draws once more, and the next epoch differed from torch's.
    With torch's seeding and persistent workers, the batches torch's window would
    have built after the break are built and dropped (``_RingIter._drain_abandoned``):
    its task stream pulled the sampler once more before it saw its limit, and after
    a break at batch 6 of 10 the next epoch differed from torch's (found by
    ``test_torch_face_programs.py``)."""
    def run(cls, taken, **kw):
        loader = _loader(cls, "generator", num_workers=2, persistent_workers=persistent, **kw)
        it = iter(loader)
        out = [[next(it).tolist() for _ in range(taken)]]
        del it
        out.append([b.tolist() for b in loader])
        if cls is mt.DataLoader:
            loader.close()
        return out
    for taken in range(1, 11):
        torch.manual_seed(0)   # (torch's seeding without seed=: base seeds from the generator)
        ours = run(mt.DataLoader, taken, seed=seed)
        torch.manual_seed(0)
        assert ours == run(torch.utils.data.DataLoader, taken), taken


def test_torch_face_pulls_the_sampler_when_torchs_iterator_does():
    """How many batches torch's multi-process iterator has taken from the batch sampler
    after ``iter()`` and after each ``next()`` (``prefetch_factor * num_workers`` at
    ``iter()``, one more per ``next()``): the face's, with an explicit
    ``prefetch_factor``, are the same after every ``next()``.  At ``iter()`` the face
    takes none (docs/faces.md: deliberately -- Lightning makes the iterator before it
    calls the sampler's ``set_epoch``, and a resumed epoch must read its own epoch;
    ``test_trainer_resume.py``)."""
    class Counting(torch.utils.data.Sampler):
        def __init__(self):
            self.taken = 0

        def __len__(self):
            return 10

        def __iter__(self):
            for b in range(10):
                self.taken += 1
                yield [4 * b + j for j in range(4)]

    def counts(cls):
        sampler = Counting()
        loader = cls(Indexed(), batch_sampler=sampler, num_workers=2, prefetch_factor=2)
        it = iter(loader)
        seen = [sampler.taken]
        for _ in range(8):
            next(it)
            seen.append(sampler.taken)
        del it
        if cls is mt.DataLoader:
            loader.close()
        return seen
    ours, torchs = counts(mt.DataLoader), counts(torch.utils.data.DataLoader)
    assert torchs == [4, 5, 6, 7, 8, 9, 10, 10, 10]
    assert ours == [0] + torchs[1:]
