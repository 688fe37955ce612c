"""The worker spec travels once (issue 27): pickled once per generation of workers into
a memfd that spawn/forkserver workers map copy-on-write; memory-mapped arrays are
mapped again from their file; what the standard pickler refuses goes by value
(cloudpickle); what cannot be pickled at all is named by its attribute path."""
from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import psutil
import pytest

import mploader
from mploader import _spec

METHODS = ["spawn", "forkserver"]


class Counter:
    """Every sample adds 1 to ``x[0, 0]`` and returns it with the worker's pid: a
    worker that shared its pages with another (or the parent) would see their adds."""

    def __init__(self, n: int = 64) -> None:
        self.x = np.zeros((256, 64), np.int64)   # 128 KiB: out of band (>= OUT_OF_BAND_BYTES)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        self.x[0, 0] += 1
        self.x[1 + i % 255, :] = i            # writes spread over the array's pages too
        return np.array([self.x[0, 0], os.getpid(), self.x[1 + i % 255, 0]], np.int64)


@pytest.mark.parametrize("method", METHODS)
def test_a_worker_writing_into_a_dataset_array_gets_private_pages(method):
    ds = Counter()
    assert ds.x.nbytes >= _spec.OUT_OF_BAND_BYTES
    with mploader.DataLoader(ds, batch_size=4, num_workers=2, start_method=method, seed=0) as loader:
        rows = np.concatenate([np.asarray(b) for b in loader])
    assert not ds.x.any(), "the parent's array changed"
    per_worker: dict[int, list[int]] = {}
    for count, pid, _ in rows:
        per_worker.setdefault(int(pid), []).append(int(count))
    assert sorted(rows[:, 2].tolist()) == list(range(64))
    assert len(per_worker) == 2, per_worker.keys()
    for pid, counts in per_worker.items():
        # Its own adds only, in order: 1, 2, ..., k (another worker's adds would show).
        assert counts == list(range(1, len(counts) + 1)), (pid, counts)


def test_the_spec_is_packed_once_per_generation_and_kept_while_unchanged():
    ds = Counter(8)
    loader = mploader.DataLoader(ds, batch_size=4, num_workers=3, start_method="spawn", seed=0)
    try:
        list(loader)
        transport = loader._engine._res.transport
        first = transport.packed
        assert first is not None and first.fd >= 0
        loader._engine.stop_workers()           # the next epoch starts a new generation
        list(loader)
        assert transport.packed is first        # the same bytes: the same memfd
        ds.x[5, 5] = 7                           # changed in the parent between generations
        loader._engine.stop_workers()
        list(loader)
        assert transport.packed is not first and first.fd == -1   # a new memfd; the old one closed
    finally:
        loader.close()
    assert transport.packed is None


class Shifted:
    def __init__(self) -> None:
        self.x = np.arange(40_000, dtype=np.int64)   # 320 KB: out of band
        self.shift = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.int64:
        return self.x[i] + self.shift


def test_a_new_generation_sees_the_dataset_as_the_parent_changed_it():
    """As under fork, and as torch's non-persistent workers: the dataset of epoch 2
    is the parent's at the start of epoch 2."""
    pytest.importorskip("torch")  # the torch face (the core suite runs without torch)

    import mploader.torch as mt

    ds = Shifted()
    loader = mt.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn",
                           persistent_workers=False)
    try:
        first = [b.tolist() for b in loader]
        ds.shift = 100
        second = [b.tolist() for b in loader]
    finally:
        loader.close()
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert second == [[100, 101, 102, 103], [104, 105, 106, 107]]


# ---- memory-mapped datasets ----------------------------------------------------------

ROW = 4096
ROWS = (2 << 30) // ROW        # a 2 GiB file, sparse: no disk, no memory until written


class Mapped:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        row = (i * 7919) % ROWS
        return np.array([row, int(self.arr[row, :].astype(np.int64).sum())], np.int64)


