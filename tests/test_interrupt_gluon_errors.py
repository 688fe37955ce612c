"""An interrupt right after the Gluon face's run raised a batch's own exception (issue
25, section 2): the exception reaches the caller, and the epoch's position counts
that batch once, so a checkpoint resumes with exactly the batches not yet received.

The interrupt is injected as in ``tests/test_interrupt_faces.py``: a profile hook
raises SIGINT when the ``after_calls + 1``-th C call made by mploader's own Python
code returns, after the run's ``__next__`` raised for the n-th time.  Before the fix
``_LoaderIter._ended`` (Python code that ``serial_next`` called before the exception
propagated) counted the failed batch: an interrupt there replaced the dataset's
exception by the ``KeyboardInterrupt`` and left the batch uncounted (the resumed
loader built it again).  Each case runs in its own child process with a hard time
limit (``test_faults.run_case``).
"""
from __future__ import annotations

import textwrap

import pytest
from test_faults import run_case
from test_interrupt_faces import INJECT

#: Child-side: ``interrupt_after_raising(run_type, nth, after_calls)`` arms the hook
#: at the n-th time ``run_type.__next__`` ends with an exception (a profile
#: ``return`` event with ``None``; its batches are never None).
RAISING = """
def interrupt_after_raising(run_type, nth, after_calls=0):
    code = run_type.__next__.__code__
    seen = {"raises": 0, "armed": False, "calls": 0}
    def hook(frame, event, arg):
        if event == "return" and frame.f_code is code and arg is None:
            seen["raises"] += 1
            if seen["raises"] == nth:
                seen["armed"] = True
        elif event == "c_return" and seen["armed"] and os.path.dirname(frame.f_code.co_filename) == PKG:
            seen["calls"] += 1
            if seen["calls"] > after_calls:
                seen["armed"] = False
                sys.setprofile(None)
                signal.raise_signal(signal.SIGINT)
    sys.setprofile(hook)

class Bad(Arange):
    # sample 10 (batch 5 of batch_size 2) raises
    def __getitem__(self, i):
        if i == 10:
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)

def outcomes(it, record_state=None):
    # every outcome of the iterator -- a batch's first sample or the dataset's
    # message -- the same iterator going on after the interrupt; the loader's
    # state_dict() after the first outcome that follows the interrupt
    out, state = [], None
    while True:
        try:
            out.append(int(next(it)[0][0]))
        except KeyboardInterrupt:
            out.append("interrupt")
            continue
        except ValueError as exc:
            out.append(str(exc))
        except StopIteration:
            return out, state
        if record_state is not None and state is None and out[-2:-1] == ["interrupt"]:
            state = record_state()
"""

EXPECTED = "[0, 2, 4, 6, 8, 'bad sample 10'] + list(range(12, 40, 2))"


@pytest.mark.parametrize("after_calls", [0, 1, 2])
def test_gluon_face_batch_error_before_an_interrupt_is_raised_and_counted_once(after_calls):
    """The dataset's exception of batch 5 is raised once, every other batch comes once
    in order, and a checkpoint taken at the first outcome after the interrupt resumes
    with exactly the outcomes that followed it (before the fix, 0 and 1 calls: the
    exception was lost and the resumed loader began one batch early)."""
    out = run_case(INJECT + RAISING + textwrap.dedent(f"""
        loader = mploader.DataLoader(Bad(40), batch_size=2, num_workers=2, timeout=30)
        it = iter(loader)
        interrupt_after_raising(type(it._gen), 1, {after_calls})
        got, state = outcomes(it, loader.state_dict)
        assert hits[0] == 1, hits
        at = got.index("interrupt")
        got.remove("interrupt")
        assert got == {EXPECTED}, got
        assert state is not None, got
        rest = got[at + 1:]
        other = mploader.DataLoader(Bad(40), batch_size=2, num_workers=2, timeout=30)
        other.load_state_dict(state)
        resumed, _ = outcomes(iter(other))
        assert resumed == rest, ("resumed", resumed, "expected", rest)
        del it
        gc.collect()
        loader.close(); other.close()
        print("OK")
    """), timeout_s=90)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout


def test_gluon_face_end_of_epoch_before_an_interrupt_is_kept():
    """The interrupt lands right after the run's StopIteration (the control: the next
    ``next()`` raises StopIteration again and the epoch counts as finished, so a
    checkpoint resumes with the next epoch, whole)."""
    out = run_case(INJECT + RAISING + textwrap.dedent(f"""
        loader = mploader.DataLoader(Bad(40), batch_size=2, num_workers=2, timeout=30)
        it = iter(loader)
        interrupt_after_raising(type(it._gen), 2, 0)   # (the first raise is batch 5's)
        got, _ = outcomes(it)
        assert hits[0] == 1, hits
        assert got == {EXPECTED} + ["interrupt"], got
        other = mploader.DataLoader(Bad(40), batch_size=2, num_workers=2, timeout=30)
        other.load_state_dict(loader.state_dict())
        again, _ = outcomes(iter(other))
        assert again == {EXPECTED}, again
        del it
        gc.collect()
        loader.close(); other.close()
        print("OK")
    """), timeout_s=90)
    assert out.stdout.split()[-1:] == ["OK"], out.stdout
