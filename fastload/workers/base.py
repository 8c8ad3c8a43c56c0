"""The batch-source protocol every worker kind implements, and the in-process source.

A batch source is the fetch stage of one epoch. The consumer (the epoch, one thread) calls
`put(j, indices, planned)` for batch j of the epoch in increasing j, then `get(j) -> (batch,
timings, token)` in the same order; `release(token)` hands the batch's buffer back once nothing
holds the batch; `close()` drops what is in flight and stops workers the source owns. `broken` is
True once no later batch can come (a worker failed to start). With nothing in flight, the
consumer may fetch a batch itself: `fetch_alone` (the batch alone) or `run_inline` (the batch
as a worker would hand it over, with its release token). Two flags tell the epoch which loop
fits: `inline` (the source only ever fetches in the caller: nothing is in flight) and
`adaptive` (the autotune probe may switch it between its workers and the caller). Only the
consumer's thread calls these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastload.fetch.plan import PlanSlice

__all__ = ["BatchSource", "Fetch", "InlineSource", "WorkerError"]

# fetch(indices, planned=None) -> (batch, {stage: seconds}); `planned`: the batch's plan slice
Fetch = Callable[..., tuple[Any, dict[str, float]]]


class BatchSource(Protocol):
    """The fetch stage's contract (see the module docstring)."""

    @property
    def broken(self) -> bool:
        """No later batch can come (a worker failed to start)."""

    @property
    def inline(self) -> bool:
        """Every batch is fetched in the caller's thread (nothing is ever in flight)."""

    @property
    def adaptive(self) -> bool:
        """The autotune probe may have the caller fetch instead of the workers."""

    def put(self, j: int, indices: Any, planned: PlanSlice | None = None) -> None:
        """Queue batch `j` of the epoch (indices and plan slice from the order stage)."""

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        """Batch `j` (the next in order) -> (batch, {stage: seconds}, release token or None)."""

    def fetch_alone(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float]]:
        """Fetch one batch in the caller's thread while no batch is in flight (it may use every core)."""

    def run_inline(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float], Any]:
        """`fetch_alone`, handed over as `get` hands a batch over (with its release token)."""

    def release(self, token: Any) -> None:
        """The consumer no longer holds the batch behind `token`."""

    def close(self) -> None:
        """Drop batches in flight; stop the workers this source owns."""


class WorkerError(RuntimeError):
    """A worker died or timed out."""


def fetch_planned(fetch: Fetch, indices: Any, planned: PlanSlice | None) -> tuple[Any, dict[str, float]]:
    """`fetch(indices)`, with the plan slice when there is one (a user's fetch may take no plan)."""
    return fetch(indices) if planned is None else fetch(indices, planned)


class InlineSource:
    """Fetch in the calling thread (`num_workers=0`)."""

    broken = False
    inline = True
    adaptive = False

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._todo: dict[int, tuple[Any, PlanSlice | None]] = {}

    def put(self, j: int, indices: Any, planned: PlanSlice | None = None) -> None:
        """Keep batch j's indices until its `get`."""
        self._todo[j] = (indices, planned)

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        """Fetch batch j now, in the caller."""
        indices, planned = self._todo.pop(j)
        batch, timings = fetch_planned(self._fetch, indices, planned)
        return batch, timings, None

    def fetch_alone(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float]]:
        """Fetch one batch now, in the caller."""
        return fetch_planned(self._fetch, indices, planned)

    def run_inline(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float], Any]:
        """`fetch_alone`, with no release token (the batch owns its memory)."""
        batch, timings = fetch_planned(self._fetch, indices, planned)
        return batch, timings, None

    def release(self, token: Any) -> None:
        """Nothing to release: the batch owns its memory."""

    def close(self) -> None:
        """Forget queued batches."""
        self._todo.clear()
