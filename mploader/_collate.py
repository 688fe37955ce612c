"""Default collation: stack samples into caller-provided memory.

Each function serves both the in-process reference (``alloc=np.empty``) and the
worker, whose ``alloc`` hands out views into the slot payload: the output's shape
and dtype are computed from the samples first, then each sample is written once,
straight into its place (docs/design.md, "Collate into the slot").

Two rules live here:

* :func:`collate_gluon` -- MXNet Gluon's ``default_batchify_fn``: only tuples are
  structure; everything else becomes one array, as ``np.asarray`` makes it.  The
  Gluon and GluonNLP faces use it by default; :func:`default_batchify` is its
  in-process form.
* :func:`collate_nested` -- stack arrays and numbers, recursing into tuples, lists,
  dicts and namedtuples (mploader 0.1's default; ``mploader.batchify.Nested``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _columns

#: ``alloc(shape, dtype) -> ndarray``: returns a writable, C-contiguous, possibly
#: uninitialised array of exactly ``shape`` and ``dtype`` (a slot view in a worker).
Alloc = Callable[[tuple, np.dtype], np.ndarray]

_NUMBER_TYPES = (bool, int, float, complex, np.number, np.bool_)


def _heap_alloc(shape: tuple, dtype: Any) -> np.ndarray:
    """The ``alloc`` of in-process batchifying: an ordinary uninitialised array."""
    return np.empty(shape, dtype)


@functools.lru_cache(maxsize=256)
def _asarray_dtype(dtype: np.dtype, count: int) -> np.dtype:
    """The dtype ``np.asarray`` gives a list of ``count`` (1 or 2, meaning "more than
    one") arrays of ``dtype``: with several, NumPy promotes them to a common dtype,
    which makes the byte order native ('>i4' arrays give 'int32'); one is kept as is."""
    return np.asarray([np.zeros(1, dtype) for _ in range(count)]).dtype


def _uniform_arrays(samples: Sequence[Any]) -> bool:
    """Whether ``samples`` are plain ndarrays of one shape and one non-object dtype
    (checked in C: ``mploader._columns.uniform_arrays``)."""
    return _columns.uniform_arrays(samples if type(samples) is list else list(samples))


def _stack_into(samples: Sequence[np.ndarray], dtype: np.dtype, alloc: Alloc) -> np.ndarray:
    """Uniform arrays (see :func:`_uniform_arrays`) -> one (B, \\*shape) array of
    ``dtype`` from ``alloc``, each sample written once."""
    shape = samples[0].shape
    out = alloc((len(samples),) + shape, dtype)
    if out.size == 0:
        pass
    elif shape:
        if _columns.copy_rows(samples if type(samples) is list else list(samples), out):
            return out  # sample i at out[i], memcpy or streaming stores (docs/design.md, "Collate into the slot")
        # Byte-swapped or non-contiguous samples: NumPy's copy (equal shapes checked by the caller).
        rows = (len(samples) * shape[0],) + shape[1:]
        np.concatenate(samples, axis=0, out=out.reshape(rows), casting="equiv")
    else:
        for i, s in enumerate(samples):
            out[i] = s
    return out


def _asarray_into(samples: Sequence[Any], alloc: Alloc) -> Any:
    """``np.asarray(samples)`` written through ``alloc``; the list of the samples when
    NumPy cannot make a non-object array of them (ragged, mixed, arbitrary objects)."""
    if type(samples) is not list:
        samples = list(samples)
    if _columns.uniform_arrays(samples):
        return _stack_into(samples, _asarray_dtype(samples[0].dtype, min(len(samples), 2)), alloc)
    number_dtype = _columns.number_column_dtype(samples)
    if number_dtype is not None:  # B numbers of one type: the dtype np.asarray gives them, filled in C
        out = alloc((len(samples),), number_dtype)
        _columns.fill_numbers(samples, out)
        return out
    try:
        arr = np.asarray(samples)
    except (ValueError, TypeError, OverflowError):
        return list(samples)
    if arr.dtype.hasobject:
        return list(samples)
    out = alloc(arr.shape, arr.dtype)
    out[...] = arr
    return out


def collate_gluon(samples: Sequence[Any], alloc: Alloc = _heap_alloc) -> Any:
    """Batch ``samples`` by Gluon's rule (see :func:`default_batchify`), writing the
    arrays through ``alloc``.

    Parameters
    ----------
    samples : sequence
        The B samples of one batch, as ``dataset[i]`` returned them.
    alloc : callable ``(shape, dtype) -> ndarray``
        Returns a writable, uninitialised, C-contiguous array; called once per
        output array.
    """
    if isinstance(samples[0], tuple):
        try:
            columns = list(zip(*samples))
        except TypeError:  # a later sample is not iterable: Gluon's zip raises here
            return list(samples)
        return [collate_gluon(column, alloc) for column in columns]
    return _asarray_into(samples, alloc)


def default_batchify(samples: Sequence[Any]) -> Any:
    """Collate a list of samples into a batch, as MXNet Gluon's ``default_batchify_fn``.

    The rule of ``mxnet.gluon.data.dataloader.default_batchify_fn`` (MXNet 1.x),
    with NumPy arrays where Gluon made ``NDArray``:

    * if the first sample is a tuple (namedtuples included), the samples are
      zipped field by field (``zip``: the shortest sample sets the number of
      fields) and each field is batched by this rule; the result is a **list**
      (a namedtuple's type is not kept);
    * anything else becomes ``np.asarray(samples)``: B arrays of shape S give one
      array of shape (B, \\*S) (NumPy's dtype for them: byte order made native,
      promotion across samples), B numbers give shape (B,) (int -> int64, float ->
      float64, bool -> bool, NumPy scalars keep their dtype), B lists of numbers
      give (B, L), strings give a fixed-width string array.

    Where Gluon raises -- NumPy cannot build a non-object array (ragged shapes,
    ``None``, dicts, arbitrary objects) -- the batch is the list of the B samples
    unchanged (docs/faces.md, "Gluon DataLoader").  Never raises for unusual samples.
    A worker computes exactly this, but writes the arrays straight into a slot.
    """
    return collate_gluon(samples, _heap_alloc)


def collate_nested(samples: Sequence[Any], alloc: Alloc = _heap_alloc) -> Any:
    """Stack ``samples`` recursing into every container, writing arrays via ``alloc``.

    * ndarrays of one shape and dtype -> ndarray of shape (B, \\*sample_shape),
      same dtype (0-d and zero-size samples included);
    * Python or NumPy numbers -> 1-D ndarray of shape (B,) with NumPy's dtype for
      them (bool -> bool, int -> int64, float -> float64, complex -> complex128);
    * tuple or list -> list of the batched fields; namedtuple -> the same
      namedtuple type; dict -> dict with the same keys, in the first sample's order;
    * anything else, and any leaf that cannot be stacked (ragged shapes, mixed
      types, object dtype, str, None) -> the list of the B leaves unchanged.
    """
    first = samples[0]
    if isinstance(first, np.ndarray):
        if not _uniform_arrays(samples):
            return list(samples)
        return _stack_into(samples, first.dtype, alloc)
    if isinstance(first, _NUMBER_TYPES):
        column = samples if type(samples) is list else list(samples)
        number_dtype = _columns.number_column_dtype(column)
        if number_dtype is not None:
            out = alloc((len(column),), number_dtype)
            _columns.fill_numbers(column, out)
            return out
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
            return {k: collate_nested([s[k] for s in samples], alloc) for k in first}
        return list(samples)
    if isinstance(first, (tuple, list)):
        n = len(first)
        kind = type(first)
        if n == 0 or set(map(type, samples)) != {kind} or set(map(len, samples)) != {n}:
            return list(samples)
        columns = [collate_nested(list(col), alloc) for col in zip(*samples)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return kind(*columns)
        return columns
    return list(samples)
