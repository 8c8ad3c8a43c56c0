"""Remote datasets against a real S3 endpoint (moto server) through a fault-injecting proxy."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest
from s3_fixtures import (  # noqa: F401
    FaultProxy,
    MotoServer,
    moto,
    s3_bucket,
    storage_options,
    upload_dir,
)

from fastload.formats import FastloadDataset, FormatError, Ragged, write
from fastload.order.shard_shuffle import ShardWindowSampler
from fastload.remote.cache.files import disk_bytes
from fastload.remote.cache.shard_cache import CacheBudgetError, ShardCache
from fastload.remote.storage import RemoteFetchError, RemoteStorage, RetryPolicy

NUM_SAMPLES = 1200
SHARD = "150KB"
FAST_RETRY = RetryPolicy(attempts=12, base=0.02, cap=0.5)


def _samples():
    rng = np.random.default_rng(0)
    for i in range(NUM_SAMPLES):
        yield {
            "x": rng.integers(0, 255, size=(400,), dtype=np.uint8),
            "label": i % 10,
            "blob": rng.bytes(int(rng.integers(10, 1500))),
        }


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ds") / "ds"
    write(_samples(), out, shard_size=SHARD, progress=False)
    return str(out)


@pytest.fixture(scope="module")
def remote(moto: MotoServer, local_ds: str) -> str:  # noqa: F811 - pytest fixture
    client = moto.client()
    client.create_bucket(Bucket="data")
    upload_dir(client, local_ds, "data", "ds")
    return "s3://data/ds"


@pytest.fixture
def proxy(moto: MotoServer):  # noqa: F811 - pytest fixture
    p = FaultProxy(moto.port).start()
    yield p
    p.stop()


def open_remote(url: str, endpoint: str, **kw: Any) -> FastloadDataset:
    """Through `fastload.open_dataset` when it exists, else the same objects built directly."""
    opts = storage_options(endpoint)
    import fastload

    if hasattr(fastload, "open_dataset") and not set(kw) - {"cache_dir", "cache_limit"}:
        return fastload.open_dataset(
            url, storage_options=opts, cache_dir=kw["cache_dir"], cache_limit=kw.get("cache_limit")
        )
    kw.setdefault("retry", FAST_RETRY)
    storage = RemoteStorage(url, storage_options=opts, **kw)
    return FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)


def shard_names(ds: FastloadDataset, order: list[int]) -> list[str]:
    return [ds.manifest.shards[k].file for k in order]


def assert_same(batch: dict, ref: dict) -> None:
    assert batch.keys() == ref.keys()
    for k, v in ref.items():
        if isinstance(v, Ragged):
            assert np.array_equal(batch[k].offsets, v.offsets) and batch[k].values.tobytes() == v.values.tobytes(), k
        else:
            assert np.array_equal(batch[k], v), k


def run_epoch(
    ds: FastloadDataset, local: FastloadDataset, sampler: ShardWindowSampler, *, batch: int = 48, on_batch=None
) -> dict[str, Any]:
    """Read one epoch in `sampler` order, compare every batch with the local dataset byte for byte."""
    order = list(sampler)
    seen = np.zeros(len(ds), dtype=np.int64)
    peak = 0
    for b, lo in enumerate(range(0, len(order), batch)):
        idx = order[lo : lo + batch]
        assert_same(ds.get_batch(idx), local.get_batch(idx))
        np.add.at(seen, idx, 1)
        peak = max(peak, ds.storage.cache.disk_bytes())
        if on_batch is not None:
            on_batch(b)
    ds.close()
    return {"seen": seen, "peak": peak}


def budget(cache_dir: Any, shards: int, biggest: int) -> int:
    """A cache_limit that holds `shards` shards of `biggest` bytes at their footprint on the cache's
    file system, plus its state files (with a block to spare for the state's growth)."""
    probe = ShardCache(cache_dir, limit=1 << 30)
    try:
        return shards * probe.footprint(biggest) + probe.state_bytes() + probe.block
    finally:
        probe.close()


def shard_gets(proxy: FaultProxy) -> int:
    return proxy.gets("/data/ds/shards/")


def test_epochs_from_s3_equal_local_and_second_epoch_makes_no_gets(remote, local_ds, proxy, tmp_path):
    local = FastloadDataset(local_ds)
    limit = 4_000_000
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=limit)
    sampler = ShardWindowSampler.from_dataset(ds, window=3, seed=1)
    out = run_epoch(ds, local, sampler)
    assert (out["seen"] == 1).all()
    assert out["peak"] <= limit
    assert shard_gets(proxy) == local.num_shards  # each shard fetched once, whole
    proxy.reset_counts()
    sampler.set_epoch(1)
    out = run_epoch(ds, local, sampler)
    assert (out["seen"] == 1).all()
    assert shard_gets(proxy) == 0
    # a new loader on the same cache directory (the next job) reads no shard either
    again = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=limit)
    assert (run_epoch(again, local, sampler)["seen"] == 1).all()
    assert shard_gets(proxy) == 0


