"""`EpochIterator`: one epoch's pipeline — dispatch indices, fetch, pin, H2D, yield in order.

Buffers are handed back two batches late: when the consumer asks for batch j+1 its loop
variable still holds batch j, so batch j-1's buffers are the ones released then (and a buffer
still referenced by the user is retired, never overwritten).

Thread workers are A/B-tested (`ThreadProbe`, one per Loader, its windows continued across
epochs): a window of batches with the consumer fetching itself, then one with the workers after
they have warmed up, timed as the consumer sees them (its own work included); when inline wins,
the workers are tried again later (after 0.25 s, then twice as long each time), so one
comparison spoiled by a noisy neighbour does not decide a whole run.
When fetching inline is faster — small GIL-light batches, where the thread hand-off costs more
than it overlaps — the loader continues inline, so adding workers does not lose to
`num_workers=0` once the windows are done (runs of a few tens of milliseconds end inside them).
When the consumer is busy (a training step) the workers win and stay.
Not done with a `timeout`, a `worker_init_fn` (they only mean something in a worker) or
`adaptive=False`.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from fastload.device import DeviceStage, DeviceWideFence
from fastload.pinned import BufferRing
from fastload.stats import LoaderStats
from fastload.workers import InlineSource, ThreadSource, WorkerError

__all__ = ["EpochIterator", "ThreadProbe"]

_perf = time.perf_counter


class EpochIterator:
    """Iterator over one epoch of batches; created by `Loader.__iter__`."""

    def __init__(
        self,
        loader: Any,
        *,
        order: Iterator[tuple[Any, dict[str, Any]]],
        source: Any,
        owns_source: bool,
        depth: int,
        ring: BufferRing | None,
        ring_in_source: bool,
        device: DeviceStage | None,
        prefetch: int,
        stats: LoaderStats,
        batched: bool,
        position: dict[str, Any] | None = None,
        probe: ThreadProbe | None = None,
        expected: int | None = None,
        gradient_state: Any = None,
    ) -> None:
        self._loader, self._order, self._source, self._owns_source = loader, order, source, owns_source
        self._depth, self._ring, self._ring_in_source = max(1, depth), ring, ring_in_source
        self._device, self._prefetch, self._stats, self._batched = device, max(1, prefetch), stats, batched
        self._inflight: deque[tuple[int, int, dict[str, Any]]] = deque()
        self._dev: deque[tuple[Any, Any, int, dict[str, Any], list[Any]]] = deque()
        self._held: deque[list[Any]] = deque()
        self._j = 0
        self._closed = False
        self._order_done = False
        self.position = position  # where the consumer is: the position of the last batch it received
        # batches still to deliver (None: unknown, the order's end decides); at 0 the epoch is complete
        self._left = expected
        self.complete = False  # the epoch's last batch was delivered (see `epoch_complete`)
        # Accelerate's hooks (see `fastload.frameworks`): set as the last batch is delivered
        self.end_of_dataloader, self.remainder = False, -1
        self._gradient_state = gradient_state
        if gradient_state is not None:
            gradient_state._add_dataloader(self)
        # one of three shapes, chosen once: no per-batch checks of which one applies
        if isinstance(source, InlineSource) and ring is None and device is None:
            # (functions, not bound methods: an attribute holding a bound method is a reference cycle,
            # and a deleted iterator must end its workers at once, not at the next garbage collection)
            self._step = EpochIterator._next_inline  # nothing in flight, nothing to release
        elif isinstance(source, ThreadSource) and ring is None and device is None:
            self._step = EpochIterator._next_adaptive  # the probe's inline mode as lean as `_next_inline`
        else:
            self._step = EpochIterator._next_host if device is None else EpochIterator._next_device
        self._full_depth = self._depth
        self.probe = probe if isinstance(source, ThreadSource) else None
        if self.probe is not None:
            self.probe.attach(self, _perf())

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        t0 = _perf()
        stats = self._stats
        stats.begin(t0)
        try:
            out, n, self.position = self._step(self)
        except StopIteration:
            self._finish()
            raise
        except Exception:
            # a batch's own error (the dataset, collate_fn, transform): raised for that batch, and the
            # iterator goes on with the next one, as torch's does; a dead, stuck or unstarted worker ends it
            if isinstance(self._source, (InlineSource, type(None))) or not (
                self._source.broken or isinstance(sys.exc_info()[1], WorkerError)
            ):
                raise
            self.close()
            self._loader._failed(self)
            raise
        except BaseException:
            self.close()
            self._loader._failed(self)
            raise
        left = self._left
        if left is not None:
            self._left = left = left - 1
            if left == 0:  # the epoch's last batch: the next iter() starts the next epoch
                self.epoch_complete()
        t1 = _perf()
        stats.delivered(n, t1 - t0, t1)
        probe = self.probe
        if probe is not None:
            probe.tick(self, t1)
        return out

    # ---- stages
    def _dispatch(self) -> None:
        inflight, put, batched = self._inflight, self._source.put, self._batched
        while not self._order_done and len(inflight) < self._depth:
            nxt = next(self._order, None)
            if nxt is None:
                self._order_done = True
                break
            indices, pos = nxt
            j = self._j
            self._j += 1
            put(j, indices)
            inflight.append((j, len(indices) if batched else 1, pos))

    def _next_cpu(self) -> tuple[Any, int, dict[str, Any], list[Any]] | None:
        inflight = self._inflight
        if len(inflight) < self._depth:
            self._dispatch()
        if inflight:
            j, n, pos = inflight.popleft()
            batch, timings, token = self._source.get(j)
        elif self._depth == 0 and not self._order_done:  # adaptive inline mode (thread source)
            nxt = next(self._order, None)
            if nxt is None:
                self._order_done = True
                return None
            indices, pos = nxt
            n = len(indices) if self._batched else 1
            batch, timings, token = self._source.run_inline(indices)
        else:
            return None
        self._stats.add_many(timings)
        tokens: list[Any] = []
        if token is not None:
            tokens.append((self._ring if self._ring_in_source else self._source, token))
        if self._ring is not None and not self._ring_in_source:
            t = _perf()
            batch, slot = self._ring.write(batch)
            self._stats.add("pin", _perf() - t)
            if slot is not None:
                tokens.append((self._ring, slot))
        if len(inflight) < self._depth:
            self._dispatch()  # keep workers busy while the consumer works
        return batch, n, pos, tokens

    def _next_inline(self) -> tuple[Any, int, dict[str, Any]]:
        """`num_workers=0` without a ring or a device: fetch straight from the order."""
        indices, pos = next(self._order)  # StopIteration ends the epoch
        batch, timings = self._source.fetch(indices)
        self._stats.add_many(timings)
        return batch, len(indices) if self._batched else 1, pos

    def _next_adaptive(self) -> tuple[Any, int, dict[str, Any]]:
        """Thread workers without a ring or a device (their batches hold no slots to release):
        while the probe fetches inline and nothing is in flight, a batch is fetched here with
        `fetch_alone`, nothing else; otherwise `_next_host`."""
        if self._depth or self._inflight:
            return self._next_host()
        indices, pos = next(self._order)  # StopIteration ends the epoch
        batch, timings = self._source.fetch_alone(indices)
        self._stats.add_many(timings)
        return batch, len(indices) if self._batched else 1, pos

    def _next_host(self) -> tuple[Any, int, dict[str, Any]]:
        """A CPU batch (no device stage); its buffers are released two batches later."""
        held = self._held
        while len(held) > 1:
            self._release(held.popleft())
        item = self._next_cpu()
        if item is None:
            raise StopIteration
        batch, n, pos, tokens = item
        held.append(tokens)
        return batch, n, pos

    def _next_device(self) -> tuple[Any, int, dict[str, Any]]:
        """A batch on the device, `prefetch` copies in flight on the side stream."""
        while len(self._held) > 1:
            self._release(self._held.popleft())
        while len(self._dev) < self._prefetch:
            item = self._next_cpu()
            if item is None:
                break
            batch, n, pos, tokens = item
            t = _perf()
            out, event = self._device.start(batch)
            del batch
            self._stats.add("h2d", _perf() - t)
            if self._device.device.type != "cpu":  # the copy no longer aliases the CPU buffers
                self._release(tokens, event)
                tokens = []
            self._dev.append((out, event, n, pos, tokens))
        if not self._dev:
            raise StopIteration
        out, event, n, pos, tokens = self._dev.popleft()
        t = _perf()
        out = self._device.finish(out, event)
        self._stats.add("h2d", _perf() - t)
        self._held.append(tokens)
        return out, n, pos

    def _release(self, tokens: list[Any], fence: Any = None) -> None:
        for owner, token in tokens:
            if isinstance(owner, BufferRing):
                if fence is None and owner.pin and owner.device_index is not None:
                    # pin_memory without `device`: the user may have queued non_blocking copies from
                    # this slot on any stream; it is rewritten only after all of them have run
                    fence = DeviceWideFence(owner.device_index)
                owner.release(token, fence)
            else:
                owner.release(token)

    # ---- shutdown
    def epoch_complete(self) -> None:
        """The epoch's last batch was delivered (or it has none left): the Loader moves on."""
        if not self.complete:
            self.complete = self.end_of_dataloader = True
            self._loader._epoch_done(self)

    def _finish(self) -> None:
        if not self._closed:
            self.epoch_complete()
        self.close()

    def close(self) -> None:
        """Stop this epoch: drop prefetched batches, shut down non-persistent workers."""
        if self._closed:
            return
        self._closed = True
        self._stats.end()
        self._inflight.clear()
        self._dev.clear()
        while self._held:
            self._release(self._held.popleft())
        if self._owns_source:
            self._source.close()
        self._source = None
        self._order = iter(())
        if self._gradient_state is not None:
            self._gradient_state._remove_dataloader(self)
            self._gradient_state = None
        self._loader._closed(self)

    def __del__(self) -> None:
        # no module globals here: at interpreter exit they may already be None
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001 - nothing to report to during interpreter shutdown
            pass


