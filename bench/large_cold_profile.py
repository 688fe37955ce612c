"""Where large batches on data not in the CPU cache spend their time (issue 24).

Usage: ``PYTHONPATH=.:bench python bench/large_cold_profile.py [--part copies|loader|all]
[--batches N] [--faces LIST] [--consumers LIST]``

The transport suite's ``large`` batches (256 x (224, 224, 3) uint8 and 256 int64
labels, 38.5 MB) drawn from its cold pool (at least 4 x the last-level cache,
:mod:`mploader_bench.cachesize`).

``copies`` (in-process, no loader): per-batch time of each step a loader's worker or
parent takes for such a batch, into 5 rotating pre-faulted slot-sized buffers (the
ring's 5 slots for large batches), by one process and by two at once (the bus shared
as by two workers):

* ``copy_rows``: ``mploader._columns.copy_rows`` (streaming stores): the Gluon face's and
  the torch face's copy of numpy samples into the slot;
* ``np.take``: one gather with ordinary stores (numpy's memcpy per row);
* ``torch.stack``: ``torch.stack(tensors, out=slot tensor)``: the torch face's copy of
  tensor leaves (samples that are tensors);
* ``copy_rows(t.numpy())``: the same tensors copied by ``copy_rows`` over zero-copy
  numpy views (a candidate change to the torch face, not the library's code);
* ``to_tensors``: the torch face's parent turning a delivered batch into tensors;
* ``touch pages`` / ``read all``: a consumer reading one byte per 4 KiB page / every
  byte (xxh3-64, as the images suite's checksum) of a batch just written.

``loader`` (end to end, 2 workers): for each face and consumer, batches/s and per
batch the parent's and the workers' CPU, minor page faults and context switches
(psutil and /proc), over ``--batches`` batches after a warm-up epoch.  Consumers:
``check`` (the suite's fingerprint: 8 bytes per row), ``touch`` (one byte per page),
``read`` (every byte).  Faces: ``mploader`` (Gluon), ``mploader.torch`` (numpy
samples, tensors out), ``mploader.torch-tensors`` (tensor samples, tensors out), and
``torch`` for reference.

Run it under ``perf record -e cpu-clock -g`` to see the native functions (docs/bench-log.md,
issue 24's entry).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from mploader_bench import peers
from mploader_bench.synthetic import make_dataset

SLOTS = 5


def _stat_faults(pid: int) -> int:
    """Minor page faults of process `pid` so far (/proc/<pid>/stat field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _median_us(f: Any, n: int) -> float:
    times = []
    for k in range(n):
        t0 = time.perf_counter()
        f(k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e6


def _touch(a: np.ndarray) -> int:
    """Read one byte of every 4 KiB page of `a` (C-contiguous)."""
    return int(a.reshape(-1)[::4096].sum())


def _read_all(a: np.ndarray) -> int:
    """Read every byte of `a` (xxh3-64 when xxhash is installed, about 20 GB/s in cache)."""
    try:
        import xxhash
    except ImportError:
        return int(a.reshape(-1).view(np.uint64).sum())
    return int(xxhash.xxh3_64_intdigest(a))


def _steps(ds: Any, n: int, seed: int) -> dict[str, float]:
    import torch

    from mploader import _columns
    from mploader._torch_collate import to_tensors

    torch.set_num_threads(1)  # as in a loader's worker (and no OpenMP pool to break by forking)
    rng = np.random.default_rng(seed)
    bs = 256
    shape = ds.pool.shape[1:]
    slots = [np.ones((bs, *shape), np.uint8) for _ in range(SLOTS)]  # faulted in
    tslots = [torch.from_numpy(s) for s in slots]
    rows = ds.pool.reshape(len(ds.pool), -1)
    views = list(ds.pool)
    tensors = [torch.from_numpy(v) for v in views]
    idx = rng.integers(0, len(ds.pool), size=(n + 2, bs))
    out: dict[str, float] = {}
    out["copy_rows"] = _median_us(lambda k: _columns.copy_rows([views[i] for i in idx[k]], slots[k % SLOTS]), n)
    out["np.take"] = _median_us(lambda k: np.take(rows, idx[k], axis=0, mode="clip",
                                                  out=slots[k % SLOTS].reshape(bs, -1)), n)
    out["torch.stack"] = _median_us(lambda k: torch.stack([tensors[i] for i in idx[k]], 0,
                                                          out=tslots[k % SLOTS]), n)
    out["copy_rows(t.numpy())"] = _median_us(
        lambda k: _columns.copy_rows([tensors[i].numpy() for i in idx[k]], slots[k % SLOTS]), n)
    labels = np.arange(bs, dtype=np.int64)
    out["to_tensors"] = _median_us(lambda k: to_tensors((slots[k % SLOTS], labels)), n)

    def fresh_then(read: Any) -> Any:
        def step(k: int) -> None:
            s = slots[k % SLOTS]
            _columns.copy_rows([views[i] for i in idx[k]], s)  # written with streaming stores: not cached
            t0 = time.perf_counter()
            read(s)
            step.took.append(time.perf_counter() - t0)  # type: ignore[attr-defined]
        step.took = []  # type: ignore[attr-defined]
        return step

    for name, read in (("touch pages", _touch), ("read all", _read_all)):
        step = fresh_then(read)
        for k in range(n):
            step(k)
        out[name] = statistics.median(step.took[2:]) * 1e6  # type: ignore[attr-defined]
    return out


def _child(q: Any, bar: Any, n: int, seed: int) -> None:
    ds = make_dataset("large", "cold")
    bar.wait()
    q.put(_steps(ds, n, seed))


def part_copies(n: int) -> None:
    print(f"copies: large batch (38.5 MB) from the cold pool into {SLOTS} rotating buffers, "
          f"median us per batch over {n} batches")
    ds = make_dataset("large", "cold")
    alone = _steps(ds, n, 0)
    for k, v in alone.items():
        print(f"  1 process: {k:24s} {v:10,.0f}", flush=True)
    ctx = mp.get_context("fork")
    q, bar = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_child, args=(q, bar, n, s)) for s in (1, 2)]
    for p in procs:
        p.start()
    both = [q.get() for _ in procs]
    for p in procs:
        p.join()
    print(f"{'step':24s} {'1 process':>12s} {'2 at once (each)':>20s}")
    for k, v in alone.items():
        print(f"{k:24s} {v:12,.0f} {' / '.join(f'{b[k]:,.0f}' for b in both):>20s}")


