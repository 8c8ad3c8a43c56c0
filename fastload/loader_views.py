"""The Loader's torch attributes as views of what it delivers, for frameworks that rebuild a loader from them.

Hugging Face Accelerate's `skip_first_batches(loader, n)` (and code like it) builds a torch
`DataLoader(loader.dataset, batch_sampler=<skip n of loader.batch_sampler>,
collate_fn=loader.collate_fn, num_workers=loader.num_workers, ...)`. For that loader to yield
exactly the rest of the Loader's epoch, with the Loader's batches, these attributes say the truth:

* `EpochBatchSampler` (`loader.batch_sampler` when the Loader made its own order, i.e. no user
  `sampler`/`batch_sampler`): this rank's batches of the Loader's current epoch, from the epoch's
  start, in the Loader's order — the seeded, rank-dealt order when that is what the Loader runs;
  else torch's own `BatchSampler`: an epoch under way replayed from the RNG states it started
  with, otherwise drawn as torch would. `len()` is that epoch's batch count.
  Iterating it to its end counts as the epoch delivered: the Loader's next `iter()` runs the next
  epoch, as after its own iterator's last batch. While the Loader holds a position of an epoch
  that was re-dealt to another world or batch size (a `load_state_dict` from another world size),
  "the epoch's first n batches" has no meaning at this world size: iterating raises `ValueError`.
* `EpochSampler` (`loader.sampler` then): the same epoch's indices, batch after batch.
* `LoaderCollate` (`loader.collate_fn` when the Loader's batch is not just `collate_fn(samples)`:
  with a `transform`, or when the batch is built from the dataset's `get_batch` columns): a list of
  samples (`dataset[i]` / `dataset.__getitems__`) to exactly the batch the Loader yields for them:
  the columns `get_batch` would give (rebuilt from the samples, exactly for a dataset with a fastload
  `schema`), the `transform`, then the Loader's conversion; or the collate, then the `transform`.
  Other attributes (`stats`, `bind_workers`, ...) are the wrapped collate's. It is also
  `loader.collate_fn` when the collate takes the run (`fastload.run.RunAware`, e.g. an
  `ImagePreset` given as `collate_fn`), so that the batch context below reaches it.

Augmentation keyed by the batch (`fastload.run.current_batch()`, e.g. `ImagePreset(kind="train")`)
stays the Loader's: `EpochBatchSampler` hands each batch it yields, with the Loader's run, to
`LoaderCollate` through a `BatchRelay`, and `LoaderCollate` makes it the current batch while it
builds the batch. That holds where torch collates a batch in the thread that drew its indices,
right after drawing them: a rebuilt DataLoader with `num_workers=0` (torch draws a batch from the
batch sampler, reads its samples, collates them), and only if the sample count matches. Elsewhere
(worker processes: torch draws indices ahead in the main process; a user's batch sampler, which
hands nothing over) `LoaderCollate` runs the batch in `fastload.run.unknown_batch`: a component
that asks for the batch's indices gets `BatchUnknownError` naming the way out (resume through the
Loader's `load_state_dict`, or `num_workers=0` for the resumed epoch), never a silently different
augmentation. A component that asks nothing (`TextCollate`, a plain transform) is unaffected.
A dataset's `__getitem__` is called by torch directly: it gets no batch context there.

A user's `sampler` / `batch_sampler` stays as given: the Loader iterates that very object, so it
already says what the Loader does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, Sampler, get_worker_info

from fastload.fetch.collate import columns_to_torch
from fastload.formats.ragged import Ragged
from fastload.formats.shapes import ShapedBatch
from fastload.order.choice import RankedOrder
from fastload.order.sampling import SeededOrder
from fastload.pipeline.progress import EpochProgress
from fastload.run import RunAware, RunContext, batch_context, implements, unknown_batch

__all__ = [
    "BatchRelay",
    "EpochBatchSampler",
    "EpochSampler",
    "LoaderCollate",
    "columns_from_samples",
    "torch_collate",
]

_WAY_OUT = (
    "Resume through the Loader itself: loader.load_state_dict(state) continues exactly after the last batch "
    "received (Accelerate: register_for_checkpointing(loader) and load_state, without skip_first_batches)"
)


class BatchRelay:
    """Hands the batch `EpochBatchSampler` has just yielded (with the Loader's run) to `LoaderCollate`,
    in the same thread and process, while the sampler's iteration is suspended at that batch (see the
    module docstring). A pickled copy (a worker process) holds nothing."""

    def __init__(self) -> None:
        self._local = threading.local()

    def publish(self, run: RunContext | None, indices: list[int] | None) -> None:
        """`indices` (of the run `run`) is the batch just yielded in this thread; None: none is."""
        self._local.batch = None if indices is None else (os.getpid(), run, indices)

    def take(self, samples: int) -> tuple[RunContext, list[int]] | str:
        """The batch published in this thread for a collate of `samples` samples (then forgotten),
        or why there is none."""
        held = getattr(self._local, "batch", None)
        self._local.batch = None
        if held is None or held[0] != os.getpid():
            return (
                "loader.collate_fn was called on samples that loader.batch_sampler did not just yield in this "
                "thread (a torch DataLoader rebuilt from the Loader, e.g. by Accelerate's skip_first_batches, "
                "hands batches from loader.batch_sampler to loader.collate_fn in one thread only with "
                f"num_workers=0). {_WAY_OUT}, or rebuild the DataLoader with num_workers=0 for the resumed epoch"
            )
        _, run, indices = held
        if len(indices) != samples:
            return (
                f"loader.batch_sampler yielded {len(indices)} indices but loader.collate_fn got {samples} samples, "
                f"so they cannot be matched. {_WAY_OUT}"
            )
        return run, indices

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._local = threading.local()


def _rank_batches(orders: RankedOrder, progress: EpochProgress, torch_batches: Any) -> Iterator[list[int]]:
    """This rank's batches of the current epoch from its start, in the Loader's order."""
    order = orders.get()
    pos = progress.saved()
    if not isinstance(order, SeededOrder):
        if pos is None or pos.get("rng") is None:  # no epoch under way: torch's samplers draw it, as in torch
            yield from torch_batches
            return
        # the epoch under way: its draws replayed from the RNG states captured when it started
        start = {"batches": 0, "sampler_state": None, "rng": pos["rng"], "base_seed": None}
        _, _, replayed = order.epoch(draw_base_seed=False, resume=start)
        for indices, _, _ in replayed:
            yield indices.tolist() if isinstance(indices, np.ndarray) else list(indices)
        return
    geometry = (0, order.world_size, order.batch_size)
    if pos is not None and (int(pos.get("base", 0)), pos.get("world_size"), pos.get("batch_size")) != geometry:
        raise ValueError(
            f"this Loader is in epoch {progress.epoch} at a position whose epoch began at another world or batch "
            f"size (a state loaded from another run: saved at world size {pos.get('world_size')}, batch size "
            f"{pos.get('batch_size')}, {pos.get('base')} samples of the epoch dealt before it): its first batches "
            f"at world size {order.world_size}, batch size {order.batch_size} are not those that were seen, so "
            "skipping a number of them cannot give the rest of the epoch. Iterate the Loader itself: it continues "
            "exactly after the last batch received (Accelerate: register_for_checkpointing(loader) and "
            "load_state, without skip_first_batches)"
        )
    _, _, batches = order.epoch(progress.epoch, ahead=False)
    for indices, _, _ in batches:
        yield indices.tolist()


class EpochSampler(Sampler[int]):
    """`loader.sampler` of a Loader that runs its own order: this rank's indices of its current
    epoch (see the module docstring). Iterating it has no effect on the Loader."""

    def __init__(self, orders: RankedOrder, progress: EpochProgress, torch_sampler: Any, torch_batches: Any) -> None:
        self._orders, self._progress = orders, progress
        self._torch_sampler, self._torch_batches = torch_sampler, torch_batches

    def __iter__(self) -> Iterator[int]:
        if not isinstance(self._orders.get(), SeededOrder):
            yield from self._torch_sampler
            return
        for batch in _rank_batches(self._orders, self._progress, self._torch_batches):
            yield from batch

    def __len__(self) -> int:
        order = self._orders.get()
        if not isinstance(order, SeededOrder):
            return len(self._torch_sampler)
        return _rank_samples(order)


def _rank_samples(order: SeededOrder) -> int:
    """Samples this rank's epoch holds (padding by repetition included; none dropped past the last full batch)."""
    n, w, bs = order.n, order.world_size, order.batch_size
    per_rank = n // w if order.drop_last else -(-n // w)
    return min(per_rank, len(order) * bs)


