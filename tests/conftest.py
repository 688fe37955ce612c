"""Shared fixtures: no test may leave a child process, fd, shared mapping or shm entry behind.

``_no_leaks`` is autouse: every test of this suite is checked, whatever starts its
workers (a face, the engine, a spawned or forkserver context, a subprocess).  It takes a
:class:`_leaks.Snapshot` of this process tree before the test and compares after it
(tests/_leaks.py says what is compared and why only this process tree's own resources
count: /dev/shm is shared with every other job on a CI runner).

Long-lived helpers, handled explicitly:

* multiprocessing's resource tracker, fork server and resource sharer live until the
  interpreter exits: :func:`_leaks.mp_helpers` recognises them wherever they start;
* a test (or its module) may define a fixture named ``mp_helpers`` that starts such
  helpers and creates what they keep (a descriptor handed to the resource sharer):
  it is set up before the snapshot is taken;
* module- and session-scoped fixtures (a module's long-lived loaders) are set up
  before any function-scoped fixture, hence before the snapshot;
* tqdm's process-wide write lock (a multiprocessing RLock: a mapped POSIX semaphore,
  made at the first progress bar and kept) is made here, before any test.

A test that failed is not checked (its traceback keeps its frames, and whatever they
refer to, alive: the leak report would repeat the failure).  After a test that passed,
the item's fixture values are dropped before the comparison: their
teardowns have run (this fixture is set up first, so torn down last), and a value
released by deallocation (a closed Region keeps its mapping until it is collected)
would otherwise still be held by the item until pytest drops it after teardown.

``no_leaks`` is kept for tests that name it: it is the same check (the snapshot of
the autouse fixture).
"""
from __future__ import annotations

import os

import pytest
from _leaks import (  # noqa: F401 - re-exported for `from conftest import ...`
    Snapshot,
    assert_no_leaks,
    child_pids,
    memfd_mappings,
    open_fds,
    record_mp_names,
    shm_entries,
)
from hypothesis import settings

# Property tests draw the same examples in every run of the suite (derived from each
# test's name: `derandomize`), so that a run of `make test` or CI is reproducible and a
# red CI always means a change broke something; MPLOADER_HYPOTHESIS=explore draws new
# ones (what found the tampered 'keep' carry, 2026-11-27; a failure prints the blob to
# replay it with @reproduce_failure).  docs/design.md, "Faults".
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("MPLOADER_HYPOTHESIS", "fixed"))

record_mp_names()
try:
    import tqdm
except ImportError:
    pass
else:
    tqdm.tqdm.get_lock()


@pytest.fixture(autouse=True)
def _no_leaks(request):
    """Fail the test if it leaves a child process, fd, shared mapping or /dev/shm entry."""
    if "mp_helpers" in request.fixturenames:
        request.getfixturevalue("mp_helpers")
    before = Snapshot()
    yield before
    if getattr(request.node, "_leaks_call_failed", False):
        return  # its traceback holds the test's frames and what they refer to: no second report
    if request.node.funcargs:
        request.node.funcargs.clear()
    assert_no_leaks(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember whether the test itself failed (for ``_no_leaks``)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item._leaks_call_failed = report.failed


@pytest.fixture
def no_leaks(_no_leaks):
    """The autouse check's snapshot (every test is checked; naming it changes nothing)."""
    return _no_leaks