class ThreadProbe:
    """Inline vs threaded fetching, by the consumer-visible batch rate; one per Loader.

    The consumer fetches inline first, as `num_workers=0` would, and the workers are first tried
    after `FIRST_S` of it (and at least `WINDOW` batches and `MIN_WINDOW_S` of timed batches): a
    run shorter than that never starts them, so it reads as fast as with 0 workers. A trial
    takes the rate of the inline stretch before it, lets the workers fill their queue and warm up
    (`FILL` batches at least: so neither a backlog of ready batches nor the first slow batches
    after the switch decide), and times them for as long as `WINDOW` inline batches took (at
    least `MIN_WINDOW_S`; a third of it when they run `CLEAR_LOSS` slower).
    The workers are kept only if they beat inline by `MARGIN`, and are watched afterwards
    (windows of `WATCH` batches and `WATCH_S`): a later stretch slower than inline switches to
    inline. Inline is not final either: the workers are tried again after `RETRY_S` of it, then
    after twice as long each time (up to `RETRY_MAX_S`), against the rate of that inline stretch,
    so one noisy comparison on a shared machine does not fix the mode for the whole run. The
    probe lives as long as its Loader: a decision carries over to later epochs.

    A window goes on across epoch boundaries: epochs shorter than a window (a few milliseconds
    of small batches) still complete it over several epochs. The time between one epoch's last
    batch and the next epoch's start (the user's code) is left out; the next epoch's start, up
    to its first batch (its order, the workers' queue refilling), is counted: in the mode the
    epoch runs in, it is that mode's cost.

    Every path starts inline. A trial costs its run the slower mode's rate and the switches, and
    with the epoch plan inline reads as fast as the workers on the direct path, so the first trial
    waits `FIRST_S` of inline fetching: a short run never starts the workers.
    """

    WINDOW, MARGIN, WATCH, FILL = 24, 1.05, 64, 32
    MIN_WINDOW_S = 0.03  # a timed window also lasts this long: a hypervisor's ms-long stalls average out
    WATCH_S = 0.15  # and a watch window this long
    CLEAR_LOSS = 1.25  # threads this much slower after a third of the window: stop timing them
    FIRST_S = 0.25  # seconds of inline fetching before the workers' first trial
    RETRY_S, RETRY_MAX_S = 0.25, 64.0  # inline chosen: seconds until the workers are tried again (doubling)

    def __init__(self) -> None:
        self.phase = "inline"  # inline, fill (the workers warming up), threads (timed), watch (workers chosen)
        self.count = 0  # batches in the current window
        self.t0 = self.last = 0.0  # when the window's part in this epoch started; the last batch
        self.before = 0.0  # seconds of the window spent in earlier epochs
        self.rate_threads = self.rate_inline = 0.0
        self.inline_s = 0.0  # how long WINDOW inline batches took: the workers' window lasts as long
        self.choice = "inline"
        self.trials = 0  # times the workers were tried
        self.switches = 0  # mode changes after the probe (diagnostics)
        self.retries = 0  # times the workers were tried again after inline was chosen (diagnostics)
        self.retry_s = self.RETRY_S
        self.retry_at: float | None = None  # when the workers are tried (inline): set by the first epoch

    def attach(self, it: EpochIterator, now: float) -> None:
        """Start an epoch in the mode the probe has reached; the current window goes on."""
        if self.retry_at is None:  # the Loader's first epoch: the workers' first trial is due in FIRST_S
            self.retry_at = now + self.FIRST_S
            self._restart(now)
        self.before += self.last - self.t0
        self.t0 = self.last = now
        threads = self.phase != "inline"
        it._depth = it._full_depth if threads else 0

    def _restart(self, now: float) -> None:
        """A new window from `now`."""
        self.count, self.t0, self.last, self.before = 0, now, now, 0.0

    def tick(self, it: EpochIterator, now: float) -> None:
        self.count += 1
        self.last = now
        elapsed = self.before + now - self.t0
        if self.phase == "inline":
            due = self.retry_at is not None and now >= self.retry_at
            if due and self.count >= self.WINDOW and elapsed >= self.MIN_WINDOW_S:
                self.rate_inline = self.count / elapsed  # the inline stretch since the start or the decision
                self.inline_s = max(self.MIN_WINDOW_S, self.WINDOW / self.rate_inline)
                if self.trials:
                    self.retries += 1
                    self.retry_s = min(2 * self.retry_s, self.RETRY_MAX_S)
                self.trials += 1
                self.retry_at = float("inf")
                self.phase = "fill"
                self._restart(now)
                it._depth = it._full_depth
        elif self.phase == "fill":
            if self.count >= max(it._full_depth + 2, self.FILL):
                self.phase = "threads"
                self._restart(now)
        elif self.phase == "threads":
            clearly_losing = (  # cut a losing window short: probing costs the slower mode's rate
                elapsed >= self.inline_s / 3 and self.count < elapsed * self.rate_inline / self.CLEAR_LOSS
            )
            if elapsed >= self.inline_s or clearly_losing:  # as long as WINDOW inline batches took
                self.rate_threads = self.count / elapsed
                self._decide(it, now)
        elif self.phase == "watch" and self.count >= self.WATCH and elapsed >= self.WATCH_S:
            if self.count / elapsed * self.MARGIN < self.rate_inline:
                self._inline(it, now)
            else:
                self._restart(now)

    def _decide(self, it: EpochIterator, now: float) -> None:
        """Keep the workers (then watch them) if they beat inline by `MARGIN`, else go inline."""
        if self.rate_threads > self.rate_inline * self.MARGIN:
            self.choice, self.phase = "threads", "watch"
            self._restart(now)
            self.switches += 1
            it._depth = it._full_depth
        else:
            self._inline(it, now)

    def _inline(self, it: EpochIterator, now: float) -> None:
        self.switches += self.choice == "threads"
        self.choice, self.phase = "inline", "inline"
        self._restart(now)
        self.retry_at = now + self.retry_s
        it._depth = 0  # what is in flight drains first
