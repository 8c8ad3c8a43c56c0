"""Shards read while they arrive: a reader waits only for the verified blocks it reads (issue 35).

An HTTP server with `Range` support holds every shard body at a byte offset (`ArrivalServer`): a
batch is served while the shards are held there, byte for byte; a connection dropped mid-shard, or
a block corrupted in transit, ends in the exact bytes after a retry, a block corrupt at the source in
an error naming the shard and the block, a frozen server in the download's error. `Download` is
checked over arbitrary arrival orders, retries and out-of-order block fetches (hypothesis).
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
import weakref

import numpy as np
import pytest
import xxhash
from http_arrival import ArrivalServer
from http_faults import ShardServer
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload import Loader
from fastload.formats import FastloadDataset, write
from fastload.formats.blocks import table_span
from fastload.formats.errors import ChecksumError
from fastload.remote import first_batch
from fastload.remote.cache.arrival import STALLED_S, STEAL_AHEAD, Arrival, BlockSpec
from fastload.remote.cache.files import Download
from fastload.remote.storage import DOWNLOAD_CHUNK, RemoteFetchError, RemoteStorage, RetryPolicy

N = 600
HELD = 1_500_000  # the byte each shard body is held at (of about 2 MB)


def _sample(i: int) -> dict:
    return {"x": np.full(8000, i % 251, np.uint8), "b": bytes([i % 256]) * (i % 97), "label": i}


def _variant(src: str, dst: str, *, blocks: str) -> None:
    """A copy of the dataset at `src` whose `blocks.bin` has a byte of shard 1's table flipped
    ("corrupt"), is missing ("missing"), or is not named by the manifest ("none": as datasets written
    before it existed; the manifest re-signed)."""
    import json
    import pathlib

    shutil.copytree(src, dst)
    manifest, tables = pathlib.Path(dst, "index.json"), pathlib.Path(dst, "blocks.bin")
    body = json.loads(manifest.read_bytes())
    if blocks == "corrupt":
        data = bytearray(tables.read_bytes())
        data[8 * table_span(body["shards"][0]["bytes"], body["block_log2"])[1] + 3] ^= 0x40  # in shard 1's
        tables.write_bytes(bytes(data))
    elif blocks == "missing":
        tables.unlink()
    elif blocks == "none":
        del body["blocks"], body["checksum"]
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["checksum"] = xxhash.xxh3_64_hexdigest(canonical)
        manifest.write_text(json.dumps(body))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("arrival") / "root"
    write((_sample(i) for i in range(N)), str(root / "ds"), shard_size=2_000_000, progress=False)
    for kind in ("corrupt", "missing", "none"):
        _variant(str(root / "ds"), str(root / f"ds-blocks-{kind}"), blocks=kind)
    return str(root), FastloadDataset(str(root / "ds"))


@pytest.fixture()
def server(dataset):
    srv = ArrivalServer(dataset[0])
    yield srv
    srv.stop()


def _open(url: str, cache_dir: str, **kw) -> FastloadDataset:
    storage = RemoteStorage(url, cache_dir=cache_dir, cache_limit="64MB", arriving_min_bytes=0, **kw)
    return FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        if hasattr(b, "offsets"):
            assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.values, b.values), name
        else:
            assert np.array_equal(a, b), name


def _cached(ds: FastloadDataset) -> list[str]:
    return os.listdir(ds.storage.cache.data_dir)


def _wait_cached(ds: FastloadDataset, name: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not any(n.endswith(name) for n in _cached(ds)):
        assert time.monotonic() < deadline, f"{name} never arrived"
        time.sleep(0.02)


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
@pytest.mark.parametrize("prefetch_depth", [0, None])
def test_a_batch_is_served_while_its_shard_is_held_mid_body(dataset, server, tmp_path, transport, prefetch_depth):
    _, local = dataset
    server.pause(HELD)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport=transport, prefetch_depth=prefetch_depth)
    first, n0 = np.arange(16), local.manifest.shards[0].num_samples
    shuffled = np.random.default_rng(0).permutation(n0)[:32]  # samples from all over shard 0
    for rows in (first, shuffled):
        _same(ds.get_batch(rows), local.get_batch(rows))
    # the download reaches the held byte (it may after the batch came) and stays there: shard 0 is not whole
    assert server.paused.wait(10) and server.pause_at == HELD
    assert not any(name.endswith("shard-00000.fls") for name in _cached(ds))
    assert ds.storage.stats()["remote_side_gets"] >= 1  # the label column lies at the end of the shard
    server.release()
    everything = np.arange(N)
    _same(ds.get_batch(everything), local.get_batch(everything))
    ds.close()
    ds.storage.close()
    for s in local.manifest.shards:  # the downloads finish in the background
        _wait_cached(ds, s.file.rsplit("/", 1)[-1])
    assert ds.storage.cache.pinned_keys() == {} and ds.storage.cache.usage()["retired"] == 0
    assert os.listdir(ds.storage.cache.tmp_dir) == []  # nothing left behind


@pytest.mark.parametrize(("workers", "worker_type"), [(0, "thread"), (2, "thread")])
def test_a_loaders_first_batch_comes_while_the_shard_is_held(dataset, server, tmp_path, workers, worker_type):
    _, local = dataset
    server.pause(HELD)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"))
    it = iter(Loader(ds, batch_size=16, num_workers=workers, worker_type=worker_type, shuffle=False))
    batch = next(it)
    # the download's GET reaches the held byte (it may after the batch came) and stays there
    assert server.paused.wait(10) and server.pause_at == HELD
    assert not any(name.endswith("shard-00000.fls") for name in _cached(ds))
    want = local.get_batch(np.arange(16))
    assert np.array_equal(batch["x"].numpy(), want["x"]) and batch["label"].tolist() == list(range(16))
    server.release()
    seen = 16 + sum(len(b["label"]) for b in it)
    assert seen == N
    ds.close()
    ds.storage.close()


def test_only_an_epochs_first_batch_fetches_ahead_of_the_downloads(dataset, server, tmp_path, monkeypatch):
    """The first read of an epoch (`bind_run`) fetches the blocks it waits for ahead of the shards'
    downloads; every other read follows them: later ones, those begun beside it (other workers), and
    those of shards opened after it. A new epoch starts over; a rebind of the same epoch does not."""
    from types import SimpleNamespace

    from fastload.formats.shard import ShardReader

    asked: dict[int, list[bool]] = {}  # thread -> `ahead` of each of its reads' block checks
    ensure = ShardReader.ensure_fields

    def recording(self, fields, rows, *, ahead=False):
        asked.setdefault(threading.get_ident(), []).append(ahead)
        return ensure(self, fields, rows, ahead=ahead)

    monkeypatch.setattr(ShardReader, "ensure_fields", recording)
    _, local = dataset
    server.pause(HELD)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"))
    n0 = local.manifest.shards[0].num_samples

    def reads(*batches) -> list[list[bool]]:
        """Read `batches` at once, one thread each; each thread's `ahead` values."""
        asked.clear()
        got = [None] * len(batches)
        barrier = threading.Barrier(len(batches))

        def read(i):
            barrier.wait()
            got[i] = ds.get_batch(batches[i])

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(batches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for rows, batch in zip(batches, got):
            _same(batch, local.get_batch(rows))
        return sorted(asked.values())

    ds.bind_run(SimpleNamespace(epoch=0))
    assert reads(np.arange(16), np.arange(16, 32)) == [[False], [True]]  # two workers: one fetches ahead
    assert reads(np.arange(32, 48)) == [[False]]
    assert reads(np.arange(n0, n0 + 16)) == [[False]]  # shard 1, opened after the first batch
    ds.bind_run(SimpleNamespace(epoch=0))  # the same epoch again (a rebind): nothing changes
    assert reads(np.arange(48, 64)) == [[False]]
    ds.bind_run(SimpleNamespace(epoch=1))
    assert reads(np.arange(n0 + 16, n0 + 32)) == [[True]]
    assert reads(np.arange(64, 80)) == [[False]]
    server.release()
    ds.close()
    ds.storage.close()


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_an_epochs_first_batch_holds_back_the_gets_it_does_not_wait_for(dataset, server, tmp_path, monkeypatch,
                                                                      transport):
    """From a new epoch's start (`bind_run`) until its first batch is served, the storage prefetches no
    shard and downloads the shard it reads in one GET at a time instead of one per part (the first
    batch's own GETs run); once the batch is served, the other parts and the prefetches start."""
    from types import SimpleNamespace

    monkeypatch.setattr(first_batch, "FIRST_BATCH_HOLD_S", 60.0)  # only the served batch ends the hold here
    lock, active, peak, seen = threading.Lock(), {}, {}, []
    range_into = RemoteStorage._range_into

    def counted(self, rpath, sink, claim, start, end, chunk):
        if chunk != DOWNLOAD_CHUNK:  # a reader's own GET (a long run of wanted blocks)
            return range_into(self, rpath, sink, claim, start, end, chunk)
        with lock:
            active[rpath] = active.get(rpath, 0) + 1
            peak[rpath] = max(peak.get(rpath, 0), active[rpath])
            seen.append(rpath)
        try:
            return range_into(self, rpath, sink, claim, start, end, chunk)
        finally:
            with lock:
                active[rpath] -= 1

    at_release = []
    served = RemoteStorage.first_batch_served

    def snapshot(self):
        lanes = {t.name for t in threading.enumerate() if t.name.startswith("fastload-part")}
        with lock:
            at_release.append((dict(peak), set(seen), lanes))
        served(self)

    monkeypatch.setattr(RemoteStorage, "_range_into", counted)
    monkeypatch.setattr(RemoteStorage, "first_batch_served", snapshot)
    _, local = dataset
    server.pause(HELD)  # shard 0's download stops at that byte: the batch is served while it is held
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport=transport, part_bytes=200_000)
    first = ds.manifest.shards[0].file
    ds.bind_run(SimpleNamespace(epoch=0))
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))
    time.sleep(0.2)
    ((peaks, paths, lanes),) = at_release
    assert {p.rsplit("/", 1)[-1] for p in paths} == {first.rsplit("/", 1)[-1]}  # no prefetch while held
    assert max(peaks.values()) == 1  # one download GET at a time while held
    assert len(lanes) <= 1, lanes  # the other parts' threads start once the hold is off, not beside the first GET
    server.release()
    deadline = time.monotonic() + 20
    while len(set(seen)) < len(local.manifest.shards) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(set(seen)) == len(local.manifest.shards)  # the prefetches ran once the batch was served
    assert max(peak.values()) > 1  # and the parts of a shard came at once
    everything = np.arange(N)
    _same(ds.get_batch(everything), local.get_batch(everything))
    ds.close()
    ds.bind_run(SimpleNamespace(epoch=1))  # every shard is open and whole now: no hold
    assert len(at_release) == 1
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))
    ds.storage.close()


