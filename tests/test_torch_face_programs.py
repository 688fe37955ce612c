"""The torch face against torch 2.13's own ``DataLoader`` under random training loops:
a program of user steps -- take batches, break and start a new pass, peek with a
second iterator, move a ``DistributedSampler`` to another epoch -- runs step by step on
``mploader.torch.DataLoader`` and on ``torch.utils.data.DataLoader`` with the same
arguments (2 workers, torch's seeding: each batch's augmentation is drawn from its
worker's torch RNG).  Every batch and every end of a pass must be torch's: which
samples, in which order, with which draws (docs/faces.md, PyTorch).  Hypothesis draws
the programs (a fixed seed in the suite's default profile;
``MPLOADER_HYPOTHESIS=explore MPLOADER_PROGRAMS=300`` explores more, with ``-o timeout=0``).
"""
from __future__ import annotations

import os

import pytest
from _util import ProgramLoop
from hypothesis import assume, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import mploader.torch as mt  # noqa: E402

N = 22   # samples: 6 batches of 4 a pass (the last one short), 3 of them per rank


class Augmented(torch.utils.data.Dataset):
    """Sample ``i``: ``[i, a draw from the worker's torch RNG]``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([i, int(torch.randint(0, 1 << 30, ()))])


class Stream(torch.utils.data.IterableDataset):
    """Each worker's replica yields its share ``[i, a draw from its torch RNG]``, i = w, w + 2, ... < N."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, N, step):
            yield torch.tensor([i, int(torch.randint(0, 1 << 30, ()))])


CONFIGS = ("generator", "generator/persistent", "distributed/persistent", "sequential", "iterable",
           "iterable/persistent", "drop_last/persistent")


def _make(cls, config: str, num_workers: int = 2, **extra):
    """The loader of ``config`` for ``cls`` and the sampler a set_epoch step moves (or None)."""
    kind, _, persistent = config.partition("/")
    kw = dict(num_workers=num_workers, persistent_workers=bool(persistent) and num_workers > 0, **extra)
    sampler = None
    if kind == "generator":
        kw.update(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9))
    elif kind == "distributed":
        sampler = torch.utils.data.DistributedSampler(Augmented(), num_replicas=2, rank=1, shuffle=True, seed=3)
        kw.update(batch_size=4, sampler=sampler)
    elif kind == "iterable":
        return cls(Stream(), batch_size=3, **kw), None
    elif kind == "drop_last":
        kw.update(batch_size=5, shuffle=True, drop_last=True)
    else:
        kw.update(batch_size=4)
    return cls(Augmented(), **kw), sampler


class Loop(ProgramLoop):
    """One loader driven by a program's steps; each step returns what the user saw."""

    def __init__(self, cls, config: str, num_workers: int = 2, **extra) -> None:
        # (torch's seeding draws each pass's base seed from the global RNG without a generator)
        torch.manual_seed(0)
        self.loader, self.sampler = _make(cls, config, num_workers, **extra)
        self.it = None

    #: The loader's newest pass was started and has not ended (left early or not): a
    #: checkpoint now describes it, and a loader that loads it continues it.
    under_way = False

    #: The newest pass is a peek's (left after one batch), not the one ``it`` goes on with.
    peeked = False

    def started(self) -> None:
        # (a peek's pass, left after one batch; or the live one's, reset by torch's persistent iterator)
        self.under_way = True
        self.peeked = False

    def peek(self) -> list:
        out = super().peek()
        self.peeked = True
        return out

    def ended(self) -> None:
        self.under_way = False

    def restart(self) -> list:
        """Break, and take the new pass's first batch (every iterator is stepped: one
        that is made and dropped unstepped draws nothing from a sampler's generator
        here, where torch's draws a permutation -- docs/faces.md, deliberately)."""
        self.it = iter(self.loader)
        self.started()
        return self.take(1)

    def close(self) -> None:
        self.it = None
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


