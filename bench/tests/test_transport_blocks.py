"""The transport suite's bracketed repetitions (:mod:`mploader_bench.transport_blocks`):
the order of the timed epochs, the copy-limit around a block, and merging a transport's
blocks into one record.  No timing here."""
from __future__ import annotations

import pytest

from mploader_bench import transport, transport_report
from mploader_bench.transport_blocks import BUS_LEVEL_CHANGE, bracket_rate, bracket_values, merge, plan

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


def test_bracket_values_are_the_copy_limit_steps_beside_it_that_ran_in_order():
    steps = [(CL, 100.0), ("a", 80.0), (CL, 200.0), ("a", 90.0), (CL, None), ("b", 5.0), ("c", 1.0)]
    assert bracket_values(steps, 1, CL) == [100.0, 200.0]
    assert bracket_values(steps, 3, CL) == [200.0]
    assert bracket_values(steps, 5, CL) == [] and bracket_values(steps, 6, CL) == []


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
    assert got["copy_limit_range"] is None  # (no copy_limit_around given)
    got = merge([_rec(10, 0.5, 40.0, copy_limit_around=[30.0, 50.0]),
                 _rec(10, 0.5, 55.0, copy_limit_around=[50.0, 60.0])])
    assert got["copy_limit_range"] == [30.0, 60.0]
    assert [b["copy_limit_around"] for b in got["blocks"]] == [[30.0, 50.0], [50.0, 60.0]]


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


def test_a_missed_share_names_its_repetitions_and_whether_the_bus_changed_level():
    """(issue 24) Repetitions under the target are listed with the copy-limit blocks
    beside theirs: the 11:37 run of 2026-11-27 had one at 0.81 while copy-limit went
    from 544 to 947 large batches/s, and one at 0.83 on one level."""
    def rec(repeat, bps, around, span):
        return dict(repeat=repeat, batches_per_s=bps, copy_limit_batches_per_s=around, copy_limit_range=span)

    by = {("large", "a"): [rec(0, 600.0, 640.0, [615.0, 672.0]),          # 0.94
                           rec(1, 500.0, 600.0, [590.0, 610.0]),          # 0.83, one level
                           rec(2, 641.0, 791.0, [544.0, 947.0])],         # 0.81, the bus changed level
          ("large", "torch"): [rec(k, 50.0, None, None) for k in range(3)]}
    got = transport._below(by, "large", "a", CL, 0.85)
    assert [(b["repeat"], round(b["value"], 3), b["bus_changed"]) for b in got] == [(1, 0.833, False),
                                                                                 (2, 0.81, True)]
    assert got[1]["copy_limit_range"] == [544.0, 947.0]
    assert 947.0 >= BUS_LEVEL_CHANGE * 544.0 and 610.0 < BUS_LEVEL_CHANGE * 590.0
    assert transport._below(by, "large", "a", "torch", 4.0) == []   # 12x torch and more
    x_torch = transport._below(by, "large", "a", "torch", 12.5)
    assert [(b["repeat"], b["value"], b["copy_limit_range"], b["bus_changed"]) for b in x_torch] == [
        (0, 12.0, None, None), (1, 10.0, None, None)]
    text = transport_report._below_text(got)
    assert text == (" (repetition 2: 0.83; copy-limit beside its blocks 590-610 batches/s, one level; "
                    "repetition 3: 0.81; copy-limit beside its blocks 544-947 batches/s, the bus changed level)")
    assert transport_report._below_text([]) == "" and transport_report._below_text(None) == ""


def test_the_summary_lists_the_repetitions_each_every_repetition_target_missed():
    """(issue 24) ``_summarise`` puts :func:`transport._below` under each of the
    large-batch targets that must hold in every repetition, and the printed report
    names them after the verdict."""
    def rec(name, repeat, bps, around=None, span=None):
        return dict(size="large", transport=name, repeat=repeat, batches=100, seconds=100 / bps,
                    parent_cpu_s=0.1, workers_cpu_s=1.0, batches_per_s=bps, gb_per_s=bps * 0.0385,
                    verdict=None, others_cpu_s=0.0, span_s=100 / bps, copy_limit_batches_per_s=around,
                    copy_limit_range=span)

    runs = []
    for k, (cl, fast) in enumerate([(600.0, False), (800.0, True)]):
        span = [590.0, 610.0] if not fast else [560.0, 900.0]
        torch_face = (0.86 if not fast else 0.8) * cl
        runs += [rec("mploader", k, 0.9 * cl, cl, span), rec("mploader.torch", k, torch_face, cl, span),
                 rec("torch", k, 45.0), rec("copy-limit", k, cl), rec("collate-limit", k, 300.0)]
    names = ["mploader", "mploader.torch", "torch", "copy-limit", "collate-limit"]
    large = dict(size="large", cache="resident", distinct_samples=4, pool_bytes=600e3)
    report = dict(runs=runs, errors={}, mismatches=[], config=dict(workers=2, repeats=2, transports=names),
                  machine=dict(usable_cores=2), sizes=dict(large=large), medians={}, ratios={},
                  paired_ratios={}, targets=[], share_targets=[], every_run_targets=[])
    transport._summarise(report)
    got = {(t["transport"], t["what"]): t for t in report["every_run_targets"]}
    assert set(got) == {(f, w) for f in ("mploader", "mploader.torch") for w in (CL, "torch")}
    assert got[("mploader", CL)]["met"] and got[("mploader", CL)]["below"] == []
    miss = got[("mploader.torch", CL)]
    assert miss["met"] is False
    assert [(b["repeat"], round(b["value"], 2), b["copy_limit_range"], b["bus_changed"]) for b in miss["below"]] == [
        (1, 0.8, [560.0, 900.0], True)]
    assert got[("mploader.torch", "torch")]["met"] and got[("mploader.torch", "torch")]["below"] == []
    lines: list[str] = []

    class PlainConsole:   # not rich's: the plain-text report
        def print(self, text: str, **_: object) -> None:
            lines.append(text)

    transport_report._print_report(report, transport_report._Out(PlainConsole()))
    missed = [x for x in lines if "mploader.torch share of copy-limit" in x]
    assert len(missed) == 1 and missed[0].endswith(
        "MISSED (repetition 2: 0.80; copy-limit beside its blocks 560-900 batches/s, the bus changed level)")
