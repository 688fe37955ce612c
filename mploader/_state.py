"""Checkpoint state: the versioned, JSON-safe dicts of ``state_dict()`` / ``load_state_dict()``.

Every face saves where iteration stands as a plain dict (str keys; int, str, bool,
None, lists and dicts as values -- JSON-serialisable whenever the user's own
sampler/dataset states are), with ``"version": 1``.  docs/design.md ("Checkpoint
state") records the format and why it resumes exactly with any ``num_workers``.

Map-style loaders (Gluon, GluonNLP, PyTorch over a map-style dataset): the parent
dispatches every batch, so the position is ``(epoch, batches consumed in the epoch)``
plus what rebuilds the epoch's order: the state of the batch sampler (and of its
iterator) as it was when the epoch started -- or, for a state that counts the
batches its pass yielded, as it was right after the last batch received was pulled
(:class:`Snapshots`) -- and the base seed of the per-batch seeding ``(seed, epoch,
batch_index)``.  Resuming rebuilds the epoch's batch stream from that state and
starts the task stream at batch ``k``; a batch's indices and its
worker seed do not depend on which worker builds it, so the batches (values,
order, random augmentations) are the same for any worker count, 0 included.  A
batch is consumed when the user received it (or received its dataset's exception):
batches in flight at save time are built again after a resume.

Samplers, batch samplers, their iterators and datasets that have ``state_dict`` /
``load_state_dict`` are saved and restored by duck typing (:func:`save`,
:func:`restore`); the others must yield the same order when iterated again from the
same point (sequential, or seeded by the epoch) -- the resumed epoch is rebuilt by
iterating the batch sampler and skipping the ``k`` batches consumed, without
reading the dataset.
"""
from __future__ import annotations

import collections
import copy
import itertools
import pickle
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["VERSION", "StateMismatchError", "MapProgress", "MapState", "Snapshots", "check_state", "check_same",
           "check_field_int", "check_field_choice", "save", "restore", "type_name"]

#: The version of every state dict this module writes and accepts.
VERSION = 1
#: The largest epoch or batch count a state may hold: they travel to the workers as
#: int64 (mploader/_protocol.py), and an epoch must leave room for the next one.
INT64_MAX = (1 << 63) - 1


class StateMismatchError(ValueError):
    """A state cannot be loaded into this loader: another version, another kind of
    loader, or a configuration that changes the batches (dataset length, batch size,
    sampler type).  The message names the field and prints both values."""


def type_name(obj: Any) -> str:
    """``module.QualifiedName`` of ``obj``'s type (how states record sampler types)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_state(state: Any, kind: str, what: str = "loader") -> Mapping:
    """Check that ``state`` is a state dict of version :data:`VERSION` and of ``kind``.

    Raises
    ------
    TypeError
        ``state`` is not a dict.
    StateMismatchError
        Another version or kind (both values printed).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict returned by state_dict(), got {type(state).__name__}")
    version = state.get("version")
    if version != VERSION:
        raise StateMismatchError(f"cannot load a {what} state of version {version!r}: this mploader reads "
                                 f"version {VERSION}")
    saved_kind = state.get("kind")
    if saved_kind != kind:
        raise StateMismatchError(f"cannot load the state: it is a state of kind {saved_kind!r}, this {what} "
                                 f"takes kind {kind!r}")
    return state


def check_same(name: str, saved: Any, here: Any, what: str = "loader") -> None:
    """Refuse a state whose ``name`` differs from this loader's, printing both values.

    Raises
    ------
    StateMismatchError
        ``saved != here``.
    """
    if saved != here:
        raise StateMismatchError(f"cannot load the state: it was saved with {name}={saved!r}, this {what} has "
                                 f"{name}={here!r}")


def check_field_int(name: str, value: Any, minimum: int = 0, maximum: int | None = INT64_MAX,
                    none_ok: bool = False) -> int | None:
    """A state's integer field ``name``, checked to lie in ``[minimum, maximum]``
    (``maximum`` None: no upper bound).

    Raises
    ------
    StateMismatchError
        ``value`` is not an int (bools are not), or out of range: the message names
        the field, the value and the range (a ValueError for a wrong type too: a
        tampered state is bad input, whatever field was changed).
    """
    if value is None and none_ok:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise StateMismatchError(f"cannot load the state: {name} must be an int {bound}"
                                 f"{' or None' if none_ok else ''}, got {value!r:.80}")
    return value


