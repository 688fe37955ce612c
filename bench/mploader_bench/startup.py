"""The start-up suite (``mploader bench --suite startup``, issue 27): time from
constructing a loader to its first batch, and the workers' summed USS (private
memory), for ``mploader.torch.DataLoader`` and ``torch.utils.data.DataLoader`` side
by side, under fork, forkserver and spawn, with 1, 4 and 8 workers.

The setting is the issue's: a map-style dataset holding one NumPy array (128 MiB by
default), ``batch_size=32``, ``persistent_workers=True``.  Each measurement runs in a
fresh process (``python -m mploader_bench.startup --child ...``) that imports torch,
builds the dataset, then times ``iter()`` + ``next()`` on a new loader:

* ``cold``: the process's first loader (for mploader, the zygote's start is included);
* ``warm``: a second loader in the same process, after the first was closed (mploader's
  zygote is running; torch starts its workers again as for the first).

* ``after set-up``: the process's first loader, constructed, then ``--setup-s``
  seconds of the user's own set-up (a sleep: the model, the optimiser, a trainer),
  then ``iter()`` + ``next()``: the wait that is left.  mploader starts its zygote
  when the loader is constructed, so its imports overlap the set-up; ``early=0`` (the
  A/B) starts it at the first worker, as before.  torch starts its workers at
  ``iter()``, so its wait is its cold time (not measured again).

The USS is summed over the workers after each has loaded a batch (``psutil``
``memory_full_info().uss``, pages mapped by that process only).  Repeats interleave the
loaders and methods in the same order; the table gives medians with min-max.

Epoch boundaries (``--parts epochs``): the issue's setting -- 2 workers, batches of 8
samples that each take ``SAMPLE_MS`` of CPU, a training step of ``STEP_MS`` (a sleep:
the accelerator's time) -- for ``EPOCHS`` epochs of ``EPOCH_BATCHES`` batches, with
persistent workers and without, for mploader's torch face, torch's ``DataLoader`` and
mploader's Gluon face with ``seed=`` (whose order is fixed in advance; its workers
always persist) and over a ``DistributedBatchSampler`` (``gluon-dist``: rank 0 of 1,
``set_epoch`` before each epoch), and the torch face with ``seed=`` and a sampler
generator of its own (``mploader-seed``): orders fixed in advance, so the next epoch's
first batches are dispatched while an epoch ends (a loader named with the suffix ``/unstaged``, e.g.
``--epoch-loaders gluon,gluon/unstaged``, runs with that staging off, interleaved).
Each cell runs in a fresh process.  The table gives the wait for the first batch of
epochs 2 and later (from ``iter()`` to the first ``next()``'s return) against the
steady-state wait in ``next()`` (the batches after the first ``STEADY_FROM`` of each
epoch: each run's median, and its mean -- the wait per batch where the workers are the
bottleneck and the waits two-valued), medians with min-max.  Beside it, the epoch's
start as a whole: the first ``STEADY_FROM`` batches' waits of epochs 2 and later,
summed, against ``STEADY_FROM`` steady medians -- what a boundary costs may land after
its first batch (the Gluon face stages the epoch after next at its second ``next()``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METHODS = ("fork", "forkserver", "spawn")
LOADERS = ("mploader", "torch")
DEFAULT_WORKERS = (1, 4, 8)
DEFAULT_MIB = 128
DEFAULT_REPEATS = 3
BATCH_SIZE = 32
#: Seconds one child may take (torch's spawn with 8 workers took 69 s on a busy machine).
CHILD_TIMEOUT_S = 600
#: The user's set-up between constructing the first loader and its iter() (seconds).
DEFAULT_SETUP_S = 1.0
PARTS = ("first", "epochs")
# The epoch-boundary cells (the issue's setting).
EPOCH_LOADERS = ("mploader", "mploader-seed", "torch", "gluon", "gluon-dist")
#: ``--epoch-loaders`` suffix: the same loader with the next epoch's staging off
#: (mploader._scheduler.STAGE_NEXT_EPOCH; docs/design.md, "No gap between epochs"),
#: for an A/B in one run.
UNSTAGED = "/unstaged"
EPOCH_METHODS = ("fork", "forkserver")
EPOCH_WORKERS = 2
EPOCH_BATCH = 8
SAMPLE_MS = 2.5      # CPU per sample: 20 ms per batch of 8
STEP_MS = 10.0       # the training step
EPOCHS = 20          # a run's first boundaries run cold, and 12 a cell were too few (docs/bench.md)
EPOCH_BATCHES = 16
STEADY_FROM = 4      # batches of each epoch before the steady state


class ArrayDataset:
    """A map-style dataset holding one float32 array of ``mib`` MiB, rows of 256."""

    def __init__(self, mib: int) -> None:
        import numpy as np

        self.x = np.arange((mib << 20) // 4, dtype=np.float32).reshape(-1, 256)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i]


def _worker_pids(loader: Any, which: str) -> list[int]:
    if which == "mploader":
        return list(loader._mpl_engine.worker_pids())
    it = loader._iterator
    return [w.pid for w in getattr(it, "_workers", [])]


def _uss_bytes(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().uss
        except psutil.Error:
            pass
    return total


def _one(which: str, method: str, workers: int, dataset: Any, setup_s: float = 0.0) -> dict[str, float]:
    """One loader: seconds from its construction to its first batch (``first_s``;
    with ``setup_s``, from the end of the set-up that follows its construction), and
    the workers' summed USS."""
    import torch.utils.data

    if which == "mploader":
        import mploader.torch

        cls: Any = mploader.torch.DataLoader
    else:
        cls = torch.utils.data.DataLoader
    t0 = time.perf_counter()
    loader = cls(dataset, batch_size=BATCH_SIZE, num_workers=workers, multiprocessing_context=method,
                 persistent_workers=True)
    if setup_s > 0:
        time.sleep(setup_s)   # the user's set-up (the model, the optimiser, ...)
        t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first_s = time.perf_counter() - t0
    for _ in range(2 * workers):   # every worker has loaded a batch (round robin)
        next(it)
    uss = _uss_bytes(_worker_pids(loader, which))
    del it
    if which == "mploader":
        loader.close()
    else:
        loader._iterator._shutdown_workers()
    del loader
    return {"first_s": first_s, "uss_mib": uss / 2**20}


