"""mploader.torch.DataLoader against torch.utils.data.DataLoader itself (differential).

The same dataset, sampler, generator and options go through both loaders; the
batches (values, dtypes, types, nesting), the exceptions and the warnings must be
the same.  Datasets draw from ``random``, NumPy and torch inside ``__getitem__`` so
that worker seeding and task assignment are compared too.
"""
import collections
import gc
import inspect
import multiprocessing
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _torch_util import assert_same_batch, assert_same_outcome, outcome  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import Dataset, IterableDataset, get_worker_info  # noqa: E402

from mploader import _engine  # noqa: E402
from mploader.torch import DataLoader  # noqa: E402

NEW_ENGINE = "worker_init" in inspect.signature(_engine.Engine).parameters
needs_engine = pytest.mark.skipif(not NEW_ENGINE, reason="SKIPPED, NOT PASSED: the engine on this branch has no "
                                  "worker_init/pinned tasks yet (issue 8)")

Pair = collections.namedtuple("Pair", "left right")


class Augmented(Dataset):
    """Tensor rows of one big tensor (views), plus draws from every RNG."""

    def __init__(self, n=23):
        self.x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {
            "x": self.x[i],
            "aug": torch.rand(2),
            "np": np.random.rand(),
            "py": random.random(),
            "label": i,
            "name": f"s{i}",
            "worker": -1 if info is None else info.id,
            "pair": Pair(np.float32(i), (i, 0.5)),
        }


class Batched(Augmented):
    """A dataset with ``__getitems__`` (torch's fetcher uses it)."""

    def __getitems__(self, indices):
        return [(self.x[i] * 2, int(i)) for i in indices]


class Faulty(Augmented):
    def __getitem__(self, i):
        if i in (5, 11):
            raise ValueError(f"bad sample {i}")
        if i == 17:
            raise KeyError(f"missing {i}")
        return self.x[i]


class Stream(IterableDataset):
    """Each worker yields its own shard, of different lengths; samples carry RNG draws."""

    def __init__(self, n=29):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n + 3 * wid, nw):
            yield torch.full((2,), float(i)), torch.rand(1), wid


class SizedStream(Stream):
    def __len__(self):
        return 5


def both(dataset_factory, **kw):
    """(torch's outcome, ours) for the same arguments; generator and global RNGs equal."""
    results = []
    for cls in (TorchDataLoader, DataLoader):
        torch.manual_seed(1234)
        np.random.seed(7)
        random.seed(3)
        args = dict(kw)
        if "generator" in args:
            args["generator"] = torch.Generator().manual_seed(args["generator"])
        loader = cls(dataset_factory(), **args)
        with warnings.catch_warnings():
            # Holding every batch uses up the slots; the rest travel through the pipe.
            warnings.filterwarnings("ignore", "mploader: all .* slots are held", RuntimeWarning)
            epochs = [outcome(iter(loader)) for _ in range(2)]
        if cls is DataLoader:
            loader.close()
        results.append(epochs)
    return results


# ---------------------------------------------------------------------------
# Differential: batches
# ---------------------------------------------------------------------------

@needs_engine
@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("options", [
    dict(batch_size=4),
    dict(batch_size=5, shuffle=True, generator=11, drop_last=True),
    dict(batch_size=None),
    dict(batch_size=3, collate_fn=lambda b: (np.stack([s["x"].numpy() for s in b]), [s["aug"] for s in b])),
], ids=["plain", "shuffle-generator-droplast", "batch_size=None", "custom-collate"])
def test_map_style_batches_equal_torch(num_workers, options, no_leaks):
    theirs, ours = both(Augmented, num_workers=num_workers, **options)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)


@needs_engine
@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitems_and_batch_sampler_equal_torch(num_workers, no_leaks):
    sampler = [[3, 1], [0], [7, 8, 9], [2, 2]]
    theirs, ours = both(Batched, batch_sampler=sampler, num_workers=num_workers)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)


@needs_engine
@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("options", [dict(batch_size=4), dict(batch_size=4, drop_last=True),
                                     dict(batch_size=None)], ids=["batched", "drop_last", "unbatched"])
def test_iterable_dataset_batches_equal_torch(num_workers, options, no_leaks):
    theirs, ours = both(Stream, num_workers=num_workers, **options)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)


@needs_engine
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("dataset", [Augmented, Stream], ids=["map", "iterable"])
def test_in_order_false_gives_the_same_batches(num_workers, dataset, no_leaks):
    """Completion order: the same multiset of batches as torch (values without RNG draws)."""
    def key(batch):
        leaves = batch["x"] if isinstance(batch, dict) else batch[0]
        return tuple(leaves.flatten().tolist())
    theirs, ours = both(dataset, num_workers=num_workers, batch_size=3, in_order=False)
    for a, b in zip(ours, theirs):
        assert sorted(map(key, a)) == sorted(map(key, b))


@needs_engine
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("dataset", [Augmented, Stream], ids=["map", "iterable"])
def test_persistent_workers_and_epoch_seeds_equal_torch(persistent, dataset, no_leaks):
    """torch draws a base seed per iterator; persistent workers keep the first one and
    their RNG streams continue into the next epoch (IterableDataset replicas restart
    their iterators each epoch)."""
    theirs, ours = both(dataset, num_workers=2, batch_size=4, persistent_workers=persistent)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)
    if dataset is Augmented:
        assert not torch.equal(ours[0][0]["aug"], ours[1][0]["aug"])


class CountingDataset(Dataset):
    """Counts ``__getitem__`` calls per worker replica: shows whether the replica lives
    across epochs (persistent workers) or is new each epoch."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        self.calls += 1
        return self.calls


@needs_engine
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_replicas_live_as_long_as_torchs(persistent, no_leaks):
    theirs, ours = both(CountingDataset, num_workers=2, batch_size=2, persistent_workers=persistent)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)


def record_init(worker_id):
    info = get_worker_info()
    info.dataset.init_seen = (worker_id, info.id, info.num_workers, info.seed, torch.get_num_threads())


class InitDataset(Dataset):
    init_seen = None

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(self.init_seen)


@needs_engine
def test_worker_init_fn_and_worker_info_equal_torch(no_leaks):
    theirs, ours = both(InitDataset, num_workers=2, batch_size=1, worker_init_fn=record_init, generator=5)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)


# ---------------------------------------------------------------------------
# Differential: errors
# ---------------------------------------------------------------------------

@needs_engine
@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_exceptions_equal_torch(num_workers, no_leaks):
    """Same types and first lines ("Caught ValueError in DataLoader worker process 1."),
    and iteration goes on after each error, as torch's."""
    theirs, ours = both(Faulty, num_workers=num_workers, batch_size=3)
    for a, b in zip(ours, theirs):
        assert_same_outcome(a, b)


@needs_engine
def test_worker_exception_carries_torchs_message_and_the_indices(no_leaks):
    loader = DataLoader(Faulty(), batch_size=3, num_workers=1)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError) as info:
        next(it)
    text = str(info.value)
    assert text.startswith("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback "
                           "(most recent call last):\n")
    assert text.rstrip().endswith("ValueError: bad sample 5")
    assert info.value.__cause__.indices == [3, 4, 5]
    assert any("sample indices [3, 4, 5]" in n for n in info.value.__notes__)
    loader.close()


def failing_init(worker_id):
    raise OSError(f"cannot open shard {worker_id}")


@needs_engine
def test_worker_init_fn_exception_equals_torch(no_leaks):
    theirs, ours = both(InitDataset, num_workers=1, batch_size=1, worker_init_fn=failing_init)
    assert ours[0][0] == theirs[0][0]
    assert ours[0][0][:2] == ("raised", OSError)


# ---------------------------------------------------------------------------
# Argument checks, attributes, len, warnings: torch's own
# ---------------------------------------------------------------------------

class Plain(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i


BAD_ARGS = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(prefetch_factor=2),
    dict(num_workers=1, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(shuffle=True, sampler=[0, 1]),
    dict(batch_sampler=[[0]], batch_size=2),
    dict(batch_sampler=[[0]], shuffle=True),
    dict(batch_sampler=[[0]], drop_last=True),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=1, multiprocessing_context="nonsense"),
    dict(num_workers=1, multiprocessing_context=3),
    dict(multiprocessing_context="fork"),
]


