"""Batch views: a batch in columnar form, handed to a collate that declares it can take one.

The protocol: a `collate_fn` whose class sets ``accepts_batch_views = True`` is called by the
Loader (on a dataset with `get_batch`) with the batch's columns instead of a list of samples:

* fixed-size fields as tensors (``(B, *shape)``; scalar fields widened to int64/float64, as
  torch's `default_collate` does for Python scalars);
* variable-size fields (bytes, strings, images, token arrays) as `Ragged` whose `values` and
  `offsets` are tensors: sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``; no per-sample
  Python object is made, and each field is read with one gather per batch.

`ragged[i]` still gives one sample as bytes / str / a tensor slice when a consumer wants it.
`BatchViews` is the identity collate for users who want the views themselves. fastload's own
consumers (`TextCollate`, `fastload.vision.ImagePreset`) declare the protocol; `collate_fn=None`
keeps torch's exact types (lists of bytes/str). `Loader.describe()["batch"]` says which applies.

Safety: a view's tensors own their memory or alias a buffer only the consumer holds. Columns a
dataset returns as slices of memory it keeps (a mapping, a resident array) are copied; the
Loader's reused buffers (pinned ring slots, worker shared memory) are retired, never rewritten,
while the user still references a view of them (`fastload.transfer.ring`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload.fetch.collate import columns_to_torch
from fastload.formats.buffers import is_batch_buffer
from fastload.formats.ragged import Ragged
from fastload.run import RunContext

__all__ = ["BatchViews", "accepts_batch_views", "columns_to_views", "ragged_to_torch"]


def accepts_batch_views(collate_fn: Any) -> bool:
    """Whether `collate_fn` declares that it takes batch views (``accepts_batch_views = True``)."""
    return getattr(collate_fn, "accepts_batch_views", False) is True


def _owned_tensor(a: Any) -> torch.Tensor:
    """`a` as a CPU tensor: zero copy when it is a writable native numpy array owning its memory or
    over a batch buffer (what a batch gather allocates), else a copy (a slice of memory the dataset keeps)."""
    if isinstance(a, torch.Tensor):
        return a
    arr = np.asarray(a)
    owned = arr.flags.owndata or is_batch_buffer(arr)
    if not (owned and arr.flags.writeable and arr.dtype.isnative and arr.flags.c_contiguous):
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("=")).copy()
    return torch.from_numpy(arr)


def ragged_to_torch(col: Ragged) -> Ragged:
    """`col` with tensor `values` / `offsets` (int64), zero copy where `_owned_tensor` allows."""
    offsets = col.offsets
    if not isinstance(offsets, torch.Tensor) and np.asarray(offsets).dtype != np.int64:
        offsets = np.asarray(offsets, dtype=np.int64)
    return Ragged(_owned_tensor(col.values), _owned_tensor(offsets), col.kind, origin=col.origin)


def columns_to_views(cols: Mapping[str, Any], *, scalar_fields: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One `get_batch` result -> batch views (see the module docstring). Columns that are neither
    arrays nor `Ragged` (e.g. a `ShapedBatch`) are converted as `columns_to_torch` does."""
    out: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for name, col in cols.items():
        if isinstance(col, Ragged):
            out[name] = ragged_to_torch(col)
        else:
            rest[name] = col
    if rest:
        out.update(columns_to_torch(rest, scalar_fields=scalar_fields))
    return {name: out[name] for name in cols}


def _column_from_samples(items: Sequence[Any]) -> Any:
    first = items[0]
    if isinstance(first, str):
        return ragged_to_torch(Ragged.from_list(list(items), kind="string"))
    if isinstance(first, (bytes, bytearray, memoryview)):
        return ragged_to_torch(Ragged.from_list(list(items), kind="bytes"))
    arrays = [np.asarray(x) for x in items]
    if all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays):
        stacked = np.stack(arrays)
        if stacked.dtype.kind in "biufc":
            if isinstance(first, (int, float)) and stacked.dtype.kind in "iuf":  # Python scalars, as torch
                stacked = stacked.astype(np.float64 if stacked.dtype.kind == "f" else np.int64)
            return torch.from_numpy(stacked)
    if all(a.ndim <= 1 and a.dtype == arrays[0].dtype and a.dtype.kind in "biufc" for a in arrays):
        return ragged_to_torch(Ragged.from_list(arrays, kind="varray", dtype=arrays[0].dtype))
    raise TypeError(f"BatchViews: cannot make a batch view of samples of type {type(first).__name__}")


class BatchViews:
    """The identity collate of batch views: `Loader(ds, batch_size=B, collate_fn=BatchViews())`
    yields each batch as its columns (fixed fields as tensors, variable ones as `Ragged`).

    Example::

        loader = fastload.Loader(ds, batch_size=256, shuffle=True, collate_fn=fastload.BatchViews())
        for batch in loader:
            jpegs = batch["jpeg"]                  # Ragged: values (uint8 tensor), offsets (int64)
            first = jpegs[0]                       # sample 0's bytes
            lengths = jpegs.offsets.diff()         # per-sample sizes, no Python loop

    Given a list of sample dicts (a dataset without `get_batch`), it builds the same columns
    from them: equal-shape arrays and scalars stacked, bytes / str / 1-D arrays as `Ragged`.

    Run context (`fastload.run`): the identity depends on no run fact; `bind_run` records the
    run the Loader gave (`run`).
    """

    accepts_batch_views = True

    def __init__(self) -> None:
        self.run: RunContext | None = None  # the Loader's run (`bind_run`)

    def bind_run(self, run: RunContext) -> None:
        """Record the Loader's run (`fastload.run.RunAware`; the columns do not depend on it)."""
        self.run = run

    def __call__(self, batch: Any) -> Any:
        """The columns of `batch` (a batch-views dict as is; a list of sample dicts columnised)."""
        if isinstance(batch, Mapping):
            return batch
        if isinstance(batch, Sequence) and batch and all(isinstance(s, Mapping) for s in batch):
            return {key: _column_from_samples([s[key] for s in batch]) for key in batch[0]}
        raise TypeError(f"BatchViews takes a batch-views dict or a list of sample dicts, got {type(batch).__name__}")

    def __repr__(self) -> str:
        return "BatchViews()"
