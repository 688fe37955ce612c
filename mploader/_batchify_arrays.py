"""The array-producing batchify functions (``Stack``, ``Pad``), their base class
``Batchify`` and the ``alloc`` contract; :mod:`mploader.batchify` re-exports them
and builds the composites (``Tuple``, ``Dict``, ...) on top.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._collate import Alloc, _heap_alloc

__all__ = ["Batchify", "Stack", "Pad", "collate"]


def _allocate(alloc: Alloc, shape: tuple[int, ...], dtype: np.dtype, who: str) -> np.ndarray:
    """Call ``alloc`` and check that it kept its side of the contract.

    Raises
    ------
    ValueError
        If the array returned does not have exactly ``shape`` and ``dtype``,
        is not writable, or is not C-contiguous.
    """
    out = alloc(shape, dtype)
    if (
        not isinstance(out, np.ndarray)
        or out.shape != shape
        or out.dtype != dtype
        or not out.flags.writeable
        or not out.flags.c_contiguous
    ):
        desc = (
            f"array of shape {out.shape}, dtype {out.dtype}, "
            f"writeable={out.flags.writeable}, c_contiguous={out.flags.c_contiguous}"
            if isinstance(out, np.ndarray)
            else type(out).__name__
        )
        raise ValueError(
            f"{who}: alloc{(shape, str(dtype))} returned {desc}; expected a writable "
            f"C-contiguous array of shape {shape}, dtype {dtype}"
        )
    return out


def _as_dtype(name: str, dtype: Any) -> np.dtype | None:
    """Normalise a ``dtype`` argument, or raise naming the argument."""
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy dtype or None, got {dtype!r}") from None


def check_samples(samples: Any, who: str) -> Sequence[Any]:
    """Return ``samples`` as a sequence; raise if it is empty."""
    if not isinstance(samples, Sequence):
        samples = list(samples)
    if len(samples) == 0:
        raise ValueError(f"{who}: got no samples; a batch needs at least one")
    return samples


def _to_array(sample: Any, i: int, who: str) -> np.ndarray:
    """``numpy.asarray(sample)`` with an error that names the sample."""
    try:
        arr = np.asarray(sample)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{who}: sample {i} cannot be converted to an array: {exc}") from exc
    if arr.dtype == object:
        raise TypeError(
            f"{who}: sample {i} ({type(sample).__name__}) converts to an object array; "
            "only numeric, bool and fixed-width string data can be batched "
            "(use List() to keep arbitrary objects)"
        )
    return arr


def collate(fn: Callable[[list[Any]], Any], samples: Sequence[Any], alloc: Alloc) -> Any:
    """Batch ``samples`` with ``fn``, into ``alloc`` memory when ``fn`` supports it.

    Parameters
    ----------
    fn : Batchify or callable
        A :class:`Batchify` (its ``collate`` is used) or a plain batchify
        function ``fn(samples)`` (called as is; its result is not placed in
        ``alloc`` memory).
    samples : sequence
        The samples of one batch.
    alloc : callable
        ``alloc(shape, dtype) -> ndarray``, see the module docstring.

    Returns
    -------
    object
        The batch.
    """
    method = getattr(fn, "collate", None)
    if method is not None:
        return method(samples, alloc)
    return fn(list(samples))


class Batchify:
    """Base class of the batchify functions.

    Subclasses implement :meth:`collate`; ``__call__`` collates into ordinary
    heap memory.
    """

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> Any:
        """Merge ``samples`` into one batch whose arrays come from ``alloc``.

        ``alloc(shape, dtype)`` is called once per output array, after the
        output shapes are known, and must return a writable C-contiguous
        ``ndarray`` of exactly that shape and dtype (its contents are
        overwritten entirely).

        Raises
        ------
        NotImplementedError
            In the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement collate")

    def __call__(self, samples: Sequence[Any]) -> Any:
        """Merge ``samples`` into one batch of ordinary NumPy arrays.

        Same as ``self.collate(samples, alloc)`` with ``alloc = numpy.empty``.
        """
        return self.collate(samples, _heap_alloc)


