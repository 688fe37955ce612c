"""mploader.SharedList: a dataset of Python objects that forked workers read without
copying it (pytorch issue 13246: reading a Python object writes its reference count,
so each worker copies the pages of a plain list as it reads them).  The reference
for the items is the plain list itself; memory is read from the kernel (USS of each
worker, psutil)."""
from __future__ import annotations

import pickle

import numpy as np
import psutil
import pytest

import mploader

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def annotations(n: int) -> list[dict]:
    """COCO-style annotation dicts (about 500 bytes of Python objects each)."""
    return [{"id": i, "image_id": i // 3, "bbox": [float(i), 2.0 * i, 10.0, 20.0 + i % 7],
             "category": f"class-{i % 80}", "area": 200.0 + i, "iscrowd": i % 2 == 0} for i in range(n)]


def test_items_read_back_as_the_list_holds_them():
    items = annotations(500) + [None, (1, "a"), np.arange(3), {"nested": [{"x": 1}]}]
    shared = mploader.SharedList(items)
    assert len(shared) == len(items)
    for i in (0, 1, 250, -1, -len(items)):
        got, want = shared[i], items[i]
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert got == want
    assert shared[10:20:3] == items[10:20:3]
    assert pickle.loads(pickle.dumps(shared))[42] == items[42]
    assert len(mploader.SharedList([])) == 0


def test_bad_indices_and_items_say_what_is_wrong():
    shared = mploader.SharedList([1, 2, 3])
    with pytest.raises(IndexError, match="SharedList index 3 out of range for 3 items"):
        shared[3]
    with pytest.raises(TypeError, match="SharedList indices must be integers or slices, not str"):
        shared["a"]
    with pytest.raises(pickle.PicklingError, match="SharedList item 1 \\(function\\) cannot be pickled"):
        mploader.SharedList([1, lambda: 0])


class Annotations:
    """A dataset over ``items`` (a list or a SharedList): each sample reads one dict."""

    def __init__(self, items) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> np.ndarray:
        a = self.items[i]
        return np.array(a["bbox"] + [a["id"]], np.float64)


def workers_private_mib(loader) -> float:
    return sum(psutil.Process(pid).memory_full_info().uss for pid in loader._engine.worker_pids()) / MiB


def test_forked_workers_share_a_shared_list_and_copy_a_plain_one():
    """Two epochs over 60,000 dicts (about 35 MiB of Python objects), 2 forked
    workers: with the plain list the workers' private memory ends tens of MiB higher
    than with a SharedList of the same items (each worker copied the pages it read).
    Same batches either way."""
    items = annotations(60_000)
    private, batches = {}, {}
    for kind, store in (("list", items), ("shared", mploader.SharedList(items))):
        with mploader.DataLoader(Annotations(store), batch_size=500, num_workers=2, prefetch=2) as loader:
            for _ in range(2):
                batches[kind] = [b.copy() for b in loader]
            private[kind] = workers_private_mib(loader)
    for a, b in zip(batches["list"], batches["shared"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert private["list"] - private["shared"] >= 16, private


class Windows:
    """A sampler over ``n`` samples that gives epoch ``k`` the ``k``-th third of them:
    each epoch the workers read Python objects they never read before."""

    def __init__(self, n: int) -> None:
        self.third = n // 3
        self.epoch = 0

    def __len__(self) -> int:
        return self.third

    def __iter__(self):
        start = (self.epoch % 3) * self.third
        self.epoch += 1
        return iter(range(start, start + self.third))


def test_diagnose_names_copy_on_write_when_workers_memory_grows_epoch_over_epoch():
    items = annotations(90_000)
    with mploader.DataLoader(Annotations(items), batch_size=500, sampler=Windows(len(items)), num_workers=2,
                             prefetch=2) as loader:
        for _ in range(3):
            for b in loader:
                del b
            loader.stats()   # sampled once per epoch
        samples = loader.stats()["worker_private_bytes"]
        message = str(mploader.diagnose(loader))
    assert len(samples) == 3 and samples[0] < samples[1] < samples[2], samples
    assert "private memory grew from" in message and "mploader.SharedList" in message, message
    with mploader.DataLoader(Annotations(mploader.SharedList(items)), batch_size=500, sampler=Windows(len(items)),
                             num_workers=2, prefetch=2) as loader:
        for _ in range(3):
            for b in loader:
                del b
            loader.stats()
        assert "private memory" not in str(mploader.diagnose(loader))


def test_the_copy_on_write_rule():
    from mploader._diagnose import _private_memory_note
    MiB_ = 1 << 20
    assert _private_memory_note({"worker_private_bytes": [10 * MiB_, 20 * MiB_, 40 * MiB_]}).startswith(
        "; the workers' private memory grew from 10 to 40 MiB over 3 epochs")
    assert _private_memory_note({"worker_private_bytes": [10 * MiB_, 40 * MiB_]}) == ""          # 2 samples
    assert _private_memory_note({"worker_private_bytes": [10 * MiB_, 40 * MiB_, 39 * MiB_]}) == ""  # fell
    assert _private_memory_note({"worker_private_bytes": [100 * MiB_, 105 * MiB_, 110 * MiB_]}) == ""  # < 16 MiB
    assert _private_memory_note({"worker_private_bytes": [900 * MiB_, 930 * MiB_, 960 * MiB_]}) == ""  # < 10 %
