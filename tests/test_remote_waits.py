"""One retry cycle per failure: a frozen or killed HTTP server ends a Loader's epoch in a
`RemoteFetchError` after the time docs/remote.md gives, and the message's attempts and duration
are the real ones (error annotation reads nothing again)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from http_faults import ShardServer, assert_attempts_within_total

from fastload import Loader
from fastload.formats import FastloadDataset, write
from fastload.remote.storage import RemoteFetchError, RemoteStorage, RetryPolicy

READ_S = 0.4


@pytest.fixture()
def server(tmp_path):
    write(({"x": np.full(2000, i % 251, np.uint8), "label": i} for i in range(200)), str(tmp_path / "root" / "ds"),
          shard_size=100_000, progress=False)
    srv = ShardServer(str(tmp_path / "root"))
    yield srv
    srv.stop()


def _open(url: str, cache_dir: str, retry: RetryPolicy, transport: str) -> FastloadDataset:
    storage = RemoteStorage(url, cache_dir=cache_dir, cache_limit="4MB", prefetch_depth=0, retry=retry,
                            connect_timeout=READ_S, read_timeout=READ_S, transport=transport)
    return FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)


def _first_batch_error(ds: FastloadDataset) -> tuple[RemoteFetchError, float, int, float]:
    """The error of the first batch, seconds to it, and the attempts and seconds its message states."""
    t0 = time.monotonic()
    with pytest.raises(RemoteFetchError) as info:
        next(iter(Loader(ds, batch_size=16, num_workers=0, shuffle=False)))
    took = time.monotonic() - t0
    m = re.search(r"giving up after (\d+) attempts in ([\d.]+)s", str(info.value))
    assert m is not None, str(info.value)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "sample index 0 " in notes  # located from the index: shard 0 is named in the error
    return info.value, took, int(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_frozen_server_one_cycle_of_the_documented_length(server, tmp_path, transport):
    # each attempt waits read_timeout for the first byte; attempts start while less than `total` has passed
    retry = RetryPolicy(attempts=10, base=0.01, cap=0.02, total=1.1)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), retry, transport)
    server.freeze()
    err, took, attempts, stated = _first_batch_error(ds)
    assert "shards/shard-00000" in str(err) and "TimeoutError" in str(err)
    assert attempts == len(server.frozen_requests), server.frozen_requests
    assert_attempts_within_total(attempts, stated, retry, READ_S)
    assert attempts * READ_S - 0.05 <= stated <= took + 0.05 and took < attempts * READ_S + 2.0, (stated, took)



@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_killed_server_one_cycle_of_the_documented_length(server, tmp_path, transport):
    # refused connections fail at once: every attempt is made, with the backoff sleeps between them
    retry = RetryPolicy(attempts=6, base=0.1, cap=0.2, total=30)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), retry, transport)
    server.kill()
    err, took, attempts, stated = _first_batch_error(ds)
    assert "Connect" in str(err)
    assert attempts == retry.attempts == ds.storage.stats()["remote_requests"]
    most = sum(min(retry.cap, retry.base * 2**k) for k in range(retry.attempts - 1))  # 0.9 s of sleeps at most
    assert stated - 0.05 <= took < stated + 1.0 and took < most + 2.0, (stated, took)
