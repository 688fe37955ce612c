"""Per-batch seeding (docs/design.md, "Per-batch seeding"): the state each generator
gets from a batch seed, checked through the generators' public getters against a
reference written here from the documented rule, on both paths: the in-place writes
and the fallback through ``random.setstate`` / ``np.random.set_state`` (forced with the
documented switch, ``_rng_state.forced_fallback()`` or ``MPLOADER_RNG_FALLBACK``)."""
from __future__ import annotations

import logging
import random
import sys
import types

import numpy as np
import pytest

import mploader
from mploader import _rng_memory, _rng_state, _worker

MASK64 = (1 << 64) - 1
NUMPY_SALT = 0x6E756D7079
PATHS = ["fast", "fallback"]


def splitmix_words(seed: int) -> list[int]:
    """624 uint32 words: the low, then the high half of each splitmix64 output."""
    x, out = seed & MASK64, []
    for _ in range(312):
        x = (x + 0x9E3779B97F4A7C15) & MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        out += [z & 0xFFFFFFFF, z >> 32]
    return out


@pytest.fixture(autouse=True)
def _fresh_layout(monkeypatch):
    """Each test checks the layout afresh and leaves it, and the caller's generators,
    as they were."""
    monkeypatch.delenv(_rng_state.FORCE_ENV, raising=False)
    saved = random.getstate(), np.random.get_state()
    _rng_state.recheck()
    yield
    monkeypatch.undo()
    _rng_state.recheck()
    random.setstate(saved[0])
    np.random.set_state(saved[1])


