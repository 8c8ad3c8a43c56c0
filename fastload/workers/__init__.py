"""Batch sources (the fetch stage): in-process, thread workers, process workers.

* `base`: the `BatchSource` protocol (`put` / `get` / `release` / `close`), `InlineSource`
  (`num_workers=0`: fetch synchronously in the caller, like torch), `WorkerError`.
* `threads`: `ThreadPool` (worker threads kept across epochs) and `ThreadSource` (one epoch's
  hand-over, with work stealing by a waiting consumer).
* `processes`: `ProcessSource` (worker processes, shared-memory slots, parent watchdog).
* `kept`: `WorkerSet`, the workers a Loader keeps across epochs (its thread pool, persistent
  process workers).
"""

from fastload.workers.base import BatchSource, InlineSource, WorkerError
from fastload.workers.processes import ProcessSource
from fastload.workers.threads import STEAL_MODES, ThreadPool, ThreadSource, resolve_steal, steal_rule

__all__ = [
    "STEAL_MODES",
    "BatchSource",
    "InlineSource",
    "ProcessSource",
    "ThreadPool",
    "ThreadSource",
    "WorkerError",
    "resolve_steal",
    "steal_rule",
]
