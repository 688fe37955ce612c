"""The bad-sample policy (issue 23): ``on_error="substitute"`` keeps batches full and
ranks in step, ``"skip"`` drops, the budget ends a broken run, every bad sample is
reported.  Each case runs in its own child process with a hard time limit
(tests/test_faults.py's ``run_case``); the child's assertions print "OK" last.
"""
from __future__ import annotations

import textwrap

import pytest
from test_faults import COLLECT_LOG, run_case

from mploader import _bad_samples
from mploader._options import LoaderOptions

# 0.1 % of 4,000 samples raise (4 of them, two exception types); a sample is its
# index plus a random augmentation, so that identical batches cover the seeding.
BROKEN = COLLECT_LOG + """
import json, logging, tempfile
from mploader._bad_samples import substitute_index

BAD = {17: OSError, 1234: OSError, 2718: ValueError, 3999: OSError}

class Broken:
    def __init__(self, n=4000, bad=BAD):
        self.n, self.bad = n, dict(bad)
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i in self.bad:
            raise self.bad[i](f"cannot decode /data/{i}.jpg")
        return np.array([i, np.random.random()])


def expected_index(i, seed, epoch, n=4000):
    '''What sample i becomes under "substitute": the rule's first good substitute.'''
    if i not in BAD:
        return i
    for attempt in range(8):
        j = substitute_index(seed, epoch, i, attempt, n)
        if j not in BAD:
            return j
"""


def broken_case(body: str, timeout_s: float = 90) -> None:
    run_case(BROKEN + textwrap.dedent(body), timeout_s=timeout_s)


def test_substitute_keeps_two_ranks_in_step_and_is_reproducible_and_resumable():
    """Gluon face, 2 simulated ranks (DistributedBatchSampler with explicit
    rank/world_size), 2 epochs: every rank gets the same number of full batches;
    each bad sample is replaced by the rule's substitute (checked against the
    sampler's own indices); a rerun gives bit-identical batches and the same report;
    a run resumed from a JSON checkpoint taken mid-epoch gives the same remaining
    batches and ends with the same report; the report names every bad index, with
    its epoch, type and message; one warning per exception type."""
    broken_case("""
        SEED = 9

        def loader(rank):
            sampler = mploader.DistributedBatchSampler(4000, 64, seed=3, rank=rank, world_size=2)
            return mploader.DataLoader(Broken(), batch_sampler=sampler, num_workers=2, seed=SEED,
                                       on_error="substitute"), sampler

        def run(rank, stop_at=None, state=None):
            dl, sampler = loader(rank)
            if state is not None:
                dl.load_state_dict(json.loads(json.dumps(state)))
            epochs, saved = [], None
            for epoch in range(2):
                sampler.set_epoch(epoch)
                got = []
                for k, b in enumerate(dl):
                    got.append(b.copy())
                    if stop_at == (epoch, k):
                        saved = dl.state_dict()
                        dl.close()
                        return epochs + [got], saved, None
                epochs.append(got)
            stats = dl.stats()
            dl.close()
            return epochs, saved, stats

        runs = {rank: run(rank) for rank in (0, 1)}
        counts = {rank: [len(e) for e in runs[rank][0]] for rank in runs}
        assert counts[0] == counts[1] == [62, 62], counts             # DDP lockstep
        assert all(b.shape == (32, 2) for r in runs for e in runs[r][0] for b in e)
        reported = []
        for rank in (0, 1):
            epochs, _, stats = runs[rank]
            sampler = mploader.DistributedBatchSampler(4000, 64, seed=3, rank=rank, world_size=2)
            for epoch in range(2):
                sampler.set_epoch(epoch)
                want = [[expected_index(i, SEED, epoch) for i in ix] for ix in sampler]
                got = [[int(x) for x in b[:, 0]] for b in epochs[epoch]]
                assert got == want, (rank, epoch)
            reported += [(r["epoch"], r["index"]) for r in stats["bad_samples"]]
            for r in stats["bad_samples"]:
                assert r["type"] == BAD[r["index"]].__name__ and f"/data/{r['index']}.jpg" in r["message"], r
                assert r["substitute"] == expected_index(r["index"], SEED, r["epoch"]), r
        met = {(e, i) for e in range(2) for i in BAD}
        assert sorted(reported) == sorted(met), (reported, met)   # every bad index named, once per epoch
        types_met = sum(len({r["type"] for r in runs[rank][2]["bad_samples"]}) for rank in (0, 1))
        assert len(log.messages) == types_met, log.messages      # per loader: one per exception type it met

        again = run(0)
        assert all(np.array_equal(a, b) for e1, e2 in zip(again[0], runs[0][0]) for a, b in zip(e1, e2))
        assert again[2]["bad_samples"] == runs[0][2]["bad_samples"]

        # resume: rank 0 stopped at batch 40 of epoch 1 (after 1234, 17 ... were met in epoch 0)
        head, state, _ = run(0, stop_at=(1, 40))
        assert state["bad_samples"]["records"] == [r for r in runs[0][2]["bad_samples"]
                                                    if (r["epoch"], r["batch_index"]) <= (1, 40)]
        dl, sampler = loader(0)
        dl.load_state_dict(json.loads(json.dumps(state)))
        sampler.set_epoch(1)
        tail = [b.copy() for b in dl]
        assert len(head[1]) + len(tail) == 62
        assert all(np.array_equal(a, b) for a, b in zip(head[1] + tail, runs[0][0][1]))
        assert dl.stats()["bad_samples"] == runs[0][2]["bad_samples"]
        dl.close()
        print("OK")
    """, timeout_s=120)


