"""mploader.DataLoader against MXNet Gluon 1.8 DataLoader semantics.

last_batch counts, samplers and batch samplers, batchify functions (checked against
the same function run in-process), thread_pool, timeout, pin_memory (a documented
no-op without CUDA; the cudaHostRegister bookkeeping checked with a fake CUDA
runtime), try_nopython, iterator lifetime and leaks.  num_workers 0, 1 and 2.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import os
import select
import warnings

import numpy as np
import pytest
from _util import arrays_in, assert_same, lease_of, mxnet_default_batchify_fn

import mploader
from mploader import _pinning, _ring
from mploader import batchify as bf
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(60)

WORKERS = [0, 1, 2]
N, B = 10_000, 31


@pytest.fixture(params=WORKERS, ids=lambda n: f"workers{n}")
def workers(request):
    return request.param


def flat(batches):
    """All sample values of an epoch, in order (each batch is dropped before the next
    arrives, so no slot is held for long)."""
    out = []
    for b in batches:
        out.extend(np.asarray(b).tolist())
    return out


def owned(obj):
    """A deep copy of a batch that holds no slot."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(owned(x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(owned(x) for x in obj)
    if isinstance(obj, dict):
        return {k: owned(v) for k, v in obj.items()}
    return obj


def collect(loader, check=None):
    """The epoch's batches as owned copies; ``check(batch)`` sees each original."""
    out = []
    for b in loader:
        if check is not None:
            check(b)
        out.append(owned(b))
        del b
    return out


# ---------------------------------------------------------------- last_batch


def test_last_batch_keep_discard_counts(workers):
    data = np.arange(N)
    with mploader.DataLoader(data, B, last_batch="keep", num_workers=workers) as loader:
        assert len(loader) == 323
        batches = collect(loader)
        assert len(batches) == 323 and len(batches[-1]) == N % B == 18
        assert flat(batches) == list(range(N))
    with mploader.DataLoader(data, B, last_batch="discard", num_workers=workers) as loader:
        assert len(loader) == 322
        batches = collect(loader)
        assert len(batches) == 322 and {len(b) for b in batches} == {B}
        assert flat(batches) == list(range(322 * B))
    with mploader.DataLoader(data, B, num_workers=workers) as loader:  # default: keep
        assert len(loader) == 323


def test_last_batch_rollover_carries_the_remainder(workers):
    with mploader.DataLoader(np.arange(N), B, last_batch="rollover", num_workers=workers) as loader:
        assert len(loader) == 322
        first = collect(loader)
        assert len(first) == 322 and flat(first) == list(range(322 * B))
        assert len(loader) == (18 + N) // B == 323  # the 18 carried indices count
        second = collect(loader)
        assert len(second) == 323 and {len(b) for b in second} == {B}
        # the carried remainder leads the next epoch, completed by its first indices
        assert np.asarray(second[0]).tolist() == list(range(322 * B, N)) + list(range(13))
        assert flat(second) == list(range(322 * B, N)) + list(range(323 * B - 18))
        assert len(loader) == (5 + N) // B


# ---------------------------------------------------------------- samplers


def reference(batch_sampler, dataset, fn=None):
    fn = fn or mploader.default_batchify
    return [fn([dataset[i] for i in idx]) for idx in batch_sampler]


@pytest.mark.parametrize("make_sampler", [
    lambda: mploader.SequentialSampler(40, start=3),
    lambda: mploader.RandomSampler(43, seed=9),
    lambda: mploader.FilterSampler(lambda x: x % 3 == 0, np.arange(43)),
    lambda: mploader.IntervalSampler(43, interval=5),
    lambda: mploader.IntervalSampler(43, interval=5, rollover=False),
], ids=["sequential", "random", "filter", "interval", "interval-norollover"])
def test_samplers_drive_the_loader_every_epoch(workers, make_sampler):
    data = np.arange(50) * 10
    with mploader.DataLoader(data, 4, sampler=make_sampler(), last_batch="keep", num_workers=workers) as loader:
        ref_sampler = mploader.BatchSampler(make_sampler(), 4, "keep")
        for _ in range(2):  # re-iterable: every epoch yields the sampler's next pass
            got = collect(loader)
            want = reference(ref_sampler, data)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_same(g, w)


