"""``mploader.diagnose`` when the loop holds the slots (issue 25, section 4).

A loop that keeps every batch makes each new batch take a slot grown and faulted in
afresh (and the pipe once the ring is full): transport work, not loading.  It used to
be diagnosed from the workers' busy fraction alone, which such a loop puts near the
50 % threshold: "input-bound ... add workers" (the torch face, whose workers do more
per batch, crossed it) or "transport-bound ... raise prefetch", depending on the run.
The verdict now reads ``held_slots``: the reference is the test's own list of kept
batches, and an epoch shorter than the ring, so that no batch falls back to the pipe
(the fallback rule is tests/test_metrics.py's)."""
from __future__ import annotations

import numpy as np
import pytest

import mploader
from mploader import _diagnose

FACES = ["gluon", "torch"]
N = 32          # batches of one epoch: fewer than the default ring's 131 slots (the case)


class Rows:
    """``N`` rows of 16 KiB (float32): not small leaves the torch face would copy."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.full(4096, i, np.float32)


def loader_of(face):
    if face == "gluon":
        return mploader.DataLoader(Rows(), batch_size=1, num_workers=2)
    pytest.importorskip("torch")
    from mploader.torch import DataLoader
    return DataLoader(Rows(), batch_size=1, num_workers=2)


@pytest.mark.parametrize("face", FACES)
def test_a_loop_keeping_every_batch_is_transport_bound(face):
    with loader_of(face) as dl:
        kept = list(dl)
        s = dl.stats()
        verdict = mploader.diagnose(dl)
        assert [int(b[0, 0]) for b in kept] == list(range(N))
        del kept
    assert s["epoch_batches"] == N and s["epoch_no_free_slot"] == 0 and s["num_slots"] >= N
    assert s["held_slots"] == N, s        # every batch the loop received, each in a slot of its own
    assert verdict.kind == "transport-bound", s
    assert verdict.message == (
        f"transport-bound: the loop waited {verdict.wait_fraction * 100:.0f} % of the time and holds {N} of the "
        f"{s['num_slots']} slots (batches it still refers to), so each new batch needs a slot grown afresh, or the "
        "pipe once none is free; drop references to old batches or pass copy=True")


@pytest.mark.parametrize("face", FACES)
def test_a_loop_dropping_every_batch_is_not_told_it_holds_slots(face):
    with loader_of(face) as dl:
        for _ in dl:
            pass
        s = dl.stats()
    assert s["held_slots"] <= 1
    assert "holds" not in mploader.diagnose(s).message


def _stats(**kw):
    s = dict(epoch_batches=100, wait_s=3.0, wall_s=10.0, first_batch_s=0.0, worker_busy=[0.97, 0.97],
             epoch_no_free_slot=0, epoch_fallback_pipe=0, num_slots=20, held_slots=0)
    s.update(kw)
    return s


@pytest.mark.parametrize("stats, kind, holds", [
    (_stats(held_slots=10), "transport-bound", True),              # half the ring, busy workers
    (_stats(held_slots=10, worker_busy=[0.1, 0.1]), "transport-bound", True),
    (_stats(held_slots=9), "input-bound", False),                  # under half: the busy rule
    (_stats(held_slots=8, num_slots=131, epoch_batches=16), "transport-bound", True),  # half the epoch
    (_stats(held_slots=7, num_slots=131, epoch_batches=16), "input-bound", False),
    (_stats(held_slots=20, wait_s=0.5), "compute-bound", False),   # the loop does not wait
    (_stats(held_slots=1, num_slots=2), "input-bound", False),     # at least two slots held
    (_stats(held_slots=10, worker_busy=[]), "input-bound", False),  # no workers: loading in-process
])
def test_the_held_slots_rule(stats, kind, holds):
    verdict = _diagnose.diagnose(stats)
    assert (verdict.kind, "holds" in verdict.message) == (kind, holds), verdict.message