@pytest.mark.parametrize(("rows", "bulk", "held"), [
    ([20, 203], 64 << 10, False),  # two blocks far apart, 128 KiB through its own GETs: bulk at 64 KiB
    ([20, 203], None, True),  # the same under the default 16 MiB: the downloads stay held back
    (list(range(0, 150, 2)), None, False),  # most of the shard: left to its download, which runs whole
])
def test_a_first_batch_that_wants_bulk_or_waits_for_the_downloads_holds_nothing_back(
        dataset, server, tmp_path, monkeypatch, rows, bulk, held):
    """A first batch that asks for `FIRST_BATCH_BULK_BYTES` or more through GETs of its own ends the
    hold before it is served, and so does one that leaves its blocks to the downloads (`AHEAD_MOST`:
    it waits for them); a small one keeps it on until it is served. Either way the batch is exact."""
    from types import SimpleNamespace

    monkeypatch.setattr(first_batch, "FIRST_BATCH_HOLD_S", 60.0)
    if bulk is not None:
        monkeypatch.setattr(first_batch, "FIRST_BATCH_BULK_BYTES", bulk)
    on_when_served = []
    served = RemoteStorage.first_batch_served

    def snapshot(self):
        on_when_served.append(self._hold.remaining() > 0)
        served(self)

    monkeypatch.setattr(RemoteStorage, "first_batch_served", snapshot)
    _, local = dataset
    server.pause(100_000)  # the download stops there: the batch's own GETs bring what it reads
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"))
    ds.bind_run(SimpleNamespace(epoch=0))
    rows = np.array(rows)
    _same(ds.get_batch(rows), local.get_batch(rows))
    assert on_when_served == [held]
    server.release()
    ds.close()
    ds.storage.close()


def test_an_epochs_first_batch_asks_for_every_shards_blocks_before_waiting_for_any(dataset, server, tmp_path,
                                                                                monkeypatch):
    """A first batch over several arriving shards asks for the blocks of each (`Arrival.ask`) before it
    waits for those of the first: their GETs run at once, not one shard's after another's (at an object
    store's first-byte latency, one round trip instead of one per shard). Later batches only wait."""
    from types import SimpleNamespace

    events = []
    ask, wait = Arrival.ask, Arrival.wait

    def asked(self, ids, *, ahead=True):
        events.append(("ask", os.path.basename(self.where)))
        return ask(self, ids, ahead=ahead)

    def waited(self, ids, *, ahead=True):
        events.append(("wait", os.path.basename(self.where)))
        return wait(self, ids, ahead=ahead)

    monkeypatch.setattr(Arrival, "ask", asked)
    monkeypatch.setattr(Arrival, "wait", waited)
    _, local = dataset
    server.pause(100_000)  # the downloads stop there: the batch's own GETs bring what it reads
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"))
    ds.bind_run(SimpleNamespace(epoch=0))
    per = ds.manifest.shards[0].num_samples
    rows = np.concatenate([k * per + np.arange(10, 60, 5) for k in range(3)])  # from each of the 3 shards
    _same(ds.get_batch(rows), local.get_batch(rows))
    shards = [os.path.basename(s.file) for s in ds.manifest.shards]
    assert sorted(w for e, w in events if e == "ask") == sorted(shards)
    # each shard's open waits for its header and tables; then every ask, then the waits for the rows
    assert events[-3:] == [("wait", s) for s in shards]
    assert max(i for i, (e, _) in enumerate(events) if e == "ask") < len(events) - 3
    events.clear()
    later = rows + 1
    _same(ds.get_batch(later), local.get_batch(later))
    assert [e for e, _ in events if e == "ask"] == []
    server.release()
    ds.close()
    ds.storage.close()


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_an_arriving_shards_block_table_comes_from_blocks_bin(dataset, server, tmp_path, transport):
    """The download of a shard installs its block table from the dataset's `blocks.bin` (one GET for
    every shard's): no GET of any shard's own table; each shard's header (block 0) comes in one GET,
    the download's first or a reader's own. Through fsspec, which may take a whole object for a range,
    the first shard's table is fetched from the shard (a range seen to come back as asked), the others'
    (opened after it) from blocks.bin."""
    _, local = dataset
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport=transport, prefetch_depth=0)
    _same(ds.get_batch(np.arange(N)), local.get_batch(np.arange(N)))
    ends = {f"ds/{s.file}": s.bytes for s in local.manifest.shards}
    tables = [p for p, _, b in server.gets if p in ends and b == ends[p]]
    assert len(tables) == (0 if transport == "obstore" else 1)
    assert [p for p, _, _ in server.gets].count("ds/blocks.bin") == 1
    for p in ends:
        body = sorted((a, b) for q, a, b in server.gets if q == p and b != ends[p])
        assert [a for a, _ in body].count(0) == 1  # the header comes in one GET
        if transport == "obstore":  # streamed GETs end where readers' GETs took over: no byte twice
            assert all(b <= c for (_, b), (c, _) in zip(body, body[1:]))
    stats = ds.storage.stats()
    assert stats["remote_table_pages"] == 1 and stats["remote_tables_rejected"] == 0
    ds.close()
    ds.storage.close()


