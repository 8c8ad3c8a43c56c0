"""Per-stage loader timings: where the time goes, and whether training is input-bound."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["STAGES", "WAITS", "LoaderStats"]

STAGES = ("read", "transform", "collate", "pin", "h2d")
# Time a stage spent waiting, not working: `ring_wait`, packing waiting for a free ring slot (the
# batches packed ahead not yet consumed, or their copies still running): back-pressure, not a cost.
WAITS = ("ring_wait",)


class LoaderStats:
    """Accumulators behind `Loader.stats()`, written by the consumer thread only.

    Stage seconds are summed over all workers (CPU-seconds; with N workers they can exceed
    wall time). `wait` is the time the consumer spent inside `next()` waiting for a batch,
    `wall` the time iterators were active (first `next()` to the last batch handed out).
    The per-batch updates take no lock (one writer; the stage keys are fixed, so a reader in
    another thread never sees the dict change size): they run once per batch on the consumer's
    thread, whose every microsecond with the GIL held slows the workers on a small machine.
    `snapshot` and `reset` lock against each other.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter (stage times, waits, batch counts)."""
        with self._lock:
            self.stage = dict.fromkeys(STAGES + WAITS, 0.0)
            self.wait = 0.0
            self.wall_closed = 0.0
            self.batches = 0
            self.samples = 0
            self._span_start: float | None = None
            self._span_last: float | None = None

    def add(self, stage: str, seconds: float) -> None:
        """Add `seconds` to one of `STAGES` or `WAITS` (consumer thread only)."""
        self.stage[stage] += seconds

    def add_many(self, timings: dict[str, float]) -> None:
        """Add a batch's `{stage: seconds}` (keys from `STAGES` and `WAITS`; consumer thread only)."""
        stage = self.stage
        for k, v in timings.items():
            stage[k] += v

    def begin(self, now: float) -> None:
        """Start a wall-time span (an iterator's first `next()`); consumer thread only."""
        if self._span_start is None:
            self._span_start = self._span_last = now

    def delivered(self, samples: int, waited: float, now: float) -> None:
        """The consumer received one batch of `samples` after waiting `waited` seconds.

        Consumer-thread only, so no lock: these counters have a single writer.
        """
        self.batches += 1
        self.samples += samples
        self.wait += waited
        self._span_last = now

    def end(self) -> None:
        """Close the current span (iterator exhausted or closed)."""
        with self._lock:
            if self._span_start is not None and self._span_last is not None:
                self.wall_closed += self._span_last - self._span_start
            self._span_start = self._span_last = None

    def snapshot(self, extra: Iterable[Any] = (), **info: Any) -> dict[str, Any]:
        """The `Loader.stats()` dict; `extra` objects with a `stats()` method get merged in."""
        with self._lock:
            wall = self.wall_closed
            if self._span_start is not None and self._span_last is not None:
                wall += self._span_last - self._span_start
            out: dict[str, Any] = {f"{k}_s": v for k, v in dict(self.stage).items()}
            out.update(
                wait_s=self.wait,
                wall_s=wall,
                batches=self.batches,
                samples=self.samples,
                batches_per_s=self.batches / wall if wall > 0 else 0.0,
                samples_per_s=self.samples / wall if wall > 0 else 0.0,
                data_stall=min(1.0, self.wait / wall) if wall > 0 else 0.0,
            )
        out.update(info)
        for obj in extra:
            fn = getattr(obj, "stats", None)
            if callable(fn):
                for k, v in dict(fn()).items():
                    out.setdefault(k, v)
        return out
