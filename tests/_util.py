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


#: NumPy dtypes MXNet's NDArray could hold (``_DTYPE_NP_TO_MX`` in apache/mxnet
#: python/mxnet/ndarray/ndarray.py, 1.x); ``nd.array`` raises for any other.
MX_DTYPES = {np.float32, np.float64, np.float16, np.uint8, np.int32, np.int8, np.int64}


def mxnet_default_batchify_fn(data):
    """MXNet's rule, re-stated with NumPy from apache/mxnet
    python/mxnet/gluon/data/dataloader.py, ``default_batchify_fn`` (and
    ``default_mp_batchify_fn``, which differs only in the memory it allocates):
    NDArray samples are stacked (there are none here); if ``data[0]`` is a tuple the
    samples are zipped and each field batched, giving a list; anything else is
    ``nd.array(np.asarray(data), dtype=...)``, which raises for dtypes NDArray lacks."""
    if isinstance(data[0], tuple):
        data = zip(*data)
        return [mxnet_default_batchify_fn(i) for i in data]
    data = np.asarray(data)
    if data.dtype.type not in MX_DTYPES:
        raise KeyError(f"nd.array cannot hold {data.dtype}")
    return np.array(data, dtype=data.dtype)