class Stack(Batchify):
    """Stack samples of one shape into a batch, as ``gluonnlp.data.batchify.Stack``.

    Parameters
    ----------
    dtype : str or numpy.dtype, optional
        Output dtype. ``None`` (default) uses the dtype NumPy gives the whole
        list of samples (``numpy.asarray(samples).dtype``, e.g. int64 for
        Python ints, the promoted dtype for arrays of mixed dtypes), as
        GluonNLP does. Values are cast unsafely, like ``ndarray.astype``.

    Returns
    -------
    ndarray of shape (N, *sample_shape)
        From ``collate``/``__call__``, for ``N`` samples of ``sample_shape``
        (``()`` for scalars). One ``alloc`` call.

    Raises
    ------
    TypeError
        At construction, if ``dtype`` is not a dtype. At collation, if a sample
        converts to an object array (e.g. ragged nested lists of objects).
    ValueError
        At collation, if there are no samples, a sample cannot be converted to
        an array, or the samples' shapes differ, e.g.
        ``"Stack: sample 3 has shape (4,), expected (5,) like sample 0"``.

    Examples
    --------
    >>> Stack()([[1, 2], [3, 4], [5, 6]]).tolist()
    [[1, 2], [3, 4], [5, 6]]
    >>> Stack(dtype='float32')([1, 2, 3]).dtype
    dtype('float32')
    """

    def __init__(self, dtype: Any = None) -> None:
        self._dtype = _as_dtype("dtype", dtype)

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> np.ndarray:
        samples = check_samples(samples, "Stack")
        arrays = [_to_array(s, i, "Stack") for i, s in enumerate(samples)]
        shape = arrays[0].shape
        for i, arr in enumerate(arrays):
            if arr.shape != shape:
                raise ValueError(
                    f"Stack: sample {i} has shape {arr.shape}, expected {shape} like sample 0"
                )
        dtype = self._dtype
        if dtype is None:
            try:
                dtype = np.result_type(*[arr.dtype for arr in arrays])
            except TypeError as exc:
                kinds = sorted({str(arr.dtype) for arr in arrays})
                raise TypeError(f"Stack: samples have no common dtype ({kinds}): {exc}") from exc
        out = _allocate(alloc, (len(arrays),) + shape, dtype, "Stack")
        np.stack(arrays, axis=0, out=out, casting="unsafe")
        return out

    def __repr__(self) -> str:
        return f"Stack(dtype={None if self._dtype is None else str(self._dtype)!r})"


