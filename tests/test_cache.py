"""ShardCache: budget, LRU, pins, verification, crash recovery and sharing between processes."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import sqlite3
import tempfile
import threading
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats.errors import ChecksumError
from fastload.remote.cache.shard_cache import CacheBudgetError, CacheStateError, Download, ShardCache, owner_alive

KB = 1000


def blob(i: int, size: int = 100 * KB) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def meta(i: int, size: int = 100 * KB) -> dict:
    data = blob(i, size)
    return {"size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}


class Source:
    """A fake remote: counts fetches per key, can serve wrong bytes."""

    def __init__(self, size: int = 100 * KB) -> None:
        self.size, self.fetches, self.bad = size, [], set()

    def fetcher(self, i: int):
        def fetch(dl: Download) -> None:
            self.fetches.append(i)
            data = blob(i, self.size)
            dl.write(b"\0" + data[1:] if i in self.bad else data)

        return fetch

    def acquire(self, cache: ShardCache, i: int) -> str:
        return cache.acquire(f"k{i}", **meta(i, self.size), fetch=self.fetcher(i))


def read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def test_fetch_once_then_hit(tmp_path):
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    p = src.acquire(cache, 1)
    assert read(p) == blob(1)
    cache.release("k1")
    assert read(src.acquire(cache, 1)) == blob(1)
    cache.release("k1")
    assert src.fetches == [1]
    assert cache.usage()["bytes"] == 100 * KB
    # a second cache object on the same directory (another process/loader) sees the file
    other = ShardCache(tmp_path, limit="1MB")
    assert read(Source().acquire(other, 1)) == blob(1)


def test_lru_eviction_stays_under_budget_and_spares_pins(tmp_path):
    cache, src = ShardCache(tmp_path, limit=350 * KB), Source()
    src.acquire(cache, 0)  # stays pinned throughout
    for i in range(1, 10):
        src.acquire(cache, i)
        assert cache.disk_bytes() <= 350 * KB
        cache.release(f"k{i}")
    assert cache.contains("k0"), "a pinned shard was evicted"
    assert cache.contains("k9") and cache.contains("k8") and not cache.contains("k1")
    # LRU, not FIFO: touching k8 makes k9 the next victim
    src.acquire(cache, 8)
    cache.release("k8")
    src.acquire(cache, 10)
    cache.release("k10")
    assert cache.contains("k8") and not cache.contains("k9")


def test_limit_strings_and_shard_larger_than_budget(tmp_path):
    assert ShardCache(tmp_path, limit="20GB").limit == 20 * 10**9
    assert ShardCache(tmp_path, limit="1.5GiB").limit == int(1.5 * 2**30)
    cache = ShardCache(tmp_path, limit=50 * KB)
    with pytest.raises(CacheBudgetError, match="does not fit in cache_limit"):
        Source().acquire(cache, 1)


def test_budget_below_pins_fails_fast_instead_of_deadlocking(tmp_path):
    cache, src = ShardCache(tmp_path, limit=250 * KB, deadlock_grace=0.3), Source()
    src.acquire(cache, 1)
    src.acquire(cache, 2)
    t0 = time.monotonic()
    with pytest.raises(CacheBudgetError, match="cannot hold the shards in use at once"):
        src.acquire(cache, 3)
    assert time.monotonic() - t0 < 5
    assert cache.usage()["reserved"] == 0
    cache.release("k1")
    assert read(src.acquire(cache, 3)) == blob(3)


def test_checksum_mismatch_on_download_leaves_nothing(tmp_path):
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    src.bad.add(4)
    with pytest.raises(ChecksumError, match="xxh3"):
        src.acquire(cache, 4)
    usage = cache.usage()
    assert usage.pop("occupied") == cache.state_bytes()  # nothing but the state files
    assert usage == {"bytes": 0, "files": 0, "pinned": 0, "reserved": 0, "retired": 0, "limit": 10**6}
    assert os.listdir(cache.tmp_dir) == [] and os.listdir(cache.data_dir) == []

    def too_long(dl: Download) -> None:
        dl.write(blob(5) + b"x")

    with pytest.raises(ChecksumError, match="more than"):
        cache.acquire("k5", **meta(5), fetch=too_long)


@pytest.mark.parametrize("verify", ["stat", "once"])
def test_corrupted_cached_file_is_refetched(tmp_path, verify):
    src = Source()
    cache = ShardCache(tmp_path, limit="1MB", verify=verify)
    path = src.acquire(cache, 1)
    cache.release("k1")
    st = os.stat(path)
    with open(path, "r+b") as fh:  # bit rot
        fh.seek(1000)
        fh.write(b"\xff\xfe")
    if verify == "once":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # corruption that keeps the mtime
    fresh = ShardCache(tmp_path, limit="1MB", verify=verify)  # e.g. the next run
    assert read(src.acquire(fresh, 1)) == blob(1)
    assert src.fetches == [1, 1]


def test_truncated_cached_file_is_refetched(tmp_path):
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    path = src.acquire(cache, 2)
    cache.release("k2")
    os.truncate(path, 10)
    assert read(src.acquire(cache, 2)) == blob(2)
    assert src.fetches == [2, 2]


def _damage_state(root, how: str = "header") -> None:
    """Damage `state.db` as a power loss or a stray write could: its header, a page, or its document."""
    path = os.path.join(root, "state.db")
    if how == "document":  # valid SQLite, a document that is not the state
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("UPDATE live SET doc = '{not json'")
        conn.close()
        return
    with open(path, "r+b") as fh:
        if how == "header":
            fh.write(b"{not a database}")
        else:  # every page past the first: b-tree pages that no longer parse
            size = fh.seek(0, os.SEEK_END)
            for off in range(1024, size, 1024):
                fh.seek(off)
                fh.write(b"\x0d\xff\xff\x7f" * 8)


@pytest.mark.parametrize("how", ["header", "pages", "document"])
def test_state_file_damage_is_rebuilt(tmp_path, how):
    """Damage found by the only user (e.g. after a power loss) is rebuilt from the directory."""
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    src.acquire(cache, 1)
    cache.release("k1")
    cache.close()
    _damage_state(tmp_path, how)
    again = ShardCache(tmp_path, limit="1MB")
    assert again.contains("k1")
    assert read(src.acquire(again, 1)) == blob(1)
    assert src.fetches == [1]


@pytest.mark.parametrize("how", ["header", "pages", "document"])
def test_state_damage_under_live_pins_fails_clearly_and_keeps_own_pins(tmp_path, how):
    holder, src = ShardCache(tmp_path, limit="1MB"), Source()
    src.acquire(holder, 1)  # pinned by a live user
    _damage_state(tmp_path, how)
    with pytest.raises(CacheStateError, match=r"shared state is damaged .* it holds their pins"):
        ShardCache(tmp_path, limit="1MB")
    # alone again, the holder rebuilds the state and writes its own pin back from its ledger
    assert set(holder.state()["pins"]) == {"k1"}
    src.acquire(holder, 2)
    holder.release("k1")
    holder.release("k2")
    assert holder.state()["pins"] == {}


def test_an_update_cut_short_by_a_killed_process_leaves_the_previous_state(tmp_path):
    """A process killed while its update is written to `state.db` leaves a journal; the next
    update rolls it back, so the state is the last committed one."""
    cache, src = ShardCache(tmp_path, limit="10MB"), Source()
    for i in range(40):
        src.acquire(cache, i)
    for i in range(1, 40):
        cache.release(f"k{i}")
    before = cache.state()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: an update whose pages reach the file, never committed
        conn = sqlite3.connect(os.path.join(tmp_path, "state.db"), isolation_level=None)
        conn.execute("PRAGMA cache_size = 1")  # spill changed pages to the file before the commit
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM entries")
        conn.execute("UPDATE live SET doc = '{}'")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.getsize(os.path.join(tmp_path, "state.db-journal")) > 0  # the update was cut short
    state = ShardCache(tmp_path, limit="10MB").state()
    assert state["entries"] == before["entries"] and set(state["pins"]) == {"k0"}
    cache.release("k0")
    assert ShardCache(tmp_path, limit="10MB").state()["pins"] == {}


def test_prefetch_is_soft(tmp_path):
    cache, src = ShardCache(tmp_path, limit=250 * KB), Source()
    src.acquire(cache, 1)
    assert cache.prefetch("k2", **meta(2), fetch=src.fetcher(2))
    # no room for another prefetch: the pinned and the soft-pinned file are both protected
    assert not cache.prefetch("k3", **meta(3), fetch=src.fetcher(3))
    assert cache.contains("k1") and cache.contains("k2") and not cache.contains("k3")
    # a demand fetch may take the prefetched file's room
    cache.release("k1")
    src.acquire(cache, 3)
    src.acquire(cache, 4)
    assert not cache.contains("k2") or not cache.contains("k1")
    assert cache.disk_bytes() <= 250 * KB


# -- several processes ------------------------------------------------------------------------------
def _hold_and_crash(root: str, ready) -> None:
    cache = ShardCache(root, limit=250 * KB)
    Source().acquire(cache, 1)  # pinned, never released

    def hang(dl: Download) -> None:
        dl.write(blob(2)[:1000])
        ready.set()
        time.sleep(60)

    cache.acquire("k2", **meta(2), fetch=hang)


def test_crashed_process_leaves_no_pins_or_temp_files(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_and_crash, args=(str(tmp_path), ready))
    proc.start()
    assert ready.wait(30)
    proc.kill()
    proc.join()
    assert os.listdir(os.path.join(tmp_path, "tmp")), "the crashed download's temp file should exist"
    cache, src = ShardCache(tmp_path, limit=250 * KB), Source()
    assert os.listdir(cache.tmp_dir) == []
    # k1 was pinned by the dead process: it may now be evicted to make room
    for i in (3, 4):
        src.acquire(cache, i)
    assert not cache.contains("k1")
    state = cache.state()
    assert state["reserved"] == {} and set(state["pins"]) == {"k3", "k4"}


def _worker(root: str, keys: list[int], log_dir: str, barrier, hold: float) -> None:
    cache = ShardCache(root, limit=450 * KB)
    barrier.wait()
    for i in keys:

        def fetch(dl: Download, i: int = i) -> None:
            with open(os.path.join(log_dir, f"{i}.{os.getpid()}"), "w"):
                pass
            time.sleep(0.05)
            dl.write(blob(i))

        path = cache.acquire(f"k{i}", **meta(i), fetch=fetch)
        assert read(path) == blob(i)
        time.sleep(hold)
        assert read(path) == blob(i), "file changed under a pin"
        cache.release(f"k{i}")


def test_processes_share_one_cache(tmp_path):
    root, logs = tmp_path / "c", tmp_path / "log"
    logs.mkdir()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    keys = [0, 1, 2, 3, 0, 1, 2, 3]
    procs = [ctx.Process(target=_worker, args=(str(root), keys, str(logs), barrier, 0.02)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    fetched = sorted(int(n.split(".")[0]) for n in os.listdir(logs))
    # budget of 4 shards for 3 readers x 1 pin + LRU: each shard downloaded once, never twice at once
    assert fetched == [0, 1, 2, 3]
    assert ShardCache(root, limit=450 * KB).disk_bytes() <= 450 * KB


def _pin_two_then_release(root: str, pinned, release) -> None:
    cache, src = ShardCache(root, limit=250 * KB), Source()
    src.acquire(cache, 1)
    src.acquire(cache, 2)
    pinned.set()
    release.wait(30)
    time.sleep(0.3)
    assert read(cache.path("k1")) == blob(1), "evicted under a reader"
    cache.release("k1")
    time.sleep(0.5)


def test_state_updates_are_counted_per_operation(tmp_path):
    """`stats()` counts the shared-state updates (`state_updates`) and their time (`state_s`): a miss
    takes two (reserve, then record the download), a hit one, a pin this owner holds already none, and
    only the release of a key's last pin one."""
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    counts = [cache.stats()["state_updates"]]

    def step(fn) -> int:
        fn()
        counts.append(cache.stats()["state_updates"])
        return counts[-1] - counts[-2]

    assert step(lambda: src.acquire(cache, 1)) == 2  # missing: reserved, fetched, recorded
    assert step(lambda: cache.release("k1")) == 1
    assert step(lambda: src.acquire(cache, 1)) == 1  # cached: pinned
    assert step(lambda: src.acquire(cache, 1)) == 0  # pinned by this owner already: counted locally
    assert step(lambda: cache.release("k1")) == 0  # one pin of two
    assert step(lambda: cache.release("k1")) == 1
    assert cache.stats()["state_s"] > 0


