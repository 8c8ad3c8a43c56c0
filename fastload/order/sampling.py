"""Batch orders: seeded rank-aware epochs, torch-sampler replay, exact mid-epoch resume.

Two order sources feed the Loader, both yielding a `BatchRecord` (`fastload.order.record`) per
batch, whose `position` is what `Loader.state_dict()` stores once the consumer has received
that batch:

* `SeededOrder` (``seed=`` given, or a distributed run without a user sampler): position `p` of
  an epoch holds sample `IndexShuffle(n, seed, epoch)(p)` (`fastload.order.index_shuffle`: a keyed
  bijection computed per position, so nothing of size n is ever built); ranks are dealt
  interleaved positions like `DistributedSampler` (padding by repetition when
  ``drop_last=False``), and each rank maps only the positions of its own next batches. Position
  state is (order version, n, base, world_size, batch_size, batches) so a resume with another
  world size re-deals exactly the unseen rest of the epoch. See docs/order.md.
* `SamplerOrder` (torch semantics): iterates the torch / user (batch) sampler. Resume uses the
  sampler's own `state_dict()` snapshot taken right after each batch was pulled (torchdata
  `Stateful` convention) when it has one, else replays the epoch from the RNG states captured
  at epoch start and fast-forwards the number of batches already yielded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from fastload.fetch.plan import PLAN_MAX_BYTES, PlanSlice
from fastload.order.ahead import Ahead
from fastload.order.index_shuffle import IndexShuffle
from fastload.order.position import EpochPosition, SamplerPosition, SeededPosition
from fastload.order.record import BatchRecord, Planner
from fastload.run import RunContext

__all__ = [
    "AHEAD_MAX_BYTES",
    "STREAM_SAMPLES",
    "RankedSampler",
    "RunRank",
    "SamplerOrder",
    "SeededOrder",
    "batches_left",
    "epoch_permutation",
    "rank_indices",
    "rank_positions",
    "resolve_rank_world",
    "seed_for",
]


AHEAD_MAX_BYTES = 256 << 20  # a rank's epoch (int64 per sample) up to this size is computed an epoch ahead
STREAM_SAMPLES = 1 << 16  # an epoch that is not planned is mapped in chunks of up to this many positions


def resolve_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank/world size from the arguments, else `torch.distributed` (when initialized), else the
    `RANK`/`WORLD_SIZE` environment (both, or a world of 1). A partial environment (`WORLD_SIZE`
    > 1 without `RANK`, as in a launcher's child before `init_process_group`) is an error, never
    a guess: the Loader calls this at its first `iter()`/`len()`, when the run is set up."""
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
            rank = torch.distributed.get_rank() if rank is None else rank
        else:
            env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
            if world_size is None:
                world_size = int(env_world) if env_world is not None else 1
            if rank is None:
                if env_rank is None and world_size > 1:
                    raise ValueError(
                        f"the world size is {world_size} (WORLD_SIZE={env_world}) but no rank is known: RANK is not "
                        "set and torch.distributed is not initialized; pass rank= and world_size= to the Loader, "
                        "or initialize torch.distributed before its first iter()"
                    )
                rank = int(env_rank) if env_rank is not None else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world_size {world_size}")
    return int(rank), int(world_size)