def test_shuffle_is_a_new_permutation_each_epoch(workers):
    with mploader.DataLoader(np.arange(100), 10, shuffle=True, num_workers=workers, seed=3) as loader:
        first, second = flat(loader), flat(loader)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second
    with mploader.DataLoader(np.arange(100), 10, shuffle=True, num_workers=0, seed=3) as loader:
        assert flat(loader) == first  # the same seed gives the same epochs for any num_workers


def test_batch_sampler(workers):
    data = np.arange(30) ** 2
    make = lambda: mploader.BatchSampler(mploader.SequentialSampler(30), 7, "rollover")  # noqa: E731
    with mploader.DataLoader(data, batch_sampler=make(), num_workers=workers) as loader:
        ref = make()
        for _ in range(3):
            assert len(loader) == len(ref)
            got, want = collect(loader), reference(ref, data)
            assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("kwargs, message", [
    (dict(), r"batch_size must be specified unless batch_sampler is specified"),
    (dict(batch_size=2, shuffle=True, sampler=mploader.SequentialSampler(4)),
     r"shuffle must not be specified if sampler is specified"),
    (dict(batch_size=2, batch_sampler=[[0, 1]]),
     r"batch_size, shuffle, sampler and last_batch must not be specified if batch_sampler is specified"),
    (dict(batch_size=2, last_batch="drop"), r"last_batch must be one of 'keep', 'discard', 'rollover', got 'drop'"),
    (dict(batch_size=0), r"batch_size must be a positive integer, got 0"),
    (dict(batch_size=2, num_workers=-1), r"num_workers must be a non-negative integer, got -1"),
    (dict(batch_size=2, timeout=-1), r"timeout must be a non-negative number of seconds or None, got -1"),
])
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mploader.DataLoader(np.arange(4), **kwargs)


# ---------------------------------------------------------------- batchify


Pair = collections.namedtuple("Pair", ["tokens", "label"])


class Ragged:
    """Sample i: (int32 tokens of length 1 + i % 7, float label, dict) -- ragged on purpose."""

    def __len__(self):
        return 29

    def __getitem__(self, i):
        return (np.arange(1 + i % 7, dtype=np.int32) + i, np.float32(i) / 4,
                {"mask": np.ones(1 + i % 7, np.uint8), "id": i})


class Pairs(Ragged):
    def __getitem__(self, i):
        tokens, label, _ = super().__getitem__(i)
        return Pair(tokens, label)


class Dicts(Ragged):
    def __getitem__(self, i):
        tokens, label, extra = super().__getitem__(i)
        return {"tokens": tokens, "label": label, "mask": extra["mask"]}


def plain_pad(samples):
    """A plain callable (no ``collate``): its arrays are copied into the slot once."""
    width = max(len(s[0]) for s in samples)
    out = np.zeros((len(samples), width), np.int32)
    for k, s in enumerate(samples):
        out[k, :len(s[0])] = s[0]
    return out, [s[2]["id"] for s in samples]


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # Pad without pad_val warns
    BATCHIFY = {
        "default-ragged": (Ragged(), None),
        "tuple": (Ragged(), bf.Tuple(bf.Pad(pad_val=-1, ret_length=True, round_to=4), bf.Stack(), bf.List())),
        "group": (Ragged(), bf.Group(bf.Pad(pad_val=0, dtype=np.int64), bf.Stack(dtype=np.float64),
                                     bf.Dict({"mask": bf.Pad(pad_val=0), "id": bf.Stack()}))),
        "namedtuple": (Pairs(), bf.NamedTuple(Pair, {"tokens": bf.Pad(pad_val=7), "label": bf.Stack()})),
        "dict": (Dicts(), bf.Dict({"tokens": bf.Pad(pad_val=0, ret_length=True), "label": bf.Stack(),
                                   "mask": bf.Pad(pad_val=0)})),
        "list": (Ragged(), bf.List()),
        "plain-callable": (Ragged(), plain_pad),
    }


