"""The machine a benchmark ran on: CPU model, memory, commit, how busy the CPU is
(split from :mod:`.transport` to keep modules under ~600 lines)."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def cpu_busy_percent(interval: float = 1.0) -> float | None:
    """Share of all CPUs busy over the next `interval` seconds, in percent.

    Parameters
    ----------
    interval : float, optional
        Sampling window, seconds.

    Returns
    -------
    float or None
        Busy percentage (0-100), or None where it cannot be measured.
    """
    try:
        import psutil

        return float(psutil.cpu_percent(interval=interval))
    except ImportError:
        pass

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
        return sum(v), v[3] + v[4]
    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except (OSError, ValueError):
        return None
    return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))


def machine_info(with_torch: bool = True) -> dict[str, Any]:
    """Describe the machine and software versions.

    Parameters
    ----------
    with_torch : bool, optional
        Import torch to report its version (about a second the first time).

    Returns
    -------
    dict
        CPU model, logical/usable/physical cores, memory (bytes), OS, Python,
        numpy, torch and mploader versions, git commit.
    """
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "physical_cores": None,
        "memory_bytes": _mem_total_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "torch": None,
        "mploader": None,
        "git_commit": _git_commit(),
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
    except ImportError:
        pass
    if with_torch:
        try:
            import torch

            info["torch"] = torch.__version__
            info["torch_threads"] = torch.get_num_threads()
        except Exception:  # noqa: BLE001 - no torch, or a broken one: the field stays out
            pass
    try:
        import mploader

        info["mploader"] = getattr(mploader, "__version__", "unknown")
    except ImportError:
        pass
    return info


# --------------------------------------------------------------------------
# measuring
