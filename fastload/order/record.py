"""What the order stage yields and what it asks of the fetch stage.

`Order` is what the Loader asks of an order (`SeededOrder`, `SamplerOrder`): an epoch's start
position and its records. `BatchRecord` is one batch of an epoch as the order yields it: its
indices, the resume position after it, and where it lies in the epoch's plan
(`fastload.fetch.plan.PlanSlice`, or None). The record travels with the batch to whichever
thread fetches it, so the fetch stage never has to recognise a batch. `Planner` is the fetch
stage's side of the plan (`fastload.fetch.fetcher.Fetcher`): the order hands it an epoch's
whole index array once it is computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from fastload.fetch.plan import EpochPlan, PlanSlice

__all__ = ["BatchRecord", "Order", "Planner"]


class BatchRecord(NamedTuple):
    """One batch of an epoch: `indices` (an int64 array, or what a user's sampler yields),
    `position` (the order's resume state once this batch is delivered) and `plan` (its slice of
    the epoch plan, None when unplanned)."""

    indices: Any
    position: dict[str, Any]
    plan: PlanSlice | None = None


class Planner(Protocol):
    """Reads an epoch's small fields at once (the fetch stage, on the direct path)."""

    def plan(self, indices: np.ndarray, batch_size: int) -> EpochPlan | None:
        """The plan of `indices` (an epoch's order for this rank) in batches of `batch_size`, now
        (or the one `prepare_plan` made for these very indices); None when it cannot be planned."""

    def prepare_plan(self, indices: np.ndarray, batch_size: int) -> None:
        """Make the plan of the next epoch's `indices` on the calling (background) thread, for
        `plan` to take when that epoch starts."""


class Order(Protocol):
    """An epoch order for one rank: a seeded one (`SeededOrder`) or torch's samplers replayed
    (`SamplerOrder`). Each takes the arguments it uses and ignores the others: `epoch` and `ahead`
    (a seeded order; a sampler takes its epoch through `set_epoch` / `bind_run`), `draw_base_seed`
    (a sampler order draws the workers' base seed from the generator as torch does; a seeded one
    derives it from (seed, epoch))."""

    def __len__(self) -> int: ...

    def epoch(
        self,
        epoch: int,
        resume: dict[str, Any] | None = None,
        *,
        ahead: bool = True,
        plan: Planner | None = None,
        draw_base_seed: bool = True,
    ) -> tuple[int | None, dict[str, Any], Iterator[BatchRecord]]:
        """`(workers' base seed, start position, the epoch's records)`, from `resume` (a saved
        position) when given; `plan`: the fetch stage's planner for an epoch read at once."""