class EpochBatchSampler(BatchSampler):
    """`loader.batch_sampler` of a Loader that runs its own order: this rank's batches of its
    current epoch, from the epoch's start (see the module docstring)."""

    def __init__(
        self,
        orders: RankedOrder,
        progress: EpochProgress,
        torch_batch_sampler: Any,
        *,
        run: Callable[[], RunContext] | None = None,
        relay: BatchRelay | None = None,
    ) -> None:
        """`run`: the Loader's run as each iteration starts (handed to its components); `relay`:
        where each batch yielded is published for the Loader's `LoaderCollate`."""
        sampler = EpochSampler(orders, progress, torch_batch_sampler.sampler, torch_batch_sampler)
        super().__init__(sampler, torch_batch_sampler.batch_size, torch_batch_sampler.drop_last)
        self._orders, self._progress, self._torch = orders, progress, torch_batch_sampler
        self._run, self._relay = run, relay

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._progress.epoch
        run = self._run() if self._run is not None else None
        relay = self._relay
        try:
            for batch in _rank_batches(self._orders, self._progress, self._torch):
                if relay is not None:
                    relay.publish(run, batch)
                yield batch
                if relay is not None:
                    relay.publish(None, None)  # resumed: that batch is no longer the one just yielded
        finally:
            if relay is not None:
                relay.publish(None, None)
        self._progress.served(epoch)

    def __len__(self) -> int:
        return len(self._orders.get())


