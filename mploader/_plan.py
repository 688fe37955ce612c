"""Batch plans: a repeating batch structure collated and described in one C call.

The worker loop (:mod:`mploader._worker`) owns the plans: it offers the samples of
every batch that the face calls plannable (:meth:`mploader._face.Face.plannable`)
to :meth:`Planner.publish`.  A worker's first batch of a structure goes the generic
way: the face's collate rule writes through ``SlotWriter.alloc``,
``SlotWriter.finish`` encodes the descriptor.  :meth:`Planner.learn` then records,
from that batch, where each field's column lies in the payload and the descriptor
bytes, in the worker's structure cache (:class:`mploader._descriptor.Structures`).
Every later batch of the same batch size is offered to :meth:`Planner.publish`
first: :meth:`mploader._columns.BatchPlan.fill` checks each sample against the plan
(exact types, dtypes, shapes) while it copies it into its column, writes the
recorded descriptor and the slot is published.  A batch that does not match goes
the generic way, in the same slot, and its structure becomes the plan (docs/design.md, "Batch plans").

The generic path is the definition; a plan is only made for the cases where the
rule's output is a function of the samples' types, dtypes and shapes alone:

* a sample is one leaf, or exactly a ``tuple`` of leaves;
* a leaf is an ndarray (C-contiguous, of a native dtype without objects, stacked
  as it is), a Python ``int`` (within int64), ``float`` or ``bool``, or a NumPy
  number of one type -- or a leaf the face plans itself (the torch face's tensors:
  :data:`OtherColumn`) -- and its column is one array the rule allocated in the slot.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _columns
from ._descriptor import Structures

__all__ = ["Plan", "Planner", "make_plan"]

#: Plans learnt in a row without one batch published by a plan, after which a
#: worker stops learning (a structure that changes with every batch).
MAX_UNUSED_PLANS = 8
#: Plans kept per worker (one per batch size: the last batch of an epoch is often
#: shorter).
MAX_PLANS = 8

_SCALAR_TYPES = (np.number, np.bool_)
_KINDS = _columns.PLAN_KINDS


def _field(leaf: Any, out: Any, batch_size: int, handed: dict) -> tuple | None:
    """``leaf``'s field entry for :class:`mploader._columns.BatchPlan` when its column
    is the array ``out`` that ``alloc`` handed out, else None."""
    if type(out) is not np.ndarray:
        return None
    hit = handed.get(id(out))
    if hit is None or hit[0] is not out or not out.flags.c_contiguous:
        return None
    offset, dtype = hit[1], out.dtype
    if not dtype.isnative or dtype.hasobject:
        return None
    t = type(leaf)
    if t is np.ndarray:
        if (leaf.dtype != dtype or out.shape != (batch_size,) + leaf.shape or not leaf.flags.c_contiguous
                or leaf.ndim > _columns.PLAN_DIMS):
            return None
        return (_KINDS["array"], t, dtype, leaf.shape, leaf.nbytes, offset)
    if out.shape != (batch_size,):
        return None
    want: np.dtype
    if t is int:
        kind, want = _KINDS["int"], np.dtype(np.int64)
    elif t is float:
        kind, want = _KINDS["float"], np.dtype(np.float64)
    elif t is bool:
        kind, want = _KINDS["bool"], np.dtype(np.bool_)
    elif isinstance(leaf, _SCALAR_TYPES) and t is not np.timedelta64:  # (its unit is per value)
        kind, want = _KINDS["scalar"], leaf.dtype
    else:
        return None
    if dtype != want:
        return None
    return (kind, t, None, (), dtype.itemsize, offset)


#: ``other(leaf, out, batch_size) -> fill or None``: a face's plan for a column of
#: leaves the C loop does not know (torch tensors), whose generic column is the array
#: ``out`` in the slot; ``fill(leaves, out) -> bool`` writes the B leaves into an
#: array at ``out``'s place, or returns False (nothing planned: the generic path runs).
OtherColumn = Callable[[Any, np.ndarray, int], Callable[[list, np.ndarray], bool] | None]


class Plan:
    """A :class:`mploader._columns.BatchPlan` and the columns a face fills itself."""

    __slots__ = ("batch_size", "columns", "core", "in_tuple", "total")

    def __init__(self, core: Any, in_tuple: bool, columns: list[tuple]) -> None:
        self.core, self.in_tuple, self.columns = core, in_tuple, columns
        self.batch_size, self.total = core.batch_size, core.total

    def fill(self, samples: list, writer: Any) -> bool:
        """Write ``samples`` and the descriptor into ``writer``'s slot (True), or
        decline (False; what was written is garbage the generic path overwrites)."""
        if not self.core.fill(samples, writer.base, writer.capacity):
            return False
        for j, fill, shape, dtype, offset in self.columns:
            leaves = [s[j] for s in samples] if self.in_tuple else samples
            if not fill(leaves, np.ndarray(shape, dtype, writer.mv, offset)):
                return False
        return True


def make_plan(samples: list, collated: Any, writer: Any, other: OtherColumn | None = None) -> Plan | None:
    """The :class:`Plan` of a batch the generic path has just published: ``samples``
    as the dataset returned them, ``collated`` what the collate rule made of them
    through ``writer.alloc``, ``writer`` the :class:`~mploader._descriptor.SlotWriter`
    whose ``finish`` published (with ``keep_descriptor`` set) a batch whose
    descriptor depends on nothing but ``collated``'s arrays (their dtypes, shapes and
    offsets).  ``other`` plans the columns of leaves this module does not know.  None when the
    structure cannot be planned (see the module's docstring)."""
    described = writer.described
    if described is None or type(samples) is not list or not samples:
        return None
    desc_off, enc_flags, descriptor = described  # (copied before publication: the slot may be reused since)
    if enc_flags or writer.mv is None:
        return None  # in-band pickles or strings: bytes that change with the batch
    first, batch_size = samples[0], len(samples)
    in_tuple = type(first) is tuple
    if in_tuple:
        if type(collated) not in (list, tuple) or len(collated) != len(first) or not first:
            return None
        pairs = zip(first, collated)
    else:
        pairs = zip((first,), (collated,))
    fields, columns = [], []
    for j, (leaf, out) in enumerate(pairs):
        field = _field(leaf, out, batch_size, writer.handed)
        if field is None and other is not None and type(out) is np.ndarray:
            hit = writer.handed.get(id(out))
            fill = other(leaf, out, batch_size) if hit is not None and hit[0] is out else None
            if fill is not None:
                field = (_KINDS["other"], type(leaf), None, (), 0, hit[1])
                columns.append((j, fill, out.shape, out.dtype, hit[1]))
        if field is None:
            return None
        fields.append(field)
    return Plan(_columns.BatchPlan(batch_size, in_tuple, fields, descriptor, desc_off), in_tuple, columns)


class Planner:
    """One worker's plans for one collate rule (see the module's docstring).

    The worker loop offers each plannable batch's samples to :meth:`publish`; when
    that declines it has the face collate them the generic way and hands the
    samples and the collated structure to :meth:`remember`; after the batch was
    published it calls :meth:`learn`.  The plans live in ``structures.plans`` (the
    worker's :class:`~mploader._descriptor.Structures`; a cache of its own when not
    given), keyed by batch size.
    """

    __slots__ = ("other", "pending", "plans", "structures", "unused")

    def __init__(self, other: OtherColumn | None = None, structures: Structures | None = None) -> None:
        if structures is None:
            structures = Structures(MAX_PLANS)
        self.other = other                  # the face's plans for other leaves (make_plan)
        self.structures = structures        # where the plans are kept
        self.plans: dict[int, Plan] = structures.plans  # (its dict, read once per batch)
        self.pending: tuple | None = None   # (samples, collated) of the batch being finished
        self.unused = 0                     # plans learnt since a plan last published a batch

    def publish(self, samples: list, writer: Any) -> bool:
        """Write and publish ``samples`` by the plan for their batch size, with
        ``writer.side`` after the descriptor; False (nothing published) when there is
        none or they do not match it."""
        if type(samples) is not list:
            return False  # (a dataset's __getitems__ may return another sequence)
        plan = self.plans.get(len(samples))
        if plan is None or not plan.fill(samples, writer) or not writer.publish_plan(plan.core):
            return False
        self.unused = 0
        return True

    def remember(self, samples: list, collated: Any) -> None:
        """Keep the generic batch for :meth:`learn` (unless learning stopped)."""
        if self.unused < MAX_UNUSED_PLANS:
            self.pending = (samples, collated)

    def learn(self, writer: Any) -> None:
        """Make the plan of the remembered batch, now published through ``writer``;
        only forget it when it was not published in the slot (``writer`` None or
        without ``described``: an error, the pipe)."""
        pending, self.pending = self.pending, None
        if pending is None or writer is None or writer.described is None:
            return
        plan = make_plan(pending[0], pending[1], writer, self.other)
        self.unused += 1
        if plan is not None:
            self.structures.keep_plan(plan.batch_size, plan)