def child(which: str, method: str, workers: int, mib: int, setup_s: float = 0.0, early: bool = True
          ) -> dict[str, Any]:
    """In a fresh process: the cold and the warm measurement of one cell (torch: the
    cold one only; its second loader starts its workers again the same way); with
    ``setup_s``, the first loader's wait after the set-up instead (``after_setup``),
    with the zygote started at the loader's construction (``early``) or, as before,
    at its first worker."""
    import torch  # noqa: F401 - the setting is a torch user's process

    from mploader_bench.startup import ArrayDataset as Importable  # by reference, not __main__'s

    dataset = Importable(mib)
    if setup_s > 0:
        if not early:
            from mploader import _zygote

            _zygote.warm_for_loader = lambda *a, **k: False   # the A/B: no start at construction
        return {"after_setup": _one(which, method, workers, dataset, setup_s)}
    cold = _one(which, method, workers, dataset)
    warm = _one(which, method, workers, dataset) if which == "mploader" else None
    return {"cold": cold, "warm": warm}


def _run_child(which: str, method: str, workers: int, mib: int, setup_s: float = 0.0,
               early: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mploader_bench.startup", "--child", which, method, str(workers), str(mib),
           "--setup-s", str(setup_s), "--early", str(int(early))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit " + str(proc.returncode)]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)`` of ``values`` in ``fmt`` ("--" if none; the median alone for one)."""
    if not values:
        return "--"
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def run(workers: Sequence[int] = DEFAULT_WORKERS, methods: Sequence[str] = METHODS,
        loaders: Sequence[str] = LOADERS, repeats: int = DEFAULT_REPEATS, mib: int = DEFAULT_MIB,
        out_dir: str | None = None, echo: Any = print, setup_s: float = DEFAULT_SETUP_S,
        parts: Sequence[str] = PARTS, epoch_methods: Sequence[str] = EPOCH_METHODS,
        epoch_loaders: Sequence[str] = EPOCH_LOADERS, epochs: int = EPOCHS) -> dict[str, Any]:
    """Run the suite and print its tables; returns the report (also written as JSON to
    ``out_dir/startup.json`` when given).  ``parts``: "first" (the first batch and the
    USS), "epochs" (the epoch boundaries, ``epochs`` per run: ``epochs - 1`` first
    batches of epochs 2+ per run and cell)."""
    from .machine import machine_info

    started = time.time()
    rows = _first_rows(workers, methods, loaders, repeats, mib, setup_s, echo) if "first" in parts else []
    epoch_rows = _epoch_rows(epoch_methods, epoch_loaders, repeats, echo, epochs) if "epochs" in parts else []
    report = {"suite": "startup", "dataset_mib": mib, "batch_size": BATCH_SIZE, "repeats": repeats,
              "setup_s": setup_s, "epoch_setting": epoch_setting(epochs),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
              "seconds": round(time.time() - started, 1), "machine": machine_info(with_torch=True), "rows": rows,
              "epoch_rows": epoch_rows}
    if rows:
        echo(format_table(report))
    if epoch_rows:
        echo(format_epoch_table(report))
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "startup.json").write_text(json.dumps(report, indent=1))
    return report


