"""Collation into the slot for the PyTorch face (``mploader.torch``).

A worker of :class:`mploader.torch.DataLoader` must hand the engine a batch made of
containers, plain Python values and NumPy arrays: the engine writes arrays into the
slot and describes the rest (docs/design.md, "Batch descriptor").  Pickling a tensor
would pickle its whole storage -- for ``dataset.x[i]``, a view of a 100 MB tensor,
100 MB per sample -- so no tensor may reach the engine.  Three ways a batch is built:

* :func:`collate_into` computes exactly what ``torch.utils.data.default_collate``
  returns in a worker (types, dtypes, shapes, nesting), but every output tensor is
  written once, by ``torch.stack(..., out=)`` (or, for large columns of plain
  tensors, the same bytes with streaming stores), into an array that ``alloc`` handed
  out in the slot; the batch travels with NumPy arrays where torch has tensors, and
  :func:`to_tensors` in the parent turns each into ``torch.from_numpy(view)``: a
  zero-copy tensor over the slot, whose NumPy base keeps the slot's lease alive.
  (``default_collate`` never returns a numeric NumPy array, so every one is a tensor.)
* :func:`convert_into` is ``default_convert`` (``batch_size=None``) the same way.
* :func:`pack` handles whatever a custom ``collate_fn`` returned: the object is
  pickled with every CPU tensor and plain ndarray replaced by a persistent id, and
  the arrays (only each tensor's own elements, never its storage) go to the slot
  beside the pickle; :func:`unpack` in the parent rebuilds the object with tensors
  (``torch.from_numpy``) where the worker had tensors and arrays where it had arrays.

Tensors of a dtype NumPy lacks (bfloat16, complex32, float8 ...) travel as arrays
of a one-field structured dtype named ``torch.<dtype>`` over an integer of the same
size (:func:`raw_dtype`).

The module imports torch lazily (docs/design.md, "Workers"): a spawn/forkserver
worker of a NumPy-only dataset never imports it.  Until torch is imported in the
process (:func:`bind`, run at once where torch already is, else by
:mod:`mploader._torch_worker`'s import hook right after torch's own import, before any
user code can touch torch), no sample can be a tensor, and NumPy samples are collated
without it: what collation must know of torch -- which NumPy dtypes and scalar types
it takes as they are -- comes from the parent (:func:`numpy_facts`, :func:`learn`).
The rare NumPy paths whose result or error only torch can give (ragged or mixed
arrays, mixed numbers) import it (:func:`_need_torch`).
"""
from __future__ import annotations

import collections.abc
import copy
import io
import pickle
import re
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _columns

if TYPE_CHECKING:
    import torch
    from torch.utils.data._utils import collate as _torch_collate
else:
    torch = _torch_collate = None   # bound by bind() once torch is imported in this process

#: ``alloc(shape, dtype) -> ndarray``: a writable, C-contiguous array (a slot view in a worker).
Alloc = Callable[[tuple, Any], np.ndarray]

#: NumPy dtype strings default_collate refuses (torch's ``np_str_obj_array_pattern``).
_STR_OBJ = re.compile(r"[SaUO]")
_ERR = "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}"
_NESTED_MSG = ("Batches of nested tensors are not currently supported by the default collate_fn; "
               "please provide a custom collate_fn to handle them appropriately.")
_SPARSE_MSG = ("Batches of sparse tensors are not currently supported by the default collate_fn; "
               "please provide a custom collate_fn to handle them appropriately.")
#: torch's message for a non-writable array (tensor_numpy.cpp), for a worker without torch.
_NOT_WRITABLE = ("The given NumPy array is not writable, and PyTorch does not support non-writable tensors. "
                 "This means writing to this tensor will result in undefined behavior. You may want to copy "
                 "the array to protect its data or make it writable before converting it to a tensor. This "
                 "type of warning will be suppressed for the rest of this program.")