def check_field_choice(name: str, value: Any, choices: tuple) -> Any:
    """A state's field ``name`` that must be one of ``choices``.

    Raises
    ------
    StateMismatchError
        ``value`` is not one of them (the message lists them).
    """
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise StateMismatchError(f"cannot load the state: {name} must be one of "
                                 f"{', '.join(map(repr, choices))}, got {value!r:.80}")
    return value


_ATOMS = frozenset((int, float, str, bool, type(None), bytes))


class _NotPlain(Exception):
    pass


def _plain_copy(obj: Any, depth: int) -> Any:
    t = type(obj)
    if t in _ATOMS:
        return obj
    if depth > 32:
        raise _NotPlain   # a deep (or cyclic) structure: deepcopy's memo handles it
    if t is dict:
        return {k if type(k) in _ATOMS else _plain_copy(k, depth + 1): _plain_copy(v, depth + 1)
                for k, v in obj.items()}
    if t is list:
        return [_plain_copy(v, depth + 1) for v in obj]
    if t is tuple:
        return tuple([_plain_copy(v, depth + 1) for v in obj])
    raise _NotPlain


def snapshot(state: Any) -> Any:
    """``copy.deepcopy(state)``; for a plain state (dicts, lists and tuples of ints,
    floats, strings, bools, None and bytes: a JSON-like ``state_dict()``) a faster
    copy of the same value -- 4-6x faster than ``deepcopy``, which an epoch's start
    pays up to 9 times (docs/design.md, "No gap between epochs").  A plain state
    holding the same object twice gets two equal copies, which a plain state cannot
    tell apart; anything else (an array, a tensor, a cycle) is deep-copied whole,
    sharing kept."""
    try:
        return _plain_copy(state, 0)
    except _NotPlain:
        return copy.deepcopy(state)


class StateToken:
    """A state not made yet: ``owner._state_from_token(token)`` makes it, the same dict
    ``owner.state_dict()`` returned when :func:`peek` took the token.  For samplers
    whose state is a function of a few immutable values -- mploader's
    ``DistributedBatchSampler`` and its passes (the epoch and the global batches
    yielded), ``BatchSampler`` over a ``SequentialSampler`` or a seeded
    ``RandomSampler`` (the carry and the epoch) -- so that the snapshots a pass takes
    after its pulls (:class:`Snapshots`) cost a tuple each, not state dicts and their
    copies.  Equal tokens of one owner are equal states."""

    __slots__ = ("owner", "token")

    def __init__(self, owner: Any, token: tuple) -> None:
        self.owner = owner
        self.token = token

    def __eq__(self, other: object) -> bool:
        return type(other) is StateToken and other.owner is self.owner and other.token == self.token

    __hash__ = None  # type: ignore[assignment]

    def state(self) -> Any:
        return self.owner._state_from_token(self.token)


def peek(obj: Any) -> Any:
    """:func:`save`, or a :class:`StateToken` where ``obj._state_token()`` gives one."""
    method = getattr(obj, "_state_token", None)
    token = method() if method is not None else None
    return StateToken(obj, token) if token is not None else save(obj)


def made(snap: Any) -> Any:
    """A deep copy of a snapshot taken with :func:`peek` (or a tuple of such), its
    tokens made into states."""
    if type(snap) is StateToken:
        return snap.state()
    if type(snap) is tuple:
        return tuple(made(x) for x in snap)
    return snapshot(snap)


def save(obj: Any) -> Any:
    """A deep copy of ``obj.state_dict()`` (:func:`snapshot`), or None when ``obj`` has
    no ``state_dict`` (the copy is a snapshot: later iteration does not change it)."""
    method = getattr(obj, "state_dict", None)
    if not callable(method):
        return None
    return snapshot(method())


def restore(obj: Any, state: Any, what: str, field: str = "") -> None:
    """``obj.load_state_dict(state)`` (with a copy of ``state``) unless ``state`` is None.

    Raises
    ------
    StateMismatchError
        ``state`` is not None but ``obj`` has no ``load_state_dict`` (the state was
        saved from a ``what`` of another type), or ``obj.load_state_dict`` raised a
        ValueError, TypeError, KeyError, IndexError, AttributeError or
        OverflowError: a state it cannot read, tampered or of another type (the
        message names the state's ``field`` and keeps the original message; the
        original is the ``__cause__``).
    """
    if state is None:
        return
    field = field or what
    method = getattr(obj, "load_state_dict", None)
    if not callable(method):
        raise StateMismatchError(f"cannot load the state: it holds a {what} state ({field}), but this loader's "
                                 f"{what} ({type_name(obj)}) has no load_state_dict")
    try:
        method(copy.deepcopy(state))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # A ValueError naming the field, as for every other field of a state.
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise StateMismatchError(f"{message} (state field {field}: the {what}'s load_state_dict refused "
                                 f"it)") from exc


