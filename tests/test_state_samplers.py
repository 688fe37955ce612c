"""Checkpoints with samplers whose own state counts what they yielded (issue 11).

Such a sampler's ``state_dict()`` is its position within the pass, and loading it
makes the next pass continue from there (torchdata's ``StatefulDistributedSampler``
and the two samplers below).  The loaders snapshot the batch sampler's state right
after each batch is pulled and save the one of the last batch *received* (prefetch
pulls ahead); resuming restores it and skips nothing (``mploader._state.Snapshots``).

Reference: the uninterrupted run of the same loader, itself checked against the
sampler's order cut into batches; every state (before the first ``iter()``, after
each batch, after each StopIteration) is loaded into a fresh loader with a fresh
sampler, and the rest must follow epoch by epoch -- an empty or repeated pass after a
state taken between epochs shows.  Through the Gluon face (``mploader.BatchSampler``
nests the sampler's state), GluonNLP's ``ShardedDataLoader`` and the torch face
(torch's ``BatchSampler`` does not nest it; torchdata's stateful ``BatchSampler``
does), the last against torchdata 0.11's ``StatefulDataLoader``.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import mploader

pytestmark = [pytest.mark.usefixtures("no_leaks"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

N = 11
BATCH = 3
EPOCHS = 2
ORDER = [7, 2, 9, 0, 4, 10, 1, 8, 3, 6, 5]


class CountingSampler:
    """A fixed order; ``state_dict()`` is how many indices the current pass has
    yielded.  As torchdata's ``StatefulDistributedSampler``, the count is reset
    lazily, when the next pass starts (so between passes it still says "all"), and
    a loaded count is skipped by the next pass."""

    def __init__(self):
        self.yielded = 0
        self.start = None

    def __iter__(self):
        self.yielded, self.start = (self.start or 0), None
        for index in ORDER[self.yielded:]:
            self.yielded += 1
            yield index

    def __len__(self):
        return N

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self.start = state["yielded"]


class EagerCountingSampler(CountingSampler):
    """The same, resetting its count to 0 as soon as a pass ends."""

    def __iter__(self):
        yield from super().__iter__()
        self.yielded = 0


def distributed_sampler():
    torch_data = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    return torch_data.StatefulDistributedSampler(list(range(2 * N)), num_replicas=2, rank=1, shuffle=True, seed=4)


SAMPLERS = {"counting": CountingSampler, "eager": EagerCountingSampler, "torchdata": distributed_sampler}


class Dataset:
    def __len__(self):
        return 2 * N

    def __getitem__(self, i):
        return np.int64(i)


def as_list(batch):
    return np.asarray(batch).tolist()


def snapshot(loader):
    state = loader.state_dict()
    return json.loads(json.dumps(state)) if isinstance(loader, (mploader.DataLoader,)) else copy.deepcopy(state)


def run_epochs(loader, to_list=as_list):
    """The batches of each of two epochs; the state before every batch and after
    each StopIteration, with the (epoch, batch) position it was taken at."""
    states, epochs = [(0, 0, snapshot(loader))], []
    for e in range(EPOCHS):
        epochs.append([])
        for batch in loader:
            epochs[-1].append(to_list(batch))
            states.append((e, len(epochs[-1]), snapshot(loader)))
        states[-1] = (e + 1, 0, snapshot(loader))
    return states, epochs


def rest_after(epochs, e, b):
    """What follows position (epoch e, b batches received), epoch by epoch."""
    return [epochs[e][b:]] + epochs[e + 1:] if e < len(epochs) else []


def resumed_epochs(make, state, count, to_list=as_list):
    loader = make()
    loader.load_state_dict(state)
    out = [[to_list(b) for b in loader] for _ in range(count)]
    if hasattr(loader, "close"):
        loader.close()
    return out


def check_every_position(make, to_list=as_list):
    saved = make()
    states, epochs = run_epochs(saved, to_list)
    if hasattr(saved, "close"):
        saved.close()
    wrong = []
    for e, b, state in states:
        want = rest_after(epochs, e, b)
        if want and resumed_epochs(make, state, len(want), to_list) != want:
            wrong.append((e, b))
    assert wrong == []
    return epochs


def order_in_batches(sampler, last_batch="keep"):
    """The reference order: the sampler's pass cut into batches."""
    order = list(sampler)
    batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    return batches if last_batch == "keep" or len(batches[-1]) == BATCH else batches[:-1]


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("workers", [0, 2])
def test_gluon_face_resumes_a_counting_sampler(sampler, workers):
    def make():
        return mploader.DataLoader(Dataset(), batch_size=BATCH, sampler=SAMPLERS[sampler](), num_workers=workers,
                                   prefetch=4 if workers else None)

    epochs = check_every_position(make)
    assert epochs == [order_in_batches(SAMPLERS[sampler]())] * EPOCHS


