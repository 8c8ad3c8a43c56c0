"""A child forked while one of the parent's threads holds a lock must not inherit it locked."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

from fastload.formats import write
from fastload.formats.forksafe import reset_in_child
from fastload.formats.reader import FastloadDataset
from fastload.formats.storage import LocalStorage
from fastload.remote.cache.shard_cache import ShardCache


def _in_child(run, timeout: float = 10.0) -> int:
    """Fork; the child runs `run()` and exits 0 (1 on an exception). The child's exit code, or -9 when it hung."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(int(timeout) + 5)  # never outlive the test
        try:
            run()
        except BaseException:  # noqa: BLE001 - the child reports any failure by its exit code
            os._exit(1)
        os._exit(0)
    deadline = threading.Event()
    for _ in range(int(timeout * 20)):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        deadline.wait(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def _fork_while_held(lock_of, use) -> int:
    """Fork while another thread holds `lock_of()`; the child runs `use()`."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock_of():
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        return _in_child(use)
    finally:
        release.set()
        t.join()


def test_shard_cache_in_a_child_forked_while_a_thread_holds_its_mutex(tmp_path):
    """A thread in `claim` waits for the cache's cross-process `.lock` (held here) while holding
    the cache's mutex; a child forked then claims once that lock is free."""
    import fcntl

    cache = ShardCache(tmp_path, limit="1MB")
    cache.claim(0)
    lock_fd = os.open(tmp_path / ".lock", os.O_RDWR)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    claimer = threading.Thread(target=cache.claim, args=(500,))
    claimer.start()
    try:
        probe = threading.Thread(target=cache.pinned_keys)  # takes the mutex alone: waits while the claimer holds it
        probe.start()
        probe.join(0.5)
        assert probe.is_alive(), "the claimer holds the mutex while it waits for the file lock"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            signal.alarm(15)
            try:
                code = 0 if cache.claim(1000) is not None else 1
            except BaseException:  # noqa: BLE001 - the child reports any failure by its exit code
                code = 1
            os._exit(code)
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
        claimer.join()
        probe.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class _HeldOpen(LocalStorage):
    """Local files whose next `acquire` once `armed` waits for `go`: the thread opening that
    shard holds the dataset's lock meanwhile (the dataset acquires a shard's file under it)."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.armed, self.opening, self.go = False, threading.Event(), threading.Event()

    def acquire(self, name: str, *, size: int, xxh3: str) -> str:
        if self.armed and not self.opening.is_set():
            self.opening.set()
            self.go.wait(30)
        return super().acquire(name, size=size, xxh3=xxh3)


def test_dataset_in_a_child_forked_while_a_thread_opens_a_shard(tmp_path):
    write([{"x": np.full(4, i, dtype=np.int32)} for i in range(100)], str(tmp_path / "ds"), progress=False)
    storage = _HeldOpen(tmp_path / "ds")
    ds = FastloadDataset(storage=storage)
    storage.armed = True
    opener = threading.Thread(target=lambda: ds[0])
    opener.start()
    assert storage.opening.wait(10)

    def read() -> None:
        assert ds[7]["x"].tolist() == [7] * 4

    try:
        code = _in_child(read)
    finally:
        storage.go.set()
        opener.join()
    assert code == 0


def test_reset_in_child_runs_in_the_child_only_while_the_object_lives():
    class Box:
        lock = threading.Lock()

    box = Box()
    box.lock = threading.Lock()
    reset_in_child(box, lambda b: setattr(b, "lock", threading.Lock()))

    def use() -> None:
        if not box.lock.acquire(timeout=2):
            raise RuntimeError("the child inherited a held lock")

    assert _fork_while_held(lambda: box.lock, use) == 0


def test_registrations_of_dead_objects_are_dropped():
    """Registering short-lived objects holds no memory once they are gone (nor keeps them alive)."""
    import gc
    import tracemalloc
    import weakref

    from fastload.formats import forksafe

    def register_many(n: int) -> None:
        for _ in range(n):
            reset_in_child(type("T", (), {})(), lambda obj: None)

    register_many(10)  # warm up
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        register_many(5000)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    in_module = [tracemalloc.Filter(True, forksafe.__file__)]
    diff = after.filter_traces(in_module).compare_to(before.filter_traces(in_module), "filename")
    held = sum(stat.size_diff for stat in diff)
    assert held < 16 << 10, f"{held} bytes still held by the registry after 5000 dead registrations"
    obj = type("T", (), {})()
    ref = weakref.ref(obj)
    reset_in_child(obj, lambda o: None)
    del obj
    gc.collect()
    assert ref() is None


def test_a_reset_that_fails_in_the_child_leaves_the_others_to_run():
    """One object's reset failing in the child (say, over a file the parent removed) is logged and
    does not leave the objects registered after it holding the parent's locks."""

    class Holder:
        def __init__(self) -> None:
            self.lock = threading.Lock()

    def fail(_: object) -> None:
        raise FileNotFoundError("the parent removed it")

    failing, holder = Holder(), Holder()
    reset_in_child(failing, fail)
    reset_in_child(holder, lambda obj: setattr(obj, "lock", threading.Lock()))

    def use() -> None:
        if not holder.lock.acquire(timeout=2):
            raise RuntimeError("the child inherited the lock locked")

    assert _fork_while_held(lambda: holder.lock, use) == 0


def test_a_fork_waits_for_a_cache_update_under_way_and_the_child_uses_the_cache(tmp_path):
    """No thread is inside SQLite when the process forks: the fork waits for an update in progress
    to commit, and the child opens the cache afresh (the parent's connection stays the parent's)."""
    import json
    import sqlite3
    import time

    cache = ShardCache(tmp_path, limit="1MB")
    cache.claim(100)
    inside = threading.Event()

    def update() -> None:
        with cache._store.locked() as state:  # an update under way while the main thread forks
            inside.set()
            time.sleep(0.3)
            state["claims"]["0-0-1"] = [5, 5]  # an owner that does not run: the next update drops it

    def committed() -> bool:
        conn = sqlite3.connect(tmp_path / "state.db")
        try:
            return "0-0-1" in json.loads(conn.execute("SELECT doc FROM live").fetchone()[0])["claims"]
        finally:
            conn.close()

    t = threading.Thread(target=update)
    t.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(15)
        code = 0
        try:
            if not committed():
                code = 2  # forked inside the update
            elif ShardCache(tmp_path, limit="1MB").claim(200) is None:
                code = 3
        except BaseException:  # noqa: BLE001 - the child reports any failure by its exit code
            code = 1
        os._exit(code)
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.claim(300) == 300  # the parent's connection still works
    assert set(cache.state()["claims"]) == {cache._store.owner}
