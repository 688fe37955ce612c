"""spawn/forkserver workers forked from the warm zygote (issue 27, mploader/_zygote.py):
the same batches as the fork path and as torch's DataLoader, nothing of the parent's
threads, locks or state in the workers, exit statuses through the zygote, and a zygote
that goes away with its parent."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

import mploader
from mploader import _zygote

METHODS = ["fork", "spawn", "forkserver"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Squares:
    def __init__(self, n: int = 37) -> None:
        self.x = np.arange(n * 3, dtype=np.float64).reshape(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.x[i] ** 2 + np.random.random()   # seeded per batch: the same for any method


def still_running_after(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Those of ``procs`` still running (zombies count as gone) once none is, or
    ``seconds`` from now at the latest."""
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + seconds
    left = [p for p in procs if running(p)]
    while left and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.02)
        left = [p for p in left if running(p)]
    return left


def gluon_batches(method: str, dataset, **kw) -> list[list]:
    with mploader.DataLoader(dataset, batch_size=4, num_workers=2, start_method=method, seed=5, **kw) as loader:
        return [np.asarray(b).tolist() for b in loader]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_gluon_face_batches_are_the_fork_paths(method):
    assert gluon_batches(method, Squares()) == gluon_batches("fork", Squares())


def test_workers_come_from_the_zygote_and_it_is_reused():
    with mploader.DataLoader(Squares(), batch_size=4, num_workers=2, start_method="spawn") as a:
        list(a)
        zygote = _zygote.zygote_pid()
        assert zygote is not None
        assert {psutil.Process(p).ppid() for p in a._engine.worker_pids()} == {zygote}
    with mploader.DataLoader(Squares(), batch_size=4, num_workers=3, start_method="forkserver") as b:
        list(b)
        assert {psutil.Process(p).ppid() for p in b._engine.worker_pids()} == {zygote}
        assert _zygote.zygote_pid() == zygote


# ---- torch face: map-style, iterable, lambdas, local classes -------------------------------

try:
    import torch
    from torch.utils.data import DataLoader as TorchDataLoader
    from torch.utils.data import Dataset, IterableDataset, get_worker_info

    import mploader.torch as mt
except ImportError:  # the core suite runs without torch
    torch = None
    Dataset = IterableDataset = object  # type: ignore[misc,assignment]
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


class MapDS(Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int):
        return {"x": torch.full((2,), float(i)), "r": torch.rand(1), "i": i}


class IterDS(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, 19, n):
            yield torch.tensor([i, wid])


def as_lists(batches) -> list:
    out = []
    for b in batches:
        if isinstance(b, dict):
            out.append({k: v.tolist() if hasattr(v, "tolist") else v for k, v in b.items()})
        else:
            out.append(b.tolist() if hasattr(b, "tolist") else b)
    return out


def run_both(dataset, method: str, **kw) -> tuple[list, list]:
    """(mploader.torch's batches under ``method``, torch's under fork), same seed."""
    kw.setdefault("batch_size", 4)
    got = as_lists(mt.DataLoader(dataset, num_workers=2, multiprocessing_context=method,
                                 generator=torch.Generator().manual_seed(3), **kw))
    ref = as_lists(TorchDataLoader(dataset, num_workers=2, multiprocessing_context="fork",
                                   generator=torch.Generator().manual_seed(3), **kw))
    return got, ref


@needs_torch
@pytest.mark.parametrize("method", METHODS)
def test_torch_face_map_style_batches_are_torchs(method):
    got, ref = run_both(MapDS(), method, shuffle=True)
    assert got == ref


@needs_torch
@pytest.mark.parametrize("method", METHODS)
def test_torch_face_iterable_batches_are_torchs(method):
    got, ref = run_both(IterDS(), method)
    assert got == ref


@needs_torch
@pytest.mark.parametrize("method", METHODS)
def test_lambda_collate_and_local_classes_work_under_every_method(method):
    class LocalDS(Dataset):       # a local class: pickled by value
        def __init__(self) -> None:
            self.scale = lambda v: v * 10           # a lambda attribute too

        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int):
            return self.scale(i)

    seen = []

    def init_fn(worker_id: int) -> None:            # a local function: by value
        seen.append(worker_id)                      # (in the worker's copy of the closure)

    got, ref = run_both(LocalDS(), method, collate_fn=lambda b: [x + 1 for x in b], worker_init_fn=init_fn)
    assert got == ref == [[1, 11, 21, 31], [41, 51, 61, 71], [81, 91]]
    assert seen == []                               # the workers' appends stayed in the workers


