"""`DeviceQueue`: the device stage of an epoch, `prefetch` host-to-device copies in flight.

Contract: `push(batch, n, position, tokens)` starts the copy of a host batch on the side stream
(`fastload.transfer.side_stream.DeviceStage`) and, when the copy no longer aliases the host buffers (any real
device), hands those buffers back fenced by the copy's event; `pop() -> (batch, n, position,
tokens)` returns the oldest batch, the consumer's stream made to wait for its copy only;
`close()` drops what is in flight. Consumer thread only; no resume state.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from fastload.stats import LoaderStats
from fastload.transfer.pin_stage import PinStage
from fastload.transfer.side_stream import DeviceStage

__all__ = ["DeviceQueue"]

_perf = time.perf_counter


class DeviceQueue:
    """Copies to `stage.device` in flight, oldest first."""

    def __init__(self, stage: DeviceStage, *, prefetch: int, stats: LoaderStats) -> None:
        self.stage, self.prefetch, self._stats = stage, max(1, prefetch), stats
        self._aliases = stage.device.type == "cpu"  # device='cpu': the "copy" is the host batch itself
        self._queue: deque[tuple[Any, Any, int, dict[str, Any], list[Any]]] = deque()

    @property
    def full(self) -> bool:
        """`prefetch` copies are in flight."""
        return len(self._queue) >= self.prefetch

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, batch: Any, n: int, position: dict[str, Any], tokens: list[Any]) -> None:
        """Start the copy of `batch`; its host buffers are released once the copy has run."""
        t = _perf()
        out, event = self.stage.start(batch)
        del batch
        self._stats.add("h2d", _perf() - t)
        if not self._aliases:
            PinStage.release(tokens, event)
            tokens = []
        self._queue.append((out, event, n, position, tokens))

    def pop(self) -> tuple[Any, int, dict[str, Any], list[Any]]:
        """The oldest batch on the device (the consumer's stream waits for its copy)."""
        out, event, n, position, tokens = self._queue.popleft()
        t = _perf()
        out = self.stage.finish(out, event)
        self._stats.add("h2d", _perf() - t)
        return out, n, position, tokens

    def close(self) -> None:
        """Drop the copies in flight."""
        self._queue.clear()
