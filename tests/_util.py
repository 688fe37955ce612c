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


class DictSerializer:
    """Chainer's DictionarySerializer protocol: store the value, return it."""

    def __init__(self):
        self.target = {}

    def __call__(self, key, value):
        self.target[key] = np.array(value) if isinstance(value, np.ndarray) else value
        return value


class DictDeserializer:
    """Chainer's NpzDeserializer protocol: KeyError for a missing key; arrays are copied
    into ``value`` in place; a scalar comes back converted to the type of ``value``."""

    def __init__(self, target):
        self.target = target

    def __call__(self, key, value):
        if key not in self.target:
            raise KeyError(key)
        stored = self.target[key]
        if value is None:
            return stored
        if isinstance(value, np.ndarray):
            np.copyto(value, stored)
            return value
        return type(value)(np.asarray(stored))


class ProgramLoop:
    """The steps of a random program (``tests/test_*_programs.py``) on one loader
    (``self.loader``; ``self.sampler``: the sampler a ``set_epoch`` step moves, or
    None), each returning what the user saw: ``take`` (batches as lists, "end of
    pass" where a pass ended), ``peek`` (a second iterator's first batch, dropped),
    ``set_epoch``."""

    loader = None
    sampler = None
    it = None

    def take(self, k: int) -> list:
        out = []
        for _ in range(k):
            if self.it is None:
                self.it = iter(self.loader)
                self.started()
            try:
                out.append(next(self.it).tolist())
            except StopIteration:
                out.append("end of pass")
                self.it = None
                self.ended()
        return out

    def started(self) -> None:
        """(A pass began: for subclasses that follow it.)"""

    def ended(self) -> None:
        """(A pass ended.)"""

    def peek(self) -> list:
        """A second pass while this one goes on (a validation peek): its first batch, as
        :meth:`take` returns batches."""
        other = iter(self.loader)
        self.started()
        try:
            return [next(other).tolist()]
        except StopIteration:
            return ["end of pass"]
        finally:
            del other

    def set_epoch(self, epoch: int) -> str:
        if self.sampler is None:
            return "no sampler"
        self.sampler.set_epoch(epoch)
        return f"epoch {epoch}"

    def step(self, step: tuple):
        return getattr(self, step[0])(*step[1:])
