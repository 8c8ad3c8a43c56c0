"""`FirstBatchHold`: while a cold epoch's first batch is pending, a storage starts no GET it does not need.

At an epoch's start the reader needs a few blocks now (its first batch) and the rest of the shards
later. GETs share the link and, on a fast link, the cores that receive them, so every GET started
beside the first batch's delays it: the prefetch of the next shards, and the extra ranged parts of a
large shard (`PARTS_IN_FLIGHT`). While the hold is on, prefetch threads start no shard and a shard's
download runs one GET (from the shard's start) instead of one per part; the reader's own GETs for the
blocks it waits for run as always, and so does every GET already under way. The hold ends when the
dataset says the batch was served (`release`) or `limit_s` after it began, whichever comes first: a
reader that never asks (or fails) cannot stall the downloads for longer than that.

A first batch that wants `bulk_bytes` or more through GETs of its own (`wanted`) ends the hold too
(a shuffled batch over large shards: a block or a few from each of hundreds of places): its own
GETs then share the link and the cores with one another anyway, and holding the downloads back only
takes their parallelism away from the epoch without bringing the batch sooner. So does one that
leaves its blocks to the downloads (`Arrival.on_follow`, `AHEAD_MOST`): it waits for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["FIRST_BATCH_BULK_BYTES", "FIRST_BATCH_HOLD_S", "FirstBatchHold"]

FIRST_BATCH_HOLD_S = 0.25  # the longest a first batch holds the other GETs back
FIRST_BATCH_BULK_BYTES = 16 << 20  # a first batch that wants this much through its own GETs holds nothing back


class FirstBatchHold:
    """On from `begin()` until `release()`, `limit_s` (default `FIRST_BATCH_HOLD_S`) later, or until
    the batch has `wanted` `bulk_bytes` (default `FIRST_BATCH_BULK_BYTES`); `wait()` blocks while it is on."""

    def __init__(self, limit_s: float | None = None, bulk_bytes: int | None = None) -> None:
        self.limit_s = float(FIRST_BATCH_HOLD_S if limit_s is None else limit_s)
        self.bulk_bytes = int(FIRST_BATCH_BULK_BYTES if bulk_bytes is None else bulk_bytes)
        self._cond = threading.Condition()
        self._until = 0.0  # monotonic time the hold ends by itself (0: off)
        self._wanted = 0  # bytes the pending batch asked for through GETs of its own (`wanted`)
        self._listeners: list[Callable[[], None]] = []

    def begin(self) -> None:
        """A first batch is pending: hold other GETs back for at most `limit_s` from now."""
        with self._cond:
            self._until = time.monotonic() + self.limit_s
            self._wanted = 0

    def wanted(self, nbytes: int) -> None:
        """Readers asked for `nbytes` more through GETs of their own (the pending batch's, or blocks no
        download GET holds that another read waits for): once they have asked for `bulk_bytes` in all
        while the hold is on, it ends (`release`). Nothing while the hold is off."""
        with self._cond:
            if not self._left():
                return
            self._wanted += int(nbytes)
            if self._wanted < self.bulk_bytes:
                return
        self.release()

    def release(self) -> None:
        """The first batch was served: GETs held back start now."""
        with self._cond:
            if not self._until:
                return
            self._until = 0.0
            self._cond.notify_all()
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def on_release(self, wake: Callable[[], None]) -> None:
        """Call `wake` (no lock held) when a hold is released early, e.g. to wake threads that wait
        on a condition of their own and look at `remaining` (a hold that runs out needs no call: their
        waits are bounded by `remaining`)."""
        with self._cond:
            self._listeners.append(wake)

    def remaining(self) -> float:
        """Seconds the hold still lasts (0.0 when it is off)."""
        with self._cond:
            return self._left()

    def _left(self) -> float:
        if not self._until:
            return 0.0
        left = self._until - time.monotonic()
        if left <= 0:
            self._until = 0.0
            return 0.0
        return left

    def wait(self) -> None:
        """Return once the hold is off (released, or run out)."""
        with self._cond:
            while (left := self._left()) > 0:
                self._cond.wait(left)
