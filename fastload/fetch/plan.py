"""`EpochPlan`: an epoch's small per-sample reads on the Loader's direct path, done at once.

On the direct path (a local fastload dataset of fixed-size fields, see `fastload.fetch.fetcher`) a batch
costs, besides the gather of its large fields, a lookup of its rows in each spliced column and a
gather of each small in-memory field (labels, ids): small random reads, a numpy call each, paid
per batch in the thread that fetches, with the caches cold after the large gather. Done once for
the whole epoch's order when it is computed (one vectorized `take` per field,
`FastloadDataset.direct_plan`), a batch's small fields become slices and its large fields one
gather at row numbers already known.

The plan cuts the epoch's index array into its batches itself, and the order yields each of
those arrays with its `PlanSlice` in the batch's record (`fastload.order.BatchRecord`): the
record, not the array, says where a batch lies in the plan, so nothing is matched by identity.
A slice is read only while the plan was made against the fetcher's current mappings (`source`):
a late batch of an epoch whose dataset was reopened since, a user's sampler or process workers
take the per-batch path, so a plan changes how a batch is read, never what it holds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fastload.formats.rows import gather_rows

__all__ = ["BATCH_BYTES", "PLAN_MAX_BYTES", "EpochPlan", "PlanSlice"]

PLAN_MAX_BYTES = 256 << 20  # an epoch is planned only while its plan (8 bytes a row number) fits this
BATCH_BYTES = 320  # a planned batch's own Python objects (its index view, its slice)


class EpochPlan:
    """The planned reads of one index array (an epoch's order for this rank), cut into `batches`
    of `batch_size` (the last one may be shorter); `slices()` gives each its `PlanSlice`.

    `fields`: per field `(name, data, rows, gather_alone)` as `direct_plan` gives them, plus the
    engine a lone fetcher gathers `rows` with (`gather_alone(row_numbers) -> tensor`, or None to
    use `gather_rows`). A batch's values are views of `data`. `source`: what the plan was read
    through (the fetcher's takes); a fetcher reads a slice only while its own takes are that.
    """

    __slots__ = ("__weakref__", "_fields", "batch_size", "batches", "source")

    def __init__(
        self,
        indices: np.ndarray,
        batch_size: int,
        fields: list[tuple[str, np.ndarray, np.ndarray | None, Callable[[np.ndarray], torch.Tensor] | None]],
        *,
        source: object = None,
    ) -> None:
        if type(indices) is not np.ndarray or indices.dtype != np.int64 or indices.ndim != 1:
            raise TypeError("an EpochPlan plans a one-dimensional int64 index array")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batches = [indices[k : k + batch_size] for k in range(0, len(indices), batch_size)]
        self._fields, self.source, self.batch_size = fields, source, batch_size

    def slices(self) -> list[PlanSlice]:
        """Each batch's slice of the plan, in order (made on each call and not kept here: the
        slices refer to the plan, so the plan is freed with the last of them, without a cycle)."""
        bs = self.batch_size
        return [PlanSlice(self, k * bs, k * bs + len(b)) for k, b in enumerate(self.batches)]

    def read(self, a: int, b: int, *, alone: bool) -> dict[str, torch.Tensor]:
        """The batch of planned positions `a:b` (a dict of tensors, what the per-batch takes would
        give). `alone`: no other thread fetches meanwhile, so large fields may be gathered by
        `gather_alone` on every core."""
        out = {}
        for name, data, rows, gather_alone in self._fields:
            if rows is None:
                out[name] = torch.from_numpy(data[a:b])
            elif alone and gather_alone is not None:
                out[name] = gather_alone(data[a:b])
            else:
                out[name] = torch.from_numpy(gather_rows(rows, data[a:b]))
        return out


class PlanSlice:
    """One batch's place in an `EpochPlan`: planned positions `start:stop`."""

    __slots__ = ("plan", "start", "stop")

    def __init__(self, plan: EpochPlan, start: int, stop: int) -> None:
        self.plan, self.start, self.stop = plan, start, stop

    def read(self, *, alone: bool) -> dict[str, torch.Tensor]:
        """This batch, read from the plan (see `EpochPlan.read`)."""
        return self.plan.read(self.start, self.stop, alone=alone)