class LoaderCollate:
    """`loader.collate_fn` where the Loader's batch is more than `collate_fn(samples)`: samples in,
    the Loader's batch out (see the module docstring). `columns`: the Loader reads the dataset's
    `get_batch` columns and converts them itself; else `collate` (taking a list of samples) runs,
    then `transform`. `schema`: the dataset's fastload schema, for exact columns."""

    accepts_batch_views = False  # samples in, as torch's DataLoader calls it

    def __init__(
        self,
        *,
        columns: bool,
        collate: Callable[[Any], Any] | None,
        transform: Callable[[Any], Any] | None,
        scalar_fields: frozenset[str] = frozenset(),
        schema: Any = None,
        relay: BatchRelay | None = None,
    ) -> None:
        """`relay`: the Loader's `EpochBatchSampler` publishes its batches there (None: the Loader's
        batch sampler is the user's, which publishes nothing)."""
        self.columns, self.collate, self.transform = columns, collate, transform
        self.scalar_fields, self.schema, self.relay = scalar_fields, schema, relay

    def __call__(self, samples: Sequence[Any]) -> Any:
        """The batch the Loader yields for `samples`, built with its `fastload.run.current_batch()`
        where known (see the module docstring)."""
        held = self._batch_of(len(samples))
        if isinstance(held, str):
            with unknown_batch(held):
                return self._build(samples)
        with batch_context(*held):
            return self._build(samples)

    def _batch_of(self, samples: int) -> tuple[RunContext, list[int]] | str:
        """The run and indices of the batch being collated, or why they cannot be known."""
        if self.relay is None:
            return (
                "the Loader's batch_sampler is the user's own object, which does not tell loader.collate_fn the "
                f"dataset indices of the samples it gets. {_WAY_OUT}"
            )
        if get_worker_info() is not None:
            return (
                "loader.collate_fn runs in a worker process of a torch DataLoader rebuilt from the Loader (e.g. by "
                "Accelerate's skip_first_batches with num_workers > 0), and torch draws each batch's indices ahead, "
                f"in the main process. {_WAY_OUT}, or rebuild the DataLoader with num_workers=0 for the resumed "
                "epoch: then each batch's indices reach loader.collate_fn"
            )
        return self.relay.take(samples)

    def _build(self, samples: Sequence[Any]) -> Any:
        if self.columns:
            cols = columns_from_samples(samples, self.schema)
            if self.transform is not None:
                cols = self.transform(cols)
            return columns_to_torch(cols, scalar_fields=self.scalar_fields)
        batch = self.collate(samples) if self.collate is not None else samples
        return self.transform(batch) if self.transform is not None else batch

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this object lacks: the wrapped collate's (stats, bind_workers, ...)
        if name.startswith("__") or name in ("collate", "columns", "transform", "scalar_fields", "schema", "relay"):
            raise AttributeError(name)
        return getattr(self.collate, name)

    def __repr__(self) -> str:
        return f"LoaderCollate(columns={self.columns}, collate={self.collate!r}, transform={self.transform!r})"


