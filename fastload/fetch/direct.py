"""`DirectReader`: what a dataset offers for the fetch stage's direct path.

A dataset whose fields are all fixed-size and each one `take` over all its shards (a local
`FastloadDataset`) implements it; the `Fetcher` then reads a batch as those takes wrapped by
`torch.from_numpy`, and an epoch's small reads at once (`fastload.fetch.plan`). While it has no takes
(a remote dataset's cold epoch), `direct_read` may still give a batch's columns read by the dataset's
own code alone (no run context, no collate: nothing of the user's runs for such a batch). A wrapper that
changes what `get_batch` returns (`fastload.vision.IndexedDataset` adds a column) must not pass
these methods through: the takes would no longer be its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["DIRECT_READER_METHODS", "DirectReader", "Gather", "Take"]

Take = Callable[[np.ndarray], Any]  # int64 indices -> one field's values (an array, or a tensor with a gather)
Gather = Callable[[np.ndarray], Callable[[np.ndarray], Any] | None]  # rows -> gather(row_numbers), or None

DIRECT_READER_METHODS = ("direct_takes", "direct_plan", "direct_read")


@runtime_checkable
class DirectReader(Protocol):
    """A dataset with a direct path (see the module docstring; `FastloadDataset` documents both)."""

    def __len__(self) -> int: ...

    def get_batch(self, indices: Any) -> dict[str, Any]:
        """The batch's columns (what the takes give, field by field)."""

    def direct_takes(self, gather: Gather | None = None) -> list[tuple[str, Take]] | None:
        """`(field, take)` for every field when each is one take over all shards, else None."""

    def direct_plan(
        self, indices: Any, *, max_bytes: int | None = None
    ) -> list[tuple[str, np.ndarray, np.ndarray | None]] | None:
        """Per field `(name, data, rows)`: the small reads of `direct_takes()` for all of `indices`."""

    def direct_read(self, indices: Any) -> dict[str, np.ndarray] | None:
        """The batch's columns, read by the dataset's own code alone (while `direct_takes()` is None), or
        None having read nothing (the fetch stage's general path reads the batch then)."""
