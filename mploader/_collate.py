"""The default batchify: stack samples into caller-provided memory.

One function serves both the in-process reference (``alloc=np.empty``) and the
worker, whose ``alloc`` hands out views into the slot payload: the output's shape
and dtype are computed from the samples first, then each sample is written once,
straight into its place (docs/design.md, "Collate into the slot").
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

#: ``alloc(shape, dtype) -> ndarray``: returns a writable, C-contiguous, possibly
#: uninitialised array of exactly ``shape`` and ``dtype`` (a slot view in a worker).
Alloc = Callable[[tuple, np.dtype], np.ndarray]

_NUMBER_TYPES = (bool, int, float, complex, np.number, np.bool_)
_NDARRAY_ONLY = {np.ndarray}


def _heap_alloc(shape: tuple, dtype: Any) -> np.ndarray:
    """The ``alloc`` of in-process batchifying: an ordinary uninitialised array."""
    return np.empty(shape, dtype)


def collate(samples: Sequence[Any], alloc: Alloc = _heap_alloc) -> Any:
    """Batch ``samples`` like :func:`default_batchify`, writing arrays via ``alloc``.

    Parameters
    ----------
    samples : sequence
        The B samples of one batch, as ``dataset[i]`` returned them.
    alloc : callable ``(shape, dtype) -> ndarray``
        Returns a writable, uninitialised, C-contiguous array; called once per
        stacked output array.

    Returns
    -------
    The batch; see :func:`default_batchify`.
    """
    first = samples[0]
    if isinstance(first, np.ndarray):
        dtype, shape = first.dtype, first.shape
        if (dtype.hasobject or set(map(type, samples)) != _NDARRAY_ONLY
                or {s.shape for s in samples} != {shape} or {s.dtype for s in samples} != {dtype}):
            return list(samples)
        out = alloc((len(samples),) + shape, dtype)
        if out.size == 0:
            pass
        elif shape:
            # One C call: sample i lands at out[i] (equal shapes checked above).
            rows = (len(samples) * shape[0],) + shape[1:]
            np.concatenate(samples, axis=0, out=out.reshape(rows), casting="no")
        else:
            for i, s in enumerate(samples):
                out[i] = s
        return out
    if isinstance(first, _NUMBER_TYPES):
        if not all(issubclass(t, _NUMBER_TYPES) and not issubclass(t, np.ndarray)
                   for t in set(map(type, samples))):
            return list(samples)
        try:
            arr = np.asarray(samples)
        except (OverflowError, ValueError, TypeError):
            return list(samples)
        if arr.dtype.hasobject or arr.ndim != 1:
            return list(samples)
        out = alloc(arr.shape, arr.dtype)
        out[...] = arr
        return out
    if isinstance(first, dict):
        keys = first.keys()
        if all(isinstance(s, dict) and s.keys() == keys for s in samples):
            return {k: collate([s[k] for s in samples], alloc) for k in first}
        return list(samples)
    if isinstance(first, (tuple, list)):
        n = len(first)
        kind = type(first)
        if n == 0 or set(map(type, samples)) != {kind} or set(map(len, samples)) != {n}:
            return list(samples)
        columns = [collate(list(col), alloc) for col in zip(*samples)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return kind(*columns)
        return columns
    return list(samples)


def default_batchify(samples: Sequence[Any]) -> Any:
    """Collate a list of samples into a batch (the in-process reference).

    As ``mxnet.gluon.data.batchify.Stack`` / Gluon's ``default_batchify_fn``,
    generalised to nested structures:

    * ndarrays of one shape and dtype -> ndarray of shape (B, \\*sample_shape),
      same dtype (0-d and zero-size samples included);
    * Python or NumPy numbers -> 1-D ndarray of shape (B,) with NumPy's dtype for
      them (bool -> bool, int -> int64, float -> float64, complex -> complex128);
    * tuple or list -> list of the batched fields (a tuple becomes a list, as
      Gluon); namedtuple -> the same namedtuple type; dict -> dict with the same
      keys, in the first sample's order;
    * anything else, and any leaf that cannot be stacked (ragged shapes, mixed
      types, object dtype, str, None) -> the list of the B leaves unchanged.

    Never raises for unusual samples: what cannot be stacked is passed through.
    A worker computes exactly this, but writes the arrays straight into a slot.
    """
    return collate(samples, _heap_alloc)