# What this module knows of torch: filled by bind() (the sets and dicts are updated in
# place, never rebound), the two NumPy facts also by learn() in a worker without torch.
_SPARSE: set = set()
#: torch dtype -> the NumPy dtype ``Tensor.numpy()`` gives (those with an equivalent).
_NP_OF: dict[torch.dtype, np.dtype] = {}
#: Integer stand-ins of the same item size, for dtypes NumPy lacks (bfloat16, complex32, float8 ...).
_RAW_OF_SIZE: dict[int, torch.dtype] = {}
#: The NumPy dtypes torch has a dtype for (``torch.as_tensor`` shares their memory).
_NP_TYPES_TORCH_TAKES: set[np.dtype] = set()
#: Array types stacked with NumPy directly (memory-mapped datasets give np.memmap rows).
_PLAIN_ARRAYS = frozenset((np.ndarray, np.memmap))


_MARK = "torch."


def raw_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype an array holding ``dtype`` elements has in transit: NumPy's
    own when it has one, else ``[("torch.<name>", <int of the same size>)]``."""
    npd = _NP_OF.get(dtype)
    if npd is not None:
        return npd
    raw = _RAW_OF_SIZE.get(dtype.itemsize)
    if raw is None:
        raise TypeError(f"mploader.torch cannot place tensors of dtype {dtype} in shared memory")
    return np.dtype([(_MARK + str(dtype).rpartition(".")[2], _NP_OF[raw])])


def as_tensor_view(array: np.ndarray) -> torch.Tensor:
    """The tensor an array in transit stands for (zero-copy; parent side)."""
    names = array.dtype.names
    if names is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(array.dtype[0])).view(getattr(torch, names[0][len(_MARK):]))


def _is_raw(dtype: np.dtype) -> bool:
    names = dtype.names
    return names is not None and len(names) == 1 and names[0].startswith(_MARK)


def _array_of(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of exactly ``t``'s elements (never its whole storage), in the
    transit dtype.  The engine copies the view's bytes into the slot."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    npd = raw_dtype(t.dtype)
    if npd.names is None:
        return t.numpy()
    return t.view(_RAW_OF_SIZE[t.dtype.itemsize]).numpy().view(npd)


def _dest(out: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``out`` (an array of ``raw_dtype(dtype)``)."""
    if out.dtype.names is None:
        return torch.from_numpy(out)
    return torch.from_numpy(out.view(out.dtype[0])).view(dtype)


def _into(t: torch.Tensor, alloc: Alloc) -> np.ndarray:
    """Copy a small, freshly computed tensor into ``alloc``'s memory."""
    out = alloc(tuple(t.shape), raw_dtype(t.dtype))
    _dest(out, t.dtype).copy_(t)
    return out


#: What :func:`to_tensors` does with an array of a dtype: ``torch.from_numpy`` it, view
#: a raw transit dtype as its tensor dtype, or leave it (string and object dtypes);
#: cached per dtype (the checks cost a regular expression search per array).
_PLAIN, _RAW, _KEEP = 0, 1, 2
_ARRAY_KIND: dict[np.dtype, int] = {}


def _array_kind(dtype: np.dtype) -> int:
    if dtype.names is not None:
        kind = _RAW if _is_raw(dtype) else _KEEP
    else:
        kind = _PLAIN if _STR_OBJ.search(dtype.str) is None else _KEEP
    if len(_ARRAY_KIND) < 256:
        _ARRAY_KIND[dtype] = kind
    return kind


