"""`ThreadProbe`: opt-in autotuning (`Loader(autotune=True)`) of thread workers against inline fetching.

The probe times the consumer-visible batch rate with the consumer fetching itself (as
`num_workers=0` would) and with the workers, and keeps the faster. It never writes into the
epoch's fields: `attach` and `tick` return whether the workers should fetch, and the epoch sets
its own in-flight depth from that. Every decision is recorded in `decisions` with the rates
behind it (shown by `Loader.describe()` and `Loader.stats()`).

Rules (the class constants):

* The consumer fetches inline first; the workers are first tried after `FIRST_S` of it (and at
  least `WINDOW` batches and `MIN_WINDOW_S` of timed batches).
* A trial takes the rate of the inline stretch before it, lets the workers fill their queue and
  warm up (`FILL` batches, at least depth + 2), and times them for as long as `WINDOW` inline
  batches took (at least `MIN_WINDOW_S`; a third of it when they run `CLEAR_LOSS` slower).
* The workers are kept only if they beat inline by `MARGIN`, and are watched afterwards
  (windows of `WATCH` batches and `WATCH_S`): a stretch slower than inline switches to inline.
* Inline is not final: the workers are tried again after `RETRY_S` of it, then after twice as
  long each time (up to `RETRY_MAX_S`), against the rate of that inline stretch.
* The probe lives as long as its Loader; a window goes on across epoch boundaries, leaving out
  the time between one epoch's last batch and the next epoch's start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ThreadProbe"]


class ThreadProbe:
    """Inline vs threaded fetching, by the consumer-visible batch rate; one per Loader."""

    WINDOW, MARGIN, WATCH, FILL = 24, 1.05, 64, 32
    MIN_WINDOW_S = 0.03  # a timed window also lasts this long: a hypervisor's ms-long stalls average out
    WATCH_S = 0.15  # and a watch window this long
    CLEAR_LOSS = 1.25  # threads this much slower after a third of the window: stop timing them
    FIRST_S = 0.25  # seconds of inline fetching before the workers' first trial
    RETRY_S, RETRY_MAX_S = 0.25, 64.0  # inline chosen: seconds until the workers are tried again (doubling)
    MAX_DECISIONS = 64  # the newest decisions kept for `describe()`

    def __init__(self, *, depth: int, clock: Callable[[], float] | None = None) -> None:
        self.depth = depth  # the epoch's in-flight batches with the workers on
        # None: time by the `now` the epoch passes; a clock: read it instead (deterministic tests)
        self.clock = clock
        self.phase = "inline"  # inline, fill (the workers warming up), threads (timed), watch (workers chosen)
        self.count = 0  # batches in the current window
        self.t0 = self.last = 0.0  # when the window's part in this epoch started; the last batch
        self.before = 0.0  # seconds of the window spent in earlier epochs
        self.rate_threads = self.rate_inline = 0.0
        self.inline_s = 0.0  # how long WINDOW inline batches took: the workers' window lasts as long
        self.choice = "inline"
        self.trials = 0  # times the workers were tried
        self.switches = 0  # mode changes after the probe
        self.retries = 0  # times the workers were tried again after inline was chosen
        self.retry_s = self.RETRY_S
        self.retry_at: float | None = None  # when the workers are tried (inline): set by the first epoch
        self.batches = 0  # batches seen, over all epochs
        self.decisions: list[dict[str, Any]] = []

    @property
    def workers_on(self) -> bool:
        """Whether the workers fetch in the current phase."""
        return self.phase != "inline"

    def attach(self, now: float) -> bool:
        """An epoch starts in the mode the probe has reached (the current window goes on);
        returns whether the workers fetch."""
        now = now if self.clock is None else self.clock()
        if self.retry_at is None:  # the Loader's first epoch: the workers' first trial is due in FIRST_S
            self.retry_at = now + self.FIRST_S
            self._restart(now)
        self.before += self.last - self.t0
        self.t0 = self.last = now
        return self.workers_on

    def _restart(self, now: float) -> None:
        """A new window from `now`."""
        self.count, self.t0, self.last, self.before = 0, now, now, 0.0

    def tick(self, now: float) -> bool:
        """A batch was delivered at `now`; returns whether the workers fetch from here on."""
        now = now if self.clock is None else self.clock()
        self.count += 1
        self.batches += 1
        self.last = now
        elapsed = self.before + now - self.t0
        if self.phase == "inline":
            due = self.retry_at is not None and now >= self.retry_at
            if due and self.count >= self.WINDOW and elapsed >= self.MIN_WINDOW_S:
                self._trial(now, elapsed)
        elif self.phase == "fill":
            if self.count >= max(self.depth + 2, self.FILL):
                self.phase = "threads"
                self._restart(now)
        elif self.phase == "threads":
            clearly_losing = (  # cut a losing window short: probing costs the slower mode's rate
                elapsed >= self.inline_s / 3 and self.count < elapsed * self.rate_inline / self.CLEAR_LOSS
            )
            if elapsed >= self.inline_s or clearly_losing:  # as long as WINDOW inline batches took
                self.rate_threads = self.count / elapsed
                self._decide(now)
        elif self.phase == "watch" and self.count >= self.WATCH and elapsed >= self.WATCH_S:
            rate = self.count / elapsed
            if rate * self.MARGIN < self.rate_inline:
                self.rate_threads = rate
                self._inline(now, "watch: workers fell below inline")
            else:
                self._restart(now)
        return self.workers_on

    def _trial(self, now: float, elapsed: float) -> None:
        """Time the inline stretch so far and start the workers' trial."""
        self.rate_inline = self.count / elapsed  # the inline stretch since the start or the decision
        self.inline_s = max(self.MIN_WINDOW_S, self.WINDOW / self.rate_inline)
        if self.trials:
            self.retries += 1
            self.retry_s = min(2 * self.retry_s, self.RETRY_MAX_S)
        self.trials += 1
        self.retry_at = float("inf")
        self.phase = "fill"
        self._restart(now)

    def _decide(self, now: float) -> None:
        """Keep the workers (then watch them) if they beat inline by `MARGIN`, else go inline."""
        if self.rate_threads > self.rate_inline * self.MARGIN:
            self.choice, self.phase = "threads", "watch"
            self._restart(now)
            self.switches += 1
            self._record("trial: workers faster by the margin")
        else:
            self._inline(now, "trial: workers not faster by the margin")

    def _inline(self, now: float, reason: str) -> None:
        self.switches += self.choice == "threads"
        self.choice, self.phase = "inline", "inline"
        self._restart(now)
        self.retry_at = now + self.retry_s
        self._record(reason)

    def _record(self, reason: str) -> None:
        self.decisions.append(
            {
                "batch": self.batches,
                "choice": self.choice,
                "reason": reason,
                "inline_batches_per_s": round(self.rate_inline, 1),
                "threads_batches_per_s": round(self.rate_threads, 1),
                "margin": self.MARGIN,
            }
        )
        del self.decisions[: -self.MAX_DECISIONS]

    def report(self) -> dict[str, Any]:
        """The probe's state and decisions, for `describe()` / `stats()`."""
        return {
            "choice": self.choice,
            "phase": self.phase,
            "trials": self.trials,
            "switches": self.switches,
            "decisions": list(self.decisions),
        }