TAKE = st.tuples(st.just("take"), st.integers(1, 8))
STEPS = st.one_of(TAKE, TAKE, TAKE, st.tuples(st.just("restart")), st.tuples(st.just("peek")),
                  st.tuples(st.just("set_epoch"), st.integers(0, 3)))


@settings(max_examples=int(os.environ.get("MPLOADER_PROGRAMS", "12")), deadline=None)
@given(config=st.sampled_from(CONFIGS), program=st.lists(STEPS, min_size=1, max_size=12))
def test_random_programs_give_torchs_batches(config, program):
    ours, torchs = Loop(mt.DataLoader, config), None
    try:
        got = [ours.step(step) for step in program]
        ours.close()
        torchs = Loop(torch.utils.data.DataLoader, config)
        want = [torchs.step(step) for step in program]
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"step {i} {program[i]} of {program}"
    finally:
        ours.close()
        if torchs is not None:
            torchs.close()



CHECKPOINT_CONFIGS = ("generator", "generator/persistent", "distributed/persistent", "sequential")


@settings(max_examples=int(os.environ.get("MPLOADER_PROGRAMS", "12")), deadline=None)
@given(config=st.sampled_from(CHECKPOINT_CONFIGS), program=st.lists(STEPS, min_size=1, max_size=12),
       at=st.integers(0, 12), workers=st.sampled_from([0, 1, 2]))
def test_random_programs_resume_from_a_checkpoint_as_uninterrupted(config, program, at, workers):
    """A checkpoint taken between any two steps (``state_dict()``, an iterator live or
    not), loaded into a new loader with 0, 1 or 2 workers that runs the rest of the
    program: every batch after it, augmentations included (``seed=``), is the
    uninterrupted loader's (docs/faces.md, PyTorch, *Checkpoints*).  The sampler's
    epoch is the user's to restore (``set_epoch``, as Lightning does); a loader with
    persistent workers resumes into one with workers (without, torch's iterators
    draw from a ``generator`` at other times), and into another worker count only
    where no pass is left early (torch's iterators with other counts pull such a pass
    to other points, and a ``RandomSampler`` draws from its generator at a pass's
    end)."""
    if workers != 2:
        # Another worker count pulls a pass left early less far, and a generator's
        # draw at the end of a pass with it: torch's later epochs differ the same way.
        program = [s for s in program if s[0] not in ("restart", "peek")] or [("take", 1)]
    at = min(at, len(program))
    if workers == 0 and config.endswith("/persistent"):
        # (torch draws the base seed from a generator once with persistent workers, at every iter() without)
        workers = 1
    whole, rest = Loop(mt.DataLoader, config, seed=4), None
    try:
        seen, state, live = [], None, False
        for i, step in enumerate(program):
            if i == at:
                state, live = whole.loader.state_dict(), whole.under_way
                # (a checkpoint describes the newest pass: after a peek, the peek's)
                assume(not live or (whole.it is not None and program[at][0] == "take" and not whole.peeked))
            seen.append(whole.step(step))
        if state is None:
            state, live = whole.loader.state_dict(), whole.under_way
        # A pass saved under way is continued by the resumed loader's first iter(), as
        # torchdata's: where the program left that pass (a break, a peek's pass) and
        # started another, the two runs part by design; so the programs here go on
        # with the pass under way (a batch of it taken) or saved none.
        whole.close()
        rest = Loop(mt.DataLoader, config, workers, seed=4)
        epochs = [s[1] for s in program[:at] if s[0] == "set_epoch"]
        if epochs and rest.sampler is not None:
            rest.sampler.set_epoch(epochs[-1])
        rest.loader.load_state_dict(state)
        if live:
            rest.it = iter(rest.loader)
        for i in range(at, len(program)):
            assert rest.step(program[i]) == seen[i], f"step {i} {program[i]} of {program}, saved before step {at}"
    finally:
        whole.close()
        if rest is not None:
            rest.close()
