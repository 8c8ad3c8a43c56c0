"""The shard cache's budget against the file system and its readers, over a local HTTP server:

- `cache_limit` bounds the bytes the cache occupies on its own file system (a dedicated tmpfs,
  sampled with statvfs every 2 ms) at every moment of shuffled epochs: thread workers, process
  workers, two readers;
- a cached shard damaged in place is dropped and fetched again in every verify mode, and the
  message says the local copy was damaged;
- readers sharing a cache directory split its budget without `max_open_shards`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import threading
import time

import numpy as np
import pytest
from http_faults import ShardServer

from fastload import Loader
from fastload.formats import ChecksumError, FastloadDataset, write
from fastload.remote.cache.shard_cache import CacheBudgetError, ShardCache
from fastload.remote.storage import RemoteStorage

N = 600  # 12 shards of 50 samples
SHARD = 100_000


def _samples():
    for i in range(N):
        yield {"x": np.full(2000, i % 251, np.uint8), "label": i}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    write(_samples(), str(root / "ds"), shard_size=SHARD, progress=False)
    server = ShardServer(str(root))
    yield f"{server.url}/ds", server
    server.stop()


def _storage(url: str, cache_dir: str, limit: int, **kw) -> RemoteStorage:
    return RemoteStorage(url, cache_dir=cache_dir, cache_limit=limit, wait_timeout=30, **kw)


def _dataset(storage: RemoteStorage) -> FastloadDataset:
    return FastloadDataset(storage=storage)


def _shard_budget(cache_dir: str, shards: float) -> int:
    """A cache_limit holding `shards` of the largest shard, at their footprint on `cache_dir`'s file
    system, plus the state files' allowance."""
    probe = ShardCache(cache_dir, limit=1 << 30)
    fp = probe.footprint(SHARD + 8192)  # the largest shard is a little over SHARD bytes
    allowance = probe.state_bytes() + 4096
    probe.close()
    return int(shards * fp) + allowance


def _epoch(ds: FastloadDataset, *, seed: int, **loader_kw) -> None:
    """One shuffled epoch through a Loader: every sample once, each with its own bytes."""
    seen = []
    for batch in Loader(ds, batch_size=32, shuffle=True, seed=seed, **loader_kw):
        labels = batch["label"].numpy()
        assert (batch["x"].numpy() == (labels % 251)[:, None]).all()
        seen += labels.tolist()
    assert sorted(seen) == list(range(N))


# -- the budget on a dedicated file system -----------------------------------------------------------
@pytest.fixture()
def tmpfs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs for the disk-budget test (needs root or CAP_SYS_ADMIN): {exc}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=20)


