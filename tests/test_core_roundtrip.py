"""Property: mploader delivers exactly the batches the in-process collate makes.

Hypothesis draws a sample *schema* (nested tuples, lists, dicts and namedtuples
whose leaves are ndarrays of many dtypes and shapes -- 0-d and zero-size included --
or Python numbers), then a few batches of samples that follow it.  For
``num_workers`` in {0, 1, 2}, every batch mploader returns must equal, bit for bit
and in order,

(a) ``mploader.batchify.Nested()`` (the loaders' batchify) applied in this process, and
(b) ``reference_batchify`` below, written independently with ``np.stack``.

The samples reach the workers as the *indices* of an identity dataset (a mutable
batch sampler hands out the current example's batches), so three long-lived loaders
serve every example: workers are forked once per worker count, and the slots keep
growing and being reused across examples of different sizes.
"""
from __future__ import annotations

import collections
import gc

import numpy as np
import pytest
from _util import lease_of
from conftest import Snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mploader
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(150)

#: The collation under test: recurses into every container (Gluon's default, the
#: DataLoader's, treats only tuples as structure; see tests/test_dataloader_gluon.py).
NESTED = mploader.batchify.Nested()

Pair = collections.namedtuple("Pair", "first second")
Triple = collections.namedtuple("Triple", "x y z")
NAMEDTUPLES = (Pair, Triple)

DTYPES = [np.dtype(d) for d in (
    "?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
    "f2", "f4", "f8", "c8", "c16", ">i4", ">f8",
    "M8[s]", "M8[ns]", "m8[ms]",
)] + [np.dtype([("i", "<i4"), ("f", ">f8"), ("s", "S3")])]  # packed structured: no padding bytes

NUMBER_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64), float: np.dtype(np.float64),
                 complex: np.dtype(np.complex128)}
NUMBERS = {
    bool: st.booleans(),
    int: st.integers(-(2**63), 2**63 - 1),
    float: st.floats(allow_nan=True, allow_infinity=True),
    complex: st.complex_numbers(allow_nan=True, allow_infinity=True),
}


# ---- schemas: ("array", dtype, shape) | ("number", type) | ("tuple"|"list", [s]) |
#               ("dict", [(key, s)]) | ("nt", namedtuple type, [s]) ----

leaf_schemas = st.one_of(
    st.tuples(st.just("array"), st.sampled_from(DTYPES),
              hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)),
    st.tuples(st.just("number"), st.sampled_from(list(NUMBERS))),
)


