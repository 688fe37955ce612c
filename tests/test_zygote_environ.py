"""A worker forked from the zygote gets the parent's environment as it is at the
worker's start, not the zygote's (issue 27, mploader/_zygote.py: the zygote started
with the parent's environment of that moment; only what differs is changed in the
worker).  Run in a fresh interpreter, so that its zygote starts with a known
environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(script: str, method: str, unset: tuple[str, ...] = (), **env_extra: str) -> dict:
    """``script`` in a fresh interpreter with ``method`` as its argument, the zygote on,
    ``MPLOADER_RNG_FALLBACK`` and ``unset`` not in its environment, ``env_extra`` in
    it; its last line's JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **env_extra)
    for name in ("MPLOADER_ZYGOTE", "MPLOADER_RNG_FALLBACK", *unset):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", script, method], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

CASE = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    import mploader
    from mploader import _zygote

    NAMES = ["MPL_ENV_GONE", "MPL_ENV_CHANGED", "MPL_ENV_ADDED", "MPL_ENV_KEPT"]

    class Env:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            value = os.environ.get(NAMES[i])
            return np.array([-1 if value is None else len(value)], dtype=np.int64)

    def seen(method):
        with mploader.DataLoader(Env(), batch_size=4, num_workers=2, start_method=method, seed=0) as loader:
            return [np.asarray(b).ravel().tolist() for b in loader]

    _zygote.warm()                       # the zygote starts with the environment of now
    assert _zygote.zygote_pid() is not None
    del os.environ["MPL_ENV_GONE"]
    os.environ["MPL_ENV_CHANGED"] = "after!"
    os.environ["MPL_ENV_ADDED"] = "xy"
    first = seen(sys.argv[1])
    os.environ["MPL_ENV_GONE"] = "back"  # a second loader: the environment of its own start
    del os.environ["MPL_ENV_ADDED"]
    second = seen(sys.argv[1])
    print(json.dumps({"first": first, "second": second, "fork": seen("fork")}))
''')


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_get_the_parents_environment_at_their_start(method):
    got = run_case(CASE, method, unset=("MPL_ENV_ADDED",), MPL_ENV_GONE="gone", MPL_ENV_CHANGED="before",
                   MPL_ENV_KEPT="kept!!")
    # lengths of GONE, CHANGED, ADDED, KEPT (-1: unset), as the parent had them
    assert got["first"] == [[-1, 6, 2, 6]]
    assert got["second"] == [[4, 6, -1, 6]]
    assert got["fork"] == got["second"]


RNG_CASE = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    import mploader
    from mploader import _rng_state, _zygote

    class Path:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.array([_rng_state.path() == "fast", np.random.randint(1 << 30)], dtype=np.int64)

    def seen(method):
        with mploader.DataLoader(Path(), batch_size=2, num_workers=2, start_method=method, seed=3) as loader:
            return [np.asarray(b).tolist() for b in loader]

    _zygote.warm()               # checks the RNG layout with the environment of now
    fast = seen(sys.argv[1])
    os.environ[_rng_state.FORCE_ENV] = "1"
    forced = seen(sys.argv[1])
    del os.environ[_rng_state.FORCE_ENV]
    print(json.dumps({"fast": fast, "forced": forced, "again": seen(sys.argv[1]), "fork": seen("fork")}))
''')


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_follow_the_rng_fallback_switch_of_their_start(method):
    """The zygote checks the RNG layout once for its workers (mploader._rng_state); a
    worker started with ``MPLOADER_RNG_FALLBACK`` set since uses the fallback, one
    started after it is unset the in-place path again, with the same draws."""
    got = run_case(RNG_CASE, method)
    assert [row[0] for batch in got["fast"] for row in batch] == [1, 1, 1, 1]
    assert [row[0] for batch in got["forced"] for row in batch] == [0, 0, 0, 0]
    assert got["again"] == got["fast"]
    draws = [[row[1] for row in batch] for batch in got["fork"]]
    for key in ("fast", "forced", "again"):
        assert [[row[1] for row in batch] for batch in got[key]] == draws, key