def test_a_claim_repeated_reads_the_state_only_after_another_owner_wrote_it(tmp_path):
    """A reader asks for its share at every shard it opens: the same claim again makes no update
    while no other owner has written the state since this owner's last update, and reads the state
    as soon as one has (here another cache object, as another process would), so a new claim
    shrinks this one's share at its next look."""
    mine, other = ShardCache(tmp_path, limit="1MB"), ShardCache(tmp_path, limit="1MB")
    alone = mine.claim(800 * KB, least=100 * KB)
    updates = mine.stats()["state_updates"]
    for _ in range(3):
        assert mine.claim(800 * KB, least=100 * KB) == alone
    assert mine.stats()["state_updates"] == updates  # nothing written, nothing read under the lock
    assert other.claim(800 * KB, least=100 * KB) is not None
    shared = mine.claim(800 * KB, least=100 * KB)
    assert shared is not None and shared < alone and mine.stats()["state_updates"] == updates + 1
    assert mine.claim(800 * KB, least=100 * KB) == shared and mine.stats()["state_updates"] == updates + 1
    other.claim(0)  # withdrawn: the share grows back at the next look
    assert mine.claim(800 * KB, least=100 * KB) == alone
    assert mine.claim(500 * KB, least=100 * KB) is not None  # another claim than the recorded one: written
    assert mine.stats()["state_updates"] == updates + 3


