"""Checkpoints of the PyTorch face with torch's per-worker seeding (no ``seed=``; issue
11): the workers' RNG streams survive a resume.

Every sample draws from ``random``, NumPy's global RNG (a Gaussian, so NumPy's
cached second value matters) and torch's, and carries the id and seed of the worker
that built it.  Two references:

* the uninterrupted run of the same loader (same generator seed): a loader restored
  from the state saved after any batch of two short epochs must yield exactly the
  batches that followed (values, augmentations, order);
* torch's own seeding rule, replayed in this process (:func:`check_streams`): a
  worker seeded with ``s = base_seed + id`` -- ``random.seed(s)``,
  ``torch.manual_seed(s)``, ``np.random.seed(_generate_state(base_seed, id))``, torch's
  functions -- that builds its batches one after the other must produce exactly the
  values its samples carry.  This holds whatever worker built which batch, so it
  checks ``in_order=False`` runs (whose assignment depends on timing) stitched
  across the save point: each worker must go on from where it stood.
"""
from __future__ import annotations

import contextlib
import copy
import json
import random
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata.stateful_dataloader")

import _state_util  # noqa: E402
from torch.utils.data import get_worker_info  # noqa: E402
from torch.utils.data._utils.worker import _generate_state  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from mploader import _rng_state  # noqa: E402
from mploader._state import StateMismatchError  # noqa: E402
from mploader.torch import DataLoader  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaks"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

N = 16          # samples: 8 batches of 2 per epoch
BATCH = 2
EPOCHS = 2
PER_EPOCH = N // BATCH


def draw(i):
    """The augmentation: one draw from each global RNG (NumPy's is a Gaussian)."""
    return [float(i), random.random(), float(np.random.standard_normal()), float(torch.rand(()))]


