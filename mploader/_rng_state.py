"""The global RNG states a torch-seeded worker carries from one batch to the next.

With torch's per-worker seeding (``mploader.torch.DataLoader`` without ``seed=``)
worker ``i`` seeds ``random``, NumPy's global RNG and torch's CPU generator once,
from ``base_seed + i``, and every batch it builds draws from where the previous one
left them.  A checkpoint therefore needs, for each worker, the three states after
the last batch of that worker the user received (issue 11, docs/design.md,
"Checkpoint state").  The worker calls :func:`capture` after each batch and ships
the result with the batch (one ``bytes`` leaf of the batch's descriptor); the
parent keeps the latest one per worker and turns it into JSON with :func:`to_json`
only when ``state_dict()`` is called; a resumed worker calls :func:`restore`.

:func:`capture` runs once per batch, so it reads the states' memory instead of
calling the public getters (``random.getstate()`` builds 625 ints, about 7 us;
``np.random.get_state()`` copies its key word by word, about 40 us):

* NumPy's MT19937 key and position through the bit generator's documented ctypes
  interface (``bit_generator.ctypes.state_address``, a ``mt19937_state``);
* the Python generator's index and words, and the legacy ``RandomState``'s cached
  Gaussian (``has_gauss``/``gauss``), at offsets inside their objects that are
  found once per process on private instances and checked against the public
  getters there (:func:`_calibrate`);
* torch's CPU generator with ``torch.default_generator.get_state()`` (a copy of
  its bytes, under 1 us).

Where a check fails (another interpreter, another NumPy) the public getters are
used instead: the same bytes, slower.  The blob never leaves the machine it was
made on (native byte order); :func:`to_json` is its portable form.
"""
from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any

import numpy as np

from . import _hot

__all__ = ["capture", "capture_if_changed", "to_json", "restore", "check_json"]

_MT_WORDS = 624
#: index (int32) + 624 uint32 words: CPython's RandomObject after PyObject_HEAD,
#: and (key, pos) the other way round for NumPy's mt19937_state.
_MT_BYTES = 4 + 4 * _MT_WORDS
_PY_GAUSS = struct.Struct("=B7xd")     # random.Random.gauss_next: (is set, value)
_NP_GAUSS = struct.Struct("=i4xd")     # aug_bitgen_t.has_gauss, gauss (an int, padding, a double)
_FIXED = _MT_BYTES + _PY_GAUSS.size + _MT_BYTES + _NP_GAUSS.size


class _Layout:
    """Offsets found by :func:`_calibrate` (None: use the public getters)."""

    py_state: int | None = None      # offset of RandomObject.index in a random.Random
    np_gauss: int | None = None      # offset of aug_bitgen_t.has_gauss in a RandomState
    done = False


def _calibrate() -> None:
    """Find the offsets on private instances and check every read against the public
    getters, twice (after a draw each); any mismatch leaves that offset None."""
    _Layout.done = True
    try:
        r = random.Random(20240611)
        base = random.Random.__basicsize__
        for attempt in range(2):
            version, internal, _ = r.getstate()
            raw = ctypes.string_at(id(r), base)
            words = struct.pack(f"={_MT_WORDS}I", *internal[:_MT_WORDS])
            off = raw.find(words) - 4 if attempt == 0 else _Layout.py_state
            if off is None or off < 0 or raw[off:off + _MT_BYTES] != struct.pack("=i", internal[-1]) + words:
                _Layout.py_state = None
                break
            _Layout.py_state = off
            r.random()
    except Exception:  # noqa: BLE001 - any surprise: the public getter
        _Layout.py_state = None
    try:
        rs = np.random.RandomState(20240611)
        base = type(rs).__basicsize__
        rs.standard_normal()   # generates two values and caches the second: has_gauss = 1
        st: Any = rs.get_state()
        raw = ctypes.string_at(id(rs), base)
        found = raw.find(struct.pack("=d", st[4]))
        off = found - 8
        ok = found >= 8 and _NP_GAUSS.unpack_from(raw, off) == (1, st[4])
        if ok:
            rs.standard_normal()   # takes the cached one: has_gauss = 0
            st = rs.get_state()
            ok = _NP_GAUSS.unpack(ctypes.string_at(id(rs) + off, _NP_GAUSS.size)) == (st[3], st[4]) and st[3] == 0
        if ok and _np_key(rs) != _np_key_public(rs):
            ok = False
        _Layout.np_gauss = off if ok else None
    except Exception:  # noqa: BLE001
        _Layout.np_gauss = None


