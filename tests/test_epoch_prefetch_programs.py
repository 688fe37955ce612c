"""The Gluon face with workers under random training loops (issue 27's staging, and the
pulls of the batch sampler): a program of user steps -- take batches, break and start
a new pass, peek with a second iterator, move a sampler's epoch, save a checkpoint,
load one -- runs step by step on a loader with workers (whose next epoch is staged
while the current one ends), on the same loader without workers (``num_workers=0``:
no engine, no staging) and, for which samples each batch holds, on a model of
Gluon's multi-process iterator written from MXNet's source (:class:`GluonPulls`).
Every batch, every end of a pass and every checkpoint must agree (docs/design.md,
"No gap between epochs" and "Batches in flight", *When the sampler is pulled*).
Hypothesis draws the programs (a fixed seed in the suite's default profile;
``MPLOADER_HYPOTHESIS=explore MPLOADER_PROGRAMS=500`` explores more, with ``-o timeout=0``).
"""
from __future__ import annotations

import os

import numpy as np
from _util import ProgramLoop
from hypothesis import given, settings
from hypothesis import strategies as st

import mploader
from mploader import DistributedBatchSampler
from mploader.sampler import BatchSampler, RandomSampler

N = 30   # samples: 8 batches of 4 a pass, the last one short


class Augmented:
    """Sample ``i``: ``[i, a draw from NumPy's global RNG]`` (a random augmentation: a
    batch built under another seed than its own (epoch, batch index) shows)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


CONFIGS = ("shuffle", "rollover", "distributed", "user-sampler")


def _make(config: str, num_workers: int) -> tuple[mploader.DataLoader, object]:
    """The loader of ``config`` and the sampler whose ``set_epoch`` a step may call (or None)."""
    kw: dict = {}
    sampler = None
    if config == "shuffle":
        kw = dict(batch_size=4, shuffle=True)
    elif config == "rollover":
        kw = dict(batch_size=4, shuffle=True, last_batch="rollover")
    elif config == "distributed":
        sampler = DistributedBatchSampler(N, 8, seed=5, rank=1, world_size=2)
        kw = dict(batch_sampler=sampler)
    else:
        sampler = RandomSampler(N, seed=3)
        kw = dict(batch_sampler=BatchSampler(sampler, 4))
    return mploader.DataLoader(Augmented(), num_workers=num_workers, seed=11, **kw), sampler


class Loop(ProgramLoop):
    """One loader driven by a program's steps; each step returns what the user saw."""

    def __init__(self, config: str, num_workers: int) -> None:
        self.loader, self.sampler = _make(config, num_workers)
        self.it = None
        self.saved = None

    def restart(self) -> str:
        self.it = iter(self.loader)   # the previous pass, broken off, is dropped
        return "restarted"

    def save(self) -> dict:
        """The checkpoint, less what tells the loaders apart: ``num_workers``, and what
        depends on how far the batch sampler was pulled -- how its state behaved in
        the pulls made so far, and a per-batch sampler's own state at the start of a
        pass, which still counts the pulls of the pass left before (a loader with
        workers pulls further).  :meth:`load` loads the other loader's state, so the
        two must resume alike all the same."""
        state = self.loader.state_dict()
        self.saved = state
        pulled = ("batch_sampler_mode", "batch_sampler_state") if state["batches_consumed"] == 0 else \
            ("batch_sampler_mode",)
        return {k: v for k, v in state.items() if k != "num_workers" and k not in pulled}

    def load(self, state: dict | None = None) -> str:
        if state is None:
            return "nothing saved"
        self.loader.load_state_dict(state)
        self.it = None
        return "loaded"


class GluonPulls(Loop):
    """:class:`Loop`'s steps on a model of MXNet 1.x Gluon's ``DataLoader`` with
    workers, written from ``gluon/data/dataloader.py``'s ``_MultiWorkerIter``: the
    iterator pulls ``prefetch`` batches from the batch sampler (2 per worker), and
    each ``next()`` one more before it returns the oldest pulled -- with mploader's
    one deliberate difference (docs/faces.md): the first ``prefetch`` are pulled by
    the first ``next()``, not when the iterator is made.  Over the samplers
    ``config`` builds (each ``iter()`` first moving the loader's own shuffler to the
    next epoch, as mploader's face does with ``seed=``); index lists only."""

    def __init__(self, config: str, prefetch: int) -> None:
        self.sampler = None
        self.shuffler = None
        if config in ("shuffle", "rollover"):
            self.shuffler = RandomSampler(N, seed=11)
            self.batch_sampler = BatchSampler(self.shuffler, 4, "rollover" if config == "rollover" else "keep")
        elif config == "distributed":
            self.batch_sampler = self.sampler = DistributedBatchSampler(N, 8, seed=5, rank=1, world_size=2)
        else:
            self.sampler = RandomSampler(N, seed=3)
            self.batch_sampler = BatchSampler(self.sampler, 4)
        self.prefetch = prefetch
        self.epoch = 0
        self.it = None
        self.loader = self

    def __iter__(self):
        if self.shuffler is not None:
            self.shuffler.set_epoch(self.epoch)
        self.epoch += 1
        return self._pass(iter(self.batch_sampler))

    def _pass(self, it):
        sent = [b for b in (next(it, None) for _ in range(self.prefetch)) if b is not None]
        while True:
            more = next(it, None)
            if more is not None:
                sent.append(more)
            if not sent:
                return
            yield _Rows(sent.pop(0))