def to_tensors(obj: Any) -> Any:
    """Parent side of :func:`collate_into` / :func:`convert_into`: every array that is
    not of a string or object dtype becomes ``torch.from_numpy`` of it (zero-copy);
    lists and dicts are updated in place, tuples, namedtuples and other mappings and
    sequences rebuilt as ``default_collate`` builds them; anything else is returned
    unchanged."""
    t = type(obj)
    if t is np.ndarray:
        kind = _ARRAY_KIND.get(obj.dtype)
        if kind is None:
            kind = _array_kind(obj.dtype)
        if kind == _PLAIN:
            return torch.from_numpy(obj)
        return as_tensor_view(obj) if kind == _RAW else obj
    if t is list:
        for i, x in enumerate(obj):
            obj[i] = to_tensors(x)
        return obj
    if t is dict:
        for k, v in obj.items():
            obj[k] = to_tensors(v)
        return obj
    if t is str or t is bytes or t is int or t is float or obj is None:
        return obj
    if isinstance(obj, (str, bytes, np.generic)):
        return obj
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):
            return t(*(to_tensors(x) for x in obj))
        items = [to_tensors(x) for x in obj]
        return tuple(items) if t is tuple else _rebuild(obj, items)
    if isinstance(obj, collections.abc.MutableMapping):
        for k in list(obj.keys()):
            obj[k] = to_tensors(obj[k])
        return obj
    if isinstance(obj, collections.abc.Mapping):
        values = {k: to_tensors(obj[k]) for k in obj}
        try:
            return t(values)
        except TypeError:
            return values
    if isinstance(obj, collections.abc.MutableSequence):
        for i in range(len(obj)):
            obj[i] = to_tensors(obj[i])
        return obj
    if isinstance(obj, collections.abc.Sequence):
        return _rebuild(obj, [to_tensors(x) for x in obj])
    return obj


def _rebuild(obj: Any, items: list) -> Any:
    try:
        return type(obj)(items)
    except TypeError:
        return items


# ---------------------------------------------------------------------------
# default_collate, into the slot
# ---------------------------------------------------------------------------

#: ``default_collate_fn_map`` as torch made it (taken by bind(), before user code runs).
_STOCK_MAP: dict = {}


def stock_default_collate() -> bool:
    """Whether ``default_collate_fn_map`` is torch's own (users may extend it in place;
    then the face calls ``default_collate`` itself and packs its result); True where
    torch is not imported (no user code can have extended it)."""
    if _torch_collate is None:
        return True
    current = _torch_collate.default_collate_fn_map
    return len(current) == len(_STOCK_MAP) and all(current.get(k) is f for k, f in _STOCK_MAP.items())


