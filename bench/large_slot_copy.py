"""The copy of a large batch into a slot, against copy-limit's copy (issue 24).

Usage: ``PYTHONPATH=.:bench python bench/large_slot_copy.py [--part dest|loader|all]
[--batches N] [--rounds R] [--faces LIST]``

The transport suite's ``large`` batches (256 x (224, 224, 3) uint8, 38.5 MB) from its
cold pool (at least 4 x the last-level cache).

``dest`` (one process, no loader): the CPU time (``time.thread_time``) per batch of
``mploader._columns.copy_rows`` (streaming stores) and of ``np.take`` (ordinary
stores) into 5 rotating pre-faulted batch-sized buffers of three kinds:

* ``numpy``: ``np.ones`` arrays -- numpy advises huge pages for them
  (``MADV_HUGEPAGE``), so where transparent huge pages are ``madvise`` or ``always``
  they have 2 MiB pages: copy-limit's destination;
* ``anon``: ``mmap`` anonymous private memory, 4 KiB pages unless THP is ``always``;
* ``memfd``: a ``MAP_SHARED`` memfd, as a ring's slots: 4 KiB pages unless shmem huge
  pages are on (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``).

``loader`` (end to end, 2 workers, steady state after 3 warm-up epochs of 60 batches):
for each face, with the transport suite's consumer (every batch fingerprinted by
``mploader_bench.checks``): batches/s, the parent's CPU per batch (and its thread CPU
inside ``next()`` and in the check), each worker's CPU per batch (psutil: 10 ms
ticks, so use a few hundred batches) and the minor page faults per batch of the
parent and of each worker (/proc/<pid>/stat): a slot whose pages were given back
between uses would fault them in again, about 9,400 per batch.  ``--perf FILE``
records ``perf record -e cpu-clock -g`` of the parent and the workers meanwhile.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import time
from typing import Any

import numpy as np

from mploader_bench import peers
from mploader_bench.synthetic import make_dataset

SLOTS = 5


def _faults(pid: int) -> int:
    """Minor page faults of process `pid` so far (/proc/<pid>/stat field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _buffers(kind: str, shape: tuple, keep: list) -> list[np.ndarray]:
    """SLOTS pre-faulted uint8 arrays of `shape` of the given kind (see the docstring)."""
    nbytes = int(np.prod(shape))
    if kind == "numpy":
        return [np.ones(shape, np.uint8) for _ in range(SLOTS)]
    if kind == "anon":
        maps = [mmap.mmap(-1, nbytes) for _ in range(SLOTS)]
    elif kind == "memfd":
        fd = os.memfd_create("large_slot_copy")
        os.ftruncate(fd, SLOTS * nbytes)
        whole = mmap.mmap(fd, SLOTS * nbytes, mmap.MAP_SHARED)
        os.close(fd)
        maps = [whole]
    else:
        raise ValueError(f"kind={kind!r}: expected 'numpy', 'anon' or 'memfd'")
    keep.extend(maps)
    arrays = [np.frombuffer(m, np.uint8) for m in maps]
    out = [a.reshape(shape) for a in arrays] if kind == "anon" else \
        [arrays[0][k * nbytes:(k + 1) * nbytes].reshape(shape) for k in range(SLOTS)]
    for a in out:
        a[...] = 1  # faulted in
    return out


def part_dest(batches: int, rounds: int) -> None:
    from mploader import _columns

    ds = make_dataset("large", "cold")
    pool, views = ds.pool, list(ds.pool)
    idx = np.random.default_rng(1).integers(0, len(views), size=(max(batches, 64), 256))
    keep: list[Any] = []
    kinds = {k: _buffers(k, (256, *pool.shape[1:]), keep) for k in ("numpy", "anon", "memfd")}

    def run(bufs: list[np.ndarray], method: str) -> float:
        times = []
        for k in range(batches):
            rows = idx[k % len(idx)]
            t0 = time.thread_time()
            if method == "stream":
                _columns.copy_rows([views[i] for i in rows], bufs[k % SLOTS])
            else:
                np.take(pool, rows, axis=0, out=bufs[k % SLOTS], mode="clip")
            times.append(time.thread_time() - t0)
        return statistics.median(times[3:]) * 1e6

    print(f"dest: one process, {len(views)} cold samples, a 38.5 MB batch into {SLOTS} rotating buffers; "
          f"CPU us per batch (median of {batches}), copy_rows (streaming) / np.take")
    for r in range(rounds):
        cells = [f"{k} {run(b, 'stream'):,.0f} / {run(b, 'take'):,.0f}" for k, b in kinds.items()]
        print(f"  round {r + 1}: " + " | ".join(cells) + f"  (load {os.getloadavg()[0]:.1f})", flush=True)


def part_loader(batches: int, faces: list[str], perf: str | None) -> None:
    import psutil

    ds = make_dataset("large", "cold")
    rng = np.random.default_rng(0)
    warm = rng.integers(0, len(ds), size=(60, 256)).tolist()
    timed = rng.integers(0, len(ds), size=(batches, 256)).tolist()
    check = ds.check
    want_warm, want = check.expected(warm), check.expected(timed)
    me = psutil.Process()
    print(f"loader: large, cold pool of {len(ds.pool)} samples, 2 workers, {batches} batches, the suite's check")
    for face in faces:
        with peers.open_transport(face, ds, workers=2, seed=0) as t:
            for _ in range(3):
                for k, b in enumerate(t.epoch(warm)):
                    check.check(face, k, b, want_warm[k])
                    del b
            pids = [me.pid] + [c.pid for c in me.children(recursive=True)]
            rec = None
            if perf:
                rec = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-g", "-o", f"{perf}.{face}",
                                        "-p", ",".join(map(str, pids))],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            procs = [psutil.Process(p) for p in pids]
            cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
            flt0 = [_faults(p) for p in pids]
            t_next = t_check = 0.0
            w0 = time.perf_counter()
            it = iter(t.epoch(timed))
            k = 0
            while True:
                a = time.thread_time()
                b = next(it, None)
                m = time.thread_time()
                t_next += m - a
                if b is None:
                    break
                check.check(face, k, b, want[k])
                del b
                k += 1
                t_check += time.thread_time() - m
            wall = time.perf_counter() - w0
            cpu = [(sum(p.cpu_times()[:2]) - c) / batches * 1e6 for p, c in zip(procs, cpu0)]
            flt = [(_faults(p) - f) / batches for p, f in zip(pids, flt0)]
            if rec is not None:
                rec.send_signal(2)
                rec.wait()
            print(f"  {face:16s} {batches / wall:6.0f} b/s; per batch: parent {cpu[0]:5.0f} us (next() "
                  f"{t_next / batches * 1e6:.0f}, check {t_check / batches * 1e6:.0f}), workers "
                  f"{' + '.join(f'{c:,.0f}' for c in cpu[1:])} us; minor faults parent {flt[0]:.2f}, workers "
                  f"{' + '.join(f'{f:.2f}' for f in flt[1:])}  (load {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=("dest", "loader", "all"))
    ap.add_argument("--batches", type=int, default=300, help="batches per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the dest part")
    ap.add_argument("--faces", default="mploader,mploader.torch")
    ap.add_argument("--perf", default=None, help="perf.data prefix (loader part)")
    a = ap.parse_args()
    if a.part in ("dest", "all"):
        part_dest(min(a.batches, 150), a.rounds)
    if a.part in ("loader", "all"):
        part_loader(a.batches, a.faces.split(","), a.perf)


if __name__ == "__main__":
    main()
