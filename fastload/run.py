"""The run context: what a `fastload.Loader` tells the components it holds about the run.

A Loader knows facts its components need to produce the right data: the epoch (set by
`set_epoch`, advanced automatically when an epoch ends, restored by `load_state_dict`), this
process's rank and the world size (resolved once, at the first `iter()`), the worker count, and
the base seed of its run. It hands them over through one protocol:

* `RunContext`: those facts, frozen.
* `RunAware`: a component with `bind_run(run)`. The Loader calls it on each component it holds
  that has it (`sampler`, `batch_sampler`, `transform`, `collate_fn`, and the dataset) with the
  facts as they stand: at the first `len()` / `iter()`, at every epoch start (the automatic
  advance included), on `set_epoch` and after `load_state_dict`; in worker processes, on each
  worker's copy before the first batch of a new run context. It is called again only when a fact
  changed. `bind_run` must be cheap and only record the facts (thread workers may still finish a
  batch of an abandoned epoch meanwhile).
* `SettingsReporter`: a component with `component_describe()`; `Loader.describe()["components"]`
  holds each one's settings under its role, as `stats()` holds the counters below.
* `StatsReporter`: a component with `component_stats()`; `Loader.stats()["components"]` holds
  each one's mapping under its role (`"sampler"`, `"batch_sampler"`, `"transform"`,
  `"collate_fn"`, `"dataset"`), read from the objects in the Loader's process.
* `current_batch()`: while the Loader's fetch stage calls the dataset, `collate_fn` and
  `transform` for a batch, the batch's `BatchContext` (the run and the dataset indices of its
  samples, in the batch's order), in whichever thread or worker process fetches it; also while
  `loader.collate_fn` runs in a torch DataLoader rebuilt from the Loader's attributes
  (`fastload.loader_views`) where the batch's indices are known; None outside any batch. A
  transform that draws random numbers keys them by (seed, epoch, index) from it, so its output
  does not depend on the worker count or kind, the batch composition, or a resume. Where a
  batch is being built but its indices cannot be known (that rebuilt loader with worker
  processes), it raises `BatchUnknownError` naming why and the way out, rather than let a
  component augment differently from the Loader.

A user component implements the same methods (see docs/run.md)::

    class RandomNoise:
        def __init__(self) -> None:
            self.seed = 0

        def bind_run(self, run: fastload.run.RunContext) -> None:
            self.seed = run.seed

        def __call__(self, batch):
            ctx = fastload.run.current_batch()
            ...  # draw from np.random.default_rng([self.seed, ctx.run.epoch, index]) per sample

Plain torch samplers that only have `set_epoch` (e.g. `DistributedSampler`) get the epoch
through it (see `EpochRelay`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "COMPONENT_ROLES",
    "BatchContext",
    "BatchUnknownError",
    "EpochRelay",
    "RunAware",
    "RunContext",
    "SettingsReporter",
    "StatsReporter",
    "batch_context",
    "bind_components",
    "collect_component_descriptions",
    "collect_component_stats",
    "current_batch",
    "implements",
    "unknown_batch",
]

COMPONENT_ROLES = ("sampler", "batch_sampler", "transform", "collate_fn", "dataset")


@dataclass(frozen=True)
class RunContext:
    """The facts of a run that a Loader hands to its components (see the module docstring)."""

    seed: int  # the Loader's base seed: its seeded order's, else derived once (see `Loader.run`)
    epoch: int
    rank: int
    world_size: int
    num_workers: int


@runtime_checkable
class RunAware(Protocol):
    """A component that takes the run's facts from the Loader that holds it."""

    def bind_run(self, run: RunContext) -> None:
        """Record `run` (cheap; called at every epoch start and whenever a fact changes)."""


@runtime_checkable
class StatsReporter(Protocol):
    """A component whose counters `Loader.stats()["components"][role]` reports."""

    def component_stats(self) -> Mapping[str, Any]:
        """The component's counters (plain values)."""


@runtime_checkable
class SettingsReporter(Protocol):
    """A component whose settings `Loader.describe()["components"][role]` shows."""

    def component_describe(self) -> Mapping[str, Any]:
        """The component's configuration (plain values)."""


_PROTOCOL_METHODS: dict[type, str] = {
    RunAware: "bind_run",
    StatsReporter: "component_stats",
    SettingsReporter: "component_describe",
}


def implements(obj: Any, protocol: type) -> bool:
    """Whether `obj` is a `protocol` (`RunAware`, `StatsReporter` or `SettingsReporter`), its method
    looked up as a call would find it, so a wrapper that forwards through `__getattr__` (e.g.
    `fastload.loader_views.LoaderCollate`) counts. `isinstance` against these runtime-checkable
    protocols skips `__getattr__` from Python 3.12 on, and would then miss such a wrapper."""
    return callable(getattr(obj, _PROTOCOL_METHODS[protocol], None))