class RunRank:
    """The (rank, world size) of a Loader or a fastload sampler, by one rule: arguments given
    win; else, for a sampler held by a Loader, the Loader's run (`bind`); else `resolve_rank_world`
    afresh at each call until `fix()` (the first `iter()` / `__iter__`), so an object built before
    the process group exists takes the rank the run has when it starts. `owner` names the object
    in errors."""

    def __init__(self, rank: int | None, world_size: int | None, *, owner: str) -> None:
        if rank is not None and world_size is not None:
            resolve_rank_world(rank, world_size)  # invalid arguments fail here
        elif world_size is not None and world_size < 1:
            raise ValueError(f"{owner}: invalid world_size {world_size}")
        elif rank is not None and rank < 0:
            raise ValueError(f"{owner}: invalid rank {rank}")
        self.rank_arg, self.world_arg, self.owner = rank, world_size, owner
        self._fixed: tuple[int, int] | None = None
        self._bound: tuple[int, int] | None = None

    def get(self) -> tuple[int, int]:
        """(rank, world size): fixed, else the bound run's, else resolved now."""
        if self._fixed is not None:
            return self._fixed
        if self._bound is not None:
            return self._bound
        return resolve_rank_world(self.rank_arg, self.world_arg)

    def fix(self) -> tuple[int, int]:
        """Keep the current (rank, world size) until the next `bind`."""
        self._fixed = self.get()
        return self._fixed

    def bind(self, rank: int, world_size: int) -> None:
        """Take the Loader's run (`rank` of `world_size`) for what was not given. A given value
        that differs raises `ValueError` naming both, except against a run of one process (rank 0
        of 1), which a sampler simulating one rank of a larger world may contradict."""
        given = [(name, v) for name, v in (("rank", self.rank_arg), ("world_size", self.world_arg)) if v is not None]
        run = {"rank": rank, "world_size": world_size}
        if world_size > 1 and any(run[name] != v for name, v in given):
            args = ", ".join(f"{name}={v}" for name, v in given)
            raise ValueError(
                f"{self.owner} was built with {args}, but the Loader holding it runs rank {rank} of world size "
                f"{world_size}: pass the Loader's rank and world size, or leave them out (it then takes the Loader's)"
            )
        # against a run of one process, the arguments given resolve as they would alone
        bound = resolve_rank_world(self.rank_arg, self.world_arg) if world_size == 1 and given else (rank, world_size)
        self._bound, self._fixed = bound, None


class RankedSampler:
    """What fastload's samplers share: `rank` / `world_size` by the `RunRank` rule (`_ranks`, set by
    the subclass), `bind_run` (`fastload.run.RunAware`): the Loader's rank and world size where
    none were given (ValueError if given ones contradict it) and its epoch, as `set_epoch`; and
    resume state: `get_state()` is `position.get_state()` (the subclass's `EpochPosition`),
    `set_state(state)` (the subclass's) continues from one, and torch's `state_dict()` /
    `load_state_dict()` (what the Loader, Lightning and torchdata's `StatefulDataLoader` call)
    are those two."""

    _ranks: RunRank

    @property
    def position(self) -> EpochPosition:
        """Where this rank is in its epoch."""
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        """`self.position.get_state()`: enough to continue after the last item yielded."""
        return self.position.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `get_state()`, or an older flat one): the next `__iter__`
        resumes after its last yielded item. A state of another order version, or saved with
        other settings or at another world size, raises ValueError naming what differs."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """`get_state()`, under the name torch's stateful protocol uses."""
        return self.get_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`set_state(state)`, under the name torch's stateful protocol uses."""
        self.set_state(state)

    @property
    def rank(self) -> int:
        """This rank (see `RunRank`)."""
        return self._ranks.get()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks the epoch is dealt to (see `RunRank`)."""
        return self._ranks.get()[1]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next `__iter__` yields."""
        raise NotImplementedError

    def bind_run(self, run: RunContext) -> None:
        """Take the Loader's run (see the class docstring)."""
        self._ranks.bind(run.rank, run.world_size)
        self.set_epoch(run.epoch)


