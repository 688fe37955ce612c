"""Where the staged epoch boundary's time goes, step by step (issue 27).

Usage (repository root, extensions built): ``PYTHONPATH=. python bench/epoch_boundary_breakdown.py [--epochs N]``

The setting of ``bench/epoch_boundary_footprint.py spin``: the Gluon face, ``seed=0``,
2 workers, epochs of 16 batches of 8 cheap samples, a 2 ms step spun on the CPU
between batches and 20 ms before each epoch's ``iter()`` (every batch of the next
epoch staged and loaded by then).  The library's steps that an epoch's ``iter()`` and
first ``next()`` run are wrapped (in this process; its files are not changed) with a
timer that counts only inside that window, inclusive of what each calls; printed:
each step's median over the epochs, in microseconds, largest first, and the medians
of ``iter()`` and of the first ``next()`` as a whole.  A wrapper costs ~0.1-0.3 µs a
call, so the sums run a little above ``epoch_boundary_footprint.py``'s.  Results:
docs/bench-log.md, "Seventh session: the staged epoch boundary, step by step".
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from typing import Any

# The footprint script's dataset and pause (this script's directory is on sys.path when run as a file)
from epoch_boundary_footprint import Rows, pause

import mploader
from mploader import _dispatch, _engine, _receive, _run, _scheduler, _state, _steps, dataloader, sampler

_ON = [False]
_spent: dict[str, int] = {}

#: (owner, attribute names): the steps timed.
STEPS = [
    (dataloader.DataLoader, ["__iter__"]),
    (dataloader._LoaderIter, ["__init__"]),
    (sampler.RandomSampler, ["set_epoch"]),
    (_state.MapState, ["start_epoch"]),
    (_engine.Engine, ["busy", "run", "ensure_workers", "next_batch"]),
    (_run.Run, ["__init__"]),
    (_scheduler.Scheduler, ["take_staged", "_take_over", "adopt", "abandon", "next_batch", "_consume",
                            "_reap_stale"]),
    (_dispatch.Dispatch, ["staff", "_fill"]),
    (_receive.Receive, ["_await", "replace_dead"]),
    (_steps, ["pull", "adopt"]),
]


def _timed(f: Any, key: str) -> Any:
    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _ON[0]:
            return f(*args, **kwargs)
        t0 = time.perf_counter_ns()
        try:
            return f(*args, **kwargs)
        finally:
            _spent[key] = _spent.get(key, 0) + time.perf_counter_ns() - t0
    return timed


def _wrap() -> None:
    for owner, names in STEPS:
        for name in names:
            setattr(owner, name, _timed(getattr(owner, name), f"{owner.__name__}.{name}"))


def main(epochs: int) -> None:
    _wrap()
    loader = mploader.DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=2, seed=0)
    times: dict[str, list[int]] = defaultdict(list)
    it = iter(loader)
    try:
        for _ in range(epochs):
            for _batch in it:
                pause("spin", 0.002)
            pause("spin", 0.02)
            _spent.clear()
            _ON[0] = True
            t0 = time.perf_counter_ns()
            it = iter(loader)
            t1 = time.perf_counter_ns()
            next(it)
            t2 = time.perf_counter_ns()
            _ON[0] = False
            _spent["iter() as a whole"] = t1 - t0
            _spent["first next() as a whole"] = t2 - t1
            for key, ns in _spent.items():
                times[key].append(ns)
        stats = loader.stats()
    finally:
        loader.close()
    for key, ns in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"{statistics.median(ns) / 1e3:8.1f} us  {key}")
    print(f"staged_used {stats['staged_used']} of {16 * epochs} batches")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=150)
    main(p.parse_args().epochs)