@pytest.mark.parametrize("name", sorted(BATCHIFY))
def test_batchify_matches_in_process_reference(workers, name):
    dataset, fn = BATCHIFY[name]
    def views_of_the_slot(batch):
        if workers:
            assert all(isinstance(lease_of(a), SlotLease) for a in arrays_in(batch)), "zero-copy views of the slot"

    with mploader.DataLoader(dataset, 5, batchify_fn=fn, num_workers=workers) as loader:
        got = collect(loader, views_of_the_slot)
    want = reference(mploader.BatchSampler(mploader.SequentialSampler(len(dataset)), 5), dataset, fn)
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        assert_same(g, w)


def test_batches_are_views_of_one_slot():
    with mploader.DataLoader(Ragged(), 5, batchify_fn=BATCHIFY["tuple"][1], num_workers=2) as loader:
        (padded, lengths), labels, extras = next(iter(loader))
    leases = {id(lease_of(a)) for a in (padded, lengths, labels)}
    assert len(leases) == 1 and isinstance(lease_of(padded), SlotLease)


# ---------------------------------------------------------------- Gluon's default batchify


Point = collections.namedtuple("Point", ["xy", "weight"])


class Func:
    """Sample i is ``fn(i)``."""

    def __init__(self, n, fn):
        self.n, self.fn = n, fn

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.fn(i)


# Samples Gluon batches without raising: the loader must give exactly MXNet's result.
GLUON_SAMPLES = {
    "lists of numbers": lambda i: [i, i + 1, i + 2],
    "lists of arrays": lambda i: [np.full(2, i, np.float32), np.zeros(2, np.float32) - i],
    "namedtuple": lambda i: Point(np.arange(3, dtype=np.int32) + i, float(i) / 2),
    "tuple of list, array, scalar": lambda i: ([i, -i], np.full((2, 2), i, np.float16), np.uint8(i)),
    "nested tuple": lambda i: ((np.arange(2) + i, i), [float(i)]),
    "big-endian arrays": lambda i: (np.arange(4) * i).astype(">i4"),
    "first sample decides: tuple then lists": lambda i: (i, [i, i]) if i % 5 == 0 else [i, [i, i]],
    "tuples of different lengths (zip truncates)": lambda i: (i, 2 * i) if i % 5 == 0 else (i, 2 * i, 3 * i),
    "numbers": lambda i: i * 1.5,
    "equal arrays": lambda i: np.full((3, 2), i, np.int64),
}


@pytest.mark.parametrize("name", sorted(GLUON_SAMPLES))
def test_default_batchify_is_gluons(workers, name):
    dataset = Func(23, GLUON_SAMPLES[name])

    def views_of_the_slot(batch):
        if workers:
            assert all(isinstance(lease_of(a), SlotLease) for a in arrays_in(batch)), "collated into the slot"

    with mploader.DataLoader(dataset, 5, num_workers=workers, seed=0) as loader:
        got = collect(loader, views_of_the_slot)
    want = [mxnet_default_batchify_fn([dataset[i] for i in idx])
            for idx in mploader.BatchSampler(mploader.SequentialSampler(len(dataset)), 5)]
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert_same(g, w)
    assert_same(mploader.default_batchify([dataset[i] for i in range(5)]), want[0])


def patterned(dtype, shape, seed):
    """An array of ``dtype`` and ``shape`` whose bytes are a pattern (so a missing
    byte swap shows), different for each ``seed``."""
    nbytes = np.dtype(dtype).itemsize * int(np.prod(shape))
    raw = (np.arange(nbytes, dtype=np.uint32) * 7 + seed) % 251
    return raw.astype(np.uint8).view(dtype).reshape(shape)


