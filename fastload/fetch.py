"""`Fetcher`: indices -> one CPU batch, timed per stage; the unit of work of every worker kind.

Modes (chosen by the Loader):

* ``columns`` — fast path: `dataset.get_batch(indices)` once, optional `transform` on the
  columnar dict, then `columns_to_torch` (no per-sample Python).
* ``getitems`` — `dataset.__getitems__(indices)` once (as torch does), then `collate_fn`.
* ``getitem`` — `[dataset[i] for i in indices]`, then `collate_fn`.
* ``single`` — `batch_size=None`: `collate_fn(dataset[index])` (torch's `default_convert`).

Outside the fast path `transform` (if given) runs on the collated batch. Exceptions carry a
note naming the failing sample index (found by retrying the batch sample by sample).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastload.collate import columns_to_torch

__all__ = ["MODES", "Fetcher"]

MODES = ("columns", "getitems", "getitem", "single")


class Fetcher:
    """Picklable callable `fetcher(indices) -> (batch, {stage: seconds})`."""

    def __init__(
        self,
        dataset: Any,
        *,
        mode: str,
        collate_fn: Callable[[Any], Any] | None,
        transform: Callable[[Any], Any] | None = None,
        scalar_fields: frozenset[str] = frozenset(),
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.dataset, self.mode, self.collate_fn = dataset, mode, collate_fn
        self.transform, self.scalar_fields = transform, scalar_fields

    def __call__(self, indices: Any) -> tuple[Any, dict[str, float]]:
        try:
            return self._fetch(indices)
        except Exception as e:
            self._annotate(e, indices)
            raise

    def _fetch(self, indices: Any) -> tuple[Any, dict[str, float]]:
        ds = self.dataset
        if self.mode != "columns" and isinstance(indices, np.ndarray):
            indices = indices.tolist()  # torch's datasets see lists of ints
        t0 = time.perf_counter()
        if self.mode == "columns":
            data = ds.get_batch(indices)
            t1 = t2 = time.perf_counter()
            if self.transform is not None:
                data = self.transform(data)
                t2 = time.perf_counter()
            batch = columns_to_torch(data, scalar_fields=self.scalar_fields)
            t3 = time.perf_counter()
            return batch, {"read": t1 - t0, "transform": t2 - t1, "collate": t3 - t2}
        if self.mode == "getitems":
            data = ds.__getitems__(indices)
        elif self.mode == "getitem":
            data = [ds[i] for i in indices]
        else:
            data = ds[indices]
        t1 = time.perf_counter()
        batch = self.collate_fn(data) if self.collate_fn is not None else data
        t2 = time.perf_counter()
        if self.transform is not None:
            batch = self.transform(batch)
        t3 = time.perf_counter()
        return batch, {"read": t1 - t0, "collate": t2 - t1, "transform": t3 - t2}

    def _annotate(self, exc: BaseException, indices: Any) -> None:
        """Add a note with the failing sample index (retrying one by one if needed)."""
        if self.mode == "single":
            _note(exc, f"fastload: raised while loading sample index {indices}")
            return
        bad = _locate(self.dataset, indices)
        if bad is not None:
            _note(exc, f"fastload: raised while loading sample index {bad} (batch indices {_short(indices)})")
        else:
            _note(exc, f"fastload: raised while loading batch indices {_short(indices)}")


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11: shown with the traceback
        exc.add_note(text)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), text]  # type: ignore[attr-defined]


def _short(indices: Sequence[Any]) -> str:
    idx = list(indices)
    return str(idx) if len(idx) <= 16 else f"{idx[:16]}... ({len(idx)} samples)"


def _locate(dataset: Any, indices: Sequence[Any]) -> Any:
    """The first index whose `dataset[i]` raises, or None."""
    if not callable(getattr(dataset, "__getitem__", None)):
        return None
    for i in indices:
        try:
            dataset[i]
        except Exception:  # noqa: BLE001 - any error marks the culprit; the original is re-raised
            return i
    return None