NOTEBOOK = textwrap.dedent("""
    import json, sys
    import torch
    import mploader.torch as mt

    class Cells(torch.utils.data.Dataset):          # defined in __main__, as in a notebook
        def __len__(self):
            return 9
        def __getitem__(self, i):
            return torch.tensor([i * 2.0]) + torch.rand(1)

    def collate(batch):                             # a __main__ function
        return torch.cat(batch).sum()

    out = {}
    for method in ["fork", "spawn", "forkserver"]:
        loader = mt.DataLoader(Cells(), batch_size=3, num_workers=2, multiprocessing_context=method,
                               collate_fn=collate, generator=torch.Generator().manual_seed(1))
        out[method] = [float(b) for b in loader]
        loader.close()
    print(json.dumps(out))
""")


@needs_torch
def test_a_notebook_style_main_class_works_under_every_method(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["fork"]) == 3
    assert out["spawn"] == out["fork"] and out["forkserver"] == out["fork"]


#: A script whose __main__ dataset uses module globals cloudpickle cannot pickle (a
#: lock, an open file): torch's spawn and forkserver workers import the script (as
#: ``__mp_main__``) and get globals of their own; by value it cannot travel at all.
MAIN_GLOBALS = textwrap.dedent("""
    import json, os, sys, threading
    import numpy as np
    import torch.utils.data as tud
    import mploader.torch as mt

    LOCK = threading.Lock()
    LOG = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "log.txt"), "a")
    OFFSET = 100

    class Rows:
        def __len__(self):
            return 6
        def __getitem__(self, i):
            with LOCK:
                LOG.write(f"{os.getpid()} {i}\\n")
                LOG.flush()
            return np.array([i, OFFSET, sys.modules["__main__"].__name__ == "__mp_main__"], np.int64)

    class Plain:   # picklable by value: its global OFFSET travels as the parent has it
        def __len__(self):
            return 2
        def __getitem__(self, i):
            return np.array([i, OFFSET], np.int64)

    def run(cls, method, dataset):
        loader = cls(dataset, batch_size=2, num_workers=2, multiprocessing_context=method)
        out = [b.tolist() for b in loader]
        if cls is mt.DataLoader:
            loader.close()
        return out

    if __name__ == "__main__":
        OFFSET = 5   # the parent's own value: a worker that imports the script has 100
        out = {m: {"mploader": run(mt.DataLoader, m, Rows()), "torch": run(tud.DataLoader, m, Rows()),
                   "plain": run(mt.DataLoader, m, Plain()), "plain_torch": run(tud.DataLoader, m, Plain())}
               for m in sys.argv[1:]}
        print(json.dumps(out))
""")