ASARRAY_DTYPES = [">i4", "<i4", ">f8", "f2", "?", "c8", ">c16", "M8[s]", "m8[ms]", "S2", ">U3", "V4",
                  [("i", "<i4"), ("f", ">f8"), ("s", "S3")]]


@pytest.mark.parametrize("dtype", ASARRAY_DTYPES, ids=str)
def test_arrays_batch_as_np_asarray_makes_them(dtype):
    """Gluon's rule for array samples is ``np.asarray(samples)``: its dtype included
    (several samples of a byte-swapped dtype give the native one, a single sample
    keeps it), for every batch size and for 0-d and zero-size samples; the slot path
    and the in-process function agree with it."""
    shapes = [(2, 3), (), (0,), (0, 2)]
    sizes = [1, 2, 5]
    samples = [patterned(dtype, shape, seed=k) for shape in shapes for k in range(max(sizes))]
    # samples of shape j are at j * 5 ...; each shape is batched 1, 2 and 5 at a time
    batches = [list(range(j * max(sizes), j * max(sizes) + size)) for j in range(len(shapes)) for size in sizes]
    with mploader.DataLoader(samples, batch_sampler=batches, num_workers=1) as loader:
        got = collect(loader)
    for idx, g in zip(batches, got):
        want = np.asarray([samples[i] for i in idx])
        for out in (g, mploader.default_batchify([samples[i] for i in idx])):
            assert type(out) is np.ndarray and out.dtype == want.dtype and out.shape == want.shape
            assert out.tobytes() == want.tobytes()


def test_two_list_samples_make_one_array():
    """The issue's example: ``[[1, 2, 3], [4, 5, 6]]`` as two samples is one (2, 3) array."""
    with mploader.DataLoader([[1, 2, 3], [4, 5, 6]], batch_size=2, num_workers=1) as loader:
        (batch,) = collect(loader)
    assert type(batch) is np.ndarray and batch.shape == (2, 3) and batch.dtype == np.int64
    assert batch.tolist() == [[1, 2, 3], [4, 5, 6]]


# Samples where MXNet's rule raises: the loader passes them through (docs/faces.md).
GLUON_RAISES = {
    "ragged arrays": (lambda i: np.arange(1 + i % 3), list),
    "None": (lambda i: None, list),
    "dicts": (lambda i: {"x": i}, list),
    "strings": (lambda i: f"s{i}", np.ndarray),         # np.asarray's fixed-width string array
    "int16 numbers": (lambda i: np.int16(i), np.ndarray),  # NumPy's dtype, which NDArray lacked
}


@pytest.mark.parametrize("name", sorted(GLUON_RAISES))
def test_default_batchify_passes_through_what_gluon_cannot_batch(name):
    fn, kind = GLUON_RAISES[name]
    samples = [fn(i) for i in range(4)]
    with pytest.raises((ValueError, KeyError)):
        mxnet_default_batchify_fn(samples)
    with mploader.DataLoader(Func(4, fn), 4, num_workers=1) as loader:
        (got,) = collect(loader)
    assert type(got) is kind
    if kind is list:
        assert_same(got, samples)
    else:
        assert_same(got, np.asarray(samples))


# ---------------------------------------------------------------- thread_pool, timeout


def test_thread_pool_gives_the_same_batches():
    dataset, fn = BATCHIFY["tuple"]
    with mploader.DataLoader(dataset, 4, batchify_fn=fn, num_workers=2, thread_pool=True) as loader:
        assert loader.worker_pids() == []
        got = collect(loader)
        assert loader.stats()["shm_bytes"] == 0  # no shared memory with threads
    want = reference(mploader.BatchSampler(mploader.SequentialSampler(len(dataset)), 4), dataset, fn)
    for g, w in zip(got, want):
        assert_same(g, w)


