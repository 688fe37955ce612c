"""How large the transport suite's data must be to stay out of the CPU cache.

A benchmark's data are not in the CPU cache unless its name says so
(docs/bench.md, "The cache rule"): the transport suite's samples come from a
pool of distinct samples whose total is at least :data:`POOL_FACTOR` times the
last-level cache (LLC), read from the OS by :func:`last_level_cache`.  The
pool's size follows :func:`plan_pool`, capped so that it cannot exhaust memory.

Examples
--------
>>> plan = plan_pool(sample_bytes=150_528, header_bytes=112, llc_bytes=32 << 20)
>>> plan.samples, plan.total_bytes >= 4 * (32 << 20), plan.capped
(891, True, False)
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_LLC_BYTES", "POOL_FACTOR", "POOL_CAP_BYTES", "SYSFS_CPU0_CACHE",
           "CacheInfo", "PoolPlan", "available_memory_bytes", "default_cap_bytes",
           "last_level_cache", "parse_cache_size", "plan_pool"]

#: Assumed LLC where the OS tells nothing (a 32 MiB L3, as on this project's 2-core VM).
DEFAULT_LLC_BYTES = 32 << 20
#: The pool holds at least this many times the LLC, so that a sample drawn at random is
#: in the cache with a probability of at most about 1 / POOL_FACTOR.
POOL_FACTOR = 4
#: Largest pool whatever the machine: 1 GiB (also at most 1/4 of the available memory).
POOL_CAP_BYTES = 1 << 30
SYSFS_CPU0_CACHE = "/sys/devices/system/cpu/cpu0/cache"

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class CacheInfo:
    """The last-level cache as found.

    Attributes
    ----------
    bytes : int
        Its size in bytes (of the instance that CPU 0 uses).
    level : int or None
        Its level (3 for an L3); None when unknown (the default).
    source : str
        Where the size came from: ``"sysfs <dir>"``, ``"sysconf <name>"`` or
        ``"default"``.
    """

    bytes: int
    level: int | None
    source: str


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache size such as ``"32768K"``, ``"1M"`` or ``"512"``.

    Raises
    ------
    ValueError
        If `text` is not a number with an optional K, M or G suffix.
    """
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"cache size {text!r}: expected a number of bytes with an optional "
                         f"K, M or G suffix, e.g. '32768K'")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _from_sysfs(root: Path) -> CacheInfo | None:
    best: tuple[int, int] | None = None  # (level, bytes)
    try:
        entries = sorted(root.glob("index*"))
    except OSError:
        return None
    for entry in entries:
        try:
            kind = (entry / "type").read_text().strip().lower()
            if kind == "instruction":
                continue
            level = int((entry / "level").read_text().strip())
            size = parse_cache_size((entry / "size").read_text())
        except (OSError, ValueError):
            continue  # unreadable or odd entry: the others may still tell
        if size > 0 and (best is None or (level, size) > best):
            best = (level, size)
    if best is None:
        return None
    return CacheInfo(bytes=best[1], level=best[0], source=f"sysfs {root}")


def last_level_cache(sysfs: str | os.PathLike = SYSFS_CPU0_CACHE) -> CacheInfo:
    """The size of the last-level cache of CPU 0, from the OS.

    Reads ``<sysfs>/index*/{level,type,size}`` (Linux) and takes the data or unified
    cache of the highest level; else ``os.sysconf`` (``SC_LEVEL4_CACHE_SIZE``,
    ``SC_LEVEL3_CACHE_SIZE``, ``SC_LEVEL2_CACHE_SIZE``: the first above 0); else
    :data:`DEFAULT_LLC_BYTES`.

    Parameters
    ----------
    sysfs : path, optional
        The cache directory of one CPU (a fake one in tests).

    Returns
    -------
    CacheInfo
    """
    found = _from_sysfs(Path(sysfs))
    if found is not None:
        return found
    for level, name in ((4, "SC_LEVEL4_CACHE_SIZE"), (3, "SC_LEVEL3_CACHE_SIZE"),
                        (2, "SC_LEVEL2_CACHE_SIZE")):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError, AttributeError):  # name unknown to this libc / OS
            continue
        if size > 0:
            return CacheInfo(bytes=int(size), level=level, source=f"sysconf {name}")
    return CacheInfo(bytes=DEFAULT_LLC_BYTES, level=None, source="default")