def test_other_process_pins_block_eviction_until_released(tmp_path):
    ctx = mp.get_context("spawn")
    pinned, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_pin_two_then_release, args=(str(tmp_path), pinned, release))
    proc.start()
    assert pinned.wait(30)
    cache, src = ShardCache(tmp_path, limit=250 * KB, deadlock_grace=0.2), Source()
    t0 = time.monotonic()  # before the release: the other reader holds its pins 0.3 s after it
    release.set()
    assert read(src.acquire(cache, 3)) == blob(3)  # waits for the other reader, no error
    assert time.monotonic() - t0 >= 0.25
    assert not cache.contains("k1") and cache.contains("k2")
    proc.join(30)
    assert proc.exitcode == 0


# -- one pin ledger ----------------------------------------------------------------------------------
def test_threads_acquiring_one_missing_shard_leave_no_pin(tmp_path):

    cache = ShardCache(tmp_path, limit="1MB")
    slow = threading.Event()

    def fetch(dl: Download) -> None:
        slow.wait(5)
        dl.write(blob(1))

    paths: list[str] = []
    threads = [
        threading.Thread(target=lambda: paths.append(cache.acquire("k1", **meta(1), fetch=fetch))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)
    slow.set()
    for t in threads:
        t.join(10)
    assert len(paths) == 4 and cache.pinned_keys() == {"k1": 4}
    assert set(cache.state()["pins"]) == {"k1"}
    for _ in range(4):
        cache.release("k1")
    assert cache.state()["pins"] == {} and cache.pinned_keys() == {}
    cache.clear()  # evictable again
    assert not cache.contains("k1")


def _stress(root: str, seed: int, rounds: int, threads: int) -> None:
    import random

    cache = ShardCache(root, limit=1000 * KB, deadlock_grace=30)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        rng = random.Random(seed * 100 + t)
        src = Source()
        try:
            for _ in range(rounds):
                keys = rng.sample(range(6), 2) if rng.random() < 0.5 else [0, 0]  # different and the same
                for i in keys:
                    assert read(src.acquire(cache, i)) == blob(i)
                time.sleep(rng.random() * 0.005)
                for i in keys:
                    cache.release(f"k{i}")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    assert cache.pinned_keys() == {}


def test_stress_threads_by_processes_leave_no_pin(tmp_path):
    """4 processes x 4 threads acquire the same and different shards concurrently (16 holders of at
    most 2 pins over 6 distinct shards fit the 10-shard budget); afterwards no pin, reservation,
    waiter or temp file is left."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_stress, args=(str(tmp_path), seed, 15, 4)) for seed in range(3)]
    for p in procs:
        p.start()
    _stress(str(tmp_path), 9, 15, 4)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    state = ShardCache(tmp_path, limit=1000 * KB).state()
    assert state["pins"] == {} and state["reserved"] == {} and state["waiting"] == {}
    assert os.listdir(os.path.join(tmp_path, "tmp")) == []


def test_default_mode_hashes_a_cached_shard_with_its_stamp_restored(tmp_path):
    """Default settings: a cached file damaged with size and mtime restored (the inode and the recorded
    stamp match) is hashed before its first use by a new cache object, evicted and fetched again."""
    src = Source()
    cache = ShardCache(tmp_path, limit="1MB")
    assert cache.verify == "once"
    path = src.acquire(cache, 1)
    cache.release("k1")
    cache.close()
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(5000)
        fh.write(b"\xff\xfe\xfd")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_ino == st.st_ino and os.stat(path).st_mtime_ns == st.st_mtime_ns
    fresh = ShardCache(tmp_path, limit="1MB")
    assert read(src.acquire(fresh, 1)) == blob(1)
    assert src.fetches == [1, 1]
    fresh.release("k1")
    assert fresh.state()["pins"] == {}


def test_a_collected_cache_objects_pins_are_dropped_without_locking_in_del(tmp_path):
    """`__del__` may run inside another cache object's update (garbage collection): it takes no
    lock; the next update of any cache object in the process drops the collected owner's pins."""
    other = ShardCache(tmp_path, limit="1MB")
    gone, src = ShardCache(tmp_path, limit="1MB"), Source()
    src.acquire(gone, 1)
    assert set(other.state()["pins"]) == {"k1"}
    lock_fd = os.open(os.path.join(tmp_path, ".lock"), os.O_RDWR)  # the cache's cross-process lock
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # an update in progress while the collector runs __del__
    try:
        collector = threading.Thread(target=gone.__del__)
        collector.start()
        collector.join(5)
        assert not collector.is_alive(), "__del__ waited for the cache's lock"
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
    del gone, collector
    assert other.state()["pins"] == {}


def test_download_parts_in_any_order_are_hashed_in_file_order(tmp_path):
    """`write_at`: ranged parts land at their offsets in any order; the xxh3 covers the file in order,
    a damaged or overlapping part fails `check`/`write_at`, and `reset` starts over."""
    import xxhash

    data = bytes(range(256)) * 40
    parts = [(o, data[o:o + 1000]) for o in range(0, len(data), 1000)]
    dl = Download(str(tmp_path / "t"), size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data), where="s0")
    for o, b in [parts[2], parts[0], *parts[3:][::-1], parts[1]]:
        dl.write_at(o, b)
    dl.check()
    dl.finish(fsync=False)
    assert (tmp_path / "t").read_bytes() == data
    dl = Download(str(tmp_path / "u"), size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data), where="s0")
    with pytest.raises(ChecksumError, match="overlaps"):
        dl.write_at(0, data[:1000])
        dl.write_at(500, data[500:1500])
    dl.reset()
    for o, b in parts:
        dl.write_at(o, b if o != 3000 else b"\0" + b[1:])
    with pytest.raises(ChecksumError, match="xxh3"):
        dl.check()
    dl.close()


