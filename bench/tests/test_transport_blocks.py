"""The transport suite's bracketed repetitions (:mod:`mploader_bench.transport_blocks`):
the order of the timed epochs, the copy-limit around a block, and merging a transport's
blocks into one record.  No timing here."""
from __future__ import annotations

import pytest

from mploader_bench.transport_blocks import bracket_rate, merge, plan

CL = "copy-limit"


def test_plan_brackets_every_block_of_every_transport_between_copy_limit_blocks():
    got = plan(["a", "b", CL, "collate"], copy_limit=CL, unbracketed=("collate",), blocks=2)
    assert got == [CL, "a", CL, "a", CL, "b", CL, "b", CL, "collate"]


def test_plan_gives_a_slow_transport_fewer_blocks():
    got = plan(["a", "slow", CL], copy_limit=CL, blocks=3, fewer={"slow": 1, "a": 7})
    assert got == [CL, "a", CL, "a", CL, "a", CL, "slow", CL]
    assert plan(["slow", CL], copy_limit=CL, blocks=2, fewer={"slow": 0}) == [CL, "slow", CL]


@pytest.mark.parametrize("names, blocks, want", [
    (["a", CL, "collate"], 0, ["a", CL, "collate"]),  # blocks=0: the former order
    (["a", "collate"], 3, ["a", "collate"]),  # no copy-limit: nothing to bracket with
    ([CL, "collate"], 2, [CL, "collate"]),  # copy-limit alone runs once
])
def test_plan_runs_each_name_once_when_there_is_nothing_to_bracket(names, blocks, want):
    assert plan(names, copy_limit=CL, unbracketed=("collate",), blocks=blocks) == want


def test_plan_names_a_bad_block_count():
    with pytest.raises(ValueError, match="blocks=-1: expected >= 0"):
        plan(["a", CL], copy_limit=CL, blocks=-1)


def test_bracket_rate_is_the_mean_of_the_copy_limit_steps_beside_it_that_ran():
    steps = [(CL, 100.0), ("a", 80.0), (CL, 200.0), ("a", 90.0), (CL, None), ("b", 5.0), ("c", 1.0)]
    assert bracket_rate(steps, 1, CL) == pytest.approx(150.0)
    assert bracket_rate(steps, 3, CL) == pytest.approx(200.0)  # the one after failed
    assert bracket_rate(steps, 5, CL) is None  # neither neighbour ran copy-limit
    assert bracket_rate(steps, 6, CL) is None


def _rec(batches, seconds, around=None, **kw):
    bps = batches / seconds
    return dict(dict(transport="a", repeat=0, batches=batches, seconds=seconds, parent_cpu_s=0.1,
                     workers_cpu_s=0.5, batches_per_s=bps, gb_per_s=bps * 2e-3, verdict=None,
                     copy_limit_batches_per_s=around, others_cpu_s=0.3, span_s=seconds + 0.01), **kw)


def test_merge_adds_the_blocks_up_and_keeps_each():
    blocks = [_rec(10, 0.5, 40.0, verdict="input"), _rec(10, 0.25, 60.0, verdict="compute")]
    got = merge(blocks)
    assert (got["batches"], got["seconds"]) == (20, pytest.approx(0.75))
    assert got["parent_cpu_s"] == pytest.approx(0.2) and got["workers_cpu_s"] == pytest.approx(1.0)
    assert got["others_cpu_s"] == pytest.approx(0.6) and got["span_s"] == pytest.approx(0.77)
    assert got["batches_per_s"] == pytest.approx(20 / 0.75)
    assert got["gb_per_s"] == pytest.approx(20 / 0.75 * 2e-3)
    assert got["copy_limit_batches_per_s"] == pytest.approx(50.0)
    assert got["verdict"] == "compute"  # the last block's
    assert [b["batches_per_s"] for b in got["blocks"]] == pytest.approx([20.0, 40.0])
    assert [b["copy_limit_batches_per_s"] for b in got["blocks"]] == [40.0, 60.0]


def test_merge_of_copy_limit_blocks_gives_each_methods_rate_over_the_repetition():
    blocks = [_rec(10, 0.1, methods_batches_per_s=dict(take=50.0, stream=100.0)),
              _rec(30, 0.2, methods_batches_per_s=dict(take=150.0, stream=150.0))]
    got = merge(blocks)
    assert got["copy_limit_batches_per_s"] is None
    # take: 40 batches in 10/50 + 30/150 = 0.4 s; stream: 40 in 0.1 + 0.2 s
    assert got["methods_batches_per_s"] == pytest.approx(dict(take=100.0, stream=40 / 0.3))


def test_merge_of_one_unbracketed_run_is_that_run():
    one = _rec(7, 0.5)
    got = merge([one])
    assert "blocks" not in got and got["workers_cpu_s"] == 0.5
    assert merge([one, _rec(7, 0.5, others_cpu_s=None)])["others_cpu_s"] is None  # unknown in one block
    assert {k: got[k] for k in one} == pytest.approx(one)
