"""From a Loader's arguments to what lives as long as the Loader: how a batch is fetched
(`fetch_mode`), the settings resolved once (`LoaderConfig`), the `Fetcher` and the kept workers
(`WorkerSet`). `TORCH_ARGS` names the arguments torch's `DataLoader` checks and the Loader mirrors."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from fastload.fetch.collate import fast_collate
from fastload.fetch.fetcher import Fetcher
from fastload.fetch.views import accepts_batch_views
from fastload.pipeline.config import COLUMNAR_MODES, LoaderConfig, batch_rule, resolve_config, worker_kind_rule
from fastload.workers.kept import WorkerSet

__all__ = ["TORCH_ARGS", "LoaderStages", "build_stages", "fetch_mode", "torch_loader"]

TORCH_ARGS = (
    "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory",
    "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
    "persistent_workers", "pin_memory_device", "in_order",
)  # the arguments torch's DataLoader checks and mirrors (the rest are the Loader's own)


def _scalar_fields(dataset: Any) -> frozenset[str]:
    schema = getattr(dataset, "schema", None)
    fields = getattr(schema, "fields", schema)
    if fields is None or not isinstance(fields, Iterable):
        return frozenset()
    return frozenset(f.name for f in fields if getattr(f, "kind", None) == "scalar" and hasattr(f, "name"))


def fetch_mode(dataset: Any, *, batched: bool, default_collate: bool, views: bool = False) -> str:
    """How a batch is fetched (`fastload.fetch.fetcher.MODES`), from what its collation receives
    (`batch_rule`): "views" or "columns" (the fast paths, one `get_batch` per batch), else
    "single" without batching, "getitems" or "getitem"."""
    get_batch = callable(getattr(dataset, "get_batch", None))
    batch = batch_rule(views=views, get_batch=get_batch, default_collate=default_collate, batched=batched)
    if batch != "samples":
        return "views" if batch == "views" else "columns"
    if not batched:
        return "single"
    return "getitems" if getattr(dataset, "__getitems__", None) else "getitem"


@dataclass(frozen=True)
class LoaderStages:
    """What a map-style Loader builds once: `worker_type` as resolved ("thread" or "process"
    for "auto"), the settings, the fetcher and the kept workers."""

    worker_type: str
    config: LoaderConfig
    fetcher: Fetcher
    workers: WorkerSet


def torch_loader(**args: Any) -> DataLoader:
    """torch's `DataLoader` of the same arguments (it validates them, with torch's errors, and builds
    the default samplers), minus its warning about more worker processes than cores: that warning is
    given by the Loader once its workers are known to be processes (thread workers are not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        return DataLoader(**args)


def build_stages(
    dl: DataLoader,
    *,
    user_collate: Callable[[Any], Any] | None,
    transform: Callable[[Any], Any] | None,
    worker_type: str,
    device: torch.device | None,
    **settings: Any,
) -> LoaderStages:
    """Resolve the settings and build the long-lived stages from `dl` (torch's `DataLoader` built
    from the same arguments: its dataset, samplers and worker arguments, as torch resolved them).
    `user_collate`: the `collate_fn` as given (None or `default_collate` is the default
    collation, done by `fast_collate`); `settings`: `resolve_config`'s `buffer_ring`,
    `ring_slots`, `prefetch`, `autotune`, `order_ahead`, `epoch_plan`."""
    dataset, batched, timeout = dl.dataset, dl.batch_sampler is not None, dl.timeout
    default = user_collate is None or user_collate is default_collate
    mode = fetch_mode(dataset, batched=batched, default_collate=default, views=accepts_batch_views(user_collate))
    if worker_type == "auto":
        worker_type = worker_kind_rule(1, "auto", mode)
    config = resolve_config(
        mode=mode, num_workers=dl.num_workers, worker_type=worker_type, prefetch_factor=dl.prefetch_factor,
        timeout=timeout, worker_init=dl.worker_init_fn is not None, pin_memory=dl.pin_memory, device=device,
        **settings,
    )
    fetcher = Fetcher(
        dataset, mode=mode, collate_fn=fast_collate if (default and batched) else dl.collate_fn, transform=transform,
        scalar_fields=_scalar_fields(dataset) if mode in COLUMNAR_MODES else frozenset(),
    )
    workers = WorkerSet(config, fetcher, timeout=timeout, worker_init_fn=dl.worker_init_fn,
                        persistent=dl.persistent_workers, mp_context=dl.multiprocessing_context)
    return LoaderStages(worker_type, config, fetcher, workers)