def test_download_reset_never_truncates_and_the_retry_verifies_from_scratch(tmp_path):
    """The temp file is made at full size and `reset` never truncates it (a reader may map it, and a
    truncate makes ext4 write the whole file back at close): size and times stay; what the failed
    attempt wrote is overwritten by the retry, which verifies from scratch."""
    data = bytes(range(256)) * 8
    path = tmp_path / "t"
    dl = Download(str(path), size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data), where="s0")
    assert path.stat().st_size == len(data)
    os.utime(path, ns=(10**9, 10**9))
    ctime = os.stat(path).st_ctime_ns
    time.sleep(0.01)
    dl.reset()
    assert os.stat(path).st_ctime_ns == ctime and os.stat(path).st_mtime_ns == 10**9
    dl.write(b"junk" * 100)
    dl.reset()
    assert path.stat().st_size == len(data) and dl.written == 0
    dl.write(data)
    dl.check()
    dl.finish(fsync=False)
    assert path.read_bytes() == data


# -- a verified download vouches for its file -------------------------------------------------------


def test_a_verified_download_or_check_vouches_for_that_file_only(tmp_path):
    """A download whose xxh3 matched, and a cached file hashed again, are vouched by identity; a file
    changed since, or a download that failed its check, is not."""
    from fastload.formats.blocks import file_identity, vouched

    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    p = src.acquire(cache, 1)
    assert vouched(file_identity(os.stat(p)))
    cache.release("k1")
    src.bad.add(2)
    with pytest.raises(ChecksumError):
        src.acquire(cache, 2)
    with open(p, "r+b") as fh:
        fh.write(b"\xff")
    os.utime(p, ns=(1, 1))  # changed after its check: another identity
    assert not vouched(file_identity(os.stat(p)))
    other = ShardCache(tmp_path, limit="1MB", verify="always")
    p2 = src.acquire(other, 1)  # hashed, found corrupt, fetched again: the new file is vouched
    assert read(p2) == blob(1) and vouched(file_identity(os.stat(p2)))


