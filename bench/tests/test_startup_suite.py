"""The start-up suite's table and CLI registration (the suite itself runs for minutes:
``mploader bench --suite startup``)."""
from __future__ import annotations

import pytest

from mploader_bench import cli, startup


def test_the_suite_is_registered_in_the_cli():
    args = cli.build_parser().parse_args(["--suite", "startup", "--repeats", "2"])
    assert args.suite == "startup" and args.repeats == 2


def test_the_table_gives_medians_with_min_max_side_by_side():
    rows = [
        {"loader": "mploader", "method": "spawn", "workers": 8, "runs": 3, "errors": [],
         "cold_first_s": [1.5, 1.0, 2.0], "warm_first_s": [0.2, 0.1, 0.3], "cold_uss_mib": [30, 32, 31],
         "warm_uss_mib": [30, 30, 30], "after_setup_first_s": [0.3, 0.2, 0.4],
         "after_setup_late_first_s": [0.9, 0.8, 1.0]},
        {"loader": "torch", "method": "spawn", "workers": 8, "runs": 3, "errors": ["boom"],
         "cold_first_s": [20.0, 30.0], "warm_first_s": [], "cold_uss_mib": [1400, 1500], "warm_uss_mib": []},
    ]
    table = startup.format_table({"dataset_mib": 128, "batch_size": 32, "repeats": 3, "rows": rows, "setup_s": 1})
    assert ("| spawn | 8 | 1.50 (1.00-2.00) / 25.00 (20.00-30.00) | 0.20 (0.10-0.30) | 0.30 (0.20-0.40) / "
            "0.90 (0.80-1.00) | 31 (30-32) / 1450 (1400-1500) |") in table
    assert "after 1 s of the user's set-up" in table
    assert "torch spawn 8: boom" in table


def test_epoch_summary_takes_epochs_two_and_later_and_the_steady_state():
    waits = [[0.5] + [0.001] * 9, [0.04, 0.02, 0.01, 0.01] + [0.002] * 6, [0.03] + [0.003] * 9]
    summary = startup.epoch_summary(waits)
    assert summary["first_ms"] == [40.0, 30.0]   # not the first epoch's start-up
    # the epoch's start as a whole: its first STEADY_FROM (4) batches, summed
    assert startup.STEADY_FROM == 4
    assert summary["start_ms"] == pytest.approx([80.0, 39.0])
    steady = summary["steady_ms"]
    assert len(steady) == 3 * (10 - startup.STEADY_FROM) and set(steady) == {1.0, 2.0, 3.0}


def test_the_epoch_table_gives_first_batch_and_steady_state_side_by_side():
    rows = [{"loader": "mploader", "method": "fork", "persistent": True, "first_ms": [40.0, 30.0, 50.0],
             "start_ms": [48.0, 40.0, 64.0], "steady_ms": [2.0, 1.0, 3.0], "errors": []},
            {"loader": "gluon", "method": "forkserver", "persistent": True, "first_ms": [], "steady_ms": [],
             "errors": ["boom"]}]
    table = startup.format_epoch_table({"repeats": 3, "epoch_rows": rows, "epoch_setting": startup.epoch_setting()})
    assert ("| fork | persistent | mploader.torch | 40.00 (30.00-50.00) | 2.00 (1.00-3.00) | 20.0 | -- | -- | "
            "48.00 (40.00-64.00) | 6.0 |") in table   # 48 ms against 4 steady medians of 2 ms
    assert "| forkserver | persistent | mploader (Gluon, seed=) | -- | -- | -- | -- | -- | -- | -- |" in table
    assert "gluon forkserver persistent=True: boom" in table


def test_the_distributed_epoch_cell_gives_the_samplers_epochs_and_takes_the_staged_batches():
    """``gluon-dist``: the training loop's set_epoch(e) before each iter(), and the
    batches of each epoch are DistributedBatchSampler's order for that epoch
    (``numpy.random.default_rng([0, e]).permutation``, rank 0 of 1), the second
    epoch's taken over from the batches dispatched while the first ended."""
    import numpy as np

    loader, before_epoch = startup._epoch_loader("gluon-dist", "fork", True)
    try:
        for e in range(2):
            before_epoch(e)
            got = [b[:, 0].astype(int).tolist() for b in loader]
            order = np.random.default_rng([0, e]).permutation(len(loader) * startup.EPOCH_BATCH).tolist()
            assert got == [order[i:i + startup.EPOCH_BATCH] for i in range(0, len(order), startup.EPOCH_BATCH)]
        assert loader.stats()["staged_used"] > 0
    finally:
        loader.close()


def test_the_epoch_child_runs_as_many_epochs_as_asked(capsys):
    """``--epochs N`` (the epoch part's epochs per run; 5 by default): the child times
    every batch of N epochs and the setting the table prints says N."""
    import json

    assert startup.main(["--epoch-child", "gluon", "fork", "persistent", "--epochs", "3"]) == 0
    waits = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["waits"]
    assert [len(e) for e in waits] == [startup.EPOCH_BATCHES] * 3
    assert startup.epoch_setting(12)["epochs"] == 12 and startup.epoch_setting()["epochs"] == startup.EPOCHS
    with pytest.raises(SystemExit):   # (no epoch 2: nothing to time)
        startup.main(["--parts", "epochs", "--epochs", "1"])
    assert "--epochs must be at least 2" in capsys.readouterr().err