def test_a_header_a_reader_waits_for_comes_in_a_get_of_its_own(dataset, server, tmp_path, monkeypatch):
    """A reader that waits for a shard's header (block 0) before the shard's download starts its GETs
    (an epoch's first shard) gets that block in a GET of its own, one block long; the download's first
    GET starts right after it, and no byte of the body is fetched twice."""
    _, local = dataset
    known = RemoteStorage._known_table
    waiting = threading.Event()
    ask = Arrival._ask

    def asked(self, ids, *, ahead=True):  # a wait's first step: the blocks are asked for
        ask(self, ids, ahead=ahead)
        waiting.set()

    def late(self, name):  # the download installs its table only once the reader asked for the header
        waiting.wait(10)
        return known(self, name)

    monkeypatch.setattr(Arrival, "_ask", asked)
    monkeypatch.setattr(RemoteStorage, "_known_table", late)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport="obstore", prefetch_depth=0)
    info, block = local.manifest.shards[0], 1 << local.manifest.block_log2
    rows = np.arange(info.num_samples)
    _same(ds.get_batch(rows), local.get_batch(rows))
    body = sorted((a, b) for p, a, b in server.gets if p == f"ds/{info.file}")
    assert body[:2] == [(0, block), (block, body[1][1])]
    assert all(b <= c for (_, b), (c, _) in zip(body, body[1:]))  # no range overlaps the next: bytes once
    assert body[-1][1] == table_span(info.bytes, local.manifest.block_log2)[0]
    ds.close()
    ds.storage.close()


@pytest.mark.parametrize("kind", ["corrupt", "missing"])
def test_a_shard_whose_table_in_blocks_bin_cannot_be_had_fetches_its_own(dataset, server, tmp_path, kind):
    """A table in `blocks.bin` that does not match the manifest's `blocks_xxh3` is not used: that shard's
    own table is fetched and its bytes come exact; without `blocks.bin` every shard's is."""
    _, local = dataset
    ds = _open(f"{server.url}/ds-blocks-{kind}", str(tmp_path / "c"), transport="obstore")
    _same(ds.get_batch(np.arange(N)), local.get_batch(np.arange(N)))
    ends = {f"ds-blocks-{kind}/{s.file}": s.bytes for s in local.manifest.shards}
    tables = sorted(p for p, _, b in server.gets if p in ends and b == ends[p])
    stats = ds.storage.stats()
    if kind == "corrupt":
        assert tables == [f"ds-blocks-{kind}/{local.manifest.shards[1].file}"]
        assert stats["remote_tables_rejected"] == 1
    else:
        assert tables == sorted(ends)
    ds.close()
    ds.storage.close()


def test_an_arriving_shards_header_comes_with_its_block_table(dataset, server, tmp_path):
    """Without `blocks.bin`, through obstore the GET of a shard's block table and the GET of its first
    block (the header, which a reader reads first) run at once, in one call: no GET after them brings
    block 0 again."""
    _, local = dataset
    server.pause(HELD)
    ds = _open(f"{server.url}/ds-blocks-none", str(tmp_path / "c"), transport="obstore", prefetch_depth=0)
    info, block = local.manifest.shards[0], 1 << local.manifest.block_log2
    reader = ds.shard(0)
    assert reader.arriving
    gets = [(a, b) for p, a, b in server.gets if p == f"ds-blocks-none/{info.file}"]
    table = next(g for g in gets if g[1] == info.bytes)
    assert set(gets[:2]) == {table, (0, block)}
    assert [g for g in gets if g[0] == 0] == [(0, block)]  # the download's own GETs start after block 0
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))
    server.release()
    ds.close()
    ds.storage.close()


def test_a_first_batch_hold_ends_when_released_or_after_its_limit():
    hold = first_batch.FirstBatchHold(limit_s=30)
    woken = []
    hold.on_release(lambda: woken.append(1))
    assert hold.remaining() == 0.0
    hold.wait()  # off: returns at once
    hold.begin()
    assert 29 < hold.remaining() <= 30
    started = threading.Event()
    waiter = threading.Thread(target=lambda: (started.set(), hold.wait()))
    waiter.start()
    started.wait(10)
    time.sleep(0.05)
    assert waiter.is_alive()  # held (30 s)
    hold.release()
    waiter.join(10)
    assert not waiter.is_alive() and woken == [1]  # the release ended the wait
    hold.release()  # released already: no second call
    assert woken == [1]
    short = first_batch.FirstBatchHold(limit_s=0.3)
    short.on_release(lambda: woken.append(2))
    t0 = time.monotonic()
    short.begin()
    assert 0 < short.remaining() <= 0.3
    short.wait()  # runs out by itself: no release call (waits bounded by `remaining` need none)
    assert 0.3 <= time.monotonic() - t0 < 5.0 and short.remaining() == 0.0 and woken == [1]


def test_a_first_batch_hold_ends_once_the_batch_wants_bulk():
    hold = first_batch.FirstBatchHold(limit_s=30, bulk_bytes=100)
    woken = []
    hold.on_release(lambda: woken.append(1))
    hold.wanted(500)  # off: nothing counts
    hold.begin()
    hold.wanted(60)
    assert hold.remaining() > 0 and woken == []
    hold.wanted(40)
    assert hold.remaining() == 0.0 and woken == [1]
    hold.begin()  # a new first batch counts from zero
    hold.wanted(99)
    assert hold.remaining() > 0
    hold.release()
    assert first_batch.FirstBatchHold().bulk_bytes == first_batch.FIRST_BATCH_BULK_BYTES


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_a_connection_dropped_mid_shard_is_retried_in_place(dataset, server, tmp_path, transport):
    """The retry rewrites the file in place: bytes a reader mapped before the drop stay what they were."""
    _, local = dataset
    server.pause(HELD)
    server.drop(HELD + 100_000, times=1)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport=transport, prefetch_depth=0)
    view = ds.shard(0).fixed["x"][:16]  # zero-copy: the mapped temp file itself
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))
    server.release()  # the held body goes on to the drop; the retry brings the whole shard
    _wait_cached(ds, "shard-00000.fls")
    assert ds.storage.stats()["remote_retries"] >= 1
    rows = np.arange(local.manifest.shards[0].num_samples)
    _same(ds.get_batch(rows), local.get_batch(rows))
    assert np.array_equal(view, local.get_batch(np.arange(16))["x"])
    _same(ds.get_batch(np.arange(N)), local.get_batch(np.arange(N)))
    ds.close()
    ds.storage.close()