def test_torch_face_substitute_with_distributed_sampler():
    """Torch face, torch's DistributedSampler with explicit num_replicas/rank: equal
    batch counts, full batches, the report names every bad index of the rank's
    share, a rerun substitutes the same samples, and a resume from a checkpoint gives
    the same remaining batches."""
    pytest.importorskip("torch")
    broken_case("""
        import torch
        import mploader.torch as mt
        from torch.utils.data import DistributedSampler

        def run(rank, stop_at=None, state=None):
            ds = Broken()
            dl = mt.DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds, 2, rank, seed=4), num_workers=2,
                               seed=8, on_error="substitute")
            if state is not None:
                dl.load_state_dict(json.loads(json.dumps(state)))
            got, saved = [], None
            for k, b in enumerate(dl):
                got.append(b.clone())
                if k == stop_at:
                    saved = dl.state_dict()
                    break
            stats = dl.stats()
            dl.close()
            return got, saved, stats

        first = {rank: run(rank) for rank in (0, 1)}
        assert len(first[0][0]) == len(first[1][0]) == 63
        assert all(b.shape == (32, 2) for r in (0, 1) for b in first[r][0][:-1])
        for rank in (0, 1):
            share = set(list(DistributedSampler(Broken(), 2, rank, seed=4)))
            named = [r["index"] for r in first[rank][2]["bad_samples"]]
            assert sorted(named) == sorted(i for i in BAD if i in share), (rank, named)
        again = run(0)
        assert all(torch.equal(a, b) for a, b in zip(again[0], first[0][0]))
        head, state, _ = run(0, stop_at=30)
        tail, _, stats = run(0, state=state)
        assert all(torch.equal(a, b) for a, b in zip(head + tail, first[0][0]))
        assert stats["bad_samples"] == first[0][2]["bad_samples"]
        print("OK")
    """, timeout_s=120)


def test_skip_drops_the_sample_and_writes_the_log_file():
    """"skip": the batch is one sample shorter for each bad one (unsafe for DDP, as
    documented); the JSON-lines file gets one line per bad sample, as stats()."""
    broken_case("""
        path = os.path.join(tempfile.mkdtemp(), "bad.jsonl")
        dl = mploader.DataLoader(Broken(), batch_size=50, num_workers=2, seed=1, on_error="skip",
                                 bad_sample_log=path)
        batches = list(dl)
        sizes = [len(b) for b in batches]
        assert sum(sizes) == 4000 - len(BAD), sizes
        assert [i for b in batches for i in b[:, 0].astype(int).tolist()] == [i for i in range(4000) if i not in BAD]
        stats = dl.stats()
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        assert lines == stats["bad_samples"] and sorted(r["index"] for r in lines) == sorted(BAD), lines
        assert all(r["substitute"] is None for r in lines)
        dl.close()
        print("OK")
    """)


def test_sharded_loader_skips_inside_shards_and_substitutes_keep_them_full():
    """GluonNLP's ShardedDataLoader: a task is a list of shards; "skip" leaves the
    sample out of its shard, "substitute" keeps every shard full; the budget counts
    samples, not shards."""
    broken_case("""
        shards = [[[0, 1, 17], [9, 10]], [[3, 4], [2718, 7]]]
        with mploader.ShardedDataLoader(Broken(), batch_sampler=shards, num_workers=2, seed=2,
                                        on_error="skip") as dl:
            got = [[s[:, 0].astype(int).tolist() for s in b] for b in dl]
            assert got == [[[0, 1], [9, 10]], [[3, 4], [7]]], got
            assert sorted(r["index"] for r in dl.stats()["bad_samples"]) == [17, 2718]
        with mploader.ShardedDataLoader(Broken(), batch_sampler=shards, num_workers=2, seed=2,
                                        on_error="substitute") as dl:
            got = [[s[:, 0].astype(int).tolist() for s in b] for b in dl]
            want = [[[expected_index(i, 2, 0) for i in shard] for shard in b] for b in shards]
            assert got == want, (got, want)
            assert dl._engine._scheduler.ledger.epoch_samples == {0: 9}   # samples, not shards
        print("OK")
    """)


