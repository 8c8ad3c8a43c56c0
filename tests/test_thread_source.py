"""ThreadSource work stealing: a waiting consumer fetches unstarted later batches itself,
without changing the order, the contents or where errors surface."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from fastload.formats import FastloadDataset, Field, Schema, write
from fastload.loader import Loader
from fastload.system import usable_cores
from fastload.workers import ThreadSource


def _recording_fetch(gate: threading.Event, fail: set[int] = frozenset(), release_at: int | None = None):
    """A fetch that records which thread ran each batch; batch 0 waits for `gate` (and sets
    `fetch.started0` when it begins); running batch `release_at` sets `gate`."""
    ran_by: dict[int, str] = {}
    started0 = threading.Event()

    def fetch(indices):
        j = int(indices[0])
        if j == 0:
            started0.set()
            assert gate.wait(10), "batch 0 was never released"
        ran_by[j] = threading.current_thread().name
        if j == release_at:
            gate.set()
        if j in fail:
            raise ValueError(f"bad batch {j}")
        return {"j": j}, {"read": 0.0}

    fetch.started0 = started0
    return fetch, ran_by


def _stuck_on_batch_0(fail: set[int] = frozenset()) -> tuple[ThreadSource, dict[int, str]]:
    """One worker that has started batch 0 of 4 and stays on it until batch 3 runs (batches 1..3
    unstarted: a consumer that steals them releases it, however slowly its thread is scheduled)."""
    gate = threading.Event()
    fetch, ran_by = _recording_fetch(gate, fail, release_at=3)
    src = ThreadSource(fetch, 1)
    for j in range(4):
        src.put(j, np.array([j]))
    assert fetch.started0.wait(10)
    return src, ran_by


def test_consumer_steals_unstarted_batches_while_waiting() -> None:
    # the only worker is stuck on batch 0: the consumer fetches 1..3, then batch 0 is released
    src, ran_by = _stuck_on_batch_0()
    try:
        got = [src.get(j)[0]["j"] for j in range(4)]
    finally:
        src.close()
    assert got == [0, 1, 2, 3]
    me = threading.current_thread().name
    assert ran_by[0] != me
    assert [ran_by[j] for j in (1, 2, 3)] == [me, me, me]
    assert src.stolen == 3


def test_error_in_a_stolen_batch_surfaces_at_its_turn() -> None:
    src, _ = _stuck_on_batch_0(fail={2})
    try:
        assert src.get(0)[0]["j"] == 0  # batch 2 failed while the consumer waited: not raised yet
        assert src.stolen >= 2
        assert src.get(1)[0]["j"] == 1
        with pytest.raises(ValueError, match="bad batch 2"):
            src.get(2)
        assert src.get(3)[0]["j"] == 3
    finally:
        src.close()


def test_no_stealing_with_a_timeout() -> None:
    """With `timeout` the consumer only waits (a stolen batch could outlast the timeout)."""
    gate = threading.Event()
    fetch, _ = _recording_fetch(gate)
    src = ThreadSource(fetch, 1, timeout=10)
    try:
        for j in range(3):
            src.put(j, np.array([j]))
        threading.Timer(0.2, gate.set).start()
        assert [src.get(j)[0]["j"] for j in range(3)] == [0, 1, 2]
    finally:
        src.close()
    assert src.stolen == 0


def test_loader_with_stealing_thread_workers_covers_each_sample_once(tmp_path) -> None:
    schema = Schema((Field("x", "ndarray", np.uint8, (64,)), Field("y", "scalar", np.int64)))
    n = 5000
    rows = np.random.default_rng(0).integers(0, 256, (n, 64), dtype=np.uint8)
    samples = ({"x": rows[i], "y": i} for i in range(n))
    write(samples, tmp_path / "ds", schema=schema, shard_size=64 << 10, progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    inline = Loader(ds, batch_size=32, shuffle=True, seed=3)
    threaded = Loader(ds, batch_size=32, shuffle=True, seed=3, num_workers=1, worker_type="thread")
    for epoch in range(2):
        a = [b["y"].numpy().copy() for b in inline]
        b = [(b["y"].numpy().copy(), b["x"].numpy().copy()) for b in threaded]
        assert len(a) == len(b)
        for ya, (yb, xb) in zip(a, b):
            np.testing.assert_array_equal(ya, yb)
            np.testing.assert_array_equal(xb, rows[yb])
        seen = np.concatenate([y for y, _ in b])
        assert np.array_equal(np.sort(seen), np.arange(n)), f"epoch {epoch}"


def test_no_stealing_when_a_worker_init_fn_prepares_the_threads(tmp_path) -> None:
    """The consumer's thread never ran `worker_init_fn`: it must not fetch for the workers."""
    schema = Schema((Field("y", "scalar", np.int64),))
    write(({"y": i} for i in range(640)), tmp_path / "ds", schema=schema, progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    prepared: set[str] = set()
    seen_by: set[str] = set()

    class Watched:
        def __len__(self) -> int:
            return len(ds)

        def get_batch(self, indices):
            seen_by.add(threading.current_thread().name)
            return ds.get_batch(indices)

    loader = Loader(
        Watched(),
        batch_size=16,
        num_workers=1,
        worker_type="thread",
        worker_init_fn=lambda wid: prepared.add(threading.current_thread().name),
    )
    assert sum(len(b["y"]) for b in loader) == 640
    assert seen_by and seen_by <= prepared


def test_bounded_stealing_takes_a_nearly_done_batch() -> None:
    """steal="bounded": a consumer whose batch is about to finish waits for it (a stolen fetch
    would hold up the GPU step it launches next)."""
    fetch_s = 0.3

    started = {j: threading.Event() for j in range(5)}

    def fetch(indices):
        started[int(indices[0])].set()
        time.sleep(fetch_s)
        return {"j": int(indices[0])}, {"read": fetch_s}

    src = ThreadSource(fetch, 1, steal="bounded")  # "auto" picks it on CUDA machines
    try:
        src.put(0, np.array([0]))
        assert src.get(0)[0]["j"] == 0  # taken inline or by the worker: the mean fetch time is now known
        for j in range(1, 5):
            src.put(j, np.array([j]))
        assert started[1].wait(10)  # the worker has started batch 1
        time.sleep(fetch_s - 0.08)  # batch 1 is ~80 ms from done, far less than 0.75 of a fetch
        before = src.stolen
        assert src.get(1)[0]["j"] == 1
        assert src.stolen == before
    finally:
        src.close()


def test_steal_modes() -> None:
    def fetch(indices):
        return {}, {}

    with pytest.raises(ValueError, match="steal must be one of"):
        ThreadSource(fetch, 1, steal="sometimes")
    auto, timed = ThreadSource(fetch, 1), ThreadSource(fetch, 1, steal="always", timeout=5)
    try:
        if usable_cores() > 1:
            assert auto.steal == ("bounded" if torch.cuda.is_available() else "always")
        else:
            assert auto.steal is False
        full = ThreadSource(fetch, usable_cores())
        try:
            assert full.steal is False  # the workers fill every core already
        finally:
            full.close()
        assert timed.steal is False  # a stolen batch could outlast the timeout
    finally:
        auto.close()
        timed.close()


def _fastload_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fastload-") and t.is_alive()}


def _wait_no_fastload_threads(before: set[threading.Thread], limit: float = 5.0) -> set[threading.Thread]:
    deadline = time.monotonic() + limit
    while (left := _fastload_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


@pytest.mark.parametrize("how", ["exhaust", "break", "close", "del"])
def test_thread_workers_serve_every_epoch_and_exit_with_their_loader(tmp_path, how: str) -> None:
    """Worker threads outlive an epoch that ends or is left early (the next epoch reuses them,
    starting none) and stop when the Loader is closed or dropped, also mid-epoch."""
    import gc

    schema = Schema((Field("y", "scalar", np.int64),))
    write(({"y": i} for i in range(2000)), tmp_path / "ds", schema=schema, progress=False)
    before = _fastload_threads()
    loader = Loader(FastloadDataset(tmp_path / "ds"), batch_size=16, num_workers=2, worker_type="thread")
    it = iter(loader)
    for _ in range(5):
        next(it)
    started = _fastload_threads() - before
    assert started, "no worker threads were started"
    if how in ("exhaust", "break"):
        if how == "exhaust":
            assert sum(1 for _ in it) == len(loader) - 5
        else:
            it.close()
        assert _fastload_threads() - before == started  # idle between epochs, not stopped
        ys = torch.cat([b["y"] for b in loader])
        assert sorted(ys.tolist()) == list(range(2000))  # the next epoch, on the same threads
        assert _fastload_threads() - before == started
        del it, loader
        gc.collect()
    elif how == "close":
        loader.close()
    else:
        del it, loader
        gc.collect()
    assert not _wait_no_fastload_threads(before)


def test_thread_workers_run_worker_init_fn_each_epoch_unless_persistent(tmp_path) -> None:
    """As torch's workers: `worker_init_fn` runs in fresh workers every epoch, or once with
    `persistent_workers=True`."""
    schema = Schema((Field("y", "scalar", np.int64),))
    write(({"y": i} for i in range(64)), tmp_path / "ds", schema=schema, progress=False)
    for persistent, runs_per_worker in ((False, 3), (True, 1)):
        calls: list[int] = []
        loader = Loader(
            FastloadDataset(tmp_path / "ds"),
            batch_size=4,
            num_workers=2,
            worker_type="thread",
            worker_init_fn=calls.append,
            persistent_workers=persistent,
        )
        for _ in range(3):
            assert sum(len(b["y"]) for b in loader) == 64
        loader.close()
        assert sorted(calls) == sorted([0, 1] * runs_per_worker), persistent


def test_a_failing_thread_init_is_raised_in_the_consumer() -> None:
    def init(wid: int) -> None:
        raise OSError(f"cannot prepare worker {wid}")

    src = ThreadSource(lambda idx: ({"j": int(idx[0])}, {}), 2, init=init, steal=False)
    try:
        src.put(0, np.array([0]))
        with pytest.raises(OSError, match="cannot prepare worker"):
            src.get(0)
    finally:
        src.close()


def test_workers_filling_every_core_start_as_asked_without_stealing(tmp_path) -> None:
    """num_workers >= usable cores: exactly num_workers threads, and the consumer does not steal
    (the workers fill every core); likewise with a worker_init_fn."""
    schema = Schema((Field("y", "scalar", np.int64),))
    write(({"y": i} for i in range(256)), tmp_path / "ds", schema=schema, progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    cores = usable_cores()
    nw = max(2, cores)
    it = iter(Loader(ds, batch_size=16, num_workers=nw, worker_type="thread"))
    try:
        assert it.source.num_threads == nw
        assert it.source.steal is False
        assert sorted(int(y) for b in it for y in b["y"]) == list(range(256))
    finally:
        it.close()
    with_init = iter(Loader(ds, batch_size=16, num_workers=nw, worker_type="thread", worker_init_fn=lambda w: None))
    try:
        assert with_init.source.num_threads == nw and with_init.source.steal is False
    finally:
        with_init.close()


def test_reports_do_not_pile_up_when_the_consumer_never_waits() -> None:
    """Workers that are always ahead report nothing: the wake-up queue stays empty, not one entry per batch."""
    src = ThreadSource(lambda idx: ({"j": int(idx[0])}, {}), 1, steal=False)
    try:
        for j in range(200):
            src.put(j, np.array([j]))
        deadline = time.monotonic() + 10
        while src.finished < 200 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [src.get(j)[0]["j"] for j in range(200)] == list(range(200))
        assert src.reports_waiting <= 1
    finally:
        src.close()


def test_a_pool_serves_the_next_source_without_batches_of_the_closed_one() -> None:
    """A worker still fetching a batch of a closed source (an epoch left early) stores it with that
    source: the next source on the same pool gets only its own batches, in order."""
    from fastload.workers import ThreadPool

    pool = ThreadPool(1)
    slow_started = threading.Event()

    def slow(idx: np.ndarray) -> tuple[dict[str, Any], dict[str, float]]:
        if int(idx[0]) > 0:
            slow_started.set()
            time.sleep(0.2)
        return {"epoch": 0, "j": int(idx[0])}, {}

    first = ThreadSource(slow, 1, pool=pool, steal=False)
    for j in range(4):
        first.put(j, np.array([j]))
    assert first.get(0)[0] == {"epoch": 0, "j": 0}
    assert slow_started.wait(5)
    first.close()  # batch 1 is still being fetched
    assert not pool.closed
    second = ThreadSource(lambda idx: ({"epoch": 1, "j": int(idx[0])}, {}), 1, pool=pool, steal=False)
    try:
        for j in range(6):
            second.put(j, np.array([j]))
        assert [second.get(j)[0] for j in range(6)] == [{"epoch": 1, "j": j} for j in range(6)]
    finally:
        second.close()
        pool.close()
    assert pool.closed


def test_a_forked_child_starts_its_own_worker_threads(tmp_path) -> None:
    """The Loader keeps its worker threads across epochs; a child forked after an epoch has none of
    them, so it starts its own instead of waiting on threads that do not exist there."""
    import multiprocessing

    schema = Schema((Field("y", "scalar", np.int64),))
    write(({"y": i} for i in range(640)), tmp_path / "ds", schema=schema, progress=False)
    loader = Loader(
        FastloadDataset(tmp_path / "ds"),
        batch_size=16,
        num_workers=2,
        worker_type="thread",
        worker_init_fn=lambda wid: None,  # workers only: the consumer never fetches itself
        persistent_workers=True,
    )
    assert sum(len(b["y"]) for b in loader) == 640
    ctx = multiprocessing.get_context("fork")
    results = ctx.SimpleQueue()

    def child() -> None:
        results.put(sorted(int(y) for b in loader for y in b["y"]))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    try:
        assert proc.exitcode == 0, "the child hung or failed"
        assert results.get() == list(range(640))
    finally:
        if proc.is_alive():
            proc.kill()
        loader.close()


_EXIT_SCRIPT = """
import gc, sys
from fastload.formats import FastloadDataset
from fastload.loader import Loader
ds = FastloadDataset(sys.argv[1])
for _ in range(12):
    loader = Loader(ds, batch_size=16, num_workers=2, worker_type="thread", autotune=False)
    loader.cycle = loader  # left to the garbage collector
    for _ in range(2):
        for batch in loader:
            pass
gc.collect()  # the pools' finalizers wake their idle workers: they are on their way out at exit
"""


def test_a_process_exits_cleanly_with_loaders_left_to_the_garbage_collector(tmp_path) -> None:
    """Worker threads kept across epochs end before the interpreter is torn down: a thread ending
    during finalization while it frees a tensor aborted the process ("terminate called without an
    active exception"; in 4 of 8 runs of this script before the fix)."""
    import subprocess
    import sys

    schema = Schema((Field("x", "ndarray", np.float32, (64,)), Field("y", "scalar", np.int64)))
    write(
        ({"x": np.full(64, i, np.float32), "y": i} for i in range(512)), tmp_path / "ds", schema=schema, progress=False
    )
    script = tmp_path / "exit_case.py"
    script.write_text(_EXIT_SCRIPT)
    for _ in range(6):
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "ds")], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr


def test_the_pool_keeps_num_workers_threads_whatever_the_cores(tmp_path, monkeypatch) -> None:
    """The worker threads started are `num_workers`, on 2 cores as on 4, and the pool is kept
    across epochs with the same samples each epoch."""
    import fastload.pipeline.config as config_module

    schema = Schema((Field("y", "scalar", np.int64),))
    write(({"y": i} for i in range(640)), tmp_path / "ds", schema=schema, progress=False)
    for cores in (2, 4):
        monkeypatch.setattr(config_module, "usable_cores", lambda cores=cores: cores)
        loader = Loader(FastloadDataset(tmp_path / "ds"), batch_size=16, num_workers=2, worker_type="thread")
        try:
            assert sorted(int(y) for b in loader for y in b["y"]) == list(range(640))
            first = loader.thread_pool
            assert first is not None and first.num_workers == 2
            assert sorted(int(y) for b in loader for y in b["y"]) == list(range(640))
            assert loader.thread_pool is first  # kept across epochs
        finally:
            loader.close()