def test_blocks_a_reader_fetched_ahead_are_not_received_again(tmp_path):
    """The download's GET is held near the start of a 16 MB shard while a reader reads all of it: the
    reader's own GETs take over the blocks the held GET has not brought, and once released the held
    GET stops where its blocks were taken, so every byte of the shard is received about once (not
    the reader's blocks twice), and the shard lands whole. (obstore streams GETs; fsspec's come whole.)"""
    root = tmp_path / "root"
    write((_sample(i) for i in range(2000)), str(root / "ds"), shard_size=32_000_000, progress=False)
    local = FastloadDataset(str(root / "ds"))
    info = local.manifest.shards[0]
    assert len(local.manifest.shards) == 1 and info.bytes > 6 * DOWNLOAD_CHUNK
    server = ArrivalServer(str(root))
    try:
        server.pause(100_000)
        ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport="obstore", prefetch_depth=0)
        rows = np.arange(info.num_samples)
        _same(ds.get_batch(rows), local.get_batch(rows))
        assert server.paused.wait(10) and server.pause_at == 100_000  # served while the download's GET is held
        server.release()
        _wait_cached(ds, "shard-00000.fls")
        stats = ds.storage.stats()
        assert stats["remote_side_bytes"] > info.bytes // 2
        # the held GET may receive a piece or two of its body (`DOWNLOAD_CHUNK` and what came with it) before
        # it learns its blocks were taken; a shard received twice over would pass `info.bytes + side bytes`
        assert stats["remote_bytes"] <= info.bytes + 2 * DOWNLOAD_CHUNK, stats
        ds.close()
        ds.storage.close()
    finally:
        server.stop()


def test_an_acquire_counts_as_a_get_in_flight_until_its_download_ends(dataset, server, tmp_path):
    """A reader's acquire holds one of the GETs in flight from its start (before its read-ahead wakes the
    prefetch threads); the download it starts in another thread keeps it until it ends, and an acquire
    that downloads nothing gives it back when it returns."""
    _, local = dataset
    server.pause(HELD)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), prefetch_depth=0)
    planner = ds.storage.planner
    info = local.manifest.shards[0]
    ds.get_batch(np.arange(16))  # served while shard 0's download is held
    assert planner.demand_in_flight == 1
    server.release()
    _wait_cached(ds, "shard-00000.fls")
    deadline = time.monotonic() + 10
    while planner.demand_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert planner.demand_in_flight == 0
    _, arrival = ds.storage.acquire_arriving(info.file, size=info.bytes, xxh3=info.xxh3)  # cached now
    assert arrival is None and planner.demand_in_flight == 0
    ds.storage.release(info.file)
    ds.close()
    ds.storage.close()


def test_a_second_reader_of_a_download_under_way_pins_it_without_a_state_update(dataset, server, tmp_path):
    """A reader that opens a shard this process is downloading by block pins it in the owner's ledger
    only; the state holds the file as this owner's reservation meanwhile, and the download's own
    update publishes the pin with the file's entry, so no other owner ever sees the file unpinned."""
    from fastload.remote.cache.shard_cache import ShardCache

    _, local = dataset
    info = local.manifest.shards[0]
    server.pause(HELD)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), prefetch_depth=0)
    storage = ds.storage
    _, first = storage.acquire_arriving(info.file, size=info.bytes, xxh3=info.xxh3)  # starts the download
    assert first is not None and server.paused.wait(10)
    (key, pins), = storage.cache.pinned_keys().items()
    assert pins == 1
    updates = storage.stats()["remote_state_updates"]
    _, second = storage.acquire_arriving(info.file, size=info.bytes, xxh3=info.xxh3)
    assert second is first and storage.cache.pinned_keys() == {key: 2}
    assert storage.stats()["remote_state_updates"] == updates  # no update: the reservation protects the file
    other = ShardCache(storage.cache.root, limit="64MB")  # another owner's view of the shared state
    seen = other.state()
    assert key in seen["reserved"] and key not in seen["entries"]
    server.release()
    assert first.wait_all()
    _wait_cached(ds, "shard-00000.fls")
    seen = other.state()
    assert key in seen["entries"] and key not in seen["reserved"]
    assert list(seen["pins"][key].values()) == [2]  # published with the entry
    storage.release(info.file)
    storage.release(info.file)
    assert key not in other.state()["pins"]
    other.close()
    ds.close()
    storage.close()


def _block_of(local: FastloadDataset, sample: int) -> int:
    """The block holding field x of `sample` (in shard 0)."""
    reader = local.shard(0)
    return (reader.fixed_offset["x"] + sample * 8000) >> 16


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
@pytest.mark.parametrize("part_bytes", [None, 200_000])
def test_a_block_corrupted_in_transit_is_fetched_again(dataset, server, tmp_path, transport, part_bytes):
    """Also with the shard in parts of 200 kB, four GETs at once (`part_bytes`)."""
    _, local = dataset
    at = (_block_of(local, 200) << 16) + 5
    server.corrupt(at, times=1)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport=transport, prefetch_depth=0,
               **({"part_bytes": part_bytes} if part_bytes else {}))
    _same(ds.get_batch(np.arange(N)), local.get_batch(np.arange(N)))
    stats = ds.storage.stats()  # the corrupt body reached the download (a retry) or a reader's own GET
    assert stats["remote_retries"] + stats["remote_side_rejected"] >= 1
    ds.close()
    ds.storage.close()
    for name in _cached(ds):
        with open(os.path.join(ds.storage.cache.data_dir, name), "rb") as fh:
            data = fh.read()
        assert xxhash.xxh3_64_hexdigest(data) in {s.xxh3 for s in local.manifest.shards}


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_a_block_corrupt_at_the_source_raises_naming_shard_and_block(dataset, server, tmp_path, transport):
    _, local = dataset
    j = _block_of(local, 200)
    server.pause(HELD)
    server.corrupt((j << 16) + 5, times=None)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), transport=transport, prefetch_depth=0,
               retry=RetryPolicy(attempts=2, base=0.01, cap=0.02, total=10))
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))  # blocks before the bad one are fine
    server.release()
    with pytest.raises(RemoteFetchError) as info:
        ds.get_batch(np.arange(190, 210))
    msg = str(info.value)
    assert "shards/shard-00000" in msg and f"(block {j})" in msg and "do not match their checksum" in msg, msg
    ds.close()
    ds.storage.close()


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_a_frozen_server_wakes_the_reader_with_the_download_error(dataset, tmp_path, transport):
    srv = ShardServer(dataset[0])
    try:
        srv.freeze()
        ds = _open(f"{srv.url}/ds", str(tmp_path / "c"), transport=transport, prefetch_depth=0,
                   connect_timeout=0.3, read_timeout=0.3, retry=RetryPolicy(attempts=3, base=0.01, cap=0.02, total=0.5))
        t0 = time.monotonic()
        with pytest.raises(RemoteFetchError, match="shard-00000.*giving up after"):
            next(iter(Loader(ds, batch_size=16, num_workers=0, shuffle=False)))
        assert time.monotonic() - t0 < 5
        ds.storage.close()
    finally:
        srv.stop()