def collate_into(batch: Any, alloc: Alloc) -> Any:
    """``default_collate(batch)`` as a worker of torch's DataLoader computes it, with
    every output tensor written once into ``alloc``'s memory, as an array there
    (:func:`to_tensors` makes it a tensor in the parent).

    Mirrors torch 2.13's ``collate`` with ``default_collate_fn_map``: tensors are
    stacked into a tensor of the first element's dtype (what a torch worker does);
    NumPy arrays become tensors (string/object dtypes raise TypeError); NumPy scalars
    ``torch.as_tensor``, floats float64, ints ``torch.tensor`` (bools -> bool); str and
    bytes stay as they are (the list or tuple of them); mappings, namedtuples and
    sequences recurse (a tuple becomes a list).  Raises exactly torch's errors
    (TypeError for unsupported elements, RuntimeError for ragged sequences or tensors).
    """
    elem = batch[0]
    elem_type = type(elem)
    if elem_type is tuple:   # the commonest sample, (image, label): torch's Sequence branch
        return _collate_sequence(batch, alloc)
    if torch is not None and isinstance(elem, torch.Tensor):
        return _stack_tensors(batch, alloc)
    if isinstance(elem, np.ndarray):
        if _STR_OBJ.search(elem.dtype.str) is not None:
            raise TypeError(_ERR.format(elem.dtype))
        dtype, shape = elem.dtype, elem.shape
        # The hot path: one C loop over exact ndarrays (mploader._columns), else set-based
        # checks (np.memmap rows, ~0.1 us per sample).
        if dtype in _NP_TYPES_TORCH_TAKES and dtype.isnative and (
                _columns.uniform_arrays(batch if type(batch) is list else list(batch))
                or (set(map(type, batch)) <= _PLAIN_ARRAYS and len({b.shape for b in batch}) == 1
                    and len({b.dtype for b in batch}) == 1)):
            if not elem.flags.writeable:  # torch's own warning about it (once per process), as torch.as_tensor
                _not_writable(elem)
            out = alloc((len(batch),) + shape, dtype)
            if out.size:
                if shape and _columns.copy_rows(batch if type(batch) is list else list(batch), out):
                    pass  # sample i at out[i]: memcpy or streaming stores (docs/design.md, "Collate into the slot")
                elif shape:  # non-contiguous samples: NumPy's copy
                    np.concatenate(batch, axis=0, out=out.reshape((len(batch) * shape[0],) + shape[1:]),
                                   casting="no")
                else:
                    for i, b in enumerate(batch):
                        out[i] = b
            return out
        t = _need_torch()
        return _stack_tensors([t.as_tensor(b) for b in batch], alloc)
    if isinstance(elem, (np.bool_, np.number, np.object_)):
        if elem_type in _SCALARS_AS_THEIR_DTYPE:
            column = batch if type(batch) is list else list(batch)
            number_dtype = _columns.number_column_dtype(column)   # None unless all are elem_type
            if number_dtype is not None:  # torch.as_tensor gives their own dtype: fill the slot in C
                out = alloc((len(column),), number_dtype)
                _columns.fill_numbers(column, out)
                return out
        return _into(_need_torch().as_tensor(batch), alloc)
    if isinstance(elem, float):
        if set(map(type, batch)) == _FLOAT:
            return _numbers_into(batch, np.float64, alloc)
        t = _need_torch()
        return _into(t.tensor(batch, dtype=t.float64), alloc)
    if isinstance(elem, int):
        kinds = set(map(type, batch))
        if kinds == _INT and _INT64_MIN <= min(batch) and max(batch) <= _INT64_MAX:
            return _numbers_into(batch, np.int64, alloc)  # torch.tensor of ints: int64
        if kinds == _BOOL:
            return _numbers_into(batch, np.bool_, alloc)  # torch.tensor of bools: bool
        return _into(_need_torch().tensor(batch), alloc)
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, collections.abc.Mapping):
        values = {key: collate_into([d[key] for d in batch], alloc) for key in elem}
        try:
            if isinstance(elem, collections.abc.MutableMapping):
                clone = copy.copy(elem)
                clone.update(values)
                return clone
            return elem_type(values)
        except TypeError:
            return values
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return elem_type(*(collate_into(samples, alloc) for samples in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        return _collate_sequence(batch, alloc)
    raise TypeError(_ERR.format(elem_type))


def _collate_sequence(batch: Any, alloc: Alloc) -> Any:
    """:func:`collate_into`'s sequence branch (torch's ``collate`` for a Sequence that
    is neither a str, a mapping nor a namedtuple): column by column; a tuple gives a
    list, another sequence its own type where it can be rebuilt."""
    if len(set(map(len, batch))) != 1:
        raise RuntimeError("each element in list of batch should be of equal size")
    columns = [collate_into(samples, alloc) for samples in zip(*batch)]
    elem = batch[0]
    if isinstance(elem, tuple):
        return columns
    return _same_sequence(elem, columns)


def _same_sequence(like: Any, items: list) -> Any:
    """``items`` in a sequence of ``like``'s type, as torch's collate/convert rebuild
    one: a mutable sequence is copied and refilled, another type is called with the
    list; a type that cannot be rebuilt gives the list."""
    try:
        if isinstance(like, collections.abc.MutableSequence):
            seq = copy.copy(like)
            for i, item in enumerate(items):
                seq[i] = item
            return seq
        return type(like)(items)
    except TypeError:
        return items


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT, _FLOAT, _BOOL = {int}, {float}, {bool}


def _scalars_as_their_dtype() -> frozenset:
    """NumPy scalar types whose lists ``torch.as_tensor`` turns into a tensor of the
    scalars' own dtype (asked of torch itself, once): a column of one of them is
    filled straight into the slot.  Others (uint64, which torch refuses; longdouble)
    keep going through ``torch.as_tensor``, errors included."""
    ok = set()
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, np.complex128):
        try:
            if torch.as_tensor([t(1), t(0)]).dtype == torch.from_numpy(np.zeros(1, t)).dtype:
                ok.add(t)
        except (TypeError, RuntimeError):
            pass
    return frozenset(ok)


_SCALARS_AS_THEIR_DTYPE: set[type] = set()


def bind() -> None:
    """Bind this module to torch, imported in this process (a no-op once bound): the
    module's ``torch``, the stock ``default_collate_fn_map`` and the dtype tables.
    Runs at this module's import where torch is already imported, else right after
    torch's own import (:mod:`mploader._torch_worker`'s hook), before user code could
    extend the map."""
    global torch, _torch_collate
    if torch is not None:
        return
    import torch as t
    from torch.utils.data._utils import collate as c

    np_of = {}
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
                 "complex64", "complex128", "uint16", "uint32", "uint64"):
        td = getattr(t, name, None)
        if td is not None:
            try:
                np_of[td] = t.empty(0, dtype=td).numpy().dtype
            except (TypeError, RuntimeError):  # pragma: no cover - older torch without numpy support for it
                pass
    _STOCK_MAP.update(c.default_collate_fn_map)
    _SPARSE.update((t.sparse_coo, t.sparse_csr, t.sparse_bsr, t.sparse_csc, t.sparse_bsc))
    _NP_OF.update(np_of)
    _RAW_OF_SIZE.update({1: t.uint8, 2: t.int16, 4: t.int32, 8: t.int64})
    torch, _torch_collate = t, c
    learn((frozenset(np_of.values()), _scalars_as_their_dtype()))


