"""How big a worker makes the slots it writes (docs/design.md, "Slot sizing").

A slot used to be sized by a high-water mark: every slot grew to the largest batch
ever seen and never shrank, so one outlier batch inflated every slot for good.
Now each worker sizes slots from the batches it wrote recently, and gives back
the memory of a slot that is far larger than that.
"""
from __future__ import annotations

import collections

from . import _ring

#: Headroom over the typical batch (and over a batch that did not fit).
HEADROOM = 1.25
_PAGE = 4096
#: Entries kept in the per-process table of policies (one per mapped region).
_MAX_REGIONS = 256


class SlotSizing:
    """The sizing policy of one process for one region.

    Keeps the payload bytes of this process's last ``window`` batches.
    :meth:`target_bytes` is their 75th percentile times :data:`HEADROOM`, rounded
    up to a 4 KiB page (0 before the first batch): a batch size that makes up less
    than a quarter of recent batches is an outlier and does not move it.  A slot
    smaller than the target is grown to it before collation (so a typical batch is
    collated in place, with no second copy); a slot that was grown and is now
    larger than ``shrink_factor`` times the target, with at least
    ``shrink_min_bytes`` to gain, is shrunk to it (a slot never grown keeps the
    size the loader was configured with, ``shared_mem``).
    An outlier therefore costs one grow of the slot it lands in, and its memory
    goes back the next time that slot is written.  The shrunk slot keeps its
    address range, so the next outlier in it grows it again in place: outliers do
    not use up the region's reservation (docs/design.md, "Growth").

    Parameters
    ----------
    window : int
        Batches remembered (default 16).
    shrink_factor : float
        A slot is shrunk when its capacity exceeds this many times the target
        (default 4: hysteresis, so sizes that vary by less never cause churn).
    shrink_min_bytes : int
        ...and when shrinking gives back at least this many bytes (default 1 MiB:
        smaller gains are not worth the system call and the page faults).
    """

    __slots__ = ("_dirty", "_target", "recent", "shrink_factor", "shrink_min_bytes")

    def __init__(self, window: int = 16, shrink_factor: float = 4.0, shrink_min_bytes: int = 1 << 20) -> None:
        self.recent: collections.deque[int] = collections.deque(maxlen=window)
        self.shrink_factor = shrink_factor
        self.shrink_min_bytes = shrink_min_bytes
        self._target = 0
        self._dirty = False

    def note(self, used_bytes: int) -> None:
        """Record the payload bytes (arrays and descriptor) one batch used."""
        self.recent.append(used_bytes)
        self._dirty = True

    def target_bytes(self) -> int:
        """Payload bytes to give a slot before collating into it (0: no opinion yet)."""
        if self._dirty:
            recent = sorted(self.recent)  # copied in one C call: safe beside other threads
            typical = recent[(3 * len(recent)) // 4] if recent else 0
            self._target = (int(typical * HEADROOM) + _PAGE - 1) & ~(_PAGE - 1) if typical else 0
            self._dirty = False
        return self._target

    def should_shrink(self, capacity: int, target: int) -> bool:
        """Whether a slot of ``capacity`` bytes is worth shrinking to ``target`` bytes."""
        return bool(target) and capacity > self.shrink_factor * target \
            and capacity - target >= self.shrink_min_bytes


_POLICIES: dict[int, SlotSizing] = {}


def sizing_for(region: _ring.Region) -> SlotSizing:
    """This process's :class:`SlotSizing` for ``region`` (one per mapped region)."""
    key = region.address  # two mapped regions never share an address
    sizing = _POLICIES.get(key)
    if sizing is None:
        if len(_POLICIES) >= _MAX_REGIONS:
            _POLICIES.clear()
        sizing = _POLICIES[key] = SlotSizing()
    return sizing


def shrink(region: _ring.Region, slot: int, target: int) -> bool:
    """Shrink an ASSIGNED slot in place to ``target`` bytes (rounded up to a page):
    the tail's memory goes back to the kernel, no address space is used, and the
    slot keeps its range (a later grow up to it is in place).

    Returns False, leaving the slot as it was, if the system refused (shrinking
    only saves memory; the batch is written either way).
    """
    try:
        region.resize(slot, target)
    except OSError:
        return False
    return True
