"""ruff and mypy as tests: their configuration is in pyproject.toml ([tool.ruff], [tool.mypy]).

Each runs in a subprocess over the source tree and fails with the tools' own report.
They skip where the tools are not installed (they come with the ``lint`` and ``test``
extras; ``make test`` installs the versions pinned in constraints.txt).  To fix a
failure: ``ruff check --fix`` for what it can fix, then read what is left.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What ruff checks: the whole tree (files git ignores are skipped; exceptions are
#: per-file-ignores in pyproject.toml, each with its reason).
RUFF_PATHS = ["."]
#: What mypy checks: the `files` of [tool.mypy] (the mploader package and the harness).
MYPY_ARGS: list[str] = []


def _tool(module: str, *args: str) -> None:
    pytest.importorskip(module)
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"{module} {' '.join(args)} failed:\n{p.stdout}{p.stderr}"


def test_ruff():
    _tool("ruff", "check", "--no-cache", *RUFF_PATHS)


def test_mypy():
    _tool("mypy", *MYPY_ARGS)


def test_the_tools_do_report_with_this_configuration(tmp_path):
    """A lint test that cannot fail is no test: with the project's configuration each
    tool rejects a file with a planted fault."""
    pytest.importorskip("ruff")
    pytest.importorskip("mypy")
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x: int) -> str:\n    try:\n        return x\n"
                   "    except Exception:\n        return ''\n")
    config = os.path.join(REPO, "pyproject.toml")
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", config,
                        str(bad)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "F401" in p.stdout and "BLE001" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "mypy", "--config-file", config,
                        "--cache-dir", str(tmp_path / "cache"), str(bad)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "return-value" in p.stdout, p.stdout + p.stderr