def test_reader_skips_block_hashes_of_a_vouched_file_only(tmp_path, monkeypatch):
    """A shard vouched for is read without hashing its blocks; one changed after it was vouched is hashed
    and its corruption reported."""
    import numpy as np

    import fastload.formats.shard as shard_mod
    from fastload.formats import FastloadDataset, write
    from fastload.formats.blocks import vouch_file

    root = str(tmp_path / "ds")
    write(({"x": np.full(100, i % 7, np.uint8)} for i in range(50)), root, shard_size=10_000, progress=False)
    hashed = []
    real = shard_mod.verify_blocks
    monkeypatch.setattr(shard_mod, "verify_blocks", lambda *a: (hashed.append(len(a[3])), real(*a))[1])
    ds = FastloadDataset(root)
    paths = [os.path.join(root, s.file) for s in ds.manifest.shards]
    for p in paths:
        vouch_file(os.stat(p))
    assert [int(ds[i]["x"][0]) for i in range(len(ds))] == [i % 7 for i in range(50)]
    assert hashed == []
    with open(paths[0], "r+b") as fh:  # a byte of the first sample's data, changed after the vouch
        data = fh.read()
        pos = data.find(bytes([0] * 100))
        fh.seek(pos)
        fh.write(b"\x01")
    os.utime(paths[0], ns=(1, 1))
    with pytest.raises(ChecksumError):
        FastloadDataset(root)[0]
    assert hashed