class _Rows(list):
    """An index list that answers ``tolist()`` as a batch of those samples, their index in column 0."""

    def tolist(self) -> list:
        return [[i] for i in self]


def _column(seen, column: int):
    """Column ``column`` of every batch a step returned (0: the sample indices, 1: the
    augmentation draws); what is not a batch ("end of pass", a step's word) as it is."""
    if not isinstance(seen, list):
        return seen
    return [[row[column] for row in b] if isinstance(b, list) else b for b in seen]


def _check_counts(loader) -> None:
    """The staging's counters add up: dispatched ahead = taken over + dropped + still staged."""
    stats = loader.stats()
    staged = loader._engine.staged_slots() if loader._engine is not None else []
    assert stats["staged"] == stats["staged_used"] + stats["staged_dropped"] + len(staged), stats


TAKE = st.tuples(st.just("take"), st.integers(1, 10))
STEPS = st.one_of(TAKE, TAKE, st.tuples(st.just("restart")), st.tuples(st.just("peek")),
                  st.tuples(st.just("set_epoch"), st.integers(0, 3)))
CHECKPOINT_STEPS = st.one_of(TAKE, TAKE, st.tuples(st.just("restart")), st.tuples(st.just("save")),
                             st.tuples(st.just("load")))
EXAMPLES = int(os.environ.get("MPLOADER_PROGRAMS", "25"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(config=st.sampled_from(CONFIGS), program=st.lists(STEPS, min_size=1, max_size=25))
def test_random_programs_pull_the_sampler_as_gluon_and_batch_as_without_workers(config, program):
    """Step by step -- batches taken, passes broken off and started again, peeks with a
    second iterator, the sampler moved to another epoch between any two steps -- the
    loader with workers (the next epoch staged while the current one ends) returns
    the batches of Gluon's pulls (:class:`GluonPulls`: which samples, and so the
    carry of ``'rollover'`` and the epoch a pass reads from a sampler moved while it
    runs), each built as without workers (the augmentation draws of its epoch and
    batch index; not for 'rollover', whose passes differ in length from those
    without workers)."""
    staged, inline, gluon = Loop(config, 2), Loop(config, 0), GluonPulls(config, 4)
    try:
        for i, step in enumerate(program):
            got, want, upstream = staged.step(step), inline.step(step), gluon.step(step)
            assert _column(got, 0) == _column(upstream, 0), f"step {i} {step} of {program}"
            # ('rollover' carries other samples than without workers: its passes differ
            # in length, and so the epoch and batch index that seed a batch)
            if config != "rollover":
                assert _column(got, 1) == _column(want, 1), f"step {i} {step} of {program}"
        _check_counts(staged.loader)
    finally:
        staged.it = inline.it = None
        staged.loader.close()
        inline.loader.close()


@settings(max_examples=EXAMPLES, deadline=None)
@given(config=st.sampled_from([c for c in CONFIGS if c != "rollover"]),   # (its carry: the other test)
       program=st.lists(CHECKPOINT_STEPS, min_size=1, max_size=25))
def test_random_programs_with_checkpoints_give_what_the_loader_without_workers_gives(config, program):
    """Batches taken, passes broken off, checkpoints saved and loaded between any two
    steps: the loader with workers returns exactly the batches and the checkpoints of
    the loader without workers, and each resumes from the other's checkpoint (no step
    here moves a sampler while a pass runs, so how far a pass was pulled does not
    show: ``'rollover'``, whose carry does, is the other test's)."""
    staged, inline = Loop(config, 2), Loop(config, 0)
    try:
        for i, step in enumerate(program):
            if step[0] == "load":   # each loads the other's checkpoint
                got, want = staged.load(inline.saved), inline.load(staged.saved)
            else:
                got, want = staged.step(step), inline.step(step)
            assert got == want, f"step {i} {step} of {program}"
        _check_counts(staged.loader)
    finally:
        staged.it = inline.it = None
        staged.loader.close()
        inline.loader.close()


def test_a_program_of_whole_passes_takes_staged_batches_over():
    """The program test's setting does stage: three whole passes take staged batches
    over (a guard against a configuration that never stages, where the program test
    would compare two loaders without staging)."""
    loop = Loop("shuffle", 2)
    try:
        for _ in range(3):
            assert loop.take(9)[-1] == "end of pass"
        assert loop.loader.stats()["staged_used"] > 0
    finally:
        loop.loader.close()
