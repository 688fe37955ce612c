"""The memory budget of this process's rings (docs/design.md, "Memory budget").

Training runs under memory cgroups and ``RLIMIT_AS``.  A ring holds the memory of
every slot it ever filled until a worker writes that slot again, which for a deep
ring of small batches is a whole turn of the ring later; an idle loader (validation,
while training runs) holds its slots' memory for good.  torch's DataLoader frees
each batch with the batch.  This module owns the rule that brings the rings close
to that:

* **The budget** (bytes, one for the whole process): :func:`set_memory_budget`, else
  the environment variable ``MPLOADER_MEMORY_BUDGET`` (bytes), else half of the
  smallest of the machine's memory and the memory limit of the cgroup this process
  runs in (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, the tightest on the
  path to the root).
* **Outliers come back at once.**  Each ring remembers the payload bytes of its last
  16 batches; a slot whose capacity is more than 4 times their 75th percentile and
  at least :data:`TRIM_MIN_BYTES` larger holds an outlier: as soon as it is FREE
  again (the loop dropped the batch) the parent gives its pages back, and its range
  to the region's pool for the next outlier, whichever slot that lands in
  (``Region.park``), at the next ``next()``.
* **Over the budget, FREE slots give their memory back**, the largest first, until
  the process's rings are under it, when a batch grew a slot; and a ring whose epoch
  ends while the rings hold more than half the budget gives back all of its FREE
  slots' memory.  Idle rings give first: a ring whose loader is not inside ``next()`` in any
  thread (its engine lock is free: taken without waiting, so no FREE slot of it can
  be dispatched meanwhile), then the ring that grew -- an idle validation loader
  keeps no memory while training runs.
* **Batches in flight follow the budget**: at most ``budget // slot bytes - 2`` (at
  least 1; a slot is the batch and its 25 % headroom), so that the batches in flight,
  the one the loop holds and the one it just dropped fit.

A trimmed slot keeps its range: no address space is used when it is written again,
only page faults (as a slot a worker shrank keeps its range and grows again in place,
docs/design.md, "Growth").  Pinned regions (CUDA) are never trimmed: their pages are held by
the driver's pin.

**Address space** (``RLIMIT_AS``, common under Slurm): a ring reserves 16 GiB of
address space for its slots' growth; under a finite ``RLIMIT_AS`` it reserves a
quarter of the room left (the limit less the process's current ``VmSize``), at least
64 MiB, at most 16 GiB (:func:`reserve_bytes`).  The reservation cannot grow later
(every worker maps it at start): once it is used up, batches that do not fit their
slot travel by pipe (``fallback_pipe`` in ``stats()``).  What a ring uses of it follows
the largest batch each slot held, not the number of batches that grew a slot.
"""
from __future__ import annotations

import collections
import os
import resource
import weakref
from typing import Any

#: A slot is worth trimming only when it gives back at least this much (bytes).
TRIM_MIN_BYTES = 1 << 20
#: An outlier's slot: capacity above this many times the typical batch.
OUTLIER_FACTOR = 4
#: Batches remembered per ring for the typical size.
WINDOW = 16
_UNLIMITED = 1 << 60   # cgroup v1 reports "no limit" as a number near 2**63

_rings: weakref.WeakSet[RingMemory] = weakref.WeakSet()
#: The budget in force (bytes), or None until the first loader asks (then resolved
#: once: set_memory_budget, else MPLOADER_MEMORY_BUDGET, else the default).
_budget: int | None = None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _UNLIMITED else None


def cgroup_limit_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit (bytes) on this process's cgroup path, or None.

    cgroup v2 (a ``0::/path`` line): ``memory.max`` of the group and of each ancestor;
    v1 (a ``memory`` controller line): ``memory.limit_in_bytes`` under
    ``<root>/memory``.  Limits that mean "none" ("max", ~2**63) are ignored.
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        path = path.strip("/")
        while True:
            value = _read_int(os.path.join(base, path, name))
            if value is not None:
                limits.append(value)
            if not path:
                break
            path = os.path.dirname(path)
    return min(limits) if limits else None