_ENTRY_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "touch", "stamp", "del"]),
        st.integers(0, 11),  # key
        st.integers(0, 1 << 40),  # size
        st.integers(0, 50),  # used
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=_ENTRY_OPS)
def test_entry_table_keeps_entries_totals_and_lru_order_of_a_dict(ops):
    """`EntryTable` against a dict: entries, counts and byte totals (kept by triggers, at any block),
    least recently used order, read-only entries; a rolled-back update changes nothing."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        cache = ShardCache(root, limit="1TB")
        block = cache.block
        model: dict[str, dict] = {}
        with cache._store.locked() as state:
            entries = state["entries"]
            for op, k, size, used in ops:
                key = f"k{k}"
                if op == "put":
                    entries.put(key, size=size, used=float(used), stamp=[size, used, "boot"])
                    model[key] = {"size": size, "used": float(used), "stamp": [size, used, "boot"]}
                elif op == "touch":
                    entries.touch(key, float(used))
                    if key in model:
                        model[key]["used"] = float(used)
                elif op == "stamp":
                    entries.set_stamp(key, None)
                    if key in model:
                        model[key]["stamp"] = None
                elif key in model:
                    del entries[key]
                    del model[key]
                else:
                    with pytest.raises(KeyError):
                        del entries[key]
            assert len(entries) == len(model) and set(entries) == set(model)
            assert entries.copy() == model
            for b in (1, block, 512, 1 << 20):
                assert entries.bytes(b) == sum(-(-m["size"] // b) * b for m in model.values())
            assert [k for k, _ in entries.least_recently_used()] == sorted(model, key=lambda k: (model[k]["used"], k))
            for key in model:
                assert key in entries and dict(entries[key]) == model[key]
                with pytest.raises(TypeError):
                    entries[key]["used"] = 0.0  # type: ignore[index]
        with pytest.raises(RuntimeError), cache._store.locked() as state:
            state["entries"].put("gone", size=1, used=0.0, stamp=None)
            raise RuntimeError("an update that fails")
        assert cache.state()["entries"] == model
        cache.close()


def test_a_cache_of_the_earlier_layout_keeps_its_files_as_entries(tmp_path):
    """A cache directory whose state is `state.0.json`/`state.1.json` opens with its files as
    entries (hashed before first use) and the old state files gone."""
    os.makedirs(tmp_path / "data")
    (tmp_path / "data" / "k1").write_bytes(blob(1))
    for name in ("state.0.json", "state.1.json"):
        (tmp_path / name).write_text('{"version":1}')
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    assert cache.contains("k1") and not (tmp_path / "state.0.json").exists()
    assert read(src.acquire(cache, 1)) == blob(1) and src.fetches == []


def test_an_owner_is_dead_once_its_process_is_gone_or_a_zombie_past_the_recheck(monkeypatch):
    """`owner_alive`: a process that exited and was reaped is dead at once; one killed but not
    reaped (a zombie, which `kill(pid, 0)` still reaches) is dead from its next full check,
    at most `RECHECK_S` after the last; a pid reused by another process is not the owner."""
    import subprocess

    from fastload.remote.cache import state as state_mod
    from fastload.system import process_start

    def owner_of(proc: subprocess.Popen) -> str:
        return f"{proc.pid}-{process_start(proc.pid):.2f}-1"

    reaped = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["sleep", "30"])
    try:
        owners = {"reaped": owner_of(reaped), "zombie": owner_of(zombie)}
        assert all(owner_alive(o) for o in owners.values())
        reaped.kill()
        reaped.wait()
        zombie.kill()
        time.sleep(0.2)  # exited, not reaped: a zombie
        assert not owner_alive(owners["reaped"])
        assert owner_alive(owners["zombie"])  # verified less than RECHECK_S ago
        monkeypatch.setattr(state_mod, "RECHECK_S", 0.0)
        assert not owner_alive(owners["zombie"])
        other_start = f"{zombie.pid}-12345.00-1"  # same pid, another start time
        assert not owner_alive(other_start)
    finally:
        for proc in (reaped, zombie):
            proc.kill()
            proc.wait()


def test_a_state_locked_by_another_program_is_an_error_not_damage(tmp_path, monkeypatch):
    """`state.db` held by a program outside the cache (a `sqlite3` shell in a transaction) makes an
    update fail with `CacheStateError` once SQLite's wait ends; the state is not rebuilt over it."""
    from fastload.remote.cache import state as state_mod

    monkeypatch.setattr(state_mod, "_BUSY_S", 0.2)
    cache, src = ShardCache(tmp_path, limit="1MB"), Source()
    src.acquire(cache, 1)
    cache.release("k1")
    cache.close()
    shell = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(CacheStateError, match=r"state.db cannot be updated \(database is locked\)"):
            ShardCache(tmp_path, limit="1MB")
    finally:
        shell.execute("ROLLBACK")
        shell.close()
    again = ShardCache(tmp_path, limit="1MB")
    assert again.contains("k1") and again.state()["entries"]["k1"]["stamp"] is not None  # not rebuilt


