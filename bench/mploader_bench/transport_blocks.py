"""The transport suite's repetitions: what runs when (split from :mod:`.transport`).

A repetition either runs every transport once, one whole epoch each, in order
(:func:`plan` with ``blocks=0``), or, where rows get a share of copy-limit, runs
**bracketed**: each transport's run is split into `blocks` epochs and a copy-limit
block runs just before each of them and just after the last::

    copy-limit, A, copy-limit, A, copy-limit, B, copy-limit, B, copy-limit, collate-limit

A burst of other work on the machine (another tenant on the memory bus or the
cores) then hits a transport's block and the copy-limit blocks beside it alike,
so a row's share of copy-limit is taken against the copy-limit measured around
its own blocks (:func:`bracket_rate`), not against one copy-limit run seconds
away.  collate-limit runs once, unbracketed, at the end.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plan", "bracket_values", "bracket_rate", "steady", "merge", "BUS_LEVEL_CHANGE"]

#: Two copy-limit blocks, the faster at least this many times the slower: the memory
#: bus changed level between them (this VM's bus switches between ~600 and ~800-950
#: large batches/s; within a level its copy-limit blocks spread by up to ~1.2x), so a
#: block between them ran at an unknown level and has no reference to be divided by
#: (:func:`steady`; docs/bench.md, "The references: copy-limit and collate-limit").
BUS_LEVEL_CHANGE = 1.25


def plan(names: Sequence[str], *, copy_limit: str, unbracketed: Sequence[str] = (),
         blocks: int = 0, fewer: Mapping[str, int] | None = None) -> list[str]:
    """The order of one repetition's timed epochs.

    Parameters
    ----------
    names : sequence of str
        The live transports, in the suite's order (may include `copy_limit` and
        the `unbracketed` names).
    copy_limit : str
        The copy-limit row's name.
    unbracketed : sequence of str, optional
        Names that run once at the end, without copy-limit blocks beside them.
    blocks : int, optional
        Epochs per transport, each with a copy-limit block before it (and one after
        the last); 0 (or no `copy_limit` in `names`): every name once, in order.
    fewer : mapping of str to int, optional
        Names that get fewer blocks than `blocks` (at least 1 each): a slow
        transport whose epochs would be too short to hide an epoch's start.

    Returns
    -------
    list of str
        One name per timed epoch.

    Raises
    ------
    ValueError
        If `blocks` < 0.
    """
    if blocks < 0:
        raise ValueError(f"plan: blocks={blocks!r}: expected >= 0")
    if blocks == 0 or copy_limit not in names:
        return list(names)
    steps: list[str] = []
    for name in names:
        if name == copy_limit or name in unbracketed:
            continue
        for _ in range(max(1, min(blocks, (fewer or {}).get(name, blocks)))):
            steps += [copy_limit, name]
    if steps:
        steps.append(copy_limit)
    else:  # copy-limit alone: one block
        steps = [copy_limit]
    return steps + [n for n in names if n in unbracketed]


def bracket_values(steps: Sequence[tuple[str, float | None]], index: int, copy_limit: str) -> list[float]:
    """The rates of the copy-limit steps just before and just after step `index` that
    ran, in that order (empty when neither did); arguments as :func:`bracket_rate`."""
    around: list[float] = []
    for j in (index - 1, index + 1):
        rate = steps[j][1] if 0 <= j < len(steps) and steps[j][0] == copy_limit else None
        if rate:
            around.append(rate)
    return around


def bracket_rate(steps: Sequence[tuple[str, float | None]], index: int, copy_limit: str) -> float | None:
    """Copy-limit's rate around step `index`: the mean of the nearest copy-limit
    steps just before and just after it that ran (one if only one did).

    Parameters
    ----------
    steps : sequence of (name, batches per second or None)
        The repetition's steps as run (None: the step did not run or failed).
    index : int
        The step of interest.
    copy_limit : str
        The copy-limit row's name.

    Returns
    -------
    float or None
        None when neither neighbour is a copy-limit step that ran.
    """
    around = bracket_values(steps, index, copy_limit)
    return sum(around) / len(around) if around else None


def steady(around: Sequence[float] | None) -> bool:
    """Whether a block's copy-limit neighbours (:func:`bracket_values`) agree: the
    faster under :data:`BUS_LEVEL_CHANGE` x the slower (one neighbour: nothing says
    the level changed).  False without any."""
    if not around:
        return False
    return max(around) < BUS_LEVEL_CHANGE * min(around)


def merge(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One repetition's record of a transport from the records of its blocks.

    Batches, seconds and CPU seconds (also ``others_cpu_s``: the work of other
    processes meanwhile, over ``span_s`` wall seconds) add up; the rate is batches over seconds; the
    copy-limit around it (``copy_limit_batches_per_s``) is the mean of its blocks',
    and ``copy_limit_range`` the slowest and fastest copy-limit block beside any of
    its blocks (``[min, max]`` of the records' ``copy_limit_around``, :func:`bracket_values`;
    None when unbracketed).  ``steady`` (bracketed records only): the same over the
    blocks whose neighbours agree (:func:`steady`) -- ``blocks`` (how many),
    ``batches_per_s`` and ``copy_limit_batches_per_s`` (None when there are none) --
    what the share of copy-limit is taken from.  Each block is kept under ``blocks``
    (batches, seconds, batches_per_s, copy_limit_batches_per_s, copy_limit_around).

    Parameters
    ----------
    records : sequence of dict
        The blocks' records, in order (keys as :func:`mploader_bench.transport.run`'s
        ``runs``), at least one.

    Returns
    -------
    dict
        The first record's keys, summed or recomputed as above.
    """
    first = records[0]
    out = dict(first)
    for key in ("batches", "seconds", "parent_cpu_s"):
        out[key] = sum(r[key] for r in records)
    for key in ("workers_cpu_s", "others_cpu_s", "span_s"):
        xs = [r.get(key) for r in records]
        out[key] = None if any(x is None for x in xs) else sum(xs)
    out["batches_per_s"] = out["batches"] / out["seconds"]
    out["gb_per_s"] = first["gb_per_s"] / first["batches_per_s"] * out["batches_per_s"]
    out["verdict"] = records[-1].get("verdict")
    around = [r.get("copy_limit_batches_per_s") for r in records]
    known = [a for a in around if a]
    out["copy_limit_batches_per_s"] = sum(known) / len(known) if known else None
    beside = [v for r in records for v in r.get("copy_limit_around") or ()]
    out["copy_limit_range"] = [min(beside), max(beside)] if beside else None
    if beside:
        kept = [r for r in records if steady(r.get("copy_limit_around")) and r.get("copy_limit_batches_per_s")]
        out["steady"] = dict(blocks=len(kept), batches_per_s=None, copy_limit_batches_per_s=None)
        if kept:
            out["steady"].update(
                batches_per_s=sum(r["batches"] for r in kept) / sum(r["seconds"] for r in kept),
                copy_limit_batches_per_s=sum(r["copy_limit_batches_per_s"] for r in kept) / len(kept))
    if len(records) > 1 or first.get("copy_limit_batches_per_s") is not None:
        out["blocks"] = [dict(batches=r["batches"], seconds=r["seconds"], batches_per_s=r["batches_per_s"],
                              copy_limit_batches_per_s=r.get("copy_limit_batches_per_s"),
                              copy_limit_around=r.get("copy_limit_around"))
                         for r in records]
    methods: dict[str, list[float]] = {}
    for r in records:
        for m, rate in (r.get("methods_batches_per_s") or {}).items():
            methods.setdefault(m, []).append(rate)
    if methods:  # copy-limit: each method's rate over the repetition (batches / seconds)
        n = [r["batches"] for r in records]
        out["methods_batches_per_s"] = {
            m: sum(n) / sum(k / v for k, v in zip(n, rates)) for m, rates in methods.items()
            if len(rates) == len(records) and all(v > 0 for v in rates)}
    return out
