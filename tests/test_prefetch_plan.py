"""`PrefetchPlan` (`fastload.remote.plan`): its threads follow the plan, and a change in the plan wakes
only as many of them as can start a prefetch, not every thread for every acquire and release."""

from __future__ import annotations

import threading
import time

import pytest

from fastload.remote.first_batch import FirstBatchHold
from fastload.remote.get_window import GetWindow
from fastload.remote.plan import CONSUMED_POLL_S, PrefetchPlan
from fastload.remote.transfer_stats import TransferStats

THREADS = 16


class CountingHold(FirstBatchHold):
    """A hold that is never on and counts the looks at it: each prefetch thread looks once per wake-up."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0
        self._count_lock = threading.Lock()

    def remaining(self) -> float:
        with self._count_lock:
            self.looks += 1
        return super().remaining()


class MemoryCache:
    """The part of `ShardCache` a plan uses; a prefetch completes at once and is recorded."""

    def __init__(self) -> None:
        self.transfer = TransferStats()
        self.prefetched: list[str] = []
        self.lock = threading.Lock()

    def prefetch(self, key: str, **_: object) -> bool:
        with self.lock:
            self.prefetched.append(key)
        return True

    def pinned_keys(self) -> dict[str, int]:
        return {}

    def soft_keys(self) -> set[str]:
        with self.lock:
            return set(self.prefetched)

    def unsoft(self, keys: list[str] | None = None) -> None:
        pass


class Shards:
    """The storage side of a plan (its `fetch` and `key_of` are held weakly: keep this object alive)."""

    def fetch(self, name: str, sink: object) -> None:
        raise AssertionError("MemoryCache.prefetch never downloads")

    def key_of(self, name: str, size: int, xxh3: str) -> str:
        return name


def _wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def plan(monkeypatch):
    from fastload.remote import plan as plan_module

    # threads other than the poller sleep until woken: their timeouts (a burst of them on a slow machine)
    # are not what these tests count or wait for
    monkeypatch.setattr(plan_module, "IDLE_WAIT_S", 60.0)
    cache, shards, hold = MemoryCache(), Shards(), CountingHold()
    p = PrefetchPlan(cache=cache, fetch=shards.fetch, key_of=shards.key_of, url="mem://ds", threads=THREADS,
                     depth=2, window=GetWindow(ceiling=THREADS, adaptive=False), hold=hold)
    p.shards = shards  # type: ignore[attr-defined]  (alive as long as the plan)
    yield p, cache, hold
    p.close(timeout=5)


def test_acquires_and_releases_that_open_no_room_wake_no_thread(plan):
    p, cache, hold = plan
    known = {n: (1, "0" * 16) for n in "abcd"}
    p.replace(list("abcd"), known)
    _wait_for(lambda: len(cache.prefetched) == 2)  # depth 2: two shards ahead, the threads wait
    time.sleep(0.05)
    assert sorted(cache.prefetched) == ["a", "b"]  # by two threads at once
    looks = hold.looks
    t0 = time.monotonic()
    for _ in range(50):
        p.released("z")  # a release of a shard not in the plan: nothing can start
        time.sleep(0.002)  # time for woken threads to look
    time.sleep(0.05)
    elapsed = time.monotonic() - t0
    # at most the poller's timed looks (one per CONSUMED_POLL_S) and a few more; waking all 16 threads
    # on every release looked thousands of times
    assert hold.looks - looks <= 5 + 2 * elapsed / CONSUMED_POLL_S
    p.acquired("a", "a", 1, "0" * 16)  # room for one more: one thread starts it
    _wait_for(lambda: len(cache.prefetched) == 3)
    assert cache.prefetched[2] == "c"
    p.acquired("b", "b", 1, "0" * 16)
    _wait_for(lambda: len(cache.prefetched) == 4)
    assert cache.prefetched[3] == "d"


def test_close_ends_every_thread_at_once(plan):
    p, cache, _ = plan
    before = set(threading.enumerate())
    p.replace(["a"], {"a": (1, "0" * 16)})
    _wait_for(lambda: cache.prefetched == ["a"])
    threads = [t for t in set(threading.enumerate()) - before if t.name == "fastload-prefetch"]
    assert len(threads) == THREADS
    t0 = time.monotonic()
    p.close(timeout=5)
    for t in threads:
        t.join(timeout=5)
    assert time.monotonic() - t0 < 5.0  # threads asleep for up to IDLE_WAIT_S (60 s here) are woken to end
    assert not any(t.is_alive() for t in threads)