def numpy_facts() -> tuple[frozenset, frozenset]:
    """What collating NumPy samples needs to know of torch (the process must have
    bound it): the NumPy dtypes torch takes as they are, and the NumPy scalar types
    whose lists ``torch.as_tensor`` keeps in their dtype.  The parent sends them to
    its workers (:func:`learn`), which then need no torch for NumPy samples."""
    bind()
    return frozenset(_NP_TYPES_TORCH_TAKES), frozenset(_SCALARS_AS_THEIR_DTYPE)


def learn(facts: tuple[frozenset, frozenset]) -> None:
    """Adopt :func:`numpy_facts` of the parent's torch (the same installation)."""
    _NP_TYPES_TORCH_TAKES.clear()
    _NP_TYPES_TORCH_TAKES.update(facts[0])
    _SCALARS_AS_THEIR_DTYPE.clear()
    _SCALARS_AS_THEIR_DTYPE.update(facts[1])


def _need_torch() -> Any:
    """torch, imported now if it was not (a NumPy batch whose result or error only
    torch can give, in a worker that had no torch)."""
    if torch is None:
        import torch as _t  # noqa: F401 - the import hook (or the line below) binds this module

        bind()
    return torch


class _Warned:
    not_writable = False   # torch's non-writable warning was given (it gives it once per process)


def _not_writable(elem: np.ndarray) -> None:
    """torch's warning for a non-writable array, once per process: torch's own (by
    ``torch.as_tensor``) where torch is imported, else the same text (without torch's
    "Triggered internally at" location)."""
    if _Warned.not_writable:
        return
    _Warned.not_writable = True
    if torch is not None:
        torch.as_tensor(elem)
    else:
        warnings.warn(_NOT_WRITABLE, UserWarning, stacklevel=3)


if "torch" in sys.modules:
    bind()


def _numbers_into(batch: Any, dtype: Any, alloc: Alloc) -> np.ndarray:
    """Plain Python floats or in-range ints, written once into the slot (what
    ``torch.tensor(batch)`` gives for them, without the temporary tensor)."""
    out = alloc((len(batch),), dtype)
    out[:] = batch
    return out


