"""`Fetcher`: indices -> one CPU batch, timed per stage; the unit of work of every worker kind.

Modes (chosen by the Loader):

* ``columns`` — fast path: `dataset.get_batch(indices)` once, optional `transform` on the
  columnar dict, then `columns_to_torch` (no per-sample Python). Leanest case: a dataset whose
  `direct_takes()` gives one `take` per field (local fastload datasets of fixed-size fields),
  no `transform`, and columns that `columns_to_torch` would only wrap with `torch.from_numpy`
  (checked on one sample as each epoch starts): each batch is then those takes and `from_numpy`,
  nothing else, timed as "read". With two cores gathering, every microsecond the GIL is held per batch shows.
  When the Loader has handed over the epoch's order (`plan`), the row lookups and the small
  in-memory fields of all its batches are read at once, and a batch that comes with its
  `PlanSlice` is one gather per large field plus slices (`fastload.fetch.plan`).
* ``views`` — `dataset.get_batch(indices)` once, `columns_to_views` (fixed fields as tensors,
  variable fields as `Ragged` of tensors: no per-sample Python), then `collate_fn`, a collate
  that declares ``accepts_batch_views`` (`fastload.fetch.views`), then `transform`.
* ``getitems`` — `dataset.__getitems__(indices)` once (as torch does), then `collate_fn`.
* ``getitem`` — `[dataset[i] for i in indices]`, then `collate_fn`.
* ``single`` — `batch_size=None`: `collate_fn(dataset[index])` (torch's `default_convert`).

Outside the ``columns`` path `transform` (if given) runs on the collated batch. Exceptions carry a
note naming the failing sample index: for a sharded dataset found from its index alone (the first
index out of range, or in a shard the error names; nothing is read again, so a failed remote read
is not retried a second time), for other datasets by reading the batch's samples one by one.

The run: `bind_run` (`fastload.run`) records the Loader's run context and hands it to the
dataset, `collate_fn` and `transform`; while they run for a batch, `fastload.run.current_batch()`
gives them the run and the batch's dataset indices (in worker threads, worker processes and
the consumer alike).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from fastload.fetch.collate import columns_to_torch, zero_copy_column
from fastload.fetch.direct import DirectReader
from fastload.fetch.plan import BATCH_BYTES, PLAN_MAX_BYTES, EpochPlan, PlanSlice
from fastload.fetch.views import columns_to_views
from fastload.remote.retry import RemoteFetchError
from fastload.run import RunContext, batch_context, bind_components

__all__ = ["MODES", "Fetcher", "torch_gather"]

MODES = ("columns", "views", "getitems", "getitem", "single")


@dataclass(frozen=True)
class _Prepared:
    """A plan made ahead (`Fetcher.prepare_plan`) for `indices` through `takes`."""

    indices: np.ndarray
    batch_size: int
    takes: Any
    plan: EpochPlan | None


class Fetcher:
    """Picklable callable `fetcher(indices, planned=None) -> (batch, {stage: seconds})`; `planned`:
    the batch's slice of the epoch plan (`BatchRecord.plan`)."""

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
        self._takes: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] | None = None
        self._takes_alone: list[tuple[str, Callable[[np.ndarray], torch.Tensor]]] | None = None  # make tensors
        self._takes_checked = False
        # the dataset's `direct_read` while `_takes` is None (mode and transform allowing)
        self._direct_read: Callable[[Any], dict[str, np.ndarray] | None] | None = None
        # the next epoch's plan, prepared on the order's background thread: one store, one read
        self._prepared: _Prepared | None = None
        self.run: RunContext | None = None  # the Loader's run (`bind_run`)

    def bind_run(self, run: RunContext) -> None:
        """Record the run (each batch's `current_batch()` carries it) and hand it to the dataset,
        `collate_fn` and `transform` that implement `fastload.run.RunAware`."""
        self.run = run
        bind_components((self.dataset, self.collate_fn, self.transform), run)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_takes"] = state["_takes_alone"] = state["_direct_read"] = None  # bound to this process's mappings
        state["_takes_checked"] = False
        state["_prepared"] = None
        return state

    def refresh(self) -> None:
        """Look up the dataset's `direct_takes()` again, now (the Loader calls this as each epoch
        starts, so a dataset closed and reopened between epochs is read through its new mappings;
        in the consumer's thread, rather than in whichever worker fetches first)."""
        self._takes_checked = False
        self._direct_takes()

    def plan(self, indices: np.ndarray, batch_size: int) -> EpochPlan | None:
        """Do the small reads of the direct path for all of `indices` (an epoch's order) now, in
        one vectorized step per field, instead of per batch (see `fastload.fetch.plan`): the plan,
        cut into batches of `batch_size`, each with the `PlanSlice` its record carries. None off
        the direct path, for an empty or oversized plan (`PLAN_MAX_BYTES`), or when an index is
        out of range (the batch holding it then raises as usual). A plan `prepare_plan` made for
        these very `indices` is taken instead of reading again, if the dataset's takes are still
        the same (not reopened since)."""
        takes = self._takes
        prepared, self._prepared = self._prepared, None
        if (
            prepared is not None
            and prepared.indices is indices
            and prepared.batch_size == batch_size
            and prepared.takes is takes
            and prepared.plan is not None  # none then (e.g. blocks still unverified) may be one now
        ):
            return prepared.plan
        return self._make_plan(indices, batch_size, takes)

    def prepare_plan(self, indices: np.ndarray, batch_size: int) -> None:
        """Make the plan of `indices` (the next epoch's order, computed ahead on another thread)
        for the `plan` call of that epoch."""
        takes = self._takes
        self._prepared = _Prepared(indices, batch_size, takes, self._make_plan(indices, batch_size, takes))

    @property
    def plan_prepared(self) -> bool:
        """Whether a plan made ahead (`prepare_plan`) waits for its epoch."""
        return self._prepared is not None

    def _make_plan(self, indices: np.ndarray, batch_size: int, takes: list[Any] | None) -> EpochPlan | None:
        dataset = self.dataset
        if takes is None or not isinstance(dataset, DirectReader) or type(indices) is not np.ndarray:
            return None
        if not len(indices):
            return None
        if indices.dtype != np.int64 or indices.ndim != 1:
            return None
        room = PLAN_MAX_BYTES - -(-len(indices) // batch_size) * BATCH_BYTES  # after the batches' own objects
        if room < 0:
            return None
        try:
            fields = dataset.direct_plan(indices, max_bytes=room)
        except IndexError:
            return None
        if fields is None or [name for name, _, _ in fields] != [name for name, _ in takes]:
            return None
        return EpochPlan(
            indices,
            batch_size,
            [(name, data, rows, None if rows is None else torch_gather(rows)) for name, data, rows in fields],
            source=takes,
        )

    @property
    def direct(self) -> bool:
        """Whether a batch is only the dataset's takes (GIL-free gathers) wrapped as tensors, as of
        the last `refresh()`."""
        return self._takes is not None

    def direct_path(self) -> bool:
        """`direct`, checking the dataset's takes first if no epoch has done so yet."""
        if not self._takes_checked:
            self._direct_takes()
        return self._takes is not None

    def __call__(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float]]:
        return self._call(indices, planned, alone=False)

    def fetch_alone(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float]]:
        """`self(indices)` for a caller that no other thread fetches beside (`num_workers=0`, the
        autotune's inline stretch): the large fields of the direct path are gathered by one
        `torch.index_select`, which torch spreads over its intra-op threads, so one consumer uses
        every core torch may use. Same batch, same errors."""
        return self._call(indices, planned, alone=True)

    def _call(self, indices: Any, planned: PlanSlice | None, *, alone: bool) -> tuple[Any, dict[str, float]]:
        try:
            if not self._takes_checked:
                self._direct_takes()
            takes = self._takes_alone if alone else self._takes
            if takes is None:
                read = self._direct_read
                if read is not None:  # a cold epoch's batch, read by the dataset alone: no run context, no collate
                    t0 = time.perf_counter()
                    cols = read(indices)
                    if cols is not None:
                        batch = columns_to_torch(cols, scalar_fields=self.scalar_fields)
                        return batch, {"read": time.perf_counter() - t0}
                return self._fetch(indices)
            t0 = time.perf_counter()
            if planned is not None and planned.plan.source is self._takes:  # read through these mappings
                return planned.read(alone=alone), {"read": time.perf_counter() - t0}
            idx = np.asarray(indices, dtype=np.int64).reshape(-1)
            try:
                if alone:  # these make tensors
                    batch = {name: take(idx) for name, take in takes}
                else:
                    batch = {name: torch.from_numpy(take(idx)) for name, take in takes}
            except IndexError:
                self.dataset.get_batch(indices)  # raises the error that names the dataset
                raise
            return batch, {"read": time.perf_counter() - t0}
        except Exception as e:
            self._annotate(e, indices)
            raise

    def _fetch(self, indices: Any) -> tuple[Any, dict[str, float]]:
        if self.run is None:
            return self._fetch_batch(indices)
        with batch_context(self.run, indices):
            return self._fetch_batch(indices)

    def _fetch_batch(self, indices: Any) -> tuple[Any, dict[str, float]]:
        ds = self.dataset
        if self.mode not in ("columns", "views") and isinstance(indices, np.ndarray):
            indices = indices.tolist()  # torch's datasets see lists of ints
        t0 = time.perf_counter()
        if self.mode == "views":
            data = columns_to_views(ds.get_batch(indices), scalar_fields=self.scalar_fields)
        elif self.mode == "columns":
            data = ds.get_batch(indices)
            t1 = t2 = time.perf_counter()
            if self.transform is not None:
                data = self.transform(data)
                t2 = time.perf_counter()
            batch = columns_to_torch(data, scalar_fields=self.scalar_fields)
            t3 = time.perf_counter()
            return batch, {"read": t1 - t0, "transform": t2 - t1, "collate": t3 - t2}
        elif self.mode == "getitems":
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

    def _direct_takes(self) -> list[tuple[str, Callable[[np.ndarray], np.ndarray]]] | None:
        """The dataset's `direct_takes()` in columns mode without a `transform`, when every column
        they give converts with a bare `torch.from_numpy` (checked on one sample), else None."""
        dataset = self.dataset
        takes = alone = None
        direct = isinstance(dataset, DirectReader) and self.mode == "columns" and self.transform is None
        if direct:
            takes = dataset.direct_takes()
        self._direct_read = dataset.direct_read if direct and takes is None else None
        if takes is not None:
            assert isinstance(dataset, DirectReader)
            probe = dataset.get_batch(np.zeros(min(1, len(dataset)), dtype=np.int64))
            if list(probe) != [name for name, _ in takes] or not all(
                zero_copy_column(name, col, self.scalar_fields) for name, col in probe.items()
            ):
                takes = None
            else:  # spliced fields come as tensors made by torch; the others are `takes`' own, wrapped
                plain = dict(takes)
                alone = [
                    (name, partial(_tensor_take, take) if take is plain[name] else take)
                    for name, take in dataset.direct_takes(gather=torch_gather) or ()
                ]
        self._takes, self._takes_alone, self._takes_checked = takes, alone, True
        return takes

    def _annotate(self, exc: BaseException, indices: Any) -> None:
        """Add a note with the failing sample index, found without reading anything again (see `_locate`)."""
        if self.mode == "single":
            _note(exc, f"fastload: raised while loading sample index {indices}")
            return
        bad = _locate(self.dataset, indices, exc)
        if bad is not None:
            _note(exc, f"fastload: raised while loading sample index {bad} (batch indices {_short(indices)})")
        else:
            _note(exc, f"fastload: raised while loading batch indices {_short(indices)}")