class Augmented(torch.utils.data.Dataset):
    """``([i, worker id, worker seed] as int64, [random, numpy normal, torch] as
    float64)``."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = get_worker_info()
        wid, seed = (info.id, info.seed) if info is not None else (-1, -1)
        return torch.tensor([i, wid, seed]), torch.tensor(draw(i)[1:], dtype=torch.float64)


class SometimesAugmented(Augmented):
    """Draws for every third sample only: most batches leave a worker's RNG states as
    its previous batch left them, and then do not carry them (a worker sends them
    when they changed, and with the first batch of each run)."""

    def __getitem__(self, i):
        ids, values = super().__getitem__(i) if i % 3 == 0 else (None, None)
        if ids is None:
            info = get_worker_info()
            ids = torch.tensor([i, info.id, info.seed] if info is not None else [i, -1, -1])
            values = torch.zeros(3, dtype=torch.float64)
        return ids, values


def as_list(batch):
    """A batch as ``[[i, worker id, worker seed, random, normal, torch], ...]``."""
    return [[*ids, *values] for ids, values in zip(batch[0].tolist(), batch[1].tolist())]


def make(workers, persistent=False, in_order=True, shuffle=True, dataset=None, **kw):
    return DataLoader(dataset if dataset is not None else Augmented(), batch_size=BATCH, shuffle=shuffle,
                      num_workers=workers, persistent_workers=persistent, in_order=in_order,
                      generator=torch.Generator().manual_seed(11), **kw)


def snapshot(loader):
    return _state_util.snapshot(loader)


def run_all(loader):
    return _state_util.run_all(loader, as_list, EPOCHS)


def resumed(make, state, needed):
    return _state_util.resumed(make, state, needed, as_list, EPOCHS + 1)


def replay(seed, wid, indices):
    """What a worker seeded by torch's rule draws for ``indices``, one after the other
    (this process's RNG states are put back afterwards)."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(_generate_state(seed - wid, wid))
        return [draw(i) for i in indices]
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


def check_streams(batches):
    """Every worker's samples, in the order it built them, are torch's seeding rule
    replayed (see the module docstring).  A worker answers its tasks in order, so the
    order of its batches in ``batches`` is the order it built them."""
    streams: dict[tuple, list] = {}
    for batch in batches:
        for sample in batch:
            streams.setdefault((sample[1], sample[2]), []).append(sample)
    assert streams and all(wid >= 0 for wid, _ in streams)
    for (wid, seed), samples in streams.items():
        want = replay(seed, wid, [int(s[0]) for s in samples])
        assert [[float(s[0]), *s[3:]] for s in samples] == want, (wid, seed)


def epochs_complete(batches):
    ids = [int(s[0]) for b in batches for s in b]
    assert len(ids) == EPOCHS * N
    for e in range(EPOCHS):
        assert sorted(ids[e * N:(e + 1) * N]) == list(range(N))


# ---- the capture itself ----

def test_capture_reads_what_the_public_getters_return():
    """The calibrated memory reads give the states of ``random.getstate()``,
    ``np.random.get_state()`` (with and without a cached Gaussian) and
    ``torch.get_rng_state()``, byte for byte the blob the public getters make, and
    :func:`restore` brings the three generators back."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        for step in range(4):
            random.seed(step)
            np.random.seed(step)
            torch.manual_seed(step)
            for _ in range(step):
                random.gauss(0, 1)
                np.random.standard_normal()   # odd steps leave a cached Gaussian
                torch.rand(5)
            fast = _rng_state.capture()
            state = _rng_state.to_json(fast)
            py, npy = random.getstate(), np.random.get_state()
            assert state["python"] == {"state": list(py[1]), "gauss_next": py[2]}
            assert state["numpy"] == {"key": npy[1].tolist(), "pos": npy[2], "has_gauss": npy[3], "gauss": npy[4]}
            assert npy[3] == step % 2
            assert state["torch"] == torch.random.get_rng_state().tolist()
            assert _rng_state.path() == "fast", _rng_state._Layout.reason
            with _rng_state.forced_fallback():
                assert _rng_state.path() == "fallback"
                assert _rng_state.capture() == fast
            want = [draw(0) for _ in range(3)]
            random.seed(99)
            np.random.seed(99)
            torch.manual_seed(99)
            _rng_state.restore(json.loads(json.dumps(state)))
            assert [draw(0) for _ in range(3)] == want
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


def test_capture_is_native_bytes_of_the_documented_layout():
    blob = _rng_state.capture()
    index = struct.unpack_from("=i", blob)[0]
    assert index == random.getstate()[1][-1]
    assert len(blob) == _rng_state._FIXED + torch.random.get_rng_state().numel()


# ---- resume against the uninterrupted run ----

@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_resume_at_every_position_continues_the_uninterrupted_run(workers, persistent):
    """Saved after every batch of two epochs (and before the first, and after each
    StopIteration), restored into a fresh loader with the same ``num_workers``: the
    batches that follow are the uninterrupted run's, augmentations included; that
    run is torch's seeding rule replayed."""
    with make(workers, persistent) as saved:
        states, want = run_all(saved)
    check_streams(want)
    epochs_complete(want)
    wrong = [p for p, state in enumerate(states)
             if resumed(lambda: make(workers, persistent), state, len(want) - p) != want[p:]]
    assert wrong == []


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_when_only_some_batches_draw(persistent):
    """Batches that draw nothing do not carry the worker's RNG states (the parent
    keeps the last it got): a restore after any of them still continues the run."""
    def fresh():
        return make(2, persistent, dataset=SometimesAugmented())

    with fresh() as saved:
        states, want = run_all(saved)
    epochs_complete(want)
    assert [p for p, state in enumerate(states) if resumed(fresh, state, len(want) - p) != want[p:]] == []


def test_a_checkpoint_after_an_abandoned_iterator_continues_as_the_saver_does():
    """Persistent workers: the batches in flight when an iterator is dropped are
    discarded unseen, and may have drawn; the next iterator's first batch from each
    worker carries its RNG states again, so the checkpoint holds the states the
    workers really have."""
    def fresh():
        return make(2, True, dataset=SometimesAugmented())

    with fresh() as saved:
        it = iter(saved)
        next(it)
        saved.state_dict()
        del it                                  # abandoned with batches in flight
        it = iter(saved)
        got = [as_list(next(it)) for _ in range(2)]
        state = json.loads(json.dumps(saved.state_dict()))
        rest = [as_list(b) for b in it] + [as_list(b) for b in saved]
    assert got and rest
    assert resumed(fresh, state, len(rest)) == rest


@pytest.mark.parametrize("persistent", [False, True])
def test_in_order_false_every_worker_goes_on_where_it_stood(persistent):
    """``in_order=False``: which worker builds which batch depends on timing, so the
    uninterrupted run is not a fixed reference; instead the saved run's batches up to
    the save point followed by the resumed run's must be every worker's stream
    replayed without a gap, and each epoch every sample once.  The batches in flight
    at the save go to the workers that had them."""
    def loader():
        return make(2, persistent, in_order=False, shuffle=False)   # batch b holds samples 2b, 2b + 1

    with loader() as saved:
        states, got = run_all(saved)
    check_streams(got)
    moved = 0
    for p, state in enumerate(states):
        rest = resumed(loader, state, len(got) - p)
        check_streams(got[:p] + rest)
        epochs_complete(got[:p] + rest)
        assigned = (state["worker_rng"] or {}).get("assigned", [])
        for b, w in assigned:
            built_by = next(batch[0][1] for batch in rest if batch[0][0] == BATCH * b)
            assert built_by == w, (p, b)
        moved += len(assigned)
    assert moved > 0


def test_in_flight_batches_go_back_to_their_workers():
    """The state names the batches in flight and their workers; the resumed run gives
    each to the same worker (its samples carry the worker id)."""
    with make(2) as saved:
        it = iter(saved)
        first = [as_list(next(it)) for _ in range(3)]
        state = json.loads(json.dumps(saved.state_dict()))
        rest = [as_list(b) for b in it]
    assigned = state["worker_rng"]["assigned"]
    assert assigned and [b for b, _ in assigned] == list(range(3, 3 + len(assigned)))
    assert [w for _, w in assigned] == [b % 2 for b, _ in assigned]   # torch's round robin
    with make(2) as loader:
        loader.load_state_dict(state)
        again = [as_list(b) for b in loader]
    assert again == rest
    check_streams(first + again)


def test_workers_start_after_worker_init_fn():
    """A ``worker_init_fn`` that reseeds (the usual NumPy recipe) runs first; the
    restored states are set after it, so the stream still goes on."""
    def reseed(wid):
        np.random.seed(torch.initial_seed() % 2**32)

    def loader():
        return make(2, worker_init_fn=reseed)

    with loader() as saved:
        states, want = run_all(saved)
    for p in (3, 5):
        assert resumed(loader, states[p], len(want) - p) == want[p:]


def test_another_worker_count_starts_the_workers_from_the_saved_base_seed():
    """Documented (docs/faces.md): under torch's seeding a worker's stream depends on
    the batches it built, so with another ``num_workers`` the resumed batches have
    the uninterrupted run's indices and order, and each new worker ``i`` starts from
    the saved base seed ``+ i`` (as torchdata restores every worker) -- its
    augmentations are not the uninterrupted run's.  With ``seed=`` they are
    (tests/test_state_torch.py::test_any_worker_count_with_seed)."""
    with make(2) as saved:
        states, want = run_all(saved)
    base = int(want[0][0][2]) - int(want[0][0][1])
    for workers in (1, 3):
        got = resumed(lambda w=workers: make(w), states[3], PER_EPOCH - 3)
        assert [[s[0] for s in b] for b in got] == [[s[0] for s in b] for b in want[3:PER_EPOCH]]
        assert {int(s[2]) - int(s[1]) for b in got for s in b} == {base}
        check_streams(got)
        assert got != want[3:PER_EPOCH]


def test_state_is_json_and_refuses_a_malformed_worker_state():
    with make(2) as saved:
        it = iter(saved)
        next(it)
        state = json.loads(json.dumps(saved.state_dict()))
    rng = state["worker_rng"]
    assert sorted(rng) == ["assigned", "base_seed", "next_worker", "states"]
    assert rng["states"][1] is None and set(rng["states"][0]) == {"python", "numpy", "torch"}
    bad = copy.deepcopy(state)
    bad["worker_rng"]["states"][0]["numpy"]["key"] = [1, 2]
    with make(2) as loader:
        with pytest.raises(ValueError, match=r"worker_rng\['states'\]\[0\]\['numpy'\] is not an RNG state"):
            loader.load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["worker_rng"]["assigned"] = [[1]]
    with make(2) as loader:
        with pytest.raises(StateMismatchError, match=r"worker_rng\['assigned'\] must be a list of "
                                                     r"\[batch_index, worker_id\] pairs"):
            loader.load_state_dict(bad)


def test_per_batch_seeding_carries_no_worker_state():
    """With ``seed=`` the workers send no RNG states and the state has none: each
    batch's seed is (seed, epoch, batch index)."""
    with make(2, seed=5) as loader:
        it = iter(loader)
        next(it)
        assert loader.state_dict()["worker_rng"] is None


def test_persistent_workers_resume_at_an_epoch_boundary_with_seed():
    """Regression: with persistent workers the next epoch draws no base seed from the
    generator but a fresh loader's first ``iter()`` does; a state saved between epochs
    (here with ``seed=``) used to resume with another permutation."""
    def loader():
        return make(1, persistent=True, seed=4)

    with loader() as saved:
        first = [as_list(b) for b in saved]
        state = json.loads(json.dumps(saved.state_dict()))
        want = [as_list(b) for b in saved]
    assert [s[0] for b in want for s in b] != [s[0] for b in first for s in b]
    with loader() as again:
        again.load_state_dict(state)
        assert [as_list(b) for b in again] == want


# ---- torchdata ----

def test_torchdata_restarts_every_worker_from_its_base_seed():
    """What torchdata 0.11's ``StatefulDataLoader`` does with the workers' RNGs: it
    saves the base seed and, on resume, seeds every worker ``i`` from ``base_seed +
    i`` again, so after a mid-epoch restore a worker draws what it drew at the start
    of the epoch: the indices and order are the uninterrupted run's (as ours), the
    augmentations are not (ours are)."""
    def theirs():
        return StatefulDataLoader(Augmented(), batch_size=BATCH, num_workers=2,
                                  generator=torch.Generator().manual_seed(11))

    saved = theirs()
    states, want = run_all(saved)
    check_streams(want)
    with make(2, shuffle=False) as ours:
        ours_states, ours_want = run_all(ours)
    for p in (2, 3, 5):
        got = resumed(theirs, states[p], PER_EPOCH - p)
        assert [[s[0] for s in b] for b in got] == [[s[0] for s in b] for b in want[p:PER_EPOCH]]
        assert got != want[p:PER_EPOCH]
        check_streams(got)   # a fresh start from base_seed + i: the epoch's first draws again
        assert resumed(lambda: make(2, shuffle=False), ours_states[p], PER_EPOCH - p) == ours_want[p:PER_EPOCH]


class AugmentedStream(torch.utils.data.IterableDataset):
    """Each worker's replica yields its share ``i::W`` of ``range(N)`` as
    :class:`Augmented`'s samples."""

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return (Augmented()[i] for i in range(wid, N, nw))


@pytest.mark.parametrize("persistent", [False, True])
def test_iterable_dataset_replays_the_epoch_from_the_saved_streams(persistent):
    """An IterableDataset resumes by replaying the epoch in new replicas: the workers
    start from the saved base seed and, with persistent workers, from their states as
    the epoch started, so the replayed and the following batches are the
    uninterrupted run's."""
    def loader():
        return DataLoader(AugmentedStream(), batch_size=BATCH, num_workers=2, persistent_workers=persistent,
                          generator=torch.Generator().manual_seed(11))

    with loader() as saved:
        states, want = run_all(saved)
    check_streams(want)
    epochs_complete(want)
    wrong = [p for p, state in enumerate(states) if resumed(loader, state, len(want) - p) != want[p:]]
    assert wrong == []


def test_shuffle_off_the_generator_only_seeds_the_workers():
    """Shuffle off: ``generator`` only feeds the base seeds, one per iterator; the state
    carries it apart from the sampler's (a state saved between two epochs used to
    give the next epoch the first epoch's base seed again)."""
    with make(2, shuffle=False) as saved:
        states, want = run_all(saved)
    assert len({s[2] for b in want for s in b}) == 2 * EPOCHS   # a new base seed per epoch
    p = PER_EPOCH
    assert states[p]["base_seed_generator"] is not None
    assert resumed(lambda: make(2, shuffle=False), states[p], len(want) - p) == want[p:]


class FailsAtFive(Augmented):
    """Draws its augmentation, then raises for sample 5."""

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        if i == 5:
            raise KeyError(i)
        return sample


def test_a_batch_that_raised_passes_its_worker_state_on():
    """A dataset exception consumes its batch; the worker's RNG states after it travel
    with the exception, so a state saved right after it resumes that worker's stream."""
    def loader():
        return DataLoader(FailsAtFive(), batch_size=BATCH, num_workers=2, generator=torch.Generator().manual_seed(1))

    def run(it, out):
        while True:
            try:
                out.append(as_list(next(it)))
            except KeyError:
                out.append("KeyError")
            except StopIteration:
                return out

    with loader() as saved:
        it = iter(saved)
        got = [as_list(next(it)), as_list(next(it))]
        with pytest.raises(KeyError):
            next(it)
        state = json.loads(json.dumps(saved.state_dict()))
        rest = run(it, [])
    assert state["batches_consumed"] == 3 and state["worker_rng"]["states"][0] is not None
    with loader() as again:
        again.load_state_dict(state)
        assert run(iter(again), []) == rest
    check_streams(got)


@pytest.fixture
def mp_helpers():
    """multiprocessing's resource tracker and resource sharer (which passes the ring's
    fd to spawned workers) are per-process daemons that live until exit; start them
    before ``no_leaks`` takes its snapshot (as tests/test_torch_face.py)."""
    import multiprocessing.reduction
    import multiprocessing.resource_tracker
    import os
    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.reduction.DupFd(os.dup(0))  # starts the sharer's listener


@pytest.mark.usefixtures("mp_helpers")   # function marks come before the module's no_leaks
def test_spawned_workers_get_their_states():
    """spawn: the states reach the workers inside the pickled ``worker_init``."""
    def loader():
        return make(1, multiprocessing_context="spawn")

    with loader() as saved:
        it = iter(saved)
        first = [as_list(next(it)) for _ in range(3)]
        state = json.loads(json.dumps(saved.state_dict()))
        rest = [as_list(b) for b in it]
    with loader() as again:
        again.load_state_dict(state)
        assert [as_list(b) for b in again] == rest
    check_streams(first + rest)


DRAWS = {
    "random.random": lambda: random.random(),
    "random.gauss (caches the next)": lambda: random.gauss(0, 1),
    "numpy rand": lambda: np.random.rand(),
    "numpy standard_normal (caches a Gaussian)": lambda: np.random.standard_normal(),
    "torch.rand": lambda: torch.rand(1),
    "nothing": lambda: None,
}


@pytest.mark.parametrize("calibrated", [True, False], ids=["in-place reads", "public getters"])
def test_capture_if_changed_is_none_exactly_when_capture_is_unchanged(calibrated):
    """The reference is capture() itself, compared as bytes (capture is checked
    against the public getters by the tests above)."""
    assert _rng_state.path() == "fast", _rng_state._Layout.reason
    with contextlib.nullcontext() if calibrated else _rng_state.forced_fallback():
        check_capture_if_changed()


def check_capture_if_changed():
    rng = random.Random(5)
    names = list(DRAWS) * 3
    rng.shuffle(names)
    last = _rng_state.capture()
    assert _rng_state.capture_if_changed(None) == last
    outcomes = set()
    for name in names:
        DRAWS[name]()
        now = _rng_state.capture()
        got = _rng_state.capture_if_changed(last)
        if now == last:
            assert got is None, name
        else:
            assert got == now, name
        outcomes.add(now == last)
        last = now
    assert outcomes == {True, False}
    assert _rng_state.capture_if_changed(last[:-1]) == last  # another length: changed


# ---- the fallback of the in-place reads (docs/design.md, "Per-batch seeding") ----

def test_workers_on_the_fallback_capture_the_same_states():
    """Forked workers inherit ``forced_fallback()``: they capture through the public
    getters, and the batches, the checkpoints and a resume across the two paths are
    those of the in-place reads."""
    assert _rng_state.path() == "fast", _rng_state._Layout.reason
    with make(2) as loader:
        fast = run_all(loader)
        assert loader.stats()["seeding"] == "fast"
    with _rng_state.forced_fallback():
        with make(2) as loader:
            slow = run_all(loader)
            assert loader.stats()["seeding"] == "fallback"
        assert slow == fast
        states, want = fast
        for p in (1, 4, PER_EPOCH + 3):
            assert resumed(lambda: make(2), states[p], len(want) - p) == want[p:]
    states, want = slow
    for p in (2, PER_EPOCH + 1):
        assert resumed(lambda: make(2), states[p], len(want) - p) == want[p:]


def test_per_batch_seeding_is_the_same_on_both_paths():
    """``seed=``: every batch's augmentations are those of the in-process loader, on
    both paths (torch's generator is seeded with manual_seed on both)."""
    def epochs(workers):   # [i, random, normal, torch] per sample (not the worker's id and seed)
        with make(workers, seed=5) as loader:
            return [[[s[0], *s[3:]] for s in as_list(b)] for _ in range(EPOCHS) for b in loader]

    want = epochs(0)
    assert epochs(2) == want
    with _rng_state.forced_fallback():
        assert epochs(2) == want
        assert epochs(0) == want
