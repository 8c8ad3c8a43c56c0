"""`TransferStats`: per-stage timings of shard downloads, shared by the threads of one process.

The remote path's stages, each summed over every download of this process (seconds are thread
seconds: with several GETs in flight they add up to more than the wall time):

- `request_s`: from sending a GET to its first body byte (latency, connection set-up included);
- `receive_s`: waiting for the rest of the body on the socket;
- `write_s`, `verify_s`: writing the received bytes into the cache's temp file, hashing them;
- `fsync_s`: `os.fsync` of finished downloads (0 unless `fsync=True`);
- `commit_s`: renaming a verified download into place and recording it in the cache state;
- `wait_s`: time readers waited inside `acquire` for a shard that was not ready;
- `state_s`: time in updates of the cache's shared state (`state_updates` of them: pins, reservations,
  budget claims, entries; each under the cache's cross-process lock, waits for it included; the update
  that records a download counts in `commit_s` too);
- `gets_in_flight_mean` / `gets_in_flight_max`: GETs outstanding at once (the mean is weighted by
  time over the periods when at least one was outstanding), `bytes_in_flight_max` their sizes;
- `get_busy_s`: wall time with at least one GET outstanding; `bytes` / `get_busy_s` is the
  throughput the link gave while it was used.

Counts: `requests` (shard downloads started, retries included; a ranged one counts once),
`ranged_parts` (its ranged GETs; each part's whole time counts as `receive_s`), `bytes` (body
bytes received), `fetched` / `fetched_bytes` (downloads verified and committed), `demand_fetches`
(downloads a reader ran itself because no prefetch had started them), `prefetched`, `retries`,
`waits` (acquires that took over 1 ms), `side_gets` and `side_bytes` (ranged GETs of blocks a
reader of an arriving shard waited for, ahead of the download's order, and their bytes, which are
not in `bytes`: the download receives those blocks again), `side_rejected` (such GETs whose bytes
failed their block checksum: the blocks are left to the download, which fetches them again),
`table_pages` (GETs of pages of the dataset's `blocks.bin`, which hold shards' block checksum tables),
`tables_rejected` (tables from `blocks.bin` that did not match the manifest: those shards' own tables
were fetched instead), `connections` (HTTP connections the receiver opened: one per GET in flight at once when they are
reused, more when a server closes them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["TransferStats"]

_TIMES = ("request_s", "receive_s", "write_s", "verify_s", "fsync_s", "commit_s", "wait_s", "state_s")
_COUNTS = ("requests", "ranged_parts", "bytes", "fetched", "fetched_bytes", "demand_fetches", "prefetched", "retries",
           "waits", "side_gets", "side_bytes", "side_rejected", "table_pages",
           "tables_rejected", "connections", "state_updates")


class TransferStats:
    """Thread-safe accumulators for `_TIMES` and `_COUNTS` plus the GETs-in-flight gauge."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter (the in-flight gauge keeps the GETs outstanding now)."""
        with self._lock:
            self._vals: dict[str, float] = dict.fromkeys(_TIMES + _COUNTS, 0)
            self._max_gets = self._max_bytes = 0
            self._area = self._busy = 0.0
            self._since = time.perf_counter()
            if not hasattr(self, "_gets"):
                self._gets = self._bytes = 0

    def add(self, name: str, value: float) -> None:
        """Add `value` to one counter (`_TIMES` in seconds, `_COUNTS` as numbers)."""
        with self._lock:
            self._vals[name] += value

    def add_many(self, **values: float) -> None:
        """Add several counters under one lock."""
        with self._lock:
            for name, value in values.items():
                self._vals[name] += value

    def received(self) -> int:
        """Body bytes received so far (`bytes`, counted as they arrive)."""
        with self._lock:
            return int(self._vals["bytes"])

    def _tick(self, now: float) -> None:
        if self._gets:
            self._area += self._gets * (now - self._since)
            self._busy += now - self._since
        self._since = now

    @contextmanager
    def get(self, nbytes: int) -> Iterator[None]:
        """Count one GET of `nbytes` as outstanding for the duration of the block."""
        with self._lock:
            self._tick(time.perf_counter())
            self._gets += 1
            self._bytes += nbytes
            self._max_gets = max(self._max_gets, self._gets)
            self._max_bytes = max(self._max_bytes, self._bytes)
        try:
            yield
        finally:
            with self._lock:
                self._tick(time.perf_counter())
                self._gets -= 1
                self._bytes -= nbytes

    def snapshot(self, prefix: str = "") -> dict[str, float]:
        """Every counter, keys prefixed with `prefix`."""
        with self._lock:
            self._tick(time.perf_counter())
            out: dict[str, float] = dict(self._vals)
            out["gets_in_flight_mean"] = self._area / self._busy if self._busy > 0 else 0.0
            out["gets_in_flight_max"] = self._max_gets
            out["bytes_in_flight_max"] = self._max_bytes
            out["get_busy_s"] = self._busy
        return {prefix + k: v for k, v in out.items()}