def test_budget_of_three_shards_evicts_and_completes(remote, local_ds, proxy, tmp_path):
    local = FastloadDataset(local_ds)
    biggest = max(s.bytes for s in local.manifest.shards)
    limit = budget(tmp_path, 3, biggest)
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=limit, prefetch_depth=1)
    assert ds.storage.max_open_shards == 2
    sampler = ShardWindowSampler.from_dataset(ds, window=1, seed=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        out = run_epoch(ds, local, sampler, batch=32)
        assert (out["seen"] == 1).all()
        assert out["peak"] <= limit
    assert shard_gets(proxy) >= 2 * local.num_shards - 3  # evicted shards were fetched again


def test_too_small_budget_fails_at_construction(remote, local_ds, proxy, tmp_path):
    biggest = max(s.bytes for s in FastloadDataset(local_ds).manifest.shards)
    with pytest.raises(CacheBudgetError, match=r"cache_limit=.*the 2 shards it needs at least"):
        open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=int(1.5 * biggest))
    with pytest.raises(CacheBudgetError, match=r"max_open_shards \+ 1 = 9 shards"):
        RemoteStorage(
            remote,
            storage_options=storage_options(proxy.endpoint),
            cache_dir=tmp_path,
            cache_limit=4 * biggest,
            max_open_shards=8,
        )
    assert shard_gets(proxy) == 0


def _loader_process(ds_bytes: bytes, local_dir: str, seed: int, barrier) -> None:
    ds = pickle.loads(ds_bytes)
    local = FastloadDataset(local_dir)
    barrier.wait()
    out = run_epoch(ds, local, ShardWindowSampler.from_dataset(ds, window=2, seed=seed))
    assert (out["seen"] == 1).all()


def test_two_loaders_share_one_cache_dir(remote, local_ds, proxy, tmp_path):
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB")
    blob = pickle.dumps(ds)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_loader_process, args=(blob, local_ds, seed, barrier)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert shard_gets(proxy) == ds.num_shards  # the second loader waited for, then reused, the first's downloads


def test_injected_503s_resets_and_short_bodies(remote, local_ds, proxy, tmp_path):
    proxy.fail_rate = 0.1
    local = FastloadDataset(local_ds)
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB")
    sampler = ShardWindowSampler.from_dataset(ds, window=2, seed=3)
    for epoch in range(10):  # until enough faults of each kind were injected (about 4 per epoch)
        sampler.set_epoch(epoch)
        ds.storage.cache.clear()  # fetch everything again through the faults
        assert (run_epoch(ds, local, sampler)["seen"] == 1).all()
        if sum(proxy.fault_counts.values()) >= 8 and set(proxy.fault_counts) >= {"503", "drop", "truncate"}:
            break
    assert sum(proxy.fault_counts.values()) >= 8, proxy.fault_counts
    assert set(proxy.fault_counts) >= {"503", "drop", "truncate"}