_END = object()


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def _batch_size(batch_sampler: Any) -> int | None:
    """The batch sampler's ``batch_size`` (torch's, mploader's), None if it has none."""
    size = getattr(batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


#: How a batch sampler's state behaves within a pass (see :class:`Snapshots`).
UNDECIDED, PER_PASS, PER_BATCH = "undecided", "per pass", "per batch"
#: The snapshot of a pull whose sampler's state is per pass by construction (Snapshots.fixed).
_FIXED = ("per pass by construction",)


class Snapshots:
    """The states ``(batch sampler's, its iterator's)`` taken right after each batch
    was pulled, for a batch sampler (or iterator) with ``state_dict``.

    Two kinds of sampler state exist.  *Per pass*: the state describes a whole pass
    and does not move while the pass yields (mploader's samplers, samplers seeded by
    the epoch); resuming restores the state the pass started from and skips the
    batches received.  *Per batch*: the state counts what the pass has yielded and
    loading it makes the next pass continue from there (torchdata's
    ``StatefulDistributedSampler``, torchdata's iterators,
    :class:`~mploader.DistributedBatchSampler`); resuming restores the state taken
    right after the last batch received was pulled -- not the latest one: prefetch
    pulls ahead -- and skips nothing.  The first two pulls of a pass decide: a state
    that differs after the second pull from after the first is per batch.  (One pass
    of one batch stays undecided and is resumed per pass, which is exact for both
    there.)  A per-pass state is snapshotted twice per pass; a per-batch one after
    every pull, kept from the last batch received on.

    A per-batch state taken when no batch of the pass has been received (between
    passes, or right after ``iter()``) may still point at the end of the previous
    pass: ``StatefulDistributedSampler`` resets its count only when the next pass
    starts.  Loaded, it makes the next pass empty, while the live sampler's next pass
    is whole; so a resumed pass from such a state that turns out empty is started
    again once (:meth:`MapState._pulls`).  Between passes the state of a per-batch
    iterator is kept too, as its pass ended (``end``): loaded, its pass is empty and
    the one started again draws what the live batch sampler's next pass will (e.g.
    torchdata's ``RandomSampler`` regenerates the finished pass's permutation from
    its generator's state, which leaves the generator where the live one is)."""

    __slots__ = ("mode", "first", "after", "end", "fixed")

    def __init__(self, fixed: bool = False) -> None:
        self.mode = UNDECIDED
        # The batch sampler says its state moves only where a pass begins and ends
        # (``_state_tokens_per_pass``, a StateToken at the start, an iterator without
        # state): the first two pulls decide per pass without a snapshot (_FIXED).
        self.fixed = fixed
        self.first: Any = None
        self.after: collections.deque = collections.deque()   # (batch index, snapshot)
        self.end: Any = None   # a per-batch iterator's state once its pass is exhausted

    def pulled(self, batch_index: int, snap: tuple, consumed: int) -> None:
        if self.mode == UNDECIDED:
            if self.first is None:
                self.first = snap
            else:
                self.mode = PER_PASS if snap is self.first or _same(snap, self.first) else PER_BATCH
                if self.mode == PER_PASS:
                    self.after.clear()
                    return
        after = self.after
        after.append((batch_index, snap))
        while len(after) > 1 and after[0][0] < consumed - 1:
            after.popleft()

    def at(self, consumed: int) -> tuple | None:
        """The snapshot taken after batch ``consumed - 1`` was pulled."""
        for i, snap in self.after:
            if i == consumed - 1:
                return snap
        return None


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for states that may hold tensors or arrays (whose ``==`` is
    elementwise): containers are compared item by item, and a value whose ``==`` is
    not a plain truth value by its pickle."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an elementwise == (tensors, arrays): compare the bytes
        try:
            return pickle.dumps(a) == pickle.dumps(b)
        except Exception:  # noqa: BLE001 - unpicklable: treat as moved (per batch, the safe side)
            return False


class MapProgress:
    """Where one epoch of a map-style loader stands: its epoch, the batches the user
    has received (``consumed``: the contiguous prefix; ``ahead``: batch indices
    received beyond it, with ``in_order=False``), and the states that rebuild its
    batch stream (taken when the epoch started, or loaded: ``position`` is the
    batch index the rebuilt stream starts at), and the per-batch ``snaps``."""

    __slots__ = ("epoch", "consumed", "ahead", "sampler_state", "iter_state", "finished", "error", "rng_state",
                 "position", "snaps", "retry_empty")

    def __init__(self, epoch: int, consumed: int, ahead: set[int], sampler_state: Any, iter_state: Any,
                 error: BaseException | None, position: int = 0, snaps: Snapshots | None = None) -> None:
        self.epoch = epoch
        self.consumed = consumed
        self.ahead = ahead
        self.sampler_state = sampler_state
        self.iter_state = iter_state
        self.finished = False
        self.error = error
        self.rng_state: Any = None   # the sampler's RNG as the epoch's first batch was drawn
        self.position = position
        self.snaps = snaps
        self.retry_empty = 0   # iterators to make when the resumed pass is empty (MapState._pulls)

    def received(self, batch_index: int | None = None) -> None:
        """The user received batch ``batch_index`` (None: the next one in order).

        With a batch index it may be called again for the same batch (the torch face
        reports a result again when an interrupt cut its bookkeeping): the prefix
        moves in one store, and indices it passed leave ``ahead`` after it, so an
        interrupt anywhere leaves a state the second call completes.  ``ahead`` may
        then hold indices below ``consumed`` until the next call: readers skip them."""
        consumed = self.consumed
        if batch_index is None or batch_index == consumed:
            ahead = self.ahead
            consumed += 1
            while consumed in ahead:
                consumed += 1
            self.consumed = consumed
            if ahead:
                ahead.difference_update([i for i in ahead if i < consumed])
        elif batch_index > consumed:
            self.ahead.add(batch_index)


def _rng_state_of(rng: Any, held: Any) -> Any:
    """The JSON-safe state of ``rng`` as ``held`` (what its ``get()`` returned, or its
    ``snapshot()``), a new object."""
    to_state = getattr(rng, "to_state", None)
    return to_state(held) if to_state is not None else snapshot(held)


class MapState:
    """The checkpoint logic of a map-style loader, shared by the faces.

    The face calls :meth:`start_epoch` from ``__iter__`` (it returns the epoch's
    progress and its task stream ``(epoch, batch_index, indices)``), reports each
    batch the user receives to the progress, and forwards ``state_dict`` /
    ``load_state_dict``.

    Parameters
    ----------
    face : str
        The face's name, recorded in the state (informational: a state loads into
        any map-style face with the same configuration).
    dataset : object
        The dataset; its ``state_dict`` is saved when it has one.
    batch_sampler : iterable of index lists
        Re-iterated every epoch.
    rng : object with ``get() -> JSON-safe`` and ``set(state)``, optional (and, where
        the state is costly to make JSON-safe, ``snapshot()`` and ``to_state(snapshot)
        -> JSON-safe``: the first pull's state is taken as a snapshot)
        A random generator the sampler draws its order from lazily (torch's
        ``RandomSampler``): its state is taken just before the epoch's first batch is
        pulled, and on resume set for that pull.  Between
        epochs it is taken when the state is, and set by :meth:`load`.  A generator
        others draw from as well (``rng.shared``, torch's global one) is put back after
        that pull; the sampler's own generator goes on from the state it drew from.
    """

    def __init__(self, face: str, dataset: Any, batch_sampler: Any, rng: Any = None) -> None:
        self.face = face
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.rng = rng
        self.progress: MapProgress | None = None
        self.pending: dict | None = None   # a loaded state, for the next start_epoch
        self.mode: str | None = None   # how the last pass's batch sampler state behaved (Snapshots)
        self.workers: tuple | None = None   # a face's own bookkeeping of its running workers (the torch face's)

    # ---- iteration ----

    def start_epoch(self, epoch: int, it: Iterator | None = None,
                    iterators_per_epoch: int = 1) -> tuple[MapProgress, Iterator[tuple]]:
        """Begin epoch ``epoch`` (or, after :meth:`load`, the loaded epoch at its
        position; the face passes the epoch :meth:`load` returned).  The batch
        sampler's state is taken before ``iter()`` and its iterator's right after,
        each with :func:`peek` (a :class:`StateToken` where the sampler gives one, made
        into its dict only when :meth:`state` asks; a deep copy otherwise).  ``it``:
        the epoch's iterator when the face already made it (torch's iterators do);
        ``iterators_per_epoch``: how many times the face iterates the batch sampler at
        an epoch's start (torch's multi-process iterator makes two and uses the last: a
        sampler that draws when iterated, such as torchdata's ``RandomSampler``, draws
        twice), which a pass started again (:meth:`_pulls`) repeats."""
        pending, self.pending = self.pending, None
        consumed, ahead, position = 0, set(), 0
        error = None
        sampler_state = iter_state = None
        try:
            sampler_state = peek(self.batch_sampler)
        except Exception as exc:  # noqa: BLE001 - raised by state_dict(), not by iteration
            error = exc
        if it is None:
            it = iter(self.batch_sampler)
        if pending is not None:
            consumed, ahead = pending["batches_consumed"], set(pending["batches_ahead"])
            position = pending.get("batch_sampler_position", 0)
            if pending["batch_sampler_iter_state"] is not None:
                restore(it, pending["batch_sampler_iter_state"], "batch sampler's iterator",
                        "batch_sampler_iter_state")
        if error is None:
            try:
                iter_state = peek(it) if pending is None else snapshot(pending["batch_sampler_iter_state"])
            except Exception as exc:  # noqa: BLE001 - raised by state_dict(), not by iteration
                error = exc
        snaps = None
        if error is None and (callable(getattr(self.batch_sampler, "state_dict", None))
                              or callable(getattr(it, "state_dict", None))):
            snaps = Snapshots(type(sampler_state) is StateToken and iter_state is None
                              and getattr(self.batch_sampler, "_state_tokens_per_pass", False))
        self.mode = None
        progress = MapProgress(epoch, consumed, ahead, sampler_state, iter_state, error, position, snaps)
        if pending is not None and consumed == 0 and not ahead and pending.get("batch_sampler_mode") == PER_BATCH:
            progress.retry_empty = iterators_per_epoch
        rng_state = None
        if pending is not None and pending.get("rng_at") == "first_pull":
            rng_state = progress.rng_state = pending.get("rng_state")
        self.progress = progress
        return progress, self._tasks(progress, it, consumed, frozenset(ahead), rng_state)

    def _tasks(self, progress: MapProgress, it: Iterator, start: int, skip: frozenset,
               rng_state: Any) -> Iterator[tuple]:
        epoch, rng = progress.epoch, self.rng
        source = it   # the batch sampler's own iterator (its state is snapshotted)
        if rng is not None:   # the sampler draws its order from rng at the first pull
            first: Any = _END
            if rng_state is None:   # (a snapshot where the generator can take one cheaply)
                snapshot = getattr(rng, "snapshot", None)
                progress.rng_state = snapshot() if snapshot is not None else rng.get()
                first = next(it, _END)
            else:
                saved = rng.get() if getattr(rng, "shared", False) else None
                rng.set(rng_state)
                try:
                    first = next(it, _END)
                finally:
                    if saved is not None:   # a generator others draw from too: theirs again
                        rng.set(saved)
            if first is _END:
                return
            it = itertools.chain((first,), it)
        snaps = progress.snaps
        pulls = self._pulls(progress, it, source)
        for pulled in pulls:
            batches = [pulled]
            if snaps is not None and snaps.mode == UNDECIDED:
                ahead = next(pulls, None)   # a second pull decides how the state behaves
                if ahead is not None:
                    batches.append(ahead)
            for i, indices in batches:
                if i < start or i in skip:
                    continue   # consumed before the checkpoint: rebuilt, not loaded
                yield epoch, i, indices

    def _pulls(self, progress: MapProgress, it: Iterator, source: Iterator) -> Iterator[tuple[int, Any]]:
        """``(batch_index, indices)`` from ``it``, numbered from ``progress.position``,
        with the states of the batch sampler and of ``source`` (its iterator)
        snapshotted right after each pull (:class:`Snapshots`).  A pass resumed from a
        per-batch state with nothing received that yields nothing is started again,
        once (the state pointed at the end of the pass before; see :class:`Snapshots`)."""
        snaps = progress.snaps
        i = progress.position
        for attempt in (0, 1):
            for indices in it:
                if snaps is not None and snaps.mode != PER_PASS:
                    try:
                        snap = _FIXED if snaps.fixed else (peek(self.batch_sampler), peek(source))
                    except Exception as exc:  # noqa: BLE001 - raised by state_dict(): state() raises it
                        progress.error, progress.snaps, snaps = exc, None, None
                    else:
                        snaps.pulled(i, snap, progress.consumed)
                yield i, indices
                i += 1
            if i > progress.position or attempt or not progress.retry_empty:
                break
            for _ in range(progress.retry_empty):   # as the face starts an epoch
                it = source = iter(self.batch_sampler)
        if snaps is not None:
            self.mode = snaps.mode
            if snaps.mode == PER_BATCH:
                try:
                    snaps.end = save(source)
                except Exception as exc:  # noqa: BLE001 - raised by state_dict(): state() raises it
                    progress.error = exc

    # ---- checkpoints ----

    def state(self, next_epoch: int, seed: int, extra: dict | None = None) -> dict:
        """The state dict (see docs/design.md, "Checkpoint state").

        Raises
        ------
        Exception
            Whatever the batch sampler's ``state_dict`` raised when the epoch started
            (e.g. a ``RandomSampler(seed=None)``, whose order cannot be rebuilt).
        """
        progress = self.progress
        if self.pending is not None:
            return copy.deepcopy(self.pending)
        rng = self.rng
        position, mode = 0, self.mode
        if progress is None or progress.finished:
            epoch, consumed, ahead = next_epoch, 0, []
            sampler_state, iter_state = save(self.batch_sampler), None
            if progress is not None and progress.snaps is not None and progress.snaps.mode == PER_BATCH:
                iter_state = copy.deepcopy(progress.snaps.end)   # see Snapshots
            rng_state, rng_at = (rng.get(), "epoch_start") if rng is not None else (None, None)
        else:
            if progress.error is not None:
                raise progress.error
            epoch, consumed = progress.epoch, progress.consumed
            ahead = sorted(i for i in progress.ahead if i >= consumed)
            snaps, position = progress.snaps, progress.position
            mode = snaps.mode if snaps is not None else None
            snap = snaps.at(consumed) if snaps is not None and snaps.mode == PER_BATCH and consumed > position \
                else None
            if snap is not None:   # a per-batch state: as of the last batch received
                sampler_state, iter_state = made(snap)
                position = consumed
            else:
                sampler_state, iter_state = made((progress.sampler_state, progress.iter_state))
            rng_state, rng_at = None, None
            if rng is not None:   # before the first pull the generator has not drawn yet
                rng_state = _rng_state_of(rng, progress.rng_state) if progress.rng_state is not None else rng.get()
                rng_at = "first_pull"
        state = {
            "version": VERSION,
            "kind": "map",
            "face": self.face,
            "dataset_length": _length(self.dataset),
            "batch_sampler_type": type_name(self.batch_sampler),
            "batch_size": _batch_size(self.batch_sampler),
            "epoch": epoch,
            "batches_consumed": consumed,
            "batches_ahead": ahead,
            "batch_sampler_position": position,
            "batch_sampler_mode": mode,
            "seed": seed,
            "batch_sampler_state": sampler_state,
            "batch_sampler_iter_state": iter_state,
            "dataset_state": save(self.dataset),
            "rng_state": rng_state,
            "rng_at": rng_at,
        }
        if extra:
            state.update(extra)
        return state

    def load(self, state: Any, seed_none_ok: bool = False) -> dict:
        """Check ``state`` against this loader and restore the batch sampler and the
        dataset; the next :meth:`start_epoch` resumes at the saved position.  Returns
        the checked state (the face adopts ``state["epoch"]`` and ``state["seed"]``).

        Raises
        ------
        TypeError
            ``state`` is not a dict.
        StateMismatchError
            Another version or kind, another dataset length or batch sampler type, a
            batch sampler that refuses its state (batch size, sampler type), or a
            position outside the epoch.
        """
        state = check_state(state, "map")
        missing = [k for k in ("epoch", "batches_consumed", "batches_ahead", "seed", "batch_sampler_state",
                               "batch_sampler_iter_state", "dataset_state") if k not in state]
        if missing:
            raise StateMismatchError(f"cannot load the state: it lacks {', '.join(missing)}")
        check_same("dataset_length", state.get("dataset_length"), _length(self.dataset))
        check_same("batch_sampler_type", state.get("batch_sampler_type"), type_name(self.batch_sampler))
        if "batch_size" in state and state["batch_sampler_state"] is None:
            # The position counts batches of this size (torch's BatchSampler keeps no
            # state).  A batch sampler with a state of its own judges it itself:
            # mploader's BatchSampler refuses another batch_size, a
            # DistributedBatchSampler resumes with another world size (another
            # per-rank batch_size).  (States of mploader < 0.2 lack the field.)
            check_same("batch_size", state["batch_size"], _batch_size(self.batch_sampler), "batch sampler")
        self._check_fields(state, seed_none_ok)
        # The batches a pass yields may depend on the batch sampler's state (Gluon's
        # 'rollover' carries indices over): the position is checked against the
        # restored one, and a refused state puts the previous one back.
        previous = save(self.batch_sampler) if state["batch_sampler_state"] is not None else None
        restore(self.batch_sampler, state["batch_sampler_state"], "batch sampler", "batch_sampler_state")
        try:
            self._check_position(state)
        except StateMismatchError:
            restore(self.batch_sampler, previous, "batch sampler", "batch_sampler_state")
            raise
        restore(self.dataset, state["dataset_state"], "dataset", "dataset_state")
        if self.rng is not None and state.get("rng_at") == "epoch_start" and state.get("rng_state") is not None:
            self.rng.set(state["rng_state"])   # as it was before the saved loader's next iter()
        self.pending = copy.deepcopy(dict(state))
        self.progress = None
        return self.pending

    def _check_fields(self, state: Mapping, seed_none_ok: bool) -> None:
        """The fields :meth:`load` reads, checked before anything is restored (the
        position within the epoch is checked after the batch sampler's state is
        restored: :meth:`_check_position`).

        Raises
        ------
        StateMismatchError
            The first field out of range, named with its value and the range.
        """
        if not isinstance(state.get("face"), (str, type(None))):   # informational, but a str
            raise StateMismatchError(f"cannot load the state: face must be a str, got {state.get('face')!r:.80}")
        check_field_int("epoch", state["epoch"], maximum=INT64_MAX - 1)   # the next epoch must fit too
        check_field_int("seed", state["seed"], maximum=None, none_ok=seed_none_ok)
        check_field_int("num_workers", state.get("num_workers", 0))
        consumed = check_field_int("batches_consumed", state["batches_consumed"])
        assert consumed is not None
        check_field_int("batch_sampler_position", state.get("batch_sampler_position", 0), maximum=consumed)
        mode = check_field_choice("batch_sampler_mode", state.get("batch_sampler_mode"),
                                  (None, UNDECIDED, PER_PASS, PER_BATCH))
        if mode not in (PER_BATCH, UNDECIDED):   # a pass rebuilt from a state of its start
            check_field_int(f"batch_sampler_position (with batch_sampler_mode={mode!r})",
                            state.get("batch_sampler_position", 0), maximum=0)
        check_field_choice("rng_at", state.get("rng_at"), (None, "epoch_start", "first_pull"))
        rng_state = state.get("rng_state")
        if self.rng is not None and rng_state is not None:
            self.rng.check(rng_state, "rng_state")

    def _check_position(self, state: Mapping) -> None:
        """``batches_consumed`` and ``batches_ahead`` (checked ints) within the
        batches the (restored) batch sampler yields a pass."""
        consumed, position = state["batches_consumed"], state.get("batch_sampler_position", 0)
        length = _length(self.batch_sampler)
        last = INT64_MAX if length is None else position + length   # batch indices are below it
        if consumed > last:
            raise StateMismatchError(f"cannot load the state: batches_consumed={consumed} is beyond the epoch: "
                                     f"the batch sampler yields {length} batches a pass (from "
                                     f"batch_sampler_position={position}), so it must be in [0, {last}]")
        ahead = state["batches_ahead"]
        if not isinstance(ahead, list):
            raise StateMismatchError(f"cannot load the state: batches_ahead must be a list of batch indices, got "
                                     f"{ahead!r:.80}")
        for k, index in enumerate(ahead):
            check_field_int(f"batches_ahead[{k}]", index, minimum=consumed + 1, maximum=last - 1)
        if len(set(ahead)) != len(ahead):
            raise StateMismatchError(f"cannot load the state: batches_ahead must not repeat an index, got "
                                     f"{ahead!r:.80}")
