"""Adding a transport to the benchmarks is one registered class in ``mploader_bench.peers``.

A toy transport (a thread pool collating in the calling process) is registered
for one test at a time; both suites and the command line must then run it, and
its batches are checked against the inline reference by the suites themselves.
"""
from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

peers = pytest.importorskip("mploader_bench.peers")
from mploader import cli  # noqa: E402


class _Threads(peers.Transport):
    """Collates each batch with :func:`peers.collate` in a thread pool, in order."""

    name = "toy-threads"

    def __init__(self, dataset, **kw):
        super().__init__(dataset, **kw)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, self.workers))

    def _epoch(self, batches):
        def work(indices):
            return peers.collate([self.dataset[i] for i in indices])

        yield from self._pool.map(work, batches)

    def _close(self):
        self._pool.shutdown(wait=True)


@pytest.fixture()
def toy():
    """Register a fresh subclass of `_Threads` for one test, and unregister it after."""
    made = []

    def make(**attrs):
        cls = type("Toy", (_Threads,), attrs)
        peers.register(cls)
        made.append(cls.name)
        return cls

    yield make
    for name in made:
        peers._REGISTRY.pop(name, None)


def test_registered_transport_is_listed_where_its_suites_and_requirements_say(toy):
    toy()
    assert peers.transport_names()[-1] == "toy-threads"
    assert "toy-threads" in peers.transport_names("images")
    assert "toy-threads" in peers.available_transports("transport")
    peers._REGISTRY.pop("toy-threads")
    toy(suites=("transport",), requires=("mploader_no_such_module",))
    assert "toy-threads" not in peers.transport_names("images")
    assert "toy-threads" in peers.transport_names("transport")
    assert peers.missing_requirements("toy-threads") == ["mploader_no_such_module"]
    assert "toy-threads" not in peers.available_transports()


def test_register_refuses_bad_transports(toy):
    toy()
    with pytest.raises(ValueError, match="'toy-threads' is empty or already registered"):
        toy()
    with pytest.raises(ValueError, match=r"unknown suites \['video'\]"):
        toy(name="toy-video", suites=("video",))
    with pytest.raises(TypeError, match="expects a Transport subclass"):
        peers.register(dict)
    with pytest.raises(ValueError, match="unknown transport 'nope'"):
        peers.missing_requirements("nope")


def test_registered_transport_runs_in_the_transport_suite(toy, tmp_path):
    from mploader_bench import transport

    toy()
    report = transport.run(workers=1, repeats=1, seconds=0.01, sizes=("tiny",),
                           transports=("toy-threads", "inline"), out_dir=None, quiet=True)
    assert not report["errors"]
    # collate-limit, the reference of every row's share of the limit, always runs too
    assert {r["transport"] for r in report["runs"]} == {"toy-threads", "inline", "collate-limit"}
    share = report["medians"]["tiny"]["toy-threads"]["share_of_limit"]
    limit = report["medians"]["tiny"]["collate-limit"]["batches_per_s"] * report["limit_cores"]
    assert share == report["medians"]["tiny"]["toy-threads"]["batches_per_s"] / limit


def test_a_transport_delivering_wrong_batches_is_caught_by_the_transport_suite(toy):
    from mploader_bench import transport

    def _epoch(self, batches):
        for batch in _Threads._epoch(self, batches):
            first = np.array(batch[0], copy=True)
            first.flat[0] += 1
            yield (first, *batch[1:])

    toy(_epoch=_epoch)
    report = transport.run(workers=1, repeats=1, seconds=0.01, sizes=("tiny",),
                           transports=("toy-threads",), out_dir=None, quiet=True)
    assert "toy-threads" in json.dumps(report["errors"])


def test_registered_transport_runs_in_the_images_suite_from_the_command_line(toy, tmp_path, capsys):
    pytest.importorskip("PIL")
    from PIL import Image

    toy()
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / c / f"{i}.jpg")
    argv = ["bench", "--data", str(root), "--transports", "inline,toy-threads", "--workers", "1",
            "--batch-size", "3", "--batches", "2", "--repeats", "1", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--format", "raw"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "images-latest.json").read_text())
    assert report["verification"]["ok"]
    assert list(report["formats"]["raw"]["transports"]) == ["inline", "toy-threads"]


def test_command_line_names_a_missing_requirement(toy, tmp_path, capsys):
    toy(requires=("mploader_no_such_module",))
    assert cli.main(["bench", "--transports", "toy-threads", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "transport 'toy-threads' is not available here (cannot import mploader_no_such_module" in err