@pytest.mark.parametrize(("workers", "worker_type", "part_bytes"),
                         [(0, "thread", None), (2, "thread", None), (2, "process", None), (0, "thread", 200_000)])
def test_loader_epochs_over_arriving_shards_are_exact(dataset, server, tmp_path, workers, worker_type, part_bytes):
    """Threads stream from the arriving files; process workers read what their own process downloads
    as it arrives, and wait for shards other processes download whole."""
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), **({"part_bytes": part_bytes} if part_bytes else {}))
    for _ in range(2):  # cold, then warm
        seen = []
        for batch in Loader(ds, batch_size=50, num_workers=workers, worker_type=worker_type, shuffle=True, seed=1):
            labels = batch["label"].numpy()
            assert (batch["x"][:, 0].numpy() == labels % 251).all()
            seen += labels.tolist()
        assert sorted(seen) == list(range(N))
    ds.close()
    ds.storage.close()


@pytest.fixture(scope="module")
def fixed_only(tmp_path_factory):
    """Fixed fields only (x, label), about 250 samples a shard: a batch over open shards is read in one
    pass per field (`_ranges.take_rows`)."""
    root = tmp_path_factory.mktemp("fixed") / "root"
    samples = ({"x": np.full(8000, i % 251, np.uint8), "label": i} for i in range(N))
    write(samples, str(root / "ds"), shard_size=2_000_000, progress=False)
    return str(root), FastloadDataset(str(root / "ds"))


def _counting_take_rows(monkeypatch) -> list[int]:
    from fastload.formats import reader

    calls: list[int] = []
    take = reader._c_take_rows
    if take is None:
        pytest.skip("the C extension is built by `make install`")

    def counted(sources, *args):
        calls.append(len(sources))
        return take(sources, *args)

    monkeypatch.setattr(reader, "_c_take_rows", counted)
    return calls


def test_a_batch_over_open_arriving_shards_is_read_in_one_pass_exactly(fixed_only, tmp_path, monkeypatch):
    """Once every shard of a batch is open (still arriving, held mid-body), a shuffled batch over all of them
    is one `take_rows` per field, byte for byte, its blocks verified as they arrive."""
    root, local = fixed_only
    starts = local.shard_boundaries.tolist()
    assert len(starts) >= 4  # three shards or more (starts, then the end)
    calls = _counting_take_rows(monkeypatch)
    srv = ArrivalServer(root)
    try:
        srv.pause(HELD)
        ds = _open(f"{srv.url}/ds", str(tmp_path / "c"), prefetch_depth=0)
        _same(ds.get_batch(starts[:-1]), local.get_batch(starts[:-1]))  # opens every shard, one at a time
        assert calls == []
        held_rows = HELD // 8000 - 10  # samples whose x lies before the held byte of each shard
        rng = np.random.default_rng(0)
        spans = [np.arange(a, min(a + held_rows, b)) for a, b in zip(starts, starts[1:])]
        rows = rng.permutation(np.concatenate(spans))
        _same(ds.get_batch(rows[:200]), local.get_batch(rows[:200]))
        assert calls == [len(starts) - 1] * 2  # x and label, each over every shard in one call
        assert srv.paused.wait(10) and not any(n.endswith("shard-00000.fls") for n in _cached(ds))  # still held
        srv.release()
        everything = rng.permutation(N)
        for i in range(0, N, 128):
            _same(ds.get_batch(everything[i : i + 128]), local.get_batch(everything[i : i + 128]))
        ds.close()
        ds.storage.close()
    finally:
        srv.stop()


def test_a_block_corrupt_at_the_source_raises_in_a_batch_over_open_shards(fixed_only, tmp_path, monkeypatch):
    """The one-pass read waits for each shard's blocks as the shard-by-shard read does: a block corrupt at
    the source ends in the error that names the shard and the block, and no row of the batch is returned."""
    root, local = fixed_only
    starts = local.shard_boundaries.tolist()
    calls = _counting_take_rows(monkeypatch)
    j = _block_of(local, 200)
    srv = ArrivalServer(root)
    try:
        srv.pause(HELD)
        srv.corrupt((j << 16) + 5, times=None)
        ds = _open(f"{srv.url}/ds", str(tmp_path / "c"), prefetch_depth=0,
                   retry=RetryPolicy(attempts=2, base=0.01, cap=0.02, total=10))
        _same(ds.get_batch(starts[:-1]), local.get_batch(starts[:-1]))
        srv.release()
        with pytest.raises(RemoteFetchError) as info:
            ds.get_batch(np.array([starts[1] + 1, 200, starts[2] + 1]))
        msg = str(info.value)
        assert "shards/shard-00000" in msg and f"(block {j})" in msg and "do not match their checksum" in msg, msg
        assert calls == []  # nothing was copied
        ds.close()
        ds.storage.close()
    finally:
        srv.stop()


def _counting_take_sharded(monkeypatch) -> list[int]:
    """The results of `_ranges.take_sharded` from now on (-1: a field of a batch read over open shards)."""
    from fastload.formats import open_columns

    results: list[int] = []
    take = open_columns._c_take_sharded
    if take is None:
        pytest.skip("the C extension is built by `make install`")

    def counted(*args):
        results.append(take(*args))
        return results[-1]

    monkeypatch.setattr(open_columns, "_c_take_sharded", counted)
    return results