class Pad(Batchify):
    """Pad samples to a common length along one axis and stack them.

    As ``gluonnlp.data.batchify.Pad`` (0.10). Every sample is an array (or a
    nested list) of the same number of dimensions; their sizes may differ
    along ``axis`` only. Sample ``i`` of length ``L_i`` along ``axis`` occupies
    ``out[i, ..., :L_i, ...]`` and the rest of ``out[i]`` holds ``pad_val``.

    Parameters
    ----------
    axis : int, default 0
        The sample axis to pad (negative counts from the end of the sample's
        dimensions, as in NumPy).
    pad_val : number, optional
        Padding value. ``None`` (default) means 0 and, as in GluonNLP, emits a
        ``UserWarning`` asking whether 0 is really the padding index intended.
        It is converted to the output dtype as ``numpy.full`` would.
    ret_length : bool, default False
        Also return each sample's original length along ``axis``.
    dtype : str or numpy.dtype, optional
        Output dtype. ``None`` (default) follows GluonNLP: the dtype of sample 0
        when it is an ``ndarray``, float32 otherwise (lists of numbers, which
        GluonNLP converts through ``mx.nd.array``'s float32 default). Values
        are cast unsafely, like ``ndarray.astype``.
    round_to : int, optional
        Round the padded length up to a multiple of ``round_to``:
        ``round_to * ceil(max_i L_i / round_to)``.

    Returns
    -------
    batch : ndarray of shape (N, *padded_sample_shape)
        ``padded_sample_shape`` is sample 0's shape with ``axis`` replaced by
        the padded length.
    valid_length : ndarray of shape (N,), dtype int32
        Only if ``ret_length``; returned as ``(batch, valid_length)``. The
        ``alloc`` calls are made in that order.

    Raises
    ------
    TypeError
        At construction, if ``axis`` or ``round_to`` is not an int or ``dtype``
        is not a dtype. At collation, if a sample is 0-dimensional (a scalar
        has no axis to pad) or converts to an object array.
    ValueError
        At construction, if ``round_to < 1``. At collation, if there are no
        samples, ``axis`` is out of range for the samples' dimensions, or the
        samples differ in anything but their length along ``axis``.
    OverflowError
        If ``pad_val`` does not fit the output dtype (NumPy's own error).

    Examples
    --------
    >>> Pad(pad_val=0)([[1, 2, 3, 4], [4, 5, 6], [8, 2]]).tolist()
    [[1.0, 2.0, 3.0, 4.0], [4.0, 5.0, 6.0, 0.0], [8.0, 2.0, 0.0, 0.0]]
    >>> batch, length = Pad(pad_val=-1, ret_length=True, round_to=4)(
    ...     [np.array([1, 2, 3, 4, 5]), np.array([6])])
    >>> batch.tolist(), length.tolist()
    ([[1, 2, 3, 4, 5, -1, -1, -1], [6, -1, -1, -1, -1, -1, -1, -1]], [5, 1])
    """

    def __init__(
        self,
        axis: int = 0,
        pad_val: Any = None,
        ret_length: bool = False,
        dtype: Any = None,
        round_to: int | None = None,
    ) -> None:
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"axis must be an int, got {axis!r} ({type(axis).__name__})")
        if round_to is not None:
            if isinstance(round_to, bool) or not isinstance(round_to, (int, np.integer)):
                raise TypeError(
                    f"round_to must be an int or None, got {round_to!r} "
                    f"({type(round_to).__name__})"
                )
            if round_to < 1:
                raise ValueError(f"round_to must be positive, got {round_to}")
            round_to = int(round_to)
        if pad_val is None:
            warnings.warn(
                "Pad: pad_val was not given and defaults to 0; check that 0 is the padding "
                "value you intend (e.g. the padding index of your vocabulary)",
                UserWarning,
                stacklevel=2,
            )
            pad_val = 0
        self._axis = int(axis)
        self._pad_val = pad_val
        self._ret_length = bool(ret_length)
        self._dtype = _as_dtype("dtype", dtype)
        self._round_to = round_to

    def collate(
        self, samples: Sequence[Any], alloc: Alloc
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        samples = check_samples(samples, "Pad")
        arrays = [_to_array(s, i, "Pad") for i, s in enumerate(samples)]
        first = arrays[0]
        if first.ndim == 0:
            raise TypeError(
                f"Pad: sample 0 is 0-dimensional ({type(samples[0]).__name__}); Pad needs "
                "arrays or lists with at least one axis (use Stack for scalars)"
            )
        ndim = first.ndim
        if not -ndim <= self._axis < ndim:
            raise ValueError(
                f"Pad: axis={self._axis} is out of range for samples with {ndim} "
                f"dimension(s) (sample 0 has shape {first.shape})"
            )
        axis = self._axis % ndim
        expected = first.shape[:axis] + ("*",) + first.shape[axis + 1:]
        for i, arr in enumerate(arrays):
            if arr.ndim != ndim or (
                arr.shape[:axis] != first.shape[:axis]
                or arr.shape[axis + 1:] != first.shape[axis + 1:]
            ):
                exp = "(" + ", ".join(str(d) for d in expected) + ("," if ndim == 1 else "") + ")"
                raise ValueError(
                    f"Pad: sample {i} has shape {arr.shape}, expected {exp} like sample 0 "
                    f"(only axis {self._axis} may differ)"
                )

        if self._dtype is not None:
            dtype = self._dtype
        elif isinstance(samples[0], np.ndarray):
            dtype = first.dtype
        else:
            dtype = np.dtype(np.float32)

        lengths = [arr.shape[axis] for arr in arrays]
        max_len = max(lengths)
        if self._round_to is not None:
            max_len = self._round_to * math.ceil(max_len / self._round_to)
        fill = np.empty((), dtype)  # converted as numpy.full converts its fill_value
        try:
            np.copyto(fill, self._pad_val, casting="unsafe")
        except (OverflowError, ValueError, TypeError) as exc:
            raise type(exc)(
                f"Pad: pad_val={self._pad_val!r} cannot be stored as {dtype}: {exc}"
            ) from exc

        out_shape = (len(arrays),) + first.shape[:axis] + (max_len,) + first.shape[axis + 1:]
        out = _allocate(alloc, out_shape, dtype, "Pad")
        lead = (slice(None),) * axis
        for i, (arr, length) in enumerate(zip(arrays, lengths)):
            row = out[i]
            if length:
                row[lead + (slice(0, length),)] = arr
            if length < max_len:
                row[lead + (slice(length, None),)] = fill

        if not self._ret_length:
            return out
        valid_length = _allocate(alloc, (len(arrays),), np.dtype(np.int32), "Pad")
        valid_length[:] = lengths
        return out, valid_length

    def __repr__(self) -> str:
        dtype = None if self._dtype is None else str(self._dtype)
        return (
            f"Pad(axis={self._axis}, pad_val={self._pad_val!r}, "
            f"ret_length={self._ret_length}, dtype={dtype!r}, round_to={self._round_to})"
        )