@needs_torch
@pytest.mark.parametrize("how", ["script", "-m"])
def test_a_main_class_using_unpicklable_globals_works_as_under_torchs_spawn(tmp_path, how):
    """Before, spawn and forkserver refused it (a PicklingError naming the lock) where
    torch's workers import the script; now the zygote imports it as torch's would
    (multiprocessing.spawn.prepare), and the batches -- the module's own OFFSET
    included -- are torch's own.  A class that pickles by value keeps the deliberate
    difference docs/faces.md states."""
    (tmp_path / "mainglobals.py").write_text(MAIN_GLOBALS)
    target = [str(tmp_path / "mainglobals.py")] if how == "script" else ["-m", "mainglobals"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    proc = subprocess.run([sys.executable, *target, "spawn", "forkserver"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for method in ("spawn", "forkserver"):
        assert out[method]["mploader"] == out[method]["torch"], method
        assert out[method]["mploader"] == [[[i, 100, 1], [i + 1, 100, 1]] for i in range(0, 6, 2)]
        # (docs/faces.md) a class that pickles by value takes the parent's globals, as
        # under fork; torch's workers have the script's own
        assert out[method]["plain"] == [[[0, 5], [1, 5]]]
        assert out[method]["plain_torch"] == [[[0, 100], [1, 100]]]
    # every sample logged through the workers' own LOG: 2 methods x 2 loaders x 6
    assert len((tmp_path / "log.txt").read_text().splitlines()) == 24


UNGUARDED = textwrap.dedent("""
    import threading
    import numpy as np
    import mploader.torch as mt

    LOCK = threading.Lock()

    class Rows:
        def __len__(self):
            return 4
        def __getitem__(self, i):
            with LOCK:
                return np.array([i])

    loader = mt.DataLoader(Rows(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    print([b.tolist() for b in loader])
""")


@needs_torch
def test_an_unguarded_script_the_zygote_must_import_fails_with_the_guard_named(tmp_path):
    """The zygote imports such a script (as above); without the ``__main__`` guard the
    script starts a loader's workers there: refused, the error says what to do (as
    spawn's children raise theirs), nothing hangs."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "the zygote could not start" in last and 'if __name__ == "__main__":' in last, proc.stderr[-3000:]


# ---- what the workers do not inherit -------------------------------------------------------

#: Held by a thread of the parent for the whole test (as a logging or stdout lock can be).
HELD = threading.Lock()
#: Changed in the parent at test time: a fresh worker sees the value the module sets.
STATE = {"x": 0}


class LockProbe:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> np.ndarray:
        free = HELD.acquire(blocking=False)
        if free:
            HELD.release()
        threads = threading.active_count()
        return np.array([free, threads, STATE["x"], "test_zygote_parent_only" in sys.modules], np.int64)


@pytest.mark.parametrize("method", METHODS)
def test_workers_do_not_inherit_the_parents_threads_locks_or_state(method):
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with HELD:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10)
    STATE["x"] = 7
    sys.modules["test_zygote_parent_only"] = sys   # a module only the parent has
    try:
        with mploader.DataLoader(LockProbe(), batch_size=2, num_workers=2, start_method=method,
                                 timeout=60) as loader:
            rows = np.concatenate([np.asarray(b) for b in loader]).tolist()
    finally:
        release.set()
        holder.join()
        STATE["x"] = 0
        del sys.modules["test_zygote_parent_only"]
    if method == "fork":   # the reference: fork copies the held lock, the state and the module
        assert all(r == [0, 1, 7, 1] for r in rows), rows
    else:                  # a fresh lock, one thread, the module's own state, no parent-only module
        assert all(r == [1, 1, 0, 0] for r in rows), rows


# ---- exit statuses through the zygote --------------------------------------------------------

class Dies:
    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            if self.how == "exit":
                os._exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        return i


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("how, says", [("exit", "exited with code 7"), ("kill", "killed by signal 9 (SIGKILL)")])
def test_a_workers_exit_status_reaches_the_worker_error(method, how, says):
    loader = mploader.DataLoader(Dies(how), batch_size=2, num_workers=2, start_method=method, timeout=60)
    try:
        with pytest.raises(mploader.WorkerError) as info:
            list(loader)
        assert says in str(info.value)
        assert (info.value.exitcode, info.value.signal) == ((7, None) if how == "exit" else (None, 9))
    finally:
        loader.close()


# ---- the zygote goes with its parent -----------------------------------------------------------

PARENT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import mploader
    from mploader import _zygote

    class DS:
        def __len__(self):
            return 10 ** 6
        def __getitem__(self, i):
            return np.zeros(4)

    loader = mploader.DataLoader(DS(), batch_size=2, num_workers=2, start_method=sys.argv[1])
    it = iter(loader)
    next(it)
    print(_zygote.zygote_pid(), *loader._engine.worker_pids(), flush=True)
    sys.stdin.read()   # until killed
""")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_zygote_and_its_workers_go_away_with_a_killed_parent(tmp_path, method):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), method], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, line
        procs = [psutil.Process(p) for p in pids]
    finally:
        parent.kill()
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()
    left = still_running_after(procs, 1.0)
    assert not left, f"still alive 1 s after the parent's SIGKILL: {left}"


def test_a_true_spawn_remains_behind_mploader_zygote_0(tmp_path):
    script = tmp_path / "true_spawn.py"
    script.write_text(textwrap.dedent("""
        import json
        import numpy as np
        import mploader
        from mploader import _zygote

        class DS:
            def __len__(self):
                return 12
            def __getitem__(self, i):
                return np.array([i, np.random.randint(1000)])

        if __name__ == "__main__":   # multiprocessing's spawn runs this module again in each worker
            out = {}
            for method in ["fork", "spawn"]:
                with mploader.DataLoader(DS(), batch_size=4, num_workers=2, start_method=method, seed=2) as loader:
                    out[method] = [np.asarray(b).tolist() for b in loader]
            out["zygote"] = _zygote.zygote_pid()
            print(json.dumps(out))
    """))
    env = dict(os.environ, MPLOADER_ZYGOTE="0")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["zygote"] is None
    assert out["spawn"] == out["fork"] and len(out["fork"]) == 3