def test_a_batch_over_open_shards_and_verified_blocks_is_one_call_per_field(fixed_only, tmp_path, monkeypatch):
    """Before every shard is at hand (here never: one fewer may stay open than there are shards), a batch
    whose rows all lie in open shards, over blocks already verified (published by the download while the
    shard arrives, or verified earlier), is one `take_sharded` per field, byte for byte; a batch over a
    block still to arrive, or over a shard to open, is read the general way (which waits and verifies)."""
    root, local = fixed_only
    starts = local.shard_boundaries.tolist()
    shards = len(starts) - 1
    results = _counting_take_sharded(monkeypatch)
    srv = ArrivalServer(root)
    try:
        srv.pause(HELD)  # every shard's body stops at byte HELD until released
        storage = RemoteStorage(f"{srv.url}/ds", cache_dir=str(tmp_path / "c"), cache_limit="64MB",
                                arriving_min_bytes=0, prefetch_depth=0)
        ds = FastloadDataset(storage=storage, max_open_shards=shards - 1)
        _same(ds.get_batch(starts[:-2]), local.get_batch(starts[:-2]))  # the first read opens all shards but one
        held_rows = HELD // 8000 - 10  # rows whose x lies before the held byte
        early = [np.arange(a, min(a + held_rows, b)) for a, b in zip(starts[:-2], starts[1:-1])]
        rng = np.random.default_rng(1)
        order = rng.permutation(np.concatenate(early))
        results.clear()
        for i in range(0, len(order), 100):  # their blocks fetched (the readers' own GETs) and verified
            _same(ds.get_batch(order[i : i + 100]), local.get_batch(order[i : i + 100]))
            if not i:
                assert results[:1] == [0]  # blocks still to arrive: not read here, nothing copied
        for _ in range(3):
            results.clear()
            rows = rng.permutation(np.concatenate(early))[:100]
            _same(ds.get_batch(rows), local.get_batch(rows))
            assert results == [-1, -1]  # x and label, over shards still arriving
        results.clear()
        late = np.array([starts[0] + 1, starts[-2]])  # the last shard's first row: that shard is not open
        _same(ds.get_batch(late), local.get_batch(late))
        assert results == [1]
        srv.release()
        batches = [np.arange(i, min(i + 40, N)) for i in range(0, N, 40)]
        for _ in range(2):  # in order, through every shard (one closes as the last one opens)
            results.clear()
            for rows in batches:
                _same(ds.get_batch(rows), local.get_batch(rows))
        # every batch but those that open a shard: x and label, one call each
        assert results.count(-1) >= 2 * (len(batches) - 2 * shards), (results, len(batches))
        with pytest.raises(IndexError, match="out of range"):
            ds.get_batch([0, N])  # an index out of range: the general way names the dataset
        ds.close()
        storage.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cold_epoch_leaves_the_blocks_it_read_verified_for_the_spliced_columns(fixed_only, tmp_path, monkeypatch,
                                                                                workers):
    """Blocks a cold epoch read over arriving shards (most batches in one call per field) are recorded as
    verified in the process's ledger, as the general read records them: the columns spliced over every shard
    after that epoch need no check, so the next epoch's reads are planned ahead (`direct_plan`)."""
    root, local = fixed_only
    results = _counting_take_sharded(monkeypatch)
    srv = ArrivalServer(root)
    try:
        srv.pause(HELD)  # the downloads stay held: every shard arrives (its blocks come by the readers' GETs)
        ds = _open(f"{srv.url}/ds", str(tmp_path / "c"))
        loader = Loader(ds, batch_size=50, num_workers=workers, worker_type="thread", shuffle=True, seed=1)
        order = []
        for batch in loader:
            order += batch["label"].tolist()
            _same({k: v.numpy() for k, v in batch.items()}, local.get_batch(batch["label"].numpy()))
        assert sorted(order) == list(range(N))
        assert -1 in results  # batches over blocks an earlier batch's GETs brought: one call per field
        srv.release()
        for info in ds.manifest.shards:
            _wait_cached(ds, os.path.basename(info.file))
        assert ds.direct_plan(np.arange(N)) is not None  # spliced, and no block left to check
        loader.close()
        ds.close()
        ds.storage.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_cold_loader_reads_batches_over_open_shards_without_the_general_path(fixed_only, tmp_path, monkeypatch,
                                                                                 workers, transform):
    """In a cold epoch without a `transform`, batches come from the dataset's `direct_read` (those over open
    shards and verified blocks in one call per field), not through `get_batch` and the run context around
    it, and every batch is exact. With a `transform`, every batch goes through `get_batch` inside its run
    context, which the transform sees."""
    from fastload.run import current_batch

    root, local = fixed_only
    results = _counting_take_sharded(monkeypatch)
    contexts: list[bool] = []

    def seen(cols):
        ctx = current_batch()
        contexts.append(ctx is not None and sorted(ctx.indices) == sorted(cols["label"].tolist()))
        return cols

    srv = ArrivalServer(root)
    try:
        srv.pause(HELD)  # blocks past HELD come by the readers' GETs: batches after them are over verified blocks
        ds = _open(f"{srv.url}/ds", str(tmp_path / "c"))
        general: list[int] = []
        direct_reads: list[bool] = []  # whether each `direct_read` gave the batch
        get_batch, direct_read = ds.get_batch, ds.direct_read
        monkeypatch.setattr(ds, "get_batch", lambda idx, **kw: general.append(1) or get_batch(idx, **kw))

        def counted_read(idx):
            read = direct_read(idx)
            direct_reads.append(read is not None)
            return read

        monkeypatch.setattr(ds, "direct_read", counted_read)
        loader = Loader(ds, batch_size=50, num_workers=workers, worker_type="thread", shuffle=True, seed=1,
                        transform=seen if transform else None)
        results.clear()
        order, batches = [], 0
        for batch in loader:
            batches += 1
            order += batch["label"].tolist()
            _same({k: v.numpy() for k, v in batch.items()}, local.get_batch(batch["label"].numpy()))
        assert sorted(order) == list(range(N))
        if transform:
            assert len(contexts) == batches and all(contexts)  # every batch in its run context
            assert len(general) >= batches and not direct_reads
        else:
            one_call = results.count(-1) // 2  # x and label: one call each for a batch over verified blocks
            assert one_call > 0, results
            assert sum(direct_reads) + len(general) >= batches and len(general) < batches, (general, direct_reads)
        srv.release()
        loader.close()
        ds.close()
        ds.storage.close()
    finally:
        srv.stop()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_a_shard_closed_beyond_max_open_shards_is_unmapped_with_its_reader(fixed_only, tmp_path, monkeypatch):
    """Batches read over verified shards keep no closed shard mapped: with `max_open_shards=2`, a pass in
    order through every shard leaves at most two shard files mapped, and every batch is exact."""
    root, local = fixed_only
    results = _counting_take_sharded(monkeypatch)
    cache = str(tmp_path / "c")
    srv = ArrivalServer(root)
    enabled = gc.isenabled()
    gc.disable()  # mappings must go with their readers, not at a collection
    try:
        ds = FastloadDataset(storage=RemoteStorage(f"{srv.url}/ds", cache_dir=cache, cache_limit="64MB",
                                                   arriving_min_bytes=0), max_open_shards=2)
        for _ in range(2):
            for i in range(0, N, 50):
                rows = np.arange(i, min(i + 50, N))
                _same(ds.get_batch(rows), local.get_batch(rows))
                files = {line.split()[-1] for line in _mapped(cache)}
                assert len(files) <= 2, files
        assert -1 in results  # batches within one verified shard took one call per field
        ds.close()
        assert _mapped(cache) == []
        ds.storage.close()
    finally:
        if enabled:
            gc.enable()
        srv.stop()


