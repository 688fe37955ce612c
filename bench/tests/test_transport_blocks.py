"""The transport suite's bracketed repetitions (:mod:`mploader_bench.transport_blocks`):
the order of the timed epochs, the copy-limit around a block, and merging a transport's
blocks into one record.  No timing here."""
from __future__ import annotations

import pytest

from mploader_bench import transport, transport_report
from mploader_bench.transport_blocks import BUS_LEVEL_CHANGE, bracket_rate, bracket_values, merge, plan, steady

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
    assert "steady" not in got
    got = merge([_rec(10, 0.5, 40.0, copy_limit_around=[30.0, 50.0]),
                 _rec(10, 0.5, 55.0, copy_limit_around=[50.0, 60.0])])
    assert got["copy_limit_range"] == [30.0, 60.0]
    assert [b["copy_limit_around"] for b in got["blocks"]] == [[30.0, 50.0], [50.0, 60.0]]


def test_steady_blocks_are_those_whose_copy_limit_neighbours_agree():
    assert steady([600.0, 610.0]) and steady([600.0]) and steady([600.0, BUS_LEVEL_CHANGE * 600.0 - 1])
    assert not steady([600.0, BUS_LEVEL_CHANGE * 600.0]) and not steady([947.0, 544.0])
    assert not steady([]) and not steady(None)


def test_merge_takes_the_share_of_copy_limit_from_the_steady_blocks():
    """(issue 24) The 11:37 run of 2026-11-27: a torch-face block ran while copy-limit
    went from 544 to 879 large batches/s beside it; its share of their mean (0.68)
    measured the change, not the loader."""
    blocks = [_rec(100, 100 / 482, 711.5, copy_limit_around=[544.0, 879.0]),
              _rec(100, 100 / 726, 901.0, copy_limit_around=[879.0, 923.0]),
              _rec(100, 100 / 762, 829.0, copy_limit_around=[923.0, 735.0]),   # 1.256x: changed
              _rec(100, 100 / 679, 736.5, copy_limit_around=[735.0, 738.0])]
    got = merge(blocks)
    assert got["copy_limit_range"] == [544.0, 923.0]
    held = got["steady"]
    assert held["blocks"] == 2
    assert held["batches_per_s"] == pytest.approx(200 / (100 / 726 + 100 / 679))
    assert held["copy_limit_batches_per_s"] == pytest.approx((901.0 + 736.5) / 2)
    assert got["batches_per_s"] / got["copy_limit_batches_per_s"] < 0.82   # every block: the former share
    assert held["batches_per_s"] / held["copy_limit_batches_per_s"] == pytest.approx(0.858, abs=1e-3)
    none = merge([_rec(100, 0.2, 700.0, copy_limit_around=[544.0, 879.0])])
    assert none["steady"] == dict(blocks=0, batches_per_s=None, copy_limit_batches_per_s=None)


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


def _summary_rec(name, repeat, bps, blocks=None):
    """A record as ``transport._repetition`` merges it: ``blocks`` = [(rate, [before, after])]."""
    if blocks is None:
        return dict(size="large", transport=name, repeat=repeat, batches=100, seconds=100 / bps,
                    parent_cpu_s=0.1, workers_cpu_s=1.0, batches_per_s=bps, gb_per_s=bps * 0.0385,
                    verdict=None, others_cpu_s=0.0, span_s=100 / bps)
    return merge([dict(_summary_rec(name, repeat, rate), copy_limit_around=around,
                       copy_limit_batches_per_s=sum(around) / len(around)) for rate, around in blocks])


def test_a_missed_share_names_its_repetitions_and_their_steady_blocks():
    """(issue 24) The share of copy-limit and its every-repetition target are taken over
    steady blocks; a miss names the repetition, how many of its blocks were steady and
    the copy-limit beside them; a repetition without a steady block is a miss too."""
    by = {("large", "a"): [_summary_rec("a", 0, 0, [(600.0, [640.0, 650.0])] * 2),               # 0.93
                           _summary_rec("a", 1, 0, [(500.0, [600.0, 610.0]), (482.0, [544.0, 879.0])]),  # 0.83
                           _summary_rec("a", 2, 0, [(482.0, [544.0, 879.0]), (700.0, [900.0, 560.0])])],  # none
          ("large", "torch"): [_summary_rec("torch", k, 50.0) for k in range(3)]}
    got = transport._below(by, "large", "a", CL, 0.85)
    assert [(b["repeat"], None if b["value"] is None else round(b["value"], 3), b["steady_blocks"], b["blocks"],
             b["copy_limit_range"]) for b in got] == [(1, 0.826, 1, 2, [544.0, 879.0]),
                                                      (2, None, 0, 2, [544.0, 900.0])]
    assert transport._paired(by, "large", "a", CL) == pytest.approx([600 / 645, 500 / 605])
    assert transport._below(by, "large", "a", "torch", 4.0) == []   # 9.6x torch and more
    assert [(b["repeat"], b["value"]) for b in transport._below(by, "large", "a", "torch", 12.5)] == [
        (0, 12.0), (1, pytest.approx(200 / (100 / 500 + 100 / 482) / 50)),
        (2, pytest.approx(200 / (100 / 482 + 100 / 700) / 50))]
    assert transport_report._below_text(got) == (
        " (repetition 2: 0.83, 1 of 2 blocks steady, copy-limit beside them 544-879 batches/s; "
        "repetition 3: no steady block, copy-limit beside them 544-900 batches/s)")
    assert transport_report._below_text([]) == "" and transport_report._below_text(None) == ""
    assert transport._share_note(by[("large", "a")][1]) == " (0.83 of copy-limit, 1 of 2 blocks steady)"
    assert transport._share_note(by[("large", "a")][0]) == " (0.93 of copy-limit)"
    assert transport._share_note(by[("large", "a")][2]) == " (no steady block of 2: the bus changed level beside each)"


def test_the_summary_lists_the_repetitions_each_every_repetition_target_missed():
    """(issue 24) ``_summarise`` puts :func:`transport._below` under each of the
    large-batch targets that must hold in every repetition, and the printed report
    names them after the verdict."""
    runs = []
    for k, (cl, fast) in enumerate([(600.0, False), (800.0, True)]):
        around = [cl - 10, cl + 10]
        torch_face = (0.86 if not fast else 0.8) * cl
        runs += [_summary_rec("mploader", k, 0, [(0.9 * cl, around)] * 2),
                 _summary_rec("mploader.torch", k, 0, [(torch_face, around), (500.0, [560.0, 900.0])]),
                 _summary_rec("torch", k, 45.0), _summary_rec("copy-limit", k, cl),
                 _summary_rec("collate-limit", k, 300.0)]
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
    assert miss["value"] == pytest.approx(dict(median=0.83, min=0.8, max=0.86))
    assert [(b["repeat"], round(b["value"], 2), b["steady_blocks"]) for b in miss["below"]] == [(1, 0.8, 1)]
    assert got[("mploader.torch", "torch")]["met"] and got[("mploader.torch", "torch")]["below"] == []
    lines: list[str] = []

    class PlainConsole:   # not rich's: the plain-text report
        def print(self, text: str, **_: object) -> None:
            lines.append(text)

    transport_report._print_report(report, transport_report._Out(PlainConsole()))
    missed = [x for x in lines if "mploader.torch share of copy-limit" in x]
    assert len(missed) == 1 and missed[0].endswith(
        "MISSED (repetition 2: 0.80, 1 of 2 blocks steady, copy-limit beside them 560-900 batches/s)")
