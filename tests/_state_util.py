"""Checkpoint helpers shared by test_state_torch.py and test_state_rng.py (imported as
``import _state_util`` after those modules skip without torchdata)."""
from __future__ import annotations

import copy
import json

from torchdata.stateful_dataloader import StatefulDataLoader


def snapshot(loader):
    """Our states go through JSON; torchdata's hold tensors (a generator's state), so
    they are deep-copied instead."""
    if isinstance(loader, StatefulDataLoader):
        return copy.deepcopy(loader.state_dict())
    return json.loads(json.dumps(loader.state_dict()))


def run_all(loader, as_list, epochs):
    """Every batch of ``epochs`` epochs (as ``as_list`` makes them); the state before
    each batch and after each epoch's StopIteration."""
    states, batches = [snapshot(loader)], []
    for _ in range(epochs):
        for batch in loader:
            batches.append(as_list(batch))
            states.append(snapshot(loader))
        states[-1] = snapshot(loader)
    return states, batches


def resumed(make, state, needed, as_list, passes):
    """The first ``needed`` batches of a fresh loader that loaded ``state``, over at
    most ``passes`` passes."""
    loader = make()
    loader.load_state_dict(state)
    out = []
    for _ in range(passes):
        if len(out) >= needed:
            break
        out.extend(as_list(b) for b in loader)
    if hasattr(loader, "close"):
        loader.close()
    return out[:needed]
