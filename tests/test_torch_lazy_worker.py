"""A torch-face worker starts without torch (issue 27, docs/design.md "Workers"): under
spawn and forkserver, a NumPy dataset's workers -- and the zygote they are forked from --
never import torch, and where user code imports it later (in ``__getitem__`` or
``worker_init_fn``) the worker's torch state is the one eager seeding gives.

Each case runs in a fresh process (the zygote is one per process, and a zygote that
imported torch for an earlier loader keeps it), with a hard timeout.  References:
torch's own ``DataLoader`` (fork: its seeding does not depend on the start method),
mploader's fork path (torch imported in every worker), and a loader whose dataset
module imports torch (the zygote then imports torch before it forks: eager)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# No torch at the top of this module: a dataset from here needs none.
LAZY_MODULE = textwrap.dedent('''
    import random
    import sys

    import numpy as np


    class Rows:
        """NumPy only."""
        def __init__(self, n=24):
            self.x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], i, float(i) / 2, np.random.rand(), random.random(), "torch" in sys.modules


    INIT = None


    def init_fn(worker_id):
        import torch
        global INIT
        INIT = [worker_id, torch.rand(1).item(), torch.initial_seed(), torch.utils.data.get_worker_info().id,
                torch.get_num_threads()]


    class Draws:
        """Imports torch in __getitem__ (from sample ``late`` on)."""
        def __init__(self, n=16, late=0):
            self.n, self.late = n, late
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            had = "torch" in sys.modules
            out = [i, np.random.rand(), random.random()]
            if i >= self.late:
                import torch
                from torch.utils.data import get_worker_info
                info = get_worker_info()
                out += [torch.rand(2).tolist(), torch.randint(0, 1 << 30, (1,)).item(), info.id, info.num_workers,
                        info.seed, info.dataset is self, torch.get_num_threads(), torch.initial_seed()]
            return out, INIT or [-1, -1.0, -1, -1, -1], had


    class Holder:
        """Holds whatever it is given (a tensor: the pickle names torch)."""
        def __init__(self, x):
            self.x = x
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], "torch" in sys.modules
''')

# The same datasets from a module that imports torch: the zygote imports it before the fork.
EAGER_MODULE = textwrap.dedent('''
    import torch  # noqa: F401

    from lazyds import Draws, Rows, init_fn  # noqa: F401


    class EagerDraws(Draws):
        pass


    class EagerRows(Rows):
        pass
''')

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import mploader.torch as mt
    from mploader import _zygote
    from lazyds import Draws, Holder, Rows, init_fn
    from eagerds import EagerDraws, EagerRows


    def plain(x):
        if isinstance(x, torch.Tensor):
            return [str(x.dtype), x.tolist()]
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x


    def zygote_has_torch():
        pid = _zygote.zygote_pid()
        if pid is None:
            return None
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()


    def run(cls, dataset, method, take=None, state=None, **kw):
        kw.setdefault("generator", torch.Generator().manual_seed(7))
        kw.setdefault("num_workers", 2)
        kw.setdefault("batch_size", 2)
        if cls is mt.DataLoader:
            kw["multiprocessing_context"] = method
        loader = cls(dataset, **kw)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        got = [plain(b) for _, b in zip(range(take or 10**9), it)]
        saved = json.loads(json.dumps(loader.state_dict())) if take is not None else None
        if cls is mt.DataLoader:
            loader.close()
        return got, saved


    def ref(dataset, **kw):
        return run(torch.utils.data.DataLoader, dataset, "fork", multiprocessing_context="fork", **kw)[0]


    case, method = sys.argv[1], sys.argv[2]
    out = {}
    if case == "numpy":
        out["got"] = run(mt.DataLoader, Rows(), method)[0]
        out["zygote_torch"] = zygote_has_torch()
        out["want"] = ref(Rows())
        out["draws"] = run(mt.DataLoader, Draws(), method)[0]
        out["draws_want"] = ref(Draws())
        out["init"] = run(mt.DataLoader, Draws(), method, worker_init_fn=init_fn)[0]
        out["init_want"] = ref(Draws(), worker_init_fn=init_fn)
        out["seeded"] = run(mt.DataLoader, Draws(), method, seed=3)[0]
        out["seeded_want"] = run(mt.DataLoader, Draws(), "fork", seed=3)[0]
        out["zygote_torch_after_draws"] = zygote_has_torch()
        out["tensors"] = run(mt.DataLoader, Holder(torch.arange(32.).reshape(8, 4)), method)[0]
        out["zygote_torch_after_tensors"] = zygote_has_torch()
    elif case == "resume":
        cls = {"lazy": Draws, "eager": EagerDraws}[method]
        ctx = "fork" if sys.argv[3] == "fork" else "spawn"
        # late=8: torch is imported from sample 8 on, after the checkpoint (3 batches of
        # 2, and at most 2 batches ahead per worker): the lazy workers hold no torch when
        # saved.  late=2: the saved workers drew from torch, the resumed ones import it
        # at their first sample and must take up the saved torch state there.
        kw = dict(shuffle=False, persistent_workers=True, prefetch_factor=1)
        for late in (8, 2):
            head, state = run(mt.DataLoader, cls(late=late), ctx, take=3, **kw)
            rest = run(mt.DataLoader, cls(late=late), ctx, state=state, **kw)[0]
            whole = run(mt.DataLoader, cls(late=late), ctx, **kw)[0]
            out[late] = {"head": head, "state": state, "rest": rest, "whole": whole}
    print(json.dumps(out))
''')


def run_case(tmp_path, *args: str) -> dict:
    (tmp_path / "lazyds.py").write_text(LAZY_MODULE)
    (tmp_path / "eagerds.py").write_text(EAGER_MODULE)
    script = tmp_path / "lazy_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def had_torch(batches: list) -> list:
    """The last column of each batch: whether the worker had torch when it loaded the sample."""
    return [flag for b in batches for flag in b[-1][1]]


def without_flags(batches: list) -> list:
    return [b[:-1] for b in batches]


#: Columns of a ``Draws`` sample that name the worker which built it: ``get_worker_info()``'s
#: ``id`` and ``seed``.
WORKER_COLUMNS = (5, 7)


def without_worker(batches: list) -> list:
    """:func:`without_flags`, and the ``Draws`` columns that name the worker left out: with
    ``seed=`` each task goes to the least-loaded worker, so which worker builds a batch
    depends on timing (docs/faces.md, "PyTorch"); its draws do not."""
    return [[[c for k, c in enumerate(b[0]) if k not in WORKER_COLUMNS]] + b[1:] for b in without_flags(batches)]


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_numpy_dataset_workers_have_no_torch_and_give_torchs_batches(tmp_path, method):
    out = run_case(tmp_path, "numpy", method)
    lazy = method != "fork"
    # NumPy samples: no torch in the workers, nor in the zygote; torch's batches all the same
    assert had_torch(out["got"]) == [not lazy] * 24
    assert without_flags(out["got"]) == without_flags(out["want"])
    if lazy:
        assert out["zygote_torch"] is False
    # torch imported in __getitem__: the draws, get_worker_info(), one thread and the
    # initial seed are torch's own (each worker's first sample imports it)
    assert without_flags(out["draws"]) == without_flags(out["draws_want"])
    flags = had_torch(out["draws"])
    assert flags == ([False, True] * 2 + [True] * 12 if lazy else [True] * 16)
    # worker_init_fn importing torch and drawing from it
    assert without_flags(out["init"]) == without_flags(out["init_want"])
    assert out["init"][0][1][0][1] != -1.0   # (the init draw reached the batch)
    # seed= (per-batch seeding): torch imported inside a batch is seeded as that batch
    assert without_worker(out["seeded"]) == without_worker(out["seeded_want"])
    assert {i for b in out["seeded"] for i in b[0][WORKER_COLUMNS[0]][1]} <= {0, 1}
    if lazy:
        assert out["zygote_torch_after_draws"] is False   # the workers imported torch, not the zygote
        # a dataset holding tensors: its pickle names torch, so the zygote imports it before the fork
        assert out["zygote_torch_after_tensors"] is True
    assert had_torch(out["tensors"]) == [True] * 8
    assert [x for b in out["tensors"] for x in b[0][1]] == [[4.0 * i + k for k in range(4)] for i in range(8)]


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_checkpoint_rng_states_are_the_same_with_and_without_torch_in_the_workers(tmp_path, method):
    """A state saved while the workers never imported torch holds the torch state eager
    seeding gives, and a resumed lazy worker that imports torch later draws as an eager
    one: the lazy loader (NumPy module), the eager one (a module that imports torch)
    and the uninterrupted run agree."""
    lazy_run = run_case(tmp_path, "resume", "lazy", method)
    eager_run = run_case(tmp_path, "resume", "eager", method)
    for late in ("8", "2"):
        lazy, eager = lazy_run[late], eager_run[late]
        assert lazy["state"]["worker_rng"] == eager["state"]["worker_rng"], late
        states = lazy["state"]["worker_rng"]["states"]
        assert all(s is not None and s["torch"] is not None for s in states)
        if method == "spawn":
            assert all(had_torch(eager["head"] + eager["rest"]))
            if late == "8":   # saved while the lazy workers had no torch
                assert not any(had_torch(lazy["head"]))
            else:             # the resumed lazy workers started without it
                assert had_torch(lazy["rest"])[:2] == [False, True]
        assert without_flags(lazy["head"]) == without_flags(eager["head"]), late
        assert without_flags(lazy["rest"]) == without_flags(eager["rest"]), late
        assert without_flags(lazy["head"] + lazy["rest"]) == without_flags(lazy["whole"]), late


NO_TORCH_COLLATE = textwrap.dedent('''
    import json, pickle, sys, warnings
    import numpy as np
    from mploader import _torch_collate as tc

    tc.learn(pickle.loads(bytes.fromhex(sys.argv[1])))   # what the parent's Fetch brings
    ro = np.arange(6, dtype=np.float32).reshape(2, 3)
    ro.flags.writeable = False
    batches = {
        "tuples": [(np.full(3, i, np.int16), i, i / 2, i % 2 == 0, "s", np.float32(i), np.int64(i)) for i in range(4)],
        "readonly": [ro[0], ro[1]],
        "dicts": [{"a": np.ones(2), "b": [1, 2], "c": b"x"} for _ in range(3)],
    }
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, batch in batches.items():
            out[name] = pickle.dumps(tc.collate_into(batch, lambda shape, dtype: np.zeros(shape, dtype))).hex()
    print(json.dumps({"torch": "torch" in sys.modules, "warnings": [str(w.message) for w in caught], "out": out,
                      "samples": pickle.dumps(batches).hex()}))
''')


def test_numpy_collation_without_torch_is_default_collates(tmp_path):
    """In a process without torch (a lazy worker), NumPy samples -- arrays, numbers,
    bools, NumPy scalars, strings, dicts, read-only arrays -- collate to what torch's
    default_collate gives, without importing torch; the read-only warning has torch's text."""
    import pickle

    from _torch_util import as_torch_worker, assert_same_batch

    from mploader import _torch_collate

    script = tmp_path / "no_torch_collate.py"
    script.write_text(NO_TORCH_COLLATE)
    facts = pickle.dumps(_torch_collate.numpy_facts()).hex()
    p = subprocess.run([sys.executable, str(script), facts], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["torch"] is False
    assert res["warnings"] == [_torch_collate._NOT_WRITABLE]
    want = pickle.loads(bytes.fromhex(res["samples"]))   # the samples the child collated
    assert sorted(want) == sorted(res["out"]) == ["dicts", "readonly", "tuples"]
    for name, samples in want.items():
        got = _torch_collate.to_tensors(pickle.loads(bytes.fromhex(res["out"][name])))
        with as_torch_worker(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # (torch's own read-only warning, here in the test)
            assert_same_batch(got, torch.utils.data.default_collate(samples), name)
