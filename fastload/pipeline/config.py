"""`LoaderConfig`: the Loader's settings, resolved once from its arguments, the dataset and the machine.

Every default the Loader applies is a rule in this module, with the benchmark that justifies it.
Nothing here changes what the user asked for: `num_workers=N` starts exactly N workers, of the
kind `worker_type` names (or the one rule below picks).

Rules:

* Batch form (`batch_rule`): "views" when the `collate_fn` declares ``accepts_batch_views = True``
  and the dataset has `get_batch` (the collate gets the columns: tensors and `Ragged`, see
  `fastload.fetch.views`); "torch" for the default collation on `get_batch` (torch's exact types);
  "samples" otherwise (a list of samples, as torch hands its `collate_fn`).
* Worker kind (`worker_type="auto"`): threads on the columnar fast paths (a dataset with
  `get_batch` and the default collation or a batch-views collate: gathers that release the GIL;
  `python -m bench.loader`, thread rows against torch's process workers; `python -m
  bench.batch_views`), processes otherwise (Python-heavy `__getitem__`s hold the GIL;
  `python -m bench.loader`, generic-dataset rows).
* Work stealing (thread workers): the consumer fetches an unstarted later batch instead of
  sleeping while it waits, only while the workers leave a core free (`num_workers < cores`),
  never with a `timeout` or a `worker_init_fn`; "bounded" (steal only when the awaited batch is
  far from ready) where CUDA is available, since that thread also launches the GPU step
  (`python -m bench.loader`: 1 worker + stealing consumer is the best Loader row on 2 cores).
* Batches in flight: `prefetch_factor` per worker (+`STEAL_AHEAD` for a stealing consumer), as
  torch; 1 when the consumer fetches alone. With a pinned ring: `ring_slots` (default in-flight +
  device prefetch + 3), the in-flight count clamped to `ring_slots - 2` (the consumer holds 2).
* Next epoch's order computed ahead (`order_ahead=None`): only when this epoch's fetching leaves
  a core idle (`python -m bench.epoch_start --rounds`: 1.01-1.025x faster without it on 2 cores
  where the gatherers fill both), see `order_ahead_rule`.
* Autotuning (`autotune=True`, thread workers only): the in-epoch comparison of inline fetching
  against the workers (`fastload.pipeline.autotune`); off by default, so the workers asked for
  are the workers that run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fastload.system import usable_cores
from fastload.workers.threads import steal_rule

__all__ = [
    "COLUMNAR_MODES", "STEAL_AHEAD", "LoaderConfig", "batch_rule", "describe_settings", "order_ahead_rule",
    "resolve_config", "worker_kind_rule",
]

STEAL_AHEAD = 2  # thread workers: extra batches in flight that a waiting consumer fetches itself
COLUMNAR_MODES = ("columns", "views")  # fetch modes that read a batch with one `get_batch`
_BATCH_OF_MODE = {"columns": "torch", "views": "views"}  # the other modes hand over samples


@dataclass(frozen=True)
class LoaderConfig:
    """What one Loader runs with; every field is a resolved value, none is "auto"."""

    mode: str  # how a batch is fetched: "columns"/"views" (get_batch), "getitems", "getitem", "single"
    batch: str  # what the collation gets: "views", "torch" (default collation, columns) or "samples"
    worker_kind: str  # "inline" (num_workers=0), "thread" or "process"
    num_workers: int  # workers started: exactly the argument
    steal: str | bool  # thread workers: "always", "bounded" or False (see `steal_rule`)
    depth: int  # batches in flight in the fetch stage
    ring_slots: int | None  # reused (pinned) buffers; None: no ring
    pin: bool  # the ring's buffers are page-locked
    device: str | None  # where batches are moved (H2D on a side stream), None: stay on the host
    prefetch: int  # device copies in flight
    autotune: bool  # the in-epoch inline/threads comparison runs (thread workers only)
    order_ahead: bool | None  # the argument; None: `order_ahead_rule` decides per epoch
    epoch_plan: bool  # the direct path may read an epoch's small fields at once
    cores: int  # usable cores when resolved
    cuda: bool  # CUDA available when resolved

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (for `Loader.describe()`)."""
        return dataclasses.asdict(self)


