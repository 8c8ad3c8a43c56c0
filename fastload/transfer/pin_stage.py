"""`PinStage`: the pin stage of an epoch, and the ledger of every buffer the consumer holds.

Contract: `pack(batch, token, source) -> (batch, tokens)` packs a CPU batch into a reused slot
of the `BufferRing` (page-locked when pinning) unless the batch source already did, and returns
the batch with the tokens of every buffer behind it (a ring slot, a worker process's
shared-memory slot); `hold(tokens)` records the buffers of a batch handed to the consumer;
`release_stale()`, called before the next batch is fetched, releases all held batches but the
newest (the consumer's loop variable still holds it); `release(tokens, fence)` hands buffers
back (a ring slot is rewritten only after `fence`, and a slot still referenced by the user is
retired, never overwritten); `close()` releases everything held. Consumer thread only; no resume state (buffers are not
part of a position).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from fastload.stats import LoaderStats
from fastload.transfer.ring import BufferRing
from fastload.transfer.side_stream import DeviceWideFence

__all__ = ["PinStage", "ring_post"]


class PinStage:
    """The epoch's reused-buffer ring (or none) and the buffers the consumer holds."""

    def __init__(self, ring: BufferRing | None, *, packed_by_source: bool, stats: LoaderStats) -> None:
        self.ring, self.packed_by_source, self._stats = ring, packed_by_source, stats
        self._held: deque[list[Any]] = deque()

    def pack(self, batch: Any, token: Any, source: Any) -> tuple[Any, list[Any]]:
        """`batch` in a ring slot (unless the source packed it) -> (batch, its buffers' tokens)."""
        tokens: list[Any] = []
        ring = self.ring
        if token is not None:
            tokens.append((ring if self.packed_by_source else source, token))
        if ring is not None and not self.packed_by_source:
            timings: dict[str, float] = {}
            batch, slot = ring.write(batch, timings)
            self._stats.add_many(timings)
            if slot is not None:
                tokens.append((ring, slot))
        return batch, tokens

    def hold(self, tokens: list[Any]) -> None:
        """The consumer now holds a batch backed by `tokens` (released by a later `release_stale`)."""
        self._held.append(tokens)

    def release_stale(self) -> None:
        """Release all held batches but the latest one (before the next is fetched)."""
        held = self._held
        while len(held) > 1:
            self.release(held.popleft())

    @staticmethod
    def release(tokens: list[Any], fence: Any = None) -> None:
        """Hand the buffers behind `tokens` back to their owners (a ring after `fence`)."""
        for owner, token in tokens:
            if isinstance(owner, BufferRing):
                if fence is None and owner.pin and owner.device_index is not None:
                    # pin_memory without `device`: the user may have queued non_blocking copies from
                    # this slot on any stream; it is rewritten only after all of them have run
                    fence = DeviceWideFence(owner.device_index)
                owner.release(token, fence)
            else:
                owner.release(token)

    def close(self) -> None:
        """Release every buffer still held, then close the ring (its memory goes back to torch's
        pinned allocator for the next epoch)."""
        while self._held:
            self.release(self._held.popleft())
        if self.ring is not None:
            self.ring.close()


def ring_post(ring: BufferRing) -> Callable[[Any, dict[str, float]], tuple[Any, Any]]:
    """What a worker thread runs after its fetch when the ring packs in the workers: `batch` into
    a slot -> (batch, slot), the copy timed as "pin" and the wait for a slot as "ring_wait" in the
    batch's timings."""

    def post(batch: Any, timings: dict[str, float]) -> tuple[Any, Any]:
        return ring.write(batch, timings)

    return post
