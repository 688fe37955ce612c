"""The zygote starts when a loader whose workers come from it is constructed (issue 27,
mploader/_zygote.py ``warm_for_loader``): its imports then overlap the user's set-up
before the first ``iter()``.  Each case runs in a fresh process (the zygote is one per
process), with a hard timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATASET = textwrap.dedent("""
    import os
    import torch

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 6
        def __getitem__(self, i):
            return torch.tensor([i, os.getppid()])
""")

SCRIPT = textwrap.dedent("""
    import json, multiprocessing, sys
    import psutil
    import mploader.torch as mt
    from mploader import _zygote
    from rowsdata import Rows

    def zygote(settled=False):
        pid = _zygote.zygote_pid()
        if pid is None:
            return None
        # The boot the zygote was started with.  Its /proc cmdline is read only once it
        # has served a request: Popen returns while the kernel is still setting up the
        # new program, before its arguments are in place, so a read just after the start
        # finds none in most starts (287 of 300 bare Popen starts here; under load the
        # loader's construction no longer covered that window: 2 failures in a suite run).
        args = _zygote._Zygote.proc.args
        if settled:
            assert psutil.Process(pid).cmdline() == list(args), (psutil.Process(pid).cmdline(), args)
        return {"pid": pid, "preload": json.loads(args[-1])["preload"]}

    if __name__ == "__main__":
        case = sys.argv[1]
        out = {"before": zygote()}
        if case == "default":
            # the context left to multiprocessing: read, not fixed (the user may still set it)
            mt.DataLoader(Rows(), num_workers=2)
            out["default_fork"] = zygote()
            multiprocessing.set_start_method("forkserver")
            loader = mt.DataLoader(Rows(), batch_size=2, num_workers=2)
        else:
            mt.DataLoader(Rows(), num_workers=2, multiprocessing_context="fork")
            mt.DataLoader(Rows(), num_workers=0)
            out["fork_or_inline"] = zygote()
            loader = mt.DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context=case)
        out["constructed"] = zygote()
        out["batches"] = [b.tolist() for b in loader]
        out["after"] = zygote(settled=True)   # (its workers came from it: it has run)
        loader.close()
        print(json.dumps(out))
""")


def run_case(tmp_path, case: str, **env: str) -> dict:
    (tmp_path / "rowsdata.py").write_text(DATASET)
    script = tmp_path / "warm.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path, env=dict(os.environ, **env))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_zygote_starts_with_the_loader_and_preloads_the_datasets_module(tmp_path, method):
    out = run_case(tmp_path, method)
    assert out["before"] is None and out["fork_or_inline"] is None   # fork, or no workers: no zygote
    zygote = out["constructed"]
    # the dataset's module, and its base class's (torch's, imported at construction, not
    # because this process imported torch: the zygote preloads what the dataset needs)
    assert zygote is not None and "rowsdata" in zygote["preload"] and "torch.utils.data.dataset" in zygote["preload"]
    assert "torch" not in zygote["preload"]
    assert out["after"] == zygote   # the workers came from the zygote started at construction
    assert [row for b in out["batches"] for row in b] == [[i, zygote["pid"]] for i in range(6)]


def test_the_default_context_is_read_without_fixing_it(tmp_path):
    """``multiprocessing_context=None`` under fork (this platform's default before
    Python 3.14) starts no zygote and leaves ``set_start_method`` to the user."""
    out = run_case(tmp_path, "default")
    assert out["before"] is None and out["default_fork"] is None
    assert out["constructed"] is not None and out["after"] == out["constructed"]
    assert [row[1] for b in out["batches"] for row in b] == [out["constructed"]["pid"]] * 6


def test_no_zygote_at_construction_where_it_is_turned_off(tmp_path):
    out = run_case(tmp_path, "spawn", MPLOADER_ZYGOTE="0")
    assert out["constructed"] is None and out["after"] is None
    assert [row[0] for b in out["batches"] for row in b] == list(range(6))


NOTEBOOK_MODULE = textwrap.dedent("""
    import torch
    import mploader.torch as mt

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return i

    # a module that also builds a loader when it is imported (notebook style)
    LOADER = mt.DataLoader(Rows(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
""")

NOTEBOOK_SCRIPT = textwrap.dedent("""
    import json
    import psutil
    import mploader.torch as mt
    import notebookish

    loader = mt.DataLoader(notebookish.Rows(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    batches = [b.tolist() for b in loader]   # the zygote has served a request: its preloads are done
    zygotes = [p.pid for p in psutil.Process().children(recursive=True)
               if any("mploader._zygote import main" in a for a in p.cmdline())]
    loader.close()
    print(json.dumps({"batches": batches, "zygotes": len(zygotes)}))
""")


def test_a_module_that_builds_a_loader_when_imported_starts_no_zygote_in_the_zygote(tmp_path):
    """The zygote preloads the dataset's module; a module that builds a spawn loader at
    import did so inside the zygote, which started a zygote of its own, which
    preloaded the module again: a chain of zygotes, one torch import each (3 after
    3 s before the fix)."""
    (tmp_path / "notebookish.py").write_text(NOTEBOOK_MODULE)
    script = tmp_path / "nb.py"
    script.write_text(NOTEBOOK_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"batches": [[0, 1], [2, 3]], "zygotes": 1}
