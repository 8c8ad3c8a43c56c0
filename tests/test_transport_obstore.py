"""The obstore transport: `storage_options` mapped onto the obstore client (what the requests carry),
the transport choice, epochs over moto S3 and anonymous HTTP, and bounded waits on a frozen server."""

from __future__ import annotations

import http.server
import os
import re
import threading
import time

import numpy as np
import pytest
from http_faults import ShardServer, assert_attempts_within_total
from s3_fixtures import MotoServer, moto, upload_dir  # noqa: F401

from fastload import Loader
from fastload.formats import FastloadDataset, FormatError, write
from fastload.remote.storage import RemoteFetchError, RemoteStorage, RetryPolicy
from fastload.remote.transport_obstore import UnmappedOptions, choose_transport, store_config

N = 300


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("root") / "ds"
    write(({"x": np.full(1000, i % 251, np.uint8), "label": i} for i in range(N)), str(out), shard_size=100_000,
          progress=False)
    return str(out)


def test_s3_options_map_onto_the_obstore_config():
    opts = {"key": "AK", "secret": "SK", "token": "ST", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 3, "s3": {"addressing_style": "path"}}}
    config, client = store_config("s3://b/ds", opts)
    assert config == {"access_key_id": "AK", "secret_access_key": "SK", "session_token": "ST",
                      "endpoint": "http://127.0.0.1:9", "region": "eu-west-3", "virtual_hosted_style_request": False}
    assert client == {"allow_http": True}
    assert store_config("s3://b/ds", {"anon": True}) == ({"skip_signature": True}, {})
    assert store_config("gs://b/ds", {"token": "anon", "project": "p"}) == ({"skip_signature": True}, {})
    assert store_config("gs://b/ds", {"token": "/k.json"}) == ({"service_account": "/k.json"}, {})
    assert store_config("az://c/ds", {"account_name": "a", "sas_token": "sv=1"}) == (
        {"account_name": "a", "sas_key": "sv=1"}, {})
    assert store_config("https://h/ds", {"headers": {"X-Auth": "t"}}) == (
        {}, {"allow_http": True, "default_headers": {"X-Auth": "t"}})


def test_transport_choice_and_validation():
    assert choose_transport("s3://b/ds", "auto", {"key": "k"}) == "obstore"
    assert choose_transport("http://h/ds", "auto", {}) == "obstore"
    assert choose_transport("memory://ds", "auto", {}) == "fsspec"
    assert choose_transport("s3://b/ds", "fsspec", {}) == "fsspec"
    # options obstore has no equivalent for: auto keeps fsspec, an explicit obstore says which
    assert choose_transport("s3://b/ds", "auto", {"profile": "dev"}) == "fsspec"
    with pytest.raises(UnmappedOptions, match=r"s3://b/ds: storage_options profile, client_kwargs\['verify'\]"):
        choose_transport("s3://b/ds", "obstore", {"profile": "dev", "client_kwargs": {"verify": False}})
    with pytest.raises(ValueError, match="reads .*URLs only"):
        choose_transport("memory://ds", "obstore", {})
    with pytest.raises(ValueError,
                       match=r"transport='curl'; expected one of 'auto', 'obstore', 'obstore-stream', 'fsspec'"):
        choose_transport("s3://b/ds", "curl", {})


