"""Streaming columns of a batch plan (``_columns.BatchPlan.fill`` with a column of at
least ``STREAM_MIN_BYTES``): the plan's checks run over every sample first, then the
streaming rows are copied in one block with the GIL released (issue 24).  The bytes
must be NumPy's (``np.stack`` of the arrays, ``np.asarray`` of the labels), at odd row
lengths and offsets; a batch the plan refuses leaves the streaming column unwritten.
"""
from __future__ import annotations

import numpy as np
import pytest

from mploader import _columns

B = 4
ROW = _columns.STREAM_MIN_BYTES // B + 13  # odd: each row's unaligned head and tail
OFFSET = 3                                 # the column starts at an address not 16-aligned
LABELS = OFFSET + B * ROW + 5              # the int64 column after it
DESC = b"descriptor bytes"
DESC_OFF = LABELS + 8 * B + 3


def _plan() -> _columns.BatchPlan:
    fields = [(_columns.PLAN_KINDS["array"], np.ndarray, np.dtype(np.uint8), (ROW,), ROW, OFFSET),
              (_columns.PLAN_KINDS["int"], int, None, (), 8, LABELS)]
    return _columns.BatchPlan(B, True, fields, DESC, DESC_OFF)


def _samples(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, ROW, dtype=np.uint8), int(rng.integers(-2**40, 2**40))) for _ in range(B)]


def _columns_of(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, bytes]:
    arrays = buf[OFFSET:OFFSET + B * ROW].reshape(B, ROW)
    labels = buf[LABELS:LABELS + 8 * B].view(np.int64)
    return arrays, labels, buf[DESC_OFF:DESC_OFF + len(DESC)].tobytes()


@pytest.mark.skipif(not _columns.HAVE_STREAM, reason="no streaming stores in this build")
def test_a_streaming_column_is_numpys_batch_of_its_samples():
    plan = _plan()
    assert plan.total == DESC_OFF + len(DESC)
    buf = np.full(plan.total + 64, 0xA5, np.uint8)
    for seed in range(3):  # the same slot written again, as a ring's slot is
        samples = _samples(seed)
        assert plan.fill(samples, buf.ctypes.data, len(buf)) is True
        arrays, labels, desc = _columns_of(buf)
        np.testing.assert_array_equal(arrays, np.stack([a for a, _ in samples]))
        np.testing.assert_array_equal(labels, np.asarray([y for _, y in samples], np.int64))
        assert desc == DESC
        assert (buf[:OFFSET] == 0xA5).all() and (buf[plan.total:] == 0xA5).all()  # nothing outside


@pytest.mark.skipif(not _columns.HAVE_STREAM, reason="no streaming stores in this build")
@pytest.mark.parametrize("bad", ["shape", "dtype", "label type"])
def test_a_batch_the_plan_refuses_leaves_the_streaming_column_unwritten(bad):
    """The checks of every sample come before any streaming row is copied: a batch
    whose last sample is off the plan returns False having copied none of its rows
    (the caller collates it the generic way into the same slot)."""
    plan = _plan()
    buf = np.full(plan.total, 0xA5, np.uint8)
    samples = _samples(7)
    a, y = samples[-1]
    samples[-1] = {"shape": (a[:-1], y), "dtype": (a.view(np.int8), y), "label type": (a, float(y))}[bad]
    assert plan.fill(samples, buf.ctypes.data, len(buf)) is False
    arrays, _, desc = _columns_of(buf)
    assert (arrays == 0xA5).all()
    assert desc != DESC