@pytest.mark.parametrize("how", ["np.load mmap_mode=r", "np.memmap"])
def test_a_memory_mapped_dataset_is_mapped_again_in_each_worker_not_copied(tmp_path, how):
    path = str(tmp_path / ("big.npy" if how.startswith("np.load") else "big.bin"))
    if how.startswith("np.load"):
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(ROWS, ROW))
        header = arr.offset
        del arr
    else:
        with open(path, "wb") as f:
            f.truncate(ROWS * ROW)
        header = 0
    expect = {}
    with open(path, "r+b") as f:     # a few marked rows, the rest a hole
        for i in range(0, 64, 5):
            row = (i * 7919) % ROWS
            f.seek(header + row * ROW)
            f.write(bytes([i % 251 + 1]) * ROW)
            expect[row] = (i % 251 + 1) * ROW
    arr = (np.load(path, mmap_mode="r") if how.startswith("np.load")
           else np.memmap(path, dtype=np.uint8, mode="r", shape=(ROWS, ROW)))
    assert os.stat(path).st_blocks * 512 < 64 << 20   # sparse: what a copy would not be
    # The transport itself first: a copy of the file would be a 2 GiB memfd.
    packed = _spec.pack(Mapped(arr))
    try:
        assert packed.nbytes < 1 << 20, packed.nbytes
    finally:
        packed.close()
    with mploader.DataLoader(Mapped(arr), batch_size=8, num_workers=2, start_method="spawn", seed=0) as loader:
        rows = np.concatenate([np.asarray(b) for b in loader])
        pids = loader._engine.worker_pids()
        uss = sum(psutil.Process(p).memory_full_info().uss for p in pids)
        maps = [open(f"/proc/{p}/maps").read() for p in pids]
    for row, total in rows.tolist():
        assert total == expect.get(row, 0), row
    assert all(os.path.realpath(path) in m for m in maps), "a worker does not map the file"
    # Two workers with NumPy loaded hold tens of MiB of their own; a copy would be 2 GiB each.
    assert uss < 256 << 20, f"workers' summed USS {uss / 2**20:.0f} MiB"


def test_a_memmap_view_keeps_its_offset_strides_mode_and_type(tmp_path):
    path = str(tmp_path / "a.bin")
    base = np.memmap(path, dtype=np.int32, mode="w+", shape=(300, 7), offset=4096 * 3 + 12)
    base[:] = np.arange(2100, dtype=np.int32).reshape(300, 7)
    base.flush()
    cases = {"whole": base, "slice": base[11:250:3, ::-1], "plain view": np.asarray(base)[5:, 2]}
    packed = _spec.pack(cases)
    try:
        assert packed.nbytes < _spec.OUT_OF_BAND_BYTES
        back = _spec.unpack(packed.fd)
    finally:
        packed.close()
    for name, arr in cases.items():
        assert type(back[name]) is type(arr), name
        np.testing.assert_array_equal(back[name], arr)
    assert back["whole"].mode == base.mode and back["whole"].filename == os.path.realpath(path)
    back["whole"][0, 0] = -5            # r+: the file is shared, as under fork
    base2 = np.memmap(path, dtype=np.int32, mode="r", shape=(300, 7), offset=4096 * 3 + 12)
    assert base2[0, 0] == -5


# ---- what the standard pickler refuses ------------------------------------------------

