"""Bad arguments raise ValueError/TypeError whose message names the argument and the value
(tests/test_options.py pins the exact texts and the limits).

Construction fails before any worker is forked or any shared memory is made (the
conftest leak check runs after each case).
"""
from __future__ import annotations

import numpy as np
import pytest

import mploader

pytestmark = pytest.mark.timeout(30)


class Data:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.full(2, i)


class NoLen:
    def __getitem__(self, i):
        return np.full(2, i)


SAMPLER = mploader.SequentialSampler(10)
BATCH_SAMPLER = mploader.BatchSampler(mploader.SequentialSampler(10), 3, "keep")

# (id, kwargs beyond the dataset, expected exception type(s), substrings of the message)
CASES = [
    ("batch_size=0", dict(batch_size=0), ValueError, ["batch_size", "0"]),
    ("batch_size=-3", dict(batch_size=-3), ValueError, ["batch_size", "-3"]),
    ("batch_size=2.5", dict(batch_size=2.5), TypeError, ["batch_size", "2.5"]),
    ("batch_size='4'", dict(batch_size="4"), TypeError, ["batch_size", "'4'"]),
    ("batch_size missing", dict(), ValueError, ["batch_size", "batch_sampler"]),
    ("sampler+shuffle", dict(batch_size=2, sampler=SAMPLER, shuffle=True), ValueError,
     ["shuffle", "sampler", "True"]),
    ("batch_sampler+batch_size", dict(batch_sampler=BATCH_SAMPLER, batch_size=4), ValueError,
     ["batch_sampler", "batch_size=4"]),
    ("batch_sampler+shuffle", dict(batch_sampler=BATCH_SAMPLER, shuffle=True), ValueError,
     ["batch_sampler", "shuffle=True"]),
    ("batch_sampler+sampler", dict(batch_sampler=BATCH_SAMPLER, sampler=SAMPLER), ValueError,
     ["batch_sampler", "sampler="]),
    ("batch_sampler+last_batch", dict(batch_sampler=BATCH_SAMPLER, last_batch="discard"), ValueError,
     ["batch_sampler", "last_batch='discard'"]),
    ("last_batch='drop'", dict(batch_size=2, last_batch="drop"), ValueError,
     ["last_batch", "'drop'", "keep", "discard", "rollover"]),
    ("last_batch='KEEP'", dict(batch_size=2, last_batch="KEEP"), ValueError, ["last_batch", "'KEEP'"]),
    ("shared_mem=-1", dict(batch_size=2, shared_mem=-1), ValueError, ["shared_mem", "-1"]),
    ("shared_mem=-4096", dict(batch_size=2, shared_mem=-4096, num_workers=2), ValueError,
     ["shared_mem", "-4096"]),
    ("num_workers=-1", dict(batch_size=2, num_workers=-1), ValueError, ["num_workers", "-1"]),
    ("num_workers=1.5", dict(batch_size=2, num_workers=1.5), TypeError, ["num_workers", "1.5"]),
    ("prefetch=-2", dict(batch_size=2, prefetch=-2, num_workers=1), ValueError, ["prefetch", "-2"]),
    ("timeout=-1", dict(batch_size=2, timeout=-1), ValueError, ["timeout", "-1"]),
    ("seed='abc'", dict(batch_size=2, seed="abc"), TypeError, ["seed", "'abc'"]),
]


@pytest.mark.parametrize("kwargs, exc_type, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_names_argument_and_value(kwargs, exc_type, needles):
    with pytest.raises(exc_type) as info:
        mploader.DataLoader(Data(), **kwargs)
    assert type(info.value) is exc_type, "TypeError for a wrong type, ValueError for a value out of range"
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


@pytest.mark.parametrize("dataset, type_name", [(42, "int"), (object(), "object"), (None, "NoneType"),
                                                 (iter([1, 2, 3]), "list_iterator"), (NoLen(), "NoLen")],
                         ids=["int", "object", "None", "iterator", "no __len__"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_non_dataset_input_raises_type_error(dataset, type_name, num_workers):
    with pytest.raises(TypeError) as info:
        mploader.DataLoader(dataset, batch_size=2, num_workers=num_workers)
    msg = str(info.value)
    assert "dataset" in msg and type_name in msg and "__getitem__" in msg, msg


def test_valid_edge_arguments_are_accepted():
    # A dataset without __len__ is fine with a batch sampler; ndarrays and lists are datasets.
    with mploader.DataLoader(NoLen(), batch_sampler=BATCH_SAMPLER, num_workers=1, seed=0) as dl:
        batches = list(dl)
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    del batches
    with mploader.DataLoader(np.arange(10.0), batch_size=4, last_batch="discard", shared_mem=0,
                             num_workers=2, timeout=None, seed=3) as dl:
        assert len(dl) == 2
        assert [b.tolist() for b in dl] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    dl = mploader.DataLoader(list(range(7)), batch_size=3, last_batch="rollover", timeout=0)
    assert [b.tolist() for b in dl] == [[0, 1, 2], [3, 4, 5]]
    assert [b.tolist() for b in dl] == [[6, 0, 1], [2, 3, 4]]