def _first_rows(workers: Sequence[int], methods: Sequence[str], loaders: Sequence[str], repeats: int, mib: int,
                setup_s: float, echo: Any) -> list[dict]:
    cells: dict[tuple[str, str, int], list[dict]] = {}
    for r in range(repeats):
        for method in methods:
            for n in workers:
                for which in loaders:
                    res = _run_child(which, method, n, mib)
                    if which == "mploader" and setup_s > 0 and method != "fork" and "error" not in res:
                        for early in (True, False):   # the A/B of the zygote's start
                            after = _run_child(which, method, n, mib, setup_s, early)
                            res["after_setup" if early else "after_setup_late"] = (
                                after if "error" in after else after["after_setup"])
                    cells.setdefault((which, method, n), []).append(res)
                    echo(f"  repeat {r + 1}/{repeats} {which:8s} {method:10s} {n} workers: "
                         + (json.dumps(res) if "error" in res else
                            f"cold {res['cold']['first_s']:.3f} s / {res['cold']['uss_mib']:.0f} MiB"
                            + (f", warm {res['warm']['first_s']:.3f} s / {res['warm']['uss_mib']:.0f} MiB"
                               if res["warm"] else "")
                            + "".join(f", {k} {res[k].get('first_s', float('nan')):.3f} s"
                                      for k in ("after_setup", "after_setup_late") if k in res)))
    rows = []
    for (which, method, n), results in cells.items():
        ok = [x for x in results if "error" not in x]

        def firsts(key: str, ok: list = ok) -> list[float]:
            return [x[key]["first_s"] for x in ok if isinstance(x.get(key), dict) and "first_s" in x[key]]
        rows.append({
            "loader": which, "method": method, "workers": n, "runs": len(ok),
            "errors": [x["error"] for x in results if "error" in x]
            + [x[k]["error"] for x in ok for k in ("after_setup", "after_setup_late")
               if isinstance(x.get(k), dict) and "error" in x[k]],
            "cold_first_s": firsts("cold"),
            "warm_first_s": [x["warm"]["first_s"] for x in ok if x["warm"]],
            "after_setup_first_s": firsts("after_setup"),
            "after_setup_late_first_s": firsts("after_setup_late"),
            "cold_uss_mib": [x["cold"]["uss_mib"] for x in ok],
            "warm_uss_mib": [x["warm"]["uss_mib"] for x in ok if x["warm"]],
        })
    return rows


def format_table(report: dict) -> str:
    """The report as a Markdown table: per method and worker count, mploader's and
    torch's time to the first batch (cold and warm), mploader's wait after the user's
    set-up (zygote started at construction / at the first worker) and the workers'
    summed USS."""
    by = {(r["loader"], r["method"], r["workers"]): r for r in report["rows"]}
    setup_s = report.get("setup_s", 0)
    lines = [f"Start-up: {report['dataset_mib']} MiB dataset, batch_size={report['batch_size']}, "
             f"persistent_workers=True; medians (min-max) of {report['repeats']} runs, each in a fresh process",
             "",
             "cold: the process's first loader (mploader: the zygote's start included); warm: mploader's "
             "second loader in the same process (torch's second loader starts its workers as its first did); "
             f"after set-up: the first loader's iter() + next() after {setup_s:g} s of the user's set-up, the "
             "zygote started when the loader was constructed / at its first worker (before); torch's is its cold "
             "time",
             "",
             "| start method | workers | first batch, cold: mploader / torch (s) | first batch, warm: mploader (s) "
             "| after set-up: mploader / before (s) | workers' summed USS: mploader / torch (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    workers = sorted({r["workers"] for r in report["rows"]})
    for method in methods:
        for n in workers:
            m, t = by.get(("mploader", method, n)), by.get(("torch", method, n))

            def cell(key: str, fmt: str, m: Any = m, t: Any = t) -> str:
                return " / ".join(spread(x[key], fmt) if x else "--" for x in (m, t))

            warm = spread(m["warm_first_s"], ".2f") if m else "--"
            after = " / ".join(spread(m.get(k, []), ".2f") for k in ("after_setup_first_s",
                                                                       "after_setup_late_first_s")) if m else "--"
            lines.append(f"| {method} | {n} | {cell('cold_first_s', '.2f')} | {warm} | {after} | "
                         f"{cell('cold_uss_mib', '.0f')} |")
    errors = [f"{r['loader']} {r['method']} {r['workers']}: {e}" for r in report["rows"] for e in r["errors"]]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors]
    return "\n".join(lines)


