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

from collections.abc import Mapping, Sequence
from typing import Any

from ._batchify_arrays import Batchify, Pad, Stack, check_samples, collate
from ._collate import Alloc, collate_nested

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
        samples = check_samples(samples, self._name)
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
        samples = check_samples(samples, "Dict")
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
        samples = check_samples(samples, "NamedTuple")
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