class Gated:
    """Sample 0 waits (at most 20 s) until a byte arrives on a pipe.

    (Not a multiprocessing.Event: setting one blocks forever if a waiter was killed,
    and the loader kills workers that time out.)"""

    def __init__(self):
        self.r, self.w = os.pipe()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 0:
            select.select([self.r], [], [], 20)
        return i

    def release(self):
        os.write(self.w, b"x")

    def close(self):
        os.close(self.r)
        os.close(self.w)


@pytest.mark.parametrize("workers, thread_pool", [(1, False), (2, False), (2, True)],
                         ids=["workers1", "workers2", "threads2"])
def test_timeout_raises(workers, thread_pool):
    ds = Gated()
    try:
        with mploader.DataLoader(ds, 2, num_workers=workers, thread_pool=thread_pool, timeout=0.2) as loader:
            it = iter(loader)
            with pytest.raises(TimeoutError, match=r"took more than 0.2 s"):
                next(it)
    finally:
        ds.release()  # a pool thread is still waiting; workers were killed
        ds.close()


# ---------------------------------------------------------------- pin_memory, try_nopython


def test_pin_memory_is_a_no_op_without_cuda_or_workers(workers):
    cuda = _pinning.cuda_runtime(0) is not None
    with mploader.DataLoader(np.arange(20), 4, num_workers=workers, pin_memory=True, pin_device_id=0) as loader:
        assert flat(loader) == list(range(20))
        if cuda and workers:
            assert loader._pinner.ranges, "the region is page-locked"
        else:
            assert loader._pinner is None


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; returns ``code`` from register."""

    def __init__(self, code=0):
        self.code = code
        self.calls = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class Growing:
    """Sample i is a float64 array of 64 * (1 + i) elements: later batches need bigger slots."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return np.full(64 * (1 + i), i, np.float64)


def iterate_checking_registration(loader, fake):
    """Iterate ``loader``, asserting that every byte each returned batch views is
    registered by the time it is returned (workers may have grown the region further
    for batches still in flight); returns the region."""
    region = None
    for batch in loader:
        region = loader._engine.region
        registered = sum(c[2] for c in fake.calls if c[0] == "register")
        for a in batch:
            start = a.__array_interface__["data"][0]
            assert region.address <= start and start + a.nbytes <= region.address + registered
        del batch, a
    return region


def test_pin_memory_registers_the_region_as_it_grows(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (fake, contextlib.nullcontext))
    loader = mploader.DataLoader(Growing(), 4, num_workers=2, pin_memory=True, batchify_fn=bf.List())
    try:
        region = iterate_checking_registration(loader, fake)
        starts = [c[1] for c in fake.calls]
        assert starts[0] == region.address
        assert all(c[3] == 1 for c in fake.calls)  # cudaHostRegisterPortable
        # ranges are contiguous: each starts where the previous ended
        ends = [c[1] + c[2] for c in fake.calls]
        assert starts[1:] == ends[:-1]
        assert len(fake.calls) >= 2, "the region grew while loading bigger batches"
    finally:
        loader.close()
    unregistered = [c[1] for c in fake.calls if c[0] == "unregister"]
    assert unregistered == starts
    loader.close()
    assert len([c for c in fake.calls if c[0] == "unregister"]) == len(starts)  # idempotent