def _containers(children):
    return st.one_of(
        st.tuples(st.just("tuple"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("list"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("dict"), st.lists(st.tuples(st.text("abcxyz", min_size=1, max_size=3), children),
                                            min_size=1, max_size=3, unique_by=lambda kv: kv[0])),
        st.sampled_from(NAMEDTUPLES).flatmap(
            lambda nt: st.tuples(st.just("nt"), st.just(nt), st.lists(children, min_size=len(nt._fields),
                                                                      max_size=len(nt._fields)))),
    )


schemas = st.recursive(leaf_schemas, _containers, max_leaves=6)


def sample_of(schema) -> st.SearchStrategy:
    """Strategy for one sample following ``schema``."""
    kind = schema[0]
    if kind == "array":
        return hnp.arrays(schema[1], schema[2])
    if kind == "number":
        return NUMBERS[schema[1]]
    if kind == "tuple":
        return st.tuples(*map(sample_of, schema[1]))
    if kind == "list":
        return st.tuples(*map(sample_of, schema[1])).map(list)
    if kind == "dict":
        keys = [k for k, _ in schema[1]]
        return st.tuples(*(sample_of(s) for _, s in schema[1])).map(lambda vals: dict(zip(keys, vals)))
    if kind == "nt":
        return st.tuples(*map(sample_of, schema[2])).map(lambda vals, nt=schema[1]: nt(*vals))
    raise AssertionError(schema)


@st.composite
def cases(draw):
    schema = draw(schemas)
    sample = sample_of(schema)
    batches = draw(st.lists(st.lists(sample, min_size=1, max_size=4), min_size=1, max_size=3))
    return schema, batches


# ---- the independent reference ----

def reference_batchify(schema, samples):
    """Gluon's stacking rule, spelled out for uniform samples with ``np.stack``."""
    kind = schema[0]
    if kind == "array":
        # dtype= keeps the exact dtype: NumPy's promotion would canonicalise the
        # byte order of a structured dtype's fields.
        return np.stack(samples, dtype=schema[1], casting="no")
    if kind == "number":
        return np.array(samples, dtype=NUMBER_DTYPES[schema[1]])
    if kind in ("tuple", "list"):
        return [reference_batchify(s, [x[j] for x in samples]) for j, s in enumerate(schema[1])]
    if kind == "dict":
        return {k: reference_batchify(s, [x[k] for x in samples]) for k, s in schema[1]}
    if kind == "nt":
        return schema[1](*(reference_batchify(s, [x[j] for x in samples]) for j, s in enumerate(schema[2])))
    raise AssertionError(schema)


def assert_same(got, want, path="batch"):
    """Same structure and container types; arrays with the same dtype, shape and bytes."""
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, f"{path}: {type(got).__name__} instead of ndarray"
        assert got.dtype == want.dtype and got.dtype.str == want.dtype.str, f"{path}: {got.dtype} != {want.dtype}"
        assert got.dtype.descr == want.dtype.descr, f"{path}: {got.dtype.descr} != {want.dtype.descr}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.tobytes() == want.tobytes(), f"{path}: bytes differ\n{got!r}\n{want!r}"
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for j, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{j}]")
    else:
        raise AssertionError(f"{path}: unexpected leaf {want!r}")


def leaves(batch):
    if isinstance(batch, dict):
        for v in batch.values():
            yield from leaves(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from leaves(v)
    else:
        yield batch


def owned(batch):
    """A copy of ``batch`` with the same structure, holding no slot."""
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, dict):
        return {k: owned(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*map(owned, batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map(owned, batch))
    return batch


# ---- loaders reused across examples ----

class IdentityDataset:
    """``dataset[sample] -> sample``: the batch sampler's "indices" are the samples."""

    def __getitem__(self, sample):
        return sample


class Feed:
    """A batch sampler whose batches the test replaces before each epoch."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


@pytest.fixture(scope="module")
def loaders():
    """One loader per worker count, workers already started (so each test's leak
    check sees them before and after); closed, and checked, at module teardown."""
    before = Snapshot()
    made = {}
    for nw in (0, 1, 2):
        feed = Feed()
        loader = mploader.DataLoader(IdentityDataset(), batch_sampler=feed, batchify_fn=NESTED, num_workers=nw,
                                     seed=0, timeout=60)
        feed.batches = [[np.zeros(3)]]
        assert len(list(loader)) == 1  # forks the workers
        made[nw] = (loader, feed)
    yield made
    for loader, _ in made.values():
        loader.close()
    del made, loader
    gc.collect()
    problems = Snapshot().leaks(before)
    assert not problems, "\n".join(problems)


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=cases())
def test_roundtrip_equals_default_batchify_and_np_stack(loaders, case):
    schema, batches = case
    want = [reference_batchify(schema, b) for b in batches]
    in_process = [NESTED(b) for b in batches]
    for k, (got, w) in enumerate(zip(in_process, want)):
        assert_same(got, w, f"default_batchify batch {k}")
    for nw, (loader, feed) in loaders.items():
        feed.batches = batches
        stats_before = loader.stats()
        got = list(loader)
        stats = loader.stats()
        # Record where each array lives, then drop the slot views before asserting:
        # a failing example's traceback (which hypothesis keeps) must not hold slots.
        in_slot = [[isinstance(lease_of(leaf), SlotLease) for leaf in leaves(g)] for g in got]
        got = [owned(g) for g in got]
        assert len(got) == len(batches), f"num_workers={nw}"
        for k, (g, w) in enumerate(zip(got, in_process)):
            assert_same(g, w, f"num_workers={nw} batch {k}")
        if nw:
            # Every array is a zero-copy view of a slot (no fallback on this data).
            for k, flags in enumerate(in_slot):
                assert all(flags), f"num_workers={nw} batch {k}: arrays not in a slot: {flags}"
            assert stats["slot"] - stats_before["slot"] == len(batches), (stats_before, stats)
            assert stats["batches"] - stats_before["batches"] == len(batches)
            assert stats["fallback_pipe"] == stats_before["fallback_pipe"], (stats_before, stats)
            assert stats["fallback_inband"] == stats_before["fallback_inband"], (stats_before, stats)


def test_roundtrip_across_epochs_and_slot_growth(loaders):
    """A long epoch of growing batches after many small ones: every batch still equal."""
    rng = np.random.default_rng(7)
    batches = []
    for k in range(30):
        n = 1 + 40 * k  # each batch larger than the last: slots must keep growing
        batches.append([(rng.standard_normal(n).astype(np.float32), int(k), {"m": rng.integers(0, 9, (2, k))})
                        for _ in range(3)])
    in_process = [NESTED(b) for b in batches]
    for nw, (loader, feed) in loaders.items():
        feed.batches = batches
        for epoch in range(2):
            for k, got in enumerate(loader):
                got = owned(got)  # a failure's traceback must not hold a slot
                assert_same(got, in_process[k], f"num_workers={nw} epoch {epoch} batch {k}")