@needs_torch
def test_the_torch_faces_default_follows_multiprocessing_and_gluons_stays_fork(tmp_path):
    """``multiprocessing_context=None``: the torch face uses
    ``multiprocessing.get_start_method()`` (as torch does; Python 3.14's default on
    Linux is forkserver); the Gluon face keeps ``fork``."""
    script = tmp_path / "default.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing, os
        import numpy as np
        import torch
        import mploader, mploader.torch as mt
        from mploader import _zygote

        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return os.getppid()

        if __name__ == "__main__":
            multiprocessing.set_start_method("forkserver")
            loader = mt.DataLoader(DS(), batch_size=2, num_workers=1)
            parents = [int(p) for b in loader for p in b]
            out = {"torch": loader._mpl_engine.start_method, "zygote": parents == [_zygote.zygote_pid()] * 4}
            loader.close()
            with mploader.DataLoader(DS(), batch_size=2, num_workers=1) as gluon:
                parents = [int(p) for b in gluon for p in np.asarray(b)]
                out["gluon"] = gluon._engine.start_method
                out["gluon_parent_is_us"] = parents == [os.getpid()] * 4
            print(json.dumps(out))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"torch": "forkserver", "zygote": True, "gluon": "fork", "gluon_parent_is_us": True}


def test_a_killed_zygote_is_replaced_at_the_next_start():
    """The zygote killed (the OOM killer, a stray kill): the next worker start makes a
    new one; a worker of the old one that dies has an unknown status, never a hang."""
    loader = mploader.DataLoader(Squares(), batch_size=4, num_workers=1, start_method="spawn", timeout=60)
    try:
        assert len(list(loader)) == 10
        old = _zygote.zygote_pid()
        assert old is not None
        orphan = loader._engine._res.workers[0]
        os.kill(old, signal.SIGKILL)
        psutil.Process(old).wait(10)   # reaped here: it is this process's child
        os.kill(orphan.pid, signal.SIGKILL)
        assert orphan.reap(block=True)
        assert orphan.status is not None and (orphan.status.exitcode, orphan.status.signal) == (None, None)
        with mploader.DataLoader(Squares(), batch_size=4, num_workers=2, start_method="spawn", seed=5) as fresh:
            assert [np.asarray(b).tolist() for b in fresh] == gluon_batches("fork", Squares())
            assert _zygote.zygote_pid() not in (None, old)
    finally:
        loader.close()


def test_a_parent_that_blocked_sigchld_still_learns_its_workers_exit_status(tmp_path):
    """A signal mask survives fork and exec: a zygote started by a thread that blocked
    SIGCHLD was never woken by its workers' deaths, and the loader waited for its
    timeout (the script hung) instead of raising WorkerError."""
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        import numpy as np
        import mploader

        class Dies:
            def __len__(self):
                return 8
            def __getitem__(self, i):
                if i == 5:
                    os._exit(7)
                return np.zeros(2)

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        loader = mploader.DataLoader(Dies(), batch_size=2, num_workers=2, start_method="spawn", timeout=20)
        try:
            list(loader)
        except mploader.WorkerError as exc:
            print("WorkerError", exc.exitcode)
        finally:
            loader.close()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "WorkerError 7"


