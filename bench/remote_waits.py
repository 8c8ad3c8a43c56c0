"""How long a Loader's epoch over HTTP waits, with default settings, before it fails: a frozen server
(accepts connections and shard requests, never answers them) and a killed server (connections
refused), each while reading the first batch's shard.

    python -m bench.remote_waits            # both, default timeouts, RetryPolicy and prefetching
Prints seconds from `next(iter(loader))` to the `RemoteFetchError`, its message, and for the frozen
server the shard requests it received.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from http_faults import ShardServer

from fastload import Loader, open_dataset
from fastload.formats import write
from fastload.remote.storage import RemoteFetchError


def _case(tmp: str, how: str) -> None:
    server = ShardServer(os.path.join(tmp, "root"))
    try:
        ds = open_dataset(f"{server.url}/ds", cache_dir=os.path.join(tmp, f"cache-{how}"), cache_limit="100MB")
        server.freeze() if how == "frozen" else server.kill()
        t0 = time.monotonic()
        try:
            next(iter(Loader(ds, batch_size=64, num_workers=0)))
        except RemoteFetchError as exc:
            print(f"{how} server: {time.monotonic() - t0:.1f} s -> {exc}")
        if how == "frozen":
            print(f"  shard requests the server received: {len(server.frozen_requests)}")
        ds.storage.close()
    finally:
        server.stop()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        samples = ({"x": np.full(2000, i % 251, np.uint8), "label": i} for i in range(2000))
        write(samples, os.path.join(tmp, "root", "ds"), shard_size="400KB", progress=False)
        _case(tmp, "frozen")
        _case(tmp, "killed")


if __name__ == "__main__":
    main()
