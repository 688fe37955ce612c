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


def assert_same(a, b):
    """Batch ``a`` (from a loader) equals ``b`` (in-process reference): types, dtypes, shapes, values."""
    if isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(b, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(b, dict):
        assert type(a) is dict and a.keys() == b.keys()
        for k in b:
            assert_same(a[k], b[k])
    else:
        assert a == b
