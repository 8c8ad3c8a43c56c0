"""Resume state: one versioned position per order, checked in one place, re-dealt by one rule.

Every order fastload runs and every sampler it ships saves where an epoch is as a plain dict
(what `get_state()` returns, and torch's `state_dict()` with it) and reads it back through the
types here (`set_state()`), so a state is validated once, by the same rules, with errors that
say what differs:

* `ORDER_VERSION`: the algorithm behind every seeded order fastload computes (the Loader's
  `SeededOrder`, `TokenBudgetBatchSampler`, `ShardWindowSampler`: `IndexShuffle`). A state of
  another version cannot resume exactly; `check_version` says so.
* `check_settings`: a saved state's settings against the current ones, all differences named.
* `SeededPosition`: the Loader's seeded order (samples of the epoch dealt before this rank's
  run began, batches since), with `resume_at`, the one re-deal rule for another world or batch
  size; `SamplerPosition`: a replayed sampler's (batches yielded, the sampler's own state, the
  RNG states of the epoch's start). `parse_position` tells the two apart.
* `EpochPosition`: where a sampler fastload ships (`TokenBudgetBatchSampler`,
  `ShardWindowSampler`) is in its epoch: the one state shape both save through `get_state()`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ORDER_VERSION",
    "EpochPosition",
    "SamplerPosition",
    "SeededPosition",
    "check_settings",
    "check_version",
    "parse_position",
]

ORDER_VERSION = 2


def check_version(state: dict[str, Any], *, key: str, owner: str) -> None:
    """Raise ValueError unless `state[key]` (absent: version 1) is `ORDER_VERSION`."""
    version = state.get(key, 1)
    if version != ORDER_VERSION:
        raise ValueError(
            f"cannot resume {owner}: the state's order is version {version!r}, this fastload computes version "
            f"{ORDER_VERSION} (another permutation of each epoch), so its unseen samples cannot be told apart; "
            "start that epoch over instead (set_epoch, or a Loader state with its 'position' set to None)"
        )


def check_settings(state: dict[str, Any], current: dict[str, Any], *, owner: str) -> None:
    """Raise ValueError naming every setting saved in `state` that differs from `current`."""
    diff = {k: (state[k], v) for k, v in current.items() if k in state and state[k] != v}
    if diff:
        named = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in diff.items())
        raise ValueError(f"cannot resume {owner}: its settings differ from the saved state's ({named})")


def _count(state: dict[str, Any], key: str, owner: str, *, least: int = 0) -> int:
    """`state[key]` as an int of at least `least` (ValueError naming it otherwise)."""
    value: Any = state.get(key)
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < least:
        raise ValueError(f"cannot resume {owner}: invalid {key}={value!r} in the saved position {state}")
    return int(count)


@dataclass(frozen=True)
class SeededPosition:
    """Where a seeded order's epoch is: `base` samples of the epoch were dealt before this run of
    it began (a resume at another world or batch size), `batches` of this rank's batches were
    delivered since, at `world_size` and `batch_size`, over `n` samples (`shuffle`d or not)."""

    n: int
    shuffle: bool
    base: int
    world_size: int
    batch_size: int
    batches: int

    def get_state(self) -> dict[str, Any]:
        """The position as saved (`Loader.get_state()["position"]`)."""
        return self.state(self.n, self.shuffle, self.base, self.world_size, self.batch_size, self.batches)

    @staticmethod
    def state(n: int, shuffle: bool, base: int, world_size: int, batch_size: int, batches: int) -> dict[str, Any]:
        """`SeededPosition(...).get_state()` without the object (the order makes one per batch)."""
        return {
            "order": ORDER_VERSION,
            "n": n,
            "shuffle": shuffle,
            "base": base,
            "world_size": world_size,
            "batch_size": batch_size,
            "batches": batches,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], *, n: int, shuffle: bool) -> SeededPosition:
        """The saved position, checked against an order over `n` samples (ValueError naming what differs)."""
        owner = "the seeded order"
        check_version(state, key="order", owner=owner)
        if state.get("n") != n:
            raise ValueError(
                f"cannot resume: the state was saved over a dataset of {state.get('n')} samples, this one has {n}"
            )
        if state.get("shuffle") != shuffle:
            saved = state.get("shuffle")
            raise ValueError(f"cannot resume: the state has shuffle={saved}, this order shuffle={shuffle}")
        pos = cls(n, shuffle, _count(state, "base", owner), _count(state, "world_size", owner, least=1),
                  _count(state, "batch_size", owner, least=1), _count(state, "batches", owner))
        if pos.base > n:
            raise ValueError(f"cannot resume: invalid seeded position {state} (base past the {n} samples)")
        return pos

    def resume_at(self, world_size: int, batch_size: int) -> tuple[int, int]:
        """`(base, batches to skip)` for the rest of the epoch at `world_size` and `batch_size`:
        the same when neither changed, else the samples every rank consumed folded into `base`
        (after each rank took k batches, exactly `k * batch_size * world_size` positions were
        dealt), so the unseen rest is re-dealt exactly."""
        if world_size == self.world_size and batch_size == self.batch_size:
            return self.base, self.batches
        return min(self.n, self.base + self.batches * self.batch_size * self.world_size), 0


@dataclass(frozen=True)
class SamplerPosition:
    """Where a replayed sampler's epoch is: `batches` yielded, the sampler's own `state_dict()`
    after the last one (None without one), the RNG states the epoch started from (`rng`) and
    the workers' base seed drawn then."""

    batches: int
    sampler_state: Any
    rng: Any
    base_seed: int | None

    def get_state(self) -> dict[str, Any]:
        """The position as saved (`Loader.get_state()["position"]`)."""
        return {"batches": self.batches, "sampler_state": self.sampler_state, "rng": self.rng,
                "base_seed": self.base_seed}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SamplerPosition:
        """The saved position (ValueError when malformed)."""
        return cls(_count(state, "batches", "the sampler order"), state.get("sampler_state"), state.get("rng"),
                   state.get("base_seed"))


