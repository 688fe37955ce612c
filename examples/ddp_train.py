"""DDP training on CPU (gloo) with one mploader loader per rank, checkpointed and
resumable on another number of ranks and workers.

    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py --dir run1 --num-workers 2
    # preempted?  resume, perhaps on one process with one worker:
    torchrun --standalone --nproc_per_node 1 examples/ddp_train.py --dir run1 --num-workers 1 --resume

Every rank iterates ``mploader.torch.DataLoader(batch_sampler=
mploader.DistributedBatchSampler(...))``: the global batch order depends only on
(seed, epoch) and each rank takes its share of every global batch.  Every
``--checkpoint-every`` steps rank 0 writes the model, the optimizer and *its
loader's* ``state_dict()`` (rank-independent: every rank of the resumed run loads
it, whatever the world size, as long as it divides ``--global-batch``).  Each rank
appends the sample indices of each step to ``DIR/log-*.jsonl`` so that coverage can
be checked (tests/test_ddp_example.py does: every sample of the epoch exactly once
across the killed and the resumed run).

Data: by default synthetic 32x32 RGB "photographs" (deterministic per index, label
``i % 4``), so the example runs anywhere in seconds; ``--raw IMAGES.npy LABELS.npy``
uses the benchmark's pre-decoded photographs instead (``mploader bench --format
raw`` writes them: (N, 256, 256, 3) uint8 and (N,) int64, memory-mapped).  The
augmentation (random 28x28 crop, random flip) draws from NumPy's global RNG in the
worker, which mploader seeds per batch from (seed, epoch, batch index).
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import mploader
from mploader.torch import DataLoader

CROP = 28


class Photos:
    """Map-style dataset: ``(image (3, CROP, CROP) float32, label int64, index int64)``."""

    def __init__(self, count: int, raw: list[str] | None = None) -> None:
        if raw:
            self.images = np.load(raw[0], mmap_mode="r")
            self.labels = np.load(raw[1], mmap_mode="r")
            self.count = min(count, len(self.images)) if count else len(self.images)
        else:
            self.images = None
            self.count = count

    def __len__(self) -> int:
        return self.count

    def _image(self, i: int) -> tuple[np.ndarray, int]:
        if self.images is None:
            rng = np.random.default_rng(i)
            return rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 4
        image = np.asarray(self.images[i][::8, ::8])   # 256 -> 32 pixels a side
        return image, int(self.labels[i]) % 4

    def __getitem__(self, i: int):
        image, label = self._image(i)
        y, x = np.random.randint(0, image.shape[0] - CROP + 1, size=2)
        crop = image[y:y + CROP, x:x + CROP]
        if np.random.rand() < 0.5:
            crop = crop[:, ::-1]
        chw = np.ascontiguousarray(crop.transpose(2, 0, 1), dtype=np.float32) / 255.0
        return chw, np.int64(label), np.int64(i)


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint and log directory")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--raw", nargs=2, metavar=("IMAGES_NPY", "LABELS_NPY"))
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=2, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from DIR/ckpt.pt when it exists")
    p.add_argument("--stop-after", type=int, default=0,
                   help="simulate preemption: SIGKILL this process right after the checkpoint of this step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    os.makedirs(args.dir, exist_ok=True)
    dataset = Photos(args.samples, args.raw)
    sampler = mploader.DistributedBatchSampler(len(dataset), args.global_batch, seed=args.seed)  # rank, world: dist's
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.num_workers, seed=args.seed)
    model = nn.parallel.DistributedDataParallel(small_cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.dir, "ckpt.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(json.loads(ckpt["loader"]))   # saved by rank 0, loaded by every rank
        step, epoch = ckpt["step"], json.loads(ckpt["loader"])["epoch"]
    log = open(os.path.join(args.dir, f"log-w{world}-r{rank}-pid{os.getpid()}.jsonl"), "a")
    loss_fn = nn.CrossEntropyLoss()
    while epoch < args.epochs:
        sampler.set_epoch(epoch)   # harmless after a resume: the loader's state keeps the position
        for images, labels, indices in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            step += 1
            log.write(json.dumps({"step": step, "epoch": epoch, "rank": rank, "world": world,
                                  "indices": indices.tolist(), "loss": round(loss.item(), 4)}) + "\n")
            log.flush()
            if step % args.checkpoint_every == 0 and rank == 0:
                tmp = ckpt_path + ".tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": json.dumps(loader.state_dict()), "step": step}, tmp)
                os.replace(tmp, ckpt_path)   # a kill never leaves half a checkpoint
            if args.stop_after and step == args.stop_after:
                dist.barrier()   # every rank has logged this step; rank 0's checkpoint is written
                os.kill(os.getpid(), signal.SIGKILL)
        epoch += 1
    log.close()
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
