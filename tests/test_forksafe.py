"""A child forked while one of the parent's threads holds a lock must not inherit it locked."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

from fastload.formats import write
from fastload.formats.forksafe import reset_in_child
from fastload.formats.reader import FastloadDataset
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
    cache = ShardCache(tmp_path, limit="1MB")
    cache.claim(0)
    assert _fork_while_held(lambda: cache._mutex, lambda: cache.claim(1000)) == 0


def test_dataset_in_a_child_forked_while_a_thread_holds_its_lock(tmp_path):
    write([{"x": np.full(4, i, dtype=np.int32)} for i in range(100)], str(tmp_path / "ds"), progress=False)
    ds = FastloadDataset(str(tmp_path / "ds"))

    def read() -> None:
        assert ds[7]["x"].tolist() == [7] * 4

    assert _fork_while_held(lambda: ds._lock, read) == 0


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
    from fastload.formats import forksafe

    before = len(forksafe._REGISTERED)
    for _ in range(3):
        reset_in_child(type("T", (), {})(), lambda obj: None)
    assert len(forksafe._REGISTERED) == before
