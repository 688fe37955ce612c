"""The copy-limit row: the copy is right (every batch's rows land in its rotating
buffer), the processes stop, and the suite reports shares of it.  No timing here."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from mploader_bench import copylimit
from mploader_bench.cachesize import CacheInfo
from mploader_bench.copylimit import CopyLimit, copy_batches
from mploader_bench.transport_blocks import steady

psutil = pytest.importorskip("psutil")


def _pool(distinct=37, row_bytes=64, seed=5):
    return np.random.default_rng(seed).integers(0, 256, size=(distinct, row_bytes), dtype=np.uint8)


@pytest.mark.parametrize("method", ["take", "stream"])
def test_copy_batches_puts_each_batch_in_its_rotating_buffer(method):
    if method == "stream" and copylimit.stream_min_bytes() is None:
        pytest.skip("mploader's streaming copy is not built here")
    rows = _pool()
    indices = np.random.default_rng(1).integers(0, len(rows), size=(5, 8))
    arena = np.zeros((3, 8, rows.shape[1]), np.uint8)
    copy_batches(rows, indices, arena, 7, method=method, start=2)  # batches 2..8
    for k in (6, 7, 8):  # the last three written, one per buffer
        assert np.array_equal(arena[k % 3], rows[indices[k % 5]]), k


def test_the_arena_is_shared_memory_written_once():
    """copy-limit copies into shared memory, as a loader's workers must (see
    ``shared_arena``): a forked child's writes are seen by the parent; every byte
    was written (faulted in) before any copy is timed."""
    import os

    arena = copylimit.shared_arena(3, 4, 4096)
    assert arena.shape == (3, 4, 4096) and arena.dtype == np.uint8 and (arena == 1).all()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        arena[2, 3, 4095] = 7
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert arena[2, 3, 4095] == 7


def test_copy_batches_names_a_bad_method():
    rows = _pool()
    with pytest.raises(ValueError, match="method='memcpy': expected 'take' or 'stream'"):
        copy_batches(rows, np.zeros((1, 2), np.int64), np.zeros((1, 2, 64), np.uint8), 1, method="memcpy")


def test_copy_limit_runs_every_method_in_all_processes_and_stops_them():
    pool = _pool(distinct=50, row_bytes=64).reshape(50, 16, 4)  # any sample shape: copied as bytes
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with CopyLimit(pool, 32, workers=2, llc_bytes=64 << 10, methods=("take", "take")) as limit:
        assert limit.row_bytes == 64 and limit.batch_bytes == 32 * 64
        mine = {p.pid for p in psutil.Process().children(recursive=True)} - before
        assert len(mine) == 2
        wall = limit.run(101)  # 51 + 50 batches
        assert wall > 0 and set(limit.last) == {"take"} and limit.last["take"] > 0
    alive = [p for p in psutil.Process().children(recursive=True) if p.pid in mine]
    assert not alive
    limit.close()  # idempotent
    with pytest.raises(RuntimeError, match="copy-limit is closed"):
        limit.run(1)


def test_copy_limit_uses_streaming_stores_only_where_the_ring_does():
    stream = copylimit.stream_min_bytes()
    if stream is None:
        pytest.skip("mploader's streaming copy is not built here")
    pool = np.zeros((4, 1024), np.uint8)
    for batch, want in ((stream // 1024 - 1, ("take",)), (stream // 1024, ("take", "stream"))):
        with CopyLimit(pool, batch, workers=1, llc_bytes=1 << 20) as limit:
            assert limit.methods == want, batch


@pytest.mark.parametrize("kw, message", [(dict(workers=0), "workers=0: expected >= 1"),
                                         (dict(batch_size=0), "batch_size=0: expected >= 1")])
def test_copy_limit_names_a_bad_argument(kw, message):
    args = dict(batch_size=4, workers=1, llc_bytes=1 << 20) | kw
    with pytest.raises(ValueError, match=message):
        CopyLimit(_pool(), **args)


def test_suite_reports_each_rows_share_of_copy_limit_per_repetition(monkeypatch):
    """Unbracketed (blocks=0), the share is paired: each repetition's rate over
    copy-limit's in that repetition."""
    from mploader_bench import transport

    monkeypatch.setattr(transport, "last_level_cache", lambda: CacheInfo(128 << 10, 3, "test"))
    report = transport.run(workers=1, repeats=2, seconds=0.01, sizes=("small",), blocks=0,
                           transports=("inline", "copy-limit"), out_dir=None, quiet=True)
    assert not report["errors"] and not report["mismatches"]
    info = report["sizes"]["small"]
    assert info["cache"] == "cold" and info["pool"]["total_bytes"] >= 4 * (128 << 10)
    assert info["blocks"] == 0 and all("blocks" not in r for r in report["runs"])
    runs = {(r["transport"], r["repeat"]): r["batches_per_s"] for r in report["runs"]}
    shares = [runs[("inline", k)] / runs[("copy-limit", k)] for k in range(2)]
    got = report["medians"]["small"]["inline"]["share_of_copy_limit"]
    assert got == pytest.approx(dict(median=sum(shares) / 2, min=min(shares), max=max(shares)))
    limit = report["medians"]["small"]["copy-limit"]
    assert set(limit["methods"]) == {"take"} and limit["share_of_copy_limit"] is None