def parse_position(state: dict[str, Any]) -> str:
    """"seeded" or "sampler": which order saved `state` (a seeded position records its `base`)."""
    return "seeded" if "base" in state else "sampler"


@dataclass(frozen=True)
class EpochPosition:
    """Where a sampler is in an epoch: `consumed` items (batches or indices, the sampler's unit)
    yielded by rank `rank` of `world_size` in `epoch`, a sampler-specific `cursor` locating the
    next item without replaying (empty when `consumed` alone does), and the `settings` a resume
    must match. The rank is recorded, not checked: every rank of a world advances in lockstep, so
    one rank's position continues any other's."""

    epoch: int
    consumed: int
    rank: int
    world_size: int
    settings: Mapping[str, Any] = field(default_factory=dict)
    cursor: tuple[int, ...] = ()

    def get_state(self) -> dict[str, Any]:
        """The position as saved (`sampler.get_state()`): plain ints, lists and dicts."""
        return {
            "order": ORDER_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "rank": self.rank,
            "world_size": self.world_size,
            "cursor": list(self.cursor),
            "settings": dict(self.settings),
        }

    @classmethod
    def from_state(
        cls, state: Mapping[str, Any], *, owner: str, world_size: int, settings: Mapping[str, Any]
    ) -> EpochPosition:
        """The saved position, checked against the current `world_size` and `settings`
        (ValueError naming the version or every setting that differs). The flat form (settings
        beside the position, the version under `order_version`, `batches_yielded` and `at` for the
        token-budget sampler's count and cursor) is read too."""
        state = dict(state)
        if "settings" not in state:
            state = {
                "order": state.get("order_version", 1),
                "epoch": state.get("epoch", 0),
                "consumed": state.get("consumed", state.get("batches_yielded", 0)),
                "rank": state.get("rank", 0),
                "world_size": state.get("world_size", world_size),
                "cursor": state.get("at", []),
                "settings": {k: state[k] for k in settings if k in state},
            }
        check_version(state, key="order", owner=owner)
        saved = state["settings"]
        if not isinstance(saved, Mapping):
            raise ValueError(f"cannot resume {owner}: invalid settings={saved!r} in the saved position")
        check_settings({**saved, "world_size": state.get("world_size")}, {**settings, "world_size": world_size},
                       owner=owner)
        cursor = state.get("cursor", [])
        if not isinstance(cursor, (list, tuple)):
            raise ValueError(f"cannot resume {owner}: invalid cursor={cursor!r} in the saved position")
        return cls(
            _count(state, "epoch", owner),
            _count(state, "consumed", owner),
            _count(state, "rank", owner),
            _count(state, "world_size", owner, least=1),
            dict(saved),
            tuple(_count({"cursor": c}, "cursor", owner) for c in cursor),
        )
