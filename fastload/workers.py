"""Batch sources: in-process, thread workers, process workers with shared-memory slots.

All three take `put(j, indices)` (batch j of the epoch) and hand batches back in order with
`get(j) -> (batch, timings, token)`; `release(token)` returns the batch's buffer for reuse.

* `InlineSource` (`num_workers=0`): fetch synchronously in the caller, like torch.
* `ThreadSource`: worker threads. Right for work that releases the GIL (numpy gathers, file
  reads, lmdb/h5py, JPEG decode); results need no copy or pickling.
* `ProcessSource`: worker processes (torch's default start method, or `multiprocessing_context`)
  for Python-heavy `__getitem__`s. Batch j goes to worker `j % num_workers` (as in torch), which
  runs it with torch-identical seeding and `torch.utils.data.get_worker_info()`. A worker packs
  the batch's tensors into one of its reused shared-memory slots (created by the worker on first
  use — sized from the batch, grown if a later batch is bigger — and sent to the main process
  once, as a file descriptor via torch's sharing, its name already unlinked so nothing can be
  left in /dev/shm); per batch only the layout and any non-tensor leaves (str, bytes, objects —
  the pickling fallback) cross the queue. The main process yields views of the slot and
  gives the slot back to the worker once nothing references it any more.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import queue
import random
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import worker as torch_worker

from fastload.collate import flatten, leaf_nbytes, pack_into, unflatten, views_from
from fastload.pinned import referenced_beyond, storage_refs
from fastload.system import usable_cores

__all__ = ["STEAL_MODES", "InlineSource", "ProcessSource", "ThreadPool", "ThreadSource", "WorkerError", "resolve_steal"]

_POLL = 0.1
STEAL_MODES = ("auto", "always", "bounded", False)


def resolve_steal(steal: bool | str, *, num_workers: int, timeout: float = 0) -> str | bool:
    """The `ThreadSource` steal mode that `steal` means here: "always", "bounded" or False."""
    if steal not in STEAL_MODES:
        raise ValueError(f"steal must be one of {STEAL_MODES}, got {steal!r}")
    if timeout or not steal:
        return False  # a stolen batch could outlast `timeout`
    if steal == "auto":
        if num_workers >= usable_cores():
            return False  # the workers already fill every core: a consumer fetching too only contends
        return "bounded" if torch.cuda.is_available() else "always"
    return steal


class WorkerError(RuntimeError):
    """A worker died or timed out."""


class InlineSource:
    """Fetch in the calling thread (`num_workers=0`)."""

    def __init__(self, fetch: Callable[[Any], tuple[Any, dict[str, float]]]) -> None:
        self.fetch = fetch
        self._todo: dict[int, Any] = {}

    def put(self, j: int, indices: Any) -> None:
        self._todo[j] = indices

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        batch, timings = self.fetch(self._todo.pop(j))
        return batch, timings, None

    def release(self, token: Any) -> None:
        pass

    def close(self) -> None:
        self._todo.clear()


class _Shared:
    """What a `ThreadPool` shares with its worker threads (they hold no reference to the pool,
    so dropping the pool stops them); lives as long as the threads, across epochs."""

    def __init__(self) -> None:
        self.todo: deque[tuple[int, Any, _EpochWork]] = deque()  # batches nobody has started, in order
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
        fetch: Callable[[Any], tuple[Any, dict[str, float]]],
        post: Callable[[Any, dict[str, float]], tuple[Any, Any]] | None,
        timed: bool,
        fetch_alone: Callable[[Any], tuple[Any, dict[str, float]]] | None = None,
    ) -> None:
        self.fetch, self.post, self.timed = fetch, post, timed
        self.fetch_alone = fetch_alone or fetch
        self.mean_fetch: float | None = None  # running mean of fetch seconds (`timed` only)
        self.done: dict[int, tuple[Any, BaseException | None]] = {}  # finished by a worker, not yet taken
        self.started: dict[int, float] = {}  # batch -> when a worker started it ("bounded" mode only)

    def work(self, indices: Any, j: int | None = None, *, alone: bool = False) -> tuple[Any, dict[str, float], Any]:
        """Fetch one batch (batch `j` of the epoch when a worker runs it) and `post` it; `alone`:
        no worker is fetching meanwhile (`fetch_alone` may use every core)."""
        if self.timed:
            t0 = time.perf_counter()
            if j is not None:
                self.started[j] = t0
        batch, timings = (self.fetch_alone if alone else self.fetch)(indices)
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
            j, indices, epoch = todo.popleft()
        except IndexError:  # the consumer took that batch itself
            continue
        try:
            epoch.done[j] = (epoch.work(indices, j), None)
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer when batch j's turn comes
            epoch.done[j] = (None, exc)
        del indices, epoch  # an idle worker keeps no epoch alive (its fetcher, dataset, tensors)
        if shared.waiting:  # only then: a consumer that never waits must not fill the queue
            ready.put(j)


class ThreadPool:
    """`num_workers` worker threads (started on first use) and their hand-over queues.

    A Loader keeps one across epochs, so an epoch starts without starting threads (and a probe
    comparing inline and threaded fetching over short epochs does not time thread start-ups);
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
        """Start the threads if they are not running yet (the first batch put does this: an epoch
        that the probe runs inline starts none)."""
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
    def usable(self) -> bool:
        """Not closed, and in the process that started it (not a forked copy)."""
        return self._finalizer.alive and self.pid == os.getpid()

    @property
    def closed(self) -> bool:
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
    ("terminate called without an active exception": seen in scratch runs with Loaders left to
    the garbage collector). Registered after torch's import, so it runs before torch's handlers."""
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

    def __init__(
        self,
        fetch: Callable[[Any], tuple[Any, dict[str, float]]],
        num_workers: int,
        *,
        timeout: float = 0,
        post: Callable[[Any, dict[str, float]], tuple[Any, Any]] | None = None,
        init: Callable[[int], None] | None = None,
        steal: bool | str = "auto",
        fetch_alone: Callable[[Any], tuple[Any, dict[str, float]]] | None = None,
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
        self.fetch_alone = epoch.fetch_alone  # for a caller fetching while no batch is in flight
        self.stolen = 0  # batches the consumer fetched while waiting (diagnostics)

    def put(self, j: int, indices: Any) -> None:
        if self.pool._unstarted:  # started by the first batch: an epoch the probe runs inline starts none
            self.pool.start()
        self._shared.todo.append((j, indices, self._epoch))
        self._shared.wake.put(True)

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
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
                    k, indices, _ = todo.popleft()
                except IndexError:  # a worker took it meanwhile
                    continue
                if k == j:  # no worker has started batch j: fetch it here instead of waiting
                    return self._work(indices)
                if self._worth_stealing(j):
                    self.stolen += 1
                    try:
                        done[k] = (self._work(indices), None)
                    except Exception as exc:  # noqa: BLE001 - raised when batch k's turn comes, in order
                        done[k] = (None, exc)
                    continue
                todo.appendleft((k, indices, epoch))  # batch j is nearly done: leave k to the workers
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
    def broken(self) -> bool:
        """A worker failed to start (its `worker_init_fn` raised): no later batch can come."""
        return self._shared.init_error is not None

    def run_inline(self, indices: Any) -> tuple[Any, dict[str, float], Any]:
        """Fetch in the calling thread (the pipeline's adaptive inline mode: no batch is in flight
        then, so it runs `fetch_alone`)."""
        return self._work(indices, alone=True)

    def release(self, token: Any) -> None:
        pass

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


# ---------------------------------------------------------------- process workers
PARENT_POLL_S = 0.5  # how often a worker process checks that its parent still runs


def _process_start(pid: int) -> float | None:
    """When process `pid` started (None if it does not run, or is a zombie; -1.0 if it runs but
    cannot be inspected)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:
        return -1.0


