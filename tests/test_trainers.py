"""The trainers that rebuild a user's loader: Lightning re-instantiates
``mploader.torch.DataLoader`` (DistributedSampler injection under ``ddp``,
``overfit_batches``), Accelerate's ``prepare`` builds a torch loader from its
attributes.  Every mploader argument must survive, and the batches must come through
the ring (``stats()['slot']``), not only have the right values.

References: the samplers Lightning injects (their own order, read back in the rank
process) and Accelerate's own ``prepare`` of a torch ``DataLoader`` in the same
configuration.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

import mploader.torch as mpt  # noqa: E402
from mploader.integrations import accelerate as mpl_accelerate  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.full((3,), float(i * i)), i


def accelerator(stateful: bool, split: bool) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful,
                                                                           split_batches=split))


def batches(loader) -> list:
    torch.manual_seed(0)
    return [(x.tolist(), y.tolist()) for x, y in loader]


@pytest.mark.parametrize("skip", [0, 3])
@pytest.mark.parametrize("split", [False, True], ids=["per-process batches", "split_batches"])
@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "use_stateful_dataloader"])
def test_accelerate_prepare_keeps_the_ring_and_torchs_batches(stateful, split, skip, no_leaks):
    acc = accelerator(False, split)
    reference = acc.prepare(torch.utils.data.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2,
                                                        generator=torch.Generator().manual_seed(3)))
    if skip:
        reference = acc.skip_first_batches(reference, skip)
    want = batches(reference)

    acc = accelerator(stateful, split)
    loader = mpt.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2, seed=None, copy=True,
                            generator=torch.Generator().manual_seed(3))
    prepared = mpl_accelerate.prepare(acc, loader)
    if skip:
        prepared = mpl_accelerate.skip_first_batches(acc, prepared, skip)
    ring = prepared.base_dataloader
    with ring:
        got = batches(prepared)
        assert isinstance(ring, mpt.DataLoader) and ring.copy is True
        assert got == want and len(got) == 13 - skip
        assert ring.stats()["slot"] == 13 - skip  # every batch came through a slot


def test_accelerate_stateful_loader_resumes_mid_epoch_on_the_ring(no_leaks):
    def prepared_loader():
        acc = accelerator(True, False)
        return mpl_accelerate.prepare(acc, mpt.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2,
                                                          generator=torch.Generator().manual_seed(5)))

    first = prepared_loader()
    with first.base_dataloader:
        want = [y.tolist() for _, y in first]
    interrupted = prepared_loader()
    with interrupted.base_dataloader:
        head = []
        for _, y in interrupted:
            head.append(y.tolist())
            if len(head) == 5:
                break
        state = interrupted.state_dict()
    assert head == want[:5] and state["batches_consumed"] == 5
    resumed = prepared_loader()
    with resumed.base_dataloader as ring:
        resumed.load_state_dict(state)
        tail = [y.tolist() for _, y in resumed]
        assert ring.stats()["slot"] == len(tail)
    assert head + tail == want


def test_accelerate_prepare_passes_other_objects_through(no_leaks):
    acc = accelerator(False, False)
    model = torch.nn.Linear(3, 1)
    loader = mpt.DataLoader(Squares(), batch_size=5, num_workers=1, seed=11)
    model2, prepared = mpl_accelerate.prepare(acc, model, loader)
    assert isinstance(model2, torch.nn.Module)
    with prepared.base_dataloader as ring:
        assert ring.seed == 11
        assert [y.tolist() for _, y in prepared] == [list(range(i, i + 5)) for i in range(0, 50, 5)]


LIGHTNING_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import lightning as L

    class Squares(torch.utils.data.Dataset):
        def __len__(self): return 48
        def __getitem__(self, i): return torch.full((3,), float(i)), i

    def make_loader():
        from mploader.torch import DataLoader   # first imported here: inside Lightning's hook
        return DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2, seed=7, copy=True)

    class Module(L.LightningModule):
        def __init__(self, loader=None):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.loader = loader
            self.seen = []
        def train_dataloader(self):
            return make_loader()
        def training_step(self, batch, i):
            x, y = batch
            self.seen.extend(y.tolist())
            return self.lin(x).sum()
        def on_train_epoch_end(self):
            dl = self.trainer.train_dataloader
            sampler = dl.sampler
            order = [int(i) for i in sampler]
            # one file per rank: the ranks' stdout lines can interleave
            with open(f"result-{TAG}-{self.global_rank}.json", "w") as f:
                json.dump({"rank": self.global_rank, "cls": type(dl).__module__, "seed": dl.seed, "copy": dl.copy,
                           "slot": dl.stats()["slot"], "seen": self.seen, "sampler": type(sampler).__name__,
                           "order": order}, f)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.1)

    if __name__ == "__main__":
        common = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
        # "ddp": both DDP modes, one launch of the ranks; "inside" first, so that
        # mploader.torch is first imported inside the hook
        for TAG in (["inside", "instance"] if sys.argv[1] == "ddp" else [sys.argv[1]]):
            if TAG == "overfit":
                trainer = L.Trainer(devices=1, overfit_batches=3, **common)
            else:
                trainer = L.Trainer(strategy="ddp", devices=2, **common)
            if TAG == "instance":   # a loader built outside the hooks
                trainer.fit(Module(), train_dataloaders=make_loader())
            else:
                trainer.fit(Module())
''')


def run_lightning(tmp_path, mode: str) -> dict[str, list[dict]]:
    """The script's results by mode (``ddp``: both DDP modes), each a list by rank."""
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), mode], cwd=tmp_path, capture_output=True, text=True,
                       timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out: dict[str, list[dict]] = {}
    for f in sorted(tmp_path.glob("result-*.json")):
        out.setdefault(f.stem.split("-")[1], []).append(json.loads(f.read_text()))
    return out


@pytest.fixture(scope="module")
def lightning_ddp(tmp_path_factory) -> dict[str, list[dict]]:
    """Both DDP modes from one run of the script (one launch of the two ranks: a
    Lightning launch costs ~10 s here)."""
    return run_lightning(tmp_path_factory.mktemp("lightning_ddp"), "ddp")


@pytest.mark.parametrize("mode", ["inside", "instance"], ids=["loader class imported in the hook",
                                                             "loader built outside the hooks"])
def test_lightning_ddp_keeps_every_argument_on_every_rank(lightning_ddp, mode):
    """Lightning injects a DistributedSampler by re-instantiating the loader; before,
    the first mode failed ("more than one `__init__` argument can be passed to its
    parent's `sampler=...`") and the second dropped seed/copy/shared_mem."""
    results = lightning_ddp[mode]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["cls"], r["seed"], r["copy"], r["sampler"]) == ("mploader.torch", 7, True, "DistributedSampler")
        assert r["seen"] == r["order"] and len(r["seen"]) == 24
        assert r["slot"] == 6   # every batch of the epoch through the ring
    assert sorted(results[0]["seen"] + results[1]["seen"]) == list(range(48))


def test_lightning_overfit_batches_keeps_the_ring(tmp_path):
    (r,) = run_lightning(tmp_path, "overfit")["overfit"]
    assert (r["cls"], r["seed"], r["copy"], r["sampler"]) == ("mploader.torch", 7, True, "SequentialSampler")
    assert r["seen"] == list(range(12)) and r["slot"] == 3