def test_a_step_of_the_wall_clock_leaves_every_owner_alive(monkeypatch, tmp_path):
    """Owner ids carry start times from boot: when the wall clock steps (NTP, a VM's host), and with
    it the boot time psutil computes from it, this process and a worker's parent still read as
    themselves, and a cache object's pins stay; an owner id written with a wall clock start time
    (an earlier version) reads as alive while its pid runs."""
    import psutil
    import psutil._pslinux as pslinux

    from fastload.remote.cache import state as state_mod
    from fastload.remote.cache.state import owner_id
    from fastload.workers.processes import _process_start

    other = ShardCache(tmp_path, limit="1MB")
    src = Source()
    src.acquire(other, 1)
    me, parent_start = owner_id(), _process_start(os.getppid())
    wall = psutil.Process().create_time()
    wall_owner = f"{os.getpid()}-{wall:.2f}-9"
    monkeypatch.setattr(state_mod, "RECHECK_S", 0.0)  # every call checks the start time again
    boot = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: boot + 1.0)  # /proc/stat's btime after a step
    assert psutil.Process().create_time() == pytest.approx(wall + 1.0)  # what psutil says moved
    assert owner_alive(me) and owner_alive(wall_owner)
    assert _process_start(os.getppid()) == parent_start  # a forkserver worker's check of its parent
    ShardCache(tmp_path, limit="1MB").state()  # another cache object's update prunes dead owners' pins
    assert set(other.state()["pins"]) == {"k1"}


