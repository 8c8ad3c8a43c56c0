"""`WorkerSet`: the workers a Loader keeps across epochs, and the batch source each epoch fetches with.

Owns: the thread pool (kept across epochs unless a `worker_init_fn` without
`persistent_workers` asks for fresh workers each epoch, as torch runs it once per epoch), the
persistent process pool (`persistent_workers=True`), nothing else. `source(...)` gives an
epoch its `BatchSource` (`fastload.workers.base`) with exactly `config.num_workers` workers of
`config.worker_kind`; `close()` stops every kept worker (after a failed epoch, `Loader.close()`,
or the Loader's collection). Consumer thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastload.fetch.fetcher import Fetcher
from fastload.pipeline.config import LoaderConfig
from fastload.run import RunContext
from fastload.transfer.pin_stage import ring_post
from fastload.transfer.ring import BufferRing
from fastload.transfer.side_stream import use_worker_stream, worker_stream
from fastload.workers import BatchSource, InlineSource, ProcessSource, ThreadPool, ThreadSource

__all__ = ["WorkerSet"]


class WorkerSet:
    """A Loader's kept workers (see the module docstring)."""

    def __init__(
        self,
        config: LoaderConfig,
        fetcher: Fetcher,
        *,
        timeout: float,
        worker_init_fn: Callable[[int], None] | None,
        persistent: bool,
        mp_context: Any,
    ) -> None:
        self.config, self.fetcher = config, fetcher
        self.timeout, self.worker_init_fn = timeout, worker_init_fn
        self.persistent, self.mp_context = persistent, mp_context
        self.processes: ProcessSource | None = None  # the persistent process pool
        self.threads: ThreadPool | None = None  # the thread pool kept across epochs

    @property
    def reuses_processes(self) -> bool:
        """The next epoch runs on the persistent process pool (its workers keep their seeds)."""
        return self.persistent and self.processes is not None and self.config.worker_kind == "process"

    @property
    def running(self) -> bool:
        """Kept workers exist (to stop on close)."""
        return self.processes is not None or self.threads is not None

    def source(
        self, ring: BufferRing | None, device_index: int | None, base_seed: int | None, run: RunContext | None = None
    ) -> tuple[BatchSource, bool, bool]:
        """The epoch's batch source -> (source, owned by the epoch, packs into `ring` itself);
        worker processes get `run` with each task (threads share the bound fetcher)."""
        cfg, fetcher = self.config, self.fetcher
        if cfg.worker_kind == "inline":
            return InlineSource(fetcher.fetch_alone), True, False
        if cfg.worker_kind == "thread":
            source = ThreadSource(
                fetcher,
                cfg.num_workers,
                timeout=self.timeout,
                post=ring_post(ring) if ring is not None else None,
                init=thread_init(self.worker_init_fn, device_index),
                steal=cfg.steal,
                fetch_alone=fetcher.fetch_alone,
                pool=self._kept_threads(device_index),
            )
            return source, True, ring is not None
        if self.reuses_processes:
            assert self.processes is not None
            self.processes.new_epoch(run)
            return self.processes, False, False
        pool = ProcessSource(
            fetcher,
            cfg.num_workers,
            base_seed=int(base_seed if base_seed is not None else 0),
            worker_init_fn=self.worker_init_fn,
            mp_context=self.mp_context,
            timeout=self.timeout,
            run=run,
        )
        if self.persistent:
            self.processes = pool
        return pool, not self.persistent, False

    def _kept_threads(self, device_index: int | None) -> ThreadPool | None:
        """The kept thread pool (an epoch then starts no threads), or None when a `worker_init_fn`
        without `persistent_workers` asks for fresh workers each epoch (the source starts its own)."""
        if self.worker_init_fn is not None and not self.persistent:
            return None
        if self.threads is not None and not self.threads.usable:
            self.threads.close()  # closed, or a forked copy: a new pool
            self.threads = None
        if self.threads is None:
            self.threads = ThreadPool(self.config.num_workers, init=thread_init(self.worker_init_fn, device_index))
        return self.threads

    def close(self) -> None:
        """Stop the kept workers (each thread after the fetch it is in)."""
        if self.processes is not None:
            self.processes.close()
            self.processes = None
        if self.threads is not None:
            self.threads.close()
            self.threads = None


def thread_init(worker_init_fn: Callable[[int], None] | None, device_index: int | None) -> Callable[[int], None]:
    """A worker thread's start: the Loader's CUDA device and the starting thread's current stream on
    it (see `device.worker_stream`), so CUDA work in a transform is ordered before the consumer's."""
    stream = worker_stream(device_index)

    def init(wid: int) -> None:
        use_worker_stream(device_index, stream)
        if worker_init_fn is not None:
            worker_init_fn(wid)

    return init
