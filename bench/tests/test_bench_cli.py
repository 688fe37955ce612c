"""``mploader bench`` (the harness's command line): argument errors and a tiny end-to-end bench.

Run through the library's entry point :func:`mploader.cli.main`, which hands
everything after ``bench`` to :func:`mploader_bench.cli.main`.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("mploader_bench")
from PIL import Image

from mploader import cli


def _folder(root, classes=("cat", "dog"), n=3, size=(48, 40)):
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}.jpg", quality=90)
    return root


def _run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mploader bench: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, err)


@pytest.fixture()
def empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_missing_data_folder(tmp_path, capsys):
    code, out, err = _run(["bench", "--data", str(tmp_path / "nope")], capsys)
    assert code == 2
    _one_line_error(err, "argument --data", "does not exist", str(tmp_path / "nope"))


def test_empty_data_folder(empty_dir, capsys):
    code, _, err = _run(["bench", "--data", str(empty_dir)], capsys)
    assert code == 2
    _one_line_error(err, "argument --data", "is empty", str(empty_dir))


def test_data_is_a_file(tmp_path, capsys):
    f = tmp_path / "f.jpg"
    f.write_bytes(b"x")
    code, _, err = _run(["bench", "--data", str(f)], capsys)
    assert code == 2
    _one_line_error(err, "argument --data", "not a directory")


def test_non_image_file_inside(tmp_path, capsys):
    root = _folder(tmp_path / "d")
    (root / "dog" / "labels.csv").write_text("a,b\n")
    code, _, err = _run(["bench", "--data", str(root)], capsys)
    assert code == 2
    _one_line_error(err, "argument --data", "not a JPEG or PNG image", "labels.csv")


def test_class_folder_without_images(tmp_path, capsys):
    root = _folder(tmp_path / "d")
    (root / "emu").mkdir()
    code, _, err = _run(["bench", "--data", str(root)], capsys)
    assert code == 2
    _one_line_error(err, "argument --data", "'emu' has no image")


@pytest.mark.parametrize("argv, needles", [
    (["--workers", "0"], ["argument --workers", "'0'", ">= 1"]),
    (["--workers", "two"], ["argument --workers", "'two'"]),
    (["--batch-size", "-3"], ["argument --batch-size", "'-3'"]),
    (["--batches", "1.5"], ["argument --batches", "'1.5'"]),
    (["--seconds", "0"], ["argument --seconds", "'0'"]),
    (["--seconds", "nan"], ["argument --seconds", "'nan'"]),
    (["--repeats", "0"], ["argument --repeats", "'0'"]),
    (["--seed", "-1"], ["argument --seed", "'-1'"]),
    (["--format", "gif"], ["argument --format", "'gif'"]),
    (["--format", ""], ["argument --format"]),
    (["--suite", "speed"], ["argument --suite", "'speed'"]),
    (["--transports", "mploader,zmq"], ["argument --transports", "'zmq'"]),
    (["--transports", ","], ["argument --transports"]),
    # collate-limit is the transport suite's reference, not an images transport
    (["--transports", "mploader,collate-limit"], ["argument --transports", "'collate-limit'"]),
    (["--batches", "3", "--seconds", "2"], ["argument --seconds", "--batches"]),
    (["--frobnicate"], ["--frobnicate"]),
])
def test_bad_values(argv, needles, capsys):
    code, _, err = _run(["bench", *argv], capsys)
    assert code == 2
    _one_line_error(err, *needles)


def test_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "out"
    f.write_text("")
    code, _, err = _run(["bench", "--transports", "inline", "--out", str(f)], capsys)
    assert code == 2
    _one_line_error(err, "argument --out", "not a directory")


def test_images_with_data(tmp_path, capsys):
    root = _folder(tmp_path / "d")
    code, _, err = _run(["bench", "--data", str(root), "--images", "10"], capsys)
    assert code == 2
    _one_line_error(err, "argument --images")


def test_help(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--data", "--format", "--suite", "--workers", "--batch-size", "--batches",
                "--seconds", "--repeats", "--transports", "--out", "--seed", "--cache-dir"):
        assert opt in out
    assert cli.main([]) == 2


def test_python_dash_m_reports_errors_without_traceback(tmp_path):
    for argv, needle in ([["--data", str(tmp_path / "missing")], "argument --data"],
                         [["--workers", "-2"], "argument --workers"]):
        p = subprocess.run([sys.executable, "-m", "mploader", "bench", *argv], cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def _tiny_argv(tmp_path, transports):
    root = _folder(tmp_path / "data", n=4)
    return ["bench", "--data", str(root), "--transports", transports, "--workers", "1",
            "--batch-size", "3", "--batches", "2", "--repeats", "1", "--out",
            str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]


def test_tiny_bench_end_to_end(tmp_path, capsys):
    transports = "mploader,pickle,inline"
    code, out, err = _run(_tiny_argv(tmp_path, transports), capsys)
    assert code == 0, err
    assert "images/s" in out and "jpeg" in out and "raw" in out
    report = json.loads((tmp_path / "out" / "images-latest.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "images-latest.png").stat().st_size > 1000
    assert report["verification"]["ok"]
    assert report["machine"]["cpu_model"] and report["decoder"]["decoder"] == "Pillow"
    for fmt in ("jpeg", "raw"):
        fr = report["formats"][fmt]
        assert list(fr["transports"]) == transports.split(",")
        assert fr["verification"]["batches_checked"] == 2
        for rec in fr["transports"].values():
            run = rec["runs"][0]
            assert run["images"] == 6 and run["images_per_s"] > 0 and run["wall_s"] > 0
            assert 0 <= run["wait_pct"] <= 100
            assert run["wait_ms_per_batch"] == pytest.approx(1000 * run["wait_s"] / 2)
            assert run["cpu_s_per_1k_images"] >= 0 and run["peak_pss_mb"] > 0
            assert run["other_cpu_pct"] >= 0
        assert fr["transports"]["pickle"]["x_pickle"] == pytest.approx(1.0)
        assert fr["transports"]["pickle"]["scaling_efficiency"] > 0
        # mploader.diagnose's verdict ("bound by"): 2 batches are too few; the peers keep no metrics
        assert fr["transports"]["mploader"]["median"]["verdict"] == "unknown"
        assert fr["transports"]["pickle"]["median"]["verdict"] is None


def test_tiny_bench_mismatch_fails_loudly(tmp_path, capsys, monkeypatch):
    from mploader_bench import peers

    original = peers._Pickle._epoch

    def corrupt(self, batches):
        for images, labels in original(self, batches):
            images = images.copy()
            images[0, 0, 0, 0] ^= 0xFF
            yield images, labels

    monkeypatch.setattr(peers._Pickle, "_epoch", corrupt)
    code, _, err = _run(_tiny_argv(tmp_path, "inline,pickle"), capsys)
    assert code == 3
    assert "batches differ" in err and "pickle" in err and "Traceback" not in err
    report = json.loads((tmp_path / "out" / "images-latest.json").read_text())
    assert not report["verification"]["ok"]