class DiskSampler:
    """Used bytes of a file system (statvfs), sampled every millisecond on a thread; `peak` above `base`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.base, self.peak, self.samples = self._used(), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used() - self.base)
            self.samples += 1
            time.sleep(0.001)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


RATIOS: dict[str, float] = {}  # statvfs peak / cache_limit per case, printed by the last test


@pytest.mark.parametrize("case", ["threads", "inline", "processes", "two-readers"])
def test_disk_use_never_exceeds_cache_limit(served, tmpfs, case):
    url, server = served
    gets = sum("/shards/" in r for r in server.requests)
    cache_dir = os.path.join(tmpfs, "cache")
    disk = DiskSampler(tmpfs)  # its base: the empty file system
    os.makedirs(cache_dir)
    # 3.2 shards for one reader; process workers are two readers (one each), so 2 x 2 shards at least
    limit = _shard_budget(cache_dir, 5.2 if case in ("processes", "two-readers") else 3.2)
    with disk:
        ds = _dataset(_storage(url, cache_dir, limit))
        if case == "threads":
            _epoch(ds, seed=1, num_workers=2, worker_type="thread")
        elif case == "inline":
            _epoch(ds, seed=1, num_workers=0)
        elif case == "processes":
            _epoch(ds, seed=1, num_workers=2, worker_type="process")
        else:
            other = _dataset(_storage(url, cache_dir, limit))
            errors: list[BaseException] = []

            def run(d: FastloadDataset, seed: int) -> None:
                try:
                    _epoch(d, seed=seed, num_workers=1, worker_type="thread")
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(d, s)) for s, d in enumerate((ds, other))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert errors == []
            other.close()
        ds.close()
        ds.storage.close()
    RATIOS[case] = disk.peak / limit
    print(f"\n{case}: statvfs peak {disk.peak} B / cache_limit {limit} B = {disk.peak / limit:.3f} "
          f"({disk.samples} samples)")
    assert disk.samples > 100
    assert sum("/shards/" in r for r in server.requests) - gets > 12  # shards evicted and fetched again
    assert 0 < disk.peak <= limit, (case, disk.peak / limit)


# -- a cached shard damaged in place ---------------------------------------------------------------
def _damage(path: str, at: int) -> None:
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the stamp (size, mtime, inode) still matches


@pytest.mark.parametrize("verify", ["stat", "once", "always"])
def test_damaged_cached_shard_is_dropped_and_fetched_again(served, tmp_path, verify):
    url, server = served
    limit = "10MB"
    ds = _dataset(_storage(url, str(tmp_path), limit, verify=verify, prefetch_depth=0))
    assert ds[0]["label"] == 0
    ds.close()
    ds.storage.close()
    ds.storage.cache.close()
    data = os.path.join(tmp_path, "data")
    (victim,) = [os.path.join(data, n) for n in os.listdir(data) if n.endswith("shard-00000.fls")]
    _damage(victim, 50_000)
    before = server.requests.count("GET /ds/shards/shard-00000.fls")
    again = _dataset(_storage(url, str(tmp_path), limit, verify=verify, prefetch_depth=0))
    if verify == "stat":  # the stamp is trusted: the reader's block check finds the damage
        with pytest.raises(ChecksumError) as info:
            again.get_batch(np.arange(50))
        text = str(info.value)
        assert f"the local cached copy {victim} is damaged" in text, text
        assert "the remote object is not at fault" in text and "fetches it again" in text
        assert "re-convert" not in text and "run `fastload verify`" not in text
        assert not again.storage.cache.contains(os.path.basename(victim))  # out of the cache at once
    batch = again.get_batch(np.arange(50))  # the next read fetches the shard again
    assert batch["label"].tolist() == list(range(50)) and (batch["x"][:, 0] == np.arange(50)).all()
    assert server.requests.count("GET /ds/shards/shard-00000.fls") == before + 1
    again.close()
    again.storage.close()


# -- readers sharing one cache directory -----------------------------------------------------------
def test_a_second_reader_shrinks_the_first_reader_share(served, tmp_path):
    url, _ = served
    limit = _shard_budget(str(tmp_path), 6)
    train = _dataset(_storage(url, str(tmp_path), limit))
    batches = iter(Loader(train, batch_size=32, shuffle=True, seed=3))
    first = [next(batches)["label"].tolist() for _ in range(5)]
    alone = train.storage.max_open_shards
    assert alone >= 4
    evaluate = _dataset(_storage(url, str(tmp_path), limit))  # arrives while train holds its shards
    _epoch(evaluate, seed=4)  # train is idle meanwhile: it gave up what its smaller share cannot hold
    assert train.storage.max_open_shards < alone and evaluate.storage.max_open_shards >= 1
    rest = [b["label"].tolist() for b in batches]
    assert sorted(x for b in first + rest for x in b) == list(range(N))
    evaluate.close()
    evaluate.storage.close()
    train.close()
    train.storage.close()


def test_a_budget_below_the_readers_minimums_says_what_it_needs(served, tmp_path):
    url, _ = served
    limit = _shard_budget(str(tmp_path), 3)
    first = _dataset(_storage(url, str(tmp_path), limit, prefetch_depth=0))
    assert first[0]["label"] == 0  # holds a shard: its claim (at least 2 shards) is live
    with pytest.raises(CacheBudgetError, match=r"the 2 shards it needs at least .* use cache_limit >= (\d+)") as info:
        _storage(url, str(tmp_path), limit)
    need = int(info.value.args[0].split("use cache_limit >= ")[1].split(" ")[0])
    assert limit < need <= _shard_budget(str(tmp_path), 4)
    first.close()
    first.storage.close()


def _reader_process(url: str, cache_dir: str, limit: int, seed: int, barrier) -> None:
    ds = _dataset(_storage(url, cache_dir, limit))
    barrier.wait(30)
    _epoch(ds, seed=seed)


def test_readers_in_two_processes_split_the_budget(served, tmp_path):
    url, _ = served
    limit = _shard_budget(str(tmp_path), 5)  # one reader alone would keep 4 open; two need 2 x 2
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_reader_process, args=(url, str(tmp_path), limit, s, barrier)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    with contextlib.suppress(Exception):
        for p in procs:
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
