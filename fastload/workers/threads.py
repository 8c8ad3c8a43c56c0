"""Thread workers: a `ThreadPool` kept across epochs and the per-epoch `ThreadSource`.

Right for work that releases the GIL (numpy gathers, file reads, lmdb/h5py, JPEG decode);
results need no copy or pickling.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fastload.fetch.plan import PlanSlice
from fastload.system import usable_cores
from fastload.workers.base import Fetch, WorkerError, fetch_planned

__all__ = ["STEAL_MODES", "ThreadPool", "ThreadSource", "resolve_steal", "steal_rule"]

STEAL_MODES = ("auto", "always", "bounded", False)


def steal_rule(
    *, num_workers: int, cores: int, cuda: bool, timeout: float = 0, worker_init: bool = False
) -> str | bool:
    """What "auto" means: whether a waiting consumer fetches unstarted batches itself. Never with
    a `timeout` (a stolen batch could outlast it) or a `worker_init` (the consumer's thread never
    ran it), nor when the workers fill every core (a consumer fetching too only contends);
    "bounded" when CUDA is available (the consumer goes back to launching GPU work), else "always"."""
    if timeout or worker_init or num_workers >= cores:
        return False
    return "bounded" if cuda else "always"


def resolve_steal(steal: bool | str, *, num_workers: int, timeout: float = 0) -> str | bool:
    """The `ThreadSource` steal mode that `steal` means here: "always", "bounded" or False."""
    if steal not in STEAL_MODES:
        raise ValueError(f"steal must be one of {STEAL_MODES}, got {steal!r}")
    if timeout or not steal:
        return False  # a stolen batch could outlast `timeout`
    if steal == "auto":
        return steal_rule(num_workers=num_workers, cores=usable_cores(), cuda=torch.cuda.is_available())
    return steal


class _Shared:
    """What a `ThreadPool` shares with its worker threads (they hold no reference to the pool,
    so dropping the pool stops them); lives as long as the threads, across epochs."""

    def __init__(self) -> None:
        # batches nobody has started, in order: (j, indices, plan slice, epoch)
        self.todo: deque[tuple[int, Any, PlanSlice | None, _EpochWork]] = deque()
        self.wake: queue.SimpleQueue[bool | None] = queue.SimpleQueue()  # one token per batch put; None: exit
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()  # batches finished while the consumer waited
        self.waiting = False  # the consumer is (about to be) blocked on `ready`
        self.init_error: BaseException | None = None


class _EpochWork:
    """One `ThreadSource`'s (one epoch's) fetch and results; every queued batch carries its own, so
    a worker finishing a batch of an epoch already closed stores it where nobody looks."""

    MEAN_WEIGHT = 0.2  # of the newest fetch in the running mean

    def __init__(
        self,
        fetch: Fetch,
        post: Callable[[Any, dict[str, float]], tuple[Any, Any]] | None,
        timed: bool,
        fetch_alone: Fetch | None = None,
    ) -> None:
        self.fetch, self.post, self.timed = fetch, post, timed
        self.fetch_alone = fetch_alone or fetch
        self.mean_fetch: float | None = None  # running mean of fetch seconds (`timed` only)
        self.done: dict[int, tuple[Any, BaseException | None]] = {}  # finished by a worker, not yet taken
        self.started: dict[int, float] = {}  # batch -> when a worker started it ("bounded" mode only)

    def work(
        self, indices: Any, planned: PlanSlice | None, j: int | None = None, *, alone: bool = False
    ) -> tuple[Any, dict[str, float], Any]:
        """Fetch one batch (batch `j` of the epoch when a worker runs it) and `post` it; `alone`:
        no worker is fetching meanwhile (`fetch_alone` may use every core)."""
        if self.timed:
            t0 = time.perf_counter()
            if j is not None:
                self.started[j] = t0
        batch, timings = fetch_planned(self.fetch_alone if alone else self.fetch, indices, planned)
        token = None
        if self.post is not None:
            batch, token = self.post(batch, timings)
        if self.timed:
            dt = time.perf_counter() - t0
            mean = self.mean_fetch  # a racy update between threads only blurs the mean a little
            self.mean_fetch = dt if mean is None else mean + self.MEAN_WEIGHT * (dt - mean)
        return batch, timings, token


def _thread_worker(shared: _Shared, wid: int, init: Callable[[int], None] | None) -> None:
    """A worker thread: take the earliest unstarted batch per wake-up token, fetch it, report it."""
    if init is not None:
        try:
            init(wid)
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer by its next get()
            shared.init_error = exc
            shared.ready.put(-1)
            return
    todo, wake, ready = shared.todo, shared.wake, shared.ready
    while wake.get() is not None:
        try:
            j, indices, planned, epoch = todo.popleft()
        except IndexError:  # the consumer took that batch itself
            continue
        try:
            epoch.done[j] = (epoch.work(indices, planned, j), None)
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer when batch j's turn comes
            epoch.done[j] = (None, exc)
        del indices, planned, epoch  # an idle worker keeps no epoch alive (its fetcher, dataset, tensors)
        if shared.waiting:  # only then: a consumer that never waits must not fill the queue
            ready.put(j)


class ThreadPool:
    """`num_workers` worker threads (started on first use) and their hand-over queues.

    A Loader keeps one across epochs, so an epoch starts without starting threads;
    `ThreadSource`s use it one at a time. Dropping or closing the pool stops the threads after
    the fetch they are in."""

    def __init__(self, num_workers: int, *, init: Callable[[int], None] | None = None) -> None:
        self.num_workers = num_workers
        self.pid = os.getpid()  # a forked child has none of these threads: it needs a pool of its own
        self.shared = shared = _Shared()
        self._unstarted = [
            threading.Thread(target=_thread_worker, args=(shared, wid, init), name=f"fastload-{wid}", daemon=True)
            for wid in range(num_workers)
        ]
        self._finalizer = weakref.finalize(self, _stop_threads, shared, num_workers)
        _live_pools.add(self)

    def start(self) -> None:
        """Start the threads if they are not running yet (a source's first batch put does this: an
        epoch that autotune runs inline starts none)."""
        for t in self._unstarted:
            t.start()
            _started_threads.add(t)
        self._unstarted = []

    def idle(self) -> None:
        """Forget the closed epoch's unstarted batches and the wake-up tokens left for them (a token
        per batch put, also for the batches the consumer took itself: left over, they would wake
        the workers for nothing)."""
        shared = self.shared
        shared.todo.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                if shared.wake.get_nowait() is None:  # the pool is being stopped: keep the stop
                    shared.wake.put(None)
                    break

    @property
    def started(self) -> bool:
        """Whether the threads were started (by a source's first batch)."""
        return not self._unstarted

    @property
    def usable(self) -> bool:
        """Not closed, and in the process that started it (not a forked copy)."""
        return self._finalizer.alive and self.pid == os.getpid()

    @property
    def closed(self) -> bool:
        """Whether the pool was stopped."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the threads (each after the fetch it is in)."""
        self._finalizer()


_live_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()
_started_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
EXIT_WAIT_S = 2.0  # at interpreter exit: how long to wait for the worker threads of all pools


@atexit.register
def _stop_pools_at_exit() -> None:
    """At exit, while the interpreter is whole: stop every pool's threads and wait for all worker
    threads still running (also those of pools collected earlier, which may still be on their way
    out). A thread that ends during finalization instead, releasing the GIL on its way out (freeing
    a tensor does), is killed by Python inside torch's C++ code, and the process aborts
    ("terminate called without an active exception"). Registered after torch's import, so it
    runs before torch's handlers."""
    for pool in list(_live_pools):
        pool.close()
    deadline = time.monotonic() + EXIT_WAIT_S
    for t in list(_started_threads):
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


class ThreadSource:
    """Fetch on worker threads (a `ThreadPool`); `post` (e.g. packing into the pinned ring) runs there too.

    The hand-over is lean on purpose (it runs once per batch on both sides): `put` appends the
    batch to a deque of unstarted batches and drops a token into a `SimpleQueue` that wakes one
    worker; a worker pops the earliest unstarted batch, stores the result (or the exception) under
    the batch number and, if the consumer is waiting, reports the number on a second `SimpleQueue`
    that the consumer blocks on.
    No futures, no executor bookkeeping.

    While the consumer waits for batch j it does not sit idle: it fetches the earliest later batch
    that no worker has started yet and keeps the result for its turn (work stealing); a batch that
    no worker has started when its turn comes is fetched by the consumer too. On a machine with
    few cores the consumer's thread is one more gatherer instead of a sleeper, and the order of
    batches, their contents and the errors raised are unchanged.

    `steal`: "always" (whenever the consumer would wait), "bounded" (only while batch j is expected
    to take at least `STEAL_MIN_REMAINING` of a mean fetch longer, or is far overdue: a consumer
    whose batch is nearly done takes it and goes back to launching its GPU step instead of being
    held up by a whole fetch while the GPU runs dry), "auto" (False when the workers are at least
    as many as the usable cores, else "bounded" when CUDA is available, else "always") or False
    (every batch is fetched by a worker; the Loader passes it when a `worker_init_fn` prepares
    the worker threads, which the consumer's thread never ran). Never with a `timeout` (a stolen
    batch could outlast it).

    `pool`: worker threads to use (kept by the caller, e.g. across epochs; `num_workers` and `init`
    are then the pool's); by default the source starts its own and stops them on `close()`.
    """

    STEAL_MIN_REMAINING = 0.75  # of the mean fetch time
    STEAL_OVERDUE = 2.0  # mean fetch times

    inline = False
    adaptive = True

    def __init__(
        self,
        fetch: Fetch,
        num_workers: int,
        *,
        timeout: float = 0,
        post: Callable[[Any, dict[str, float]], tuple[Any, Any]] | None = None,
        init: Callable[[int], None] | None = None,
        steal: bool | str = "auto",
        fetch_alone: Fetch | None = None,
        pool: ThreadPool | None = None,
    ) -> None:
        self.timeout = timeout
        self._own_pool = pool is None
        self.pool = pool = pool if pool is not None else ThreadPool(num_workers, init=init)
        self.num_threads = pool.num_workers
        self.steal = resolve_steal(steal, num_workers=self.num_threads, timeout=timeout)
        self._shared = pool.shared
        # only the "bounded" mode needs fetch start times and their mean
        self._epoch = epoch = _EpochWork(fetch, post, timed=self.steal == "bounded", fetch_alone=fetch_alone)
        self._work = epoch.work
        self._pool_started = False  # the first batch put starts the pool: an epoch autotune runs inline starts none
        self.stolen = 0  # batches the consumer fetched while waiting (diagnostics)

    def put(self, j: int, indices: Any, planned: PlanSlice | None = None) -> None:
        """Queue batch j for the workers (starting them on the first batch)."""
        if not self._pool_started:
            self.pool.start()
            self._pool_started = True
        self._shared.todo.append((j, indices, planned, self._epoch))
        self._shared.wake.put(True)

    def fetch_alone(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float]]:
        """Fetch one batch in the caller while no batch is in flight (`fetch_alone` of the fetcher)."""
        return fetch_planned(self._epoch.fetch_alone, indices, planned)

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        """Batch j: taken when a worker finished it, else stolen/fetched here or waited for."""
        epoch = self._epoch
        done = epoch.done
        if j not in done:
            fetched = self._fetch_or_wait(j)
            if fetched is not None:
                return fetched
        if epoch.timed:
            epoch.started.pop(j, None)
        result, error = done.pop(j)
        if error is not None:
            raise error
        return result

    def _fetch_or_wait(self, j: int) -> tuple[Any, dict[str, float], Any] | None:
        """Until batch j is in `done`: steal later batches (or fetch j itself, returned) or wait."""
        shared, epoch = self._shared, self._epoch
        done, todo = epoch.done, shared.todo
        deadline = time.monotonic() + self.timeout if self.timeout else None
        while j not in done:
            if shared.init_error is not None:
                raise shared.init_error
            if self.steal and todo:
                try:
                    k, indices, planned, _ = todo.popleft()
                except IndexError:  # a worker took it meanwhile
                    continue
                if k == j:  # no worker has started batch j: fetch it here instead of waiting
                    return self._work(indices, planned)
                if self._worth_stealing(j):
                    self.stolen += 1
                    try:
                        done[k] = (self._work(indices, planned), None)
                    except Exception as exc:  # noqa: BLE001 - raised when batch k's turn comes, in order
                        done[k] = (None, exc)
                    continue
                todo.appendleft((k, indices, planned, epoch))  # batch j is nearly done: leave k to the workers
                shared.wake.put(True)
            self._wait_ready(j, deadline)
        return None

    def _wait_ready(self, j: int, deadline: float | None) -> None:
        """Block until a worker reports a finished batch (or fails to start), unless batch j is done.

        Workers report only while `waiting` is set: the flag goes up before `done` is checked, and
        a worker stores its result before it reads the flag, so a result is either seen here or
        reported. Reports left from earlier waits are drained first (at most one per worker).
        """
        shared = self._shared
        ready = shared.ready
        shared.waiting = True
        try:
            while not ready.empty():  # only this thread takes from `ready`
                ready.get_nowait()
            if j in self._epoch.done or shared.init_error is not None:
                return
            if deadline is None:
                ready.get()
            else:
                ready.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise WorkerError(f"DataLoader timed out after {self.timeout} seconds") from None
        finally:
            shared.waiting = False

    def _worth_stealing(self, j: int) -> bool:
        """Whether batch j (running on a worker) should take long enough to fetch another meanwhile:
        it started less than 1 - STEAL_MIN_REMAINING mean fetches ago, or it is far overdue (over
        `STEAL_OVERDUE` means: stuck on something slow, so its end cannot be predicted)."""
        epoch = self._epoch
        if not epoch.timed:
            return True
        mean, started = epoch.mean_fetch, epoch.started.get(j)
        if mean is None or started is None:
            return True
        elapsed = time.perf_counter() - started
        return elapsed <= (1.0 - self.STEAL_MIN_REMAINING) * mean or elapsed >= self.STEAL_OVERDUE * mean

    @property
    def finished(self) -> int:
        """Batches the workers finished that the consumer has not taken yet."""
        return len(self._epoch.done)

    @property
    def reports_waiting(self) -> int:
        """Finished-batch reports queued for a waiting consumer (at most one per worker)."""
        return self._shared.ready.qsize()

    @property
    def broken(self) -> bool:
        """A worker failed to start (its `worker_init_fn` raised): no later batch can come."""
        return self._shared.init_error is not None

    def run_inline(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float], Any]:
        """Fetch in the calling thread (autotune's inline mode: no batch is in flight then, so it
        runs `fetch_alone`), posted as a worker's batch is."""
        return self._work(indices, planned, alone=True)

    def release(self, token: Any) -> None:
        """Nothing to release: a ring slot's token goes to the ring (`PinStage`)."""

    def close(self) -> None:
        """Drop unstarted and finished batches; the source's own workers exit after the fetch they
        are in (a pool passed in is left running, idle, for the next source)."""
        self._epoch.done.clear()
        self._epoch.started.clear()
        if self._own_pool:
            self.pool.close()
        else:
            self.pool.idle()


def _stop_threads(shared: _Shared, num_workers: int) -> None:
    shared.todo.clear()
    for _ in range(num_workers):
        shared.wake.put(None)
