"""`EpochPlan`: an epoch's small per-sample reads on the Loader's direct path, done at once.

On the direct path (a local fastload dataset of fixed-size fields, see `fastload.fetch.fetcher`) a batch
costs, besides the gather of its large fields, a lookup of its rows in each spliced column and a
gather of each small in-memory field (labels, ids): small random reads, a numpy call each, paid
per batch in the thread that fetches, with the caches cold after the large gather. Done once for
the whole epoch's order when it is computed (one vectorized `take` per field,
`FastloadDataset.direct_plan`), a batch's small fields become slices and its large fields one
gather at row numbers already known.

The plan cuts the epoch's index array into its batches itself, and the order yields those very
arrays: a batch is matched to the plan by identity (a dict lookup keyed by `id()`, where
computing its place in the epoch from its address cost more than a microsecond). Why an `id()`
key cannot match the wrong array: the plan keeps every batch it keyed alive (`batches`) for as
long as it can be looked up, and the array looked up is alive during the lookup, so two live
objects would share an id, which CPython never allows; the entry also holds the batch and the
lookup checks `is`. A plan replaced by the next epoch's is no longer looked up (`Fetcher` reads
its one current plan), and an old epoch's array still in a worker's queue is alive, so it
cannot share an id with the new plan's batches. Anything not matched (another epoch's indices,
a user's array) is fetched as before, so a plan changes how a batch is read, never what it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["BATCH_BYTES", "PLAN_MAX_BYTES", "EpochPlan"]

PLAN_MAX_BYTES = 256 << 20  # an epoch is planned only while its plan (8 bytes a row number) fits this
BATCH_BYTES = 320  # a planned batch's own Python objects (its index view, its entry): 292 measured


class EpochPlan:
    """The planned reads of one index array (an epoch's order for this rank), cut into `batches`
    of `batch_size` (the last one may be shorter).

    `fields`: per field `(name, data, rows, gather_alone)` as `direct_plan` gives them, plus the
    engine a lone fetcher gathers `rows` with (`gather_alone(row_numbers) -> tensor`, or None to
    use `np.take`). A batch's values are views of `data`.
    """

    __slots__ = ("_fields", "_starts", "batches")

    def __init__(
        self,
        indices: np.ndarray,
        batch_size: int,
        fields: list[tuple[str, np.ndarray, np.ndarray | None, Callable[[np.ndarray], torch.Tensor] | None]],
    ) -> None:
        if type(indices) is not np.ndarray or indices.dtype != np.int64 or indices.ndim != 1:
            raise TypeError("an EpochPlan plans a one-dimensional int64 index array")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batches = [indices[k : k + batch_size] for k in range(0, len(indices), batch_size)]
        # id -> (where the batch starts, the batch): `batches` keeps them alive (see the module docstring)
        self._starts = {id(b): (k * batch_size, b) for k, b in enumerate(self.batches)}
        self._fields = fields

    def offset(self, indices: Any) -> int | None:
        """Where `indices` starts in the planned array when it is one of `batches`, else None."""
        entry = self._starts.get(id(indices))
        return entry[0] if entry is not None and entry[1] is indices else None

    def batch(self, indices: Any, *, alone: bool) -> dict[str, torch.Tensor] | None:
        """The batch at `indices` (a dict of tensors, what the per-batch takes would give), or None
        when `indices` is not one of `batches`. `alone`: no other thread fetches
        meanwhile, so large fields may be gathered by `gather_alone` on every core."""
        a = self.offset(indices)
        if a is None:
            return None
        b = a + len(indices)
        out = {}
        for name, data, rows, gather_alone in self._fields:
            if rows is None:
                out[name] = torch.from_numpy(data[a:b])
            elif alone and gather_alone is not None:
                out[name] = gather_alone(data[a:b])
            else:
                out[name] = torch.from_numpy(rows.take(data[a:b], axis=0))
        return out
