"""A loader used inside a worker (issue 25, section 4): a dataset whose ``__getitem__``
iterates a loader of its own with worker processes.  Each case runs in its own child
process with a hard time limit (``test_faults.run_case``); the reference values are
computed in the case without any loader.

torch refuses this (its workers are daemonic multiprocessing processes, which may not
have children); mploader's workers are forked with ``os.fork`` and may start loaders of
their own.  It used to kill the outer worker: its forked child let go of the outer
loader's busy-time mapping, which the outer worker itself still wrote through a view
(``BufferError``), and the outer loader reported ``WorkerError ... exited with code 1``.
"""
from __future__ import annotations

import pytest
from test_faults import run_case

NESTED = """
import numpy as np
import mploader

class Inner:
    '''Sample i: the sum of 0..i-1 (plus i * 1000 from the outer dataset), computed by a
    loader with one worker of its own.'''
    def __init__(self, face, start_method="fork"):
        self.face, self.start_method = face, start_method
    def __len__(self):
        return 6
    def __getitem__(self, i):
        if self.face == "torch":
            from mploader.torch import DataLoader
            inner = DataLoader(np.arange(i), batch_size=2, num_workers=1)
        else:
            inner = mploader.DataLoader(np.arange(i), batch_size=2, num_workers=1)
        with inner:
            total = sum(int(b.sum()) for b in inner)
        return np.array([i * 1000 + total])

def expected():
    return [[i * 1000 + i * (i - 1) // 2 for i in range(k, k + 2)] for k in range(0, 6, 2)]
"""


def nested(tmp_path) -> str:
    """Code importing the dataset from a module file (spawned workers unpickle it by name)."""
    (tmp_path / "nested_case.py").write_text(NESTED)
    return f"sys.path.insert(0, {str(tmp_path)!r})\nfrom nested_case import Inner, expected\n"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_gluon_loader_inside_a_worker(start_method, tmp_path):
    run_case(nested(tmp_path) + f"""
if __name__ == "__main__":
    outer = mploader.DataLoader(Inner("gluon"), batch_size=2, num_workers=2, start_method={start_method!r})
    with outer:
        for epoch in range(2):
            got = [b[:, 0].tolist() for b in outer]
            assert got == expected(), (epoch, got)
    print("OK")
""", timeout_s=120)


def test_torch_face_loader_inside_a_worker(tmp_path):
    pytest.importorskip("torch")
    run_case(nested(tmp_path) + """
from mploader.torch import DataLoader
if __name__ == "__main__":
    with DataLoader(Inner("torch"), batch_size=2, num_workers=2) as outer:
        for epoch in range(2):
            got = [b[:, 0].tolist() for b in outer]
            assert got == expected(), (epoch, got)
    print("OK")
""", timeout_s=120)


def test_torch_refuses_a_loader_inside_a_worker():
    """The behaviour beaten: torch's own DataLoader raises in the worker."""
    pytest.importorskip("torch")
    run_case("""
import torch
from torch.utils.data import DataLoader
class Inner(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return sum(int(b.sum()) for b in DataLoader(np.arange(4), batch_size=2, num_workers=1))
try:
    list(DataLoader(Inner(), batch_size=2, num_workers=1))
except AssertionError as exc:
    assert "daemonic processes are not allowed to have children" in str(exc), exc
    print("OK")
""", timeout_s=120)
