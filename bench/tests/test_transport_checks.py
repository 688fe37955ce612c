"""Every batch of the transport suite is checked: a wrong batch fails the run.
No timing here."""
from __future__ import annotations

import numpy as np
import pytest

from mploader_bench import peers, synthetic, transport
from mploader_bench.checks import BatchCheck, BatchMismatch


@pytest.fixture(scope="module")
def ds():
    return synthetic.make_dataset("tiny", "resident")  # (np.int64 label, float32 (16,))


@pytest.fixture(scope="module")
def cold():
    return synthetic.make_dataset("small", "cold", llc=synthetic.CacheInfo(64 << 10, 2, "test"),
                                  cap_bytes=1 << 30)


def _collate(ds, indices):
    return peers.collate([ds[i] for i in indices])


def test_right_batches_pass(ds, cold):
    for d in (ds, cold):
        batches = synthetic.Batches(len(d), 8, seed=3, check=d.check).take(20)
        want = d.check.expected(batches)
        for k, (indices, fp) in enumerate(zip(batches, want)):
            d.check.check("inline", k, _collate(d, indices), fp)


def _wrong_batches(d, indices):
    good = _collate(d, indices)
    a = 1 - d.check.array_field
    arrays, labels = good[d.check.array_field], good[a]

    def pack(x, y):
        return (y, x) if d.label_first else (x, y)

    swapped = arrays.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    relabelled = labels.copy()
    relabelled[-1] += 1
    first_byte = arrays.copy()
    first_byte.view(np.uint8).reshape(len(indices), -1)[3, 0] ^= 1
    yield "two rows swapped", pack(swapped, labels)
    yield "a label changed", pack(arrays, relabelled)
    yield "a row's first byte flipped", pack(first_byte, labels)
    yield "another batch (stale)", _collate(d, [i + 1 for i in indices])
    yield "one sample short", pack(arrays[:-1], labels[:-1])
    yield "labels as int32", pack(arrays, labels.astype(np.int32))
    yield "arrays of another dtype", pack(arrays.astype(np.float64), labels)
    yield "fields swapped", (good[1], good[0])
    yield "a bare array", arrays


def test_every_kind_of_wrong_batch_fails(cold):
    indices = [5, 9, 2, 2, 40, 7, 1, 3]
    want = cold.check.expected([indices])[0]
    for what, batch in _wrong_batches(cold, indices):
        with pytest.raises(BatchMismatch, match=r"^toy: batch 4 of the epoch is wrong: "):
            cold.check.check("toy", 4, batch, want)
        assert cold.check.fingerprint(batch) != want, what


def test_wrong_batches_of_a_label_first_dataset_fail(ds):
    indices = [0, 1, 2, 3, 4, 5, 6, 7]
    want = ds.check.expected([indices])[0]
    for what, batch in _wrong_batches(ds, indices):
        assert ds.check.fingerprint(batch) != want, what


def test_check_names_a_bad_row_size():
    with pytest.raises(ValueError, match="row_bytes=12: expected a positive multiple of 8"):
        BatchCheck(np.zeros(3, np.uint64), 12, 10, False)


class _Stale(peers.Transport):
    """Delivers the batch before in place of batch 3 of every epoch (a stale slot)."""

    name = "toy-stale"
    suites = ()

    def _epoch(self, batches):
        last = None
        for k, indices in enumerate(batches):
            batch = _collate(self.dataset, indices)
            yield last if k == 3 and last is not None else batch
            last = batch


@pytest.fixture()
def stale():
    peers.register(_Stale)
    yield _Stale.name
    peers._REGISTRY.pop(_Stale.name, None)


def test_a_wrong_batch_after_the_first_fails_the_suite_and_the_command(stale, capsys):
    report = transport.run(workers=1, repeats=1, seconds=0.01, sizes=("tiny",), cache="resident",
                           transports=(stale, "inline"), out_dir=None, quiet=True)
    assert [m["transport"] for m in report["mismatches"]] == [stale]
    assert "batch 3 of the epoch is wrong" in report["mismatches"][0]["error"]
    assert report["mismatches"][0]["size"] == "tiny-resident"
    assert "inline" in report["medians"]["tiny-resident"]  # the others still ran
    assert "WRONG BATCH [tiny-resident] toy-stale" in capsys.readouterr().out
    argv = ["--sizes", "tiny", "--cache", "resident", "--transports", f"{stale},inline", "--repeats", "1",
            "--seconds", "0.01", "--no-json", "--quiet"]
    assert transport.main(argv) == 3


def test_the_bench_command_exits_3_on_a_wrong_batch(stale, tmp_path, capsys):
    from mploader_bench import cli

    argv = ["--suite", "transport", "--sizes", "tiny", "--cache", "resident", "--transports", stale,
            "--workers", "1", "--repeats", "1", "--seconds", "0.01", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == cli.EXIT_MISMATCH == 3
    err = capsys.readouterr().err
    assert "mploader bench: error: wrong batches: [tiny-resident] toy-stale: batch 3" in err
