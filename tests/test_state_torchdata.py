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
