"""Helpers shared by the test modules (imported as ``from _util import ...``)."""
import numpy as np


def lease_of(arr):
    """The object at the root of an ndarray's ``base`` chain (a SlotLease for a slot view)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def arrays_in(obj):
    """Every ndarray inside a nested tuple/list/dict structure, depth first."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from arrays_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from arrays_in(x)
