"""`fastload.Loader`: a drop-in `torch.utils.data.DataLoader` that is faster and resumable.

Replace `DataLoader(...)` with `Loader(...)`: same arguments, same errors for invalid ones,
and — given the same sampler / generator / global RNG — the same batches in the same order
(for any map-style dataset, any collate_fn, `num_workers` 0 or more). On top of that:

* Fast path: a dataset with `get_batch(indices)` (fastload datasets) and no custom collate_fn
  is read with one call per batch; fixed fields become tensors with `torch.from_numpy`, Ragged
  bytes/string/image fields lists of bytes/str (as `default_collate` gives), `varray` fields stay
  `Ragged` with tensor `values`/`offsets`. A `collate_fn` that declares
  ``accepts_batch_views = True`` (`fastload.BatchViews`, `TextCollate`, `ImagePreset`) gets the
  batch's columns instead: fixed fields as tensors, variable ones as `Ragged` of tensors, one
  gather per field and no per-sample Python object (`fastload.fetch.views`); `transform` then runs on
  its output. `describe()["batch"]` says which. Datasets with `__getitems__` get one call per
  batch (as in torch) and a cheaper collate with `default_collate`'s output.
* Workers: `num_workers=N` starts exactly N workers: threads on the fast path (GIL-releasing
  gathers), processes otherwise (Python-heavy `__getitem__`s: torch-identical seeding,
  `worker_init_fn`, `get_worker_info()`; batch j goes to worker j % num_workers; batches come
  back through reused shared-memory slots, not pickled tensors); `worker_type="thread"` or
  `"process"` overrides the rule. Thread workers are started once and kept across epochs
  (`workers.ThreadPool`; fresh ones each epoch only with a `worker_init_fn` and no
  `persistent_workers`, as torch runs it). While the thread workers leave a core free, a
  consumer that would wait for its batch fetches a later unstarted one itself (not with a
  `timeout` or a `worker_init_fn`). `autotune=True` (thread workers) compares the workers with
  fetching inline during the run and keeps the faster, reporting each decision in `describe()`.
  `describe()` shows every resolved setting (`fastload.pipeline.config` holds the rules).
* `pin_memory=True` (with an accelerator) or `device='cuda[:N]'`: batches are packed into a
  bounded ring of reused pinned buffers; with `device`, the H2D copy runs on a side stream
  `prefetch` batches ahead (see `fastload.transfer.side_stream`). `device='cpu'` is a no-op stage.
* Order: `seed=` gives an epoch order that is a pure function of (seed, epoch, len(dataset));
  ranks get disjoint, equally long shares (padding by repetition unless `drop_last`), see
  `fastload.order.sampling`. Rank and world size are resolved at the first `iter()` (`rank`/`world_size`,
  else `torch.distributed` when initialized, else `RANK` and `WORLD_SIZE`; a partial environment
  raises), so a Loader built before the process group exists takes the rank the run has.
* Epochs: once the last batch of an epoch was delivered, the next `iter()` starts the next epoch
  (a new order), whether or not `StopIteration` was raised (frameworks take `len(loader)` batches
  and call `iter()` again); a new `iter()` in the middle of an epoch starts that epoch again from
  its start, as torch re-iterates its sampler. `set_epoch(e)` sets the epoch explicitly.
  `len()` is the number of batches the next `iter()` yields.
* The run (`fastload.run`): the Loader hands its `RunContext` (seed, epoch, rank, world size,
  `num_workers`) to every component it holds that implements `bind_run` (`sampler`,
  `batch_sampler`, `transform`, `collate_fn`, the dataset): at the first `len()`/`iter()`, at
  every epoch start (the automatic advance too), on `set_epoch` and after `load_state_dict`;
  samplers with only `set_epoch` (`DistributedSampler`) get the epoch through it. While a batch is
  fetched, `fastload.run.current_batch()` gives its dataset indices, so `ImagePreset`'s crops and
  flips are a function of (seed, epoch, sample index) whatever the workers or a resume.
* `get_state()` / `set_state()` (torch's names: `state_dict()` / `load_state_dict()`): exact
  mid-epoch resume, counted in batches the consumer received (prefetched batches in flight are
  not counted); a different world size re-deals the unseen rest of a seeded epoch; a state that
  cannot apply raises `ValueError`.
* Frameworks (docs/frameworks/): a Loader pickles its configuration and position (not its workers),
  so `ddp_spawn` works; under Hugging Face Accelerate its iterator reports `end_of_dataloader`
  (`fastload.frameworks`). It is not a `DataLoader` subclass: Accelerate's `prepare` would replace
  it with a torch DataLoader; frameworks use it through duck-typed hooks (`len`, `state_dict`,
  `sampler.set_epoch`). `batch_sampler`, `sampler` and `collate_fn` say what it delivers
  (`fastload.loader_views`), so a torch DataLoader rebuilt from them (Accelerate's
  `skip_first_batches`) yields the Loader's batches, with its augmentation where the batch's
  indices reach `collate_fn` (`num_workers=0`; elsewhere a keyed augmentation raises
  `fastload.run.BatchUnknownError`); a mid-epoch resume that Lightning would cut
  short (more ranks than it was saved on) is refused (`fastload.frameworks`).
* As torch: a batch's error is raised for that batch and the iterator goes on with the next one;
  setting `batch_size`, `sampler`, `batch_sampler`, `drop_last`, `dataset` or `persistent_workers`
  after construction raises `ValueError`; `Loader[T]` is a generic alias; deleting an iterator ends
  its (non-persistent) workers.
* `stats()`: see `Loader.stats`.

`IterableDataset`s are passed to a plain torch DataLoader (no fast path, no state).
Differences from torch, by design: one live iterator per Loader (a new `iter()` closes the
previous one; the Loader holds it weakly); `in_order=False` is accepted but batches still come
in order; with `seed=` the `generator` is not used; `batch_size=None` and user samplers are never rank-split (a user
sampler is trusted to do its own split, e.g. `DistributedSampler`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import BatchSampler, IterableDataset

from fastload.frameworks import gradient_state, refuse_uncounted_resume, step_counting_caller
from fastload.loader_views import BatchRelay, EpochBatchSampler, torch_collate
from fastload.order.choice import (
    STATE_VERSION,
    RankedOrder,
    batches_from,
    check_state,
    check_state_version,
    dealt_world,
    order_kind,
)
from fastload.order.record import Order
from fastload.order.sampling import SamplerOrder, SeededOrder
from fastload.pipeline import EpochHooks, EpochIterator, EpochStages, ThreadProbe
from fastload.pipeline.config import describe_settings, order_ahead_rule
from fastload.pipeline.intake import TORCH_ARGS, build_stages, torch_loader
from fastload.pipeline.progress import EpochProgress
from fastload.run import (
    COMPONENT_ROLES,
    EpochRelay,
    RunContext,
    bind_components,
    collect_component_descriptions,
    collect_component_stats,
)
from fastload.stats import LoaderStats
from fastload.transfer.device_queue import DeviceQueue
from fastload.transfer.pin_stage import PinStage
from fastload.transfer.ring import BufferRing
from fastload.transfer.side_stream import DeviceStage, resolve_device
from fastload.validate import validate_loader_args
from fastload.workers import ThreadPool
from fastload.workers.kept import WorkerSet

__all__ = ["Loader"]

T_co = TypeVar("T_co", covariant=True)
# torch's DataLoader refuses to change these after construction (ValueError); so does the Loader
FROZEN_ATTRS = frozenset({"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"})


class Loader(Generic[T_co]):
    """Drop-in replacement for `torch.utils.data.DataLoader` (see the module docstring).

    Extra keyword-only arguments: `device` (move batches there on a side stream), `prefetch`
    (device batches in flight, default 2), `rank` / `world_size` / `seed` (seeded distributed
    order), `worker_type` (``"auto"``, ``"thread"``, ``"process"``), `transform` (a batch
    function run in the workers: on the `get_batch` dict before conversion on the fast path,
    on the collated batch otherwise), `buffer_ring` (force the reused-buffer ring on/off; by
    default on exactly when pinning), `ring_slots` (ring size, default in-flight batches + 3),
    `order_ahead` (seeded order: compute the next epoch's order on a background thread while
    this epoch runs; None, the default: only when a core is left over by this epoch's fetching,
    see `fastload.pipeline.config.order_ahead_rule`), `autotune` (thread workers: compare them
    with fetching inline in the consumer's thread during the run and keep the faster, see
    `fastload.pipeline.autotune`; default False: the workers always fetch), `epoch_plan`
    (a seeded order or torch's own samplers, over a local fastload dataset of fixed-size fields,
    fetched in this process: read the row lookups and small fields of a whole epoch at once as
    its order is computed, see `fastload.fetch.plan`; default True; False: per batch, without the
    plan's memory, at most `fastload.fetch.plan.PLAN_MAX_BYTES`).
    """

    # the drop-in attributes hold the user's objects as given (torch types them more narrowly)
    dataset: Any
    sampler: Any
    batch_sampler: Any
    batch_size: Any
    _dl: Any

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | int | torch.device | None = None,
        prefetch: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int | None = None,
        worker_type: str = "auto",
        transform: Callable[[Any], Any] | None = None,
        buffer_ring: bool | None = None,
        ring_slots: int | None = None,
        order_ahead: bool | None = None,
        autotune: bool = False,
        epoch_plan: bool = True,
    ) -> None:
        init_args = dict(locals())  # the configuration a pickled Loader is rebuilt from
        del init_args["self"]
        init_args.pop("__class__", None)
        # torch validates the arguments (same errors) and builds the same default samplers
        dl = torch_loader(**{name: init_args[name] for name in TORCH_ARGS})
        validate_loader_args(num_workers=num_workers, seed=seed, device=device, rank=rank, world_size=world_size,
                             prefetch=prefetch, ring_slots=ring_slots, worker_type=worker_type)
        self._init_args = init_args
        self._iterable = isinstance(dataset, IterableDataset)
        self._dl = dl if self._iterable else None  # an IterableDataset is iterated by torch's DataLoader
        self.dataset, self.batch_size, self.drop_last = dl.dataset, dl.batch_size, dl.drop_last
        self.sampler, self.batch_sampler, self.collate_fn = dl.sampler, dl.batch_sampler, dl.collate_fn
        self.num_workers, self.prefetch_factor, self.timeout = dl.num_workers, dl.prefetch_factor, dl.timeout
        self.pin_memory, self.worker_init_fn, self.generator = dl.pin_memory, dl.worker_init_fn, dl.generator
        self.persistent_workers, self.multiprocessing_context = dl.persistent_workers, dl.multiprocessing_context
        self.in_order, self.device = in_order, resolve_device(device)
        self.prefetch, self.transform = prefetch, transform
        self._orders = RankedOrder(
            dl.dataset, rank=rank, world_size=world_size, seed=seed, batch_size=dl.batch_size,
            batch_sampler=dl.batch_sampler, sampler=dl.sampler, drop_last=dl.drop_last, generator=dl.generator,
            user_order=sampler is not None or batch_sampler is not None, shuffle=bool(shuffle),
        )
        self._progress = EpochProgress()
        self._bound_run: RunContext | None = None  # the run last handed to the components (`_bind_run`)
        self._epochs = EpochRelay()  # the epoch for samplers with only `set_epoch`
        self._facts = RunFacts(self._orders, self._progress, generator=dl.generator, num_workers=dl.num_workers)
        self._stats = LoaderStats()
        self._workers: WorkerSet | None = None  # kept across epochs (none for an IterableDataset)
        self._probe: ThreadProbe | None = None  # autotune's probe, kept across epochs
        if not self._iterable:
            self.order_ahead, self.epoch_plan = order_ahead, epoch_plan
            self.autotune = bool(autotune)
            stages = build_stages(dl, user_collate=collate_fn, transform=transform, worker_type=worker_type,
                                  device=self.device, buffer_ring=buffer_ring, ring_slots=ring_slots, prefetch=prefetch,
                                  autotune=self.autotune, order_ahead=order_ahead, epoch_plan=epoch_plan)
            self.worker_type, self.config = stages.worker_type, stages.config
            self._fetcher, self._workers = stages.fetcher, stages.workers
            # what a framework rebuilding a loader from these reads (`fastload.loader_views`)
            relay = None
            if dl.batch_sampler is not None and sampler is None and batch_sampler is None:
                relay = BatchRelay()
                self.batch_sampler = EpochBatchSampler(self._orders, self._progress, dl.batch_sampler,
                                                       run=_run_binder(self, self._facts), relay=relay)
                self.sampler = self.batch_sampler.sampler
            self.collate_fn = torch_collate(dl.collate_fn, self._fetcher, dataset, relay)
        if self._iterable or self.config.worker_kind == "process":  # torch's warning, for worker processes only
            dl.check_worker_number_rationality()
        self._initialized = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FROZEN_ATTRS and self.__dict__.get("_initialized"):
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(name, value)

    # ---- rank, world size, order
    @property
    def rank(self) -> int:
        """This process's rank (see `fastload.order.choice.RankedOrder`)."""
        return self._orders.rank_world()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks (see `fastload.order.choice.RankedOrder`)."""
        return self._orders.rank_world()[1]

    @property
    def seed(self) -> int | None:
        """The seeded order's seed (None: torch's samplers, unless the world has several ranks)."""
        return self._orders.seed

    @property
    def _order(self) -> SeededOrder | SamplerOrder:
        return self._orders.get()

    @property
    def run(self) -> RunContext:
        """The run's facts the Loader hands to its components (`fastload.run`): its seed (the
        seeded order's; with torch's samplers derived once, without drawing from any RNG, from
        `generator.initial_seed()` or else `torch.initial_seed()`, and kept by `state_dict`), the
        epoch the next `iter()` runs, rank, world size and `num_workers`."""
        if self._iterable:
            raise TypeError("run is not supported for IterableDataset (torch's DataLoader iterates it)")
        return self._facts.run()

    def _bind_run(self, *, announce: bool = False) -> RunContext:
        """Hand the run to the components when a fact changed (`fastload.run`); the epoch to
        samplers with only `set_epoch` (`announce`: `set_epoch` / `load_state_dict`, else an
        epoch start, see `EpochRelay`)."""
        run = self.run
        # torch's BatchSampler holds the user's sampler (batch_sampler=BatchSampler(ShardWindowSampler(...)))
        inner = self.batch_sampler.sampler if type(self.batch_sampler) is BatchSampler else None
        samplers = (self.batch_sampler, self.sampler, inner)
        if run != self._bound_run:
            bind_components((*samplers, self._fetcher), run)
            self._bound_run = run
        if announce:
            self._epochs.announce(run.epoch, samplers)
        else:
            self._epochs.advance(run.epoch, samplers)
        return run

    # ---- DataLoader surface
    def __len__(self) -> int:
        """The number of batches the next `iter()` yields (the rest of the epoch after a resume)."""
        if self._iterable:
            return len(self._dl)
        self._bind_run()
        return self._progress.length(self._order, self.drop_last)

    @property
    def order_stage(self) -> SeededOrder | SamplerOrder:
        """The order the next `iter()` runs, for the run's current rank and world size."""
        return self._orders.get()

    @property
    def autotune_probe(self) -> ThreadProbe | None:
        """The inline-vs-threads probe (`autotune=True`, kept across epochs once an epoch made it)."""
        return self._probe

    @property
    def thread_pool(self) -> ThreadPool | None:
        """The worker threads kept across epochs (thread workers, once an epoch started them)."""
        return self._workers.threads if self._workers is not None else None

    @property
    def _active(self) -> EpochIterator | None:
        """The live iterator (held weakly: the consumer owns it)."""
        return self._progress.active

    def __iter__(self) -> Iterator[T_co]:
        """A new epoch's iterator. After the last batch of an epoch was delivered (whether or not
        `StopIteration` was raised), the next epoch, with its own order; in the middle of an epoch,
        that epoch again from its start (as torch re-iterates its sampler); after
        `load_state_dict`, the rest of the saved epoch."""
        if self._iterable:
            return iter(self._dl)
        resume = self._progress.begin()
        self._orders.fix()
        run = self._bind_run()
        self._fetcher.refresh()
        cfg, workers, stage = self.config, self._workers, self._order
        order_stage: Order = stage
        assert workers is not None  # a map-style Loader builds its WorkerSet in __init__
        # batches fetched in this process read their small fields from a plan of the whole epoch
        in_process = cfg.worker_kind != "process"
        plan = self._fetcher if cfg.epoch_plan and in_process and self._fetcher.direct else None
        base_seed, start, order = order_stage.epoch(
            self._progress.epoch, resume, plan=plan, ahead=order_ahead_rule(cfg, direct=self._fetcher.direct),
            draw_base_seed=not workers.reuses_processes,
        )
        expected = batches_from(stage, start if resume is not None else None, self.drop_last)
        device_index = self._device_index()
        ring = None
        if cfg.ring_slots is not None:
            ring = BufferRing(cfg.ring_slots, pin=cfg.pin, device_index=device_index)
        source, owns, ring_in_source = workers.source(ring, device_index, base_seed, run)
        device = None
        if self.device is not None:
            device = DeviceQueue(DeviceStage(self.device), prefetch=cfg.prefetch, stats=self._stats)
        stages = EpochStages(order, source, owns, PinStage(ring, packed_by_source=ring_in_source, stats=self._stats),
                             device, self._autotune_probe())
        hooks = EpochHooks(length=self.__len__, complete=self._epoch_done, closed=self._progress.closed,
                           failed=self._failed)
        it = EpochIterator(hooks, stages, depth=cfg.depth, stats=self._stats, batched=self.batch_sampler is not None,
                           position=start, expected=expected, gradient_state=gradient_state())
        self._progress.attach(it, start, resumed=resume is not None)
        if expected == 0:  # resumed at the end of an epoch: it is complete already
            it.epoch_complete()
        return it

    def _autotune_probe(self) -> ThreadProbe | None:
        """The Loader's inline-vs-threads probe (kept across epochs) with `autotune`, else None."""
        if not self.config.autotune:
            return None
        if self._probe is None:
            self._probe = ThreadProbe(depth=self.config.depth)
        return self._probe

    def _device_index(self) -> int | None:
        if self.device is not None and self.device.type == "cuda":
            return self.device.index
        if self.config.pin:
            return torch.cuda.current_device()
        return None

    # ---- callbacks from the iterator
    def _failed(self, it: EpochIterator) -> None:
        """An epoch raised: persistent workers may be broken (a dead worker, a thread stuck past
        `timeout`) — start fresh next time."""
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._workers is not None:
            self._workers.close()

    def _epoch_done(self, it: EpochIterator) -> None:
        """`it` delivered its epoch's last batch: the next `iter()` starts the next epoch."""
        self._progress.complete(it)

    # ---- epochs and state
    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` runs (auto-advances when an epoch is exhausted)."""
        return self._progress.epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch the next `iter()` runs; the components get it through `bind_run`, samplers
        with only `set_epoch` through that (see `fastload.run`)."""
        self._progress.set_epoch(int(epoch))
        if not self._iterable:
            self._bind_run(announce=True)

    def get_state(self) -> dict[str, Any]:
        """Where the consumer is: epoch + batches received + the order's position (`fastload.order.position`),
        and what the order depends on (world size, batch size, dataset length), checked by `set_state`."""
        if self._iterable:
            raise TypeError("get_state() / state_dict() is not supported for IterableDataset")
        pos = self._progress.saved()
        return {
            "version": STATE_VERSION,
            "epoch": self._progress.epoch,
            "position": pos,
            "seed": self.seed,
            "world_size": self._dealt_world(),
            "batch_size": self.batch_size,
            "num_samples": len(self.dataset),
            "batches_yielded": self._progress.received(),  # this epoch's, over its resumes
            "run_seed": self.run.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        """`get_state()`, under the name torch's stateful protocol uses (Lightning, Accelerate, torchdata)."""
        return self.get_state()

    def _dealt_world(self) -> int:
        return dealt_world(self.sampler, self.batch_sampler, self._orders.rank_world()[1])

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from a `get_state()`: the next `iter()` continues exactly after the last batch
        received. A state this Loader cannot continue exactly (another state or order version;
        another dataset length; a sampler order saved at another world or batch size, which only a
        seeded order can re-deal; the other kind of order) raises `ValueError` naming what differs:
        nothing is replayed or skipped silently."""
        if self._iterable:
            raise TypeError("set_state() / load_state_dict() is not supported for IterableDataset")
        check_state_version(state)
        check_state(state, self._order, num_samples=len(self.dataset), world=self._dealt_world(),
                    batch_size=self.batch_size)
        self._progress.stop_active()
        self._orders.fix()
        epoch, order, position = int(state["epoch"]), self._order, state["position"]
        if isinstance(order, SeededOrder):
            if state.get("seed") is not None:
                self._orders.set_seed(int(state["seed"]))
        elif state.get("run_seed") is not None:
            self._facts.derived_seed = int(state["run_seed"])
        received = state.get("batches_yielded")
        framework = step_counting_caller()
        if framework is not None and position is not None:
            left = batches_from(order, position, self.drop_last)
            refuse_uncounted_resume(framework, epoch=epoch, received=int(received or position["batches"]),
                                    left=left, epoch_batches=len(order), saved_world=state.get("world_size"),
                                    world=self._dealt_world())
        self._progress.restore(epoch, position, received)
        self._bind_run(announce=True)  # the components get the restored epoch (the position stays)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`set_state(state)`, under the name torch's stateful protocol uses (Lightning, Accelerate, torchdata)."""
        self.set_state(state)

    def __getstate__(self) -> dict[str, Any]:
        """Configuration and position only (no threads, pools or buffers): the copy is rebuilt
        from the constructor's arguments and continues where this Loader is."""
        state = None
        if not self._iterable:
            state = {"epoch": self._progress.epoch, "position": self._progress.saved(), "seed": self.seed,
                     "received": self._progress.received(), "run_seed": self._facts.derived_seed}
        return {"init": self._init_args, "state": state}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(**pickled["init"])  # type: ignore[misc]
        state = pickled["state"]
        if state is not None:
            self._orders.seed, self._facts.derived_seed = state["seed"], state.get("run_seed")
            self._progress.restore(int(state["epoch"]), state["position"], state.get("received"))

    # ---- settings and stats
    def describe(self) -> dict[str, Any]:
        """The settings this Loader runs with, as resolved (see `fastload.pipeline.config.describe_settings`):
        `batch` (what the collation receives: "views", "torch" or "samples", see
        `fastload.pipeline.config.batch_rule`), `worker_kind` ("inline", "thread", "process")
        and `num_workers` (the workers started),
        `steal` (thread workers: whether a waiting consumer fetches later batches itself),
        `depth` (batches in flight), `ring_slots` (reused buffers, None without a ring), `pin`,
        `device` and `prefetch` (H2D on a side stream, copies in flight), `order`
        ("seeded shuffle", "seeded sequential", "sampler"), `direct_path` (a batch is the
        dataset's takes wrapped as tensors), `epoch_plan`, `order_ahead` (as the next epoch
        decides it), `cores`, `cuda`, `autotune`: False, or the probe's choice and every
        decision with the batch rates behind it, and `components`: `{role: settings}` of each
        component with `component_describe()` (`fastload.run`; e.g. an image preset's size, kind,
        backend, threads and decode modes)."""
        components = collect_component_descriptions({role: getattr(self, role) for role in COMPONENT_ROLES})
        if self._iterable:
            return {"worker_kind": "torch", "num_workers": self.num_workers, "order": "iterable dataset",
                    "components": components}
        info = describe_settings(self.config, direct=self._fetcher.direct_path(), order=order_kind(self._order),
                                 autotune=self._probe.report() if self._probe is not None else self.config.autotune)
        info["components"] = components
        return info

    def stats(self) -> dict[str, Any]:
        """Loader statistics since construction / `reset_stats()`.

        Keys: `read_s`, `transform_s`, `collate_s`, `pin_s`, `h2d_s` (seconds per stage,
        summed over workers; `read` is the dataset access — all of `__getitem__` for generic
        datasets — `pin` the copy into the reused (pinned) buffers, `h2d` the host time issuing
        and waiting for copies), `ring_wait_s` (packing waiting for a free buffer: back-pressure
        from batches packed ahead, not work), `wait_s` (consumer
        time inside `next()`), `wall_s` (time iterators were active), `batches`, `samples`,
        `batches_per_s`, `samples_per_s`, `data_stall` (= wait_s / wall_s: the fraction of
        time the training loop waited for data), `num_workers`, `worker_type` (``"inline"``,
        ``"thread"``, ``"process"``), `epoch`, and with `autotune` `thread_mode` (the probe's
        current choice, "threads" or "inline") and `autotune_decisions` (see `describe`).
        `components`: `{role: counters}` from each component with `component_stats()`
        (`fastload.run.StatsReporter`; roles "sampler", "batch_sampler", "transform",
        "collate_fn", "dataset"; the objects in this process: with worker processes a
        transform's counters stay in the workers). The dataset's `storage.stats()` (a remote
        dataset's `remote_*` transfer timings, see `fastload.remote.transfer_stats`) is merged in
        without overriding these.
        """
        storage = getattr(self.dataset, "storage", None)
        info: dict[str, Any] = {"num_workers": self.num_workers, "epoch": self._progress.epoch}
        info["components"] = collect_component_stats({role: getattr(self, role) for role in COMPONENT_ROLES})
        info["worker_type"] = "inline" if self.num_workers == 0 else getattr(self, "worker_type", "torch")
        probe = getattr(self, "_probe", None)
        if probe is not None:
            info["thread_mode"] = probe.choice
            info["autotune_decisions"] = len(probe.decisions)
        return self._stats.snapshot([storage], **info)

    def reset_stats(self) -> None:
        """Zero the counters behind `stats()`."""
        self._stats.reset()

    def close(self) -> None:
        """Stop the active iterator and any persistent workers (`state_dict()` still says where it was)."""
        self._progress.stop_active()
        self._stop_workers()

    def __del__(self) -> None:
        # no module globals here: at interpreter exit they may already be None
        try:
            if (self._workers is not None and self._workers.running) or self._active is not None:
                self.close()
        except Exception:  # noqa: BLE001 - nothing to report to during interpreter shutdown
            pass


class RunFacts:
    """Where a Loader's run comes from (`Loader.run`): its order's seed and rank, its epoch, its
    `num_workers`, and with torch's samplers a seed derived once (`derived_seed`, restored by
    `load_state_dict`). Shared with its `EpochBatchSampler`, which may outlive the Loader."""

    def __init__(self, orders: RankedOrder, progress: EpochProgress, *, generator: torch.Generator | None,
                 num_workers: int) -> None:
        self.orders, self.progress, self.generator, self.num_workers = orders, progress, generator, num_workers
        self.derived_seed: int | None = None

    def run(self) -> RunContext:
        """The run as it stands (see `Loader.run`)."""
        rank, world = self.orders.rank_world()
        order = self.orders.get()
        if isinstance(order, SeededOrder):
            seed = order.seed
        else:
            if self.derived_seed is None:
                source = self.generator if self.generator is not None else torch
                self.derived_seed = int(source.initial_seed())
            seed = self.derived_seed
        return RunContext(seed=seed, epoch=self.progress.epoch, rank=rank, world_size=world,
                          num_workers=self.num_workers)


def _run_binder(loader: Loader[Any], facts: RunFacts) -> Callable[[], RunContext]:
    """The run for `loader`'s `EpochBatchSampler` as an iteration starts: handed to the Loader's
    components too (`Loader._bind_run`) while the Loader exists; the view holds it weakly (it does
    not keep its Loader alive: a DataLoader rebuilt from a dropped Loader still runs)."""
    ref = weakref.ref(loader)

    def run() -> RunContext:
        live = ref()
        return live._bind_run() if live is not None else facts.run()

    return run