def batches_left(position: SeededPosition, *, n: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    """How many batches `SeededOrder.epoch` yields from `position` at this world size and batch
    size: the rest of the epoch, re-dealt when either changed (`SeededPosition.resume_at`)."""
    base, skip = position.resume_at(world_size, batch_size)
    if n - base <= 0:
        return 0
    return max(0, _num_batches(_per_rank(n - base, world_size, drop_last), batch_size, drop_last) - skip)


def seed_for(seed: int, epoch: int) -> int:
    """A non-negative 63-bit seed derived from (seed, epoch), e.g. the workers' base seed."""
    return int(np.random.SeedSequence([seed & (2**64 - 1), epoch]).generate_state(1, np.uint64)[0] >> 1)


def epoch_permutation(n: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The global order of one epoch, whole (n int64s: for checks and small n; `SeededOrder`
    maps only the positions it needs): a pure function of (seed, epoch, n)."""
    if not shuffle or n == 0:
        return np.arange(n, dtype=np.int64)
    return IndexShuffle(n, seed=seed, epoch=epoch)(np.arange(n, dtype=np.int64))


def _per_rank(remaining: int, world_size: int, drop_last: bool) -> int:
    if drop_last:
        return remaining // world_size
    return math.ceil(remaining / world_size)


def _num_batches(per_rank: int, batch_size: int, drop_last: bool) -> int:
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


def rank_positions(
    remaining: int,
    *,
    world_size: int,
    rank: int,
    batch_size: int,
    drop_last: bool,
    batches: range | np.ndarray,
) -> np.ndarray:
    """Where rank `rank`'s batches numbered `batches` lie among `remaining` positions of an epoch
    (relative to the first unseen one), concatenated in that order (int64). Positions are dealt
    interleaved: the rank's t-th sample sits at `(rank + world_size * t) % remaining` (the wrap is
    `DistributedSampler`'s padding); its batches are consecutive runs of `batch_size` samples,
    the last one possibly shorter (none with `drop_last`). O(len(result)) time and memory."""
    if remaining <= 0:
        return np.zeros(0, dtype=np.int64)
    per_rank = _per_rank(remaining, world_size, drop_last)
    nb = _num_batches(per_rank, batch_size, drop_last)
    limit = min(per_rank, nb * batch_size)
    if isinstance(batches, range) and batches.step == 1:
        lo, hi = max(batches.start, 0) * batch_size, min(batches.stop, nb) * batch_size
        t = np.arange(lo, min(hi, limit), dtype=np.int64)
    else:
        ks = np.asarray(batches, dtype=np.int64).reshape(-1)
        ks = ks[(ks >= 0) & (ks < nb)]
        t = (ks[:, None] * batch_size + np.arange(batch_size, dtype=np.int64)).reshape(-1)
        t = t[t < limit]
    if world_size == 1:
        return t  # contiguous: t < per_rank == remaining, no padding is ever needed
    t *= world_size
    t += rank
    if len(t) and int(t.max()) >= remaining:
        t %= remaining
    return t


def rank_indices(
    order: np.ndarray,
    *,
    base: int,
    world_size: int,
    rank: int,
    batch_size: int,
    drop_last: bool,
    skip: int = 0,
    sort: bool = False,
) -> np.ndarray:
    """Rank `rank`'s indices over a whole `order[base:]`, dealt as `rank_positions` says, without
    the first `skip` batches; its batches are the consecutive `batch_size` slices (the last one
    may be shorter).

    After every rank has taken k batches, exactly `order[base : base + k*batch_size*world_size]`
    has been consumed (clipped to the end), which is what makes re-dealing exact. `sort` sorts
    the indices inside each batch (one vectorized sort for the whole range).
    """
    remaining = len(order) - base
    if remaining <= 0:
        return order[:0]
    per_rank = _per_rank(remaining, world_size, drop_last)
    nb = _num_batches(per_rank, batch_size, drop_last)
    if skip >= nb:
        return order[:0]
    if world_size == 1:  # contiguous: a view
        mine = order[base + skip * batch_size : base + min(per_rank, nb * batch_size)]
    else:
        kw = dict(world_size=world_size, rank=rank, batch_size=batch_size, drop_last=drop_last)
        mine = order[base + rank_positions(remaining, batches=range(skip, nb), **kw)]
    return _sort_batches(mine, batch_size) if sort else mine


def _sort_batches(mine: np.ndarray, batch_size: int) -> np.ndarray:
    """A copy of `mine` with each run of `batch_size` (and the shorter tail) sorted."""
    full = (len(mine) // batch_size) * batch_size
    # indices that fit int32 sort as int32: the same result, in about half the time (paid at every epoch start)
    i32 = np.iinfo(np.int32)
    narrow = len(mine) > 0 and i32.min <= int(mine.min()) and int(mine.max()) <= i32.max
    keys = mine.astype(np.int32) if narrow else mine.copy()
    keys[:full].reshape(-1, batch_size).sort(axis=1)
    keys[full:].sort()
    return keys.astype(np.int64) if narrow else keys


class SeededOrder:
    """Seeded, rank-aware, resumable epoch order over `n` samples (batches are int64 arrays).

    With `shuffle`, which samples share a batch is random (`IndexShuffle`); inside a batch they
    are sorted, so a reader gathers them in storage order. A rank maps only its own positions:
    unplanned, in chunks of at most `STREAM_SAMPLES` as its batches are asked for (growing from
    one batch, so the first batch comes at once); with a planner (`epoch(plan=)`), its whole
    epoch at once (the plan reads it all), and, when that fits `AHEAD_MAX_BYTES`, the next
    epoch's on a background thread during this one (`fastload.order.ahead`; `epoch(..., ahead=)`).
    """

    def __init__(
        self, n: int, *, batch_size: int, shuffle: bool, drop_last: bool, seed: int, rank: int, world_size: int
    ) -> None:
        if n < 0 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid seeded order: n={n}, batch_size={batch_size}, rank={rank}/{world_size}")
        if drop_last and 0 < n < world_size:
            raise ValueError(
                f"{n} samples cannot be split over {world_size} ranks with drop_last=True (every rank would "
                "get none); use drop_last=False (samples are repeated to give each rank one) or fewer ranks"
            )
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._ahead = Ahead(name="fastload-order")  # the next epoch's indices, computed during this one
        self._shuffle: tuple[int, int, IndexShuffle] | None = None  # (seed, epoch, shuffle) last used

    def __len__(self) -> int:
        return _num_batches(_per_rank(self.n, self.world_size, self.drop_last), self.batch_size, self.drop_last)

    @property
    def ahead_pending(self) -> Any:
        """The `(epoch, base, skip)` whose indices are being computed ahead, or None."""
        return self._ahead.pending

    def base_seed(self, epoch: int) -> int:
        """The workers' base seed for `epoch`: `seed_for(seed, epoch)`, as `epoch()` returns it."""
        return seed_for(self.seed, epoch)

    def position(self, state: dict[str, Any]) -> SeededPosition:
        """`state` (a `state_dict()`'s position) as a position of this order; ValueError unless it
        resumes this order exactly."""
        if "base" not in state:
            raise ValueError(
                "cannot resume: the state's position is not a seeded order's (it was saved by a Loader "
                "iterating a sampler: torch's order, or a user sampler), this Loader has a seeded order"
            )
        return SeededPosition.from_state(state, n=self.n, shuffle=self.shuffle)

    def epoch(
        self,
        epoch: int,
        resume: dict[str, Any] | None = None,
        *,
        ahead: bool = True,
        plan: Planner | None = None,
        draw_base_seed: bool = True,
    ) -> tuple[int, dict[str, Any], Iterator[BatchRecord]]:
        """`(base_seed, start_position, iterator of BatchRecord)` for this rank; `ahead`: with
        `plan`, compute the next epoch's indices in the background meanwhile (if they fit
        `AHEAD_MAX_BYTES`); `plan.plan(indices, batch_size)`: called with the array of all the
        indices to come once it is computed (before the first batch is yielded; not when they are
        past `PLAN_MAX_BYTES`: the epoch is then streamed); the batches then come with their
        slices of that plan. With `ahead`, `plan.prepare_plan` is called on the background thread
        with the next epoch's indices, to prepare what that epoch's call will use. The workers'
        base seed is `seed_for(seed, epoch)` (`draw_base_seed` is a sampler order's)."""
        base, skip = 0, 0
        if resume is not None:
            base, skip = self.position(resume).resume_at(self.world_size, self.batch_size)
        start = self._pos(base, skip)
        return seed_for(self.seed, epoch), start, self._iter(epoch, base, skip, ahead, plan)

    def _pos(self, base: int, batches: int) -> dict[str, Any]:
        return SeededPosition.state(self.n, self.shuffle, base, self.world_size, self.batch_size, batches)

    def batches_left(self, base: int = 0, skip: int = 0) -> int:
        """This rank's batches in the rest of an epoch from position (`base`, `skip`)."""
        per_rank = _per_rank(self.n - base, self.world_size, self.drop_last) if base < self.n else 0
        return max(0, _num_batches(per_rank, self.batch_size, self.drop_last) - skip)

    def indices(
        self, epoch: int, base: int = 0, skip: int = 0, stop: int | None = None, step: int = 1
    ) -> np.ndarray:
        """This rank's indices for `epoch`, batches `range(skip, stop, step)` of the rest from
        position `base` (all of them by default; `step`: e.g. one worker's share), concatenated:
        consecutive `batch_size` slices, the rank's last batch possibly shorter. Sorted inside each
        batch when shuffling: readers gather in storage order. Costs O(batches asked for)."""
        remaining = self.n - base
        nb = self.batches_left(base)
        stop = nb if stop is None else min(stop, nb)
        kw = dict(world_size=self.world_size, rank=self.rank, batch_size=self.batch_size, drop_last=self.drop_last)
        pos = rank_positions(remaining, batches=range(skip, stop, step), **kw)
        if base:
            pos += base
        if not self.shuffle:
            return pos
        return _sort_batches(self._shuffler(epoch)(pos), self.batch_size)

    def _shuffler(self, epoch: int) -> IndexShuffle:
        cached = self._shuffle  # one read: the background thread may replace it meanwhile
        if cached is not None and cached[0] == self.seed and cached[1] == epoch:
            return cached[2]
        shuffle = IndexShuffle(self.n, seed=self.seed, epoch=epoch)
        self._shuffle = (self.seed, epoch, shuffle)
        return shuffle

    def _indices_ahead(self, epoch: int, plan: Planner | None) -> np.ndarray:
        """`indices(epoch)` on the background thread, and its plan prepared."""
        mine = self.indices(epoch)
        if plan is not None:
            plan.prepare_plan(mine, self.batch_size)
        return mine

    def _iter(
        self,
        epoch: int,
        base: int,
        skip: int,
        ahead: bool,
        plan: Planner | None,
    ) -> Iterator[BatchRecord]:
        bs = self.batch_size
        left = self.batches_left(base, skip)
        if plan is not None and left * bs * 8 <= PLAN_MAX_BYTES:  # planned: the rank's whole epoch at once
            mine = self._ahead.take((epoch, base, skip))
            if mine is None:
                mine = self.indices(epoch, base, skip)
            batches: Iterable[tuple[np.ndarray, PlanSlice | None]] = _cut(mine, bs, plan)
            if ahead and self.shuffle and len(self) * bs * 8 <= AHEAD_MAX_BYTES:  # the next epoch, meanwhile
                self._ahead.start((epoch + 1, 0, 0), self._indices_ahead, epoch + 1, plan)
        else:
            batches = self._stream(epoch, base, skip, skip + left)
        for k, (indices, planned) in enumerate(batches, start=skip + 1):
            yield BatchRecord(indices, self._pos(base, k), planned)

    def _stream(self, epoch: int, base: int, skip: int, stop: int) -> Iterator[tuple[np.ndarray, None]]:
        """Batches `skip..stop` mapped chunk by chunk: 1 batch, then twice as many each time, up
        to `STREAM_SAMPLES` positions."""
        bs, step, cap = self.batch_size, 1, max(1, STREAM_SAMPLES // self.batch_size)
        k = skip
        while k < stop:
            end = min(stop, k + step)
            chunk = self.indices(epoch, base, k, end)
            for a in range(0, len(chunk), bs):
                yield chunk[a : a + bs], None
            k, step = end, min(cap, step * 2)


def _cut(order: np.ndarray, bs: int, plan: Planner | None) -> Iterable[tuple[np.ndarray, PlanSlice | None]]:
    """`order` in consecutive batches of `bs` (the last may be shorter), each with its slice of
    the plan `plan` makes of `order` (None without one)."""
    planned = plan.plan(order, bs) if plan is not None and len(order) else None
    if planned is not None:
        return zip(planned.batches, planned.slices())
    return ((order[k : k + bs], None) for k in range(0, len(order), bs))


Cut = Iterator[tuple[Any, PlanSlice | None]]  # batches, each with its plan slice or None


def torch_batches(batch_sampler: Any) -> Callable[[Planner | None], Cut] | None:
    """For torch's own `BatchSampler` over `RandomSampler` / `SequentialSampler`: a function
    producing the same batches as int64 arrays (one `randperm`, no per-index Python) with the
    same RNG draws, including the extra `randperm` torch's sampler makes when exhausted. Its
    argument: a planner as in `SeededOrder.epoch`, given the epoch's batched indices. Over a
    fastload sampler that cuts its own batches (`batches(batch_size, drop_last)`, e.g.
    `ShardWindowSampler`): those, unplanned (as its indices one by one would be)."""
    if type(batch_sampler) is not BatchSampler:
        return None
    sampler, bs, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    if isinstance(sampler, RankedSampler) and callable(getattr(sampler, "batches", None)):

        def ranked(plan: Planner | None = None) -> Cut:
            return ((batch, None) for batch in sampler.batches(bs, drop_last))

        return ranked
    if type(sampler) is SequentialSampler:

        def sequential(plan: Planner | None = None) -> Cut:
            n = len(sampler.data_source)
            yield from _cut(np.arange(n - n % bs if drop_last else n, dtype=np.int64), bs, plan)

        return sequential
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:

        def shuffled(plan: Planner | None = None) -> Cut:
            n = len(sampler.data_source)
            gen = sampler.generator
            private = gen is None
            if private:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                gen = torch.Generator()
                gen.manual_seed(seed)
            perm = torch.randperm(n, generator=gen).numpy()
            batches = iter(_cut(perm[: n - n % bs] if drop_last else perm, bs, plan))
            for _ in range(n // bs):
                yield next(batches)
            if not private:  # torch's RandomSampler draws once more at its end (visible in a shared generator)
                torch.randperm(n, generator=gen)
            yield from batches  # the last, shorter batch (not with drop_last)

        return shuffled
    return None


def _has(obj: Any, name: str) -> bool:
    return callable(getattr(obj, name, None))


class SamplerOrder:
    """Iterates a torch-style index sampler (a batch sampler, or a sampler when batch_size=None).

    `stateful` is the object whose `state_dict()` is snapshotted per batch: the batch sampler
    if it has `state_dict`/`load_state_dict`, else the inner sampler under torch's
    `BatchSampler`, else None (replay + fast-forward).
    """

    def __init__(self, index_sampler: Iterable[Any], *, sampler: Any, generator: torch.Generator | None) -> None:
        self.index_sampler, self.sampler, self.generator = index_sampler, sampler, generator
        self._fast = torch_batches(index_sampler)
        self.stateful: Any = None
        if _has(index_sampler, "state_dict") and _has(index_sampler, "load_state_dict"):
            self.stateful = index_sampler
        elif (
            isinstance(index_sampler, torch.utils.data.BatchSampler)
            and _has(sampler, "state_dict")
            and _has(sampler, "load_state_dict")
        ):
            self.stateful = sampler

    def __len__(self) -> int:
        return len(self.index_sampler)  # type: ignore[arg-type]

    def epoch(
        self,
        epoch: int = 0,
        resume: dict[str, Any] | None = None,
        *,
        ahead: bool = True,
        plan: Planner | None = None,
        draw_base_seed: bool = True,
    ) -> tuple[int | None, dict[str, Any], Iterator[BatchRecord]]:
        """Start an epoch: `(base_seed, start_position, iterator of BatchRecord)` (`epoch` and
        `ahead` are a seeded order's: a sampler takes its epoch through `set_epoch`).

        Mirrors torch: the workers' base seed is drawn from `generator` before the sampler's
        first draw, so orders match `DataLoader` given the same generator/global RNG. `plan`: as
        in `SeededOrder.epoch`, for torch's own samplers (see `torch_batches`).
        """
        saved = SamplerPosition.from_state(resume) if resume is not None else None
        if saved is not None and saved.sampler_state is not None and self.stateful is not None:
            self.stateful.load_state_dict(saved.sampler_state)
            return saved.base_seed, saved.get_state(), self._track(
                self._iterate(plan), saved.batches, saved.rng, saved.base_seed
            )
        if saved is not None and saved.rng is not None:
            return self._replay(saved, plan)
        rng = {
            "generator": self.generator.get_state() if self.generator is not None else None,
            "global": torch.get_rng_state(),
            "drew": draw_base_seed,
        }
        base_seed = self._draw() if draw_base_seed else None
        start = SamplerPosition(0, None, rng, base_seed).get_state()
        return base_seed, start, self._track(self._iterate(plan), 0, rng, base_seed)

    def _iterate(self, plan: Planner | None = None) -> Cut:
        """The (batch) sampler's indices, each with its plan slice (None: unplanned); torch's own
        samplers' batches as `torch_batches` gives them, planned by `plan` where given."""
        if self._fast is not None:
            return self._fast(plan)
        return ((idx, None) for idx in self.index_sampler)

    def _draw(self) -> int:
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def _replay(
        self, resume: SamplerPosition, plan: Planner | None = None
    ) -> tuple[int | None, dict[str, Any], Iterator[BatchRecord]]:
        """Re-run the epoch start under the RNG states captured then, and skip what was yielded."""
        rng = resume.rng
        if self.generator is not None and rng["generator"] is not None:
            self.generator.set_state(rng["generator"])
        with torch.random.fork_rng(devices=[]):  # the user's global RNG is left untouched
            torch.set_rng_state(rng["global"])
            base_seed = self._draw() if rng["drew"] else None
            it = self._iterate(plan)
            head = next(it, None)  # samplers seed themselves on the first pull
        skip = resume.batches
        start = SamplerPosition(skip, None, rng, base_seed).get_state()
        if head is None:
            return base_seed, start, iter(())
        if skip == 0:
            return base_seed, start, self._track(it, 0, rng, base_seed, head=[head])
        for _ in range(skip - 1):
            if next(it, None) is None:
                return base_seed, start, iter(())
        return base_seed, start, self._track(it, skip, rng, base_seed)

    def _track(
        self, it: Cut, start: int, rng: Any, base_seed: int | None, head: list[Any] | None = None
    ) -> Iterator[BatchRecord]:
        k = start
        for idx, planned in head or ():
            k += 1
            yield BatchRecord(idx, self._pos(k, rng, base_seed), planned)
        for idx, planned in it:
            k += 1
            yield BatchRecord(idx, self._pos(k, rng, base_seed), planned)

    def _pos(self, k: int, rng: Any, base_seed: int | None) -> dict[str, Any]:
        state = self.stateful.state_dict() if self.stateful is not None else None
        return {"batches": k, "sampler_state": state, "rng": rng, "base_seed": base_seed}
