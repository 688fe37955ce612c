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

The USS is summed over the workers after each has loaded a batch (``psutil``
``memory_full_info().uss``, pages mapped by that process only).  Repeats interleave the
loaders and methods in the same order; the table gives medians with min-max.
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


def _one(which: str, method: str, workers: int, dataset: Any) -> dict[str, float]:
    import torch.utils.data

    if which == "mploader":
        import mploader.torch

        cls: Any = mploader.torch.DataLoader
    else:
        cls = torch.utils.data.DataLoader
    t0 = time.perf_counter()
    loader = cls(dataset, batch_size=BATCH_SIZE, num_workers=workers, multiprocessing_context=method,
                 persistent_workers=True)
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


def child(which: str, method: str, workers: int, mib: int) -> dict[str, Any]:
    """In a fresh process: the cold and the warm measurement of one cell (torch: the
    cold one only; its second loader starts its workers again the same way)."""
    import torch  # noqa: F401 - the setting is a torch user's process

    from mploader_bench.startup import ArrayDataset as Importable  # by reference, not __main__'s

    dataset = Importable(mib)
    cold = _one(which, method, workers, dataset)
    warm = _one(which, method, workers, dataset) if which == "mploader" else None
    return {"cold": cold, "warm": warm}


def _run_child(which: str, method: str, workers: int, mib: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mploader_bench.startup", "--child", which, method, str(workers), str(mib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit " + str(proc.returncode)]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "--"
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def run(workers: Sequence[int] = DEFAULT_WORKERS, methods: Sequence[str] = METHODS,
        loaders: Sequence[str] = LOADERS, repeats: int = DEFAULT_REPEATS, mib: int = DEFAULT_MIB,
        out_dir: str | None = None, echo: Any = print) -> dict[str, Any]:
    """Run the suite and print its table; returns the report (also written as JSON to
    ``out_dir/startup.json`` when given)."""
    from .machine import machine_info

    cells: dict[tuple[str, str, int], list[dict]] = {}
    started = time.time()
    for r in range(repeats):
        for method in methods:
            for n in workers:
                for which in loaders:
                    res = _run_child(which, method, n, mib)
                    cells.setdefault((which, method, n), []).append(res)
                    echo(f"  repeat {r + 1}/{repeats} {which:8s} {method:10s} {n} workers: "
                         + (json.dumps(res) if "error" in res else
                            f"cold {res['cold']['first_s']:.3f} s / {res['cold']['uss_mib']:.0f} MiB"
                            + (f", warm {res['warm']['first_s']:.3f} s / {res['warm']['uss_mib']:.0f} MiB"
                               if res["warm"] else "")))
    rows = []
    for (which, method, n), results in cells.items():
        ok = [x for x in results if "error" not in x]
        rows.append({
            "loader": which, "method": method, "workers": n, "runs": len(ok),
            "errors": [x["error"] for x in results if "error" in x],
            "cold_first_s": [x["cold"]["first_s"] for x in ok],
            "warm_first_s": [x["warm"]["first_s"] for x in ok if x["warm"]],
            "cold_uss_mib": [x["cold"]["uss_mib"] for x in ok],
            "warm_uss_mib": [x["warm"]["uss_mib"] for x in ok if x["warm"]],
        })
    report = {"suite": "startup", "dataset_mib": mib, "batch_size": BATCH_SIZE, "repeats": repeats,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
              "seconds": round(time.time() - started, 1), "machine": machine_info(with_torch=True), "rows": rows}
    echo(format_table(report))
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "startup.json").write_text(json.dumps(report, indent=1))
    return report


def format_table(report: dict) -> str:
    """The report as a Markdown table: per method and worker count, mploader's and
    torch's time to the first batch (cold and warm) and workers' summed USS."""
    by = {(r["loader"], r["method"], r["workers"]): r for r in report["rows"]}
    lines = [f"Start-up: {report['dataset_mib']} MiB dataset, batch_size={report['batch_size']}, "
             f"persistent_workers=True; medians (min-max) of {report['repeats']} runs, each in a fresh process",
             "",
             "cold: the process's first loader (mploader: the zygote's start included); warm: mploader's "
             "second loader in the same process (torch's second loader starts its workers as its first did)",
             "",
             "| start method | workers | first batch, cold: mploader / torch (s) | first batch, warm: mploader (s) "
             "| workers' summed USS: mploader / torch (MiB) |",
             "|---|---:|---:|---:|---:|"]
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    workers = sorted({r["workers"] for r in report["rows"]})
    for method in methods:
        for n in workers:
            m, t = by.get(("mploader", method, n)), by.get(("torch", method, n))

            def cell(key: str, fmt: str, m: Any = m, t: Any = t) -> str:
                return " / ".join(_spread(x[key], fmt) if x else "--" for x in (m, t))

            warm = _spread(m["warm_first_s"], ".2f") if m else "--"
            lines.append(f"| {method} | {n} | {cell('cold_first_s', '.2f')} | {warm} | "
                         f"{cell('cold_uss_mib', '.0f')} |")
    errors = [f"{r['loader']} {r['method']} {r['workers']}: {e}" for r in report["rows"] for e in r["errors"]]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mploader_bench.startup")
    p.add_argument("--child", nargs=4, metavar=("LOADER", "METHOD", "WORKERS", "MIB"))
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument("--mib", type=int, default=DEFAULT_MIB)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.child:
        which, method, n, mib = a.child
        print(json.dumps(child(which, method, int(n), int(mib))))
        return 0
    run(workers=[int(x) for x in a.workers.split(",")], methods=a.methods.split(","), repeats=a.repeats,
        mib=a.mib, out_dir=a.out)
    return 0


if __name__ == "__main__":   # (multiprocessing's spawn runs this module again as __mp_main__)
    sys.exit(main())
