"""`PrefetchPlan`: which shards a `RemoteStorage` fetches ahead of its reader, and the threads that do it.

Prefetches of shards read while they arrive (`blocks_of`) are verified by block, so a reader can
start on a shard a prefetch thread is still downloading.

The plan is the upcoming shard order (handed over by a sampler, or read-ahead in manifest order).
Prefetch threads take plan entries in order and fetch them into the `ShardCache` as soft-pinned
entries, keeping at most `depth` shards fetched-but-not-acquired or in flight, and at most
`GetWindow.target` GETs in flight (a reader's own fetch counts as one). Acquiring a shard takes
it off the plan; a plan entry already acquired is skipped.

Waiting threads are woken only as many as can start a prefetch now (`_wake`): a reader's every
acquire and release changes the plan, and waking every thread for each costs a context switch and a
look under the lock per thread. One waiting thread at a time (the poller) also wakes every
`CONSUMED_POLL_S` to look for prefetched shards used elsewhere; the others sleep up to `IDLE_WAIT_S`.

One object per storage and process; every field changes under `lock`. The threads hold the
storage's `fetch` and `key_of` weakly: a storage dropped without `close` is collected, and its
finalizer (`stop`) ends them.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from fastload.remote.cache.shard_cache import BlockSpec, Download, ShardCache
from fastload.remote.first_batch import FirstBatchHold
from fastload.remote.get_window import GetWindow

__all__ = ["CONSUMED_POLL_S", "DemandSlot", "PrefetchPlan"]

CONSUMED_POLL_S = 0.1  # while prefetched shards wait, how often the threads (together) look for ones used elsewhere
IDLE_WAIT_S = 1.0  # the longest a prefetch thread other than the poller sleeps between looks at the plan

log = logging.getLogger("fastload.remote.storage")


class DemandSlot:
    """One reader acquire counted as a GET in flight (`PrefetchPlan.expect_demand`); `count(delta, wake)`
    is its plan's counter of readers' GETs."""

    def __init__(self, count: Callable[[int, bool], None]) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._state = "expected"  # -> "fetching" (its fetch holds it) -> "ended"; or -> "ended" (no fetch)

    @contextmanager
    def fetching(self) -> Iterator[None]:
        """The acquire's own fetch runs in the block: the slot stays counted until it ends (counted anew
        when the acquire already gave it up)."""
        with self._lock:
            if self._state == "ended":
                self._count(1, False)
            self._state = "fetching"
        try:
            yield
        finally:
            with self._lock:
                self._state = "ended"
            self._count(-1, True)

    def done(self) -> None:
        """The acquire returned: give the slot up unless its fetch holds it. No wake-up: when the fetch is
        about to start in another thread, prefetch threads see the room at their next look instead."""
        with self._lock:
            if self._state != "expected":
                return
            self._state = "ended"
        self._count(-1, False)


class PrefetchPlan:
    """Plan and prefetch threads for one storage: `fetch(name, sink)` downloads a shard, `key_of`
    names its cache entry, `url` prefixes shard names in messages."""

    def __init__(
        self,
        *,
        cache: ShardCache,
        fetch: Callable[[str, Download], None],
        key_of: Callable[[str, int, str], str],
        url: str,
        threads: int,
        depth: int,
        window: GetWindow,
        blocks_of: Callable[[str, int], BlockSpec | None] | None = None,
        hold: FirstBatchHold | None = None,
    ) -> None:
        self.cache, self.url = cache, url
        self.hold = FirstBatchHold() if hold is None else hold
        self.hold.on_release(self.wake)
        self._fetch_ref, self._key_ref = weakref.WeakMethod(fetch), weakref.WeakMethod(key_of)
        self._blocks_ref = None if blocks_of is None else weakref.WeakMethod(blocks_of)
        self.threads, self.depth, self.window = threads, depth, window
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self.keys: dict[str, str] = {}  # name -> cache key of every shard seen
        self._sizes: dict[str, tuple[int, str]] = {}
        self._plan: deque[str] = deque()
        self._plan_pos: dict[str, int] = {}
        self._ready: set[str] = set()  # prefetched, not acquired yet (soft pinned)
        self._inflight: set[str] = set()
        self._taken: set[str] = set()  # plan entries acquired since the plan was set
        self._demand = 0  # fetches run by readers themselves (GETs in flight beside the prefetches)
        self._polled = float("-inf")  # when a thread last looked for prefetched shards consumed elsewhere
        self._poller: int | None = None  # the waiting thread that wakes every CONSUMED_POLL_S
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()

    def following(self, name: str) -> bool:
        """Whether `name` is in the current plan."""
        with self.lock:
            return name in self._plan_pos

    def replace(self, names: list[str], known: dict[str, tuple[int, str]]) -> None:
        """Make `names` (those in `known`: name -> (size, xxh3)) the plan; shards this process
        has pinned are skipped, prefetched shards no longer planned lose their soft pins."""
        pinned = self.cache.pinned_keys()  # mapped by this process's reader already: nothing to fetch
        with self.lock:
            order: list[str] = []
            seen: set[str] = set()
            for n in names:
                if self.keys.get(n) in pinned or n in seen or n not in known:
                    continue
                seen.add(n)
                order.append(n)
            self._sizes.update({n: known[n] for n in order})
            stale = [n for n in self._ready if n not in seen]
            self._ready -= set(stale)
            self._plan = deque(order)
            self._plan_pos = {n: i for i, n in enumerate(order)}
            self._taken = set()
            self._start_threads()
            self._wake()
            stale_keys = [self.keys[n] for n in stale if n in self.keys]
        if stale_keys:
            self.cache.unsoft(stale_keys)

    def acquired(self, name: str, key: str, size: int, xxh3: str) -> None:
        """The reader acquires `name`: it is no longer ahead.

        Plan entries before it stay: a batch acquires the shards it touches in shard-id order, not in
        first-use order, so acquiring the last shard of a window does not mean the window's other
        shards were skipped (treating them as skipped left them to one demand fetch after another).
        """
        with self.lock:
            self.keys[name] = key
            self._sizes[name] = (size, xxh3)
            self._ready.discard(name)
            if name in self._plan_pos:
                self._taken.add(name)
                while self._plan and self._plan[0] in self._taken:
                    self._plan.popleft()
            self._wake()

    def released(self, name: str) -> str | None:
        """The reader released `name`: its cache key (None if never acquired); wakes waiting threads."""
        with self.lock:
            self._wake()
            return self.keys.get(name)

    @property
    def demand_in_flight(self) -> int:
        """Readers' acquires counted as GETs in flight now (`expect_demand`)."""
        with self.lock:
            return self._demand

    def expect_demand(self) -> DemandSlot:
        """Count a reader's acquire as a GET in flight from now (before its fetch, if any, starts in another
        thread, so that prefetch threads woken meanwhile do not take its place): the fetch takes the slot
        over (`DemandSlot.fetching`); the acquire gives it up when no fetch of its own took it (`done`)."""
        self._count_demand(1, False)
        return DemandSlot(self._count_demand)

    def _count_demand(self, delta: int, wake: bool) -> None:
        with self.lock:
            self._demand += delta
            if wake:
                self._wake()

    def wake(self) -> None:
        """Wake the prefetch threads to look at the plan again (a first batch's hold was released)."""
        with self.lock:
            self._wake()

    def finished(self) -> None:
        """One GET finished: feed `window` the bytes received so far (wakes the threads if it resized)."""
        before = self.window.target
        if self.window.finished(now=time.perf_counter(), received=self.cache.transfer.received()) != before:
            with self.lock:
                self._wake()

    def stop(self) -> None:
        """Tell the prefetch threads to end (each after its current fetch); does not wait for them."""
        self._stop.set()
        with self.lock:
            self._plan.clear()
            self._wake()

    def close(self, timeout: float = 10.0) -> None:
        """`stop`, then wait up to `timeout` for each prefetch thread, and up to `timeout` for the
        readers' own fetches still running (a shard read while it arrives downloads on a thread of its own)."""
        self.stop()
        with self.lock:
            workers = list(self._workers)
        for t in workers:
            t.join(timeout=timeout)
        deadline = time.monotonic() + timeout
        with self.lock:
            while self._demand and time.monotonic() < deadline:
                self._cond.wait(timeout=0.1)

    # -- threads --------------------------------------------------------------------------------
    def _start_threads(self) -> None:
        self._workers = [t for t in self._workers if t.is_alive()]
        while len(self._workers) < self.threads:
            t = threading.Thread(target=self._loop, name="fastload-prefetch", daemon=True)
            t.start()
            self._workers.append(t)

    def _startable(self) -> int:
        """How many prefetches could start now (under `lock`): room in the GET window and in `depth`,
        shards left in the plan; the first batch's hold is the woken threads' own look."""
        window = self.window.target - len(self._inflight) - self._demand
        depth = self.depth - len(self._ready) - len(self._inflight)
        return max(0, min(window, depth, len(self._plan)))

    def _wake(self) -> None:
        """Wake as many waiting threads as `_startable` says (under `lock`); all of them once stopped
        (`close` waits for the readers' fetches on the same condition)."""
        if self._stop.is_set():
            self._cond.notify_all()
            return
        n = self._startable()
        if n:
            self._cond.notify(n)

    def _next_job(self) -> str | None:
        me = threading.get_ident()
        while not self._stop.is_set():
            held = self.hold.remaining()
            with self.lock:
                room = not held and len(self._inflight) + self._demand < self.window.target
                if room and self._plan and len(self._ready) + len(self._inflight) < self.depth:
                    name = self._plan.popleft()
                    if name in self._ready or name in self._inflight or name in self._taken:
                        continue
                    self._inflight.add(name)
                    return name
                if self._poller is None:
                    self._poller = me
                poller = self._poller == me
                timeout = CONSUMED_POLL_S if poller else IDLE_WAIT_S
                self._cond.wait(timeout=min(held, timeout) if held else timeout)
                if poller:
                    self._poller = None  # the next thread to wait takes the role over
                now = time.monotonic()
                # one look at the shared state per interval for all threads: a look reads (and
                # rewrites) the cache's state under its lock
                poll = bool(self._plan) and bool(self._ready) and now - self._polled >= CONSUMED_POLL_S
                if poll:
                    self._polled = now
            if poll:
                self._forget_consumed()
        return None

    def _forget_consumed(self) -> None:
        """Prefetched shards another process (a loader worker) acquired, or that were evicted, are not ahead now."""
        soft = self.cache.soft_keys()
        with self.lock:
            gone = {n for n in self._ready if self.keys.get(n) not in soft}
            if gone:
                self._ready -= gone
                self._wake()

    def _loop(self) -> None:
        while (name := self._next_job()) is not None:
            if not self._prefetch_one(name):
                return

    def _prefetch_one(self, name: str) -> bool:
        """Prefetch `name`; False when the storage is gone (strong references live only in this call)."""
        fetch, key_of = self._fetch_ref(), self._key_ref()
        blocks_of = None if self._blocks_ref is None else self._blocks_ref()
        if fetch is None or key_of is None:
            self._done(name, True)
            return False
        with self.lock:
            size, xxh3 = self._sizes[name]
            key = self.keys.setdefault(name, key_of(name, size, xxh3))
        ok = False
        try:
            blocks = None if blocks_of is None else blocks_of(name, size)
            ok = self.cache.prefetch(key, size=size, xxh3=xxh3, fetch=partial(fetch, name), where=f"{self.url}/{name}",
                                     blocks=blocks)
        except Exception as exc:  # noqa: BLE001 - a hint only; the demand fetch reports errors
            log.warning("prefetch of %s/%s failed: %r", self.url, name, exc)
            ok = True  # do not retry it in a loop; acquire will fetch and raise
        finally:
            self._done(name, ok)
        return True

    def _done(self, name: str, ok: bool) -> None:
        with self.lock:
            self._inflight.discard(name)
            if ok and name in self._plan_pos:
                self.cache.transfer.add("prefetched", 1)
                if name not in self._taken:  # else acquired while this thread fetched or waited for it
                    self._ready.add(name)
            elif not ok and name in self._plan_pos and name not in self._taken:
                self._plan.appendleft(name)  # no room now: try again after a release
                self._cond.wait(timeout=0.2)
            self._wake()