# ---- epoch boundaries ------------------------------------------------------------------

def epoch_setting(epochs: int = EPOCHS) -> dict[str, Any]:
    return {"workers": EPOCH_WORKERS, "batch_size": EPOCH_BATCH, "sample_ms": SAMPLE_MS, "step_ms": STEP_MS,
            "epochs": epochs, "epoch_batches": EPOCH_BATCHES, "steady_from": STEADY_FROM}


class BusyDataset:
    """``EPOCH_BATCHES * EPOCH_BATCH`` samples, each ``SAMPLE_MS`` of CPU (a busy loop
    over the thread's CPU clock: a loaded machine stretches the wall time, not the
    work), returning a float32 row of 64."""

    def __len__(self) -> int:
        return EPOCH_BATCHES * EPOCH_BATCH

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        end = time.thread_time() + SAMPLE_MS / 1000
        while time.thread_time() < end:
            pass
        return np.full(64, i, dtype=np.float32)


def _epoch_loader(which: str, method: str, persistent: bool) -> tuple[Any, Any]:
    """The loader of an epoch cell, and what the training loop calls before each
    epoch's ``iter()`` with the epoch (``set_epoch`` of a ``DistributedBatchSampler``,
    as its users do; None for the others)."""
    from mploader_bench.startup import BusyDataset as Importable  # by reference, not __main__'s

    dataset = Importable()
    which, _, variant = which.partition("/")
    if variant:   # "unstaged": the A/B's other side
        import mploader._scheduler

        mploader._scheduler.STAGE_NEXT_EPOCH = False
    if which == "gluon":
        import mploader

        return mploader.DataLoader(dataset, batch_size=EPOCH_BATCH, shuffle=True, num_workers=EPOCH_WORKERS,
                                   start_method=method, seed=0), None
    if which == "gluon-dist":   # the Gluon face over DistributedBatchSampler (rank 0 of 1), set_epoch each epoch
        import mploader

        sampler = mploader.DistributedBatchSampler(len(dataset), EPOCH_BATCH, seed=0, rank=0, world_size=1)
        return mploader.DataLoader(dataset, batch_sampler=sampler, num_workers=EPOCH_WORKERS,
                                   start_method=method, seed=0), sampler.set_epoch
    import torch.utils.data

    if which == "mploader-seed":   # an order fixed in advance: seed= and the sampler's own generator
        import mploader.torch

        return mploader.torch.DataLoader(dataset, batch_size=EPOCH_BATCH, shuffle=True, num_workers=EPOCH_WORKERS,
                                         multiprocessing_context=method, persistent_workers=persistent, seed=0,
                                         generator=torch.Generator().manual_seed(0)), None
    if which == "mploader":
        import mploader.torch

        cls: Any = mploader.torch.DataLoader
    else:
        cls = torch.utils.data.DataLoader
    return cls(dataset, batch_size=EPOCH_BATCH, shuffle=True, num_workers=EPOCH_WORKERS,
               multiprocessing_context=method, persistent_workers=persistent), None


