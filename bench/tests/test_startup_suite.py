"""The start-up suite's table and CLI registration (the suite itself runs for minutes:
``mploader bench --suite startup``)."""
from __future__ import annotations

from mploader_bench import cli, startup


def test_the_suite_is_registered_in_the_cli():
    args = cli.build_parser().parse_args(["--suite", "startup", "--repeats", "2"])
    assert args.suite == "startup" and args.repeats == 2


def test_the_table_gives_medians_with_min_max_side_by_side():
    rows = [
        {"loader": "mploader", "method": "spawn", "workers": 8, "runs": 3, "errors": [],
         "cold_first_s": [1.5, 1.0, 2.0], "warm_first_s": [0.2, 0.1, 0.3], "cold_uss_mib": [30, 32, 31],
         "warm_uss_mib": [30, 30, 30]},
        {"loader": "torch", "method": "spawn", "workers": 8, "runs": 3, "errors": ["boom"],
         "cold_first_s": [20.0, 30.0], "warm_first_s": [], "cold_uss_mib": [1400, 1500], "warm_uss_mib": []},
    ]
    table = startup.format_table({"dataset_mib": 128, "batch_size": 32, "repeats": 3, "rows": rows})
    assert "| spawn | 8 | 1.50 (1.00-2.00) / 25.00 (20.00-30.00) | 0.20 (0.10-0.30) | 31 (30-32) / 1450 (1400-1500) |" \
        in table
    assert "torch spawn 8: boom" in table
