"""The torch face's ``state_dict()``/``load_state_dict()`` against torchdata 0.11's
``StatefulDataLoader`` itself, case by case (issue 22 s.1): each case runs the same
scenario on both loaders (the scenarios of torchdata's own
``test/stateful_dataloader/test_state_dict.py``) and asserts that mploader gives what
torchdata gives, and that both give the uninterrupted run's batches.  Deliberate
differences (docs/faces.md, "Checkpoints") are pinned at the end."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata.stateful_dataloader")

from torch.utils.data import IterableDataset, get_worker_info  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from mploader.torch import DataLoader  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaks"),
              # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              # torchdata's fast-forward notice for datasets without state_dict
              pytest.mark.filterwarnings("ignore:Neither dataset nor iter:UserWarning")]

LOADERS = {"torchdata": StatefulDataLoader, "mploader": DataLoader}
SIZES = [0, 100, 37]   # torchdata's GeneratorIterable: worker 0's replica is empty


def identity(x):
    return x


class Generators(IterableDataset):
    """torchdata's ``GeneratorIterableNoState``: replica ``w`` yields
    ``range(sum(SIZES[:w]), sum(SIZES[:w + 1]))`` (one replica of everything without workers)."""

    def __init__(self, sizes=SIZES):
        self.sizes = sizes

    def _range(self):
        info = get_worker_info()
        if info is None:
            return 0, sum(self.sizes)
        start = sum(self.sizes[:info.id])
        return start, start + self.sizes[info.id]


class NoState(Generators):
    def __iter__(self):
        yield from range(*self._range())


class WithState(Generators):
    """torchdata's ``GeneratorIterable``: the replica's position as its state."""

    def __init__(self, sizes=SIZES):
        super().__init__(sizes)
        self.i = 0
        self.resume = None

    def __iter__(self):
        self.i, self.resume = (self.resume or 0), None
        start, stop = self._range()
        for k in range(start + self.i, stop):
            self.i += 1
            yield k

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.resume = state["i"]


def close(loader):
    if hasattr(loader, "close"):
        loader.close()


def interrupted(cls, make, interrupt, as_json=False):
    """``interrupt`` batches of one loader, its ``state_dict()``, then everything a
    fresh loader that loaded it yields."""
    loader = make(cls)
    it = iter(loader)
    out = [next(it) for _ in range(interrupt)]
    state = loader.state_dict()
    del it
    close(loader)
    if as_json:
        state = json.loads(json.dumps(state))
    loader = make(cls)
    loader.load_state_dict(state)
    out += list(loader)
    close(loader)
    return out


def check_both(make, interrupt, **kw):
    """mploader resumes as torchdata does, and both continue the uninterrupted run."""
    expected = list(make(DataLoader))
    got = {name: interrupted(cls, make, interrupt, **kw) for name, cls in LOADERS.items()}
    assert got["torchdata"] == expected
    assert got["mploader"] == expected, (len(got["mploader"]), len(expected))


# ---- IterableDatasets with workers: no batch lost or repeated ----

@pytest.mark.parametrize("dataset,num_workers,persistent,interrupt,every", [
    (NoState, 3, False, 1, 1), (NoState, 3, True, 10, 2), (NoState, 2, False, 10, 5), (NoState, 2, True, 1, 1),
    (WithState, 3, True, 1, 5), (WithState, 3, False, 10, 1), (WithState, 2, True, 10, 1),
    (WithState, 2, False, 1, 2)])
def test_iterable_dataset_with_workers_resumes_without_loss_or_repeat(dataset, num_workers, persistent, interrupt,
                                                                      every):
    def make(cls):
        return cls(dataset(), num_workers=num_workers, collate_fn=identity, persistent_workers=persistent,
                   snapshot_every_n_steps=every)
    check_both(make, interrupt)



class DrawingIterator:
    """torchdata's ``DummyIterator(shuffle=True, include_generator=True)``: each item is
    drawn with torch's RNG, and the iterator's state holds that RNG."""

    def __init__(self, samples):
        self.samples = samples
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.samples):
            raise StopIteration
        self.i += 1
        return self.samples[torch.randint(len(self.samples), (1,)).item()]

    def state_dict(self):
        return {"i": self.i, "g": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(torch.tensor(state["g"], dtype=torch.uint8))


class Drawing(Generators):
    """torchdata's ``DummyIterableDataset(shuffle=True)``: the iterator is stateful."""

    def __iter__(self):
        return DrawingIterator(list(range(*self._range())))