@pytest.mark.parametrize("sampler", ["counting", "eager"])
def test_gluon_rollover_carries_over_a_counting_sampler(sampler):
    """'rollover': the carried indices open the next pass; the counting sampler's
    position and the carry are both restored."""
    def make():
        return mploader.DataLoader(Dataset(), batch_size=BATCH, sampler=SAMPLERS[sampler](), last_batch="rollover",
                                   num_workers=1)

    epochs = check_every_position(make)
    assert [i for e in epochs for b in e for i in b] == (ORDER * EPOCHS)[:len(epochs[0] + epochs[1]) * BATCH]


def test_sharded_loader_resumes_a_counting_sampler():
    def make():
        return mploader.ShardedDataLoader(Dataset(), batch_size=BATCH, sampler=CountingSampler(), num_workers=2)

    assert check_every_position(make) == [order_in_batches(CountingSampler())] * EPOCHS


def test_the_state_is_the_last_received_batchs_not_the_last_pulled():
    """Prefetch pulls four batches ahead; the state after one batch says three
    indices were yielded, and the rebuilt stream starts at batch 1."""
    with mploader.DataLoader(Dataset(), batch_size=BATCH, sampler=CountingSampler(), num_workers=2,
                             prefetch=4) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    assert state["batch_sampler_state"]["sampler"] == {"yielded": BATCH}
    assert (state["batches_consumed"], state["batch_sampler_position"]) == (1, 1)


@pytest.mark.parametrize("sampler,count", [(CountingSampler, N), (EagerCountingSampler, 0)])
def test_between_passes_a_lazily_reset_count_starts_a_whole_pass(sampler, count):
    """Between epochs a lazily reset sampler still says it yielded everything (the
    eager one says 0).  Loaded, that state makes the next pass empty, while the saved
    loader's next pass is whole: a per-batch state with nothing received whose
    resumed pass is empty is started again, once -- so the first epoch after the
    resume is whole either way, and the next one too."""
    with mploader.DataLoader(Dataset(), batch_size=BATCH, sampler=sampler()) as loader:
        list(loader)
        state = json.loads(json.dumps(loader.state_dict()))
        want = [as_list(b) for b in loader]
    assert state["batch_sampler_state"]["sampler"] == {"yielded": count}
    assert state["batch_sampler_mode"] == "per batch"
    assert resumed_epochs(lambda: mploader.DataLoader(Dataset(), batch_size=BATCH, sampler=sampler()), state,
                          2) == [want, want]


def test_a_per_pass_state_is_still_taken_once_per_pass():
    """mploader's own samplers describe a whole pass: resumed from the epoch's start
    state and skipped (two snapshots a pass decide it)."""
    with mploader.DataLoader(Dataset(), batch_size=BATCH, shuffle=True, seed=3, num_workers=0) as loader:
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
        snaps = loader._ckpt.progress.snaps
        assert snaps.mode == "per pass" and not snaps.after
    assert (state["batches_consumed"], state["batch_sampler_position"], state["batch_sampler_mode"]) == \
        (2, 0, "per pass")


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("last_batch", ["keep", "discard", "rollover"])
@pytest.mark.parametrize("length", [BATCH - 1, BATCH, BATCH + 1, 2 * BATCH, 2 * N])
def test_a_sampler_per_pass_by_construction_is_not_snapshotted_and_saves_the_same_states(
        monkeypatch, shuffle, last_batch, length):
    """``mploader.BatchSampler`` over a ``SequentialSampler`` or a seeded ``RandomSampler``
    declares its state per pass (``_state_tokens_per_pass``): its pulls take no
    snapshot, and the state dict at every position, passes of 0, 1, 2 and more batches
    included, is the one the general path (two snapshots decide) gives."""
    class Short(Dataset):
        def __len__(self):
            return length

    def states():
        with mploader.DataLoader(Short(), batch_size=BATCH, shuffle=shuffle, seed=3, last_batch=last_batch,
                                 num_workers=0) as loader:
            return run_epochs(loader)

    peeks = []
    real_peek = mploader._state.peek
    monkeypatch.setattr(mploader._state, "peek", lambda obj: peeks.append(obj) or real_peek(obj))
    fixed = states()
    assert len(peeks) == 2 * EPOCHS   # the batch sampler and its iterator at each epoch's start, no more
    peeks.clear()
    monkeypatch.setattr(mploader.BatchSampler, "_state_tokens_per_pass", False)
    general = states()
    if length >= 2 * BATCH:   # (two pulls a pass, each snapshotted, decide per pass)
        assert len(peeks) == (2 + 4) * EPOCHS
    assert fixed == general


