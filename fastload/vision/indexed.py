"""`with_indices(ds)`: a dataset view whose batches carry their dataset indices.

The image preset keys random crops/flips by dataset index (exact resume) and names bad samples
by it; a plain `get_batch` dict does not say which indices it holds. The view adds them:
`get_batch(indices)` gets an `__indices__` int64 column, `ds[i]` / `__getitems__` an
`__index__` entry per sample. Other attributes are forwarded to the wrapped dataset, except the
direct path's methods (`fastload.fetch.direct.DirectReader`): the wrapped dataset's takes lack the
`__indices__` column, so the view is read batch by batch through its own `get_batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fastload.fetch.direct import DIRECT_READER_METHODS

__all__ = ["INDEX_KEY", "IndexedDataset", "with_indices"]

INDEX_KEY = "__index__"


class IndexedDataset:
    """Forwards to `dataset`, adding the indices to every sample / batch it returns."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], INDEX_KEY: int(index)}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(list(indices)) if getitems is not None else [self.dataset[i] for i in indices]
        return [{**s, INDEX_KEY: int(i)} for s, i in zip(items, indices, strict=True)]

    def get_batch(self, indices: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped dataset's batch plus `__indices__`: the dataset indices of its samples (int64)."""
        batch = dict(self.dataset.get_batch(indices, **kwargs))
        batch["__indices__"] = np.asarray(indices, dtype=np.int64).reshape(-1)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        if name in DIRECT_READER_METHODS:  # its takes are not this view's batches (no `__indices__`)
            raise AttributeError(f"{type(self).__name__} has no {name}: its batches carry `__indices__`")
        return getattr(self.dataset, name)


def with_indices(dataset: Any) -> IndexedDataset:
    """Wrap `dataset` so the image preset sees the dataset indices of each batch."""
    return dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)