def _mapped(paths_under: str) -> list[str]:
    """This process's mappings of files under `paths_under` (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if paths_under in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize(("source", "workers", "shuffle"),
                         [("remote", 0, False), ("remote", 2, True), ("local", 2, True)])
def test_a_dropped_dataset_unmaps_its_shards_at_once(dataset, server, tmp_path, source, workers, shuffle):
    """A dataset dropped after an epoch takes its shard mappings and file descriptors with it there and
    then, not at some later garbage collection: none of its callbacks (shard readers', block ledger's)
    holds it, so no cycle keeps it. A process that opens dataset after dataset would otherwise keep
    every deleted cache file's pages mapped until the collector ran."""
    cache = str(tmp_path / "c")
    if source == "local":  # a copy of its own: the module's `dataset` keeps the original's shards mapped
        shutil.copytree(os.path.join(dataset[0], "ds"), cache)
    enabled = gc.isenabled()
    gc.disable()
    try:
        ds = _open(f"{server.url}/ds", cache) if source == "remote" else FastloadDataset(cache)
        seen = 0
        for batch in Loader(ds, batch_size=50, num_workers=workers, worker_type="thread", shuffle=shuffle, seed=1):
            seen += len(batch["label"])
        assert seen == N
        assert _mapped(cache), "the epoch mapped no shard of the cache"
        storage, alive = ds.storage, weakref.ref(ds)
        del ds, batch
        assert alive() is None, "the dataset outlived its last reference"
        assert _mapped(cache) == []
        if source == "remote":
            storage.close()
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("transport", ["obstore", "fsspec"])
def test_a_server_that_ignores_ranges_serves_whole_shards(dataset, tmp_path, transport):
    """Python's http.server answers a ranged GET with the whole body: the block table cannot come first,
    so shards are awaited whole (the first one from that very answer), byte for byte."""
    import functools
    import http.server
    import threading

    root, local = dataset
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=root)
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.handle_error = lambda *a: None
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        ds = _open(f"http://127.0.0.1:{srv.server_address[1]}/ds", str(tmp_path / "c"), transport=transport)
        _same(ds.get_batch(np.arange(N)), local.get_batch(np.arange(N)))
        assert ds.storage.stats()["remote_side_gets"] == 0
        ds.close()
        ds.storage.close()
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def _child_reads(ds: FastloadDataset, rows: np.ndarray, out) -> None:
    try:
        batch = ds.get_batch(rows)
        out.put((xxhash.xxh3_64_hexdigest(batch["x"].tobytes()), batch["label"].tolist()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(repr(exc))


def test_a_forked_child_reads_an_inherited_arriving_shard_once_it_is_whole(dataset, server, tmp_path):
    """A child forked while a shard arrives cannot be woken by its parent's download: it waits for the
    file renamed into the cache, then hashes the blocks it reads itself."""
    import multiprocessing

    _, local = dataset
    server.pause(HELD)
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"), prefetch_depth=0)
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))  # shard 0 open, still arriving
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    rows = np.arange(local.manifest.shards[0].num_samples)
    child = ctx.Process(target=_child_reads, args=(ds, rows, out))
    child.start()
    time.sleep(0.3)  # the child polls for the whole file meanwhile
    server.release()
    got = out.get(timeout=60)
    child.join(10)
    want = local.get_batch(rows)
    assert got == (xxhash.xxh3_64_hexdigest(want["x"].tobytes()), want["label"].tolist()), got
    ds.close()
    ds.storage.close()


# -- Download over arbitrary arrival orders -----------------------------------------------------
@pytest.fixture(scope="module")
def shard_bytes(dataset):
    root, local = dataset
    info = local.manifest.shards[0]
    with open(os.path.join(root, "ds", info.file), "rb") as fh:
        data = fh.read()
    return data, info, local.manifest.block_log2


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 10**9), max_size=40), order=st.randoms(use_true_random=False),
       corrupt=st.booleans(), wants=st.lists(st.lists(st.integers(0, 40), max_size=6), max_size=4),
       part=st.integers(1, 40), received=st.integers(0, 4))