def test_server_killed_and_restarted_mid_epoch(local_ds, tmp_path):
    server = MotoServer().start()
    client = server.client()
    client.create_bucket(Bucket="data")
    upload_dir(client, local_ds, "data", "ds")
    proxy = FaultProxy(server.port).start()
    local = FastloadDataset(local_ds)
    ds = open_remote(
        "s3://data/ds",
        proxy.endpoint,
        cache_dir=tmp_path,
        cache_limit="10MB",
        prefetch_depth=1,
        retry=RetryPolicy(attempts=30, base=0.05, cap=0.5),
    )
    outage = threading.Event()

    def recover() -> None:
        time.sleep(0.5)
        proxy.down = True  # S3 answers 503 while the restarted node gets its data back
        server.start()
        c = server.client()
        c.create_bucket(Bucket="data")
        upload_dir(c, local_ds, "data", "ds")
        proxy.down = False
        outage.set()

    helper = threading.Thread(target=recover)

    def on_batch(b: int) -> None:
        if b == 3:  # the server goes down before the epoch reads on, and comes back while it does
            server.kill()  # connections refused: the proxy resets them
            helper.start()

    try:
        out = run_epoch(ds, local, ShardWindowSampler.from_dataset(ds, window=1, seed=4), batch=32, on_batch=on_batch)
        helper.join()
        assert outage.is_set()
        assert (out["seen"] == 1).all()
        # The outage was hit: requests failed at the proxy. Who retried them (fastload's RetryPolicy or
        # s3fs's own inner retries, which a short outage can hide from fastload) is not fixed.
        assert sum(proxy.fault_counts.values()) >= 1
    finally:
        proxy.stop()
        server.kill()


def test_exhausted_retries_name_the_url(remote, local_ds, proxy, tmp_path):
    ds = open_remote(
        remote,
        proxy.endpoint,
        cache_dir=tmp_path,
        cache_limit="10MB",
        prefetch_depth=0,
        retry=RetryPolicy(attempts=3, base=0.01, cap=0.02),
    )
    proxy.down = True
    name = ds.manifest.shards[0].file
    with pytest.raises(RemoteFetchError, match=rf"s3://data/ds/{name}: giving up after 3 attempts"):
        ds[0]
    assert ds.storage.cache.usage()["bytes"] == 0
    proxy.down = False
    assert ds[0]["label"] == 0


def test_missing_object_and_bad_names_are_not_retried(remote, proxy, tmp_path):
    st = RemoteStorage(remote, storage_options=storage_options(proxy.endpoint), cache_dir=tmp_path, cache_limit="10MB")
    for bad in ("../ds2/index.json", "/etc/passwd", "shards/../../x", "s3://other/x"):
        with pytest.raises(FormatError):
            st.acquire(bad, size=1, xxh3="0")
    proxy.reset_counts()
    with pytest.raises(FileNotFoundError, match="s3://data/ds/shards/nope"):
        st.acquire("shards/nope", size=10, xxh3="0")
    assert sum(proxy.counts.values()) <= 3  # no retry loop on a 404


def _threads(name: str) -> set:
    return {t for t in threading.enumerate() if t.name == name and t.is_alive()}