@dataclass(frozen=True, eq=False)
class BatchContext:
    """The batch being fetched: the run it belongs to and its samples' dataset indices
    (1-D, in the batch's order, as the order stage gave them; int64 for every fastload order)."""

    run: RunContext
    indices: np.ndarray


class BatchUnknownError(RuntimeError):
    """A batch is being built but its dataset indices cannot be known here (`current_batch()`)."""


@dataclass(frozen=True)
class _UnknownBatch:
    reason: str  # why the indices cannot be known, and the way out


_BATCH: ContextVar[BatchContext | _UnknownBatch | None] = ContextVar("fastload_batch", default=None)


def current_batch() -> BatchContext | None:
    """The batch the Loader's fetch stage is building in this thread, or None outside a batch.

    Raises `BatchUnknownError` inside `unknown_batch(reason)`: a batch of the Loader's is being
    built (by a torch DataLoader rebuilt from its attributes) but its indices cannot be known."""
    ctx = _BATCH.get()
    if isinstance(ctx, _UnknownBatch):
        raise BatchUnknownError(
            f"fastload.run.current_batch(): the dataset indices of this batch cannot be known: {ctx.reason}"
        )
    return ctx


class batch_context:  # lower case: used as a function, `with batch_context(run, indices):`
    """Make `BatchContext(run, indices)` the `current_batch()` of this thread for the block (the
    fetch stage wraps its calls of the dataset, `collate_fn` and `transform` in it, once per batch:
    a class, not a generator, for fewer calls on that path)."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, run: RunContext, indices: Any) -> None:
        self._ctx = BatchContext(run, np.asarray(indices).reshape(-1))

    def __enter__(self) -> BatchContext:
        self._token = _BATCH.set(self._ctx)
        return self._ctx

    def __exit__(self, *exc: object) -> None:
        _BATCH.reset(self._token)


@contextlib.contextmanager
def unknown_batch(reason: str) -> Iterator[None]:
    """Make `current_batch()` raise `BatchUnknownError(reason)` in this thread for the block: a
    batch is being built whose dataset indices cannot be known (`reason` says why and what to do)."""
    token = _BATCH.set(_UnknownBatch(reason))
    try:
        yield
    finally:
        _BATCH.reset(token)


def bind_components(components: Iterable[Any], run: RunContext) -> None:
    """Call `bind_run(run)` on each `RunAware` object of `components` (None skipped), once per object."""
    seen: set[int] = set()
    for obj in components:
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if implements(obj, RunAware):
            obj.bind_run(run)


def collect_component_stats(components: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`{role: dict(obj.component_stats())}` for each `StatsReporter` of `components` ({role: object}),
    each object under its first role only."""
    return {role: dict(obj.component_stats()) for role, obj in _first_roles(components, StatsReporter)}


def collect_component_descriptions(components: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`{role: dict(obj.component_describe())}` for each `SettingsReporter` of `components`
    ({role: object}), each object under its first role only."""
    return {role: dict(obj.component_describe()) for role, obj in _first_roles(components, SettingsReporter)}


def _first_roles(components: Mapping[str, Any], kind: type) -> list[tuple[str, Any]]:
    """(role, object) for each object of `components` that is a `kind`, under its first role only."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for role, obj in components.items():
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if implements(obj, kind):
            out.append((role, obj))
    return out


class EpochRelay:
    """Hands the Loader's epoch to samplers that have `set_epoch` but not `bind_run` (torch's
    `DistributedSampler`, a user's sampler).

    `announce(epoch, samplers)` (the Loader's `set_epoch`, `load_state_dict`): every such sampler
    gets `set_epoch(epoch)`. `advance(epoch, samplers)` (an epoch start): a sampler gets it when
    the epoch differs from the one last relayed, unless its public `epoch` attribute shows that
    the training loop set another epoch itself since (torch's recipe calls
    `sampler.set_epoch(e)` each epoch; the Loader does not overrule it)."""

    def __init__(self) -> None:
        self.relayed = 0  # a sampler's own starting epoch

    def announce(self, epoch: int, samplers: Iterable[Any]) -> None:
        """Relay `epoch` to every plain sampler with `set_epoch`."""
        for obj in _plain_samplers(samplers):
            obj.set_epoch(epoch)
        self.relayed = epoch

    def advance(self, epoch: int, samplers: Iterable[Any]) -> None:
        """An epoch starts: relay `epoch` where it changed and nobody else set the sampler's epoch."""
        if epoch == self.relayed:
            return
        for obj in _plain_samplers(samplers):
            own = getattr(obj, "epoch", self.relayed)
            if not isinstance(own, int) or own == self.relayed:
                obj.set_epoch(epoch)
        self.relayed = epoch


def _plain_samplers(samplers: Iterable[Any]) -> list[Any]:
    """The objects of `samplers` (each once) with a callable `set_epoch` and no `bind_run`."""
    out: list[Any] = []
    for obj in samplers:
        if obj is None or implements(obj, RunAware) or any(o is obj for o in out):
            continue
        if callable(getattr(obj, "set_epoch", None)):
            out.append(obj)
    return out
