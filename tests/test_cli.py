"""The ``mploader`` command and the library's import hygiene.

``import mploader`` and ``mploader --help`` must load neither the benchmark
harness (``mploader_bench``) nor its heavy dependencies.  What a fresh
interpreter imported is read from ``python -X importtime`` (CPython lists every
module it imports on stderr), independently of the code under test.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

import mploader
from mploader import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Top-level packages that `import mploader` and `mploader --help` must not load.
HEAVY = ("mploader_bench", "torch", "skimage", "matplotlib", "PIL", "rich", "tqdm", "xxhash",
         "scipy")


def _imported(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGS`` with this checkout first on the path; return
    the process and the names of the modules it imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    names = set()
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return p, names


def _heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in HEAVY)


def test_import_mploader_loads_no_harness_nor_heavy_dependency():
    p, names = _imported(["-c", "import mploader; print(mploader.__file__)"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == mploader.__file__   # the package these tests import (checkout or installed)
    assert "mploader" in names and "numpy" in names  # the reading itself works
    assert _heavy(names) == []
    assert "mploader.cli" not in names and "mploader.torch" not in names


def test_mploader_help_loads_no_harness_nor_heavy_dependency():
    p, names = _imported(["-m", "mploader", "--help"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "bench" in p.stdout and "usage: mploader" in p.stdout
    assert "mploader.cli" in names
    assert _heavy(names) == []


def test_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench" in out and "--version" in out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mploader {mploader.__version__}"
    assert cli.main([]) == 2  # no command: the help, and a usage exit status
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_command_is_one_line(capsys):
    assert cli.main(["benchmark"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mploader: error: ") and "'benchmark'" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_without_harness_says_how_to_install(monkeypatch, capsys):
    # A None entry makes `import mploader_bench` raise ModuleNotFoundError, as when the
    # harness is not installed.
    for name in [n for n in sys.modules if n.split(".")[0] == "mploader_bench"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mploader_bench", None)
    assert cli.main(["bench", "--suite", "transport"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mploader bench: error: the benchmark harness (package "
                          "mploader_bench) is not installed")
    assert "make bench" in err and len(err.strip().splitlines()) == 1


def test_bench_hands_its_arguments_to_the_harness(monkeypatch):
    harness = pytest.importorskip("mploader_bench.cli")
    seen = []
    monkeypatch.setattr(harness, "main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["bench", "--suite", "transport", "--workers", "1"]) == 7
    assert seen == [["--suite", "transport", "--workers", "1"]]


def _toml(path: str) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(path, "rb") as f:
        return tomllib.load(f)


def test_one_version_source():
    project = _toml(os.path.join(REPO, "pyproject.toml"))
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) == mploader.__version__
    # The installed metadata agrees when it was built from this very tree.
    try:
        dist = importlib.metadata.distribution("mploader")
    except importlib.metadata.PackageNotFoundError:
        return
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url == "file://" + REPO:
        assert dist.version == mploader.__version__


def test_changelog_has_unreleased_and_the_current_version():
    with open(os.path.join(REPO, "CHANGELOG.md")) as f:
        text = f.read()
    assert "## [Unreleased]" in text
    assert f"## [{mploader.__version__}]" in text


def test_library_wheel_holds_only_the_library():
    project = _toml(os.path.join(REPO, "pyproject.toml"))
    assert project["tool"]["setuptools"]["packages"] == ["mploader", "mploader.integrations"]
    bench = _toml(os.path.join(REPO, "bench", "pyproject.toml"))
    assert bench["tool"]["setuptools"]["packages"] == ["mploader_bench"]
    assert os.path.isdir(os.path.join(REPO, "bench", "mploader_bench"))
    assert not os.path.exists(os.path.join(REPO, "mploader", "_bench"))


def test_project_installs_pin_torch_users_get_a_range():
    project = _toml(os.path.join(REPO, "pyproject.toml"))
    extras = project["project"]["optional-dependencies"]
    (torch,) = extras["torch"]
    oldest = torch.partition(">=")[2]
    assert oldest, f"mploader[torch] should give a range from the oldest supported: {torch!r}"
    with open(os.path.join(REPO, "README.md")) as f:
        assert f"from **{oldest}** on" in f.read(), "README must state the oldest torch"
    # the core test extras need no torch, scikit-image nor matplotlib
    assert not [r for r in extras["testcore"] if r.split(">")[0].split("=")[0].lower()
                in ("torch", "scikit-image", "matplotlib")]
    with open(os.path.join(REPO, "constraints.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f]
    assert "torch==2.13.0" in pins
    with open(os.path.join(REPO, "Makefile")) as f:
        makefile = f.read()
    assert "-c constraints.txt" in makefile
