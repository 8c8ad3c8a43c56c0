"""Collation: columnar fast path, a cheaper `default_collate`, and batch trees <-> flat buffers.

* `columns_to_torch`: a `get_batch` dict -> the batch the Loader yields. Fixed fields become
  tensors via `torch.from_numpy` (zero copy); `Ragged` bytes/string/image fields become lists of
  bytes/str (what `default_collate` gives for such fields); `varray` Ragged fields stay `Ragged`
  with torch `values`/`offsets` (default_collate cannot stack unequal lengths).
* `fast_collate`: same output as `torch.utils.data.default_collate` for the common types
  (dict/list/tuple of numpy arrays, tensors, ints, floats, str, bytes), with less per-sample
  work and no shared-memory allocation inside workers; anything else is delegated to it.
* `flatten` / `unflatten` / `pack_into`: split a batch into tensor leaves plus a picklable
  spec, so process workers and the pinned ring can write leaves into reused buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from fastload.formats.ragged import Ragged

__all__ = [
    "ALIGN",
    "columns_to_torch",
    "fast_collate",
    "flatten",
    "leaf_nbytes",
    "pack_into",
    "unflatten",
    "views_from",
    "zero_copy_column",
]

ALIGN = 64


_STACKABLE = frozenset("biufc")


def _np_to_torch(a: np.ndarray) -> torch.Tensor:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


def zero_copy_column(name: str, col: Any, scalar_fields: frozenset[str] = frozenset()) -> bool:
    """Whether `columns_to_torch` yields this column as a bare `torch.from_numpy(col)`: a writable
    numeric numpy array in native byte order that needs no widening (a scalar field already is
    int64 / float64, or is not an integer or float)."""
    if not (type(col) is np.ndarray and col.dtype.kind in _STACKABLE and col.flags.writeable and col.dtype.isnative):
        return False
    kind = col.dtype.kind
    return name not in scalar_fields or kind not in "iuf" or col.dtype == (np.float64 if kind == "f" else np.int64)


def columns_to_torch(cols: dict[str, Any], *, scalar_fields: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Convert one `get_batch` result into the yielded batch (see module docstring).

    `scalar_fields` are widened to int64/float64, as `default_collate` does for Python scalars.
    """
    out: dict[str, Any] = {}
    for name, col in cols.items():
        if zero_copy_column(name, col, scalar_fields):
            out[name] = torch.from_numpy(col)  # the common case, zero copy
        elif isinstance(col, Ragged):
            if col.kind == "varray":
                values, offsets = _np_to_torch(np.asarray(col.values)), _np_to_torch(np.asarray(col.offsets))
                out[name] = Ragged(values, offsets, col.kind)
            else:
                out[name] = col.to_list()
        elif isinstance(col, np.ndarray):
            if col.dtype.kind in "OSU":
                out[name] = col.tolist()
                continue
            if name in scalar_fields and col.dtype.kind in "iuf":
                col = col.astype(np.float64 if col.dtype.kind == "f" else np.int64, copy=False)
            out[name] = _np_to_torch(col)
        elif isinstance(col, torch.Tensor):
            out[name] = col
        else:
            out[name] = col
    return out


def fast_collate(batch: list[Any]) -> Any:
    """`default_collate` with fast paths; identical output types, dtypes and values."""
    elem = batch[0]
    t = type(elem)
    if t is np.ndarray and elem.dtype.kind in _STACKABLE and elem.dtype.isnative:
        shape = elem.shape
        if all(type(b) is np.ndarray and b.shape == shape and b.dtype == elem.dtype for b in batch):
            return torch.from_numpy(np.stack(batch))
    elif t is torch.Tensor:
        # nested, sparse and other layouts: default_collate's own handling (and errors)
        if elem.layout == torch.strided and not elem.is_nested and all(type(b) is torch.Tensor for b in batch):
            return torch.stack(batch, 0)
    elif t is int:
        if all(type(b) is int for b in batch):
            return torch.tensor(batch)
    elif t is float:
        if all(type(b) is float for b in batch):
            return torch.tensor(batch, dtype=torch.float64)
    elif t is str or t is bytes:
        return batch
    elif t is dict:
        if all(type(b) is dict for b in batch):
            return {key: fast_collate([d[key] for d in batch]) for key in elem}
    elif t is tuple or t is list:
        size = len(elem)
        if all(type(b) is t and len(b) == size for b in batch):
            return [fast_collate(list(samples)) for samples in zip(*batch)]
    return default_collate(batch)


# ---- batch trees <-> (tensor leaves, picklable spec) ----

_LEAF = ("__leaf__",)


def flatten(batch: Any) -> tuple[list[torch.Tensor], Any]:
    """Split `batch` into CPU tensor leaves and a spec holding everything else."""
    leaves: list[torch.Tensor] = []
    return leaves, _walk(batch, leaves)


def _walk(x: Any, leaves: list[torch.Tensor]) -> Any:
    # module-level recursion (no self-referencing closure: its cycle would keep views alive)
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.layout == torch.strided and not x.is_nested:
        leaves.append(x)
        return _LEAF
    tx = type(x)
    if tx is dict:
        return ("dict", [(k, _walk(v, leaves)) for k, v in x.items()])
    if tx is list:
        return ("list", [_walk(v, leaves) for v in x])
    if tx is tuple:
        return ("tuple", [_walk(v, leaves) for v in x])
    if tx is Ragged:
        return ("ragged", _walk(x.values, leaves), _walk(x.offsets, leaves), x.kind)
    return ("obj", x)


def unflatten(spec: Any, leaves: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`."""
    return _build(spec, iter(leaves))


def _build(s: Any, it: Any) -> Any:
    if s == _LEAF:
        return next(it)
    tag = s[0]
    if tag == "dict":
        return {k: _build(v, it) for k, v in s[1]}
    if tag == "list":
        return [_build(v, it) for v in s[1]]
    if tag == "tuple":
        return tuple(_build(v, it) for v in s[1])
    if tag == "ragged":
        return Ragged(_build(s[1], it), _build(s[2], it), s[3])
    return s[1]


def leaf_nbytes(leaves: list[torch.Tensor]) -> int:
    """Bytes needed to pack `leaves` with `ALIGN`-aligned offsets."""
    total = 0
    for t in leaves:
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return total


def pack_into(
    buf: torch.Tensor, leaves: list[torch.Tensor], *, copy: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
) -> tuple[list[torch.Tensor], list[tuple[int, torch.dtype, tuple[int, ...]]]]:
    """Copy `leaves` into the uint8 buffer `buf`; return the views and their (offset, dtype, shape)."""
    views, layout = [], []
    off = 0
    for t in leaves:
        nbytes = t.numel() * t.element_size()
        view = buf[off : off + nbytes].view(t.dtype).view(t.shape)
        if copy is None:
            view.copy_(t)
        else:
            copy(view, t)
        views.append(view)
        layout.append((off, t.dtype, tuple(t.shape)))
        off += -(-nbytes // ALIGN) * ALIGN
    return views, layout


def views_from(buf: torch.Tensor, layout: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Tensor views of `buf` described by a `pack_into` layout."""
    out = []
    for off, dtype, shape in layout:
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off : off + n].view(dtype).view(shape))
    return out
