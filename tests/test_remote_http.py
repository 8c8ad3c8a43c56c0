"""A dataset served over HTTP by nginx: every sample read once, and no un-awaited coroutine or
unclosed file from fsspec's async HTTP files (RuntimeWarning/ResourceWarning are errors here)."""

from __future__ import annotations

import gc
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import xxhash

from fastload.dataset import open_dataset
from fastload.formats import write
from fastload.loader import Loader

pytestmark = pytest.mark.nginx


def _serve(tmp_path, limit_rate=None):
    from bench.remote import Nginx

    root = tmp_path / "root"
    n = 600
    write(({"x": np.full(1000, i % 251, np.uint8), "label": i} for i in range(n)), str(root / "ds"),
          shard_size=100_000, progress=False)
    try:
        server = Nginx(str(root), str(tmp_path), limit_rate=limit_rate)
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        yield f"{server.url}/ds", n
    finally:
        server.stop()


@pytest.fixture()
def served(tmp_path):
    yield from _serve(tmp_path)


@pytest.fixture()
def served_slowly(tmp_path):
    """`served`, each response paced by nginx's `limit_rate` at 90 kB/s. nginx sends the first second's
    allowance at once, so a ~100 KB shard's GET lasts about a second (its last ~10 KB wait for the next
    second): GETs started together overlap on any machine, also one whose threads wait tens of ms for
    a core. (At a rate above the shard size, every GET ends within a millisecond and, under load, one
    may end before the next starts.)"""
    yield from _serve(tmp_path, limit_rate=90_000)


@pytest.mark.parametrize("workers", [0, 2])
def test_http_epoch_exact_and_no_unawaited_close(served_slowly, tmp_path, workers, monkeypatch):
    url, n = served_slowly
    before = _threads()
    unraisable: list[str] = []  # a warning raised inside __del__ (an un-awaited close) lands here
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_value!r} in {u.object!r}"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.simplefilter("error", ResourceWarning)
        ds = open_dataset(url, cache_dir=str(tmp_path / f"cache{workers}"), cache_limit="8MB")
        total = sum(s.bytes for s in ds.manifest.shards)
        for epoch in range(2):  # cold, then warm
            seen = []
            loader = Loader(ds, batch_size=64, num_workers=workers, worker_type="thread")
            for batch in loader:
                labels = batch["label"].tolist()
                assert (batch["x"][:, 0].numpy() == np.array(labels) % 251).all()
                seen += labels
            assert sorted(seen) == list(range(n))
            st = loader.stats()  # the transfer stages: every shard fetched once, in the cold epoch only
            assert st["remote_fetched"] == ds.num_shards and st["remote_fetched_bytes"] == total
            assert st["remote_bytes"] == total and st["remote_requests"] == ds.num_shards
            assert st["remote_fsync_s"] == 0 and st["remote_gets_in_flight_max"] >= 1
            assert 1 <= st["remote_gets_target"] <= ds.storage.fetch_threads  # the GET count it chose
            for k in ("request_s", "receive_s", "write_s", "verify_s", "commit_s", "get_busy_s"):
                assert st[f"remote_{k}"] > 0, k
            if epoch == 0:  # no sampler handed a plan over: the storage read ahead in manifest order
                assert st["remote_prefetched"] > 0 and st["remote_gets_in_flight_max"] > 1
        del ds, loader
        gc.collect()
    assert unraisable == []
    # a storage dropped without close() ends its receive loops and prefetch threads when collected: each
    # finishes the GET it is in (bounded by the read timeout), so allow them a few seconds to exit
    deadline = time.monotonic() + 10
    while not _threads() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() <= before


def _threads() -> set:
    """Live receive-loop and prefetch threads."""
    import threading

    return {t for t in threading.enumerate() if t.name in ("fastload-receive", "fastload-prefetch") and t.is_alive()}