def test_download_publishes_only_verified_blocks_in_any_order(shard_bytes, tmp_path_factory, cuts, order, corrupt,
                                                              wants, part, received):
    """Claims from the download (`claim_next`) and from readers (`claim_wanted`, which also takes over the
    download's blocks well ahead of where its GETs got to), their bytes in pieces in any order, a
    claim that fails on a corrupt piece given back and fetched again: every published block holds
    the shard's bytes all along, each block is written by one claim, and the file ends whole."""
    data, info, shift = shard_bytes
    path = str(tmp_path_factory.mktemp("dl") / "tmp")
    arrival = Arrival(path, path + ".final", size=info.bytes, spec=BlockSpec(info.blocks_xxh3, shift),
                      where="shard", stall_s=5)
    sink = Download(path, size=info.bytes, xxh3=info.xxh3, where="shard", arrival=arrival)
    try:  # an example hypothesis abandons midway (its random draws ran out) closes the file too
        start, end = sink.table_range()
        sink.put_table(data[start:end])
        arrival.set_want(lambda runs: None, gap=2, run=8)
        blocks = len(arrival.published)

        def agrees() -> None:  # every published block holds the shard's bytes
            with open(path, "rb") as fh:
                now = fh.read()
            assert len(now) == len(data)
            for j in np.flatnonzero(arrival.published):
                a, b = j << shift, min((j + 1) << shift, arrival.sections_end)
                assert now[a:b] == data[a:b], j

        def pieces(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
            """(claim, start, end) pieces of the runs' bytes, cut at `cuts`, shuffled."""
            out = []
            for claim, first, stop in runs:
                lo, hi = first << shift, min(stop << shift, arrival.sections_end)
                edges = sorted({lo, hi, *(lo + c % (hi - lo) for c in cuts)})
                out += [(claim, a, b) for a, b in zip(edges[:-1], edges[1:])]
            order.shuffle(out)
            return out

        runs = []  # the download's first GET got `received` blocks in, then readers claim
        first = arrival.claim_next(0, part)
        assert first is not None
        claim, a, b = first
        got = min(b, a + received)
        if got > a:
            sink.write_claimed(claim, a << shift, data[a << shift : min(got << shift, arrival.sections_end)])
        for ids in wants:
            taken = arrival.claim_wanted(np.array([i % blocks for i in ids], dtype=np.int64))
            for _, lo, hi in taken:  # a reader's claim never holds a published block or the download's near ones
                assert not arrival.published[lo:hi].any()
                assert lo >= got + STEAL_AHEAD or not (a <= lo < b)
            runs += taken
        runs.append(first)
        while (more := arrival.claim_next(0, part)) is not None:
            runs.append(more)
        if corrupt:  # one claim's bytes come with a flipped byte: it fails on that block and is given back
            open_blocks = {c: lo + np.flatnonzero(arrival.owned(c, lo, hi) & ~arrival.published[lo:hi])
                           for c, lo, hi in runs}
            victim = order.choice([r for r in runs if len(open_blocks[r[0]])])
            j = int(order.choice(open_blocks[victim[0]].tolist()))
            bad = bytearray(data)
            bad[order.randrange(j << shift, min((j + 1) << shift, arrival.sections_end))] ^= 0xFF
            with pytest.raises(ChecksumError, match="do not match their checksum"):
                for c, p, q in pieces([victim]):
                    sink.write_claimed(c, p, bad[p:q])
                    agrees()
            sink.release(victim[0])
            agrees()
            while (more := arrival.claim_next(0, part)) is not None:
                runs.append(more)
        for c, p, q in pieces(runs):
            sink.write_claimed(c, p, data[p:q])  # blocks a claim lost to another are dropped
            agrees()
        for c, _, _ in runs:
            sink.release(c)
        assert arrival.claim_next(0, part) is None
        sink.check()
        assert arrival.published.all()
        with open(path, "rb") as fh:
            assert fh.read() == data
    finally:
        sink.close()


class _StepClock:
    """A stand-in for `arrival`'s `time`: `monotonic()` moves only when the test steps it, so that "no
    progress for `STALLED_S`" holds exactly when the test says (a real clock may pass it in one stall)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def step(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def arrival_clock(monkeypatch) -> _StepClock:
    from fastload.remote.cache import arrival as arrival_module

    clock = _StepClock()
    monkeypatch.setattr(arrival_module, "time", clock)
    return clock


def test_blocks_wanted_from_all_over_a_shard_are_left_to_its_download(tmp_path, arrival_clock):
    """Fetching ahead, a reader takes over the blocks its batch needs from far ahead of the download's
    GET; unless GETs for them would cover most of the shard (`AHEAD_MOST`): the download brings those
    in file order at least as soon, and taking them over would only cut its GET into pieces. Blocks
    nobody fetches are claimed either way."""
    arrival = Arrival(str(tmp_path / "t"), str(tmp_path / "f"), size=(400 << 16) + 8 * 400,
                      spec=BlockSpec("0" * 16, 16), where="ds/shard-0", stall_s=5)
    count = len(arrival.published)
    asked, followed = [], []
    arrival.set_want(lambda runs: asked.append([(a, b) for _, a, b in runs]), gap=16, run=64,
                     follow=lambda: followed.append(1))
    download = arrival.claim_next(0, count)  # the download's GET, just started at block 0
    assert download is not None and download[1:] == (0, count)
    far = np.array([300, 301, 350])
    spread = np.arange(80, count, 4)  # a shuffled batch: every few blocks of the shard past the front
    assert arrival.claim_wanted(spread, ahead=True) == []  # left to the download's GET
    arrival.ask(spread, ahead=True)
    assert asked == [] and followed == [1]  # the storage is told: nothing the download runs is held back
    arrival.ask(far, ahead=True)  # taken over: the download gets there much later
    assert asked == [[(300, 302), (350, 351)]] and followed == [1]
    free = Arrival(str(tmp_path / "t2"), str(tmp_path / "f2"), size=(400 << 16) + 8 * 400,
                   spec=BlockSpec("0" * 16, 16), where="ds/shard-1", stall_s=5)
    free.set_want(lambda runs: None, gap=16, run=64)
    assert free.claim_wanted(spread, ahead=True) == []  # no GET holds them yet, but the download just began
    arrival_clock.step(1.5 * STALLED_S)  # and shows no progress since: nobody else fetches these, the reader's GETs do
    assert free.claim_wanted(spread, ahead=True) != []


def test_a_following_read_leaves_blocks_nobody_holds_to_a_download_under_way(tmp_path, arrival_clock):
    """A read that follows the downloads (any but an epoch's first) claims none of the blocks it waits for
    that no GET holds yet (a large shard's parts not started, a download whose body GET has not begun):
    the download's GETs claim every block in file order. Only once the download shows no progress for
    `STALLED_S` does the reader fetch them itself. A first read fetches them ahead as before."""
    size = (400 << 16) + 8 * 400

    def arrival(name):
        a = Arrival(str(tmp_path / name), str(tmp_path / (name + ".f")), size=size, spec=BlockSpec("0" * 16, 16),
                    where=f"ds/{name}", stall_s=5)
        asked: list[list[tuple[int, int]]] = []
        return a, asked

    wanted = np.array([200, 201, 300])
    parts, asked = arrival("parts")
    parts.set_want(lambda runs: asked.append([(x, y) for _, x, y in runs]), gap=16, run=64)
    part = parts.claim_next(0, 64)  # the first part's GET: blocks [0, 64)
    assert part is not None and part[1:] == (0, 64)
    parts.ask(wanted, ahead=False)
    assert asked == [] and parts.claimed[200] == 0
    parts.ask(wanted, ahead=True)
    assert asked == [[(200, 202), (300, 301)]]

    early, early_asked = arrival("early")  # waited for before the block table (and `on_want`) arrived
    early.ask(wanted, ahead=False)
    early.set_want(lambda runs: early_asked.append([(x, y) for _, x, y in runs]), gap=16, run=64)
    assert early_asked == [] and not early.claimed.any()
    arrival_clock.step(1.5 * STALLED_S)  # no block since: the reader's own GETs fetch what it waits for
    early.ask(wanted, ahead=False)
    assert early_asked == [[(200, 202), (300, 301)]]

    first, first_asked = arrival("first")
    first.ask(wanted, ahead=True)
    first.set_want(lambda runs: first_asked.append([(x, y) for _, x, y in runs]), gap=16, run=64)
    assert first_asked == [[(200, 202), (300, 301)]]


def test_arrival_waits_ask_once_wake_on_publish_fail_and_time_out(shard_bytes, tmp_path):
    import threading

    _, info, shift = shard_bytes
    spec = BlockSpec(info.blocks_xxh3, shift)

    def new(stall_s: float) -> Arrival:
        return Arrival(str(tmp_path / "t"), str(tmp_path / "f"), size=info.bytes, spec=spec, where="ds/shard-0",
                       stall_s=stall_s)

    arrival, asked, got = new(5), [], []
    arrival.ask(np.array([3, 7]))  # asked for (as a wait asks first) before the block table arrived: kept
    waiter = threading.Thread(target=lambda: got.append(arrival.wait(np.array([3, 7]))))
    waiter.start()  # its own ask comes before or after the table: the blocks are asked for once either way
    arrival.set_want(lambda runs: asked.append([(a, b) for _, a, b in runs]), gap=0, run=1)
    assert asked == [[(3, 4), (7, 8)]]
    arrival.publish([3, 7])
    waiter.join(5)
    assert got == [True]
    assert arrival.wait(np.array([3])) is True and asked == [[(3, 4), (7, 8)]]  # published: nothing more asked

    failing, errors = new(5), []

    def wait_for_failure() -> None:
        try:
            failing.wait(np.array([1]))
        except RemoteFetchError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_for_failure)
    waiter.start()
    failing.fail(RemoteFetchError("ds/shard-0: giving up after 3 attempts"))
    waiter.join(5)
    assert "giving up after 3 attempts" in str(errors[0])

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ds/shard-0: block 2 .*did not arrive"):
        new(0.2).wait(np.array([2]))
    assert time.monotonic() - t0 < 2


def test_an_epochs_start_readies_a_side_thread_for_the_first_batchs_own_gets(dataset, server, tmp_path):
    """`hold_for_first_batch` (a cold epoch's start, before any GET) starts one side thread, so the
    first batch's own GETs are handed to a running thread instead of waiting for one to start; the
    storage's close ends it, and a storage that reads no shard while it arrives starts none."""
    def side_threads() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("fastload-side")}

    before = side_threads()
    ds = _open(f"{server.url}/ds", str(tmp_path / "c"))
    assert side_threads() == before
    ds.storage.hold_for_first_batch()
    started = side_threads() - before
    assert len(started) == 1
    local = dataset[1]
    _same(ds.get_batch(np.arange(16)), local.get_batch(np.arange(16)))
    ds.storage.first_batch_served()
    ds.close()
    ds.storage.close()
    assert not (side_threads() & started)
    whole = FastloadDataset(storage=RemoteStorage(f"{server.url}/ds", cache_dir=str(tmp_path / "w"),
                                                  cache_limit="64MB", arriving_min_bytes=None))
    whole.storage.hold_for_first_batch()
    assert side_threads() == before  # shards come whole: no reader GETs of its own
    whole.storage.close()
