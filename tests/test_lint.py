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

#: What ruff checks (relative to the repository root).
RUFF_PATHS = ["mploader/cli.py", "mploader/__main__.py", "mploader/_version.py", "bench",
              "mploader/_descriptor.py", "mploader/_structure.py", "mploader/_inband.py", "mploader/_sizing.py",
              "tests/test_descriptor.py", "tests/test_core_fallback.py", "tests/test_core_roundtrip.py",
              "mploader/_metrics.py", "mploader/_diagnose.py", "tests/test_metrics.py",
              "mploader/__init__.py", "mploader/_options.py", "mploader/_pinning.py", "mploader/_collate.py",
              "mploader/dataloader.py", "mploader/sharded.py", "mploader/iterators.py", "mploader/_chainer_state.py",
              "mploader/sampler.py", "mploader/batchify.py", "mploader/_batchify_arrays.py",
              "tests/test_options.py", "tests/test_dataloader_gluon.py", "tests/test_iterators.py",
              "tests/test_sharded.py", "tests/test_batchify.py", "tests/test_sampler.py", "tests/test_core_args.py",
              "tests/test_cli.py", "tests/test_lint.py", "tests/test_bench_cli.py",
              "tests/test_bench_data.py", "tests/test_bench_peers.py", "tests/test_bench_registry.py",
              "mploader/torch.py", "mploader/_torch_collate.py", "mploader/_torch_worker.py",
              "tests/test_torch_face.py", "tests/test_torch_collate.py", "tests/test_torch_memory.py",
              "tests/_torch_util.py",
              "mploader/_engine.py", "mploader/_scheduler.py", "mploader/_executors.py", "mploader/_protocol.py",
              "mploader/_errors.py", "mploader/_worker.py", "tests/test_engine.py", "tests/test_faults.py"]
#: What mypy checks; imports it follows are read but not reported on.
MYPY_ARGS = ["--follow-imports", "silent", "mploader/cli.py", "mploader/__main__.py",
             "mploader/_options.py", "mploader/_pinning.py", "mploader/_collate.py", "mploader/dataloader.py",
             "mploader/sharded.py", "mploader/iterators.py", "mploader/_chainer_state.py", "mploader/sampler.py",
             "mploader/batchify.py", "mploader/_batchify_arrays.py",
             "mploader/_descriptor.py", "mploader/_structure.py", "mploader/_inband.py", "mploader/_sizing.py",
             "mploader/_version.py", "bench/mploader_bench",
             "mploader/torch.py", "mploader/_torch_collate.py", "mploader/_torch_worker.py",
             "mploader/_engine.py", "mploader/_scheduler.py", "mploader/_executors.py", "mploader/_protocol.py",
             "mploader/_errors.py", "mploader/_worker.py",
             "mploader/_metrics.py", "mploader/_diagnose.py"]


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