def available_memory_bytes() -> int | None:
    """Memory available to new allocations (psutil, else /proc/meminfo), or None."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_cap_bytes() -> int:
    """The pool cap: :data:`POOL_CAP_BYTES`, and at most 1/4 of the available memory."""
    avail = available_memory_bytes()
    return POOL_CAP_BYTES if avail is None else max(1, min(POOL_CAP_BYTES, avail // 4))


@dataclass(frozen=True)
class PoolPlan:
    """How many distinct samples the pool holds, and why.

    Attributes
    ----------
    samples : int
        Distinct samples in the pool (>= 1).
    sample_bytes, header_bytes : int
        Payload of one sample, and its Python object (the array header) in bytes.
    llc_bytes : int
        The last-level cache the rule was applied to.
    target_bytes : int
        ``factor * llc_bytes``: the total the pool should reach.
    total_bytes : int
        ``samples * (sample_bytes + header_bytes)``: what the pool holds.
    worst_bytes : int
        Memory the pool can take in all processes: the payload once (forked
        processes share it, reading only) and the headers once per process, which
        dirties their pages by reference counting (``1 + processes`` copies).
    cap_bytes : int
        The most `worst_bytes` may be.
    capped : bool
        The cap cut the pool below `target_bytes`: the data are then partly cached.
    """

    samples: int
    sample_bytes: int
    header_bytes: int
    llc_bytes: int
    target_bytes: int
    total_bytes: int
    worst_bytes: int
    cap_bytes: int
    capped: bool

    @property
    def cache_multiple(self) -> float:
        """``total_bytes / llc_bytes``: how many LLCs the pool fills."""
        return self.total_bytes / self.llc_bytes


def plan_pool(sample_bytes: int, header_bytes: int, llc_bytes: int, *, processes: int = 0,
              factor: int = POOL_FACTOR, cap_bytes: int | None = None) -> PoolPlan:
    """The pool sizing rule: distinct samples totalling at least `factor` x the LLC.

    ``samples = ceil(factor * llc_bytes / (sample_bytes + header_bytes))``, unless
    the memory this takes in every process, ``samples * (sample_bytes + header_bytes
    * (1 + processes))``, exceeds `cap_bytes`: then as many samples as fit under the
    cap (at least 1), and the plan says ``capped``.

    Parameters
    ----------
    sample_bytes : int
        Payload bytes of one sample (> 0).
    header_bytes : int
        Bytes of its Python object(s) (>= 0), which each process touching the sample
        copies on write.
    llc_bytes : int
        Last-level cache size (> 0), e.g. ``last_level_cache().bytes``.
    processes : int, optional
        Processes besides this one that hold the pool (forked workers).
    factor : int, optional
        Multiple of the LLC to reach (>= 1).
    cap_bytes : int, optional
        Memory limit for the pool in all processes; default :func:`default_cap_bytes`.

    Returns
    -------
    PoolPlan

    Raises
    ------
    ValueError
        If an argument is out of range (the message names it and its value).
    """
    for name, value, least in (("sample_bytes", sample_bytes, 1), ("header_bytes", header_bytes, 0),
                               ("llc_bytes", llc_bytes, 1), ("processes", processes, 0),
                               ("factor", factor, 1)):
        if int(value) != value or value < least:
            raise ValueError(f"plan_pool: {name}={value!r}: expected an integer >= {least}")
    cap = default_cap_bytes() if cap_bytes is None else int(cap_bytes)
    if cap < 1:
        raise ValueError(f"plan_pool: cap_bytes={cap_bytes!r}: expected an integer >= 1")
    per = sample_bytes + header_bytes
    per_worst = sample_bytes + header_bytes * (1 + processes)
    target = factor * llc_bytes
    samples = math.ceil(target / per)
    capped = samples * per_worst > cap
    if capped:
        samples = max(1, cap // per_worst)
    return PoolPlan(samples=samples, sample_bytes=sample_bytes, header_bytes=header_bytes,
                    llc_bytes=llc_bytes, target_bytes=target, total_bytes=samples * per,
                    worst_bytes=samples * per_worst, cap_bytes=cap, capped=capped)
