"""The Cython objects of mploader._ring, directly: every refusal and error path.

Construction (``create_region`` / ``attach_region``; ``Region()`` refused; half-built
objects), argument validation and its messages, ``wait`` (timeout, the single lease,
its read-only snapshot), header validation (each corrupt field gives
CorruptSlotError naming slot, field and value, and frees the slot), state errors,
``resize``/``set_size_hint``, the waiter bit, ``watch_parent``, and the fork rules
(a child never frees the parent's slots).  Cases that could crash the interpreter
(corrupt headers, fd 0) run in a forked child with a hard time limit.  The
reference for every expected value is the protocol in docs/design.md, not the code.
"""
from __future__ import annotations

import ctypes
import errno
import gc
import math
import os
import pickle
import select
import signal
import threading
import time

import pytest

from mploader import _ring
from mploader._ring import (
    CorruptSlotError,
    RegionFullError,
    RegionLayoutError,
    SlotLease,
    SlotStateError,
    attach_region,
    create_region,
)

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture(autouse=True)
def no_live_ring_objects():
    """Every Region and SlotLease a test makes is gone when it ends (uvloop's counters).
    A full collection (~0.1 s with torch imported, several on a busy machine) runs only
    where it can change the answer: before, if any ring object is alive (it may be
    garbage); after, if the counts differ."""
    before = _ring.live_objects()
    if any(before.values()):
        gc.collect()
        before = _ring.live_objects()
    yield
    if _ring.live_objects() != before:
        gc.collect()
    assert _ring.live_objects() == before

PAGE = 4096
CHILD_TIMEOUT_S = 20


