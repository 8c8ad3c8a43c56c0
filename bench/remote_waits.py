"""How long a remote read waits, with default settings, before it fails: a frozen server (accepts
connections, never answers) and a server killed mid-epoch (connections refused).

    python -m bench.remote_waits            # both, default timeouts and RetryPolicy
Prints seconds from the read to the `RemoteFetchError`, and its message.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from s3_fixtures import MotoServer, storage_options, upload_dir
from test_remote_s3 import FrozenServer, _samples

from fastload.formats import FastloadDataset, write
from fastload.remote import RemoteFetchError, RemoteStorage


def _defaults(endpoint: str) -> dict:
    opts = storage_options(endpoint)
    del opts["config_kwargs"]  # the test fixture's own timeouts: use RemoteStorage's defaults instead
    return opts


def frozen(tmp: str) -> None:
    server = FrozenServer()
    t0 = time.monotonic()
    try:
        RemoteStorage("s3://data/ds", storage_options=_defaults(f"http://127.0.0.1:{server.port}"), cache_dir=tmp)
    except RemoteFetchError as exc:
        print(f"frozen server: {time.monotonic() - t0:.1f} s -> {exc}")
    finally:
        server.stop()


def killed(tmp: str) -> None:
    local = os.path.join(tmp, "ds")
    write(_samples(), local, shard_size="150KB", progress=False)
    server = MotoServer().start()
    try:
        client = server.client()
        client.create_bucket(Bucket="data")
        upload_dir(client, local, "data", "ds")
        storage = RemoteStorage(
            "s3://data/ds",
            storage_options=_defaults(server.endpoint),
            cache_dir=os.path.join(tmp, "c"),
            prefetch_depth=0,
        )
        ds = FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)
        ds[0]
        server.kill()
        t0 = time.monotonic()
        try:
            ds[len(ds) - 1]
        except RemoteFetchError as exc:
            print(f"killed server: {time.monotonic() - t0:.1f} s -> {exc}")
    finally:
        server.kill()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        frozen(os.path.join(tmp, "f"))
        killed(tmp)