def test_prefetch_fetches_ahead_within_depth(remote, local_ds, proxy, tmp_path):
    before = _threads("fastload-prefetch")
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB", prefetch_depth=3)
    st: RemoteStorage = ds.storage
    names = shard_names(ds, list(range(ds.num_shards)))
    st.prefetch(names)
    deadline = time.monotonic() + 20
    while st.stats()["remote_prefetched"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    assert st.stats()["remote_prefetched"] == 3 and shard_gets(proxy) == 3  # depth 3, no further
    st.acquire(names[0], size=ds.manifest.shards[0].bytes, xxh3=ds.manifest.shards[0].xxh3)
    assert proxy.gets(f"/data/ds/{names[0]}") == 1  # already there (the window may slide meanwhile)
    deadline = time.monotonic() + 20
    while shard_gets(proxy) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shard_gets(proxy) == 4  # the window slid by one
    st.release(names[0])
    assert _threads("fastload-prefetch") - before  # running until close
    st.close()
    assert _threads("fastload-prefetch") <= before  # every prefetch thread of this storage ended


def test_memory_filesystem(local_ds, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for dirpath, _, files in os.walk(local_ds):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                fs.pipe_file(f"/mem-ds/{os.path.relpath(os.path.join(dirpath, f), local_ds)}", fh.read())
    storage = RemoteStorage("memory://mem-ds", cache_dir=tmp_path, cache_limit="10MB")
    ds = FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)
    local = FastloadDataset(local_ds)
    idx = np.random.default_rng(0).permutation(len(ds))[:300]
    assert_same(ds.get_batch(idx), local.get_batch(idx))


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_loader_epochs_and_resume_over_s3(remote, local_ds, proxy, tmp_path, worker_type):
    from fastload.loader import Loader

    local = FastloadDataset(local_ds)
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB")
    sampler = ShardWindowSampler.from_dataset(ds, window=2, seed=7)

    def check(loader: Loader, epoch: int, skip: int = 0, stop: int | None = None) -> int:
        order = sampler.indices(epoch)
        n = 0
        for b, batch in enumerate(loader, start=skip):
            ref = local.get_batch(order[b * 40 : (b + 1) * 40])
            assert np.array_equal(batch["x"].numpy(), ref["x"]) and batch["blob"] == ref["blob"].to_list()
            n += len(batch["blob"])
            if stop is not None and b + 1 == stop:
                break
        return n

    for epoch in range(2):
        proxy.reset_counts()
        loader = Loader(ds, batch_size=40, sampler=sampler, num_workers=2, worker_type=worker_type)
        loader.set_epoch(epoch)
        assert check(loader, epoch) == len(ds)
        if epoch == 1:
            assert shard_gets(proxy) == 0
    # exact resume in the middle of epoch 1
    loader = Loader(ds, batch_size=40, sampler=sampler, num_workers=2, worker_type=worker_type)
    loader.set_epoch(1)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    del it
    fresh = ShardWindowSampler.from_dataset(ds, window=2, seed=7)
    resumed = Loader(ds, batch_size=40, sampler=fresh, num_workers=2, worker_type=worker_type)
    resumed.load_state_dict(state)
    sampler = fresh
    assert check(resumed, 1, skip=7) == len(ds) - 7 * 40


def test_stream_writes_on_the_event_loop_in_pieces_and_a_failing_write_stops_the_get(
    remote, local_ds, proxy, tmp_path
):
    """The fsspec transport's streamed GET (`stream_into` on `ReceiveLoops`, what `RemoteStorage` runs
    on s3fs) writes bodies in pieces on its loop threads, one request per object."""
    from fastload.formats import ChecksumError
    from fastload.remote.get import stream_into
    from fastload.remote.receive_loops import ReceiveLoops
    from fastload.remote.transfer_stats import TransferStats

    before = _threads("fastload-receive")
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB", transport="fsspec")
    st: RemoteStorage = ds.storage
    info = ds.manifest.shards[0]
    loops = ReceiveLoops(url=st.url, storage_options=st.storage_options, count=1)
    chunk = 16 << 10

    class Sink:
        def __init__(self, fail_after: int | None = None) -> None:
            self.parts: list[bytes] = []
            self.threads: set[str] = set()
            self.fail_after = fail_after
            self.size = info.bytes

        def write(self, b: bytes) -> None:
            self.threads.add(threading.current_thread().name)
            self.parts.append(bytes(b))
            if self.fail_after is not None and len(self.parts) >= self.fail_after:
                raise ChecksumError("more bytes than the manifest records")

    def get(sink: Sink) -> TransferStats:
        stats = TransferStats()
        loops.run(stream_into, st.remote_path(info.file), sink, chunk, stats)  # NoStream if it could not stream
        return stats

    sink = Sink()
    stats = get(sink)
    with open(os.path.join(local_ds, info.file), "rb") as fh:
        assert b"".join(sink.parts) == fh.read()
    assert len(sink.parts) >= info.bytes // chunk  # streamed in pieces, not one buffer
    assert sink.threads == {"fastload-receive"}  # written by a receive loop's thread, not the caller
    assert stats.received() == info.bytes and shard_gets(proxy) == 1  # one GET, no HEAD before it
    # an error raised by a write reaches the caller and the half-read response is dropped
    with pytest.raises(ChecksumError):
        get(Sink(fail_after=2))
    full = Sink()
    get(full)  # the connection pool still works
    assert sum(map(len, full.parts)) == info.bytes
    loops.close()
    ds.close()
    st.close()
    assert _threads("fastload-receive") <= before  # the receive loops ended


# -- budget: bytes on disk, readers sharing one cache --------------------------------------------------
def test_disk_bytes_stay_within_budget_at_every_moment(remote, local_ds, proxy, tmp_path):
    """A 3.2-shard budget with prefetching: a thread samples the bytes in data/ + tmp/ (downloads in
    flight included) all through two epochs."""
    local = FastloadDataset(local_ds)
    biggest = max(s.bytes for s in local.manifest.shards)
    limit = int(3.2 * biggest)
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=limit, prefetch_depth=2)
    stop, peak, samples = threading.Event(), [0], [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(str(tmp_path)))
            samples[0] += 1
            time.sleep(0.0001)

    sampler_thread = threading.Thread(target=sample)
    sampler_thread.start()
    try:
        sampler = ShardWindowSampler.from_dataset(ds, window=1, seed=2)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            assert (run_epoch(ds, local, sampler, batch=32)["seen"] == 1).all()
    finally:
        stop.set()
        sampler_thread.join()
    assert samples[0] > 100 and 0 < peak[0] <= limit, (peak[0] / biggest, samples[0])
    assert ds.storage.stats()["remote_fetched"] > local.num_shards  # evictions happened: the budget was tight