def _np_key(rs: Any) -> bytes:
    """(key, pos) of ``rs``'s MT19937 through its ctypes interface."""
    return ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_BYTES)


def _np_key_public(rs: Any) -> bytes:
    st: Any = rs.get_state()
    return np.ascontiguousarray(st[1], dtype=np.uint32).tobytes() + struct.pack("=i", st[2])


def capture() -> bytes:
    """The states of ``random``, NumPy's global RNG and (when imported) torch's CPU
    generator, as one ``bytes`` (native byte order; :func:`to_json` reads it).
    About 1 us with the calibrated reads, about 50 us without."""
    if not _Layout.done:
        _calibrate()
    inst: Any = random._inst
    off = _Layout.py_state
    if off is not None and type(inst) is random.Random:
        py = ctypes.string_at(id(inst) + off, _MT_BYTES)
    else:
        _, internal, _ = inst.getstate()
        py = struct.pack(f"=i{_MT_WORDS}I", internal[-1], *internal[:_MT_WORDS])
    gauss_next = inst.gauss_next
    rs = np.random.mtrand._rand
    off = _Layout.np_gauss
    if off is not None and type(rs) is np.random.RandomState:
        npk = _np_key(rs)
        npg = ctypes.string_at(id(rs) + off, _NP_GAUSS.size)
    else:
        st: Any = rs.get_state()
        npk = np.ascontiguousarray(st[1], dtype=np.uint32).tobytes() + struct.pack("=i", st[2])
        npg = _NP_GAUSS.pack(st[3], st[4])
    torch = sys.modules.get("torch")
    th = b""
    if torch is not None and hasattr(torch, "default_generator"):   # not a half-imported torch
        th = torch.default_generator.get_state().numpy().tobytes()
    return b"".join((py, _PY_GAUSS.pack(gauss_next is not None, gauss_next or 0.0), npk, npg, th))


def capture_if_changed(last: bytes | None) -> bytes | None:
    """None when :func:`capture` would return ``last``, else what it returns.

    With the calibrated reads the states are compared in place with ``last``
    (``memcmp``; torch's generator through one ``get_state()``), about 1.5 us instead
    of 3 us for capturing and comparing; elsewhere this captures and compares."""
    if last is not None and len(last) >= _FIXED:
        inst: Any = random._inst
        rs = np.random.mtrand._rand
        py_off, np_off = _Layout.py_state, _Layout.np_gauss
        if (py_off is not None and np_off is not None and type(inst) is random.Random
                and type(rs) is np.random.RandomState):
            return None if _unchanged(last, inst, rs, py_off, np_off) else capture()
    blob = capture()
    return None if blob == last else blob


def _unchanged(last: bytes, inst: Any, rs: Any, py_off: int, np_off: int) -> bool:
    gauss_next = inst.gauss_next
    p = _MT_BYTES
    if not (_hot.mem_equal(id(inst) + py_off, last, 0, _MT_BYTES)
            and last[p:p + _PY_GAUSS.size] == _PY_GAUSS.pack(gauss_next is not None, gauss_next or 0.0)):
        return False
    p += _PY_GAUSS.size
    if not (_hot.mem_equal(rs._bit_generator.ctypes.state_address, last, p, _MT_BYTES)
            and _hot.mem_equal(id(rs) + np_off, last, p + _MT_BYTES, _NP_GAUSS.size)):
        return False
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "default_generator"):
        return len(last) == _FIXED
    state = torch.default_generator.get_state()
    n = state.numel()
    return len(last) == _FIXED + n and _hot.mem_equal(state.data_ptr(), last, _FIXED, n)


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
