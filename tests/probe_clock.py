"""A deterministic clock for the autotune probe (`fastload.pipeline.ThreadProbe`).

`use_step_clock(monkeypatch)` makes every Loader built afterwards give its probe a clock that
advances a fixed step per reading (one reading per delivered batch, one per epoch start): the
probe's windows, rates and decisions then depend on batch counts only, never on how fast this
(shared) machine happens to run.
"""

from __future__ import annotations

from functools import partial

import fastload.loader
from fastload.pipeline import ThreadProbe

__all__ = ["StepClock", "use_step_clock"]


class StepClock:
    """A clock that moves `step` seconds forward each time it is read."""

    def __init__(self, step: float = 1e-3) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def use_step_clock(monkeypatch, step: float = 1e-3) -> StepClock:
    """Loaders built from now on (in this test) time their autotune probe with one `StepClock`."""
    clock = StepClock(step)
    monkeypatch.setattr(fastload.loader, "ThreadProbe", partial(ThreadProbe, clock=clock))
    return clock