def test_bench_remote_cli_reports_every_row(served, tmp_path, capsys):
    """`fastload bench --remote URL`: raw, cold and warm rows per worker count and order, stage timings."""
    from fastload.cli import main

    url, _ = served
    out = tmp_path / "r.json"
    assert main(["bench", "--remote", url, "--repeats", "1", "--workers", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("raw", "w0 shuffled cold", "w0 shuffled warm", "w0 sequential cold", "w0 sequential warm"):
        assert f"\n{row} " in text, row
    import json

    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"raw", "w0 shuffled cold", "w0 shuffled warm", "w0 sequential cold",
                                "w0 sequential warm"}
    assert all(len(v) == 1 and v[0] > 0 for v in res["rows"].values())
    assert set(res["cpu_s_per_GB"]) == set(res["rows"])  # warm rows too: fetch cost = cold - warm
    assert set(res["first_batch_s"]) == set(res["rows"]) - {"raw"}
    assert all(v[0] > 0 for v in res["first_batch_s"].values())
    assert all(v[0] > 0 for v in res["cpu_s_per_GB"].values())
    assert set(res["user_cpu_s_per_GB"]) == set(res["cpu_s_per_GB"])
    assert all(0 <= res["user_cpu_s_per_GB"][k][0] <= v[0] for k, v in res["cpu_s_per_GB"].items())
    assert "\nof which user-mode: raw=" in text
    user = res["user_cpu_s_per_GB"]
    assert res["fetch_cost_s_per_GB"] == {  # per round: cold minus warm user CPU of the same Loader and order
        row: [user[f"{row} cold"][0] - user[f"{row} warm"][0]] for row in ("w0 shuffled", "w0 sequential")
    }
    assert "\nfetch cost, user CPU s/GB of the cold epoch minus the warm one" in text and "w0 shuffled=" in text
    base = float(np.median(user["raw"]))  # the goal's baseline, the plain raw pipeline, is named in the line
    if base > 0:
        cost = res["fetch_cost_s_per_GB"]["w0 shuffled"][0]
        assert f"w0 shuffled={cost:.3f}" in text and f"({cost / base:.1f}x raw" in text
    cold = res["stages"]["w0 shuffled cold"][0]
    assert cold["receive_s"] > 0 and cold["write_s"] > 0 and cold["gets_in_flight_mean"] >= 1


def test_prefetch_threads_look_for_consumed_shards_once_per_interval(served, tmp_path, monkeypatch):
    """While prefetched shards wait, the prefetch threads together read the cache's shared state at most
    once per `CONSUMED_POLL_S`, however often acquires and releases wake them."""
    from fastload.formats.manifest import MANIFEST_NAME, Manifest
    from fastload.remote.plan import CONSUMED_POLL_S
    from fastload.remote.storage import RemoteStorage

    url, _ = served
    st = RemoteStorage(url, cache_dir=str(tmp_path / "cache"), cache_limit="8MB", fetch_threads=4, prefetch_depth=2)
    try:
        names = [s.file for s in Manifest.loads(st.read_small(MANIFEST_NAME), where=url).shards]
        assert len(names) >= 4
        looks = []
        real = st.cache.soft_keys
        monkeypatch.setattr(st.cache, "soft_keys", lambda: looks.append(time.monotonic()) or real())
        st.prefetch(names)  # 2 of them fetched ahead (the depth), the rest wait in the plan
        deadline = time.monotonic() + 10
        while st.stats()["remote_prefetched"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.stats()["remote_prefetched"] == 2
        looks.clear()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:  # wake every thread, 500 times
            st.planner.released(names[-1])
            time.sleep(0.001)
        took = time.monotonic() - t0
        assert 1 <= len(looks) <= took / CONSUMED_POLL_S + 2, looks
    finally:
        st.close()


def _ranged_epoch(url: str, cache_dir: str, n: int) -> dict:
    from fastload.formats import FastloadDataset
    from fastload.remote.storage import RemoteStorage

    st = RemoteStorage(url, cache_dir=cache_dir, cache_limit="8MB", part_bytes=20_000)  # 100 KB shards: 5 parts
    ds = FastloadDataset(storage=st, max_open_shards=st.max_open_shards)
    seen = [x for b in Loader(ds, batch_size=64, num_workers=0) for x in b["label"].tolist()]
    assert sorted(seen) == list(range(n))
    cached = {xxhash.xxh3_64_hexdigest(p.read_bytes()) for p in Path(st.cache.data_dir).iterdir()}
    assert {s.xxh3.lower() for s in ds.manifest.shards} <= cached  # every shard cached, byte for byte
    stats = st.stats()
    before = _threads()
    st.close()
    assert before and not _threads()  # close() ended this storage's receive loops and prefetch threads
    return stats


def test_large_shards_arrive_in_ranged_parts(served, tmp_path):
    url, n = served
    stats = _ranged_epoch(url, str(tmp_path / "c"), n)
    assert stats["remote_ranged_parts"] >= 5 * stats["remote_fetched"] > 0


def test_a_server_without_ranges_gets_whole_object_gets(tmp_path):
    """Python's http.server ignores `Range` (200 with the whole body): ranged GETs turn off, shards come whole."""
    import functools
    import http.server
    import threading

    root = tmp_path / "root"
    n = 300
    write(({"x": np.full(1000, i % 251, np.uint8), "label": i} for i in range(n)), str(root / "ds"),
          shard_size=100_000, progress=False)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.handle_error = lambda *a: None  # cancelled parts close their connections mid-body
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        stats = _ranged_epoch(f"http://127.0.0.1:{srv.server_address[1]}/ds", str(tmp_path / "c"), n)
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()
    from fastload.remote.get import PARTS_IN_FLIGHT

    # each shard's first ranged answer is the whole body: it stops that shard's parts (threads that
    # had started one before the first failure try once each; obstore refuses such an answer before
    # its body, so none counts); the shards then come in whole GETs
    fetched = stats["remote_fetched"]
    assert fetched >= 3 and 0 <= stats["remote_ranged_parts"] <= PARTS_IN_FLIGHT * fetched


def test_an_https_dataset_is_read_exactly_through_the_receiver(tmp_path, monkeypatch):
    """nginx over HTTPS (a test CA trusted through `SSL_CERT_FILE`): a cold and a warm epoch read every
    sample once, the bodies received by `HttpReceiver` (`http.client` with the `ssl` module); the same
    with `transport="obstore-stream"`."""
    from s3_fixtures import make_tls_files

    from bench.remote import Nginx

    root = tmp_path / "root"
    n = 400
    write(({"x": np.full(3000, i % 251, np.uint8), "label": i} for i in range(n)), str(root / "ds"),
          shard_size=300_000, progress=False)
    tls = make_tls_files(str(tmp_path))
    monkeypatch.setenv("SSL_CERT_FILE", tls.ca)
    try:
        server = Nginx(str(root), str(tmp_path), tls=(tls.cert, tls.key))
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        assert server.url.startswith("https://")
        for transport in ("auto", "obstore-stream"):
            ds = open_dataset(f"{server.url}/ds", cache_dir=str(tmp_path / f"c-{transport}"), cache_limit="64MB",
                              transport=transport)
            receiver = ds.storage.obstore.receiver
            assert (receiver is None) == (transport == "obstore-stream")
            for _ in range(2):
                seen = []
                for batch in Loader(ds, batch_size=64, num_workers=2, worker_type="thread"):
                    assert (batch["x"][:, -1].numpy() == batch["label"].numpy() % 251).all()
                    seen += batch["label"].tolist()
                assert sorted(seen) == list(range(n))
            ds.close()
            ds.storage.close()
    finally:
        server.stop()


def test_bench_remote_receivers_runs_both_receivers(tmp_path):
    """`python -m bench.remote_receivers`: both receivers' rows, every body's xxh3 checked."""
    import shutil as _shutil

    if _shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        pytest.skip("nginx not found")
    from bench.remote_receivers import main

    res = main(["--objects", "4", "--size", "2MB", "--rounds", "1", "--tls"])
    assert set(res["rows"]) == {"http", "obstore"}
    assert all(len(v) == 1 and v[0] > 0 for row in res["rows"].values() for k, v in row.items() if k == "MB/s")