def _consume(kind: str, check: Any) -> Any:
    def fingerprint(batch: Any) -> None:
        check.fingerprint(batch)

    return {"check": fingerprint, "touch": lambda b: _touch(b[0]), "read": lambda b: _read_all(b[0])}[kind]


def part_loader(n: int, faces: list[str], consumers: list[str]) -> None:
    import psutil

    ds = make_dataset("large", "cold")
    rng = np.random.default_rng(0)
    batches = rng.integers(0, len(ds), size=(n + 8, 256)).tolist()
    me = psutil.Process()
    print(f"loader: large, cold pool of {len(ds.pool)} samples, 2 workers, {n} batches; per batch:")
    print(f"{'face':24s} {'consumer':8s} {'b/s':>6s} {'parent us':>10s} {'workers us':>11s} "
          f"{'parent flt':>10s} {'worker flt':>10s} {'parent cs':>9s} {'worker cs':>9s}")
    for face in faces:
        with peers.open_transport(face, ds, workers=2, seed=0) as t:
            for kind in consumers:
                consume = _consume(kind, ds.check)
                for _ in t.epoch(batches[:8]):
                    pass
                kids = me.children(recursive=True)

                def snap(kids: list = kids) -> tuple:
                    cpu = sum(sum(k.cpu_times()[:2]) for k in kids)
                    flt = sum(_stat_faults(k.pid) for k in kids)
                    cs = sum(sum(k.num_ctx_switches()) for k in kids)
                    return (time.perf_counter(), sum(me.cpu_times()[:2]), cpu, _stat_faults(me.pid), flt,
                            sum(me.num_ctx_switches()), cs)
                s0 = snap()
                for batch in t.epoch(batches[8:]):
                    consume(batch)
                    del batch
                s1 = snap()
                d = [b - a for a, b in zip(s0, s1)]
                print(f"{face:24s} {kind:8s} {n / d[0]:6.0f} {d[1] / n * 1e6:10,.0f} {d[2] / n * 1e6:11,.0f} "
                      f"{d[3] / n:10.1f} {d[4] / n:10.1f} {d[5] / n:9.2f} {d[6] / n:9.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=("copies", "loader", "all"))
    ap.add_argument("--batches", type=int, default=60, help="batches per measurement")
    ap.add_argument("--faces", default="mploader,mploader.torch,mploader.torch-tensors,torch")
    ap.add_argument("--consumers", default="check,touch,read")
    a = ap.parse_args()
    if a.part in ("copies", "all"):
        part_copies(a.batches)
    if a.part in ("loader", "all"):
        part_loader(a.batches, a.faces.split(","), a.consumers.split(","))


if __name__ == "__main__":
    main()