def test_pinning_follows_growth_notifications_not_batches(monkeypatch):
    """The pinner runs when the engine reports that the region grew (on_grow), not
    after every batch: equal batches make the region grow a few times at most."""
    fake = FakeCudart()
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (fake, contextlib.nullcontext))
    seen = []
    real = _pinning.HostPinner.on_grow

    bases = set()

    def counting(self, region):
        seen.append(region.file_bytes)
        bases.add(region.address)
        real(self, region)

    monkeypatch.setattr(_pinning.HostPinner, "on_grow", counting)
    # prefetch=4: 7 slots, each growing at most a few times (the default would make
    # 35 slots for batches this small, each growing once when first used)
    with mploader.DataLoader(np.zeros((400, 256), np.float32), 4, num_workers=2, prefetch=4,
                             pin_memory=True) as loader:
        batches = sum(1 for _ in loader)
    assert batches == 100
    assert 1 <= len(seen) <= 20, f"{len(seen)} notifications for {batches} batches"
    # A worker may grow a slot between the engine's look at the size and the pinner's,
    # so two notifications can see the same size; never a smaller one.
    assert seen == sorted(seen), f"a notification reports a smaller region: {seen}"
    # Each notification registers at most the bytes past the last registration, up to
    # the size it reads itself (which may be past the size seen here, or short of it
    # while the file lags: CI saw 3 sizes seen and 2 registrations): ranges that follow
    # one another from the region's start, never a byte twice.
    registers = [c for c in fake.calls if c[0] == "register"]
    assert 1 <= len(registers) <= len(seen), (fake.calls, seen)
    (base,) = bases
    end = base
    for _, ptr, nbytes, _flags in registers:
        assert ptr == end and nbytes > 0 and nbytes % 4096 == 0, (fake.calls, base)
        end += nbytes


def test_pin_memory_registration_failure_warns_once(monkeypatch):
    fake = FakeCudart(code=1)
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (fake, contextlib.nullcontext))
    with mploader.DataLoader(Growing(), 4, num_workers=1, pin_memory=True, batchify_fn=bf.List()) as loader:
        with pytest.warns(RuntimeWarning, match=r"pin_memory: cudaHostRegister .* failed \(cudaError 1\)"):
            batches = collect(loader)
    assert len(batches) == 6 and len(fake.calls) == 1


class FileBoundCudart(FakeCudart):
    """As the CUDA driver (seen on an H200): refuses (cudaErrorInvalidValue, 1) a range
    that reaches past the end of the file the memory maps."""

    def __init__(self):
        super().__init__()
        self.region = None
        self.refused = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        if ptr + nbytes > self.region.address + os.fstat(self.region.fd).st_size:
            self.refused.append((ptr, nbytes))
            return 1
        return 0


class _Region:
    """Stand-in for ``_ring.Region``: a memfd whose reserved span (``file_bytes``) can
    run ahead of its size, as while a worker is between reserving and allocating."""

    def __init__(self, size, file_bytes):
        self.fd = os.memfd_create("pin-test")
        os.ftruncate(self.fd, size)
        self.address = 1 << 30
        self.file_bytes = file_bytes


def test_pinner_registers_only_what_is_in_the_file(monkeypatch):
    page = _pinning._PAGE
    fake = FileBoundCudart()
    region = fake.region = _Region(2 * page, 5 * page)
    try:
        pinner = _pinning.HostPinner(fake, contextlib.nullcontext)
        assert pinner.on_grow(region) == 2 * page        # stops at the file's end, not at file_bytes
        assert pinner.on_grow(region) == 2 * page        # nothing new in the file: no call
        os.ftruncate(region.fd, 5 * page)                # the worker allocated its range
        assert pinner.on_grow(region) == 5 * page
        assert fake.refused == []
        assert [c[1:3] for c in fake.calls] == [(region.address, 2 * page), (region.address + 2 * page, 3 * page)]
        pinner.release()
        assert pinner.on_grow(region) is None
    finally:
        os.close(region.fd)


def test_a_refused_registration_clears_the_cuda_error(monkeypatch):
    """torch checks the runtime's last error after every kernel launch: a refused
    registration left there would fail the user's next CUDA op (seen on an H200)."""
    cleared = []
    monkeypatch.setattr(_pinning, "_clear_last_cuda_error", lambda: cleared.append(True))
    region = _Region(_pinning._PAGE, _pinning._PAGE)
    try:
        pinner = _pinning.HostPinner(FakeCudart(code=1), contextlib.nullcontext)
        with pytest.warns(RuntimeWarning, match=r"cudaError 1"):
            assert pinner.on_grow(region) is None
        assert cleared == [True]
    finally:
        os.close(region.fd)


