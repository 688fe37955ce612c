"""What a face hands the worker loop: how one task's indices become a batch.

The engine's ``fetch`` is either a plain callable ``fetch(dataset, indices, alloc)
-> batch``, which the loop calls as it is, or a :class:`Face`, which splits that
call into the steps the loop runs itself (docs/faces.md, "The worker contract"):

1. ``samples = face.load(dataset, indices)`` -- read the samples (under
   ``on_error='skip'`` the loop repeats this step without the sample that raised);
2. ``face.plannable(dataset, samples)`` -- whether the collation of these samples
   is a function of their types, dtypes and shapes alone (mploader._plan); then the
   loop offers them to the worker's batch plan, which may write and publish the
   batch without steps 3-4;
3. ``collated = face.collate(samples, alloc)`` -- every array written through
   ``alloc`` (an array in the slot in a worker, ``np.empty`` in-process);
4. ``batch = face.wrap(collated)`` -- the object the parent receives; beside it,
   ``face.side()`` -- bytes the parent receives in the batch's tagged record, not
   in the batch (the torch face's RNG states: a per-slot side record).

The loop owns the plans, the slot writer and the publication: a face never sees
them.  ``Face.__call__`` is the same four steps without a plan, for the in-process
executors.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Alloc", "Face"]

#: ``alloc(shape, dtype) -> ndarray``: a writable, C-contiguous, uninitialised array of
#: exactly ``shape`` and ``dtype`` (a view of the slot in a worker).
Alloc = Callable[[tuple, Any], np.ndarray]


class Face:
    """The worker contract of a face (see the module docstring).  Subclasses
    implement :meth:`load` and :meth:`collate`; the rest has defaults: nothing is
    plannable, the batch is the collated object.

    ``other_columns``: the face's plans for leaf columns that :mod:`mploader._plan`
    does not know itself (:data:`mploader._plan.OtherColumn`; the torch face's
    tensors), or None.
    """

    __slots__ = ()

    other_columns: Callable | None = None

    def load(self, dataset: Any, indices: Any) -> Any:
        """The samples of one task (``indices`` as the face's sampler made them).
        Raises whatever reading the dataset raises."""
        raise NotImplementedError

    def collate(self, samples: Any, alloc: Alloc) -> Any:
        """The collated batch of ``samples``, its arrays from ``alloc``.  Raises
        what the collation rule raises for them."""
        raise NotImplementedError

    def plannable(self, dataset: Any, samples: Any) -> bool:
        """Whether ``collate(samples, alloc)`` follows :mod:`mploader._plan`'s rule
        (a sample is a leaf or a tuple of leaves, each column one array from
        ``alloc``, nothing else in the collated object), so that a batch plan may
        write it instead.  Default: False."""
        return False

    def side(self) -> bytes | None:
        """Bytes that travel beside the batch, not in it (the torch face's RNG states):
        the worker loop writes them after the batch's descriptor in the slot (or after
        the pickle on the pipe) and a tagged run hands them over as the record's last
        item (docs/design.md, "Checkpoint state").  Taken before a plannable batch is
        collated and after any other; None (the default) for none.  A face that does
        not override this costs the loop nothing per batch."""
        return None

    def wrap(self, collated: Any) -> Any:
        """The batch the parent receives, made of the collated object; a plannable
        batch's ``collated`` must be where the plan finds its columns.  Default:
        ``collated`` itself."""
        return collated

    def __call__(self, dataset: Any, indices: Any, alloc: Alloc) -> Any:
        """``fetch(dataset, indices, alloc)``: the four steps without a plan (the
        in-process executors; no :meth:`side`)."""
        return self.wrap(self.collate(self.load(dataset, indices), alloc))
