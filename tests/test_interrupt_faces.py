"""An interrupt between a face taking a batch from its run and counting it (issue 25,
section 2): the same iterator, continued after the ``KeyboardInterrupt``, yields that
batch, and its position (checkpoints, Chainer's ``current_position``) counts it once.

The interrupt is injected deterministically where CPython runs a pending signal
handler: a profile hook raises SIGINT when a C call made by mploader's own Python
code returns (the ``after_calls + 1``-th such return) after the run's ``__next__``
returned its n-th batch -- inside the face's own ``__next__`` body, before it
counted the batch.  Before the fix the torch face and the Chainer face dropped that
batch (their bodies held it in Python frames): 10 of the 16 face cases failed; the
Gluon face (a C ``__next__``) is the control.  Each case runs in its own child
process with a hard time limit (``test_faults.run_case``).
"""
from __future__ import annotations

import textwrap

import pytest
from test_faults import run_case

#: Child-side: ``interrupt_after_taking(run_type, nth, after_calls)`` arms the hook;
#: ``hits[0]`` counts the KeyboardInterrupts raised by it.  Only C calls made from
#: mploader's frames count: one returning into the caller's own frame (``next(it)``
#: itself) is the caller's, where an interrupt drops a batch whatever the loader.
INJECT = """
hits = [0]
def on_sigint(sig, frame):
    hits[0] += 1
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_sigint)

PKG = os.path.dirname(mploader.__file__)

def interrupt_after_taking(run_type, nth, after_calls=0):
    code = run_type.__next__.__code__
    seen = {"returns": 0, "armed": False, "calls": 0}
    def hook(frame, event, arg):
        if event == "return" and frame.f_code is code and arg is not None:
            seen["returns"] += 1
            if seen["returns"] == nth:
                seen["armed"] = True
        elif event == "c_return" and seen["armed"] and os.path.dirname(frame.f_code.co_filename) == PKG:
            seen["calls"] += 1
            if seen["calls"] > after_calls:
                seen["armed"] = False
                sys.setprofile(None)
                signal.raise_signal(signal.SIGINT)
    sys.setprofile(hook)

def drain(it, nth, run_type, after_calls=0):
    # every batch of the iterator, the same iterator going on after the interrupt
    out = []
    interrupt_after_taking(run_type, nth, after_calls)
    while True:
        try:
            out.append(next(it))
        except KeyboardInterrupt:
            continue
        except StopIteration:
            return out
"""


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize(("nth", "after_calls"), [(1, 0), (5, 0), (5, 2), (5, 6)])
def test_torch_face_batch_taken_before_an_interrupt_is_not_lost(in_order, nth, after_calls):
    """Torch face, map-style: every batch once (in order with ``in_order=True``), and a
    checkpoint taken right after the interrupt and the next batch resumes with exactly
    the batches not yet received."""
    pytest.importorskip("torch")
    out = run_case(INJECT + textwrap.dedent(f"""
        import mploader.torch
        nth, in_order = {nth}, {in_order}
        loader = mploader.torch.DataLoader(Arange(40), batch_size=2, num_workers=2, timeout=30, in_order=in_order)
        it = iter(loader)
        interrupt_after_taking(type(it._run), nth, {after_calls})
        got = []
        while not hits[0] or len(got) < nth + 1:
            try:
                got.append(int(next(it)[0, 0]))
            except KeyboardInterrupt:
                pass
        assert hits[0] == 1, hits
        state = loader.state_dict()
        rest = [int(b[0, 0]) for b in it]
        every = got + rest
        assert sorted(every) == list(range(0, 40, 2)), ("missing/doubled", every)
        if in_order:
            assert every == list(range(0, 40, 2)), every
        other = mploader.torch.DataLoader(Arange(40), batch_size=2, num_workers=2, timeout=30, in_order=in_order)
        other.load_state_dict(state)
        resumed = [int(b[0, 0]) for b in other]
        assert sorted(resumed) == sorted(rest), ("resumed", resumed, "expected", rest)
        del it
        gc.collect()
        region = loader._mpl_engine.region
        assert [region.state(s) for s in range(region.nslots)] == [_ring.STATE_FREE] * region.nslots
        loader.close(); other.close()
        print("OK")
    """), timeout_s=90)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout


