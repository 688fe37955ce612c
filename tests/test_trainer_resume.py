"""Mid-epoch checkpoint and resume through a trainer (issue 22): Lightning ``fit`` with
``strategy="ddp"`` on 2 CPU processes (gloo), ``mploader.torch.DataLoader`` with
``shuffle=True`` and workers, stopped mid-epoch after a checkpoint, then resumed from
it.  Every batch each rank sees after the resume -- the rest of the interrupted epoch
and the epochs after it, random augmentations included -- must be the uninterrupted
run's.

References: the uninterrupted run of the same script; the order of the
``DistributedSampler`` Lightning injects, computed here; and torchdata's
``StatefulDataLoader`` resumed through the same trainer, where it resumes the order
(an interruption in the first epoch: later in the run it resumes with epoch 0's order,
and its augmentations after a resume are not the uninterrupted run's, so only its
batch indices are compared; it runs without workers, which do not change the indices
it resumes).

Lightning 2.6 keeps no RNG state in its checkpoints; with torch's seeding each
epoch's base seed is drawn from torch's global RNG, as in torch, so the module saves
and restores it with the checkpoint (HF's ``Trainer`` does the same).  With ``seed=``
the batches do not depend on it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("torchdata")

from torch.utils.data import DistributedSampler  # noqa: E402

import mploader.torch as mpt  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ITEMS, BATCH, EPOCHS, RANKS = 48, 3, 3, 2
PER_EPOCH = ITEMS // RANKS // BATCH   # batches per rank and epoch: 8
STOPS = (3, 11)                        # global steps of the checkpoints: mid epoch 0, mid epoch 1

SCRIPT = textwrap.dedent('''
    import faulthandler, glob, json, sys
    faulthandler.dump_traceback_later(500)   # a hang prints every thread's stack before the test's timeout (540 s)
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Items(torch.utils.data.Dataset):
        def __len__(self): return 48
        def __getitem__(self, i):   # one draw from the worker's RNG: an augmentation
            return torch.full((2,), float(i)), i, torch.randint(0, 2 ** 30, ())

    def make_loader(kind, seed, persistent, rank):
        if kind == "torchdata":
            # Given shuffle=True, torchdata's own RandomSampler is wrapped by Lightning
            # (DistributedSamplerWrapper), which does not resume: it gets the sampler
            # that Lightning injects into ours.
            from torch.utils.data import DistributedSampler
            from torchdata.stateful_dataloader import StatefulDataLoader
            # No workers: the batch indices torchdata resumes come from its sampler's
            # state, which its workers do not change; its workers would have to be
            # forkserver ones (a worker forked from this rank, beside gloo's threads, once
            # deadlocked in CPython's after-fork clean-up: CI, 2026-11-26), and each of
            # those imports this script, Lightning with it: 74 of the test's 95 s.
            return StatefulDataLoader(Items(), batch_size=3, num_workers=0,
                                      sampler=DistributedSampler(Items(), 2, rank, shuffle=True, seed=0))
        from mploader.torch import DataLoader
        return DataLoader(Items(), batch_size=3, shuffle=True, num_workers=2, seed=seed,
                          persistent_workers=persistent)

    class Module(L.LightningModule):
        def __init__(self, kind, seed, persistent):
            super().__init__()
            self.kind, self.mpl_seed, self.persistent = kind, seed, persistent
            self.lin = torch.nn.Linear(2, 1)
            self.seen = []
        def train_dataloader(self):
            return make_loader(self.kind, self.mpl_seed, self.persistent, self.global_rank)
        def training_step(self, batch, i):
            x, y, aug = batch
            self.seen.append([self.current_epoch, i, y.tolist(), aug.tolist()])
            return self.lin(x).sum()
        def on_save_checkpoint(self, checkpoint):   # the trainer's RNG checkpoint (see the test's docstring)
            checkpoint["torch_rng"] = torch.get_rng_state()
        def on_load_checkpoint(self, checkpoint):
            torch.set_rng_state(checkpoint["torch_rng"])
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.1)

    def fit(tag, kind, seed, persistent, stop=None, resume=None):
        L.seed_everything(0, verbose=False)
        callbacks = [] if stop is None else [ModelCheckpoint(dirpath="ckpt-" + tag, every_n_train_steps=stop,
                                                             save_top_k=-1, filename="stop")]
        trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=3, logger=False,
                            max_steps=-1 if stop is None else stop, callbacks=callbacks,
                            enable_checkpointing=stop is not None, enable_progress_bar=False,
                            enable_model_summary=False)
        module = Module(kind, seed, persistent)
        trainer.fit(module, ckpt_path=None if resume is None else "ckpt-" + resume + "/stop.ckpt")
        loader = trainer.train_dataloader
        result = {"seen": module.seen, "cls": type(loader).__module__,
                  "slot": loader.stats()["slot"] if hasattr(loader, "stats") else None,
                  "ckpts": sorted(glob.glob("ckpt-" + tag + "/*"))}
        with open(f"result-{tag}-{trainer.global_rank}.json", "w") as f:   # one file per rank
            json.dump(result, f)

    if __name__ == "__main__":
        seed, persistent = None if sys.argv[1] == "none" else int(sys.argv[1]), sys.argv[2] == "persistent"
        fit("full", "mploader", seed, persistent)
        for stop in (3, 11):
            fit(f"head{stop}", "mploader", seed, persistent, stop=stop)
            fit(f"tail{stop}", "mploader", seed, persistent, resume=f"head{stop}")
        if seed is None:
            fit("torchdata-head3", "torchdata", None, persistent, stop=3)
            fit("torchdata-tail3", "torchdata", None, persistent, resume="torchdata-head3")
''')


def run_script(tmp_path, seed, persistent) -> dict:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    args = ["none" if seed is None else str(seed), "persistent" if persistent else "restarted"]
    try:
        p = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=540, env=env)
    except subprocess.TimeoutExpired as exc:   # (one hang seen in CI, 2026-11-26: say where it stood)
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise AssertionError(f"the training script did not end within 540 s; its stderr ends:\n{err[-6000:]}") from None
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out: dict = {}
    for f in tmp_path.glob("result-*.json"):
        tag, rank = f.stem[len("result-"):].rsplit("-", 1)
        out.setdefault(tag, {})[int(rank)] = json.loads(f.read_text())
    return out


def sampler_order(rank: int) -> list:
    """[epoch, batch index, sample indices] of every batch rank ``rank`` gets from the
    ``DistributedSampler`` that Lightning injects (seed 0, ``set_epoch`` every epoch)."""
    sampler = DistributedSampler(range(ITEMS), num_replicas=RANKS, rank=rank, shuffle=True, seed=0)
    batches = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches += [[epoch, b, order[b * BATCH:(b + 1) * BATCH]] for b in range(PER_EPOCH)]
    return batches


def ids(seen: list) -> list:
    return [s[:3] for s in seen]


@pytest.mark.parametrize("seed,persistent", [(None, False), (5, True)],
                         ids=["torch's seeding, workers restarted every epoch", "seed=, persistent workers"])
def test_lightning_ddp_mid_epoch_resume_gives_the_uninterrupted_batches(tmp_path, seed, persistent):
    runs = run_script(tmp_path, seed, persistent)
    for rank in range(RANKS):
        full = runs["full"][rank]
        assert full["cls"] == "mploader.torch"
        assert ids(full["seen"]) == sampler_order(rank)
        # Every batch through the ring.  Without persistent workers, Lightning ends each
        # epoch after len(loader) batches without the final StopIteration, and the next
        # epoch's iter() runs on workers of its own (see the xfail test below), which
        # stats() does not count.
        if persistent:
            assert full["slot"] == EPOCHS * PER_EPOCH
        for stop in STOPS:
            head, tail = runs[f"head{stop}"][rank], runs[f"tail{stop}"][rank]
            assert head["ckpts"] == [f"ckpt-head{stop}/stop.ckpt"]
            assert head["seen"] == full["seen"][:stop]
            # the rest of the interrupted epoch and the later epochs, augmentations included
            assert tail["seen"] == full["seen"][stop:], (rank, stop)
            if persistent:
                assert tail["slot"] == len(tail["seen"])
        if seed is None:   # torchdata resumes the same batch indices (its augmentations differ)
            head, tail = runs["torchdata-head3"][rank], runs["torchdata-tail3"][rank]
            assert head["cls"] == "torchdata.stateful_dataloader.stateful_dataloader"
            assert ids(head["seen"]) == ids(full["seen"][:3])
            assert ids(tail["seen"]) == ids(full["seen"][3:])


class Draws(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return i, torch.randint(0, 2 ** 30, ()).item()   # one draw from the worker's RNG


def test_resumed_iterator_leaves_torchs_global_rng_as_the_uninterrupted_run(no_leaks):
    """A trainer that restores torch's global RNG with the loader's state (HF's Trainer)
    gets the later epochs' augmentations of the uninterrupted run with any sampler.
    Before, only a ``RandomSampler`` did: with another sampler (the ``DistributedSampler``
    of ``ddp``, a ``SequentialSampler``) the resumed ``iter()`` drew one base seed more
    from the global RNG, so every later epoch's workers were seeded differently."""
    def make():
        return mpt.DataLoader(Draws(), batch_size=2, num_workers=2)

    def batches(loader):
        return [[t.tolist() for t in b] for b in loader]
    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    state, rng = loader.state_dict(), torch.get_rng_state()
    expected = [[t.tolist() for t in b] for b in it] + batches(loader) + batches(loader)
    del it
    loader.close()
    torch.manual_seed(1)   # another process
    loader = make()
    loader.load_state_dict(json.loads(json.dumps(state)))
    torch.set_rng_state(rng)   # the trainer's RNG restore
    got = batches(loader) + batches(loader) + batches(loader)
    loader.close()
    assert len(head) == 2 and len(expected) == 4 + 6 + 6
    assert got == expected


def test_an_epoch_read_to_its_length_leaves_the_workers_to_the_next_epoch(no_leaks):
    """Lightning's fetcher takes ``len(loader)`` batches and never asks for the
    StopIteration; the old iterator is dropped only after the next ``iter()``.  That
    run is still busy, so every other epoch of a non-persistent loader starts workers
    of its own (torch's rule for two live iterators) and ``stats()`` misses it.
    Wanted: the next ``iter()`` ends the old run (its ``next()`` raises StopIteration,
    as torch's exhausted iterator does) and takes its workers."""
    loader = mpt.DataLoader(Draws(), batch_size=3, num_workers=2)
    with loader:
        old = None
        for _ in range(3):
            it = iter(loader)
            if old is not None:
                with pytest.raises(StopIteration):
                    next(old)
            got = [next(it)[0].tolist() for _ in range(len(loader))]
            assert got == [[i, i + 1, i + 2] for i in range(0, 12, 3)]
            old = it
        assert loader.stats()["slot"] == 3 * len(loader)
        with pytest.raises(StopIteration):
            next(old)


def test_an_iterator_left_mid_epoch_is_still_superseded(no_leaks):
    """Only a run whose every batch was taken ends quietly: one left with batches to
    come is superseded by the next ``iter()`` (torch: two live iterators), as before."""
    loader = mpt.DataLoader(Draws(), batch_size=3, num_workers=2)
    with loader:
        it = iter(loader)
        next(it)
        again = iter(loader)
        assert [b[0].tolist() for b in again] == [[i, i + 1, i + 2] for i in range(0, 12, 3)]
        assert [b[0].tolist() for b in it] == [[i, i + 1, i + 2] for i in range(3, 12, 3)]
