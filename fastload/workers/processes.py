"""Process workers returning batches through reused shared-memory slots.

`ProcessSource` starts worker processes (torch's default start method, or
`multiprocessing_context`) for Python-heavy `__getitem__`s. Batch j goes to worker
`j % num_workers` (as in torch), which runs it with torch-identical seeding and
`torch.utils.data.get_worker_info()`. A worker packs the batch's tensors into one of its reused
shared-memory slots (created by the worker on first use, sized from the batch, grown if a later
batch is bigger, and sent to the main process once as a file descriptor via torch's sharing, its
name already unlinked so nothing can be left in /dev/shm); per batch only the layout and any
non-tensor leaves (str, bytes, objects: the pickling fallback) cross the queue. The main process
yields views of the slot and gives the slot back to the worker once nothing references it.
Each task carries the Loader's run context (`fastload.run`): a worker hands a new one to its
copy of the fetcher (`bind_run`) before fetching, so persistent workers follow the epochs.
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
from typing import Any

import numpy as np
import psutil
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as torch_worker

from fastload.fetch.collate import flatten, leaf_nbytes, pack_into, unflatten, views_from
from fastload.fetch.plan import PlanSlice
from fastload.system import process_start
from fastload.transfer.ring import referenced_beyond, storage_refs
from fastload.workers.base import WorkerError, fetch_planned

__all__ = ["PARENT_POLL_S", "ProcessSource"]

_POLL = 0.1
PARENT_POLL_S = 0.5  # how often a worker process checks that its parent still runs
STOP_FLUSH_S = 0.5  # a worker told to stop waits this long for its last results to go (its parent waits 1 s)


def _process_start(pid: int) -> float | None:
    """When process `pid` started (`fastload.system.process_start`; None if it does not run, or is a
    zombie; -1.0 if it runs but cannot be inspected)."""
    try:
        return process_start(pid)
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
    """Worker process loop: tasks `(gen, j, indices, slot_id, retired_ids, run)` or None to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns Ctrl-C and shuts us down
    signal_handling._set_worker_signal_handlers()  # as torch's workers: a crash says so on stderr first
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
    bound: Any = None  # the run context last handed to `fetch`
    bind_run = getattr(fetch, "bind_run", None)
    while True:
        try:
            task = task_q.get(timeout=1.0)
        except queue.Empty:
            if not _parent_alive(parent_pid, parent_start):
                return
            continue
        if task is None:
            _flush(result_q, STOP_FLUSH_S)
            return
        gen, j, indices, sid, retired, run = task
        for r in retired:
            slots.pop(r, None)
        try:
            if run is not None and run != bound and bind_run is not None:
                bind_run(run)
                bound = run
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


def _flush(result_q: Any, timeout: float) -> None:
    """Close `result_q` and wait up to `timeout` for its feeder thread to hand over what was put. A new
    slot's descriptor is shared through multiprocessing's fd sharer, which the feeder starts on first
    use, with a socket in this process's temporary directory: a worker that returned while the
    feeder was still starting it had the exit's cleanup remove that directory under it ("Directory
    not empty" on stderr). The worker puts to no other queue (a dataset's own queues' feeders are
    waited for within the same `timeout`)."""
    result_q.close()
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":  # multiprocessing.Queue's feeder
            thread.join(max(0.0, deadline - time.monotonic()))


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


def worker_exit_error(pid: int | None, code: int | None) -> RuntimeError:
    """The error torch's DataLoader raises for a worker process that ended (its words, from
    torch/csrc/DataLoader.cpp): killed by a signal, or exited with a code."""
    if code is not None and code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        text = f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
        if -code == signal.SIGBUS:
            text += ("It is possible that dataloader's workers are out of shared memory. "
                     "Please try to raise your shared memory limit.")
        return RuntimeError(text)
    return RuntimeError(
        f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. Details are lost due to "
        "multiprocessing. Rerunning with num_workers=0 may give better error trace."
    )


class ProcessSource:
    """Worker processes returning batches through reused shared-memory slots. A batch the consumer
    fetches itself (`fetch_alone`, `run_inline`) runs `fetch` in this process."""

    inline = False
    adaptive = False

    def __init__(
        self,
        fetch: Any,
        num_workers: int,
        *,
        base_seed: int,
        worker_init_fn: Callable[[int], None] | None = None,
        mp_context: Any = None,
        timeout: float = 0,
        run: Any = None,
    ) -> None:
        ctx = mp_context if mp_context is not None else multiprocessing.get_context()
        self.num_workers, self.timeout = num_workers, timeout
        self._fetch = fetch
        self.run = run  # the run context each task carries (`fastload.run.RunContext`)
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
    def slots_per_worker(self) -> list[int]:
        """Shared-memory slots each worker has been given so far (reused once released)."""
        return list(self._next_sid)

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids."""
        return [p.pid for p in self.procs if p.pid is not None]

    def new_epoch(self, run: Any = None) -> None:
        """Forget batches of an abandoned epoch (their results are dropped on arrival); the tasks
        from now on carry `run`."""
        self.gen += 1
        self.run = run
        for msg in self._ready.values():
            self._free[msg[2]].append(msg[3])
        self._ready.clear()
        self._owner.clear()

    def fetch_alone(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float]]:
        """Fetch one batch in this process (the workers are not involved)."""
        return fetch_planned(self._fetch, indices, planned)

    def run_inline(self, indices: Any, planned: PlanSlice | None = None) -> tuple[Any, dict[str, float], Any]:
        """`fetch_alone`, with no release token (the batch is in this process's memory)."""
        batch, timings = fetch_planned(self._fetch, indices, planned)
        return batch, timings, None

    def put(self, j: int, indices: Any, planned: PlanSlice | None = None) -> None:
        """Send batch j to worker j % num_workers with a free slot of that worker (plans are read in
        the process that made them: a worker reads the batch per batch)."""
        w = j % self.num_workers
        if self._free[w]:
            sid = self._free[w].popleft()
        else:
            sid = self._next_sid[w]
            self._next_sid[w] += 1
        retired, self._retired[w] = self._retired[w], []
        self._owner[j] = w
        self.task_qs[w].put((self.gen, j, indices, sid, retired, self.run))

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
            # as torch: the first dead worker's exit in torch's words, under the list of dead pids
            pids = ", ".join(str(p.pid) for _, p in dead)
            raise WorkerError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from worker_exit_error(
                dead[0][1].pid, dead[0][1].exitcode
            )

    def _raise_init_error(self) -> None:
        """Raise a `worker_init_fn` error still in the result queue (other messages are kept)."""
        while True:
            try:
                msg = self.result_q.get(timeout=_POLL)
            except (queue.Empty, ConnectionError, EOFError, OSError):
                return
            self._accept(msg)

    def get(self, j: int) -> tuple[Any, dict[str, float], Any]:
        """Batch j as views of its shared-memory slot (its error raised here)."""
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
        """Stop the workers (terminated after a grace period) and drop their slots."""
        self._ready.clear()
        self._slots.clear()
        self._finalizer()
