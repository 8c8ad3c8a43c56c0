"""Batch sources: in-process, thread workers, process workers with shared-memory slots.

All three take `put(j, indices)` (batch j of the epoch) and hand batches back in order with
`get(j) -> (batch, timings, token)`; `release(token)` returns the batch's buffer for reuse.

* `InlineSource` (`num_workers=0`): fetch synchronously in the caller, like torch.
* `ThreadSource`: a thread pool. Right for work that releases the GIL (numpy gathers, file
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import worker as torch_worker

from fastload.collate import flatten, leaf_nbytes, pack_into, unflatten, views_from
from fastload.pinned import storage_refs
from fastload.system import usable_cores

__all__ = ["STEAL_MODES", "InlineSource", "ProcessSource", "ThreadSource", "WorkerError", "resolve_steal"]

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


class ThreadSource:
    """Fetch on a pool of threads; `post` (e.g. packing into the pinned ring) runs there too.

    While the consumer waits for batch j it does not sit idle: it fetches a later batch that no
    worker has started yet and keeps the result for its turn (work stealing). On a machine with
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
    """

    STEAL_MIN_REMAINING = 0.75  # of the mean fetch time
    STEAL_OVERDUE = 2.0  # mean fetch times
    _MEAN_WEIGHT = 0.2  # of the newest fetch in the running mean

    def __init__(
        self,
        fetch: Callable[[Any], tuple[Any, dict[str, float]]],
        num_workers: int,
        *,
        timeout: float = 0,
        post: Callable[[Any, dict[str, float]], tuple[Any, Any]] | None = None,
        init: Callable[[int], None] | None = None,
        steal: bool | str = "auto",
    ) -> None:
        self.fetch, self.post, self.timeout = fetch, post, timeout
        self.steal = resolve_steal(steal, num_workers=num_workers, timeout=timeout)
        counter = iter(range(num_workers))
        lock = threading.Lock()

        def initializer() -> None:
            with lock:
                wid = next(counter)
            if init is not None:
                init(wid)

        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="fastload", initializer=initializer)
        self._futures: dict[int, tuple[Future[Any] | None, Any]] = {}
        self._stolen: dict[int, tuple[Any, BaseException | None]] = {}  # done by the consumer, ahead of turn
        self._started: dict[int, float] = {}  # batch -> when a worker started it
        self._mean_fetch: float | None = None  # running mean of fetch seconds
        self.stolen = 0  # batches the consumer fetched while waiting (diagnostics)
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def _work(self, indices: Any, j: int | None = None) -> tuple[Any, dict[str, float], Any]:
        timed = self.steal == "bounded"  # only that mode needs fetch start times and their mean
        if timed:
            t0 = time.perf_counter()
            if j is not None:
                self._started[j] = t0
        batch, timings = self.fetch(indices)
        token = None
        if self.post is not None:
            batch, token = self.post(batch, timings)
        if timed:
            dt = time.perf_counter() - t0
            mean = self._mean_fetch  # a racy update between threads only blurs the mean a little
            self._mean_fetch = dt if mean is None else mean + self._MEAN_WEIGHT * (dt - mean)
        return batch, timings, token

    def put(self, j: int, indices: Any) -> None:
        self._futures[j] = (self._pool.submit(self._work, indices, j), indices)

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        fut, indices = self._futures.pop(j)
        if fut is None:  # stolen earlier
            result, error = self._stolen.pop(j)
            if error is not None:
                raise error
            return result
        if self.steal:
            if fut.cancel():  # no worker has started it yet: do it here instead of waiting
                return self._work(indices)
            self._steal_while(fut, j)
        try:
            return fut.result(timeout=self.timeout or None)
        except TimeoutError:
            raise WorkerError(f"DataLoader timed out after {self.timeout} seconds") from None
        finally:
            self._started.pop(j, None)

    def _worth_stealing(self, j: int) -> bool:
        """Whether batch j (running on a worker) should take long enough to fetch another meanwhile:
        it started less than 1 - STEAL_MIN_REMAINING mean fetches ago, or it is far overdue (over
        `STEAL_OVERDUE` means: stuck on something slow, so its end cannot be predicted)."""
        mean, started = self._mean_fetch, self._started.get(j)
        if mean is None or started is None:  # "always" records neither
            return True
        elapsed = time.perf_counter() - started
        return elapsed <= (1.0 - self.STEAL_MIN_REMAINING) * mean or elapsed >= self.STEAL_OVERDUE * mean

    def _steal_while(self, fut: Future[Any], j: int) -> None:
        """Fetch not-yet-started later batches, earliest first, while `fut` (batch j) is worth waiting for."""
        for k in sorted(self._futures):
            if fut.done() or not self._worth_stealing(j):
                return
            other, indices = self._futures[k]
            if other is None or not other.cancel():
                continue
            self._futures[k] = (None, indices)
            try:
                self._stolen[k] = (self._work(indices), None)
            except Exception as exc:  # noqa: BLE001 - raised when batch k's turn comes, in order
                self._stolen[k] = (None, exc)
            self.stolen += 1

    def run_inline(self, indices: Any) -> tuple[Any, dict[str, float], Any]:
        """Fetch in the calling thread (the pipeline's adaptive inline mode)."""
        return self._work(indices)

    def release(self, token: Any) -> None:
        pass

    def close(self) -> None:
        for fut, _ in self._futures.values():
            if fut is not None:
                fut.cancel()
        self._futures.clear()
        self._stolen.clear()
        self._started.clear()
        self._finalizer()


# ---------------------------------------------------------------- process workers


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
    result_q.cancel_join_thread()
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
        result_q.put((-1, -1, wid, -1, None, ExceptionWrapper(where=f"in DataLoader worker process {wid}"), None))
        return
    slots: dict[int, torch.Tensor] = {}
    while True:
        try:
            task = task_q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
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
        self._slots: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
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
        gen, j, w, sid, new, payload, _ = msg
        if gen == -1:  # worker_init_fn failed
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
            what = ", ".join(f"worker {i} (pid {p.pid}, {_describe_exit(p.exitcode)})" for i, p in dead)
            raise WorkerError(f"DataLoader worker exited unexpectedly: {what}")

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
        if storage_refs(buf) > baseline:
            del self._slots[(w, sid)]
            self._retired[w].append(sid)
        else:
            self._free[w].append(sid)

    def close(self) -> None:
        self._ready.clear()
        self._slots.clear()
        self._finalizer()