AT_IMPORT = """
import os

import numpy as np

import mploader

# The generation of this process: 0 in the script, one more in each process started
# from a process that imported this module (a worker gets the script's environment).
if os.environ.get("AT_IMPORT_PID") == str(os.getpid()):
    GENERATION = int(os.environ["AT_IMPORT_GENERATION"])   # imported again in this process
else:
    GENERATION = int(os.environ.get("AT_IMPORT_GENERATION", "-1")) + 1
    os.environ.update(AT_IMPORT_GENERATION=str(GENERATION), AT_IMPORT_PID=str(os.getpid()))
with open(os.environ["AT_IMPORT_LOG"], "a") as log:
    log.write(f"{GENERATION} {os.getpid()}\\n")
if GENERATION >= 3:   # the test's own cap: without the guard each new zygote imports this module again
    raise ImportError("at_import: too deep")


class DS:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.array([i])


with mploader.DataLoader(DS(), batch_size=2, num_workers=2, start_method=os.environ["AT_IMPORT_METHOD"]) as loader:
    BATCHES = [np.asarray(b).tolist() for b in loader]
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_module_iterating_a_loader_at_import_fails_once(tmp_path, method):
    """A module that iterates a spawn/forkserver loader when imported, and defines its
    dataset's class: the zygote imports it to find the class, and its loader used to
    start a zygote of the zygote, which imported it again, without end (a chain of
    interpreters, each holding torch where the module imports it, outliving the
    parent).  Now a start in a zygote, or in a worker still unpacking its spec, raises
    RuntimeError, as multiprocessing's spawn refuses a start during a child's
    bootstrapping phase: the workers exit with it and the parent gets a WorkerError."""
    (tmp_path / "at_import.py").write_text(AT_IMPORT)
    log = tmp_path / "imports.log"
    env = dict(os.environ, AT_IMPORT_LOG=str(log), AT_IMPORT_METHOD=method,
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    for key in ("AT_IMPORT_GENERATION", "AT_IMPORT_PID"):
        env.pop(key, None)
    script = textwrap.dedent("""
        import mploader
        try:
            import at_import
        except mploader.WorkerError as exc:
            print("WorkerError", exc.exitcode)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    imports = [tuple(int(x) for x in line.split()) for line in log.read_text().splitlines()]
    generations = sorted({g for g, _ in imports})
    assert generations == [0, 1], (imports, proc.stderr[-3000:])   # the script, then its zygote and workers
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "WorkerError 1"
    assert "finished its bootstrapping phase" in proc.stderr
    # Nothing of the script's tree outlives it (the zygote goes with its parent).
    procs = []
    for _, pid in imports:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    left = still_running_after(procs, 5.0)
    assert not left, left


def test_a_forked_child_of_a_process_with_a_zygote_warns_nothing(tmp_path):
    """A fork worker started after the zygote dropped the parent's ``Popen`` of it:
    ``Popen.__del__`` then warned, in each worker, that the zygote "is still running"
    (a ResourceWarning printed under ``-X dev``, an exception ignored under ``-W
    error``).  The child now keeps the object unused."""
    script = tmp_path / "fork_after_zygote.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import mploader
        from mploader import _zygote

        class DS:
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return np.array([i])

        if __name__ == "__main__":
            with mploader.DataLoader(DS(), batch_size=2, num_workers=1, start_method="spawn") as loader:
                list(loader)
            assert _zygote.zygote_pid() is not None
            with mploader.DataLoader(DS(), batch_size=2, num_workers=2, start_method="fork") as loader:
                print(len(list(loader)))
    """))
    proc = subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "4"
    assert "ResourceWarning" not in proc.stderr, proc.stderr[-3000:]


ARGV_MODULE = """
import argparse

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--scale", type=int, default=1)
ARGS = parser.parse_args()
with open("offset.txt") as f:   # relative to the working directory
    OFFSET = int(f.read())