def epoch_child(which: str, method: str, persistent: bool, epochs: int = EPOCHS) -> dict[str, Any]:
    """In a fresh process: the wait in ``next()`` of every batch of ``epochs`` epochs
    (seconds), one list per epoch, the first batch's counted from ``iter()`` (torch's
    ``iter()`` over persistent workers dispatches the epoch's first tasks and waits for
    its workers); a ``STEP_MS`` sleep after each batch."""
    import torch  # noqa: F401 - the setting is a torch user's process

    loader, before_epoch = _epoch_loader(which, method, persistent)
    waits: list[list[float]] = []
    try:
        for e in range(epochs):
            if before_epoch is not None:
                before_epoch(e)
            t0 = time.perf_counter()
            it = iter(loader)
            epoch: list[float] = []
            while True:
                if epoch:
                    t0 = time.perf_counter()
                try:
                    next(it)
                except StopIteration:
                    break
                epoch.append(time.perf_counter() - t0)
                time.sleep(STEP_MS / 1000)
            waits.append(epoch)
            del it
        stats = loader.stats() if hasattr(loader, "stats") else {}
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    # the batches dispatched ahead and taken over (mploader's loaders; docs/design.md, "No gap between epochs")
    return {"waits": waits, "staged_used": stats.get("staged_used"), "staged_dropped": stats.get("staged_dropped")}