def _parent_alive(parent_pid: int, parent_start: float | None) -> bool:
    """Whether the process that started the workers still runs: it is our parent (fork, spawn), or
    (forkserver: the server is our parent) a process with its pid and start time exists."""
    if os.getppid() == parent_pid:
        return True
    return parent_start is not None and _process_start(parent_pid) == parent_start


def _watch_parent(parent_pid: int, parent_start: float | None) -> None:
    """A worker's watchdog thread: ends the worker process within `PARENT_POLL_S` once its parent is
    gone (SIGKILLed, crashed), also while the worker's main thread is inside a long transform."""
    while _parent_alive(parent_pid, parent_start):
        time.sleep(PARENT_POLL_S)
    os._exit(1)  # nothing to flush: batches go to a parent that no longer exists


def _worker_main(
    wid: int,
    num_workers: int,
    fetch: Any,
    task_q: Any,
    result_q: Any,
    base_seed: int,
    init_fn: Callable[[int], None] | None,
    parent_pid: int,
) -> None:
    """Worker process loop: tasks `(gen, j, indices, slot_id, retired_ids)` or None to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns Ctrl-C and shuts us down
    parent_start = _process_start(parent_pid)
    threading.Thread(
        target=_watch_parent, args=(parent_pid, parent_start), name="fastload-watchdog", daemon=True
    ).start()
    torch.set_num_threads(1)
    seed = base_seed + wid
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(base_seed, wid))
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=wid, num_workers=num_workers, seed=seed, dataset=getattr(fetch, "dataset", None)
    )
    try:
        if init_fn is not None:
            init_fn(wid)
    except Exception:  # noqa: BLE001 - shipped to the main process and re-raised there
        # flushed before exit (the queue's feeder thread is joined), so the parent reads this error
        # rather than seeing a worker that exited with code 0
        result_q.put((-1, -1, wid, -1, None, ExceptionWrapper(where=f"in DataLoader worker process {wid}"), None))
        return
    result_q.cancel_join_thread()  # from here on, exiting never waits on a parent that stopped reading
    slots: dict[int, torch.Tensor] = {}
    while True:
        try:
            task = task_q.get(timeout=1.0)
        except queue.Empty:
            if not _parent_alive(parent_pid, parent_start):
                return
            continue
        if task is None:
            return
        gen, j, indices, sid, retired = task
        for r in retired:
            slots.pop(r, None)
        try:
            batch, timings = fetch(indices)
            t0 = time.perf_counter()
            leaves, spec = flatten(batch)
            need = leaf_nbytes(leaves)
            buf, new = slots.get(sid), None
            if buf is None or buf.numel() < need:
                buf = new = torch.empty(max(64, need * 9 // 8), dtype=torch.uint8).share_memory_()
                slots[sid] = buf
            _, layout = pack_into(buf, leaves)
            del batch, leaves
            timings["collate"] = timings.get("collate", 0.0) + time.perf_counter() - t0
            result_q.put((gen, j, wid, sid, new, (spec, layout), timings))
        except Exception:  # noqa: BLE001 - shipped to the main process and re-raised there
            err = ExceptionWrapper(where=f"in DataLoader worker process {wid}")
            result_q.put((gen, j, wid, sid, None, err, None))


def _shutdown(procs: list[Any], task_qs: list[Any], result_q: Any) -> None:
    for q in task_qs:
        with contextlib.suppress(OSError, ValueError):
            q.put(None)
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():  # pragma: no cover - ignores SIGTERM
            p.kill()
            p.join(1.0)
    for q in (*task_qs, result_q):
        q.cancel_join_thread()
        q.close()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal: {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessSource:
    """Worker processes returning batches through reused shared-memory slots."""

    def __init__(
        self,
        fetch: Any,
        num_workers: int,
        *,
        base_seed: int,
        worker_init_fn: Callable[[int], None] | None = None,
        mp_context: Any = None,
        timeout: float = 0,
    ) -> None:
        ctx = mp_context if mp_context is not None else multiprocessing.get_context()
        self.num_workers, self.timeout = num_workers, timeout
        self.result_q = ctx.Queue()
        self.task_qs = [ctx.Queue() for _ in range(num_workers)]
        for q in self.task_qs:
            # the parent never waits at exit to flush tasks into a full pipe that no worker reads any
            # more (pytorch issue 48666: a script raising while it holds an iterator would never exit)
            q.cancel_join_thread()
        self.broken = False  # a worker's `worker_init_fn` raised
        self.procs = []
        for wid in range(num_workers):
            p = ctx.Process(
                target=_worker_main,
                args=(
                    wid,
                    num_workers,
                    fetch,
                    self.task_qs[wid],
                    self.result_q,
                    base_seed,
                    worker_init_fn,
                    os.getpid(),
                ),
                daemon=True,
                name=f"fastload-worker-{wid}",
            )
            p.start()
            self.procs.append(p)
        self.gen = 0
        self._slots: dict[tuple[int, int], tuple[torch.Tensor, int | None]] = {}
        self._free: list[deque[int]] = [deque() for _ in range(num_workers)]
        self._next_sid = [0] * num_workers
        self._retired: list[list[int]] = [[] for _ in range(num_workers)]
        self._ready: dict[int, Any] = {}
        self._owner: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.task_qs, self.result_q)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def new_epoch(self) -> None:
        """Forget batches of an abandoned epoch (their results are dropped on arrival)."""
        self.gen += 1
        for msg in self._ready.values():
            self._free[msg[2]].append(msg[3])
        self._ready.clear()
        self._owner.clear()

    def put(self, j: int, indices: Any) -> None:
        w = j % self.num_workers
        if self._free[w]:
            sid = self._free[w].popleft()
        else:
            sid = self._next_sid[w]
            self._next_sid[w] += 1
        retired, self._retired[w] = self._retired[w], []
        self._owner[j] = w
        self.task_qs[w].put((self.gen, j, indices, sid, retired))

    def _receive(self, deadline: float | None) -> None:
        try:
            msg = self.result_q.get(timeout=_POLL)
        except (ConnectionError, EOFError) as exc:
            # A worker killed while handing over a batch (its shared-memory handle can no longer be
            # fetched from it): report the dead worker, not the broken pipe.
            grace = time.monotonic() + 1.0
            while all(p.is_alive() for p in self.procs) and time.monotonic() < grace:
                time.sleep(0.01)
            self._check_alive()
            raise WorkerError(f"DataLoader lost a batch from a worker: {exc}") from exc
        except queue.Empty:
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"DataLoader timed out after {self.timeout} seconds") from None
            return
        self._accept(msg)

    def _accept(self, msg: tuple[Any, ...]) -> None:
        """A worker's message: a batch (kept until its turn), a stale batch (slot freed), or its
        `worker_init_fn`'s error (raised)."""
        gen, j, w, sid, new, payload, _ = msg
        if gen == -1:  # worker_init_fn failed
            self.broken = True
            payload.reraise()
        if new is not None:
            self._slots[(w, sid)] = (new, storage_refs(new))
        if gen != self.gen:
            self._free[w].append(sid)
            return
        self._ready[j] = msg

    def _check_alive(self) -> None:
        dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
        if dead:
            self._raise_init_error()  # a worker that exited after reporting its worker_init_fn's error
            what = ", ".join(f"worker {i} (pid {p.pid}, {_describe_exit(p.exitcode)})" for i, p in dead)
            raise WorkerError(f"DataLoader worker exited unexpectedly: {what}")

    def _raise_init_error(self) -> None:
        """Raise a `worker_init_fn` error still in the result queue (other messages are kept)."""
        while True:
            try:
                msg = self.result_q.get(timeout=_POLL)
            except (queue.Empty, ConnectionError, EOFError, OSError):
                return
            self._accept(msg)

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        while j not in self._ready:
            self._receive(deadline)
        _, _, w, sid, _, payload, timings = self._ready.pop(j)
        self._owner.pop(j, None)
        if isinstance(payload, ExceptionWrapper):
            self._free[w].append(sid)
            payload.reraise()
        spec, layout = payload
        buf = self._slots[(w, sid)][0]
        batch = unflatten(spec, views_from(buf, layout))
        return batch, timings, (w, sid)

    def release(self, token: Any) -> None:
        """Back to the worker's free list, or retired if the user still holds views of it."""
        w, sid = token
        entry = self._slots.get((w, sid))
        if entry is None:
            return
        buf, baseline = entry
        if referenced_beyond(buf, baseline):
            del self._slots[(w, sid)]
            self._retired[w].append(sid)
        else:
            self._free[w].append(sid)

    def close(self) -> None:
        self._ready.clear()
        self._slots.clear()
        self._finalizer()
