"""Checkpoints of the PyTorch face (issue 11), differentially against torchdata 0.11's
``StatefulDataLoader``: save at every position of two short epochs (before the
first ``iter()``, after each batch, after each epoch's StopIteration), restore into
a fresh loader, and compare the batches that follow -- with each other where both
loaders yield the same order, and with each loader's own uninterrupted run."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

import _state_util  # noqa: E402
from torch.utils.data import IterableDataset, get_worker_info  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler  # noqa: E402

from mploader._state import StateMismatchError  # noqa: E402
from mploader.torch import DataLoader  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaks"),
              # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              # three workers on this two-core machine, on purpose (N -> M for every pair)
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

N = 10
BATCH = 3
EPOCHS = 2


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


class Noisy(Squares):
    """A random augmentation drawn from torch's RNG in the worker."""

    def __getitem__(self, i):
        return torch.cat([torch.tensor([float(i)]), torch.rand(2)])


class Counting(IterableDataset):
    """A stateful IterableDataset: each worker's replica reads its share ``i::W`` of
    ``range(N)`` and can save and restore where it stands."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        items = list(range(wid, N, nw))
        if self.position >= len(items):
            self.position = 0   # the previous pass ended: a new one
        while self.position < len(items):
            self.position += 1
            yield torch.tensor(items[self.position - 1])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def as_list(batch):
    return batch.tolist()


def snapshot(loader):
    return _state_util.snapshot(loader)


def run_all(loader):
    return _state_util.run_all(loader, as_list, EPOCHS)


def resumed(make, state, needed):
    return _state_util.resumed(make, state, needed, as_list, EPOCHS + 2)


def wrong_positions(make_saved, make_resumed):
    """The uninterrupted batches, and the positions whose restore does not continue them."""
    saved = make_saved()
    states, want = run_all(saved)
    if hasattr(saved, "close"):
        saved.close()
    return want, [p for p, state in enumerate(states) if resumed(make_resumed, state, len(want) - p) != want[p:]]


def check_resumes(make_saved, make_resumed):
    want, wrong = wrong_positions(make_saved, make_resumed)
    assert wrong == []
    return want


class Permuted(torch.utils.data.Sampler):
    """A fixed order, no state: both loaders fast-forward it."""

    def __init__(self):
        self.order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return N


@pytest.mark.parametrize("sampler", [None, "permuted"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_same_batches_as_torchdata(workers, sampler):
    """Shuffle off and a fixed permutation: both loaders yield the same order, so the
    batches after every restore must be the same as torchdata's."""
    def kw():
        return {"sampler": Permuted()} if sampler else {}

    def ours():
        return DataLoader(Squares(), batch_size=BATCH, num_workers=workers, **kw())

    def theirs():
        return StatefulDataLoader(Squares(), batch_size=BATCH, num_workers=min(workers, 2), **kw())

    want = check_resumes(ours, ours)
    # torchdata's run is ours and each of its restores continues it: from every position
    # both loaders resume with the same batches (comparing them again pairwise would
    # only repeat these runs and restores)
    assert check_resumes(theirs, theirs) == want


@pytest.mark.parametrize("workers,torchdata_wrong", [(0, [0, 1, 2, 3, 4]), (2, [])])
def test_shuffle_with_a_generator(workers, torchdata_wrong):
    """shuffle=True: the order comes from the generator; each loader resumes its own run
    (torchdata draws the permutation before the base seed, torch after, so the two
    orders differ).  torchdata 0.11 with ``num_workers=0`` restored from any position
    of epoch 0 goes on with an epoch 1 that differs from its uninterrupted run's (its
    sampler and the base seed draw from the one ``generator``); mploader resumes
    every position."""
    def ours():
        return DataLoader(Squares(), batch_size=BATCH, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(5))

    def theirs():
        return StatefulDataLoader(Squares(), batch_size=BATCH, shuffle=True, num_workers=workers,
                                  generator=torch.Generator().manual_seed(5))

    check_resumes(ours, ours)
    assert wrong_positions(theirs, theirs)[1] == torchdata_wrong


def test_shuffle_from_the_global_rng():
    """RandomSampler(generator=None) draws from torch's global RNG: mid-epoch states
    hold it as drawn; loading does not disturb the caller's global RNG."""
    torch.manual_seed(0)
    saved = DataLoader(Squares(), batch_size=BATCH, shuffle=True, num_workers=2)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    rest = [as_list(b) for b in it]
    saved.close()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    with DataLoader(Squares(), batch_size=BATCH, shuffle=True, num_workers=1) as loader:
        loader.load_state_dict(state)
        assert [as_list(b) for b in loader] == rest
    torch.manual_seed(123)
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_sampler_against_torchdata(workers):
    """torchdata's own stateful RandomSampler (its iterator has the state) in both.  With
    workers torchdata iterates its batch sampler twice when the iterator starts (as
    torch does), and its batch sampler draws the permutation eagerly, so the two
    orders differ there: each loader is then compared with its own run."""
    def ours():
        ds = Squares()
        return DataLoader(ds, batch_size=BATCH, num_workers=workers,
                          sampler=StatefulRandomSampler(ds, generator=torch.Generator().manual_seed(3)))

    def theirs():
        ds = Squares()
        return StatefulDataLoader(ds, batch_size=BATCH, num_workers=workers,
                                  sampler=StatefulRandomSampler(ds, generator=torch.Generator().manual_seed(3)))

    want = check_resumes(ours, ours)
    theirs_want = check_resumes(theirs, theirs)
    if workers == 0:
        assert theirs_want == want