def _run_epoch_child(which: str, method: str, persistent: bool, epochs: int = EPOCHS) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mploader_bench.startup", "--epoch-child", which, method,
           "persistent" if persistent else "restarted", "--epochs", str(epochs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit " + str(proc.returncode)]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def epoch_summary(waits: list[list[float]]) -> dict[str, list[float]]:
    """The first-batch waits of epochs 2 and later, the waits of their first
    ``STEADY_FROM`` batches summed (``start_ms``: the epoch's start as a whole), and
    the steady-state waits (the batches after the first ``STEADY_FROM`` of each
    epoch), in milliseconds.  Where the workers are the bottleneck the steady-state
    waits are two-valued (the workers finish together: about 0.2 ms, then a batch's
    load), so their median is either value by chance; the table also gives their
    mean, the wait per batch."""
    return {"first_ms": [1000 * e[0] for e in waits[1:] if e],
            "start_ms": [1000 * sum(e[:STEADY_FROM]) for e in waits[1:] if len(e) >= STEADY_FROM],
            "steady_ms": [1000 * w for e in waits for w in e[STEADY_FROM:]]}


def _epoch_rows(methods: Sequence[str], loaders: Sequence[str], repeats: int, echo: Any,
                epochs: int = EPOCHS) -> list[dict]:
    cells: dict[tuple[str, str, bool], dict[str, list]] = {}
    for r in range(repeats):
        for method in methods:
            for persistent in (True, False):
                for which in loaders:
                    if which.startswith("gluon") and not persistent:
                        continue   # the Gluon face's workers always persist
                    res = _run_epoch_child(which, method, persistent, epochs)
                    cell = cells.setdefault((which, method, persistent),
                                            {"first_ms": [], "start_ms": [], "steady_ms": [], "steady_mean_ms": [],
                                             "errors": []})
                    if "error" in res:
                        cell["errors"].append(res["error"])
                        echo(f"  repeat {r + 1}/{repeats} {which:8s} {method:10s} persistent={persistent}: "
                             f"{res['error']}")
                        continue
                    summary = epoch_summary(res["waits"])
                    cell["first_ms"] += summary["first_ms"]
                    cell["start_ms"] += summary["start_ms"]
                    # one median per run: each run weighs the same
                    cell["steady_ms"].append(statistics.median(summary["steady_ms"]))
                    cell["steady_mean_ms"].append(statistics.fmean(summary["steady_ms"]))
                    staged = ("" if res.get("staged_used") is None else
                              f", staged batches used {res['staged_used']}, dropped {res['staged_dropped']}")
                    echo(f"  repeat {r + 1}/{repeats} {which:8s} {method:10s} persistent={persistent}: first "
                         f"{spread(summary['first_ms'], '.2f')} ms, steady "
                         f"{statistics.median(summary['steady_ms']):.2f} ms{staged}")
    return [{"loader": which, "method": method, "persistent": persistent, **cell}
            for (which, method, persistent), cell in cells.items()]


EPOCH_LABELS = {"mploader": "mploader.torch", "mploader-seed": "mploader.torch (seed=, generator=)",
                "torch": "torch", "gluon": "mploader (Gluon, seed=)",
                "gluon-dist": "mploader (Gluon, DistributedBatchSampler)"}


def _epoch_label(which: str) -> str:
    base, _, variant = which.partition("/")
    return EPOCH_LABELS.get(base, base) + (", no staging" if variant else "")


def format_epoch_table(report: dict) -> str:
    """The epoch-boundary rows as a Markdown table: first-batch wait of epochs 2 and
    later, steady-state wait (the median and the mean of each run), the ratios of the
    medians, and the epoch's start as a whole (its first ``steady_from`` batches'
    waits summed) against as many steady medians."""
    st = report["epoch_setting"]
    lines = [f"Epoch boundaries: {st['workers']} workers, batches of {st['batch_size']} samples of "
             f"{st['sample_ms']:g} ms CPU each, a {st['step_ms']:g} ms training step, {st['epochs']} epochs of "
             f"{st['epoch_batches']} batches, shuffle=True; wait in next(), ms, medians (min-max) over "
             f"{report['repeats']} runs (first batch: every epoch after the first, from iter(); steady state: each "
             f"run's median, and mean, of the batches after the first {st['steady_from']} of each epoch; epoch "
             f"start: the first {st['steady_from']} batches of epochs 2+, summed, against {st['steady_from']} "
             f"steady medians)",
             "",
             "| start method | workers | loader | first batch of epochs 2+ (ms, from iter()) | steady state, "
             f"median (ms) | ratio | steady state, mean (ms) | ratio to mean | epoch start: first {st['steady_from']} "
             f"batches summed (ms) | ratio to {st['steady_from']} medians |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(first: list[float], steady: list[float], times: int = 1) -> str:
        return (f"{statistics.median(first) / (times * statistics.median(steady)):.1f}"
                if first and steady and statistics.median(steady) > 0 else "--")
    for r in report["epoch_rows"]:
        means, start = r.get("steady_mean_ms", []), r.get("start_ms", [])
        lines.append(f"| {r['method']} | {'persistent' if r['persistent'] else 'restarted'} | "
                     f"{_epoch_label(r['loader'])} | {spread(r['first_ms'], '.2f')} | "
                     f"{spread(r['steady_ms'], '.2f')} | {ratio(r['first_ms'], r['steady_ms'])} | "
                     f"{spread(means, '.2f')} | {ratio(r['first_ms'], means)} | {spread(start, '.2f')} | "
                     f"{ratio(start, r['steady_ms'], st['steady_from'])} |")
    errors = [f"{r['loader']} {r['method']} persistent={r['persistent']}: {e}" for r in report["epoch_rows"]
              for e in r["errors"]]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mploader_bench.startup")
    p.add_argument("--child", nargs=4, metavar=("LOADER", "METHOD", "WORKERS", "MIB"))
    p.add_argument("--epoch-child", nargs=3, metavar=("LOADER", "METHOD", "PERSISTENT"))
    p.add_argument("--early", type=int, default=1, help="(with --child) the zygote starts at construction")
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument("--mib", type=int, default=DEFAULT_MIB)
    p.add_argument("--setup-s", type=float, default=DEFAULT_SETUP_S,
                   help="the user's set-up between constructing the first loader and its iter() (0: not measured)")
    p.add_argument("--parts", default=",".join(PARTS), help="first (first batch, USS), epochs (epoch boundaries)")
    p.add_argument("--epoch-methods", default=",".join(EPOCH_METHODS))
    p.add_argument("--epoch-loaders", default=",".join(EPOCH_LOADERS))
    p.add_argument("--epochs", type=int, default=EPOCHS,
                   help="epochs per run of the epoch part (the first batches of epochs 2+ are timed)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.epochs < 2:
        p.error(f"--epochs must be at least 2 (the first batches of epochs 2 and later are timed), got {a.epochs}")
    if a.child:
        which, method, n, mib = a.child
        print(json.dumps(child(which, method, int(n), int(mib), a.setup_s if a.setup_s > 0 else 0.0,
                               bool(a.early))))
        return 0
    if a.epoch_child:
        which, method, persistent = a.epoch_child
        print(json.dumps(epoch_child(which, method, persistent == "persistent", a.epochs)))
        return 0
    run(workers=[int(x) for x in a.workers.split(",")], methods=a.methods.split(","),
        loaders=a.loaders.split(","), repeats=a.repeats, mib=a.mib, out_dir=a.out, setup_s=a.setup_s,
        parts=a.parts.split(","), epoch_methods=a.epoch_methods.split(","),
        epoch_loaders=a.epoch_loaders.split(","), epochs=a.epochs)
    return 0


if __name__ == "__main__":   # (multiprocessing's spawn runs this module again as __mp_main__)
    sys.exit(main())
