"""The benchmark's peer transports deliver exactly the inline reference's batches.

No timing here: the benchmarks measure, the tests only check correctness and
that ``close()`` leaves no process behind.
"""
import time

import numpy as np
import pytest

from mploader_bench import peers

psutil = pytest.importorskip("psutil")


class TinyDataset:
    """Samples ``(float32 array (3, 4), int label)`` that depend on the index."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.arange(12, dtype=np.float32).reshape(3, 4) + 100 * i, int(i) * 7 - 3


class ScalarFirstDataset:
    """Samples ``(np.int64 scalar, float32 (16,))``, the benchmark's tiny shape."""

    def __len__(self):
        return 25

    def __getitem__(self, i):
        return np.int64(i * 11), np.linspace(i, i + 1, 16, dtype=np.float32)


EPOCH_A = [[0, 1, 2, 3], [7, 5, 6, 4], [39, 38], [10, 11, 12, 13], [20], [1, 1, 2, 3]]
EPOCH_B = [[int(i) for i in row] for row in np.random.default_rng(0).permutation(24).reshape(8, 3)]


def _own(batch):
    """Copy a batch out of whatever memory the transport lent it in."""
    if isinstance(batch, (tuple, list)):
        return tuple(np.array(a, copy=True) for a in batch)
    return np.array(batch, copy=True)


def _run_epoch(transport, batches):
    return [_own(b) for b in transport.epoch(batches)]


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is type(w)
        assert len(g) == len(w)
        for ga, wa in zip(g, w):
            assert isinstance(ga, np.ndarray)
            assert ga.shape == wa.shape
            assert ga.dtype == wa.dtype
            assert np.array_equal(ga, wa)


def _children():
    """Descendants of this process, except multiprocessing's own helper daemons."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            cmd = ""
        if "resource_tracker" in cmd or "forkserver" in cmd:
            continue
        out.add(p.pid)
    return out


def _wait_gone(pids, seconds=30.0):
    """Pids still children of this process (zombies included) after waiting up to
    `seconds` (only children are looked at: another process may get a freed pid)."""
    deadline = time.monotonic() + seconds
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive &= {p.pid for p in psutil.Process().children(recursive=True)}
        if alive:
            time.sleep(0.05)  # polling the OS against a deadline, not synchronising
    return alive


def _transport_params():
    return list(peers.available_transports())


def test_available_transports():
    names = peers.available_transports()
    assert set(names) <= set(peers.transport_names())
    assert names == [n for n in peers.transport_names() if n in names]
    for n in ("mploader", "pickle", "queue", "inline"):
        assert n in names


def test_unknown_transport():
    with pytest.raises(ValueError):
        peers.open_transport("carrier-pigeon", TinyDataset(), workers=1)


@pytest.mark.parametrize("dataset_cls", [TinyDataset, ScalarFirstDataset])
@pytest.mark.parametrize("name", _transport_params())
def test_same_batches_as_inline(name, dataset_cls):
    ds = dataset_cls()
    n = len(ds)
    epoch_a = [[i % n for i in b] for b in EPOCH_A]
    epoch_b = [[i % n for i in b] for b in EPOCH_B]
    with peers.open_transport("inline", ds, workers=0) as ref:
        want_a = _run_epoch(ref, epoch_a)
        want_b = _run_epoch(ref, epoch_b)

    before = _children()
    t = peers.open_transport(name, ds, workers=2, seed=1)
    try:
        assert t.name == name
        _assert_same(_run_epoch(t, epoch_a), want_a)
        _assert_same(_run_epoch(t, epoch_b), want_b)   # another list, same workers
        _assert_same(_run_epoch(t, epoch_a), want_a)
    finally:
        t.close()
    t.close()  # idempotent
    left = _wait_gone(_children() - before)
    assert not left, f"{name} left processes behind: {sorted(left)}"
    with pytest.raises(RuntimeError):
        next(iter(t.epoch(epoch_a)))


@pytest.mark.parametrize("name", _transport_params())
def test_context_manager_and_abandoned_epoch(name):
    """An epoch left half-way does not leak into the next one; ``with`` closes."""
    ds = TinyDataset()
    with peers.open_transport("inline", ds, workers=0) as ref:
        want = _run_epoch(ref, EPOCH_B)
    before = _children()
    with peers.open_transport(name, ds, workers=2) as t:
        it = t.epoch(EPOCH_A)
        next(it)
        it.close()
        del it
        _assert_same(_run_epoch(t, EPOCH_B), want)
    left = _wait_gone(_children() - before)
    assert not left, f"{name} left processes behind: {sorted(left)}"


def test_collate_structures():
    samples = [(np.ones(2, np.uint8) * i, (i, float(i)), np.int64(i)) for i in range(3)]
    images, (ints, floats), scalars = peers.collate(samples)
    assert images.shape == (3, 2) and images.dtype == np.uint8
    assert ints.dtype == np.int64 and floats.dtype == np.float64
    assert scalars.tolist() == [0, 1, 2]
    assert peers.collate([np.zeros(3), np.ones(3)]).shape == (2, 3)


def test_transport_suite_smoke(tmp_path):
    """The benchmark runs end to end and writes its JSON (structure only, no timing)."""
    import json

    from mploader_bench import transport

    report = transport.run(workers=1, repeats=2, seconds=0.01, sizes=("tiny",),
                           transports=("pickle", "inline", "collate-limit"),
                           out_dir=tmp_path, quiet=True)
    assert not report["errors"]
    assert {r["transport"] for r in report["runs"]} == {"pickle", "inline", "collate-limit"}
    assert len(report["runs"]) == 6
    assert report["sizes"]["tiny"]["bytes_per_batch"] == 32 * (8 + 16 * 4)
    assert set(report["medians"]["tiny"]) == {"pickle", "inline", "collate-limit"}
    for key in ("cpu_model", "python", "numpy", "logical_cores"):
        assert key in report["machine"]
    saved = json.loads((tmp_path / "transport-latest.json").read_text())
    assert saved["config"]["sizes"] == ["tiny"]
    assert len(saved["runs"]) == 6


@pytest.mark.parametrize("dataset_cls", [TinyDataset, ScalarFirstDataset])
def test_collate_limit_matches_inline(dataset_cls):
    from mploader_bench.transport import CollateLimit

    ds = dataset_cls()
    batches = [[i % len(ds) for i in b] for b in EPOCH_A]
    with peers.open_transport("inline", ds, workers=0) as ref:
        want = _run_epoch(ref, batches)
    with CollateLimit(ds, max_batch=8) as limit:
        _assert_same(_run_epoch(limit, batches), want)
