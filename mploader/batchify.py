"""Batchify functions: merge a list of samples into one batch.

These are the batchify functions of GluonNLP 0.10 (``gluonnlp.data.batchify``:
``Stack``, ``Pad``, ``Tuple``, ``List``, ``Dict``, ``NamedTuple``, and ``Group``,
the name newer GluonNLP gives ``Tuple``), producing NumPy arrays instead of
``mx.nd.NDArray``.

Collating into caller-provided memory
-------------------------------------
Every batchify object is a :class:`Batchify` and has two entry points:

``collate(samples, alloc)``
    Works out the shape and dtype of each output array from ``samples``, asks
    ``alloc(shape, dtype)`` once per output array for the memory, and writes
    every sample once into its place. No full-size temporary batch is built.
    ``alloc`` must return a writable, C-contiguous ``numpy.ndarray`` of exactly
    that shape and dtype, whose contents may be garbage: the batchify writes
    every element. In mploader's workers ``alloc`` hands out views into a
    shared-memory slot, so a batch is collated straight into the memory the
    main process reads it from. Composite batchifies (``Tuple``, ``Dict``,
    ``NamedTuple``) pass ``alloc`` on to their children, in field order.

``__call__(samples)``
    ``collate(samples, alloc)`` with ``alloc = numpy.empty``: an ordinary
    in-process batchify function, usable as a Gluon ``batchify_fn``.

A child of a composite may also be any plain callable ``f(samples)``; it is
called as such and its result is returned as it is (not placed in ``alloc``
memory). :func:`collate` applies the same rule to a top-level function.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._collate import Alloc, _heap_alloc, collate_nested

__all__ = [
    "Batchify",
    "Stack",
    "Pad",
    "Tuple",
    "Group",
    "Dict",
    "NamedTuple",
    "List",
    "Nested",
    "collate",
]

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


def _check_samples(samples: Any, who: str) -> Sequence[Any]:
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
        samples = _check_samples(samples, "Stack")
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
        samples = _check_samples(samples, "Pad")
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


def _check_fns(fns: Sequence[Any], who: str) -> None:
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"{who}: batchify function {i} must be callable, got {fn!r}")


class Tuple(Batchify):
    """Apply one batchify function per field of tuple-like samples.

    As ``gluonnlp.data.batchify.Tuple``: each sample is a sequence of ``F``
    fields, and function ``k`` batches field ``k`` of all samples.

    Parameters
    ----------
    fn : Batchify, callable, or list/tuple of them
        The first function, or all ``F`` functions as one list or tuple.
    *args : Batchify or callable
        Further functions (only when ``fn`` is a single function).

    Returns
    -------
    tuple
        ``F`` entries, entry ``k`` from function ``k``. ``alloc`` is passed to
        each :class:`Batchify` child in field order.

    Raises
    ------
    ValueError
        At construction, if ``fn`` is a list/tuple and ``args`` are given too,
        or no function is given. At collation, if there are no samples or a
        sample does not have ``F`` fields.
    TypeError
        At construction, if a function is not callable. At collation, if a
        sample is not a sequence.

    Examples
    --------
    >>> data, label = Tuple(Pad(pad_val=0), Stack())([([1, 2, 3, 4], 0), ([5, 7], 1)])
    >>> data.tolist(), label.tolist()
    ([[1.0, 2.0, 3.0, 4.0], [5.0, 7.0, 0.0, 0.0]], [0, 1])
    """

    _name = "Tuple"

    def __init__(self, fn: Any, *args: Any) -> None:
        if isinstance(fn, (list, tuple)):
            if args:
                raise ValueError(
                    f"{self._name}: pass the functions either as {self._name}(A, B, C) or as "
                    f"{self._name}([A, B, C]), got fn={fn!r} and args={args!r}"
                )
            fns = tuple(fn)
        else:
            fns = (fn,) + args
        if not fns:
            raise ValueError(f"{self._name}: needs at least one batchify function, got none")
        _check_fns(fns, self._name)
        self._fns = fns

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> tuple[Any, ...]:
        samples = _check_samples(samples, self._name)
        n_fields = len(self._fns)
        for i, sample in enumerate(samples):
            try:
                n = len(sample)
            except TypeError:
                raise TypeError(
                    f"{self._name}: sample {i} is {type(sample).__name__}, expected a "
                    f"sequence of {n_fields} fields"
                ) from None
            if n != n_fields:
                raise ValueError(
                    f"{self._name}: sample {i} has {n} fields, expected {n_fields} "
                    "(one per batchify function)"
                )
        return tuple(
            collate(fn, [sample[k] for sample in samples], alloc)
            for k, fn in enumerate(self._fns)
        )

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(repr(fn) for fn in self._fns)})"


class Group(Tuple):
    """The name newer GluonNLP gives :class:`Tuple`; identical behaviour."""

    _name = "Group"


class Dict(Batchify):
    """Apply one batchify function per key of dict samples.

    As ``gluonnlp.data.batchify.Dict``: each sample is a mapping, and
    ``fn_dict[key]`` batches ``sample[key]`` of all samples. Keys of the
    samples that are not in ``fn_dict`` are ignored.

    Parameters
    ----------
    fn_dict : dict
        ``key -> Batchify or callable``.

    Returns
    -------
    dict
        ``key -> batch``, keys in ``fn_dict`` order; ``alloc`` is passed to the
        children in that order.

    Raises
    ------
    TypeError
        At construction, if ``fn_dict`` is not a dict or a value is not
        callable (GluonNLP raises ValueError for both).
    ValueError
        At collation, if there are no samples.
    KeyError
        At collation, if a sample lacks a key of ``fn_dict``.

    Examples
    --------
    >>> out = Dict({'data': Pad(pad_val=0), 'label': Stack()})(
    ...     [{'data': [1, 2, 3], 'label': 0}, {'data': [5], 'label': 1}])
    >>> out['data'].tolist(), out['label'].tolist()
    ([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]], [0, 1])
    """

    def __init__(self, fn_dict: Mapping[Any, Any]) -> None:
        if not isinstance(fn_dict, Mapping):
            raise TypeError(
                f"fn_dict must be a dict of batchify functions, got {type(fn_dict).__name__}"
            )
        for key, fn in fn_dict.items():
            if not callable(fn):
                raise TypeError(f"Dict: fn_dict[{key!r}] must be callable, got {fn!r}")
        self._fn_dict = dict(fn_dict)

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> dict[Any, Any]:
        samples = _check_samples(samples, "Dict")
        columns = {}
        for key in self._fn_dict:
            column = []
            for i, sample in enumerate(samples):
                try:
                    column.append(sample[key])
                except (KeyError, TypeError, IndexError):
                    raise KeyError(f"Dict: sample {i} has no key {key!r}") from None
            columns[key] = column
        return {key: collate(fn, columns[key], alloc) for key, fn in self._fn_dict.items()}

    def __repr__(self) -> str:
        return f"Dict({self._fn_dict!r})"


class NamedTuple(Batchify):
    """Apply one batchify function per field of namedtuple samples.

    As ``gluonnlp.data.batchify.NamedTuple``: each sample is an instance of
    ``container``, and the batch is ``container(*field_batches)``.

    Parameters
    ----------
    container : type
        A namedtuple class (anything with ``_fields``, built from positional
        field values).
    fn_info : list, tuple or dict
        One function per field, in ``container._fields`` order, or a dict
        ``field name -> function`` covering exactly the fields.

    Returns
    -------
    container
        The batched fields; ``alloc`` is passed to the children in field
        order.

    Raises
    ------
    TypeError
        At construction, if ``container`` has no ``_fields``, ``fn_info`` is
        neither a list/tuple nor a dict, or a function is not callable. At
        collation, if a sample is not a ``container`` (GluonNLP raises
        ValueError for the last two).
    ValueError
        At construction, if ``fn_info`` does not give exactly one function per
        field. At collation, if there are no samples.

    Examples
    --------
    >>> from collections import namedtuple
    >>> Sample = namedtuple('Sample', ['data', 'label'])
    >>> out = NamedTuple(Sample, {'data': Pad(pad_val=0), 'label': Stack()})(
    ...     [Sample([1, 2], 0), Sample([3], 1)])
    >>> out.data.tolist(), out.label.tolist()
    ([[1.0, 2.0], [3.0, 0.0]], [0, 1])
    """

    def __init__(self, container: type, fn_info: Any) -> None:
        fields = getattr(container, "_fields", None)
        if fields is None:
            raise TypeError(f"container must be a namedtuple class, got {container!r}")
        fields = tuple(fields)
        if isinstance(fn_info, Mapping):
            missing = [name for name in fields if name not in fn_info]
            extra = [name for name in fn_info if name not in fields]
            if missing or extra:
                raise ValueError(
                    f"NamedTuple: fn_info keys must be the fields of {container.__name__} "
                    f"{list(fields)}, got {list(fn_info)} (missing {missing}, extra {extra})"
                )
            fns = tuple(fn_info[name] for name in fields)
        elif isinstance(fn_info, (list, tuple)):
            if len(fn_info) != len(fields):
                raise ValueError(
                    f"NamedTuple: fn_info must hold one function per field of "
                    f"{container.__name__} {list(fields)}, got {len(fn_info)} functions"
                )
            fns = tuple(fn_info)
        else:
            raise TypeError(
                f"fn_info must be a list, tuple or dict of batchify functions, "
                f"got {type(fn_info).__name__}"
            )
        _check_fns(fns, "NamedTuple")
        self._container = container
        self._fields = fields
        self._fns = fns

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> Any:
        samples = _check_samples(samples, "NamedTuple")
        for i, sample in enumerate(samples):
            if not isinstance(sample, self._container):
                raise TypeError(
                    f"NamedTuple: sample {i} is {type(sample).__name__}, expected "
                    f"{self._container.__name__}"
                )
        return self._container(
            *(collate(fn, [sample[k] for sample in samples], alloc)
              for k, fn in enumerate(self._fns))
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={fn!r}" for name, fn in zip(self._fields, self._fns))
        return f"NamedTuple({self._container.__name__}, {inner})"


class List(Batchify):
    """Return the samples as a plain list, as ``gluonnlp.data.batchify.List``.

    For fields that are not arrays (strings, token lists, objects). Samples
    may be anything; ``alloc`` is never called.

    Returns
    -------
    list
        ``list(samples)``.

    Examples
    --------
    >>> _, text = Tuple(Stack(), List())([([1, 2], 'a b'), ([3, 4], 'c')])
    >>> text
    ['a b', 'c']
    """

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> list[Any]:
        return list(samples)

    def __repr__(self) -> str:
        return "List()"



class Nested(Batchify):
    """Stack arrays and numbers, recursing into tuples, lists, dicts and namedtuples.

    An mploader extension (mploader 0.1's default batchify, kept for datasets whose
    samples are dicts or nested containers; Gluon's default treats only tuples as
    structure).  For B samples of one structure:

    * ndarrays of one shape and dtype -> ndarray of shape (B, \\*sample_shape), same
      dtype (byte order kept);
    * Python or NumPy numbers -> ndarray of shape (B,) with NumPy's dtype for them;
    * tuple or list -> list of the batched fields; namedtuple -> the same namedtuple
      type; dict -> dict with the first sample's keys, in its order;
    * anything that cannot be stacked (ragged shapes, mixed types, object dtype,
      strings, None) -> the list of the B leaves unchanged.  Never raises.

    Examples
    --------
    >>> batch = Nested()([{"x": np.zeros(2), "y": 1}, {"x": np.ones(2), "y": 2}])
    >>> batch["x"].shape, batch["y"].tolist()
    ((2, 2), [1, 2])
    """

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> Any:
        return collate_nested(samples, alloc)

    def __repr__(self) -> str:
        return "Nested()"
