"""`EpochIterator`: one epoch's pipeline: order -> fetch (batch source) -> pin -> device, in order.

Buffers are handed back two batches late: when the consumer asks for batch j+1 its loop
variable still holds batch j, so batch j-1's buffers are the ones released then (and a buffer
still referenced by the user is retired, never overwritten).

The iterator holds no reference to its Loader: it reports to the `EpochHooks` it is given
(epoch complete, closed, failed) and owns its in-flight depth; an opt-in autotuner
(`ThreadProbe`) only returns whether the workers should fetch.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastload.order.record import BatchRecord
from fastload.pipeline.autotune import ThreadProbe
from fastload.stats import LoaderStats
from fastload.transfer.device_queue import DeviceQueue
from fastload.transfer.pin_stage import PinStage
from fastload.transfer.ring import BufferRing
from fastload.workers import BatchSource, WorkerError

__all__ = ["EpochHooks", "EpochIterator", "EpochStages"]

_perf = time.perf_counter


@dataclass(frozen=True)
class EpochHooks:
    """What an epoch reports to its owner (the Loader), called in the consumer's thread:
    `length()` batches of the epoch; `complete(it)` its last batch was delivered; `closed(it)`
    it stopped (its `position` is final); `failed(it)` a worker broke (persistent workers are
    to be replaced)."""

    length: Callable[[], int]
    complete: Callable[[Any], None]
    closed: Callable[[Any], None]
    failed: Callable[[Any], None]


@dataclass(frozen=True)
class EpochStages:
    """One epoch's stage objects: `order` (an iterator of `BatchRecord`), `source` (the fetch
    stage, a `BatchSource`; closed with the epoch when `owns_source`), `pin`, `device` (None:
    batches stay on the host) and `probe` (opt-in autotune; used with an `adaptive` source only)."""

    order: Iterator[BatchRecord]
    source: BatchSource
    owns_source: bool
    pin: PinStage
    device: DeviceQueue | None = None
    probe: ThreadProbe | None = None


class EpochIterator:
    """Iterator over one epoch of batches; created by `Loader.__iter__`."""

    def __init__(
        self,
        hooks: EpochHooks,
        stages: EpochStages,
        *,
        depth: int,
        stats: LoaderStats,
        batched: bool,
        position: dict[str, Any] | None = None,
        expected: int | None = None,
        gradient_state: Any = None,
    ) -> None:
        order, source, owns_source = stages.order, stages.source, stages.owns_source
        pin, device, probe = stages.pin, stages.device, stages.probe
        self._hooks, self._order, self._owns_source = hooks, order, owns_source
        self._source: BatchSource | None = source
        self._depth, self._pin, self._device = max(1, depth), pin, device
        self._stats, self._batched = stats, batched
        self._inflight: deque[tuple[int, int, dict[str, Any]]] = deque()  # (batch number, samples, position)
        self._j = 0
        self._closed = False
        self._order_done = False
        self._deferred: Exception | None = None  # a refill's error, raised by the next `_next_cpu`
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
        lean = pin.ring is None and device is None
        if source.inline and lean:
            # (functions, not bound methods: an attribute holding a bound method is a reference cycle,
            # and a deleted iterator must end its workers at once, not at the next garbage collection)
            self._step = EpochIterator._next_inline  # nothing in flight, nothing to release
        elif source.adaptive and lean:
            self._step = EpochIterator._next_adaptive  # the probe's inline mode as lean as `_next_inline`
        else:
            self._step = EpochIterator._next_host if device is None else EpochIterator._next_device
        self._full_depth = self._depth
        self.probe = probe if source.adaptive else None
        if self.probe is not None:
            self._depth = self._full_depth if self.probe.attach(_perf()) else 0

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return self._hooks.length()

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
            source = self._source
            if source is None or source.inline or not (source.broken or isinstance(sys.exc_info()[1], WorkerError)):
                raise
            self.close()
            self._hooks.failed(self)
            raise
        except BaseException:
            self.close()
            self._hooks.failed(self)
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
            self._depth = self._full_depth if probe.tick(t1) else 0  # inline: what is in flight drains first
        return out

    # ---- stages
    @property
    def depth(self) -> int:
        """Batches kept in flight now (0 while the autotune probe has the consumer fetch alone)."""
        return self._depth

    @property
    def source(self) -> BatchSource | None:
        """The epoch's fetch stage (None once the epoch is closed)."""
        return self._source

    @property
    def ring(self) -> BufferRing | None:
        """The pinned-buffer ring batches are packed into (None: batches keep their own memory)."""
        return self._pin.ring

    def _dispatch(self) -> None:
        assert self._source is not None
        inflight, put, batched = self._inflight, self._source.put, self._batched
        while not self._order_done and len(inflight) < self._depth:
            rec = next(self._order, None)
            if rec is None:
                self._order_done = True
                break
            indices = rec.indices
            j = self._j
            self._j += 1
            put(j, indices, rec.plan)
            inflight.append((j, len(indices) if batched else 1, rec.position))

    def _next_cpu(self, *, refill: bool = True) -> tuple[Any, int, dict[str, Any], list[Any]] | None:
        """The next CPU batch, packed. `refill=False`: fetches are dispatched only when none is in
        flight (the caller refills once its own work is done)."""
        if self._deferred is not None:
            exc, self._deferred = self._deferred, None
            raise exc
        inflight, source = self._inflight, self._source
        assert source is not None
        if len(inflight) < self._depth and (refill or not inflight):
            self._dispatch()
        if inflight:
            j, n, pos = inflight.popleft()
            batch, timings, token = source.get(j)
        elif self._depth == 0 and not self._order_done:  # the probe's inline mode (an adaptive source)
            rec = next(self._order, None)
            if rec is None:
                self._order_done = True
                return None
            indices, pos = rec.indices, rec.position
            n = len(indices) if self._batched else 1
            batch, timings, token = source.run_inline(indices, rec.plan)
        else:
            return None
        self._stats.add_many(timings)
        batch, tokens = self._pin.pack(batch, token, source)
        if refill:
            self._refill()  # keep workers busy while the consumer works
        return batch, n, pos, tokens

    def _refill(self) -> None:
        """Hand the workers fetches up to the depth once this call's batch is taken. An error in doing
        so (the sampler's) is raised by the next `_next_cpu` call instead, so that batch is delivered."""
        if len(self._inflight) < self._depth:
            try:
                self._dispatch()
            except Exception as exc:  # noqa: BLE001 - raised by the next call, after this batch
                self._deferred = exc

    def _next_inline(self) -> tuple[Any, int, dict[str, Any]]:
        """`num_workers=0` without a ring or a device: fetch straight from the order."""
        indices, pos, planned = next(self._order)  # StopIteration ends the epoch
        batch, timings = self._source.fetch_alone(indices, planned)  # type: ignore[union-attr]
        self._stats.add_many(timings)
        return batch, len(indices) if self._batched else 1, pos

    def _next_adaptive(self) -> tuple[Any, int, dict[str, Any]]:
        """Thread workers without a ring or a device (their batches hold no slots to release):
        while the probe fetches inline and nothing is in flight, a batch is fetched here with
        `fetch_alone`, nothing else; otherwise `_next_host`."""
        if self._depth or self._inflight:
            return self._next_host()
        indices, pos, planned = next(self._order)  # StopIteration ends the epoch
        batch, timings = self._source.fetch_alone(indices, planned)  # type: ignore[union-attr]
        self._stats.add_many(timings)
        return batch, len(indices) if self._batched else 1, pos

    def _next_host(self) -> tuple[Any, int, dict[str, Any]]:
        """A CPU batch (no device stage); its buffers are released two batches later."""
        self._pin.release_stale()
        item = self._next_cpu()
        if item is None:
            raise StopIteration
        batch, n, pos, tokens = item
        self._pin.hold(tokens)
        return batch, n, pos

    def _next_device(self) -> tuple[Any, int, dict[str, Any]]:
        """A batch on the device, `prefetch` copies in flight on the side stream.

        The workers are handed new fetches last: a worker woken earlier can take the GIL whenever a
        copy's issue releases it, while the GPU idles until this call returns (bench/RESULTS.md ## GPU,
        `overlap`)."""
        self._pin.release_stale()
        device = self._device
        while not device.full:
            item = self._next_cpu(refill=False)
            if item is None:
                break
            device.push(*item)
        if not len(device):
            raise StopIteration
        out, n, pos, tokens = device.pop()
        self._pin.hold(tokens)
        self._refill()
        return out, n, pos

    # ---- shutdown
    def epoch_complete(self) -> None:
        """The epoch's last batch was delivered (or it has none left): the Loader moves on."""
        if not self.complete:
            self.complete = self.end_of_dataloader = True
            self._hooks.complete(self)

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
        if self._device is not None:
            self._device.close()
        self._pin.close()
        if self._owns_source and self._source is not None:
            self._source.close()
        self._source = None
        self._order = iter(())
        if self._gradient_state is not None:
            self._gradient_state._remove_dataloader(self)
            self._gradient_state = None
        self._hooks.closed(self)

    def __del__(self) -> None:
        # no module globals here: at interpreter exit they may already be None
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001 - nothing to report to during interpreter shutdown
            pass