# ---- the torch face, against torchdata ----

def torch_batches(batch):
    return batch.tolist()


def torchdata_random_sampler():
    """torchdata's ``RandomSampler``: its iterator's state counts the indices yielded
    and holds the generator's state (a tensor)."""
    torch = pytest.importorskip("torch")
    torch_data = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    return torch_data.RandomSampler(list(range(N)), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS) + ["torchdata random"])
@pytest.mark.parametrize("workers", [0, 2])
def test_torch_face_resumes_a_counting_sampler_as_torchdata(workers, sampler, nested):
    """``nested``: torchdata's stateful ``BatchSampler`` as ``batch_sampler`` (it nests
    the sampler's state; its iterator counts the samples yielded).  Ours resumes every
    position epoch by epoch; torchdata's batches after each restore are the same
    (taken across its passes: torchdata 0.11 resumed between epochs with a nested
    counting sampler yields an empty pass first).  "torchdata random": torchdata's
    ``RandomSampler``, whose iterator draws the permutation when it is made and keeps
    the generator's state in its own state."""
    torch = pytest.importorskip("torch")
    td = pytest.importorskip("torchdata.stateful_dataloader")
    from mploader.torch import DataLoader

    make_sampler = torchdata_random_sampler if sampler == "torchdata random" else SAMPLERS[sampler]

    def kw():
        s = make_sampler()
        if nested:
            return {"batch_sampler": td.sampler.BatchSampler(s, BATCH, False)}
        return {"sampler": s, "batch_size": BATCH}

    class TorchDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 2 * N

        def __getitem__(self, i):
            return i

    def ours():
        return DataLoader(TorchDataset(), num_workers=workers, **kw())

    def theirs():
        return td.StatefulDataLoader(TorchDataset(), num_workers=workers, **kw())

    epochs = check_every_position(ours, torch_batches)
    if sampler != "torchdata random":   # its order moves on with its generator
        assert epochs == [order_in_batches(make_sampler())] * EPOCHS
    saved = theirs()
    states, theirs_epochs = run_epochs(saved, torch_batches)
    if sampler != "torchdata random" or workers == 0:
        assert theirs_epochs == epochs
    # (with workers torch's iterator iterates the batch sampler twice and torchdata's
    # RandomSampler draws a permutation each time; torchdata's loader does not)
    for e, b, state in states:
        want = [x for epoch in rest_after(theirs_epochs, e, b) for x in epoch]
        got = [x for epoch in resumed_epochs(theirs, state, EPOCHS + 1, torch_batches) for x in epoch]
        assert got[:len(want)] == want, (e, b)


class Unsavable(CountingSampler):
    """A counting sampler whose ``state_dict`` fails once the pass has gone far."""

    def state_dict(self):
        if self.yielded > 2 * BATCH:
            raise RuntimeError(f"cannot save after {self.yielded} indices")
        return super().state_dict()


def test_a_state_dict_failing_mid_pass_fails_state_dict_not_iteration():
    with mploader.DataLoader(Dataset(), batch_size=BATCH, sampler=Unsavable()) as loader:
        it = iter(loader)
        got = [as_list(next(it))]
        assert loader.state_dict()["batch_sampler_state"]["sampler"] == {"yielded": BATCH}
        got += [as_list(next(it)), as_list(next(it))]   # the third pull's snapshot failed
        with pytest.raises(RuntimeError, match="cannot save after 9 indices"):
            loader.state_dict()
        got += [as_list(b) for b in it]
        assert got == order_in_batches(CountingSampler())
        with pytest.raises(RuntimeError, match="cannot save after 11 indices"):
            loader.state_dict()   # between passes: the sampler's state as it is