def test_arrays_bytes_and_tensors_travel_out_of_band_and_come_back_equal():
    torch = pytest.importorskip("torch")
    big = b"\x01\x02" * 50_000
    obj = {"a": np.arange(50_000, dtype=np.float32).reshape(-1, 10), "b": big, "ba": bytearray(big),
           "t": torch.arange(30_000, dtype=torch.int64).reshape(-1, 3)[::2], "small": np.ones(3),
           "same": big, "ro": np.arange(20_000, dtype=np.int64)}
    obj["ro"].flags.writeable = False
    packed = _spec.pack(obj)
    try:
        assert not packed.by_value
        assert len(packed.stream) < 4096        # the big things are out of band
        back = _spec.unpack(packed.fd)
    finally:
        packed.close()
    np.testing.assert_array_equal(back["a"], obj["a"])
    assert back["b"] == big and type(back["b"]) is bytes and back["same"] is back["b"]
    assert back["ba"] == bytearray(big) and type(back["ba"]) is bytearray
    assert torch.equal(back["t"], obj["t"]) and back["t"].stride() == obj["t"].stride()
    assert not back["ro"].flags.writeable and back["a"].flags.writeable
    back["a"][0, 0] = 99                      # private pages: the parent's array is not touched
    assert obj["a"][0, 0] == 0


def test_views_of_one_tensor_travel_as_one_storage_and_share_it_in_the_worker():
    """torch pickles each tensor with a storage object of its own: 64 row views of a
    1 MiB tensor were 64 copies of it (64 MiB); one storage, shared, as in the parent."""
    torch = pytest.importorskip("torch")
    big = torch.arange(1 << 18, dtype=torch.float32).reshape(64, -1)
    rows = [big[i] for i in range(64)]
    packed = _spec.pack(rows)
    try:
        assert packed.nbytes < 2 * big.nbytes, packed.nbytes
        back = _spec.unpack(packed.fd)
    finally:
        packed.close()
    assert all(torch.equal(a, b) for a, b in zip(back, rows))
    assert len({r.untyped_storage().data_ptr() for r in back}) == 1   # one storage, as in the parent


def test_lambdas_and_local_classes_go_by_value():
    class Local:
        def __init__(self) -> None:
            self.fn = lambda v: v * 3

    packed = _spec.pack([Local(), lambda: 5])
    try:
        assert packed.by_value
        back = _spec.unpack(packed.fd)
    finally:
        packed.close()
    assert back[0].fn(2) == 6 and back[1]() == 5


class Transform:
    def __init__(self) -> None:
        self.fn = threading.Lock()


class WithTransform:
    def __init__(self) -> None:
        self.transform = Transform()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("method", METHODS)
def test_what_cannot_be_pickled_at_all_is_named_by_its_attribute_path(method):
    loader = mploader.DataLoader(WithTransform(), batch_size=2, num_workers=2, start_method=method)
    try:
        with pytest.raises(pickle.PicklingError,
                           match=r"dataset\.transform\.fn = <unlocked _thread\.lock object .*> cannot be sent "
                                 r"to spawn/forkserver workers.*cannot pickle '_thread\.lock' object"):
            list(loader)
    finally:
        loader.close()


def test_the_memfd_is_closed_and_unmapped_by_close():
    packed = _spec.pack(np.zeros(100_000))
    fd = packed.fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:mploader-spec")
    packed.close()
    packed.close()   # idempotent
    assert packed.fd == -1 and packed.map is None
    assert not any(os.readlink(f"/proc/self/fd/{f}").startswith("/memfd:mploader-spec")
                   for f in map(int, os.listdir("/proc/self/fd")) if os.path.exists(f"/proc/self/fd/{f}"))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, (1 << 20) + 3, 3 * (1 << 20) + 13])
def test_the_chunked_compare_finds_any_changed_byte(n):
    """``_equal`` (the new generation's check that its buffers are the memfd's) against
    ``bytes ==``: a change at the first byte, the last, inside the 8-byte tail, at a
    chunk boundary."""
    a = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert _spec._equal(memoryview(a), memoryview(a.copy()))
    for pos in sorted({0, n - 1, n // 2, n - n % 8, 1 << 20} & set(range(n))):
        b = a.copy()
        b[pos] ^= 0x40
        assert _spec._equal(memoryview(a), memoryview(b)) == (a.tobytes() == b.tobytes()) is False, pos