def test_the_budget_ends_the_run_with_a_clear_error():
    """max_bad_samples=2 with 4 bad samples in the epoch; max_bad_fraction=0.01 with
    5 % bad samples: BadSampleBudgetError naming the limit, the count and the last
    sample; the report travels with the error; the loader can run again."""
    broken_case("""
        dl = mploader.DataLoader(Broken(), batch_size=50, num_workers=2, seed=1, on_error="substitute",
                                 max_bad_samples=2, max_bad_fraction=None)
        try:
            list(dl)
        except mploader.BadSampleBudgetError as exc:
            err = exc
        else:
            raise AssertionError("no BadSampleBudgetError")
        assert "3 distinct samples raised, more than max_bad_samples=2" in str(err), str(err)
        assert "cannot decode /data/" in str(err) and len(err.report) == 3, err.report
        dl.close()

        many = {i: OSError for i in range(0, 4000, 20)}        # 5 %
        dl = mploader.DataLoader(Broken(bad=many), batch_size=50, num_workers=2, seed=1, on_error="substitute")
        try:
            list(dl)
        except mploader.BadSampleBudgetError as exc:
            err = exc
        else:
            raise AssertionError("no BadSampleBudgetError")
        assert "of epoch 0 delivered so far raised" in str(err), str(err)
        assert "more than max_bad_fraction=0.01" in str(err) and "cannot decode /data/" in str(err), str(err)
        assert 11 <= len(err.report) <= 14, err.report       # 10 allowed early in the epoch, then 1 %
        assert isinstance(err, RuntimeError)
        dl.close()
        print("OK")
    """)


def test_a_bad_sample_whose_substitutes_all_fail_raises():
    """Every sample raises: after MAX_SUBSTITUTES tries the sample's own exception is
    raised from next() (its batch), named."""
    broken_case("""
        dl = mploader.DataLoader(Broken(n=64, bad={i: OSError for i in range(64)}), batch_size=4, num_workers=2,
                                 seed=1, on_error="substitute", max_bad_fraction=None)
        try:
            next(iter(dl))
        except RuntimeError as exc:
            assert "sample 0 raised OSError and its 8 substitutes raised too" in str(exc), str(exc)
        else:
            raise AssertionError("no error")
        dl.close()
        print("OK")
    """)


# ---- the rule and the options (in process) ----


def test_substitute_index_is_a_pure_function_never_itself_and_spread():
    seen = [_bad_samples.substitute_index(5, 2, i, 0, 1000) for i in range(1000)]
    assert seen == [_bad_samples.substitute_index(5, 2, i, 0, 1000) for i in range(1000)]
    assert all(j != i and 0 <= j < 1000 for i, j in enumerate(seen))
    assert len(set(seen)) > 550        # ~1 - 1/e of 1000 distinct for a uniform draw
    assert seen != [_bad_samples.substitute_index(5, 3, i, 0, 1000) for i in range(1000)]  # the epoch matters
    assert seen != [_bad_samples.substitute_index(6, 2, i, 0, 1000) for i in range(1000)]  # the seed matters


@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"on_error": "ignore"}, ValueError, "on_error must be one of 'raise', 'skip', 'substitute', got 'ignore'"),
    ({"on_error": "skip", "num_workers": 0}, ValueError, "on_error='skip' needs worker processes (num_workers > 0"),
    ({"max_bad_fraction": 2.0}, ValueError, "max_bad_fraction must be a fraction in [0, 1] or None, got 2.0"),
    ({"max_bad_fraction": "1%"}, TypeError, "max_bad_fraction must be a fraction in [0, 1] or None, got '1%' (str)"),
    ({"max_bad_samples": -1}, ValueError, "max_bad_samples must be a non-negative integer or None, got -1"),
    ({"bad_sample_log": 3.5}, TypeError, "bad_sample_log must be a path or None, got 3.5 (float)"),
])
def test_bad_sample_options_are_checked(kwargs, error, text):
    with pytest.raises(error) as info:
        LoaderOptions(**{"num_workers": 2, **kwargs})
    assert text in str(info.value)


def test_a_malformed_checkpoint_report_is_refused_before_anything_is_restored():
    with pytest.raises(ValueError) as info:
        _bad_samples.parse_state({"records": [{"epoch": "x", "index": 1, "type": "OSError"}]})
    assert "bad_samples is malformed" in str(info.value)
    with pytest.raises(ValueError) as info:
        _bad_samples.parse_state([1, 2])
    assert "bad_samples must be a dict with a 'records' list, got [1, 2]" in str(info.value)