@pytest.mark.parametrize("dataset,batch_size,interrupt", [
    (Drawing, None, 10), (Drawing, 7, 1), (WithState, None, 10), (NoState, 7, 3)])
def test_without_workers_the_dataset_and_iterator_states_are_restored(dataset, batch_size, interrupt):
    """torchdata's single-process resume: the dataset's and ``iter(dataset)``'s own
    ``state_dict`` (here the iterator's holds torch's RNG, from which it draws) put the
    replica where it stood; without them the replica is fast-forwarded.  Before, the
    replica was always replayed from the epoch's start, with the caller's RNG as it
    was at the resume: other draws."""
    def make(cls):
        return cls(dataset(), batch_size=batch_size, num_workers=0, collate_fn=identity)
    got = {}
    for name, cls in LOADERS.items():
        torch.manual_seed(3)
        loader = make(cls)
        it = iter(loader)
        for _ in range(interrupt):
            next(it)
        state = loader.state_dict()
        expected = list(it)
        if name == "mploader":
            state = json.loads(json.dumps(state))
        torch.manual_seed(4)   # another process
        loader = make(cls)
        loader.load_state_dict(state)
        got[name] = (list(loader), expected)
    assert got["torchdata"][0] == got["torchdata"][1]
    assert got["mploader"][0] == got["mploader"][1]



def test_state_right_after_a_resumed_iter_of_persistent_workers():
    """torchdata's TestFastStateDictRequest: load a state into the running loader,
    take two batches and save again before every worker has delivered one; a fresh
    loader resumes from that state where the first run stood."""
    def make(cls):
        return cls(Drawing([25, 25, 25, 25]), num_workers=4, batch_size=4, collate_fn=identity,
                   persistent_workers=True, snapshot_every_n_steps=0)
    for name, cls in LOADERS.items():
        loader = make(cls)
        it = iter(loader)
        for _ in range(11):
            next(it)
        state = loader.state_dict()
        next(it), next(it)
        expected = list(it)
        loader.load_state_dict(state)
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
        del it
        close(loader)
        loader = make(cls)
        loader.load_state_dict(state)
        assert list(loader) == expected, name
        close(loader)


# ---- in_order=False: an IterableDataset is checkpointable ----

@pytest.mark.parametrize("persistent", [False, True])
def test_iterable_dataset_in_order_false_resumes_the_batches_not_received(persistent):
    """Which batch comes when depends on timing with ``in_order=False``: the resumed run
    gives exactly the batches the interrupted run had not received, as torchdata's."""
    def make(cls):   # (torchdata's fast-forward of a replica without state fails with in_order=False)
        return cls(WithState(), num_workers=3, collate_fn=identity, persistent_workers=persistent, in_order=False)
    expected = sorted(list(make(DataLoader)))
    got = {}
    for name, cls in LOADERS.items():
        loader = make(cls)
        it = iter(loader)
        first = [next(it) for _ in range(10)]
        state = json.loads(json.dumps(loader.state_dict())) if name == "mploader" else loader.state_dict()
        del it
        close(loader)
        loader = make(cls)
        loader.load_state_dict(state)
        got[name] = sorted(first + list(loader))
        close(loader)
    # torchdata 0.11 saves and resumes it too, but may deliver a batch twice (seen: [5]
    # twice, not persistent): only mploader is held to the uninterrupted run
    assert got["mploader"] == expected


# ---- a stateful sampler (its iterator counts what it yielded) ----

class CountingIterator:
    """torchdata's ``DummySamplerIterator``."""

    def __init__(self, size):
        self.size = size
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.size:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


class CountingSampler(torch.utils.data.Sampler):
    """torchdata's ``DummySampler``: the state lives in the iterator it returns."""

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return CountingIterator(self.size)

    def __len__(self):
        return self.size


class Items(torch.utils.data.Dataset):
    """torchdata's ``DummyMapDataset`` (unshuffled): item ``i`` is ``{"id": i, ...}``."""

    def __init__(self, size=100):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"id": i, "strcol": f"strcol_{i}", "listcol": [i, i + 1, i + 2]}


@pytest.mark.parametrize("num_workers,batch_size,interrupt,as_json", [
    (0, None, 1, False), (0, 7, 10, True), (3, None, 10, False), (3, 7, 1, True), (2, 7, 0, False)])
def test_stateful_sampler_resumes_at_the_next_sample(num_workers, batch_size, interrupt, as_json):
    def make(cls):
        return cls(Items(), sampler=CountingSampler(100), batch_size=batch_size, num_workers=num_workers,
                   collate_fn=identity)
    check_both(make, interrupt, as_json=as_json)