def _tensor_take(take: Callable[[np.ndarray], np.ndarray], indices: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(take(indices))


def torch_gather(rows: np.ndarray) -> Callable[[np.ndarray], torch.Tensor] | None:
    """`torch.from_numpy(rows.take(row_numbers, axis=0))` as one `torch.index_select`, which torch
    splits over its intra-op threads, holding the GIL once per batch; made as a tensor, not
    through numpy (see ARCHITECTURE.md, "The Loader's direct path"). None for a dtype torch
    lacks. The mapping behind `rows` is never written through the tensor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the mapping is read-only
        try:
            source = torch.from_numpy(rows)
        except (TypeError, ValueError):  # no torch dtype for it, or not in native byte order
            return None
    return partial(_index_select, source)


def _index_select(source: torch.Tensor, row_numbers: np.ndarray) -> torch.Tensor:
    return torch.index_select(source, 0, torch.from_numpy(row_numbers))


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11: shown with the traceback
        exc.add_note(text)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), text]  # type: ignore[attr-defined]


def _short(indices: Sequence[Any]) -> str:
    idx = list(indices)
    return str(idx) if len(idx) <= 16 else f"{idx[:16]}... ({len(idx)} samples)"


def _locate(dataset: Any, indices: Sequence[Any], exc: BaseException) -> Any:
    """The index of `indices` that the error `exc` is about, or None.

    A sharded dataset (`shard_boundaries` and `manifest`, as `FastloadDataset` has) is never read
    again: the culprit is the first index out of range, else the first whose shard file the error
    names. A remote read that failed for good (`RemoteFetchError`) is not repeated either: its
    retries were spent already. Any other map-style dataset has its samples read one by one until
    one raises (the only way to find it in user code)."""
    bounds, manifest = getattr(dataset, "shard_boundaries", None), getattr(dataset, "manifest", None)
    if bounds is not None and manifest is not None:
        return _locate_in_shards(np.asarray(bounds), [s.file for s in manifest.shards], indices, exc)
    if _remote_failure(exc) or not callable(getattr(dataset, "__getitem__", None)):
        return None
    for i in indices:
        try:
            dataset[i]
        except Exception:  # noqa: BLE001 - any error marks the culprit; the original is re-raised
            return i
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and its causes / contexts."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not e for e in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _remote_failure(exc: BaseException) -> bool:
    return any(isinstance(e, RemoteFetchError) for e in _chain(exc))


def _locate_in_shards(bounds: np.ndarray, files: list[str], indices: Sequence[Any], exc: BaseException) -> Any:
    """From the index alone: the first index out of range, else the first in a shard the error names."""
    n = int(bounds[-1])
    text = " ".join(str(e) for e in _chain(exc))
    named = {k for k, f in enumerate(files) if f in text}
    for i in indices:
        try:
            j = int(i)
        except (TypeError, ValueError):
            return i
        if not -n <= j < n:
            return i
        if int(np.searchsorted(bounds, j % n, side="right")) - 1 in named:
            return i
    return None
