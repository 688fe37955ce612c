"""Measuring one images run: the process tree's CPU and PSS, batch verification, one
timed epoch (split from :mod:`.images` to keep modules under ~600 lines)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from . import data as _data
from . import pipeline as _pipeline
from .images import _PSS_INTERVAL, CHECKSUM, ImagesConfig, consume


class _Tree:
    """CPU time and PSS of the parent plus a set of worker pids (psutil)."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a bench extra
            psutil = None
        self.psutil = psutil
        self.procs: list[Any] = []
        if psutil is not None:
            self.me = psutil.Process()

    def children(self) -> set[int]:
        if self.psutil is None:
            return set()
        return {p.pid for p in self.me.children(recursive=True)}

    def track(self, pids: set[int]) -> None:
        self.procs = [self.me] if self.psutil is not None else []
        for pid in sorted(pids):
            try:
                self.procs.append(self.psutil.Process(pid))
            except self.psutil.Error:  # exited meanwhile
                pass

    def cpu(self) -> dict[int, float] | None:
        if self.psutil is None:
            return None
        out = {}
        for p in self.procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except self.psutil.Error:  # exited meanwhile
                pass
        return out

    def system_busy(self) -> float | None:
        """CPU seconds the whole machine has been busy (all CPUs, not idle/iowait/steal)."""
        if self.psutil is None:
            return None
        t = self.psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "steal", 0.0)
        return sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def pss(self) -> int | None:
        if self.psutil is None:
            return None
        total = 0
        for p in self.procs:
            try:
                total += p.memory_full_info().pss
            except self.psutil.Error:  # exited meanwhile
                pass
        return total


class _PssSampler(threading.Thread):
    def __init__(self, tree: _Tree, interval: float = _PSS_INTERVAL) -> None:
        super().__init__(daemon=True, name="mploader-bench-pss")
        self.tree, self.interval = tree, interval
        self.peak: int | None = None
        self.cpu_s = 0.0
        self._halt = threading.Event()

    def _sample(self) -> None:
        v = self.tree.pss()
        if v is not None and (self.peak is None or v > self.peak):
            self.peak = v

    def run(self) -> None:
        start = time.thread_time()
        self._sample()
        while not self._halt.wait(self.interval):
            self._sample()
        # Reading /proc/PID/smaps_rollup costs milliseconds per process (the
        # kernel walks the page tables): not the transport's CPU, subtracted.
        self.cpu_s = time.thread_time() - start

    def stop(self) -> int | None:
        self._halt.set()
        self.join()
        return self.peak


# --------------------------------------------------------------------------
# running


class _Verifier:
    """Reference checksums per batch; collects differences."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.ref: dict[int, tuple[int, str]] = {}
        self.problems: list[str] = []

    def check(self, k: int, crc: int, who: str, problem: str | None) -> None:
        if problem is not None:
            self.problems.append(f"format {self.fmt}: {who}, batch {k}: {problem}")
            return
        if k not in self.ref:
            self.ref[k] = (crc, who)
        elif self.ref[k][0] != crc:
            want, ref_who = self.ref[k]
            self.problems.append(f"format {self.fmt}: {who}, batch {k}: {CHECKSUM} {crc:08x} "
                                 f"differs from {want:08x} of {ref_who}")


def _run_epoch(t: Any, batches: list[list[int]], first: int, verifier: _Verifier, who: str,
               batch_size: int, tick: Callable[[], None] | None) -> tuple[float, float]:
    """Iterate one epoch, consuming every batch; returns (wall s, wait s)."""
    wait = 0.0
    k = first
    clock = time.perf_counter
    t0 = clock()
    it = iter(t.epoch(batches))
    while True:
        a = clock()
        try:
            batch = next(it)
        except StopIteration:
            break
        wait += clock() - a
        crc, _, problem = consume(batch, batch_size)
        del batch
        verifier.check(k, crc, who, problem)
        k += 1
        if tick is not None:
            tick()
    wall = clock() - t0
    if k - first != len(batches):
        verifier.problems.append(f"format {verifier.fmt}: {who} yielded {k - first} batches, "
                                 f"expected {len(batches)}")
    return wall, wait


def _open_dataset(fmt: str, folder: _data.ImageFolder, cfg: ImagesConfig, epochs: int,
                  log: Callable[[str], None]) -> Any:
    if fmt == "jpeg":
        return _pipeline.JpegDataset(folder.paths, folder.labels, seed=cfg.seed, epochs=epochs)
    images_path, labels_path = _data.ensure_raw(folder, cfg.cache_dir, progress=cfg.progress,
                                                log=log)
    return _pipeline.RawDataset(images_path, labels_path, seed=cfg.seed, epochs=epochs)
