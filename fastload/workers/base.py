"""The batch-source protocol every worker kind implements, and the in-process source.

A batch source is the fetch stage of one epoch. The consumer (the epoch, one thread) calls
`put(j, indices)` for batch j of the epoch in increasing j, then `get(j) -> (batch, timings,
token)` in the same order; `release(token)` hands the batch's buffer back once nothing holds the
batch; `close()` drops what is in flight and stops workers the source owns. `broken` is True
once no later batch can come (a worker failed to start). Only the consumer's thread calls these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["BatchSource", "InlineSource", "WorkerError"]


class BatchSource(Protocol):
    """The fetch stage's contract (see the module docstring)."""

    broken: bool

    def put(self, j: int, indices: Any) -> None:
        """Queue batch `j` of the epoch (indices from the order stage)."""

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        """Batch `j` (the next in order) -> (batch, {stage: seconds}, release token or None)."""

    def release(self, token: Any) -> None:
        """The consumer no longer holds the batch behind `token`."""

    def close(self) -> None:
        """Drop batches in flight; stop the workers this source owns."""


class WorkerError(RuntimeError):
    """A worker died or timed out."""


class InlineSource:
    """Fetch in the calling thread (`num_workers=0`)."""

    broken = False

    def __init__(self, fetch: Callable[[Any], tuple[Any, dict[str, float]]]) -> None:
        self.fetch = fetch
        self._todo: dict[int, Any] = {}

    def put(self, j: int, indices: Any) -> None:
        """Keep batch j's indices until its `get`."""
        self._todo[j] = indices

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        """Fetch batch j now, in the caller."""
        batch, timings = self.fetch(self._todo.pop(j))
        return batch, timings, None

    def release(self, token: Any) -> None:
        """Nothing to release: the batch owns its memory."""

    def close(self) -> None:
        """Forget queued batches."""
        self._todo.clear()