def test_pinning_a_growing_region_never_asks_for_bytes_outside_the_file(monkeypatch):
    """Two workers grow slots while the parent registers: every registration stays
    inside the file (the driver refuses the rest) and every batch is registered."""
    fake = FileBoundCudart()
    real = _pinning.HostPinner.on_grow

    def tracking(self, region):
        fake.region = region
        return real(self, region)

    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (fake, contextlib.nullcontext))
    monkeypatch.setattr(_pinning.HostPinner, "on_grow", tracking)
    for _ in range(3):
        fake.calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            loader = mploader.DataLoader(Growing(), 2, num_workers=2, pin_memory=True, batchify_fn=bf.List())
            try:
                iterate_checking_registration(loader, fake)
            finally:
                loader.close()
        assert fake.refused == []


class FakeEvent:
    """A CUDA event whose completion the test decides (``FakeEvent.done``)."""

    done = False
    made = 0

    def __init__(self):
        FakeEvent.made += 1
        self.recorded = False

    def record(self):
        self.recorded = True

    def query(self):
        return FakeEvent.done

    def synchronize(self):
        FakeEvent.done = True


def test_a_dropped_pinned_batch_keeps_its_slot_until_the_gpu_copy_is_done(monkeypatch, no_leaks):
    """x.cuda(non_blocking=True) reads the pinned slot later, on the GPU: the slot of a
    dropped batch is not reused before the event recorded at its release completed
    (on an H200, 145 of 200 batches arrived with another batch's bytes without this)."""
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (FakeCudart(), contextlib.nullcontext))
    monkeypatch.setattr(_pinning, "_default_event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "done", False)
    loader = mploader.DataLoader(Growing(), 4, num_workers=1, prefetch=1, pin_memory=True,
                                 batchify_fn=bf.List())
    try:
        it = iter(loader)
        first = next(it)
        region = loader._engine.region
        slot = lease_of(first[0]).slot
        del first
        gc.collect()
        assert region.state(slot) == _ring.STATE_LEASED       # held for the GPU, not FREE
        assert loader._pinner.held == 1
        second = next(it)                                     # the event is not done: another slot
        assert lease_of(second[0]).slot != slot
        assert region.state(slot) == _ring.STATE_LEASED
        FakeEvent.done = True
        del second
        rest = list(it)                                       # polled before each dispatch
        assert len(rest) == 4
        assert loader._pinner.held <= 2
        del rest
    finally:
        loader.close()
    assert FakeEvent.made >= 6


def test_held_slots_are_waited_for_when_no_slot_is_free(monkeypatch, no_leaks):
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (FakeCudart(), contextlib.nullcontext))
    monkeypatch.setattr(_pinning, "_default_event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "done", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no pipe fallback for want of a slot
        with mploader.DataLoader(Growing(), 1, num_workers=1, prefetch=1, pin_memory=True,
                                 batchify_fn=bf.List()) as loader:
            got = [int(b[0][0]) for b in loader]       # each batch dropped at once
    assert got == list(range(24))
    assert FakeEvent.done                              # a wait happened (synchronize)


@pytest.mark.parametrize("try_nopython", [None, False, True])
def test_try_nopython_is_accepted(try_nopython):
    with mploader.DataLoader(np.arange(10), 3, num_workers=1, try_nopython=try_nopython) as loader:
        assert flat(loader) == list(range(10))


# ---------------------------------------------------------------- lifetime


def test_iterator_outlives_its_loader(workers, no_leaks):
    it = iter(mploader.DataLoader(np.arange(40), 4, num_workers=workers))
    gc.collect()
    assert len(it) == 10
    assert flat(it) == list(range(40))
    del it


def test_ten_dropped_loaders_with_eight_workers_leave_nothing(no_leaks):
    for k in range(10):
        loader = mploader.DataLoader(np.arange(64) + k, 8, num_workers=8)
        batch = next(iter(loader))
        assert batch.tolist() == list(range(k, k + 8))
        del loader, batch