def run_in_child(fn, timeout_s: float = CHILD_TIMEOUT_S):
    """Run ``fn()`` in a forked child; return ("ok", value) / ("raised", repr) / ("died", status).

    A crash (SIGSEGV, SIGBUS) or a hang is one failed test, not a dead suite.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            out = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = ("raised", f"{type(e).__name__}: {e}")
        try:
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"child did not finish within {timeout_s} s (hang)")
        _, status = os.waitpid(pid, 0)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
    finally:
        os.close(pidfd)
        os.close(r)
    if not data:
        return ("died", status)
    return pickle.loads(data)


def u64(addr: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(addr)


def field(region, slot: int, name: str):
    """ctypes view of one header field of ``slot`` (a stray writer's handle)."""
    addr = region._meta_address(slot) + _ring._META_OFFSETS[name]
    return (ctypes.c_uint32 if name in ("kind", "flags", "grow_count") else
            ctypes.c_int32 if name == "worker_pid" else ctypes.c_uint64).from_address(addr)


def publish(region, slot: int, seq: int, data: bytes = b"payload!", kind: int = _ring.KIND_SLOT,
            desc=(0, 0), flags: int = 0) -> None:
    """The worker's side of one batch, done in this process."""
    region.assign(slot, seq)
    cap = region.begin(slot, seq)
    if cap < len(data):
        assert region.grow(slot, len(data))
    region.payload(slot)[:len(data)] = data
    region.publish(slot, kind, flags, len(data), *desc)


# ---- construction -----------------------------------------------------------------


def test_region_cannot_be_built_directly_and_fd0_survives():
    def body():
        # fd 0 is a pipe we can recognise; a half-built Region must never close it
        r, w = os.pipe()
        os.dup2(r, 0)
        ino = os.fstat(0).st_ino
        for args in [(8, 2**64), (8, 2**64, 0), (), (5003, 0), ("x",)]:
            try:
                _ring.Region(*args)
            except TypeError as e:
                assert "create_region" in str(e), e
            else:
                raise AssertionError(f"Region{args} did not raise")
        half = _ring.Region.__new__(_ring.Region)
        assert half.fd == -1 and half.address == 0 and half.file_bytes == 0 and half.closed
        del half
        for _ in range(3):
            try:
                create_region(8, 2**64)
            except ValueError:
                pass
        gc.collect()
        return os.fstat(0).st_ino == ino

    assert run_in_child(body) == ("ok", True)


def test_half_built_region_refuses_every_method():
    half = _ring.Region.__new__(_ring.Region)
    assert repr(half) == "<mploader._ring.Region (not mapped)>"
    for call in (lambda: half.find_free(), lambda: half.assign(0, 1), lambda: half.wait(0, 0),
                 lambda: half.meta(0), lambda: half.populate(), lambda: half.note_size(1),
                 lambda: half.set_size_hint(1), lambda: half.state(0)):
        with pytest.raises(ValueError, match="not mapped in this process"):
            call()
    half.close()
    half.forget()  # idempotent, nothing to free


def test_slot_lease_cannot_be_built_directly():
    with pytest.raises(TypeError, match=r"made by Region.wait\(\)"):
        SlotLease()
    empty = SlotLease.__new__(SlotLease)  # harmless: holds nothing, frees nothing
    assert empty.nbytes == 0 and bytes(memoryview(empty)) == b""
    del empty


@pytest.mark.parametrize("args, exc, message", [
    ((0, 0), ValueError, "nslots must be in 1..4096, got 0"),
    ((5003, 0), ValueError, "nslots must be in 1..4096, got 5003"),
    ((-1, 0), ValueError, "nslots must be in 1..4096, got -1"),
    ((5, -1), ValueError, "slot_bytes must be in 0..1099511627776 (MAX_SLOT_BYTES, 1 TiB), got -1"),
    ((5, 2**62), ValueError, f"slot_bytes must be in 0..1099511627776 (MAX_SLOT_BYTES, 1 TiB), got {2**62}"),
    ((5, 2**64), ValueError, f"got {2**64}"),
    ((4, 0, -1), ValueError, "reserve_bytes must be in 0..70368744177664 (MAX_RESERVE_BYTES, 64 TiB; "
                             "0 = 17179869184), got -1"),
    ((4, 0, 2**47), ValueError, f"reserve_bytes must be in 0..70368744177664 (MAX_RESERVE_BYTES, 64 TiB; "
                                f"0 = 17179869184), got {2**47}"),
    ((4096, 2**40), ValueError, "nslots * slot_bytes (4096 x 1099511627776) is too large"),
    ((1.0, 0), TypeError, "nslots must be an int, got float 1.0"),
    ((True, 0), TypeError, "nslots must be an int, got bool True"),
    ((4, "1"), TypeError, "slot_bytes must be an int, got str '1'"),
    ((4, 0, None), TypeError, "reserve_bytes must be an int, got NoneType None"),
])
def test_create_region_validation(args, exc, message):
    with pytest.raises(exc) as info:
        create_region(*args)
    assert type(info.value) is exc
    assert message in str(info.value)


def test_create_region_refuses_more_than_physical_memory():
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    slot = min(_ring.MAX_SLOT_BYTES, phys // 2 + PAGE)
    with pytest.raises(RegionFullError, match=r"nslots \* slot_bytes \(3 x \d+ = \d+ bytes with headers\) "
                                              rf"exceeds this machine's physical memory \({phys} bytes\)"):
        create_region(3, slot)
    assert issubclass(RegionFullError, MemoryError)


def test_limits_are_exported_and_enforced_at_the_edges():
    assert (_ring.MAX_SLOTS, _ring.MAX_SLOT_BYTES, _ring.MAX_RESERVE_BYTES) == (4096, 2**40, 2**46)
    r = create_region(_ring.MAX_SLOTS, 0)
    assert r.nslots == 4096 and r.reserve_bytes == _ring.DEFAULT_RESERVE_BYTES
    del r
    r = create_region(1, 1, 1)  # tiny reservation is raised to 4x the initial size
    assert r.reserve_bytes >= 4 * 2 * PAGE
    r.close()
    assert r.fd == -1 and r.closed
    r.close()  # idempotent


def test_live_objects_count_regions_and_leases():
    start = _ring.live_objects()
    r = create_region(2, PAGE)
    publish(r, 0, 1)
    lease = r.wait(0, 0)
    assert _ring.live_objects() == {"regions": start["regions"] + 1, "leases": start["leases"] + 1}
    del r  # the lease keeps its region alive
    assert _ring.live_objects()["regions"] == start["regions"] + 1
    del lease
    assert _ring.live_objects() == start


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    r = create_region(np.int64(2), np.uint32(4096))
    assert r.nslots == 2 and r.meta(0).capacity == PAGE


# ---- attach ----------------------------------------------------------------------


def test_attach_region_maps_the_same_memory_and_is_not_owner():
    r = create_region(3, 3 * PAGE)
    a = attach_region(r.fd)
    assert a.attached and not r.attached and a.owner_pid == 0
    assert (a.nslots, a.reserve_bytes) == (3, r.reserve_bytes)
    assert a.fd not in (-1, r.fd)  # its own duplicate
    r.assign(1, 42)
    assert a.begin(1, 42) == 3 * PAGE
    a.payload(1)[:5] = b"hello"
    a.publish(1, _ring.KIND_SLOT, 0, 5)
    with pytest.raises(SlotStateError, match="wait slot 1: an attached region cannot take leases"):
        a.wait(1, 0)
    with pytest.raises(SlotStateError, match="assign slot 0: an attached region cannot assign slots"):
        a.assign(0, 1)
    with pytest.raises(SlotStateError, match="reclaim slot 1: an attached region cannot reclaim slots"):
        a.reclaim(1)
    lease = r.wait(1, 0)
    assert bytes(lease) == b"hello" and lease.worker_pid == os.getpid()
    del lease
    assert r.state(1) == _ring.STATE_FREE
    a.populate()
    a.close()
    del a


def test_attach_region_errors():
    with pytest.raises(TypeError, match="fd must be an int, got str 'x'"):
        attach_region("x")
    with pytest.raises(ValueError, match="fd must be a non-negative file descriptor, got -1"):
        attach_region(-1)
    fd = os.memfd_create("not-a-region")
    try:
        with pytest.raises(RegionLayoutError, match=rf"fd {fd} is not an mploader region: magic 0x0000000000000000, "
                                                    r"expected 0x6d706c72696e6731"):
            attach_region(fd)
        os.ftruncate(fd, 65536)
        with pytest.raises(RegionLayoutError, match="not an mploader region"):
            attach_region(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        attach_region(fd)  # closed now
    assert info.value.errno == errno.EBADF


def test_attach_checks_version_and_layout_and_populate_checks_both():
    r = create_region(2, PAGE)
    version = ctypes.c_uint32.from_address(r.address + 8)
    nslots = ctypes.c_uint32.from_address(r.address + 12)
    magic = u64(r.address)
    assert magic.value == 0x6D706C72696E6731 and version.value == _ring.LAYOUT_VERSION
    version.value = 99
    with pytest.raises(RegionLayoutError, match=rf"holds an mploader region of layout version 99; "
                                                rf"this build reads layout version {_ring.LAYOUT_VERSION}"):
        attach_region(r.fd)
    with pytest.raises(RegionLayoutError, match="layout version is not"):
        r.populate()
    version.value = _ring.LAYOUT_VERSION
    magic.value ^= 0xFF
    with pytest.raises(RegionLayoutError, match="not an mploader region"):
        attach_region(r.fd)
    with pytest.raises(RegionLayoutError, match="populate: the control block's magic"):
        r.populate()
    magic.value ^= 0xFF
    nslots.value = 0
    with pytest.raises(RegionLayoutError, match="control block is inconsistent"):
        attach_region(r.fd)
    nslots.value = 2
    r.populate()


# ---- wait and the lease ------------------------------------------------------------


def test_wait_returns_one_lease_with_a_read_only_snapshot():
    r = create_region(2, 2 * PAGE)
    publish(r, 0, 7, b"abcdefgh", kind=_ring.KIND_ERROR, desc=(2, 5), flags=_ring.FLAG_INBAND)
    lease = r.wait(0, 1.0)
    assert isinstance(lease, SlotLease) and r.state(0) == _ring.STATE_LEASED
    assert (lease.slot, lease.seq, lease.kind, lease.flags, lease.nbytes, lease.desc_off, lease.desc_len,
            lease.worker_pid, lease.capacity, lease.grow_count) == \
        (0, 7, _ring.KIND_ERROR, _ring.FLAG_INBAND, 8, 2, 5, os.getpid(), 2 * PAGE, 0)
    assert lease.offset == r.meta(0).offset
    assert bytes(lease) == b"abcdefgh" and memoryview(lease).nbytes == 8
    for name in ("slot", "seq", "kind", "flags", "nbytes", "desc_off", "desc_len", "worker_pid", "capacity",
                 "grow_count", "offset"):
        with pytest.raises(AttributeError):
            setattr(lease, name, 1)
    # a snapshot: a later write to the header does not change the lease
    field(r, 0, "used").value = 1
    assert lease.nbytes == 8 and len(bytes(lease)) == 8
    # no second lease for a LEASED slot
    with pytest.raises(SlotStateError, match="wait slot 0 \\(needs ASSIGNED or READY\\): slot 0 is LEASED"):
        r.wait(0, 0)
    del lease
    assert r.state(0) == _ring.STATE_FREE


def test_wait_timeout_and_bad_arguments():
    r = create_region(2, PAGE)
    r.assign(1, 3)
    assert r.wait(1, 0) is None
    t0 = time.monotonic()
    assert r.wait(1, 0.05) is None
    assert time.monotonic() - t0 >= 0.045
    assert r.state(1) == _ring.STATE_ASSIGNED
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds \\(< 0: forever\\), got nan"):
        r.wait(1, math.nan)
    with pytest.raises(SlotStateError, match="slot 0 is FREE"):
        r.wait(0, 0)
    with pytest.raises(IndexError, match="slot must be in 0..1, got 2"):
        r.wait(2, 0)
    with pytest.raises(OverflowError):
        r.wait(-1, 0)
    r.reclaim(1)


def test_wait_appends_the_lease_to_into():
    r = create_region(1, PAGE)
    publish(r, 0, 1)
    into = []
    lease = r.wait(0, 0, into)
    assert into == [lease]
    del lease
    assert r.state(0) == _ring.STATE_LEASED  # still held by the list
    into.clear()
    assert r.state(0) == _ring.STATE_FREE
    r.assign(0, 2)
    assert r.wait(0, 0, into) is None and into == []
    with pytest.raises(TypeError):
        r.wait(0, 0, ())
    r.reclaim(0)


def test_wait_sleeps_and_is_woken_only_when_someone_waits():
    r = create_region(2, PAGE)
    w0 = r.wakes
    publish(r, 0, 1)  # nobody waits: no FUTEX_WAKE
    assert r.wakes == w0 and r._state_word(0) == _ring.STATE_READY
    del_lease = r.wait(0, 0)
    del del_lease
    r.assign(1, 2)
    got = []
    t = threading.Thread(target=lambda: got.append(r.wait(1, 10.0)))
    t.start()
    deadline = time.monotonic() + 10
    while r._state_word(1) != _ring.STATE_ASSIGNED | _ring.WAITER_BIT and time.monotonic() < deadline:
        time.sleep(0)  # yield until the waiter has announced itself (the condition, not a delay)
    assert r._state_word(1) == _ring.STATE_ASSIGNED | _ring.WAITER_BIT
    assert r.state(1) == _ring.STATE_ASSIGNED  # the bit is hidden from state()
    assert r.begin(1, 2) == PAGE
    r.publish(1, _ring.KIND_SLOT, 0, 0)
    t.join(10)
    assert not t.is_alive() and got[0] is not None and got[0].seq == 2
    assert r.wakes == w0 + 1
    got.clear()
    assert r.state(1) == _ring.STATE_FREE


def test_meta_has_named_fields():
    r = create_region(2, PAGE)
    publish(r, 1, 9, b"xyz", desc=(1, 2))
    m = r.meta(1)
    assert isinstance(m, _ring.SlotMeta)
    assert m._fields == ("seq", "kind", "flags", "used", "desc_off", "desc_len", "worker_pid", "capacity",
                         "grow_count", "offset")
    assert (m.seq, m.kind, m.used, m.desc_off, m.desc_len, m.worker_pid, m.capacity) == \
        (9, _ring.KIND_SLOT, 3, 1, 2, os.getpid(), PAGE)
    r.reclaim(1)


# ---- corrupt headers ---------------------------------------------------------------

CORRUPT = [
    # (case id, field, value as a function of the honest header, expected field name)
    ("kind-none", "kind", lambda m, r: _ring.KIND_NONE, "kind"),
    ("kind-7", "kind", lambda m, r: 7, "kind"),
    ("offset-unaligned", "offset", lambda m, r: m.offset + 8, "offset"),
    ("offset-in-headers", "offset", lambda m, r: 0, "offset"),
    ("offset-past-file", "offset", lambda m, r: r.file_bytes + (1 << 20), "offset"),
    ("offset-past-reservation", "offset", lambda m, r: r.reserve_bytes + PAGE, "offset"),
    ("capacity-past-file", "capacity", lambda m, r: 1 << 30, "capacity"),
    ("capacity-2^62", "capacity", lambda m, r: 1 << 62, "capacity"),
    ("used-past-capacity", "used", lambda m, r: m.capacity + 1, "used"),
    ("used-2^40", "used", lambda m, r: 1 << 40, "used"),
    ("desc-off-past-used", "desc_off", lambda m, r: m.used + 1, "desc_off"),
    ("desc-len-past-used", "desc_len", lambda m, r: m.used, "desc_len"),
    ("desc-len-2^64-1", "desc_len", lambda m, r: 2**64 - 1, "desc_len"),
]


@pytest.mark.parametrize("case, name, value, want", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_header_gives_corrupt_slot_error_and_frees_the_slot(case, name, value, want):
    def body():
        r = create_region(3, 3 * PAGE, 1 << 26)
        publish(r, 2, 11, b"0123456789" * 10, desc=(4, 50))
        bad = value(r.meta(2), r)
        field(r, 2, name).value = bad
        try:
            r.wait(2, 1.0)
        except CorruptSlotError as e:
            msg, err = str(e), e
        else:
            return "no error"
        out = [msg, err.slot, err.field, err.value, r.state(2)]
        # the slot works again (its range was reset if the range was bad)
        publish(r, 2, 12, b"fine")
        lease = r.wait(2, 0)
        out.append(bytes(lease))
        del lease
        out.append(r.state(2))
        return out

    status, out = run_in_child(body)
    assert status == "ok", out
    msg, slot, fname, fvalue, state, again, state2 = out
    assert (slot, fname, state) == (2, want, _ring.STATE_FREE)
    assert msg.startswith(f"slot 2 (batch 11): corrupt header field {want} = {fvalue}: "), msg
    assert msg.endswith("the batch is dropped and the slot freed"), msg
    assert (again, state2) == (b"fine", _ring.STATE_FREE)
    assert issubclass(CorruptSlotError, RuntimeError)


BEGIN_CORRUPT = [
    ("offset-unaligned", "offset", lambda m, r: m.offset + 8),
    ("offset-in-headers", "offset", lambda m, r: 0),
    ("offset-past-file", "offset", lambda m, r: r.file_bytes + (1 << 20)),
    ("capacity-past-file", "capacity", lambda m, r: 1 << 30),
    ("capacity-2^62", "capacity", lambda m, r: 1 << 62),
]


@pytest.mark.parametrize("case, name, value", BEGIN_CORRUPT, ids=[c[0] for c in BEGIN_CORRUPT])
def test_begin_refuses_a_corrupt_range_and_resets_it(case, name, value):
    def body():
        r = create_region(2, 2 * PAGE, 1 << 26)
        r.assign(1, 5)
        bad = value(r.meta(1), r)
        field(r, 1, name).value = bad
        try:
            r.begin(1, 5)
        except CorruptSlotError as e:
            out = [str(e), e.slot, e.field, e.value]
        else:
            return "no error"
        m = r.meta(1)
        out += [m.capacity, r.begin(1, 5)]
        assert r.grow(1, 100)  # the worker can still report through the slot
        r.payload(1)[:3] = b"err"
        r.publish(1, _ring.KIND_ERROR, 0, 3, 0, 3)
        lease = r.wait(1, 0)
        out.append(bytes(lease))
        return out

    status, out = run_in_child(body)
    assert status == "ok", out
    msg, slot, fname, fvalue, capacity, begin_again, data = out
    assert (slot, fname, capacity, begin_again, data) == (1, name, 0, 0, b"err")
    assert msg.startswith(f"slot 1 (batch 5): corrupt header field {name} = {fvalue}: "), msg
    assert msg.endswith("the slot's range was reset to empty"), msg


def test_wait_spin():
    r = create_region(2, PAGE)
    r.assign(0, 1)
    with pytest.raises(ValueError, match="spin_s must be a non-negative number of seconds, got -1.0"):
        r.wait(0, 1, spin_s=-1)
    with pytest.raises(ValueError, match="spin_s must be a non-negative number of seconds, got nan"):
        r.wait(0, 1, spin_s=math.nan)
    t0 = time.monotonic()
    # the spin is bounded by the timeout (a spin of 600 s would outlast the test's timeout)
    assert r.wait(0, 0.02, spin_s=600.0) is None
    assert time.monotonic() - t0 >= 0.015
    assert r._state_word(0) == _ring.STATE_ASSIGNED  # spun to the end: never announced a sleeper
    w0 = r.wakes
    got = []
    t = threading.Thread(target=lambda: got.append(r.wait(0, 10.0, spin_s=5.0)))
    t.start()
    r.begin(0, 1)
    r.publish(0, _ring.KIND_SLOT, 0, 0)
    t.join(10)
    assert got[0] is not None and got[0].seq == 1 and r.wakes == w0
    got.clear()
    assert r.state(0) == _ring.STATE_FREE


def test_wait_on_a_closed_region_with_a_grown_slot():
    r = create_region(2, PAGE)
    r.assign(0, 1)
    r.begin(0, 1)
    assert r.grow(0, 1 << 20)
    r.publish(0, _ring.KIND_SLOT, 0, 10)
    r.close()
    with pytest.raises(OSError) as info:
        r.wait(0, 0)
    assert info.value.errno == errno.EBADF and "wait slot 0" in str(info.value)
    assert r.state(0) == _ring.STATE_FREE


# ---- state errors and the worker side ------------------------------------------------


def test_state_errors_name_the_slot_and_its_state():
    r = create_region(2, PAGE)
    r.assign(0, 5)
    with pytest.raises(SlotStateError, match=r"assign slot 0 \(needs FREE\): slot 0 is ASSIGNED"):
        r.assign(0, 6)
    with pytest.raises(SlotStateError, match="begin slot 0: it is assigned to batch 5, not 6"):
        r.begin(0, 6)
    with pytest.raises(SlotStateError, match=r"begin slot 1 for batch 1 \(needs ASSIGNED\): slot 1 is FREE"):
        r.begin(1, 1)
    with pytest.raises(SlotStateError, match=r"publish slot 1 \(needs ASSIGNED\): slot 1 is FREE"):
        r.publish(1, _ring.KIND_SLOT, 0, 0)
    with pytest.raises(SlotStateError, match=r"reclaim slot 1 \(needs ASSIGNED or READY\): slot 1 is FREE"):
        r.reclaim(1)
    with pytest.raises(SlotStateError, match=r"grow slot 1 \(needs ASSIGNED\): slot 1 is FREE"):
        r.grow(1, 100)
    with pytest.raises(SlotStateError, match=r"resize slot 1 to 0 bytes \(needs ASSIGNED\): slot 1 is FREE"):
        r.resize(1, 0)
    with pytest.raises(ValueError, match="publish slot 0: used must be <= the slot's capacity 4096, got 4097"):
        r.publish(0, _ring.KIND_SLOT, 0, 4097)
    with pytest.raises(ValueError, match=r"publish slot 0: the descriptor \[desc_off, desc_off \+ desc_len\) = "
                                         r"\[5, 15\) must lie inside \[0, used=10\)"):
        r.publish(0, _ring.KIND_SLOT, 0, 10, 5, 10)
    with pytest.raises(IndexError, match="slot must be in 0..1, got 7"):
        r.assign(7, 1)
    r.reclaim(0)
    assert r.find_free(1) == 1


def test_resize_shrinks_in_place_and_grows():
    r = create_region(1, 0)
    r.assign(0, 1)
    assert r.begin(0, 1) == 0
    assert r.resize(0, 1 << 20)  # grow from nothing
    m = r.meta(0)
    assert m.capacity == 1 << 20 and m.grow_count == 1 and r.size_hint == 1 << 20
    r.payload(0)[:6] = b"keepme"
    file_bytes = r.file_bytes
    assert r.resize(0, 6)  # shrink: same offset, first bytes kept, no address space used
    m2 = r.meta(0)
    assert (m2.offset, m2.capacity, m2.grow_count) == (m.offset, PAGE, 1)
    assert bytes(r.payload(0)[:6]) == b"keepme" and r.file_bytes == file_bytes
    assert r.resize(0, 100)  # within the capacity: unchanged
    assert r.meta(0).capacity == PAGE
    assert r.resize(0, 3 * PAGE, preserve=6)  # grows (new range), preserving 6 bytes
    assert bytes(r.payload(0)[:6]) == b"keepme" and r.meta(0).capacity == 3 * PAGE
    r.set_size_hint(PAGE)  # lowered, not only raised
    assert r.size_hint == PAGE
    r.note_size(100)
    assert r.size_hint == PAGE
    r.note_size(5 * PAGE)
    assert r.size_hint == 5 * PAGE
    r.reclaim(0)


def test_grow_past_the_reservation_returns_false_and_keeps_the_slot():
    r = create_region(1, PAGE, 1 << 20)
    r.assign(0, 1)
    r.begin(0, 1)
    r.payload(0)[:3] = b"abc"
    before = r.meta(0)
    assert r.grow(0, r.reserve_bytes + 1, 3) is False
    assert r.meta(0) == before and bytes(r.payload(0)[:3]) == b"abc"
    r.reclaim(0)


def test_forget_unmaps():
    r = create_region(1, PAGE)
    r.forget()
    assert r.address == 0 and r.closed and r.fd == -1
    with pytest.raises(ValueError, match="not mapped"):
        r.state(0)


# ---- fork rules -----------------------------------------------------------------------


def test_forked_child_dropping_a_lease_does_not_free_it():
    r = create_region(2, PAGE)
    publish(r, 0, 1)
    lease = r.wait(0, 0)
    publish(r, 1, 2)

    def body():
        nonlocal lease
        del lease
        gc.collect()
        msgs = []
        for call in (lambda: r.wait(1, 0), lambda: r.assign(0, 9), lambda: r.reclaim(1)):
            try:
                call()
            except SlotStateError as e:
                msgs.append(str(e))
            else:
                msgs.append("allowed")
        return msgs

    status, msgs = run_in_child(body)
    assert status == "ok", msgs
    me = os.getpid()
    for msg, what, action in zip(msgs, ("wait slot 1", "assign slot 0", "reclaim slot 1"),
                                 ("take the parent's batches", "assign the parent's slots",
                                  "reclaim the parent's slots")):
        assert msg.startswith(f"{what}: this process (pid ") and f"did not create the region (pid {me}); " \
            f"a forked child cannot {action}" in msg, msg
    assert r.state(0) == _ring.STATE_LEASED and r.state(1) == _ring.STATE_READY
    del lease
    assert r.state(0) == _ring.STATE_FREE
    got = r.wait(1, 0)
    assert got.seq == 2
    del got


def test_worker_pid_is_the_publishing_child_after_fork():
    r = create_region(1, PAGE)
    r.assign(0, 1)

    def body():
        r.begin(0, 1)
        r.publish(0, _ring.KIND_SLOT, 0, 0)
        return os.getpid()

    status, pid = run_in_child(body)
    assert status == "ok"
    lease = r.wait(0, 0)
    assert lease.worker_pid == pid != os.getpid()
    del lease


# ---- watch_parent ----------------------------------------------------------------------


def test_watch_parent_validation():
    with pytest.raises(TypeError, match="parent_pid must be an int, got str"):
        _ring.watch_parent("1")
    with pytest.raises(ValueError, match="parent_pid must be a positive process id, got 0"):
        _ring.watch_parent(0)


def test_watch_parent_survives_the_forking_thread_and_dies_with_the_process():
    life_r, life_w = os.pipe()   # the worker holds life_w: EOF = the worker is gone
    pong_r, pong_w = os.pipe()   # the worker answers after its forking thread ended
    go_r, go_w = os.pipe()       # closing go_w lets the middle process exit
    middle = os.fork()
    if middle == 0:  # pragma: no cover - middle process
        try:
            os.close(go_w)
            os.close(life_r)
            os.close(pong_r)
            me = os.getpid()

            def fork_worker():
                if os.fork() == 0:  # the worker; it keeps life_w open until it dies
                    try:
                        os.close(go_r)
                        _ring.watch_parent(me)
                        os.write(pong_w, b"k")
                        while True:
                            signal.pause()
                    finally:
                        os._exit(3)

            t = threading.Thread(target=fork_worker)
            t.start()
            t.join()  # the forking thread is gone: PR_SET_PDEATHSIG would kill the worker here
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(life_w)
    os.close(pong_w)
    os.close(go_r)
    try:
        ready, _, _ = select.select([pong_r], [], [], 10)
        assert ready and os.read(pong_r, 1) == b"k", "the worker died with its forking thread"
        os.close(go_w)
        go_w = -1
        os.waitpid(middle, 0)
        # EOF once the worker is gone; the 30 s only bound a test whose worker stays
        ready, _, _ = select.select([life_r], [], [], 30)
        assert ready and os.read(life_r, 1) == b"", "the worker outlived its parent by 30 s"
    finally:
        for fd in (life_r, pong_r, go_w):
            if fd >= 0:
                os.close(fd)


def test_watch_parent_of_a_dead_parent_exits_at_once():
    pid = os.fork()
    if pid == 0:  # pragma: no cover
        os._exit(0)
    os.waitpid(pid, 0)

    def body():
        _ring.watch_parent(pid)
        return "returned"

    assert run_in_child(body) == ("died", 1 << 8)  # exit status 1, nothing reported


def test_set_pdeathsig_is_an_alias_of_watch_parent():
    def body():
        _ring.set_pdeathsig(signal.SIGKILL, os.getppid())
        return "ok"

    assert run_in_child(body) == ("ok", "ok")
