"""`ReceiveLoops`: a few private event loops, each in its own thread with its own async fsspec file system.

fsspec runs every async file system of a process on one shared event-loop thread, so every GET's
body (receive, write into the cache file, hash) is handled by that one thread. Here the GETs of a
`RemoteStorage` are spread over `count` loops instead, each GET on the loop with the fewest GETs
running: the socket reads, page-cache writes and hashing (all of which release the GIL) of
different shards then run on different cores. Each loop has its own file system instance
(`asynchronous=True`, `skip_instance_cache=True`), hence its own connection pool; `close` closes
each client session on its loop, then stops and joins the loop threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.asyn import sync as fsspec_sync

__all__ = ["ReceiveLoops"]

T = TypeVar("T")

CLOSE_TIMEOUT_S = 10.0  # closing one client session


class ReceiveLoops:
    """`count` event-loop threads with one async file system each for `url` (with `storage_options`)."""

    def __init__(self, *, url: str, storage_options: dict[str, Any], count: int) -> None:
        self._lock = threading.Lock()
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._threads: list[threading.Thread] = []
        self._fss: list[AsyncFileSystem] = []
        self._busy: list[int] = []
        self._closed = False
        self._pid = os.getpid()  # the threads exist in this process only
        try:
            for _ in range(max(1, count)):
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name="fastload-receive", daemon=True)
                t.start()
                self._loops.append(loop)
                self._threads.append(t)
                opts = {**storage_options, "asynchronous": True, "skip_instance_cache": True, "loop": loop}
                fs, _ = fsspec.core.url_to_fs(url, **opts)
                if isinstance(getattr(fs, "retries", None), int):
                    fs.retries = 1  # s3fs's inner retries off: the caller's retry policy counts attempts
                self._fss.append(fs)
                self._busy.append(0)
        except BaseException:
            self.close()
            raise

    def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout: float | None = None) -> T:
        """`fn(fs, *args)` on the least busy loop, waited for here (the coroutine's own reads time out)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ReceiveLoops is closed")
            i = min(range(len(self._busy)), key=self._busy.__getitem__)
            self._busy[i] += 1
        try:
            fs = self._fss[i]
            return fsspec_sync(self._loops[i], fn, fs, *args, timeout=timeout)
        finally:
            with self._lock:
                self._busy[i] -= 1

    def close(self) -> None:
        """Close every file system's client session on its loop, then stop and join the loop threads."""
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                return
            self._closed = True
        for loop, fs in zip(self._loops, self._fss, strict=False):
            with contextlib.suppress(Exception):  # a session that cannot close cleanly goes with its loop
                fsspec_sync(loop, _close_session, fs, timeout=CLOSE_TIMEOUT_S)
        for loop in self._loops:
            loop.call_soon_threadsafe(loop.stop)
        for t in self._threads:
            t.join(timeout=CLOSE_TIMEOUT_S)
        for loop, t in zip(self._loops, self._threads, strict=True):
            if not t.is_alive():
                loop.close()


async def _close_session(fs: AsyncFileSystem) -> None:
    """Close the client an async fsspec file system opened (`set_session` returns it: an aiohttp session
    for http and gcs, an aiobotocore client for s3), when it opened one."""
    for attr in ("_session", "_s3"):  # the attribute holding it once created (http, gcsfs / s3fs)
        if getattr(fs, attr, None) is not None:
            client = getattr(fs, attr)
            close = getattr(client, "close", None)
            if close is not None:
                res = close()
                if asyncio.iscoroutine(res):
                    await res
            return
