"""The Gluon face resumed from a checkpoint with batches received out of order
(``batches_ahead``: the torch face's ``in_order=False`` states load into every
map-style face): its position moves past those batches when it reaches them, so a
checkpoint taken later resumes with exactly the batches not yet received.  Before
the fix its ``next()`` counted one batch per call (``_steps.serial_next``), and the
later checkpoint built the batches ahead's successors again."""
from __future__ import annotations

import numpy as np
import pytest

import mploader


class Arange:
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(2, i, np.int64)


def firsts(batches) -> list[int]:
    return [int(b[0][0]) for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("ahead", [[3], [3, 4], [5]])
def test_a_state_with_batches_ahead_counts_them_once_reached(num_workers, ahead):
    state = mploader.DataLoader(Arange(), batch_size=2).state_dict()
    state.update(batches_consumed=2, batches_ahead=ahead)
    expected = [2 * k for k in range(2, 10) if k not in ahead]   # the batches a resume builds
    with mploader.DataLoader(Arange(), batch_size=2, num_workers=num_workers) as first:
        first.load_state_dict(state)
        it = iter(first)
        got = firsts(next(it) for _ in range(3))
        assert got == expected[:3]
        later = first.state_dict()
        with mploader.DataLoader(Arange(), batch_size=2, num_workers=num_workers) as second:
            second.load_state_dict(later)
            assert firsts(second) == expected[3:], (later["batches_consumed"], later["batches_ahead"])
        assert firsts(it) == expected[3:]
