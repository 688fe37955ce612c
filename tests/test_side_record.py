"""A face's side record (mploader._face.Face.side: the torch face's RNG states)
travels beside its batch -- after the descriptor in the slot, after the pickle on
the pipe -- and a tagged run hands it over as the record's last item; a face
without one gets None (issue 21 s3)."""
from __future__ import annotations

import numpy as np
import pytest

from mploader._engine import Engine
from mploader._face import Face


class Data:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return np.full(3, i, np.int64)


class Plain(Face):
    """Batches of ``np.stack`` shape, by a plan after the first of each size."""

    def load(self, dataset, indices):
        self.first = indices[0]
        return [dataset[i] for i in indices]

    def plannable(self, dataset, samples):
        return True

    def collate(self, samples, alloc):
        out = alloc((len(samples), 3), np.int64)
        out[:] = samples
        return out


class Sided(Plain):
    """:class:`Plain` with a side record naming the batch's first index; every third
    batch none (as the torch face's states when they did not change)."""

    def side(self):
        return None if self.first % 3 == 2 else f"batch from {self.first}".encode() * (1 + self.first % 4)


def expected_side(first):
    return None if first % 3 == 2 else f"batch from {first}".encode() * (1 + first % 4)


@pytest.mark.parametrize("face", [Sided, Plain])
def test_side_records_travel_beside_the_batches_in_slots_and_on_the_pipe(face):
    """Every batch is held, so the ring fills and later batches come through the
    pipe: both ways each record carries its own batch's side record."""
    engine = Engine(Data(), face(), num_workers=2, prefetch=4, shared_mem=None, timeout_s=30, seed=0,
                    num_slots=6, warn_when_full=False)
    try:
        tasks = [(0, b, [b, b + 1]) for b in range(24)]
        held = list(engine.run(tasks, tagged=True))
        stats = engine.stats()
    finally:
        engine.close()
    assert stats["slot"] >= 1 and stats["fallback_pipe"] >= 1, stats
    assert [r[1] for r in held] == list(range(24))
    for wid, b, value, failed, side in held:
        assert not failed and wid in (0, 1)
        np.testing.assert_array_equal(value, [np.full(3, b), np.full(3, b + 1)])
        assert side == (expected_side(b) if face is Sided else None), (b, side)