def columns_from_samples(samples: Sequence[Any], schema: Any = None) -> dict[str, Any]:
    """The `get_batch` columns of a list of sample dicts (`FastloadDataset.__getitems__` /
    `dataset[i]`): per the fastload `schema` when given (each field's kind and dtype), else by the
    values: numbers and equal-shape arrays stacked, str / bytes / 1-D arrays of varying length
    as `Ragged`."""
    if not samples or not all(isinstance(s, dict) for s in samples):
        raise TypeError(
            "the Loader reads this dataset's get_batch columns; to rebuild them from samples each sample "
            f"must be a dict, got {type(samples[0]).__name__ if samples else 'no samples'}"
        )
    fields = {f.name: f for f in schema} if schema is not None and _is_schema(schema) else {}
    out: dict[str, Any] = {}
    for name in samples[0]:
        items = [s[name] for s in samples]
        f = fields.get(name)
        out[name] = _schema_column(f, items) if f is not None else _inferred_column(name, items)
    return out


def _is_schema(schema: Any) -> bool:
    try:
        return all(hasattr(f, "name") and hasattr(f, "kind") and hasattr(f, "dtype") for f in schema)
    except TypeError:
        return False


def _schema_column(f: Any, items: list[Any]) -> Any:
    kind, dtype = f.kind, np.dtype(f.dtype)
    if kind in ("scalar", "ndarray"):
        return np.stack([np.asarray(x) for x in items]).astype(dtype, copy=False)
    if kind in ("bytes", "image", "string"):
        return Ragged.from_list(items, kind=kind)
    if kind == "varray":
        return Ragged.from_list([np.asarray(x, dtype=dtype).reshape(-1) for x in items], kind="varray", dtype=dtype)
    if kind == "vndarray":
        arrays = [np.asarray(x, dtype=dtype) for x in items]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        values = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, dtype)
        shapes = np.array([a.shape for a in arrays], dtype=np.int64).reshape(len(arrays), -1)
        return ShapedBatch(values, offsets, shapes)
    return _inferred_column(f.name, items)


def _inferred_column(name: str, items: list[Any]) -> Any:
    first = items[0]
    if isinstance(first, str):
        return Ragged.from_list(items, kind="string")
    if isinstance(first, (bytes, bytearray, memoryview)):
        return Ragged.from_list(items, kind="bytes")
    arrays = [np.asarray(x) for x in items]
    if all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays):
        return np.stack(arrays)
    if all(a.ndim == 1 and a.dtype == arrays[0].dtype for a in arrays):
        return Ragged.from_list(arrays, kind="varray", dtype=arrays[0].dtype)
    raise TypeError(f"field {name!r}: cannot rebuild a get_batch column from samples of type {type(first).__name__}")


def torch_collate(
    collate_fn: Callable[[Any], Any], fetcher: Any, dataset: Any, relay: BatchRelay | None = None
) -> Callable[[Any], Any]:
    """`loader.collate_fn`: `collate_fn` (torch's resolved one) where the Loader's batch is exactly
    `collate_fn(samples)` and the collate does not take the run, else a `LoaderCollate` giving the
    Loader's batch from samples. `fetcher`: the Loader's `fastload.fetch.fetcher.Fetcher` (its `mode`,
    `collate_fn`, `transform`, `scalar_fields`); `relay`: its `EpochBatchSampler`'s, if it has one."""
    if fetcher.mode == "columns":
        return LoaderCollate(columns=True, collate=collate_fn, transform=fetcher.transform,
                             scalar_fields=fetcher.scalar_fields, schema=getattr(dataset, "schema", None), relay=relay)
    if fetcher.transform is not None or implements(fetcher.collate_fn, RunAware):
        return LoaderCollate(columns=False, collate=fetcher.collate_fn, transform=fetcher.transform, relay=relay)
    return collate_fn