def on_path(path: str):
    """A context in which seeding takes ``path`` (asserted)."""
    if path == "fast":
        assert _rng_state.path() == "fast", _rng_state._Layout.reason
        return _nothing()
    return _rng_state.forced_fallback()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def states():
    """(random's state, NumPy's state as plain values)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return random.getstate(), (name, key.tolist(), pos, has_gauss, gauss)


def draws():
    """Draws that read every part of the states (words, position, cached Gaussians)."""
    return ([random.random() for _ in range(700)], random.gauss(0, 1), random.gauss(0, 1), random.getrandbits(64),
            np.random.standard_normal(3).tolist(), np.random.randint(0, 2**62, 4).tolist(),
            np.random.random(700).tolist())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32, 2**63 + 17, MASK64])
def test_the_generators_get_the_documented_states(seed, path):
    random.random()
    np.random.standard_normal()       # leaves a cached Gaussian behind
    random.gauss(0, 1)                # and Python's own
    with on_path(path):
        _worker.seed_rngs(seed)
        assert _rng_state.path() == path
    version, internal, gauss_next = random.getstate()
    assert list(internal) == splitmix_words(seed) + [624] and gauss_next is None
    name, key, pos, has_gauss, gauss = np.random.get_state()
    assert name == "MT19937" and key.tolist() == splitmix_words(seed ^ NUMPY_SALT)
    assert (pos, has_gauss, gauss) == (624, 0, 0.0)


def test_mt_words_is_the_documented_rule():
    for seed in (0, 7, 2**40 + 3, MASK64):
        assert list(np.frombuffer(_rng_memory.mt_words(seed), dtype=np.uint32)) == splitmix_words(seed)


def test_fast_path_and_fallback_give_identical_states_and_draws():
    """Many seeds, each seeded on both paths from a different prior state (a cached
    Gaussian on each side): states and draws are identical."""
    rng = random.Random(3)
    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, MASK64] + [rng.getrandbits(64) for _ in range(200)]
    assert _rng_state.path() == "fast", _rng_state._Layout.reason
    for seed in seeds:
        random.gauss(0, 1)
        np.random.standard_normal()
        _worker.seed_rngs(seed)
        fast = states(), draws()
        random.random()
        with _rng_state.forced_fallback():
            assert _rng_state.path() == "fallback"
            _worker.seed_rngs(seed)
            slow = states(), draws()
        assert fast == slow, seed


@pytest.mark.parametrize("path", PATHS)
def test_seeds_that_differ_above_32_bits_give_numpy_other_draws(path):
    """The old fallback passed ``seed & 0xFFFFFFFF`` to ``np.random.seed``: seeds that
    differ only in their high half drew the same NumPy numbers."""
    with on_path(path):
        got = []
        for seed in (5, 5 + 2**32, 5 + 2**40):
            _worker.seed_rngs(seed)
            got.append(np.random.random(4).tolist())
    assert len({tuple(g) for g in got}) == 3


def test_the_interpreter_is_checked_before_any_object_memory_is_read(monkeypatch, caplog):
    """Not CPython: the fallback, and no read of object memory happens at all."""
    def no_reads(*args):
        raise AssertionError("object memory read on an interpreter that is not CPython")

    for name in ("object_bytes", "field_bytes", "field_equal", "mt_seed", "field_clear", "state_offset"):
        monkeypatch.setattr(_rng_memory, name, no_reads)
    monkeypatch.setattr(sys, "implementation", types.SimpleNamespace(name="pypy"))
    with caplog.at_level(logging.INFO, logger="mploader"):
        assert _rng_state.path() == "fallback"
        _worker.seed_rngs(99)
        blob = _rng_state.capture()
        assert _rng_state.capture_if_changed(blob) is None
    assert random.getstate()[1] == tuple(splitmix_words(99)) + (624,)
    assert np.random.get_state()[1].tolist() == splitmix_words(99 ^ NUMPY_SALT)
    assert [r.getMessage() for r in caplog.records] == [
        "mploader: per-batch seeding and RNG state capture use random.setstate/getstate and "
        "np.random.set_state/get_state (the same states, slower): the interpreter is pypy, not CPython "
        "(its objects are not C structs)"]
    assert caplog.records[0].levelno == logging.INFO


def test_without_the_gil_the_fallback_is_used(monkeypatch):
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    assert _rng_state.path() == "fallback"
    assert _rng_state._Layout.reason == "the GIL is disabled (another thread could draw while a state is written)"
    _worker.seed_rngs(7)
    assert random.getstate()[1] == tuple(splitmix_words(7)) + (624,)


def test_a_layout_that_fails_its_check_is_not_used_and_is_logged_once(monkeypatch, caplog):
    """A struct whose bytes are not where the search found them (here: the copy read
    for the search is shifted by 4 bytes) fails the check against getstate()."""
    real = _rng_memory.object_bytes
    monkeypatch.setattr(_rng_memory, "object_bytes", lambda obj: b"\0\0\0\0" + real(obj))
    with caplog.at_level(logging.INFO, logger="mploader"):
        assert _rng_state.path() == "fallback"
        assert _rng_state.path() == "fallback"
        _worker.seed_rngs(2**40 + 3)
    assert [(r.levelno, r.getMessage().rsplit(": ", 1)[1]) for r in caplog.records] == [
        (logging.WARNING, "random.Random's state moved inside its object")]
    assert random.getstate()[1] == tuple(splitmix_words(2**40 + 3)) + (624,)
    assert np.random.get_state()[1].tolist() == splitmix_words((2**40 + 3) ^ NUMPY_SALT)


def test_a_generator_of_another_type_is_seeded_through_its_setstate(monkeypatch):
    """``random``'s module functions bound to an instance of a subclass: the in-place
    path does not apply to it, the fallback seeds that very instance."""
    class Mine(random.Random):
        pass

    mine = Mine(1)
    for name in ("setstate", "getstate", "random"):
        monkeypatch.setattr(random, name, getattr(mine, name))
    assert _rng_state.path() == "fallback"
    _worker.seed_rngs(31)
    assert mine.getstate()[1] == tuple(splitmix_words(31)) + (624,)


def test_the_environment_switch_forces_the_fallback(monkeypatch, caplog):
    monkeypatch.setenv(_rng_state.FORCE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="mploader"):
        assert _rng_state.path() == "fallback"
    assert caplog.records[0].getMessage().endswith(f": {_rng_state.FORCE_ENV}=1 is set")
    monkeypatch.setenv(_rng_state.FORCE_ENV, "0")
    _rng_state.recheck()
    assert _rng_state.path() == "fast"


def test_hot_takes_objects_and_offsets_inside_them():
    r = random.Random()
    size = type(r).__basicsize__
    with pytest.raises(ValueError, match=f"offset must leave 2500 bytes inside a Random \\({size} bytes\\), "
                                         f"got {size - 100}"):
        _rng_memory.mt_seed(r, size - 100, 1, True)
    with pytest.raises(ValueError, match="offset must leave 16 bytes inside a Random .*, got -1"):
        _rng_memory.field_clear(r, -1, 16)
    with pytest.raises(ValueError, match="at must leave 8 bytes inside 4 bytes of data, got 0"):
        _rng_memory.field_equal(r, 0, b"abcd", 0, 8)
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got bytes"):
        _rng_memory.tensor_equal(b"xyz", b"abcd", 0)
    bitgen = np.random.MT19937(5)
    offset = _rng_memory.state_offset(bitgen)
    assert _rng_memory.field_bytes(bitgen, offset, 4) == np.uint32(bitgen.state["state"]["key"][0]).tobytes()
    with pytest.raises(AttributeError):
        _rng_memory.state_offset(r)


def test_tensor_equal_compares_a_cpu_tensor_in_place():
    torch = pytest.importorskip("torch")
    t = torch.arange(5, dtype=torch.uint8)
    data = b"ab" + bytes(range(5))
    assert _rng_memory.tensor_equal(t, data, 2) and not _rng_memory.tensor_equal(t, data, 1)
    assert _rng_memory.tensor_equal(torch.arange(3, dtype=torch.int32), b"".join(
        int(i).to_bytes(4, sys.byteorder) for i in range(3)), 0)
    with pytest.raises(ValueError, match="at must leave 5 bytes inside 7 bytes of data, got 3"):
        _rng_memory.tensor_equal(t, data, 3)
    with pytest.raises(ValueError, match=r"tensor must be a contiguous CPU tensor, got one on cpu \(contiguous: "
                                         r"False\)"):
        _rng_memory.tensor_equal(torch.arange(6, dtype=torch.uint8).reshape(2, 3).t(), data, 0)


# ---- the loaders ----


class Augmented:
    """Each sample draws from ``random`` and NumPy's global RNG."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return np.array([i, random.random(), np.random.random(), np.random.standard_normal()])


def gluon_epochs(**kw):
    with mploader.DataLoader(Augmented(), batch_size=3, num_workers=2, seed=7, **kw) as loader:
        out = [[b.tolist() for b in loader] for _ in range(2)]
        return out, loader.stats()["seeding"]


def test_loaders_draw_the_same_augmentations_on_both_paths(monkeypatch):
    """Forked workers inherit the switch; spawned ones read the environment: the
    batches are those of the fast path, which are those of num_workers=0."""
    fast, seeding = gluon_epochs()
    assert seeding == "fast"
    with mploader.DataLoader(Augmented(), batch_size=3, num_workers=0, seed=7) as inline:
        assert [[b.tolist() for b in inline] for _ in range(2)] == fast
    with _rng_state.forced_fallback():
        assert gluon_epochs() == (fast, "fallback")
    monkeypatch.setenv(_rng_state.FORCE_ENV, "1")
    _rng_state.recheck()
    assert gluon_epochs(start_method="spawn") == (fast, "fallback")