def test_torch_face_iterable_dataset_batch_taken_before_an_interrupt_is_not_lost():
    """Torch face, IterableDataset (torch's own ``__next__`` path): every batch once."""
    pytest.importorskip("torch")
    out = run_case(INJECT + textwrap.dedent("""
        import torch, mploader.torch
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                return iter(range(info.id, 40, info.num_workers))
        loader = mploader.torch.DataLoader(Stream(), batch_size=2, num_workers=2, timeout=30)
        it = iter(loader)
        got = [int(x) for b in drain(it, 3, type(it._run)) for x in b]
        assert hits[0] == 1, hits
        assert sorted(got) == list(range(40)), ("missing/doubled", got)
        loader.close()
        print("OK")
    """), timeout_s=90)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout


@pytest.mark.parametrize("n_processes", [0, 2])
@pytest.mark.parametrize("after_calls", [0, 1, 3])
def test_chainer_face_batch_taken_before_an_interrupt_is_not_lost(n_processes, after_calls):
    """Chainer face: every batch once, in order, and ``current_position`` /
    ``previous_epoch_detail`` follow the batches returned (the interrupted batch is
    counted once, when it is returned)."""
    out = run_case(INJECT + textwrap.dedent(f"""
        it = mploader.MultiprocessIterator(Arange(40), batch_size=4, repeat=False, shuffle=False,
                                           n_processes={n_processes})
        next(it)   # the run exists
        run = it._run.batches
        interrupt_after_taking(type(run), 3, {after_calls})
        got, positions = [0], [4]
        while True:
            try:
                batch = next(it)
            except KeyboardInterrupt:
                continue
            except StopIteration:
                break
            got.append(int(batch[0][0]))
            positions.append(it.current_position)
            assert it.previous_epoch_detail == (len(got) - 1) * 4 / 40, (it.previous_epoch_detail, len(got))
        assert hits[0] == 1, hits
        assert got == list(range(0, 40, 4)), got
        assert positions == [4 * k for k in range(1, 10)] + [0], positions
        it.finalize()
        print("OK")
    """), timeout_s=90)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout


def test_gluon_face_batch_taken_before_an_interrupt_is_not_lost():
    """The Gluon face (its ``__next__`` is C since issue 25): the control."""
    out = run_case(INJECT + textwrap.dedent("""
        loader = mploader.DataLoader(Arange(40), batch_size=2, num_workers=2, timeout=30)
        it = iter(loader)
        got = [int(b[0][0]) for b in drain(it, 5, type(it._gen))]
        assert hits[0] == 1, hits
        assert got == list(range(0, 40, 2)), got
        del it
        gc.collect()
        loader.close()
        print("OK")
    """), timeout_s=90)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout


@pytest.mark.parametrize("line", range(12))
def test_progress_reported_again_after_an_interrupt_counts_each_batch_once(line):
    """``MapProgress.received`` (the position of every map-style face; the torch face
    reports a result again after an interrupt): interrupted before its ``line``-th
    line event (a trace hook raises SIGINT there: each line boundary, where CPython
    3.10 may run a handler), then called again with the same batch index, the prefix
    ends where one uninterrupted call puts it (``in_order=False``: batches 1..3 came
    first).  Before the fix an interrupt after ``ahead.discard`` lost the batches
    ahead from the count (10 of these 12 cases failed)."""
    out = run_case(INJECT + textwrap.dedent(f"""
        from mploader._state import MapProgress
        progress = MapProgress(0, 0, {{1, 2, 3, 7}}, None, None, None)
        code = MapProgress.received.__code__
        seen = {{"lines": 0}}
        def local(frame, event, arg):
            if event == "line":
                seen["lines"] += 1
                if seen["lines"] > {line}:
                    sys.settrace(None)
                    frame.f_trace = None
                    signal.raise_signal(signal.SIGINT)
            return local
        def hook(frame, event, arg):
            return local if frame.f_code is code else None
        sys.settrace(hook)
        try:
            progress.received(0)
        except KeyboardInterrupt:
            pass
        sys.settrace(None)
        progress.received(0)   # the same result, reported again
        assert (progress.consumed, sorted(i for i in progress.ahead if i >= progress.consumed)) == (4, [7]), (
            progress.consumed, progress.ahead)
        assert hits[0] == 1, hits
        print("OK")
    """), timeout_s=60)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout
