"""The bad-sample policy: what happens when ``dataset[i]`` raises (``on_error``).

* ``"raise"`` (default, as upstream): the batch's ``next()`` raises the sample's
  exception; nothing here runs.
* ``"substitute"``: the worker loads another sample in its place, chosen from
  ``(seed, epoch, index)`` alone (:func:`substitute_index`; tried again with the next
  ``attempt`` when the substitute raises too, at most :data:`MAX_SUBSTITUTES` times).
  Every batch stays full, so every rank of a distributed job gets the same number of
  batches and the collectives stay in step; a rerun, any ``num_workers`` and a
  resumed run substitute the same samples.
* ``"skip"``: the batch is built without the sample (one sample shorter).  **Unsafe
  for DDP**: the ranks' batches differ in size, and a batch whose samples all fail
  raises.

Two sides (docs/design.md, "Bad samples"):

* the worker's :class:`Guard` wraps the dataset: it catches the exception, reports
  it to the parent on the worker's pipe (kind :data:`KIND_REPORT`, sent before the
  batch is published, so the parent has it when it takes the batch) and substitutes;
* the parent's :class:`Ledger` -- one per engine -- keeps the report (index,
  exception type and message, epoch, substitute), counts the budget
  (``max_bad_fraction`` of an epoch's samples delivered so far, over at least
  ``FRACTION_MIN_BAD / max_bad_fraction`` of them; ``max_bad_samples`` distinct indices
  over the run), logs one WARNING per distinct exception type, appends each record
  to ``bad_sample_log`` (JSON lines) and travels in checkpoints.
"""
from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Callable
from typing import Any

from ._protocol import PIPE_HEADER

__all__ = ["ON_ERROR", "KIND_REPORT", "MAX_SUBSTITUTES", "DEFAULT_MAX_BAD_FRACTION", "BadSampleBudgetError",
           "Guard", "Ledger", "parse_state", "count_samples", "substitute_index", "Skipped"]

_LOG = logging.getLogger("mploader")

ON_ERROR = ("raise", "skip", "substitute")
#: The pipe message kind of a bad-sample report (worker -> parent; mploader._protocol).
KIND_REPORT = 16
#: Substitutes tried for one bad sample before its exception is raised after all.
MAX_SUBSTITUTES = 8
#: The default budget: an epoch may have at most 1 % bad samples.
DEFAULT_MAX_BAD_FRACTION = 0.01
#: The fraction is judged over at least FRACTION_MIN_BAD / max_bad_fraction samples:
#: until then an epoch may have FRACTION_MIN_BAD bad ones (two bad samples among the
#: first 160 are 1.25 % and say nothing of a dataset with 0.1 % bad); a broken
#: dataset (half of it bad) still ends the run within ~20 samples.
FRACTION_MIN_BAD = 10
_MASK64 = (1 << 64) - 1
_SALT = 0x62616473616D706C  # "badsampl": substitutes draw from their own stream


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def substitute_index(seed: int, epoch: int, index: int, attempt: int, n: int) -> int:
    """The sample that replaces bad sample ``index`` at ``attempt`` (0, 1, ...): a pure
    function of ``(seed, epoch, index, attempt)``, uniform over ``[0, n)`` and never
    ``index`` itself (for ``n > 1``)."""
    x = _splitmix(_splitmix(_splitmix((seed ^ _SALT) & _MASK64) ^ (epoch & _MASK64)) ^ (index & _MASK64))
    j = _splitmix(x ^ attempt) % n
    return (j + 1) % n if j == index and n > 1 else j


class BadSampleBudgetError(RuntimeError):
    """More bad samples than the budget allows (``max_bad_fraction`` of an epoch's
    samples, or ``max_bad_samples`` distinct indices over the run).

    Attributes
    ----------
    report : list of dict
        Every bad sample met so far (as ``stats()["bad_samples"]``).
    """

    def __init__(self, message: str, report: list[dict]) -> None:
        super().__init__(message)
        self.report = report


