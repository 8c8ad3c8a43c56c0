"""`Ahead`: one value computed on a background thread before it is asked for.

The Loader's next epoch order (a permutation of the whole dataset, then a sort inside each
batch) is a pure function of (seed, epoch, ...) and costs milliseconds per 100k samples, all of
it spent while the pipeline is empty at the start of an epoch. Computed during the previous
epoch instead (numpy releases the GIL for both steps), the epoch starts at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

__all__ = ["Ahead"]


class Ahead:
    """At most one pending computation, identified by a key.

    `start(key, fn, *args)` runs `fn(*args)` on a daemon thread (unless that key is already
    pending); `take(key)` returns its result (waiting for it if still running) and forgets it,
    or None when the pending key is another one (the caller computes it itself; the stale value
    is dropped). An exception in `fn` is not raised by `take`: the caller computes again and
    meets it there, in its own thread.
    """

    def __init__(self, *, name: str = "fastload-ahead") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._key: Hashable | None = None
        self._future: Future[Any] | None = None

    @property
    def pending(self) -> Hashable | None:
        """The key being (or already) computed, or None."""
        return self._key

    def start(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """Compute `fn(*args)` on a daemon thread under `key` (nothing if `key` is pending)."""
        with self._lock:
            if self._future is not None and self._key == key:
                return
            future: Future[Any] = Future()
            self._key, self._future = key, future
        threading.Thread(target=_run, args=(future, fn, args), name=self.name, daemon=True).start()

    def take(self, key: Hashable) -> Any | None:
        """The value computed for `key` (waiting for it), or None; forgets the pending value."""
        with self._lock:
            future, pending = self._future, self._key
            self._key = self._future = None
        if future is None or pending != key:
            return None
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - the caller computes it again and raises in its own thread
            return None


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - kept for `take`, which recomputes in the caller
        future.set_exception(exc)