def machine_bytes() -> int:
    """Physical memory of the machine (bytes)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget_bytes() -> int:
    """Half of the smaller of the machine's memory and the cgroup's limit (bytes)."""
    limit = cgroup_limit_bytes()
    total = machine_bytes()
    return (min(total, limit) if limit is not None else total) // 2


def set_memory_budget(nbytes: int | None) -> None:
    """Set the bytes that all of this process's loaders' rings may hold together.

    ``None`` goes back to the default (``MPLOADER_MEMORY_BUDGET``, else half of the
    smaller of the machine's memory and the cgroup's limit).  Takes effect at each
    loader's next batch.

    Raises
    ------
    TypeError
        ``nbytes`` is not an int or None.
    ValueError
        ``nbytes`` is not positive.
    """
    global _budget
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"memory budget must be an int (bytes) or None, got {nbytes!r}")
        if nbytes <= 0:
            raise ValueError(f"memory budget must be positive (bytes), got {nbytes}")
    _budget = nbytes


def budget_bytes() -> int:
    """The budget in force (bytes): see :func:`set_memory_budget`.  The environment
    and the cgroup are read once, at the first call after start or after
    ``set_memory_budget(None)``.

    Raises ValueError naming ``MPLOADER_MEMORY_BUDGET`` when the variable is set to
    something else than a positive integer.
    """
    global _budget
    if _budget is None:
        env = os.environ.get("MPLOADER_MEMORY_BUDGET")
        if env:
            try:
                value = int(env)
            except ValueError:
                value = 0
            if value <= 0:
                raise ValueError(f"MPLOADER_MEMORY_BUDGET must be a positive number of bytes, got {env!r}")
            _budget = value
        else:
            _budget = default_budget_bytes()
    return _budget


#: Bounds of the address space a ring reserves under a finite RLIMIT_AS (bytes).
MIN_RESERVE_BYTES = 64 << 20
MAX_RESERVE_BYTES = 16 << 30


def _vm_size_bytes(status: str = "/proc/self/status") -> int:
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def reserve_bytes() -> int:
    """Address space (bytes) a new ring reserves: 0 (the ring's default, 16 GiB) when
    ``RLIMIT_AS`` is unlimited, else a quarter of the room the limit leaves above this
    process's ``VmSize``, between :data:`MIN_RESERVE_BYTES` and
    :data:`MAX_RESERVE_BYTES`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return 0
    room = soft - _vm_size_bytes()
    return max(MIN_RESERVE_BYTES, min(MAX_RESERVE_BYTES, room // 4))


def region_error(exc: OSError, reserve: int) -> OSError:
    """``exc`` (creating a ring failed), with a message that names ``RLIMIT_AS`` when
    an address-space limit is set and the error is ENOMEM; else ``exc`` itself."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if exc.errno != 12 or soft == resource.RLIM_INFINITY:  # ENOMEM
        return exc
    return OSError(exc.errno, f"{exc.strerror}: mploader could not reserve {reserve >> 20} MiB of address space "
                              f"for a ring under RLIMIT_AS={soft >> 20} MiB (this process already maps "
                              f"{_vm_size_bytes() >> 20} MiB); raise the limit (`ulimit -v`, Slurm's --mem) "
                              f"or close other loaders first")


def held_bytes_total() -> int:
    """What every live ring of this process holds, as its parent knows it (bytes)."""
    return sum(r.held for r in list(_rings))


class RingMemory:
    """The memory a ring's FREE slots hold, as its parent sees it (one per scheduler).

    ``capacity[slot]`` is the payload capacity the slot had when its last batch was
    taken (an upper bound of its pages in memory), 0 once trimmed; ``held`` their sum.
    Only the parent's thread that runs the ring touches it.
    """

    __slots__ = ("__weakref__", "capacity", "configured", "held", "lock", "outliers", "pinned", "recent", "res")

    def __init__(self, nslots: int, pinned: bool, lock: Any, res: Any, configured_bytes: int = 0) -> None:
        self.capacity = [0] * nslots
        self.configured = configured_bytes   # shared_mem: slots of this size are no outliers
        self.held = 0
        self.recent: collections.deque[int] = collections.deque(maxlen=WINDOW)
        self.outliers: set[int] = set()
        self.pinned = pinned
        self.lock = lock     # the engine's lock: held by its next(); free while the loader is idle
        self.res = res       # the engine's resources (``res.region``: None before the first run or once closed)
        _rings.add(self)

    def typical_bytes(self) -> int:
        recent = sorted(self.recent)
        return recent[(3 * len(recent)) // 4] if recent else 0

    def note(self, slot: int, capacity: int) -> bool:
        """A batch was taken from ``slot``, whose capacity changed to ``capacity`` bytes
        (its size is already in ``recent``).  Returns True when the slot is large
        enough that the budget should be checked."""
        old = self.capacity[slot]
        self.capacity[slot] = capacity
        self.held += capacity - old
        if capacity < TRIM_MIN_BYTES or self.pinned:
            return False
        if capacity > max(self.configured, OUTLIER_FACTOR * self.typical_bytes() + TRIM_MIN_BYTES):
            self.outliers.add(slot)
        return True

    def trim_outliers(self) -> None:
        """Give back the pages and the range of outlier slots that are FREE again
        (``Region.park``: the range goes to the region's pool, where the next
        outlier's grow finds it, whichever slot that lands in; the caller holds this
        ring's engine lock)."""
        region = self.res.region
        if region is None:
            return
        for slot in list(self.outliers):
            if region.park(slot):
                self.outliers.discard(slot)
                self.held -= self.capacity[slot]
                self.capacity[slot] = 0

    def _trim(self, want: int) -> int:
        """Trim FREE slots of at least TRIM_MIN_BYTES, the largest first, until
        ``want`` bytes were given back (the caller holds this ring's engine lock)."""
        region = self.res.region
        if region is None or self.pinned:
            return 0
        freed = 0
        for slot in sorted(range(len(self.capacity)), key=self.capacity.__getitem__, reverse=True):
            cap = self.capacity[slot]
            if cap < TRIM_MIN_BYTES or freed >= want:
                break
            if region.trim(slot, 0):
                self.outliers.discard(slot)
                self.capacity[slot] = 0
                self.held -= cap
                freed += cap
        return freed

    def trim_at_epoch_end(self, budget: int) -> int:
        """The ring's epoch ended: when the process's rings hold more than half the
        budget, it gives back all its FREE slots' memory, so that the loader that runs
        next (validation after training) finds room before it dispatches -- the
        parent learns a slot's size only when its batch comes back, too late to make
        room for the batches a new epoch starts with.  Returns bytes given back."""
        if held_bytes_total() <= budget // 2:
            return 0
        return self._trim(self.held)

    def stage_room(self, budget: int) -> int:
        """How many more batches of this ring's typical size the next epoch may have
        dispatched ahead ("No gap between epochs"): as many slots (25 % headroom) as
        fit, beside what the process's rings hold, in half the budget -- staged
        batches stay in their slots while another loader (validation after training)
        runs, and no idle-ring trim can reach them.  Unbounded while batches are
        smaller than TRIM_MIN_BYTES (the budget's rules ignore such slots too)."""
        slot = self.typical_bytes() * 5 // 4
        if slot < TRIM_MIN_BYTES or self.pinned:
            return 1 << 30
        return max(0, (budget // 2 - held_bytes_total()) // slot)

    def trim_to_budget(self, budget: int) -> int:
        """While the process's rings hold more than ``budget``: trim idle rings, then
        this one (the caller holds this ring's engine lock).  Returns bytes given back."""
        over = held_bytes_total() - budget
        if over <= 0:
            return 0
        freed = 0
        for ring in sorted((r for r in list(_rings) if r is not self and r.held >= TRIM_MIN_BYTES),
                           key=lambda r: r.held, reverse=True):
            if freed >= over:
                break
            if ring.lock.acquire(blocking=False):   # idle: no next() can dispatch its slots meanwhile
                try:
                    freed += ring._trim(over - freed)
                finally:
                    ring.lock.release()
        if freed < over:
            freed += self._trim(over - freed)
        return freed



def depth_cap(slot_bytes: int, budget: int) -> int:
    """Most batches to keep in flight in slots of ``slot_bytes`` under ``budget`` (at
    least 1): the slots in flight, the one the loop holds and the one it just dropped
    fit."""
    return max(1, budget // max(slot_bytes, 1) - 2)