def _read_epoch(ds: FastloadDataset, local: FastloadDataset, seed: int, errors: list) -> None:
    """One epoch through a `fastload.Loader`, every batch equal to the local dataset's."""
    from fastload import Loader

    try:
        sampler = ShardWindowSampler.from_dataset(ds, window=2, seed=seed)
        order = list(sampler)
        n = 0
        for b, batch in enumerate(Loader(ds, batch_size=32, sampler=sampler)):
            ref = local.get_batch(order[b * 32 : (b + 1) * 32])
            assert np.array_equal(np.asarray(batch["x"]), ref["x"]) and np.array_equal(
                np.asarray(batch["label"]), ref["label"]
            )
            n += len(batch["label"])
        assert n == len(local)
        ds.close()
    except BaseException as exc:  # noqa: BLE001 - checked by the test
        errors.append(exc)


def test_two_loaders_in_one_process_at_the_documented_minimum(remote, local_ds, proxy, tmp_path):
    """Minimum = the sum of the readers' (max_open_shards + 1) x largest shard; the error for a third
    reader names the budget it needs, and that budget works."""
    local = FastloadDataset(local_ds)
    biggest = max(s.bytes for s in local.manifest.shards)
    limit = budget(tmp_path, 2 * (1 + 1), biggest)
    readers = [
        open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=limit, max_open_shards=1) for _ in range(2)
    ]
    errors: list = []
    threads = [threading.Thread(target=_read_epoch, args=(ds, local, seed, errors)) for seed, ds in enumerate(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    for ds in readers:  # both reading again: a third reader does not fit next to them
        ds[0]
    third = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=limit, max_open_shards=1)
    with pytest.raises(CacheBudgetError, match=r"use cache_limit >= ") as info:
        third[0]
    need = int(info.value.args[0].split("use cache_limit >= ")[1].split(" ")[0])
    footprint = ShardCache(tmp_path, limit=limit).footprint(biggest)
    assert 3 * 2 * footprint < need < budget(tmp_path, 3 * 2, biggest)  # the shards plus the state files
    roomy = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit=need, max_open_shards=1)
    _read_epoch(roomy, local, 5, errors)
    assert errors == []