class Skipped(Exception):
    """Raised by :class:`Guard` under ``"skip"``: ``index`` is left out of the batch."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class Guard:
    """The dataset as a worker's ``fetch`` sees it under ``"skip"``/``"substitute"``:
    ``guard[i]`` is ``dataset[i]``, or what the policy makes of its exception.
    Other attributes are the dataset's, except ``__getitems__`` (torch's batched
    fetch): samples are read one at a time, so that one bad sample is caught alone.
    """

    def __init__(self, dataset: Any, mode: str, seed: int, send: Callable[[bytes], None]) -> None:
        self._dataset = dataset
        self._mode = mode
        self._seed = seed
        self._send = send
        self._n = len(dataset)
        self.seq = 0
        self.epoch = 0
        self.batch_index = 0

    def __len__(self) -> int:
        return self._n

    def __getattr__(self, name: str) -> Any:
        if name == "__getitems__":
            raise AttributeError(name)
        return getattr(self._dataset, name)

    def __getitem__(self, index: Any) -> Any:
        dataset = self._dataset
        try:
            return dataset[index]
        except Exception as exc:
            if isinstance(index, bool) or not hasattr(index, "__index__"):
                raise   # (a batch of indices, a key: nothing to substitute)
            index = int(index)
            self._report(index, exc, None)
            if self._mode == "skip":
                raise Skipped(index) from exc
            first = exc
        for attempt in range(MAX_SUBSTITUTES):
            j = substitute_index(self._seed, self.epoch, index, attempt, self._n)
            try:
                sample = dataset[j]
            except Exception as exc:  # noqa: BLE001 - reported, and the next one is tried
                self._report(j, exc, None, substitute_for=index)
                continue
            self._report(index, first, j, note=True)
            return sample
        raise RuntimeError(f"sample {index} raised {type(first).__name__} and its {MAX_SUBSTITUTES} substitutes "
                           f"raised too (on_error='substitute')") from first

    def _report(self, index: int, exc: BaseException, substitute: int | None, substitute_for: int | None = None,
                note: bool = False) -> None:
        record = {"index": index, "epoch": self.epoch, "batch_index": self.batch_index,
                  "type": type(exc).__name__, "message": str(exc)[:500], "substitute": substitute}
        if substitute_for is not None:
            record["substitute_for"] = substitute_for
        if note:
            record["resolved"] = True   # the substitute that was used (the record before had none)
        self._send(PIPE_HEADER.pack(self.seq, KIND_REPORT) + pickle.dumps(record, protocol=5))

    def fetch(self, fetch: Callable, indices: Any) -> Any:
        """``fetch(indices)`` -- the face's fetch bound to this guard -- leaving out
        the samples that raise under ``"skip"`` (each leaves the batch one shorter).
        """
        if self._mode != "skip" or not isinstance(indices, list):
            return fetch(indices)
        left = list(indices)
        while True:
            try:
                return fetch(left)
            except Skipped as skip:
                fewer = _without(left, skip.index)
                if fewer == left:   # (not an index of this task: a dataset that indexes itself)
                    raise RuntimeError(f"sample {skip.index} raised inside batch {self.batch_index}, which does not "
                                       f"list it (sample indices {indices!r:.200}): on_error='skip' cannot leave it "
                                       f"out") from skip.__cause__
                left = fewer
                if not any(left) if all(isinstance(x, list) for x in left) else not left:
                    raise RuntimeError(f"every sample of batch {self.batch_index} (sample indices {indices!r:.200}) "
                                       f"raised (on_error='skip')") from skip.__cause__


def count_samples(indices: Any) -> int:
    """Samples a task asks for: its indices, those of its shards, or 1 (a key)."""
    if not isinstance(indices, list):
        return 1
    return sum(len(x) if isinstance(x, list) else 1 for x in indices)


def _without(indices: list, index: int) -> list:
    """``indices`` without ``index``, at the top level or inside shards (lists of
    indices: GluonNLP's ShardedDataLoader)."""
    return [(_without(x, index) if isinstance(x, list) else x) for x in indices
            if isinstance(x, list) or x != index]


class Ledger:
    """The parent's record of the bad samples (see the module docstring).

    Parameters
    ----------
    max_bad_fraction : float or None
        The most bad samples an epoch may have, as a fraction of the samples it has
        delivered so far, counted over at least ``FRACTION_MIN_BAD /
        max_bad_fraction`` samples (so up to FRACTION_MIN_BAD bad ones are allowed
        early in an epoch; none with 0).
    max_bad_samples : int or None
        The most distinct bad sample indices over the run (checkpoints carry it).
    log_path : str or None
        A JSON-lines file that gets one line per bad sample.
    """

    def __init__(self, max_bad_fraction: float | None, max_bad_samples: int | None, log_path: str | None) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.max_bad_samples = max_bad_samples
        self.log_path = log_path
        self.pending: dict[int, list[dict]] = {}     # seq -> records not yet settled
        self.records: list[dict] = []
        self.seen: set[tuple[int, int]] = set()      # (epoch, index) recorded
        self.indices: set[int] = set()               # distinct bad indices, all epochs
        self.epoch_samples: dict[int, int] = {}      # epoch -> samples delivered
        self.epoch_bad: dict[int, int] = {}          # epoch -> bad samples met
        self.warned: set[str] = set()

    def receive(self, msg: bytes) -> None:
        """A report message from a worker's pipe (kind KIND_REPORT)."""
        seq = PIPE_HEADER.unpack_from(msg)[0]
        self.pending.setdefault(seq, []).append(pickle.loads(memoryview(msg)[PIPE_HEADER.size:]))

    def settle(self, seq: int, epoch: int, nsamples: int) -> None:
        """Batch ``seq`` of ``epoch`` (``nsamples`` samples) is being delivered: its
        reports join the record, and the budget is checked.  Raises
        BadSampleBudgetError."""
        records = self.pending.pop(seq, ())
        self.epoch_samples[epoch] = self.epoch_samples.get(epoch, 0) + nsamples
        for r in records:
            if r.get("resolved"):
                continue   # (which substitute was used: folded into the record below)
            key = (r["epoch"], r["index"])
            if key in self.seen:
                continue   # a batch loaded again (watchdog): reported twice
            used = next((x["substitute"] for x in records if x.get("resolved") and x["index"] == r["index"]),
                        None)
            r = dict(r, substitute=used)
            self.seen.add(key)
            self.indices.add(r["index"])
            self.records.append(r)
            self.epoch_bad[epoch] = self.epoch_bad.get(epoch, 0) + 1
            self._tell(r)
        if records:
            self.check(epoch)

    def _tell(self, r: dict) -> None:
        if r["type"] not in self.warned:
            self.warned.add(r["type"])
            _LOG.warning("mploader: sample %d raised %s: %s (epoch %d; further %s are counted in "
                         "stats()['bad_samples'], not logged)", r["index"], r["type"], r["message"], r["epoch"],
                         r["type"])
        if self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")

    def check(self, epoch: int) -> None:
        """Raise BadSampleBudgetError if the budget is exceeded."""
        if self.max_bad_samples is not None and len(self.indices) > self.max_bad_samples:
            raise BadSampleBudgetError(
                f"{len(self.indices)} distinct samples raised, more than max_bad_samples={self.max_bad_samples}; "
                f"indices {sorted(self.indices)[:20]!r:.300}; the last: sample {self.records[-1]['index']} "
                f"raised {self.records[-1]['type']}: {self.records[-1]['message']:.200}", list(self.records))
        frac = self.max_bad_fraction
        if frac is not None:
            seen, bad = self.epoch_samples.get(epoch, 0), self.epoch_bad.get(epoch, 0)
            if bad > (frac * max(seen, FRACTION_MIN_BAD / frac) if frac > 0 else 0):
                raise BadSampleBudgetError(
                    f"{bad} of the {seen} samples of epoch {epoch} delivered so far raised ({bad / seen:.2%}), "
                    f"more than max_bad_fraction={frac}; the last: sample {self.records[-1]['index']} raised "
                    f"{self.records[-1]['type']}: {self.records[-1]['message']:.200}", list(self.records))

    def stats(self) -> dict:
        return {"bad_samples": [dict(r) for r in self.records], "bad_sample_count": len(self.records)}

    def state(self) -> dict:
        """JSON-safe: the report and the budget's counts (checkpoints)."""
        return {"records": [dict(r) for r in self.records],
                "epoch_samples": {str(k): v for k, v in self.epoch_samples.items()},
                "epoch_bad": {str(k): v for k, v in self.epoch_bad.items()}}

    def load(self, parsed: tuple) -> None:
        """Restore what :func:`parse_state` read from a checkpoint."""
        records, epoch_samples, epoch_bad = parsed
        self.records = [dict(r) for r in records]
        self.seen = {(r["epoch"], r["index"]) for r in records}
        self.indices = {r["index"] for r in records}
        self.epoch_samples, self.epoch_bad = dict(epoch_samples), dict(epoch_bad)
        self.warned = {r["type"] for r in records}
        self.pending.clear()


def parse_state(state: Any) -> tuple:
    """A checkpoint's ``bad_samples`` (:meth:`Ledger.state`; None or absent: an empty
    record) checked before anything is restored.  Raises ValueError naming the field."""
    if state is None:
        return [], {}, {}
    if not isinstance(state, dict) or not isinstance(state.get("records"), list):
        raise ValueError(f"cannot load the state: bad_samples must be a dict with a 'records' list, "
                         f"got {state!r:.100}")
    try:
        records = [dict(r) for r in state["records"]]
        for r in records:
            r["epoch"], r["index"], r["type"] = int(r["epoch"]), int(r["index"]), str(r["type"])
        epoch_samples = {int(k): int(v) for k, v in dict(state.get("epoch_samples", {})).items()}
        epoch_bad = {int(k): int(v) for k, v in dict(state.get("epoch_bad", {})).items()}
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load the state: bad_samples is malformed ({exc!r}): {state!r:.200}") from None
    return records, epoch_samples, epoch_bad
