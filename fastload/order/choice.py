"""The order stage: which order a Loader runs, how many batches it has left, and whether a saved state applies.

The order is an iterator of `(indices, position)`; `position` (a few integers, plus the
sampler's RNG state for a sampler order) is the stage's resume state: the Loader keeps the
position of the last batch the consumer received and `Loader.get_state()` saves it.
"""

from __future__ import annotations

from typing import Any

from fastload.order.position import SamplerPosition, parse_position
from fastload.order.sampling import RunRank, SamplerOrder, SeededOrder, batches_left

__all__ = [
    "STATE_VERSION",
    "RankedOrder",
    "batches_from",
    "check_state",
    "check_state_version",
    "dealt_world",
    "make_order",
    "order_kind",
]

STATE_VERSION = 1  # the layout of `Loader.get_state()` (its position's own version is `position.ORDER_VERSION`)


def check_state_version(state: dict[str, Any]) -> None:
    """Raise ValueError unless `state` is a Loader state of `STATE_VERSION` (its `version` key)."""
    version = state.get("version") if isinstance(state, dict) else None
    if version != STATE_VERSION:
        raise ValueError(
            f"cannot resume the Loader: the state's 'version' is {version!r}, this fastload reads Loader states "
            f"of version {STATE_VERSION} (what Loader.get_state() / state_dict() returns)"
        )


def make_order(
    *,
    num_samples: int,
    batch_size: int | None,
    batch_sampler: Any,
    sampler: Any,
    user_order: bool,
    shuffle: bool,
    drop_last: bool,
    seed: int | None,
    generator: Any,
    rank: int,
    world_size: int,
) -> SeededOrder | SamplerOrder:
    """A seeded order (a pure function of seed, epoch and dataset length, dealt over the ranks)
    for batched loading without a user's sampler when `seed` is given or the world has several
    ranks; else torch's samplers replayed (`SamplerOrder`)."""
    batched = batch_sampler is not None
    if batched and not user_order and (seed is not None or world_size > 1):
        return SeededOrder(
            num_samples,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed if seed is not None else 0,
            rank=rank,
            world_size=world_size,
        )
    index_sampler = batch_sampler if batched else sampler
    return SamplerOrder(index_sampler, sampler=sampler, generator=generator)


def order_kind(order: SeededOrder | SamplerOrder) -> str:
    """"seeded shuffle", "seeded sequential" or "sampler"."""
    if isinstance(order, SeededOrder):
        return "seeded shuffle" if order.shuffle else "seeded sequential"
    return "sampler"


def batches_from(order: SeededOrder | SamplerOrder, position: dict[str, Any] | None, drop_last: bool) -> int | None:
    """Batches an epoch yields from `position` (None: from its start); None if the sampler has no len."""
    try:
        full = len(order)
    except TypeError:
        return None
    if position is None:
        return full
    if isinstance(order, SeededOrder):
        return batches_left(
            order.position(position), n=order.n, batch_size=order.batch_size, world_size=order.world_size,
            drop_last=drop_last,
        )
    return max(0, full - SamplerPosition.from_state(position).batches)


def dealt_world(sampler: Any, batch_sampler: Any, world_size: int) -> int:
    """The number of ranks the order is dealt over: the sampler's own `num_replicas` (e.g. a
    `DistributedSampler`) when it has one, else `world_size`."""
    for obj in (sampler, getattr(batch_sampler, "sampler", None), batch_sampler):
        replicas = getattr(obj, "num_replicas", None)
        if isinstance(replicas, int):
            return replicas
    return world_size


def check_state(
    state: dict[str, Any], order: SeededOrder | SamplerOrder, *, num_samples: int, world: int, batch_size: Any
) -> None:
    """Raise `ValueError` when `state` cannot continue exactly with `order` (another dataset
    length; the other kind of order; a seeded position this order cannot resume, see
    `SeededPosition.from_state`; a sampler order saved mid-epoch at another world or batch size,
    which only a seeded order can re-deal). The one check of a Loader state's position."""
    pos = state.get("position")
    saved_n = state.get("num_samples")
    if pos is None:
        return
    if saved_n is not None and saved_n != num_samples:
        raise ValueError(
            f"Loader state is for a dataset of {saved_n} samples, this Loader's has {num_samples}: "
            "its position does not apply"
        )
    kind = parse_position(pos)
    if isinstance(order, SeededOrder) != (kind == "seeded"):
        saved, here = ("a seeded", "a sampler") if kind == "seeded" else ("a sampler", "a seeded")
        raise ValueError(f"Loader state was saved with {saved} order, this Loader has {here} order (see seed=)")
    if isinstance(order, SeededOrder):
        order.position(pos)  # valid for this order; it re-deals the rest of the epoch to any world or batch size
        return
    if not SamplerPosition.from_state(pos).batches:
        return
    for key, current in (("world_size", world), ("batch_size", batch_size)):
        saved_value = state.get(key)
        if saved_value is not None and saved_value != current:
            raise ValueError(
                f"Loader state was saved mid-epoch at {key}={saved_value}, this Loader has {key}={current}: "
                "a sampler's order cannot be re-dealt (the rest of the epoch would be replayed or skipped); "
                "resume at an epoch boundary, or use seed= (a seeded order re-deals exactly)"
            )


class RankedOrder:
    """The order for the run's rank and world size: (rank, world size) is `RunRank`'s (the
    arguments, else resolved afresh at each call until `fix()`: the first `iter()` or
    `load_state_dict`), so a Loader built before the process group exists (in a LightningModule's
    `__init__`) takes the rank the run has when it starts; the order is rebuilt only when that
    pair changes. `order_args`: `make_order`'s other arguments but `num_samples` (`len(dataset)`
    when built) and `seed` (this object's)."""

    def __init__(self, dataset: Any, *, rank: int | None, world_size: int | None, seed: int | None,
                 **order_args: Any) -> None:
        self._ranks = RunRank(rank, world_size, owner="Loader")
        self._dataset, self.seed, self._args = dataset, seed, order_args
        self._order: SeededOrder | SamplerOrder | None = None
        self._built_for: tuple[int, int] | None = None

    def rank_world(self) -> tuple[int, int]:
        """(rank, world size): fixed by `fix()`, else resolved now (see `resolve_rank_world`)."""
        return self._ranks.get()

    def fix(self) -> None:
        """Keep the current (rank, world size) from now on."""
        self._ranks.fix()

    def get(self) -> SeededOrder | SamplerOrder:
        """The order for the current (rank, world size), built when first needed."""
        rw = self.rank_world()
        if self._order is None or self._built_for != rw:
            self._order = make_order(num_samples=len(self._dataset), seed=self.seed, rank=rw[0],
                                     world_size=rw[1], **self._args)
            self._built_for = rw
        return self._order

    def set_seed(self, seed: int) -> None:
        """Use `seed` from now on (a loaded state's), in the order already built too."""
        self.seed = seed
        if isinstance(self._order, SeededOrder):
            self._order.seed = seed