def test_suite_takes_each_share_against_the_copy_limit_blocks_around_the_row(monkeypatch):
    """Bracketed (blocks=3): copy-limit, inline, copy-limit, inline, copy-limit, inline,
    copy-limit; each inline block's copy-limit is the mean of its two neighbours', and
    the repetition's share is its rate over the mean of those."""
    from mploader_bench import transport

    monkeypatch.setattr(transport, "last_level_cache", lambda: CacheInfo(128 << 10, 3, "test"))
    monkeypatch.setattr(transport, "_MIN_BLOCK_BATCHES", 1)  # 3 blocks even of 10-batch runs
    report = transport.run(workers=1, repeats=2, seconds=0.01, sizes=("small", "tiny"), blocks=3,
                           transports=("inline", "copy-limit"), out_dir=None, quiet=True)
    assert not report["errors"] and not report["mismatches"]
    assert report["config"]["blocks"] == 3
    assert report["sizes"]["small"]["blocks"] == 3 and report["sizes"]["tiny"]["blocks"] == 0
    assert report["sizes"]["small"]["blocks_of"] == {"inline": 3}
    runs = {(r["size"], r["transport"], r["repeat"]): r for r in report["runs"]}
    assert len(runs) == len(report["runs"])  # one record per size, transport and repetition
    shares = []
    for k in range(2):
        mine, limit = runs[("small", "inline", k)], runs[("small", "copy-limit", k)]
        assert len(mine["blocks"]) == 3 and len(limit["blocks"]) == 4
        assert mine["batches"] == sum(b["batches"] for b in mine["blocks"])
        assert mine["batches_per_s"] == pytest.approx(mine["batches"] / mine["seconds"])
        cl = [b["batches_per_s"] for b in limit["blocks"]]
        around = [(cl[j] + cl[j + 1]) / 2 for j in range(3)]
        assert [b["copy_limit_batches_per_s"] for b in mine["blocks"]] == pytest.approx(around)
        assert [b["copy_limit_around"] for b in mine["blocks"]] == [cl[j:j + 2] for j in range(3)]
        assert mine["copy_limit_range"] == [min(cl), max(cl)]
        assert mine["copy_limit_batches_per_s"] == pytest.approx(sum(around) / 3)
        assert limit["batches_per_s"] == pytest.approx(limit["batches"] / limit["seconds"])
        # the share: over the blocks whose two copy-limit neighbours agree (steady)
        kept = [b for b in mine["blocks"] if steady(b["copy_limit_around"])]
        assert mine["steady"]["blocks"] == len(kept)
        if kept:
            shares.append(sum(b["batches"] for b in kept) / sum(b["seconds"] for b in kept)
                          / (sum(b["copy_limit_batches_per_s"] for b in kept) / len(kept)))
        assert "blocks" not in runs[("tiny", "inline", k)]
    got = report["medians"]["small"]["inline"]["share_of_copy_limit"]
    assert got == (pytest.approx(dict(median=statistics.median(shares), min=min(shares), max=max(shares)))
                   if shares else None)
    # collate-limit runs once per repetition, whole, after the bracketed blocks
    assert "blocks" not in runs[("small", "collate-limit", 0)]
    # the other work on the machine meanwhile: CPU seconds outside the suite's processes
    assert all(r["others_cpu_s"] >= 0 for r in report["runs"])
    assert all(r["span_s"] >= r["seconds"] for r in report["runs"])
    cores = [r["others_cpu_s"] / r["span_s"] for r in report["runs"]
             if (r["size"], r["transport"]) == ("small", "inline")]
    assert report["medians"]["small"]["inline"]["others_cores"] == pytest.approx(
        dict(median=sum(cores) / 2, min=min(cores), max=max(cores)))