@pytest.mark.parametrize("kw", BAD_ARGS, ids=[",".join(f"{k}={v}" for k, v in kw.items()) for kw in BAD_ARGS])
def test_argument_errors_equal_torch(kw):
    with pytest.raises(Exception) as theirs:
        TorchDataLoader(Plain(), **kw)
    with pytest.raises(Exception) as ours:
        DataLoader(Plain(), **kw)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])])
def test_iterable_dataset_argument_errors_equal_torch(kw):
    with pytest.raises(ValueError) as theirs:
        TorchDataLoader(Stream(), **kw)
    with pytest.raises(ValueError) as ours:
        DataLoader(Stream(), **kw)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kw", [dict(shared_mem=-1), dict(shared_mem=1.5), dict(copy=1), dict(seed="x")])
def test_mploader_argument_errors_name_the_argument(kw):
    with pytest.raises((TypeError, ValueError), match=next(iter(kw))):
        DataLoader(Plain(), **kw)


@pytest.mark.parametrize("attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                                  "persistent_workers"])
def test_attributes_cannot_be_reassigned_as_torch(attr):
    ours, theirs = DataLoader(Plain()), TorchDataLoader(Plain())
    with pytest.raises(ValueError) as a:
        setattr(ours, attr, None)
    with pytest.raises(ValueError) as b:
        setattr(theirs, attr, None)
    assert str(a.value) == str(b.value)  # both classes are named DataLoader
    ours.num_workers = 0  # others may be set, as torch


@pytest.mark.parametrize("dataset,kw", [(Plain, dict(batch_size=3)), (Plain, dict(batch_size=3, drop_last=True)),
                                        (Plain, dict(batch_size=None)), (SizedStream, dict(batch_size=2)),
                                        (SizedStream, dict(batch_size=2, drop_last=True))])
def test_len_equals_torch(dataset, kw):
    assert len(DataLoader(dataset(), **kw)) == len(TorchDataLoader(dataset(), **kw))


def test_len_of_unsized_iterable_raises_as_torch():
    with pytest.raises(TypeError) as a:
        len(DataLoader(Stream()))
    with pytest.raises(TypeError) as b:
        len(TorchDataLoader(Stream()))
    assert str(a.value) == str(b.value)


def test_is_a_torch_dataloader_and_generic():
    loader = DataLoader(Plain())
    assert isinstance(loader, TorchDataLoader)
    alias = DataLoader[tuple[torch.Tensor, torch.Tensor]]
    assert alias.__origin__ is DataLoader


@needs_engine
def test_a_loader_pickles_without_its_workers(no_leaks):
    import copy
    loader = DataLoader(Plain(), batch_size=5, num_workers=1, persistent_workers=True)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    clone = copy.deepcopy(loader)
    assert clone._mpl_engine is None and [b.tolist() for b in clone] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    clone.close()
    loader.close()


def _warnings_of(make):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make()
    return [str(x.message) for x in w]


def test_excessive_worker_warning_equals_torch():
    ours = _warnings_of(lambda: DataLoader(Plain(), num_workers=1000))
    theirs = _warnings_of(lambda: TorchDataLoader(Plain(), num_workers=1000))
    assert ours == theirs and "excessive worker creation" in ours[0]


@needs_engine
def test_length_mismatch_warning_equals_torch(no_leaks):
    def run(cls):
        loader = cls(SizedStream(n=29), batch_size=2, num_workers=1)
        len(loader)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            list(loader)
        if cls is DataLoader:
            loader.close()
        return sorted({str(x.message) for x in w if "Length of IterableDataset" in str(x.message)})
    ours, theirs = run(DataLoader), run(TorchDataLoader)
    assert ours and [s.split(" was reported")[1] for s in ours] == [s.split(" was reported")[1] for s in theirs]


@needs_engine
def test_timeout_message_equals_torch(no_leaks):
    loader = DataLoader(Sleepy(), batch_size=1, num_workers=1, timeout=0.3)
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 0\.3 seconds$"):
        next(iter(loader))
    loader.close()


class Sleepy(Dataset):
    """Never answers in time (simulates a hung storage read)."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        import time
        time.sleep(30)
        return i


@needs_engine
def test_pin_memory_without_accelerator(no_leaks):
    """Accepted; torch's warning at iter(), none during next(); tensors unpinned."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    loader = DataLoader(Augmented(), batch_size=4, num_workers=1, pin_memory=True)
    at_iter = _warnings_of(lambda: setattr(loader, "_it", iter(loader)))
    assert at_iter == _warnings_of(lambda: iter(TorchDataLoader(Augmented(), batch_size=4, num_workers=1,
                                                                pin_memory=True)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = next(loader._it)
    assert not batch["x"].is_pinned()
    del batch, loader._it
    loader.close()


# ---------------------------------------------------------------------------
# mploader: zero-copy, lifetime, per-batch seeding
# ---------------------------------------------------------------------------

@needs_engine
def test_tensors_are_views_of_the_slot_and_never_change(no_leaks):
    """Hold three epochs of tensors: each still equals the copy taken when it arrived,
    and it points into the engine's shared region.  (The rows are widened to 1 KiB so
    that a batch's ``x`` is not a small leaf, which comes out as a copy:
    ``test_torch_small_leaves.py``.)"""
    data = Augmented(n=40)
    data.x = data.x.repeat(1, 64)   # (40, 256) float32: a batch's x is 4 KiB
    loader = DataLoader(data, batch_size=4, num_workers=2, shuffle=True, persistent_workers=True)
    held, copies = [], []
    for _ in range(3):
        for batch in loader:
            held.append(batch["x"])
            copies.append(batch["x"].clone())
    region = loader._mpl_engine.region
    lo, hi = region.address, region.address + region.file_bytes
    assert lo <= held[0].data_ptr() < hi
    gc.collect()
    assert all(torch.equal(a, b) for a, b in zip(held, copies))
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(held, copies))


@needs_engine
def test_copy_true_gives_owned_tensors(no_leaks):
    loader = DataLoader(Augmented(), batch_size=4, num_workers=1, copy=True)
    batch = next(iter(loader))
    region = loader._mpl_engine.region
    assert not region.address <= batch["x"].data_ptr() < region.address + region.file_bytes
    loader.close()


@needs_engine
def test_per_batch_seed_gives_the_same_batches_for_any_num_workers(no_leaks):
    def run(num_workers):
        loader = DataLoader(Augmented(), batch_size=4, num_workers=num_workers, seed=99, shuffle=True,
                            generator=torch.Generator().manual_seed(1), copy=True)
        out = [list(loader) for _ in range(2)]
        loader.close()
        return out
    ref = run(0)
    assert not torch.equal(ref[0][0]["aug"], ref[1][0]["aug"])
    for nw in (1, 2):
        for a, b in zip(run(nw), ref):
            for x, y in zip(a, b):
                assert_same_batch({k: v for k, v in x.items() if k != "worker"},
                                  {k: v for k, v in y.items() if k != "worker"})


class WorkerZeroSlow(Dataset):
    """Sample ``i`` is ``[i, worker id]``; worker 0 takes ``slow_s`` per sample, worker 1 none."""

    def __init__(self, n=24, slow_s=0.1):
        self.n, self.slow_s = n, slow_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time
        info = get_worker_info()
        if info is not None and info.id == 0:
            time.sleep(self.slow_s)   # (a slow worker, not synchronisation: nothing waits on it)
        return torch.tensor([i, -1 if info is None else info.id])


@needs_engine
def test_seed_gives_each_task_to_the_least_loaded_worker_and_torchs_round_robin_otherwise(no_leaks):
    """docs/faces.md, "Tasks": without ``seed=`` batch ``i`` is built by the worker
    torch's own DataLoader gives it (``i % 2`` here), however slow that worker is; with
    ``seed=`` a batch does not depend on its worker, and the engine gives each task to
    the least-loaded one: with one worker taking 100 ms a sample and the other none,
    the assignment is no longer the round robin.  The batches' samples are the same
    either way."""
    def workers(cls, **kw):
        loader = cls(WorkerZeroSlow(), batch_size=1, num_workers=2, prefetch_factor=2, **kw)
        try:
            batches = list(loader)
        finally:
            getattr(loader, "close", lambda: None)()
        assert [int(b[0, 0]) for b in batches] == list(range(24))
        return [int(b[0, 1]) for b in batches]

    reference = workers(TorchDataLoader)
    assert reference == [i % 2 for i in range(24)]
    assert workers(DataLoader) == reference
    free = workers(DataLoader, seed=0)
    # Batches are consumed in order, so the parent refills one task per batch it takes;
    # the first refill (batch 4, after batch 0) finds worker 0 still on batch 2 and
    # worker 1 done, and goes to worker 1 (round robin: worker 0).  Observed: worker 1
    # builds 14 of the 24.
    assert free != reference
    assert sorted(set(free)) == [0, 1]


class Rows(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.arange(3) + i, "i": i, "get_worker_info": get_worker_info() is not None}


@pytest.fixture
def mp_helpers():
    """multiprocessing's resource tracker, forkserver and resource sharer (which passes
    the ring's fd to spawned workers) are per-process daemons that live until exit;
    start them before ``no_leaks`` takes its snapshot."""
    import multiprocessing.forkserver
    import multiprocessing.reduction
    import multiprocessing.resource_tracker
    import os
    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.forkserver.ensure_running()
    multiprocessing.reduction.DupFd(os.dup(0))  # starts the sharer's listener


@needs_engine
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork context object"])
def test_spawn_and_forkserver_workers(method, mp_helpers, no_leaks):
    """The dataset travels pickled (torch's rule); batches as torch's in-process ones
    apart from the worker flag.  (Spawned children import torch: ~2 s each.)"""
    import multiprocessing
    ref = list(TorchDataLoader(Rows(), batch_size=4))
    context = multiprocessing.get_context("fork") if method == "fork context object" else method
    loader = DataLoader(Rows(), batch_size=4, num_workers=1, multiprocessing_context=context)
    try:
        got = list(loader)
    finally:
        loader.close()
        # multiprocessing holds the last started Process (and, for forkserver, its
        # sentinel pipe) in multiprocessing.process._children until the next start or
        # active_children(); the engine should reap it at close (reported).
        multiprocessing.active_children()
    assert all(bool(b["get_worker_info"].all()) for b in got)
    for a, b in zip(got, ref):
        a.pop("get_worker_info"), b.pop("get_worker_info")
    assert_same_outcome(got, ref)


def test_import_mploader_works_without_torch():
    """Only mploader.torch imports torch: with torch unimportable, ``import mploader``
    and the numpy faces work, and ``import mploader.torch`` raises ImportError."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, mploader\n"
            "assert [b.shape for b in mploader.DataLoader(np.zeros((4, 2)), batch_size=2)] == [(2, 2)] * 2\n"
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])\n"
            "try:\n    import mploader.torch\nexcept ImportError:\n    print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


class Killer(Dataset):
    """Sample 6 kills its worker (a segfault in a decoder, the OOM killer ...), once
    ``armed`` (an event inherited by fork) is set."""

    def __init__(self, armed):
        self.armed = armed

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 6:
            import os
            import signal
            self.armed.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)
        return i


@needs_engine
def test_dead_worker_raises_naming_pid_signal_and_batch(no_leaks):
    import signal

    from mploader import WorkerError
    # The death waits for batch 1's delivery: a wait that notices a dead worker owing a
    # batch raises at once, as torch's SIGCHLD handler does, so a worker killed before
    # batch 1 was published (a loaded machine: CI, 2026-11-28) failed batch 1's next().
    armed = multiprocessing.get_context("fork").Event()
    loader = DataLoader(Killer(armed), batch_size=3, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2]
    assert next(it).tolist() == [3, 4, 5]
    armed.set()
    with pytest.raises(WorkerError) as info:
        next(it)
    assert isinstance(info.value, RuntimeError)
    assert info.value.signal == signal.SIGKILL and info.value.indices == [6, 7, 8]
    assert str(info.value.pid) in str(info.value) and "SIGKILL" in str(info.value)
    loader.close()


@needs_engine
@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_sampler_equals_torch(rank, no_leaks):
    from torch.utils.data import DistributedSampler
    out = []
    for cls in (TorchDataLoader, DataLoader):
        ds = Plain()
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = cls(ds, batch_size=2, sampler=sampler, num_workers=2)
        epochs = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            epochs.append([b.tolist() for b in loader])
        out.append(epochs)
        if cls is DataLoader:
            loader.close()
    assert out[0] == out[1]


class SlowWorkerZero(Dataset):
    """Worker 0's samples wait for ``go`` (a stalled disk), worker 1's do not."""

    def __init__(self):
        import multiprocessing
        self.go = multiprocessing.get_context("fork").Event()

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = get_worker_info()
        if info.id == 0:
            assert self.go.wait(60), "worker 0 was never let go"
        return torch.tensor([i, info.id])


@needs_engine
@pytest.mark.parametrize("in_order", [True, False])
def test_in_order_false_returns_batches_as_they_complete(in_order, no_leaks):
    """in_order=False: the fast worker's batches come first and it takes over the work
    (never more than prefetch_factor tasks held by one worker: worker 0 is let go once
    the other 6 arrived); in_order=True: sampler order, task 0 from worker 0 first."""
    dataset = SlowWorkerZero()
    if in_order:
        dataset.go.set()
    loader = DataLoader(dataset, batch_size=1, num_workers=2, prefetch_factor=2, in_order=in_order)
    got = []
    try:
        for b in loader:
            got.append(b[0].tolist())
            if len(got) == 8 - 2:
                dataset.go.set()
    finally:
        dataset.go.set()
        loader.close()
    assert sorted(i for i, _ in got) == list(range(8))
    if in_order:
        assert [i for i, _ in got] == list(range(8)) and [w for _, w in got] == [0, 1] * 4
    else:
        assert got[0][1] == 1
        assert sum(w == 1 for _, w in got) > sum(w == 0 for _, w in got)


# ---------------------------------------------------------------------------
# Deliberate differences from torch, each pinned here (docs/faces.md's table)
# ---------------------------------------------------------------------------

@needs_engine
def test_a_second_iterator_runs_beside_the_first(no_leaks):
    """As torch (issue 26): two non-persistent iterators of one loader run side by
    side, the second on workers of its own (tests/test_iterator_semantics.py)."""
    loader = DataLoader(Plain(), batch_size=2, num_workers=1)
    first = iter(loader)
    assert next(first).tolist() == [0, 1]
    second = iter(loader)
    assert [b.tolist() for b in second] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [b.tolist() for b in first] == [[2, 3], [4, 5], [6, 7], [8, 9]]
    loader.close()


def transposed_collate(batch):
    return torch.stack([s["x"] for s in batch]).t()  # a non-contiguous view of its own storage


@needs_engine
def test_custom_collate_tensors_come_back_contiguous(no_leaks):
    """torch pickles a custom collate_fn's tensor with its storage and strides; here
    only its elements travel, so a non-contiguous result arrives contiguous (same
    values, shape and dtype)."""
    ref = next(iter(TorchDataLoader(Augmented(), batch_size=3, num_workers=1, collate_fn=transposed_collate)))
    loader = DataLoader(Augmented(), batch_size=3, num_workers=1, collate_fn=transposed_collate)
    got = next(iter(loader))
    assert not ref.is_contiguous() and got.is_contiguous()
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.equal(got, ref)
    loader.close()


def test_prefetch_beyond_the_ring_is_refused():
    """torch accepts any prefetch_factor; the ring has at most MAX_SLOTS slots."""
    from mploader import _options
    with pytest.raises(ValueError, match=r"prefetch_factor \* num_workers must be at most"):
        DataLoader(Plain(), num_workers=2, prefetch_factor=_options.MAX_PREFETCH)
    TorchDataLoader(Plain(), num_workers=2, prefetch_factor=_options.MAX_PREFETCH)


@needs_engine
def test_worker_init_fn_failure_fails_every_batch_of_that_worker(no_leaks):
    """torch reports the worker_init_fn error for that worker's first batch and then
    UnboundLocalError for each later one; here every batch of it repeats the error."""
    loader = DataLoader(InitDataset(), batch_size=1, num_workers=1, worker_init_fn=failing_init)
    got = outcome(iter(loader))
    assert got == [("raised", OSError, "Caught OSError in DataLoader worker process 0.")] * 4
    loader.close()


class RangeStream(IterableDataset):
    """torch's documentation example: each worker narrows ``[start, end)`` to its share
    in ``worker_init_fn`` through ``get_worker_info().dataset``."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def shard_range(worker_id):
    import math
    info = get_worker_info()
    ds = info.dataset
    per_worker = int(math.ceil((ds.end - ds.start) / float(info.num_workers)))
    start = ds.start + worker_id * per_worker
    ds.start, ds.end = start, min(start + per_worker, ds.end)


@needs_engine
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_info_dataset_is_the_workers_replica(method, mp_helpers, no_leaks):
    """get_worker_info().dataset is the very object the worker iterates, also when the
    dataset travels pickled (spawn): torch's sharding recipe gives torch's batches."""
    import multiprocessing
    ref = [b.tolist() for b in TorchDataLoader(RangeStream(3, 17), batch_size=3, num_workers=2,
                                               worker_init_fn=shard_range)]
    loader = DataLoader(RangeStream(3, 17), batch_size=3, num_workers=2, worker_init_fn=shard_range,
                        multiprocessing_context=method)
    try:
        got = [b.tolist() for b in loader]
    finally:
        loader.close()
        multiprocessing.active_children()
    assert got == ref == [[3, 4, 5], [10, 11, 12], [6, 7, 8], [13, 14, 15], [9], [16]]


@needs_engine
@pytest.mark.parametrize("persistent", [False, True])
def test_dropping_the_loader_stops_its_workers(persistent, no_leaks):
    """No close(): when the loader and its iterator go away, so do the workers and the
    shared memory (tensors still held stay valid)."""
    loader = DataLoader(Plain(), batch_size=2, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    kept = next(it)
    pids = loader._mpl_engine.worker_pids()
    assert len(pids) == 2
    del it, loader
    gc.collect()
    assert kept.tolist() == [0, 1]
    del kept


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister (no GPU needed)."""

    def __init__(self):
        self.calls = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class GrowingRows(Dataset):
    """Sample i has 64 * (1 + i) floats: later batches need bigger slots."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((64 * (1 + i),), float(i))


@needs_engine
def test_pin_memory_with_cuda_registers_the_region_before_batches_arrive(monkeypatch, no_leaks):
    """With CUDA (faked here: no GPU on the test machine) the ring's region is
    page-locked as it grows, so every returned tensor lies in registered memory; no
    per-batch copy into pinned memory; close() unregisters every range."""
    import contextlib

    from mploader import _pinning
    fake = FakeCudart()
    monkeypatch.setattr(_pinning, "cuda_runtime", lambda device_id: (fake, contextlib.nullcontext))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.utils.data._utils.pin_memory, "pin_memory",
                        lambda *a, **k: pytest.fail("a batch was copied into pinned memory"))
    loader = DataLoader(GrowingRows(), batch_size=1, num_workers=2, pin_memory=True)
    try:
        for batch in loader:
            region = loader._mpl_engine.region
            registered = sum(c[2] for c in fake.calls if c[0] == "register")
            start = batch.data_ptr()
            assert region.address <= start and start + batch.nbytes <= region.address + registered
            del batch
        starts = [c[1] for c in fake.calls if c[0] == "register"]
        assert len(starts) >= 2 and starts[0] == region.address
    finally:
        loader.close()
    assert [c[1] for c in fake.calls if c[0] == "unregister"] == starts


@needs_engine
@pytest.mark.parametrize("num_workers", [0, 2])
def test_profiler_sees_one_next_span_per_batch_as_with_torch(num_workers):
    """The face skips torch's per-batch record_function span while no profiler is on
    (docs/faces.md); under torch.profiler it opens it as torch does: one
    ``enumerate(DataLoader)#<iterator class>.__next__`` event per batch."""
    ds = Augmented(12)

    def spans(loader_cls):
        loader = loader_cls(ds, batch_size=4, num_workers=num_workers)
        it = iter(loader)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            n = sum(1 for _ in it)
        names = [e.name for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
        if hasattr(loader, "close"):
            loader.close()
        return n, [name.split("#")[1].split(".")[1] for name in names]

    ours, theirs = spans(DataLoader), spans(TorchDataLoader)
    # 3 batches; the call that raises StopIteration may or may not leave a 4th span
    # (torch's own loader shows both in one process), so it is not compared
    assert ours[0] == theirs[0] == 3
    assert ours[1][:3] == theirs[1][:3] == ["__next__"] * 3 and len(ours[1]) <= 4 and len(theirs[1]) <= 4
