"""Workers forked while another thread of the parent runs torch ops: how often they hang.

Usage: ``python bench/fork_torch_ops.py [--loader mploader|mploader.torch|torch]
[--busy fresh|mm|sum|none] [--train-step] [--sample small|large] [--trials 30]
[--epochs 30] [--start-method fork]``

Each trial is its own process (hard limit ``--limit`` s): a thread runs torch ops in
a loop while the main thread makes ``--epochs`` loaders in turn (2 workers, no
persistent workers, so 2 forks per epoch), each over 16 samples whose
``__getitem__`` is ``torch.ones(64, 64) @ torch.ones(64, 64)`` (``--sample large``:
512x512, which makes MKL allocate), with ``timeout=10``.  ``--train-step``: before
each epoch the main thread runs a "training step" (a parallel fill and sum, a 512x512
matmul), as a training loop does.  A trial "hangs" when a batch times out or the
process overruns its limit.

``--busy``: ``fresh`` -- each op on a new thread (its first MKL call: MKL registers
the thread in its memory manager), ``mm`` -- ``torch.mm`` of 512x512 on one thread,
``sum`` -- ``x.sum()`` over 4M floats on one thread (OpenMP, no MKL), ``none``.
docs/design.md ("Faults") quotes the hang rates.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRIAL = r"""
import os, sys, threading
import torch
loader, busy, epochs, method, n, train = sys.argv[1:7]
epochs, n = int(epochs), int(n)

class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return (torch.ones(n, n) @ torch.ones(n, n))[0, :4] + i

stop = threading.Event()
def one_thread():
    a, big = torch.ones(512, 512), torch.ones(4_000_000)
    while not stop.is_set():
        torch.mm(a, a) if busy == "mm" else big.sum()
def fresh_threads():
    a = torch.ones(512, 512)
    while not stop.is_set():
        t = threading.Thread(target=torch.mm, args=(a, a)); t.start(); t.join()
if busy != "none":
    t = threading.Thread(target=fresh_threads if busy == "fresh" else one_thread, daemon=True)
    t.start()

if loader == "torch":
    from torch.utils.data import DataLoader
    make = lambda: DataLoader(DS(), batch_size=4, num_workers=2, timeout=10, multiprocessing_context=method)
elif loader == "mploader.torch":
    import mploader.torch
    make = lambda: mploader.torch.DataLoader(DS(), batch_size=4, num_workers=2, timeout=10,
                                             multiprocessing_context=method)
else:
    import mploader
    assert method == "fork", "mploader.DataLoader forks; use --loader mploader.torch for another start method"
    make = lambda: mploader.DataLoader(DS(), batch_size=4, num_workers=2, timeout=10)
w = torch.rand(512, 512)
for e in range(epochs):
    if train == "1":
        torch.ones(512, 512).sum()
        w @ w
    dl = make()
    assert sum(1 for _ in dl) == 4
    if hasattr(dl, "close"):
        dl.close()
    del dl
stop.set()
if busy != "none":
    t.join()
print("OK")
"""


def trial(args: argparse.Namespace) -> tuple[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", TRIAL, args.loader, args.busy, str(args.epochs),
                             args.start_method, "512" if args.sample == "large" else "64",
                             "1" if args.train_step else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return "hang (limit)", time.monotonic() - t0
    finally:
        try:
            os.killpg(proc.pid, 9)  # workers a torch DataLoader left behind
        except ProcessLookupError:
            pass
    dt = time.monotonic() - t0
    if proc.returncode == 0 and out.strip().endswith("OK"):
        return "ok", dt
    if "took more than" in err or "timed out" in err:
        return "hang (batch timeout)", dt
    return f"error rc={proc.returncode}: {err.strip().splitlines()[-1:]}", dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loader", default="mploader", choices=["mploader", "mploader.torch", "torch"])
    p.add_argument("--busy", default="fresh", choices=["fresh", "mm", "sum", "none"])
    p.add_argument("--train-step", action="store_true", help="the main thread runs parallel ops each epoch")
    p.add_argument("--sample", default="small", choices=["small", "large"])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--start-method", default="fork")
    p.add_argument("--limit", type=float, default=120.0, help="hard limit per trial, seconds")
    args = p.parse_args()
    counts: dict[str, int] = {}
    for i in range(args.trials):
        what, dt = trial(args)
        counts[what] = counts.get(what, 0) + 1
        print(f"trial {i}: {what} ({dt:.1f} s)", flush=True)
    hangs = sum(n for w, n in counts.items() if w.startswith("hang"))
    print(f"{args.loader} busy={args.busy} train_step={args.train_step} sample={args.sample} "
          f"start_method={args.start_method} epochs={args.epochs} MKL_DISABLE_FAST_MM="
          f"{os.environ.get('MKL_DISABLE_FAST_MM', '')}: "
          f"{hangs}/{args.trials} trials hung; {counts}")


if __name__ == "__main__":
    main()
