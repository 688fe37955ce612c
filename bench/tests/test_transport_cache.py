"""The transport suite's cache rule: the last-level cache read from the OS, the pool
sizing rule, and the cold datasets built from it.  No timing here."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from mploader_bench import cachesize, synthetic
from mploader_bench.cachesize import CacheInfo, last_level_cache, parse_cache_size, plan_pool


def _fake_cache(root, entries):
    """A fake ``/sys/devices/system/cpu/cpu0/cache``: entries of (level, type, size)."""
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


AMD_EPYC = [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]


def test_llc_from_sysfs_is_the_highest_data_or_unified_level(tmp_path):
    info = last_level_cache(_fake_cache(tmp_path, AMD_EPYC))
    assert info == CacheInfo(bytes=32 << 20, level=3, source=f"sysfs {tmp_path}")


def test_llc_from_sysfs_ignores_instruction_caches_and_unreadable_entries(tmp_path):
    root = _fake_cache(tmp_path, [(2, "Unified", "2M"), (4, "Instruction", "64M"), (3, "Unified", "garbage")])
    (root / "index3").mkdir()  # an entry with no files at all
    info = last_level_cache(root)
    assert (info.bytes, info.level) == (2 << 20, 2)


def test_llc_falls_back_to_sysconf_then_to_the_default(tmp_path, monkeypatch):
    sizes = {"SC_LEVEL4_CACHE_SIZE": 0, "SC_LEVEL3_CACHE_SIZE": 8 << 20}

    def sysconf(name):
        if name not in sizes:
            raise ValueError(f"unrecognized configuration name {name}")
        return sizes[name]

    monkeypatch.setattr(cachesize.os, "sysconf", sysconf)
    missing = tmp_path / "no-such-dir"
    assert last_level_cache(missing) == CacheInfo(8 << 20, 3, "sysconf SC_LEVEL3_CACHE_SIZE")
    sizes.clear()  # every name unknown, as on this project's VM
    assert last_level_cache(missing) == CacheInfo(cachesize.DEFAULT_LLC_BYTES, None, "default")
    assert cachesize.DEFAULT_LLC_BYTES == 32 << 20


def test_llc_of_this_machine_is_positive():
    info = last_level_cache()
    assert info.bytes > 0 and info.source


@pytest.mark.parametrize("text, want", [("32768K", 32 << 20), ("1M", 1 << 20), ("512", 512),
                                        ("2G\n", 2 << 30), ("64KiB", 64 << 10)])
def test_parse_cache_size(text, want):
    assert parse_cache_size(text) == want


def test_parse_cache_size_names_a_bad_value():
    with pytest.raises(ValueError, match=r"cache size '32 MB!'.*K, M or G suffix"):
        parse_cache_size("32 MB!")


@pytest.mark.parametrize("sample, header, llc", [(150_528, 112, 32 << 20), (3072, 112, 32 << 20),
                                                 (64, 112, 32 << 20), (64, 0, 1 << 20), (1 << 30, 0, 8 << 20)])
def test_pool_is_the_fewest_samples_that_reach_four_times_the_llc(sample, header, llc):
    plan = plan_pool(sample, header, llc, cap_bytes=1 << 40)
    assert not plan.capped
    assert plan.target_bytes == 4 * llc
    assert plan.total_bytes == plan.samples * (sample + header) >= 4 * llc
    assert (plan.samples - 1) * (sample + header) < 4 * llc
    assert plan.cache_multiple >= 4


def test_pool_counts_the_headers_of_every_process_against_the_cap():
    # 1,000 samples of 100 + 50 bytes reach 4 x 37,500; with 3 workers each copying
    # the headers, the worst case is 1,000 x (100 + 50 x 4) = 300,000 bytes.
    plan = plan_pool(100, 50, 37_500, processes=3, cap_bytes=300_000)
    assert (plan.samples, plan.worst_bytes, plan.capped) == (1000, 300_000, False)
    capped = plan_pool(100, 50, 37_500, processes=3, cap_bytes=299_999)
    assert capped.capped and capped.samples == 999 and capped.worst_bytes <= 299_999
    assert plan_pool(1 << 20, 0, 1 << 30, cap_bytes=1).samples == 1  # never empty


def test_default_cap_is_at_most_1_gib_and_a_quarter_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(cachesize, "available_memory_bytes", lambda: 2 << 30)
    assert cachesize.default_cap_bytes() == 512 << 20
    monkeypatch.setattr(cachesize, "available_memory_bytes", lambda: 64 << 30)
    assert cachesize.default_cap_bytes() == cachesize.POOL_CAP_BYTES == 1 << 30
    monkeypatch.setattr(cachesize, "available_memory_bytes", lambda: None)
    assert cachesize.default_cap_bytes() == 1 << 30


@pytest.mark.parametrize("kw, message", [
    (dict(sample_bytes=0), "sample_bytes=0: expected an integer >= 1"),
    (dict(header_bytes=-1), "header_bytes=-1: expected an integer >= 0"),
    (dict(llc_bytes=0), "llc_bytes=0: expected an integer >= 1"),
    (dict(processes=-2), "processes=-2: expected an integer >= 0"),
    (dict(factor=0), "factor=0: expected an integer >= 1"),
    (dict(cap_bytes=0), "cap_bytes=0: expected an integer >= 1"),
])
def test_plan_pool_names_a_bad_argument(kw, message):
    args = dict(sample_bytes=64, header_bytes=112, llc_bytes=1 << 20) | kw
    with pytest.raises(ValueError, match=message):
        plan_pool(**args)


def test_cold_dataset_draws_every_sample_from_a_pool_of_distinct_arrays():
    llc = CacheInfo(bytes=256 << 10, level=3, source="test")
    ds = synthetic.make_dataset("small", "cold", llc=llc, processes=2, cap_bytes=1 << 30)
    header = synthetic.header_bytes((32, 32, 3), np.uint8)
    want = math.ceil(4 * (256 << 10) / (3072 + header))
    assert len(ds.pool) == ds.plan.samples == want and not ds.plan.capped
    assert ds.pool.shape == (want, 32, 32, 3) and ds.pool.flags.c_contiguous
    assert len(ds) >= want
    rows = ds.pool.reshape(want, -1)
    assert len({r.tobytes() for r in rows}) == want  # distinct
    for i in (0, 1, want - 1, want, 2 * want + 5, len(ds) - 1):
        x, y = ds[i]
        assert np.shares_memory(x, ds.pool) and np.array_equal(x, ds.pool[i % want])
        assert y == np.int64(i % 1024) and isinstance(y, np.int64)


def test_resident_dataset_keeps_the_former_four_arrays():
    ds = synthetic.make_dataset("tiny", "resident")
    assert ds.plan is None and len(ds.pool) == synthetic.RESIDENT_DISTINCT == 4
    assert len(ds) == synthetic.SIZES["tiny"]["length"]
    y, x = ds[6]
    assert x.shape == (16,) and x.dtype == np.float32 and np.array_equal(x, ds.pool[2]) and y == 6


def test_make_dataset_names_a_bad_argument():
    with pytest.raises(ValueError, match=r"size='huge': expected one of \('tiny', 'small', 'large'\)"):
        synthetic.make_dataset("huge")
    with pytest.raises(ValueError, match=r"cache='warm': expected one of \('cold', 'resident'\)"):
        synthetic.make_dataset("tiny", "warm")


def test_case_names_say_when_the_data_are_cache_resident():
    assert synthetic.case_name("large", "cold") == "large"
    assert synthetic.case_name("large", "resident") == "large-resident"


def test_suite_rejects_an_unknown_cache_mode():
    from mploader_bench import transport

    with pytest.raises(ValueError, match=r"cache='lukewarm': expected 'cold', 'resident', 'both'"):
        transport.run(sizes=("tiny",), cache="lukewarm", transports=("inline",), out_dir=None, quiet=True)


def test_sysfs_of_this_machine_if_any_agrees_with_the_reader():
    root = cachesize.SYSFS_CPU0_CACHE
    if not os.path.isdir(root):
        pytest.skip("no sysfs cache directory here")
    info = last_level_cache(root)
    assert info.source == f"sysfs {root}" and info.level is not None and info.level >= 1


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "tiny,huge"], "argument --sizes: invalid value 'tiny,huge': expected a comma-separated list "
                               "of tiny, small, large"),
    (["--sizes", ","], "argument --sizes: invalid value ','"),
    (["--cache", "warm"], "argument --cache: invalid choice: 'warm'"),
])
def test_bench_command_names_a_bad_cache_or_sizes_argument(argv, message, capsys, tmp_path):
    from mploader_bench import cli

    assert cli.main(["--suite", "transport", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mploader bench: error: ") and message in err and err.count("\n") == 1