def _minimum_budget_process(url: str, endpoint: str, cache_dir: str, limit: int, local_dir: str, seed: int, barrier):
    ds = open_remote(url, endpoint, cache_dir=cache_dir, cache_limit=limit, max_open_shards=1)
    barrier.wait()
    out = run_epoch(ds, FastloadDataset(local_dir), ShardWindowSampler.from_dataset(ds, window=2, seed=seed), batch=32)
    assert (out["seen"] == 1).all()


def test_two_processes_at_the_documented_minimum(remote, local_ds, proxy, tmp_path):
    biggest = max(s.bytes for s in FastloadDataset(local_ds).manifest.shards)
    limit = budget(tmp_path, 2 * (1 + 1), biggest)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    args = (remote, proxy.endpoint, str(tmp_path), limit, local_ds)
    procs = [ctx.Process(target=_minimum_budget_process, args=(*args, seed, barrier)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]


def test_cached_shard_damaged_with_stamp_restored_is_refetched(remote, local_ds, proxy, tmp_path):
    local = FastloadDataset(local_ds)
    ds = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB")
    sampler = ShardWindowSampler.from_dataset(ds, window=2, seed=1)
    run_epoch(ds, local, sampler)
    ds.storage.cache.close()
    data_dir = os.path.join(tmp_path, "data")
    victim = os.path.join(data_dir, sorted(os.listdir(data_dir))[0])
    st = os.stat(victim)
    with open(victim, "r+b") as fh:
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    proxy.reset_counts()
    again = open_remote(remote, proxy.endpoint, cache_dir=tmp_path, cache_limit="10MB")
    assert (run_epoch(again, local, sampler)["seen"] == 1).all()
    assert shard_gets(proxy) == 1  # the damaged shard, and only it, was fetched again


# -- bounded waits -------------------------------------------------------------------------------------
class FrozenServer:
    """Accepts TCP connections on 127.0.0.1 and never answers."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted += 1

    def stop(self) -> None:
        import socket

        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)
        for c in self.conns:
            c.close()


SHORT_WAITS = {
    "connect_timeout": 0.5,
    "read_timeout": 0.5,
    "retry": RetryPolicy(attempts=4, base=0.05, cap=0.1, total=3),
}


@pytest.mark.parametrize(("transport", "error"), [("auto", "TimeoutError"), ("fsspec", "ReadTimeoutError")])
def test_frozen_server_ends_in_a_clear_error(tmp_path, transport, error):
    server = FrozenServer()
    try:
        opts = storage_options(f"http://127.0.0.1:{server.port}")
        del opts["config_kwargs"]  # RemoteStorage's own timeouts apply
        t0 = time.monotonic()
        pattern = rf"s3://data/ds/index\.json: giving up after \d+ attempts in .*last error {error}: "
        with pytest.raises(RemoteFetchError, match=pattern):
            RemoteStorage("s3://data/ds", storage_options=opts, cache_dir=tmp_path, cache_limit="10MB",
                          transport=transport, **SHORT_WAITS)
        took = time.monotonic() - t0
        assert took < 10, took  # budget 3 s + one attempt (0.5 s connect + 0.5 s read) + client start-up
        assert server.accepted >= 1  # connected, then each attempt timed out on the read
    finally:
        server.stop()


def test_server_killed_mid_epoch_ends_in_a_clear_error(local_ds, tmp_path):
    server = MotoServer().start()
    try:
        client = server.client()
        client.create_bucket(Bucket="data")
        upload_dir(client, local_ds, "data", "ds")
        opts = storage_options(server.endpoint)
        del opts["config_kwargs"]
        storage = RemoteStorage(
            "s3://data/ds",
            storage_options=opts,
            cache_dir=tmp_path,
            cache_limit="10MB",
            prefetch_depth=0,
            **SHORT_WAITS,
        )
        ds = FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)
        assert ds[0]["label"] == 0
        server.kill()
        last = ds.manifest.shards[-1].file
        t0 = time.monotonic()
        with pytest.raises(RemoteFetchError, match=rf"s3://data/ds/{last}: giving up after \d+ attempts"):
            ds[len(ds) - 1]
        assert time.monotonic() - t0 < 10
    finally:
        server.kill()