def _stack_tensors(batch: Any, alloc: Alloc) -> np.ndarray:
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(_NESTED_MSG)
    if elem.layout in _SPARSE:
        raise RuntimeError(_SPARSE_MSG)
    if elem.layout == torch.strided and elem.device.type == "cpu" and elem.dtype.itemsize in _RAW_OF_SIZE:
        # A torch worker stacks into new storage of elem's shape and dtype (casting or
        # refusing the other elements exactly as stack(out=) does); here that storage
        # is the slot.  torch.stack checks every element itself.
        out = alloc((len(batch),) + tuple(elem.shape), raw_dtype(elem.dtype))
        if _stream_rows(batch, out, elem.dtype, elem.shape):
            return out
        try:
            torch.stack(batch, 0, out=_dest(out, elem.dtype))
        except TypeError:
            _sizes(batch)
            raise
        except RuntimeError:
            _refuse_grad(batch)
            raise
        return out
    # Other devices and layouts: torch's own stack, then one copy into the slot.
    _sizes(batch)
    return _into(torch.stack(batch, 0, out=torch.empty(0, dtype=elem.dtype, device=elem.device)).cpu(), alloc)


def _stream_rows(leaves: Any, out: np.ndarray, dtype: torch.dtype, shape: Any) -> bool:
    """Copy ``leaves`` into the rows of ``out`` with streaming stores (True), as
    :func:`mploader._columns.copy_rows` copies NumPy samples -- what ``torch.stack(leaves,
    0, out=<tensor over out>)`` writes, bit for bit, for such leaves -- or write
    nothing and return False (the caller stacks with torch).

    Only for an ``out`` of at least :data:`mploader._columns.STREAM_MIN_BYTES` (one
    ``large`` batch: 38.5 MB) of a NumPy dtype, and leaves that are all exact
    ``torch.Tensor`` of ``dtype`` and ``shape``: there ``torch.stack`` writes with
    ordinary stores, which first read every destination line into the cache
    (bench/tensor_leaves_ab.py, issue 24: +33 % batches/s on data not in the cache).
    Declines where ``Tensor.numpy()`` refuses (RuntimeError: requires grad, conj or
    neg bit; TypeError: not on the CPU) and where ``copy_rows`` does (a leaf not
    C-contiguous): ``torch.stack`` then resolves or refuses them as torch does."""
    if out.nbytes < _columns.STREAM_MIN_BYTES or out.dtype.names is not None:
        return False
    exact = torch.Tensor
    for t in leaves:
        if type(t) is not exact or t.dtype != dtype or t.shape != shape:
            return False
    try:
        arrays = [t.numpy() for t in leaves]
    except (RuntimeError, TypeError):
        return False
    return _columns.copy_rows(arrays, out)


def _refuse_grad(batch: Any) -> None:
    """Raise the error that says why a batch of tensors requiring grad cannot be
    made in a worker, and what to do (torch's DataLoader fails on it too, with
    "stack(): functions with out=... arguments don't support automatic
    differentiation"); nothing when no element requires grad."""
    for k, t in enumerate(batch):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(
                f"element {k} of the batch is a tensor with requires_grad=True: a batch made in a "
                f"worker process cannot carry an autograd graph (torch's DataLoader with num_workers > 0 fails "
                f"here too), so no gradient could ever reach the dataset's tensors.  Return the data without "
                f"its graph from __getitem__ (tensor.detach()), and call .requires_grad_() on the batch in the "
                f"training loop if it needs a gradient; or use num_workers=0 to keep the graph")


def plan_tensor_column(leaf: Any, out: np.ndarray, batch_size: int) -> Callable[[list, np.ndarray], bool] | None:
    """:data:`mploader._plan.OtherColumn` for tensors: a column that
    :func:`_stack_tensors` stacked into the slot (``out``) from exact ``torch.Tensor``
    leaves on the CPU, strided, not nested, of a dtype with a transit dtype.

    The plan's ``fill(leaves, dest)`` does what :func:`_stack_tensors` does for such a
    first leaf -- ``torch.stack`` into a tensor of the first leaf's dtype and shape
    over the slot, which checks (or casts) the other leaves exactly as there, or the
    same bytes with streaming stores (:func:`_stream_rows`) -- and declines when the
    first leaf is not of the plan's dtype, shape, device, layout, or when
    ``torch.stack`` raises (the generic path then raises its own error)."""
    if (torch is None or type(leaf) is not torch.Tensor or leaf.is_nested or leaf.layout != torch.strided
            or leaf.device.type != "cpu" or leaf.dtype.itemsize not in _RAW_OF_SIZE):
        return None
    dtype, shape = leaf.dtype, tuple(leaf.shape)
    if out.shape != (batch_size,) + shape or out.dtype != raw_dtype(dtype):
        return None
    strided = torch.strided

    def fill(leaves: list, dest: np.ndarray) -> bool:
        first = leaves[0]
        if (first.dtype != dtype or first.shape != shape or first.is_nested or first.layout != strided
                or first.device.type != "cpu"):
            return False
        if _stream_rows(leaves, dest, dtype, shape):
            return True
        try:
            torch.stack(leaves, 0, out=_dest(dest, dtype))
        except Exception:  # noqa: BLE001 - the generic path raises its own error for this batch
            return False
        return True
    return fill


