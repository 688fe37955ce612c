"""examples/ddp_train.py under torchrun (issue 11): two ranks with two workers each
are killed (SIGKILL) right after the checkpoint of step 4; one rank with one worker
resumes from it.  The sample indices the runs logged must cover the epoch exactly
once, in the global batch order of ``DistributedBatchSampler`` (the reference:
``global_order``, a function of (seed, epoch) only)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

import mploader

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.usefixtures("no_leaks")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES, GLOBAL, STOP = 64, 8, 4


def torchrun(nproc, *args, timeout_s=120):
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not installed")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [exe, "--standalone", f"--nproc_per_node={nproc}", os.path.join(REPO, "examples", "ddp_train.py"),
           "--samples", str(SAMPLES), "--global-batch", str(GLOBAL), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, out


def read_logs(directory, world):
    rows = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(f"log-w{world}-"):
            with open(os.path.join(directory, name)) as f:
                rows.extend(json.loads(line) for line in f)
    return rows


def test_killed_two_rank_run_resumes_on_one_rank(tmp_path):
    d = str(tmp_path)
    rc, out = torchrun(2, "--dir", d, "--num-workers", "2", "--stop-after", str(STOP))
    assert rc != 0, out   # both ranks were SIGKILLed
    import torch
    ckpt_step = torch.load(os.path.join(d, "ckpt.pt"), weights_only=False)["step"]
    assert ckpt_step == STOP
    rc, out = torchrun(1, "--dir", d, "--num-workers", "1", "--resume")
    assert rc == 0, out
    before = [r for r in read_logs(d, 2) if r["step"] <= ckpt_step]
    after = read_logs(d, 1)
    steps = {}
    for r in before:   # a global batch = the ranks' shares, in rank order
        steps.setdefault(r["step"], {})[r["rank"]] = r["indices"]
    global_batches = [steps[s][0] + steps[s][1] for s in sorted(steps)]
    global_batches += [r["indices"] for r in sorted(after, key=lambda r: r["step"])]
    order = mploader.DistributedBatchSampler(SAMPLES, GLOBAL, seed=0, rank=0, world_size=1).global_order(0)
    assert global_batches == [order[i:i + GLOBAL].tolist() for i in range(0, SAMPLES, GLOBAL)]
    flat = sum(global_batches, [])
    assert sorted(flat) == list(range(SAMPLES))   # every sample of the epoch exactly once