@pytest.mark.parametrize("replaced", [False, True])
def test_disk_bytes_never_counts_a_file_evicted_while_the_downloads_were_listed(tmp_path, monkeypatch, replaced):
    """An eviction and a new download between the two listings of data/: the evicted file is not
    counted beside the download (nor is a new file of the same name renamed in meanwhile)."""
    from fastload.remote.cache import files

    data, tmp = tmp_path / "data", tmp_path / "tmp"
    data.mkdir()
    tmp.mkdir()
    for name in ("a", "b", "c"):
        (data / name).write_bytes(b"x" * 1000)
    real_scandir = os.scandir
    old_a = os.open(data / "a", os.O_RDONLY)  # its inode number stays taken: a new `a` gets another

    def scandir(folder):
        if os.fspath(folder) == str(tmp):  # the cache evicts `a` and reserves the next download now
            os.unlink(data / "a")
            (tmp / "d.1.1").write_bytes(b"y" * 1000)
            if replaced:  # and another download of `a` completes: a new file of the old name
                (tmp / "a.1.2").write_bytes(b"z" * 1000)
                os.replace(tmp / "a.1.2", data / "a")
        return real_scandir(folder)

    monkeypatch.setattr(files.os, "scandir", scandir)
    try:
        assert files.disk_bytes(str(tmp_path)) == 3000  # b, c and the download of d: never 4000
    finally:
        os.close(old_a)
    monkeypatch.setattr(files.os, "scandir", real_scandir)
    assert files.disk_bytes(str(tmp_path)) == (4000 if replaced else 3000)
