"""Small leaves of a torch-face batch are owned copies, large ones views of the slot
(``mploader.torch.SMALL_LEAF_BYTES``): an evaluation loop that keeps every batch's
labels (torchmetrics, ``all_labels.append(y)``) must not keep every batch's slot
alive -- before, one pass over real photos held +404 MB where torch's DataLoader held
+7 MB.  Collecting every batch (``list(loader)``) prints nothing, as torch.
Reference for the values: torch 2.13's own DataLoader on the same dataset.
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mploader.torch as mpt  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Photos(torch.utils.data.Dataset):
    """(3, 32, 32) uint8 images (3 KiB each: a batch of 8 is 24 KiB) and int labels."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((3, 32, 32), i % 251, dtype=torch.uint8), i


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, 40, n))


def in_region(loader, t) -> bool:
    region = loader._mpl_engine.region
    return region.address <= t.data_ptr() < region.address + region.file_bytes


def test_kept_labels_do_not_keep_their_batches(no_leaks):
    want = list(torch.utils.data.DataLoader(Photos(), batch_size=8, num_workers=2))
    with mpt.DataLoader(Photos(), batch_size=8, num_workers=2) as loader:
        labels, images = [], None
        for batch_images, y in loader:
            labels.append(y)
            images = batch_images
        assert in_region(loader, images)                       # the large leaf: a view of its slot
        assert not any(in_region(loader, y) for y in labels)   # the small ones: owned copies
        stats = loader.stats()
        assert stats["slot"] == 12 and stats["fallback_pipe"] == 0
        assert stats["held_slots"] == 1                        # only the last batch's images
        del images, batch_images
        assert loader.stats()["held_slots"] == 0
    assert [y.tolist() for y in labels] == [y.tolist() for _, y in want]


def test_the_copy_threshold_is_by_bytes(no_leaks):
    """A leaf of SMALL_LEAF_BYTES is a view, one byte less a copy (NumPy arrays from
    a custom collate_fn too)."""
    n = mpt.SMALL_LEAF_BYTES

    def collate(samples):
        return np.zeros(n, np.uint8), np.zeros(n - 1, np.uint8), torch.zeros(n // 4, dtype=torch.float32)

    with mpt.DataLoader(list(range(4)), batch_size=2, num_workers=1, collate_fn=collate) as loader:
        for at_limit, below, tensor in loader:
            region = loader._mpl_engine.region
            assert region.address <= at_limit.__array_interface__["data"][0] < region.address + region.file_bytes
            assert not region.address <= below.__array_interface__["data"][0] < region.address + region.file_bytes
            assert in_region(loader, tensor)


def test_list_of_an_iterable_dataset_warns_no_more_than_torch(no_leaks, caplog):
    """Holding every batch used to print 'all N slots are held by batches that are
    still alive' (a RuntimeWarning torch never prints); the batches also held every
    slot.  Now small batches hold none, and a full ring is one INFO log line."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = [b.tolist() for b in torch.utils.data.DataLoader(Stream(), batch_size=3, num_workers=2)]
        with mpt.DataLoader(Stream(), batch_size=3, num_workers=2) as loader:
            got = [b.tolist() for b in list(loader)]
            assert loader.stats()["held_slots"] == 0
        assert got == want

        big = [torch.full((64, 64), i, dtype=torch.float32) for i in range(300)]   # 16 KiB samples
        with caplog.at_level(logging.INFO, logger="mploader"), \
                mpt.DataLoader(big, batch_size=2, num_workers=1, prefetch_factor=2) as loader:
            kept = list(loader)                                 # every batch held: the ring fills
            assert loader.stats()["fallback_pipe"] > 0
        assert [float(b[0, 0, 0]) for b in kept] == [float(i) for i in range(0, 300, 2)]
        assert any("slots are held by batches that are still alive" in r.getMessage() for r in caplog.records)