class DS:
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return np.array([i * ARGS.scale + OFFSET])
"""


def test_modules_imported_for_workers_see_the_parents_argv_and_working_directory(tmp_path):
    """A module that parses ``sys.argv`` (argparse at module level) or opens a relative
    path when imported, imported by the zygote to find the dataset's class: it saw the
    zygote's own command line (argparse: "unrecognized arguments", the workers exited
    with code 2) and the working directory the zygote started in.  Now it sees the
    parent's, at each worker start, as a child of multiprocessing's spawn does."""
    (tmp_path / "argv_module.py").write_text(ARGV_MODULE)
    (tmp_path / "offset.txt").write_text("100")
    run = tmp_path / "run"
    run.mkdir()
    (run / "offset.txt").write_text("7")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import numpy as np
        import mploader
        from mploader import _zygote

        if __name__ == "__main__":
            _zygote.warm()          # started here, in the script's directory
            os.chdir("run")         # the run's directory, where its offset.txt is
            import argv_module
            out = {}
            for method in ["fork", "spawn", "forkserver"]:
                with mploader.DataLoader(argv_module.DS(), batch_size=3, num_workers=2, start_method=method) as loader:
                    out[method] = [np.asarray(b).ravel().tolist() for b in loader]
            print(json.dumps(out))
    """))
    proc = subprocess.run([sys.executable, str(script), "--scale", "3"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fork"] == [[7, 10, 13], [16, 19, 22]]
    assert out["spawn"] == out["fork"] and out["forkserver"] == out["fork"], (out, proc.stderr[-2000:])


def test_workers_write_to_the_parents_stdout_and_stderr_as_they_are_at_the_start(tmp_path):
    """The parent's fds 1 and 2 redirected after its zygote started (a logger that
    captures the console at the descriptor level, as ``wandb`` or pytest's ``capfd``
    do): spawn/forkserver workers printed to the streams the zygote was started with,
    where a spawned child's go to the parent's current ones."""
    script = tmp_path / "redirected.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import numpy as np
        import mploader
        from mploader import _zygote

        class DS:
            def __len__(self):
                return 2
            def __getitem__(self, i):
                print(f"out {i}", flush=True)
                print(f"err {i}", file=sys.stderr, flush=True)
                return np.array([i])

        if __name__ == "__main__":
            method, out_path, err_path = sys.argv[1:]
            with mploader.DataLoader(DS(), batch_size=1, num_workers=1, start_method=method) as loader:
                list(loader)   # the zygote runs from here on, its fds 1 and 2 the terminal's
            assert _zygote.zygote_pid() is not None
            os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT), 1)
            os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT), 2)
            with mploader.DataLoader(DS(), batch_size=1, num_workers=1, start_method=method) as loader:
                assert [np.asarray(b).tolist() for b in loader] == [[[0]], [[1]]]
    """))
    for method in ["spawn", "forkserver"]:
        out, err = tmp_path / f"{method}.out", tmp_path / f"{method}.err"
        proc = subprocess.run([sys.executable, str(script), method, str(out), str(err)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, err.read_text()[-3000:] if err.exists() else proc.stderr[-3000:]
        # (the loader may run a staged epoch's first batches too: each line at least once)
        assert {"out 0", "out 1"} <= set(out.read_text().splitlines()), (method, proc.stdout)
        assert {"err 0", "err 1"} <= set(err.read_text().splitlines()), (method, proc.stderr)
        assert proc.stdout.count("out 0") <= 2   # the first loader's (its epoch, and one staged)


EDITED_MODULE = """
import numpy as np


class DS:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.array([i * {scale}])
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_run_a_module_as_it_is_on_disk_when_they_start(tmp_path, method):
    """The dataset's module edited on disk (and reloaded in the parent: a notebook
    with autoreload) after the zygote imported it: the next loader's workers ran the
    old code, where a spawned child -- torch's spawn and forkserver workers -- imports
    the file as it is.  Now the zygote sees the file changed, starts no worker, and
    the parent starts a new zygote; the old one stays while its workers (a loader
    started before the edit) run, and exits once they have."""
    (tmp_path / "edited.py").write_text(EDITED_MODULE.format(scale=1))
    script = tmp_path / "notebook.py"
    script.write_text(textwrap.dedent("""
        import importlib, json, sys
        import numpy as np
        import mploader
        from mploader import _zygote
        import edited

        def batches(loader):
            return [np.asarray(b).ravel().tolist() for b in loader]

        if __name__ == "__main__":
            method = sys.argv[1]
            out = {}
            kept = mploader.DataLoader(edited.DS(), batch_size=4, num_workers=2, start_method=method)
            out["before"] = batches(kept)
            old = _zygote.zygote_pid()
            with open(edited.__file__, "w") as f:
                f.write(sys.argv[2])
            importlib.reload(edited)
            with mploader.DataLoader(edited.DS(), batch_size=4, num_workers=2, start_method=method) as loader:
                out["after"] = batches(loader)
            out["new_zygote"] = _zygote.zygote_pid() not in (None, old)
            out["kept"] = batches(kept)   # its workers started before the edit
            retired = _zygote._Zygote.retired
            out["old_running"] = [p.pid for p, _ in retired if p.poll() is None] == [old]
            kept.close()
            out["old_exit"] = retired[0][0].wait(timeout=30)
            print(json.dumps(out))
    """))
    proc = subprocess.run([sys.executable, str(script), method, EDITED_MODULE.format(scale=100)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"before": [[0, 1, 2, 3]], "after": [[0, 100, 200, 300]], "new_zygote": True,
                   "kept": [[0, 1, 2, 3]], "old_running": True, "old_exit": 0}, proc.stderr[-2000:]
