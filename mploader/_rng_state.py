"""The global RNG states: what per-batch seeding writes and the torch face captures.

Two users, one owner of the generators' memory layout:

* per-batch seeding (:func:`seed`, called by ``mploader._worker.seed_rngs``; docs/design.md,
  "Per-batch seeding") gives ``random``'s and NumPy's global Mersenne Twisters a fresh
  state that is a pure function of a 64-bit batch seed: 624 words of splitmix64
  output (``_rng_memory.mt_words``), position 624, no cached Gaussian;
* with torch's per-worker seeding (``mploader.torch.DataLoader`` without ``seed=``)
  worker ``i`` seeds ``random``, NumPy's global RNG and torch's CPU generator once,
  from ``base_seed + i``, and every batch it builds draws from where the previous one
  left them.  A checkpoint therefore needs, for each worker, the three states after
  the last batch of that worker the user received (issue 11, docs/design.md,
  "Checkpoint state").  The worker calls :func:`capture_if_changed` after each batch
  and ships the result with the batch (one ``bytes`` leaf of the batch's
  descriptor); the parent keeps the latest one per worker and turns it into JSON
  with :func:`to_json` only when ``state_dict()`` is called; a resumed worker calls
  :func:`restore`.

Both run once per batch, so where they can they write and read the states' memory in
place (``mploader._rng_memory``: the object and an offset inside its struct, never an
address) instead of calling the public setters and getters (``random.seed`` runs
``init_by_array``, 3.8 us; ``random.getstate()`` builds 625 ints, about 7 us;
``np.random.get_state()`` copies its key word by word, about 40 us):

* NumPy's MT19937 key and position inside its bit generator, found through the
  documented capsule (``bitgen_t.state``, ``_rng_memory.state_offset``);
* the Python generator's index and words, and the legacy ``RandomState``'s cached
  Gaussian (``has_gauss``/``gauss``), at offsets inside their objects found on
  private instances (:func:`_calibrate`);
* torch's CPU generator with ``torch.default_generator.get_state()`` /
  ``manual_seed`` (public either way).

The calibration first checks the interpreter (CPython, with the GIL: on another
runtime ``id()`` is not an address and object memory is not a struct; without the GIL
another thread may draw while the state is written) and then checks every read and
every write against the public getters on its private instances.  Where anything
fails -- or ``MPLOADER_RNG_FALLBACK=1`` is set, or :func:`forced_fallback` is active --
the **fallback** writes and reads the very same states through ``random.setstate`` /
``np.random.set_state`` and the getters: the same bits, slower.  A fast path and its
fallback give the same states (pinned by tests/test_seeding.py and
tests/test_state_rng.py); :func:`path` says which one is in use (the ``"seeding"`` key
of every face's ``stats()``) and logs the fallback once, with the reason, on the
``"mploader"`` logger.

The blob never leaves the machine it was made on (native byte order); :func:`to_json`
is its portable form.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import struct
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _rng_memory

__all__ = ["seed", "path", "forced_fallback", "FORCE_ENV", "capture", "capture_if_changed", "to_json", "restore",
           "check_json"]

_LOG = logging.getLogger("mploader")

#: Set to a non-empty value other than "0" in the environment, it makes every process
#: that starts with it (and the workers it forks or spawns) use the fallback.
FORCE_ENV = "MPLOADER_RNG_FALLBACK"

_MT_WORDS = 624
#: index (int32) + 624 uint32 words: CPython's RandomObject after PyObject_HEAD,
#: and (key, pos) the other way round for NumPy's mt19937_state.
_MT_BYTES = 4 + 4 * _MT_WORDS
_PY_GAUSS = struct.Struct("=B7xd")     # random.Random.gauss_next: (is set, value)
_NP_GAUSS = struct.Struct("=i4xd")     # aug_bitgen_t.has_gauss, gauss (an int, padding, a double)
_FIXED = _MT_BYTES + _PY_GAUSS.size + _MT_BYTES + _NP_GAUSS.size
_WORDS = struct.Struct(f"={_MT_WORDS}I")
#: XORed into the batch seed for NumPy's state, so that its stream differs from random's.
_NUMPY_SALT = 0x6E756D7079  # "numpy"
_MT19937 = np.random.MT19937
_RandomState = np.random.RandomState
assert _rng_memory.MT_STATE_BYTES == _MT_BYTES


class _Layout:
    """What :func:`_calibrate` found in this process (forked workers inherit it)."""

    done = False
    reason: str | None = None   # why the fallback is used (None: the offsets below are checked)
    expected = False            # the reason is the runtime or a switch, not a failed check
    py_state = 0                # offset of RandomObject.index in a random.Random
    np_key = 0                  # offset of mt19937_state in an MT19937
    np_gauss = 0                # offset of aug_bitgen_t.has_gauss in a RandomState
    forced = False              # forced_fallback() is active
    logged = False              # path() logged the fallback
    targets: tuple | None = None  # the last (generator, RandomState, MT19937) _fast() accepted


def _runtime_reason() -> str | None:
    """Why this interpreter or its environment rules the in-place path out (None: it
    does not).  Runs before any memory of an object is read."""
    if sys.implementation.name != "cpython":
        return f"the interpreter is {sys.implementation.name}, not CPython (its objects are not C structs)"
    gil = getattr(sys, "_is_gil_enabled", None)
    if gil is not None and not gil():
        return "the GIL is disabled (another thread could draw while a state is written)"
    value = os.environ.get(FORCE_ENV, "")
    if value not in ("", "0"):
        return f"{FORCE_ENV}={value} is set"
    return None


def _calibrate() -> None:
    """Check the interpreter, then find the offsets on private instances and check
    every read and write against the public getters (twice, after draws); sets
    ``_Layout.reason`` when anything is off."""
    _Layout.done = True
    _Layout.reason = _runtime_reason()
    _Layout.expected = _Layout.reason is not None
    if _Layout.reason is None:
        try:
            _Layout.reason = _find_python() or _find_numpy()
        except Exception as exc:  # noqa: BLE001 - any surprise: the fallback, and say why
            _Layout.reason = f"checking the generators' layout raised {type(exc).__name__}: {exc}"


def _find_python() -> str | None:
    r = random.Random(20240611)
    off = -1
    for _ in range(2):
        _, internal, _ = r.getstate()
        want = struct.pack(f"=i{_MT_WORDS}I", internal[-1], *internal[:_MT_WORDS])
        if off < 0:
            off = _rng_memory.object_bytes(r).find(want)
            if off < 0:
                return "random.Random's state was not found inside its object"
        if _rng_memory.field_bytes(r, off, _MT_BYTES) != want:
            return "random.Random's state moved inside its object"
        r.random()
    _rng_memory.mt_seed(r, off, 99, True)
    if r.getstate()[1] != struct.unpack(f"={_MT_WORDS}I", _rng_memory.mt_words(99)) + (_MT_WORDS,):
        return "a state written into random.Random is not what its getstate() returns"
    _Layout.py_state = off
    return None


def _find_numpy() -> str | None:
    rs = _RandomState(20240611)
    bitgen = rs._bit_generator
    if type(bitgen) is not _MT19937:
        return f"NumPy's RandomState draws from a {type(bitgen).__name__}, not an MT19937"
    key = _rng_memory.state_offset(bitgen)
    rs.standard_normal()   # generates two values and caches the second: has_gauss = 1
    st: Any = rs.get_state()
    raw = _rng_memory.object_bytes(rs)
    off = raw.find(struct.pack("=d", st[4])) - 8
    if off < 0 or raw[off:off + _NP_GAUSS.size] != _NP_GAUSS.pack(1, st[4]):
        return "RandomState's cached Gaussian was not found inside its object"
    for _ in range(2):
        if _rng_memory.field_bytes(bitgen, key, _MT_BYTES) != _np_public(st)[0]:
            return "MT19937's state (bitgen_t.state) is not what get_state() returns"
        if _rng_memory.field_bytes(rs, off, _NP_GAUSS.size) != _np_public(st)[1]:
            return "RandomState's cached Gaussian moved inside its object"
        rs.standard_normal()   # takes the cached one: has_gauss = 0
        st = rs.get_state()
    rs.standard_normal()
    _rng_memory.mt_seed(bitgen, key, 99, False)
    _rng_memory.field_clear(rs, off, _NP_GAUSS.size)
    st = rs.get_state()
    if (st[1].tobytes(), st[2], st[3], st[4]) != (_rng_memory.mt_words(99), _MT_WORDS, 0, 0.0):
        return "a state written into NumPy's MT19937 is not what get_state() returns"
    _Layout.np_key, _Layout.np_gauss = key, off
    return None


def _np_public(st: Any) -> tuple[bytes, bytes]:
    """(key + pos, has_gauss + gauss) of a ``get_state()`` tuple, as the blob holds them."""
    return (np.ascontiguousarray(st[1], dtype=np.uint32).tobytes() + struct.pack("=i", st[2]),
            _NP_GAUSS.pack(st[3], st[4]))


def _generators() -> tuple[Any, Any]:
    """The generators behind ``random``'s and ``np.random``'s module functions (the
    objects ``random.setstate`` and ``np.random.set_state`` are bound to)."""
    return getattr(random.setstate, "__self__", None), getattr(np.random.set_state, "__self__", None)


def _fast() -> tuple[Any, Any, Any] | None:
    """(random's generator, NumPy's RandomState, its MT19937) when the in-place path
    applies to them now; None: the fallback.  Once per batch or more: the objects
    accepted last are compared by identity (0.1 us), anything else checked afresh."""
    t = _Layout.targets
    if t is not None:
        try:
            if (random.setstate.__self__ is t[0] and np.random.set_state.__self__ is t[1]  # type: ignore[attr-defined]
                    and t[1]._bit_generator is t[2]):
                return t
        except AttributeError:   # a module function replaced by one that is not a bound method
            pass
    _Layout.targets = None
    if not _Layout.done:
        _calibrate()
    if _Layout.reason is not None or _Layout.forced:
        return None
    inst, rs = _generators()
    if type(inst) is not random.Random or type(rs) is not _RandomState:
        return None
    bitgen = rs._bit_generator
    if type(bitgen) is not _MT19937:
        return None
    _Layout.targets = (inst, rs, bitgen)
    return _Layout.targets


def path() -> str:
    """``"fast"`` when seeding and capture write and read the generators in place in
    this process now, ``"fallback"`` when they go through the public setters and
    getters (the same states, slower).  The first ``"fallback"`` answer of a process
    is logged on the ``"mploader"`` logger with the reason (INFO where the runtime or a
    switch asked for it, WARNING where a check of the layout failed)."""
    if _fast() is not None:
        return "fast"
    if not _Layout.logged:
        _Layout.logged = True
        reason, level = _Layout.reason, logging.INFO if _Layout.expected else logging.WARNING
        if reason is None:
            inst, rs = _generators()
            reason = ("forced_fallback() is active" if _Layout.forced else
                      f"the global generators are a {type(inst).__name__} and a {type(rs).__name__} "
                      f"({type(getattr(rs, '_bit_generator', None)).__name__}), not random.Random and "
                      "RandomState(MT19937)")
            level = logging.INFO
        _LOG.log(level, "mploader: per-batch seeding and RNG state capture use random.setstate/getstate and "
                        "np.random.set_state/get_state (the same states, slower): %s", reason)
    return "fallback"


@contextlib.contextmanager
def forced_fallback() -> Iterator[None]:
    """Inside the block this process (and the workers it forks) seed and capture
    through the public setters and getters, as where the layout is not recognised:
    the internal switch of the tests that compare both paths, and of
    ``bench/resume_cost.py``.  ``MPLOADER_RNG_FALLBACK=1`` does the same for a whole
    process and the workers it spawns."""
    saved = _Layout.forced, _Layout.logged
    _Layout.forced, _Layout.targets = True, None
    try:
        yield
    finally:
        _Layout.forced, _Layout.logged = saved   # a forced fallback's log line is not the process's


def recheck() -> None:
    """Forget the calibration (and whether the fallback was logged): the next use
    checks the interpreter, ``MPLOADER_RNG_FALLBACK`` and the layout again."""
    _Layout.done = _Layout.logged = False
    _Layout.reason = _Layout.targets = None


def seed(seed64: int) -> None:
    """Give ``random``'s and NumPy's global generators the state of batch seed
    ``seed64`` (docs/design.md, "Per-batch seeding"): Python's gets the words of
    ``_rng_memory.mt_words(seed64)``, NumPy's those of ``seed64 ^ 0x6E756D7079``, both at
    position 624, with no cached Gaussian.  In place (0.2 us each) or through
    ``random.setstate`` / ``np.random.set_state``: the same state either way."""
    t = _fast()
    if t is not None:
        inst, rs, bitgen = t
        _rng_memory.mt_seed(inst, _Layout.py_state, seed64, True)
        inst.gauss_next = None
        _rng_memory.mt_seed(bitgen, _Layout.np_key, seed64 ^ _NUMPY_SALT, False)
        _rng_memory.field_clear(rs, _Layout.np_gauss, _NP_GAUSS.size)
        return
    random.setstate((3, _WORDS.unpack(_rng_memory.mt_words(seed64)) + (_MT_WORDS,), None))
    # A tuple of ints, not an array (NumPy's stubs ask for one): MT19937's setter
    # indexes the key word by word, 2 us instead of 34 us; the same state.
    key = _WORDS.unpack(_rng_memory.mt_words(seed64 ^ _NUMPY_SALT))
    np.random.set_state(("MT19937", key, _MT_WORDS, 0, 0.0))  # type: ignore[arg-type]


def capture() -> bytes:
    """The states of ``random``, NumPy's global RNG and (when imported) torch's CPU
    generator, as one ``bytes`` (native byte order; :func:`to_json` reads it).
    About 1 us in place, about 50 us through the public getters (the same bytes)."""
    t = _fast()
    if t is not None:
        inst, rs, bitgen = t
        py = _rng_memory.field_bytes(inst, _Layout.py_state, _MT_BYTES)
        gauss_next = inst.gauss_next
        npk = _rng_memory.field_bytes(bitgen, _Layout.np_key, _MT_BYTES)
        npg = _rng_memory.field_bytes(rs, _Layout.np_gauss, _NP_GAUSS.size)
    else:
        _, internal, gauss_next = random.getstate()
        py = struct.pack(f"=i{_MT_WORDS}I", internal[-1], *internal[:_MT_WORDS])
        npk, npg = _np_public(np.random.get_state())
    torch = sys.modules.get("torch")
    th = b""
    if torch is not None and hasattr(torch, "default_generator"):   # not a half-imported torch
        th = torch.default_generator.get_state().numpy().tobytes()
    return b"".join((py, _PY_GAUSS.pack(gauss_next is not None, gauss_next or 0.0), npk, npg, th))


def capture_if_changed(last: bytes | None) -> bytes | None:
    """None when :func:`capture` would return ``last``, else what it returns.

    In place the states are compared with ``last`` where they lie (``memcmp``;
    torch's generator through one ``get_state()``), about 1.5 us instead of 3 us for
    capturing and comparing; the fallback captures and compares."""
    if last is not None and len(last) >= _FIXED:
        t = _fast()
        if t is not None:
            return None if _unchanged(last, *t) else capture()
    blob = capture()
    return None if blob == last else blob


def _unchanged(last: bytes, inst: Any, rs: Any, bitgen: Any) -> bool:
    gauss_next = inst.gauss_next
    p = _MT_BYTES
    if not (_rng_memory.field_equal(inst, _Layout.py_state, last, 0, _MT_BYTES)
            and last[p:p + _PY_GAUSS.size] == _PY_GAUSS.pack(gauss_next is not None, gauss_next or 0.0)):
        return False
    p += _PY_GAUSS.size
    if not (_rng_memory.field_equal(bitgen, _Layout.np_key, last, p, _MT_BYTES)
            and _rng_memory.field_equal(rs, _Layout.np_gauss, last, p + _MT_BYTES, _NP_GAUSS.size)):
        return False
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "default_generator"):
        return len(last) == _FIXED
    state = torch.default_generator.get_state()
    return len(last) == _FIXED + state.nbytes and _rng_memory.tensor_equal(state, last, _FIXED)


def to_json(blob: bytes) -> dict:
    """A :func:`capture` blob as a JSON-safe dict::

        {"python": {"state": [624 words..., index], "gauss_next": float or None},
         "numpy": {"key": [624 words], "pos": int, "has_gauss": int, "gauss": float},
         "torch": [uint8, ...] or None}

    (``random.getstate()[1:]``, ``np.random.get_state()[1:]`` and
    ``torch.get_rng_state().tolist()``)."""
    index, *words = struct.unpack_from(f"=i{_MT_WORDS}I", blob, 0)
    has_next, gauss_next = _PY_GAUSS.unpack_from(blob, _MT_BYTES)
    at = _MT_BYTES + _PY_GAUSS.size
    key = list(struct.unpack_from(f"={_MT_WORDS}I", blob, at))
    (pos,) = struct.unpack_from("=i", blob, at + 4 * _MT_WORDS)
    has_gauss, gauss = _NP_GAUSS.unpack_from(blob, at + _MT_BYTES)
    th = blob[_FIXED:]
    return {"python": {"state": words + [index], "gauss_next": gauss_next if has_next else None},
            "numpy": {"key": key, "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
            "torch": list(th) if th else None}


def check_json(state: Any, name: str) -> dict:
    """Check the shape of a :func:`to_json` dict loaded from a checkpoint.

    Raises
    ------
    ValueError
        A field is missing or has the wrong type or length (the message names
        ``name`` and the field).
    """
    def bad(field: str, value: Any) -> ValueError:
        return ValueError(f"cannot load the state: {name}[{field!r}] is not an RNG state, got {value!r:.80}")

    if not isinstance(state, dict):
        raise bad("", state)
    py, npy, th = state.get("python"), state.get("numpy"), state.get("torch")
    if not isinstance(py, dict) or not isinstance(py.get("state"), list) or len(py["state"]) != _MT_WORDS + 1:
        raise bad("python", py)
    if not isinstance(npy, dict) or not isinstance(npy.get("key"), list) or len(npy["key"]) != _MT_WORDS \
            or not isinstance(npy.get("pos"), int):
        raise bad("numpy", npy)
    if th is not None and not isinstance(th, list):
        raise bad("torch", th)
    return state


def restore(state: dict) -> None:
    """Set ``random``, NumPy's global RNG and (when both the state and this process
    have it) torch's CPU generator to a :func:`to_json` state."""
    py = state["python"]
    random.setstate((3, tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(npy["key"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["gauss"]))
    torch = sys.modules.get("torch")
    if state.get("torch") is not None and torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.set_state(torch.tensor(state["torch"], dtype=torch.uint8))