def _sizes(batch: Any) -> int:
    """What a torch worker computes first (AttributeError for a non-tensor element)."""
    return sum(x.numel() for x in batch)


def convert_into(data: Any) -> Any:
    """``default_convert(data)`` (``batch_size=None``) with tensors as arrays.

    NumPy arrays (not string/object dtype) and NumPy scalars become tensors, tensors
    stay tensors; mappings, namedtuples and sequences recurse (a tuple becomes a list,
    str/bytes stay); anything else is returned unchanged -- torch 2.13's rules.
    """
    elem_type = type(data)
    if torch is not None and isinstance(data, torch.Tensor):
        return _array_of(data)
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if elem_type.__name__ == "ndarray" and _STR_OBJ.search(data.dtype.str) is not None:
            return data
        return _array_of(_need_torch().as_tensor(data))
    if isinstance(data, collections.abc.Mapping):
        values = {key: convert_into(data[key]) for key in data}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = copy.copy(data)
                clone.update(values)
                return clone
            return elem_type(values)
        except TypeError:
            return values
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return elem_type(*(convert_into(d) for d in data))
    if isinstance(data, tuple):
        return [convert_into(d) for d in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        return _same_sequence(data, [convert_into(d) for d in data])
    return data


# ---------------------------------------------------------------------------
# Whatever a custom collate_fn returned
# ---------------------------------------------------------------------------

class _Packer(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.arrays: list[np.ndarray] = []
        self.ids: dict[int, tuple] = {}

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if torch is not None and t is torch.Tensor:
            if obj.layout != torch.strided or obj.is_nested or obj.is_quantized:
                return None  # pickled as torch pickles it
            pid = self.ids.get(id(obj))
            if pid is None:
                self.arrays.append(_array_of(obj))
                pid = self.ids[id(obj)] = ("t", len(self.arrays) - 1, obj.requires_grad)
            return pid
        if t is np.ndarray and not obj.dtype.hasobject and obj.dtype.itemsize:
            pid = self.ids.get(id(obj))
            if pid is None:
                self.arrays.append(obj)
                pid = self.ids[id(obj)] = ("n", len(self.arrays) - 1)
            return pid
        return None


def pack(obj: Any) -> tuple[bytes, list[np.ndarray]]:
    """Worker side: ``(pickle, arrays)`` of ``obj`` with its tensors and arrays taken
    out (see the module docstring)."""
    f = io.BytesIO()
    p = _Packer(f)
    p.dump(obj)
    return (f.getvalue(), p.arrays)


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, arrays: list[np.ndarray]) -> None:
        super().__init__(file)
        self.arrays = arrays
        self.built: dict[tuple, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        obj = self.built.get(pid)
        if obj is None:
            if pid[0] == "t":
                obj = as_tensor_view(self.arrays[pid[1]])
                if pid[2]:
                    obj.requires_grad_(True)
            else:
                obj = self.arrays[pid[1]]
            self.built[pid] = obj
        return obj


def unpack(packed: Any) -> Any:
    """Parent side of :func:`pack`: tensors (zero-copy over the slot) where the worker
    had tensors, NumPy arrays where it had arrays."""
    blob, arrays = packed
    return _Unpacker(io.BytesIO(blob), arrays).load()