@pytest.mark.parametrize("saved_workers", [0, 1, 2, 3])
def test_any_worker_count_with_seed(saved_workers):
    """N -> M workers for every pair in {0, 1, 2, 3}: with ``seed`` the batches,
    augmentations included, are bit-identical (torchdata refuses another count)."""
    def make(w):
        return lambda: DataLoader(Noisy(), batch_size=BATCH, shuffle=True, num_workers=w, seed=4,
                                  generator=torch.Generator().manual_seed(8))

    saved = make(saved_workers)()
    states, want = run_all(saved)
    saved.close()
    with make(0)() as ref:
        assert run_all(ref)[1] == want
    for m in (0, 1, 2, 3):
        for p, state in enumerate(states):
            assert resumed(make(m), state, len(want) - p) == want[p:], (saved_workers, m, p)


def test_in_order_false_resumes_what_was_not_received():
    with DataLoader(Squares(), batch_size=1, num_workers=2, in_order=False) as saved:
        it = iter(saved)
        got = [as_list(next(it)) for _ in range(4)]
        state = json.loads(json.dumps(saved.state_dict()))
        consumed, ahead = state["batches_consumed"], state["batches_ahead"]
        assert consumed + len(ahead) == 4
        assert sorted(x[0][0] for x in got) == sorted(list(range(consumed)) + ahead)
    with DataLoader(Squares(), batch_size=1, num_workers=1, in_order=False) as loader:
        loader.load_state_dict(state)
        rest = [as_list(b)[0][0] for b in loader]
    assert sorted(rest + [x[0][0] for x in got]) == list(range(N))


@pytest.mark.parametrize("workers,torchdata_wrong", [(0, []), (2, [5])])
def test_stateful_iterable_dataset_against_torchdata(workers, torchdata_wrong):
    """Same batches as torchdata's; mploader replays the replicas, torchdata restores
    each worker's dataset state.  torchdata 0.11 restored at position 5 (worker 0's
    replica exhausted, worker 1's not) yields batches again and loses others;
    mploader resumes every position."""
    def ours():
        return DataLoader(Counting(), batch_size=2, num_workers=workers)

    def theirs():
        return StatefulDataLoader(Counting(), batch_size=2, num_workers=workers)

    want = check_resumes(ours, ours)
    theirs_want, wrong = wrong_positions(theirs, theirs)
    assert theirs_want == want and wrong == torchdata_wrong


def test_iterable_refuses_another_worker_count():
    with DataLoader(Counting(), batch_size=2, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with DataLoader(Counting(), batch_size=2, num_workers=1) as other:
        with pytest.raises(StateMismatchError, match=r"it was saved with num_workers=2, this loader has "
                                                     r"num_workers=1 \(an IterableDataset's position lives in "
                                                     r"each worker's replica"):
            other.load_state_dict(state)


def test_snapshot_every_n_steps_is_accepted_and_changes_nothing():
    a = [as_list(b) for b in DataLoader(Squares(), batch_size=BATCH, snapshot_every_n_steps=2)]
    assert a == [as_list(b) for b in DataLoader(Squares(), batch_size=BATCH)]
    with pytest.raises(ValueError, match="snapshot_every_n_steps must be a non-negative integer or None, got -1"):
        DataLoader(Squares(), batch_size=BATCH, snapshot_every_n_steps=-1)   # (0 is accepted, as torchdata)


def test_mismatch_prints_both_values():
    with DataLoader(Squares(), batch_size=BATCH) as loader:
        state = loader.state_dict()

    class Longer(Squares):
        def __len__(self):
            return N + 1

    with DataLoader(Longer(), batch_size=BATCH) as other:
        with pytest.raises(StateMismatchError, match="it was saved with dataset_length=10, this loader has "
                                                     "dataset_length=11"):
            other.load_state_dict(state)
    assert np.asarray(state["batches_consumed"]) == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_distributed_sampler_against_torchdata(workers):
    """torchdata's StatefulDistributedSampler (its state counts the indices yielded):
    the same batches as torchdata's after every restore.  torch's BatchSampler does
    not nest its sampler's state, so the epoch is rebuilt from the sampler as new
    and fast-forwarded."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def sampler(ds):
        return StatefulDistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=4)

    def ours():
        ds = Squares()
        return DataLoader(ds, batch_size=BATCH, num_workers=workers, sampler=sampler(ds))

    def theirs():
        ds = Squares()
        return StatefulDataLoader(ds, batch_size=BATCH, num_workers=workers, sampler=sampler(ds))

    assert check_resumes(ours, ours) == check_resumes(theirs, theirs)