# ---- a state taken after iter() and before the first next() ----

class Shuffled(torch.utils.data.Dataset):
    """torchdata's ``DummyMapDataset(shuffle=True)``: each item draws its id from torch's
    RNG, and the dataset's state is that RNG's."""

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return {"id": torch.randint(100, (1,)).item()}

    def state_dict(self):
        return {"g": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        torch.set_rng_state(torch.tensor(state["g"], dtype=torch.uint8))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("dataset", ["generators", "map_shuffle"])
def test_state_before_the_first_next_resumes_the_whole_epoch(dataset, persistent):
    """torchdata's TestSnapshotZero: ``it = iter(dl); state = dl.state_dict()``, the
    epoch, then the state loaded into the same loader gives the same epoch again."""
    def make(cls):
        if dataset == "generators":
            return cls(WithState(), num_workers=3, collate_fn=identity, persistent_workers=persistent,
                       snapshot_every_n_steps=10)
        return cls(Items(), shuffle=True, num_workers=3, collate_fn=identity, persistent_workers=persistent,
                   snapshot_every_n_steps=10)
    for name, cls in LOADERS.items():
        loader = make(cls)
        it = iter(loader)
        state = loader.state_dict()
        expected = list(it)
        del it
        loader.load_state_dict(state)
        assert list(loader) == expected, name
        close(loader)


# ---- a state saved at the end of an epoch ----

@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("dataset", ["generators", "map_shuffle", "map_generator"])
def test_state_at_the_end_of_an_epoch_resumes_with_the_next_epoch(dataset, persistent):
    """torchdata's TestSnapshotEnd: a state saved after an epoch's StopIteration,
    loaded into a loader that has begun an epoch of its own, gives the next epoch."""
    def make(cls, generator=None):
        kw = dict(num_workers=3, collate_fn=identity, persistent_workers=persistent, batch_size=4)
        if dataset == "generators":
            return cls(WithState(), **kw)
        if dataset == "map_shuffle":
            return cls(Items(), shuffle=True, **kw)
        return cls(Shuffled(), generator=generator, **kw)
    for name, cls in reversed(LOADERS.items()):
        g = torch.Generator().manual_seed(4)
        loader = make(cls, g)
        first = list(loader)
        state = loader.state_dict()
        expected = list(loader)
        if dataset == "generators":
            assert expected == first, name   # a plain restart gives the same epoch again
        close(loader)
        g.manual_seed(4)
        loader = make(cls, g)
        it = iter(loader)
        next(it), next(it)
        del it
        loader.load_state_dict(state)
        got = list(loader)
        close(loader)
        if name == "torchdata" and dataset == "map_generator" and not persistent:
            continue   # torchdata 0.11 itself gives another epoch here (its workers' RNGs)
        assert got == expected, name


# ---- snapshot_every_n_steps=0 ----

def test_snapshot_every_n_steps_zero_is_accepted():
    """torchdata's TestFastStateDictRequest passes 0 (never snapshot on its own)."""
    def make(cls):
        return cls(NoState(), num_workers=3, collate_fn=identity, snapshot_every_n_steps=0)
    check_both(make, 10)
    with pytest.raises(ValueError, match="snapshot_every_n_steps must be a non-negative integer or None, got -1"):
        DataLoader(NoState(), snapshot_every_n_steps=-1)


# ---- a state through JSON ----

@pytest.mark.parametrize("num_workers", [0, 3])
def test_json_round_trip_resumes_after_an_epoch(num_workers):
    """torchdata's TestJsonSerDe: one whole epoch, then 4 batches of the next, the
    state through json.dumps/loads into a fresh loader."""
    def make(cls):
        return cls(NoState(), num_workers=num_workers, collate_fn=identity)
    for name, cls in LOADERS.items():
        if name == "torchdata" and num_workers == 0:
            continue   # (its state holds no tensor here either, but keep the case short)
        loader = make(cls)
        list(loader)
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        expected = list(it)
        del it
        close(loader)
        loader = make(cls)
        loader.load_state_dict(state)
        assert list(loader) == expected, (name, len(expected))
        close(loader)


# ---- an incompatible state is refused ----

@pytest.mark.parametrize("when", ["initial", "mid-epoch"])
@pytest.mark.parametrize("saved", ["shuffle", "counting"])
def test_a_state_of_another_sampler_is_refused(saved, when):
    """A state saved with another sampler (a RandomSampler's, a stateful sampler's)
    does not describe this loader's order: torchdata refuses it when the next epoch
    starts (an assertion); mploader refuses it in ``load_state_dict`` with a
    ValueError naming both sampler types (before: it resumed the sequential order at
    the saved count, silently)."""
    def make(cls, sampler):
        kw = {"shuffle": True} if sampler == "shuffle" else {"sampler": CountingSampler(20)} if sampler else {}
        return cls(Items(20), batch_size=4, num_workers=0, collate_fn=identity, **kw)
    for name, cls in LOADERS.items():
        loader = make(cls, saved)
        if when == "mid-epoch":
            it = iter(loader)
            next(it)
            del it
        state = loader.state_dict()
        other = make(cls, None)
        if name == "torchdata":
            with pytest.raises(AssertionError):
                other.load_state_dict(state)
                list(other)
        else:
            expected = "RandomSampler" if saved == "shuffle" else "CountingSampler"
            with pytest.raises(ValueError, match=f"sampler_type.*{expected}.*SequentialSampler"):
                other.load_state_dict(state)
            assert [b[0]["id"] for b in other] == [0, 4, 8, 12, 16]   # the loader is left as it was
        close(other)


# ---- shuffle=True without a generator: the epochs after the resumed one ----

@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_default_shuffle_epochs_after_the_resumed_one_keep_their_order(num_workers, persistent):
    """A trainer (Lightning) saves torch's global RNG with the loader's state and sets it
    back on resume; ``RandomSampler(generator=None)`` draws each epoch's seed from that
    RNG.  The resumed epoch's ``iter()`` must not move it, so the later epochs come out
    as in the uninterrupted run (torchdata's own RandomSampler keeps one generator)."""
    def make(cls):
        return cls(Items(20), shuffle=True, batch_size=3, num_workers=num_workers, collate_fn=identity,
                   persistent_workers=persistent)

    def ids(batches):
        return [[x["id"] for x in b] for b in batches]
    for name, cls in LOADERS.items():
        torch.manual_seed(0)
        loader = make(cls)
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        state, rng = loader.state_dict(), torch.get_rng_state()
        if name == "mploader":
            state = json.loads(json.dumps(state))
        expected = ids(list(it) + list(loader) + list(loader))
        del it
        close(loader)
        torch.manual_seed(1)   # another process
        loader = make(cls)
        loader.load_state_dict(state)
        torch.set_rng_state(rng)   # the trainer's own RNG restore
        got = ids(list(loader) + list(loader) + list(loader))
        close(loader)
        assert len(first) == 2 and got == expected, name


# ---- persistent workers and an epoch left early ----

class Draws(torch.utils.data.Dataset):
    """Each item is one draw from the worker's torch RNG (an augmentation)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.rand(1)


@pytest.mark.parametrize("num_workers,prefetch_factor,left_after", [(2, None, 1), (2, None, 3), (3, 3, 2)])
def test_persistent_workers_after_a_break_draw_as_torchs(num_workers, prefetch_factor, left_after):
    """torch's persistent workers build the batches in flight when an epoch is left
    (``break``, Lightning's ``limit_train_batches``) and their RNGs move on: from the
    second epoch on every worker's random stream is torch's."""
    out = {}
    for name, cls in (("torch", torch.utils.data.DataLoader), ("mploader", DataLoader)):
        loader = cls(Draws(), batch_size=1, num_workers=num_workers, persistent_workers=True,
                     prefetch_factor=prefetch_factor, generator=torch.Generator().manual_seed(7))
        epochs = []
        for _ in range(3):
            batches = []
            for batch in loader:
                batches.append(batch.tolist())
                if len(epochs) == 0 and len(batches) == left_after:
                    break
            epochs.append(batches)
        out[name] = epochs
        close(loader)
        del loader
    assert out["mploader"] == out["torch"]


# ---- deliberate differences (docs/faces.md, "Deliberate differences") ----

def test_another_worker_count_on_a_map_style_dataset_resumes_where_torchdata_asserts():
    """torchdata asserts the saved ``num_workers`` at ``iter()``; mploader's position is
    the batches received, so another count resumes the uninterrupted run's batches."""
    def make(cls, num_workers):
        return cls(Items(30), batch_size=4, num_workers=num_workers, collate_fn=identity)
    expected = list(make(DataLoader, 3))
    for name, cls in LOADERS.items():
        loader = make(cls, 3)
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        state = loader.state_dict()
        del it
        close(loader)
        other = make(cls, 2)
        other.load_state_dict(state)
        if name == "torchdata":
            with pytest.raises(AssertionError):
                iter(other)
        else:
            assert first + list(other) == expected
        close(other)
