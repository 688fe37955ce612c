"""The start-up deadline of forked workers (docs/design.md, "Faults"): a forked child
that deadlocks before its first step -- in CPython's child-side clean-up of the fork,
on a lock another thread of the parent held at the fork (seen in CI under Lightning's
ddp, whose gloo threads run beside the fork) -- is killed and forked again, and the
epoch is the undisturbed one; a fork that deadlocks every time ends in StallError,
not a hang.

The deadlock is stood in for by an ``os.register_at_fork(after_in_child=...)`` hook
that sleeps for ever: it runs where the real one hangs, after the fork and before
the worker's first step.  Each case runs in its own child process with a hard time
limit (tests/test_faults.py's ``run_case``), whose process group must end empty.
"""
from __future__ import annotations

import pytest
from test_faults import COLLECT_LOG, run_case

HOOK = COLLECT_LOG + """
import tempfile
from mploader import _watchdog
_watchdog.BOOT_LIMIT_S = 1.0
MARK = os.path.join(tempfile.mkdtemp(), "hung")

def hang_after_fork(always):
    def hook():
        if not always:
            try:   # the first child to get here hangs, the others go on
                os.close(os.open(MARK, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        while True:
            time.sleep(3600)
    os.register_at_fork(after_in_child=hook)

"""


@pytest.mark.parametrize("stall_timeout", ["auto", None])
def test_a_worker_deadlocked_in_its_fork_is_forked_again(stall_timeout):
    """One of the two forked workers never takes its first step: after the deadline
    (1 s here) it is killed and forked again, the epoch has every batch in order, one
    respawn is counted and logged; also with the stall watchdog off
    (``stall_timeout=None``, Chainer's default), as the deadline is not the
    watchdog's batch limit."""
    run_case(HOOK + f"""
loader = mploader.DataLoader(Arange(40), batch_size=4, num_workers=2, stall_timeout={stall_timeout!r})
assert firsts(loader) == list(range(40)), "undisturbed"
loader.close()
hang_after_fork(always=False)
loader = mploader.DataLoader(Arange(40), batch_size=4, num_workers=2, stall_timeout={stall_timeout!r})
assert firsts(loader) == list(range(40))
assert firsts(loader) == list(range(40))
stats = loader.stats()
assert stats["respawns"] == 1 and stats["stalls"] == 1, stats
assert os.path.exists(MARK)
assert len(log.messages) == 1 and "did not start within" in log.messages[0], log.messages
assert len(loader.worker_pids()) == 2
loader.close()
print("OK")
""", timeout_s=90)


def test_a_fork_that_deadlocks_every_time_raises_stall_error():
    """Every fork hangs: after BOOT_RETRIES forks of a worker id missed the deadline,
    ``next()`` raises StallError naming the deadline and the start methods that avoid
    it, and closing the loader leaves no process behind (run_case checks the group)."""
    run_case(HOOK + """
hang_after_fork(always=True)
loader = mploader.DataLoader(Arange(40), batch_size=4, num_workers=2)
try:
    next(iter(loader))
except mploader.StallError as exc:
    message = str(exc)
else:
    raise AssertionError("no StallError")
assert "did not start within" in message and "forkserver" in message, message
assert str(_watchdog.BOOT_RETRIES + 1) + " times" in message, message
loader.close()
print("OK")
""", timeout_s=90)