def batch_rule(*, views: bool, get_batch: bool, default_collate: bool, batched: bool) -> str:
    """What a batch's collation receives: "views" (a collate that `accepts_batch_views`, on a
    `get_batch` dataset), "torch" (the default collation on `get_batch`), else "samples"."""
    if batched and get_batch and views:
        return "views"
    if batched and get_batch and default_collate:
        return "torch"
    return "samples"


def worker_kind_rule(num_workers: int, worker_type: str, mode: str) -> str:
    """ "inline" for 0 workers; else `worker_type`, or for "auto": threads on the columnar fast
    path (`COLUMNAR_MODES`), processes otherwise."""
    if num_workers == 0:
        return "inline"
    if worker_type != "auto":
        return worker_type
    return "thread" if mode in COLUMNAR_MODES else "process"


def order_ahead_rule(config: LoaderConfig, *, direct: bool, torch_threads: int | None = None) -> bool:
    """Whether this epoch computes the next epoch's order in the background: the argument when
    given; else only when the threads this epoch's fetching keeps busy (the consumer fetching
    alone, on torch's intra-op threads on the direct path; worker threads plus a stealing
    consumer; worker processes) leave a usable core idle."""
    if config.order_ahead is not None:
        return config.order_ahead
    if config.worker_kind == "inline":
        busy = (torch_threads if torch_threads is not None else torch.get_num_threads()) if direct else 1
    elif config.worker_kind == "thread":
        busy = config.num_workers + bool(config.steal)
    else:
        busy = config.num_workers
    return config.cores > busy


def resolve_config(
    *,
    mode: str,
    num_workers: int,
    worker_type: str,
    prefetch_factor: int | None,
    timeout: float,
    worker_init: bool,
    pin_memory: bool,
    device: torch.device | None,
    buffer_ring: bool | None,
    ring_slots: int | None,
    prefetch: int,
    autotune: bool,
    order_ahead: bool | None,
    epoch_plan: bool,
    cores: int | None = None,
    cuda: bool | None = None,
) -> LoaderConfig:
    """The Loader's settings from its arguments and the machine (`cores`, `cuda`: the machine's
    unless given)."""
    cores = usable_cores() if cores is None else cores
    cuda = torch.cuda.is_available() if cuda is None else cuda
    kind = worker_kind_rule(num_workers, worker_type, mode)
    steal: str | bool = False
    if kind == "thread":
        steal = steal_rule(num_workers=num_workers, cores=cores, cuda=cuda, timeout=timeout, worker_init=worker_init)
    depth = 1 if kind == "inline" else num_workers * max(1, prefetch_factor or 1)
    if steal:
        depth += STEAL_AHEAD
    pin = (pin_memory and cuda) or (device is not None and device.type == "cuda")
    use_ring = pin if buffer_ring is None else bool(buffer_ring)
    slots = None
    if use_ring:
        slots = ring_slots or depth + prefetch + 3
        depth = max(1, min(depth, slots - 2))
    return LoaderConfig(
        mode=mode,
        batch=_BATCH_OF_MODE.get(mode, "samples"),
        worker_kind=kind,
        num_workers=num_workers,
        steal=steal,
        depth=depth,
        ring_slots=slots,
        pin=pin,
        device=None if device is None else str(device),
        prefetch=max(1, prefetch),
        autotune=bool(autotune) and kind == "thread" and not timeout and not worker_init,
        order_ahead=order_ahead,
        epoch_plan=epoch_plan,
        cores=cores,
        cuda=cuda,
    )


def describe_settings(config: LoaderConfig, *, direct: bool, order: str, autotune: Any) -> dict[str, Any]:
    """`Loader.describe()`: `config` as a dict plus `h2d`, `order` (its kind), `direct_path`,
    `epoch_plan` and `order_ahead` as this epoch's path decides them, and `autotune` (False, or
    the probe's report)."""
    info = config.as_dict()
    info["h2d"] = f"side stream to {config.device}, {config.prefetch} in flight" if config.device else None
    info["order"] = order
    info["direct_path"] = direct
    info["epoch_plan"] = config.epoch_plan and direct and config.worker_kind != "process"
    # only a planned, shuffled epoch has a whole next order to compute (see `SeededOrder.epoch`)
    planned = order == "seeded shuffle" and info["epoch_plan"]
    info["order_ahead"] = planned and order_ahead_rule(config, direct=direct)
    info["autotune"] = autotune
    return info