class _Recorder:
    """An HTTP server that records each request's path and headers and answers `status` (no body)."""

    def __init__(self, status: int = 404) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.status = status
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                rec.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                self.send_response(rec.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.mark.parametrize("anon", [False, True])
def test_s3_requests_carry_the_mapped_endpoint_credentials_and_region(tmp_path, anon):
    rec = _Recorder()
    try:
        opts = {"anon": True} if anon else {"key": "AKIDTEST", "secret": "s", "token": "tok"}
        opts["client_kwargs"] = {"endpoint_url": rec.url, "region_name": "eu-west-3"}
        with pytest.raises(FormatError, match=r"s3://bkt/ds/index.json: file is missing"):
            RemoteStorage("s3://bkt/ds", storage_options=opts, cache_dir=tmp_path, cache_limit="1MB")
    finally:
        rec.stop()
    assert len(rec.seen) == 1  # a missing object is not retried
    path, headers = rec.seen[0]
    assert path == "/bkt/ds/index.json"  # path-style at the endpoint
    if anon:
        assert "authorization" not in headers
    else:
        assert "Credential=AKIDTEST/" in headers["authorization"] and "/eu-west-3/s3/aws4_request" in headers[
            "authorization"]
        assert headers["x-amz-security-token"] == "tok"


def test_http_headers_reach_the_server(tmp_path):
    rec = _Recorder()
    try:
        with pytest.raises(FormatError, match="file is missing"):
            RemoteStorage(f"{rec.url}/ds", storage_options={"headers": {"X-Token": "abc"}}, cache_dir=tmp_path,
                          cache_limit="1MB")
    finally:
        rec.stop()
    assert [(p, h.get("x-token")) for p, h in rec.seen] == [("/ds/index.json", "abc")]


@pytest.mark.parametrize("url", ["http://{host}/ds", "s3://b/ds"])
def test_error_statuses_become_standard_exceptions_judged_by_is_transient(url):
    from fastload.remote.storage import is_transient
    from fastload.remote.transport_obstore import HTTPStatusError, ObstoreTransport

    rec = _Recorder()
    host = rec.url.split("://", 1)[1]
    opts = {} if url.startswith("http") else {"anon": True, "endpoint_url": rec.url}
    t = ObstoreTransport(url.format(host=host), opts, connect_timeout=1, read_timeout=1)
    want = {503: (HTTPStatusError, True), 500: (HTTPStatusError, True), 429: (HTTPStatusError, True),
            408: (HTTPStatusError, True), 400: (HTTPStatusError, False), 403: (PermissionError, False),
            401: (PermissionError, False), 404: (FileNotFoundError, False)}
    try:
        for status, (kind, transient) in want.items():
            rec.status = status
            with pytest.raises(kind) as info:
                t.cat("x")
            assert is_transient(info.value) is transient, status
            if kind is HTTPStatusError:
                assert info.value.status == status and str(info.value).startswith(f"{url.format(host=host)}/x: ")
    finally:
        rec.stop()


def _epoch_labels(st: RemoteStorage, workers: int = 0) -> list[int]:
    ds = FastloadDataset(storage=st, max_open_shards=st.max_open_shards)
    return sorted(x for b in Loader(ds, batch_size=64, num_workers=workers) for x in b["label"].tolist())


def test_moto_s3_epoch_through_obstore_with_endpoint_credentials_and_region(moto, local_ds, tmp_path):  # noqa: F811
    client = moto.client()
    client.create_bucket(Bucket="obs")
    upload_dir(client, local_ds, "obs", "ds")
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto.endpoint,
                                                                       "region_name": "us-east-1"}}
    st = RemoteStorage("s3://obs/ds", storage_options=opts, cache_dir=tmp_path, cache_limit="4MB",
                       part_bytes=20_000, transport="obstore")  # shards over 80 KB: ranged parts
    assert st.transport == "obstore"
    assert _epoch_labels(st) == list(range(N))
    stats = st.stats()
    assert stats["remote_fetched"] == 4 and stats["remote_ranged_parts"] > 4 and stats["remote_retries"] == 0
    st.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_anonymous_http_epoch_through_obstore(local_ds, tmp_path, workers):
    srv = ShardServer(os.path.dirname(local_ds))
    try:
        st = RemoteStorage(f"{srv.url}/ds", cache_dir=tmp_path, cache_limit="4MB")
        assert st.transport == "obstore"
        assert _epoch_labels(st, workers) == list(range(N))
        for s in FastloadDataset(local_ds).manifest.shards:  # the cached copies equal the source
            path = st.acquire(s.file, size=s.bytes, xxh3=s.xxh3)
            with open(os.path.join(local_ds, s.file), "rb") as a, open(path, "rb") as b:
                assert a.read() == b.read()
            st.release(s.file)
        st.close()
    finally:
        srv.stop()


def test_frozen_mid_epoch_times_out_per_read_and_names_the_shard(local_ds, tmp_path):
    """obstore's read timeout bounds each attempt; fastload's policy counts the attempts."""
    srv = ShardServer(os.path.dirname(local_ds))
    retry = RetryPolicy(attempts=10, base=0.01, cap=0.02, total=1.1)
    try:
        st = RemoteStorage(f"{srv.url}/ds", cache_dir=tmp_path, cache_limit="4MB", prefetch_depth=0, retry=retry,
                           connect_timeout=0.4, read_timeout=0.4, transport="obstore")
        srv.freeze()
        s = FastloadDataset(local_ds).manifest.shards[0]
        t0 = time.monotonic()
        gave_up = r"shard-00000\.fls: giving up after \d+ attempts .*TimeoutError"
        with pytest.raises(RemoteFetchError, match=gave_up) as info:
            st.acquire(s.file, size=s.bytes, xxh3=s.xxh3)
        took = time.monotonic() - t0
        m = re.search(r"giving up after (\d+) attempts in ([\d.]+)s", str(info.value))
        assert m is not None
        attempts, stated = int(m.group(1)), float(m.group(2))
        assert_attempts_within_total(attempts, stated, retry, 0.4)
        assert attempts * 0.4 - 0.05 <= took < attempts * 0.4 + 2.0
        assert st.stats()["remote_requests"] == attempts
        st.close()
    finally:
        srv.stop()
