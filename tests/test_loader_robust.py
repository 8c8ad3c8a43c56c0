"""Failures, shutdown, buffer reuse, device stage and stats of `fastload.Loader`."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
import torch

from fastload.loader import Loader

pytestmark = pytest.mark.timeout(120)

WORKERS = [(0, "auto"), (2, "thread"), (2, "process")]


class FailingDS:
    def __init__(self, n: int = 64, bad: int = 17, batched: bool = False) -> None:
        self.n, self.bad = n, bad
        if batched:
            self.get_batch = self._get_batch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.bad:
            raise ValueError(f"corrupt record {i}")
        return np.full(4, i)

    def _get_batch(self, idx) -> dict:
        idx = np.asarray(idx)
        if (idx == self.bad).any():
            raise ValueError("corrupt record in batch")
        return {"x": np.repeat(idx[:, None], 4, 1)}


class SlowDS:
    def __init__(self, n: int = 400, delay: float = 0.01) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        time.sleep(self.delay)
        return np.full((64,), i, dtype=np.float32)


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def leaked_shm(before: set[str], pids: set[int]) -> set[str]:
    """New /dev/shm entries named after one of `pids` (others' tests may create their own)."""
    return {e for e in shm_entries() - before if any(f"_{p}_" in e or e.endswith(f"_{p}") for p in pids)}


def wait_gone(pids: set[int], seconds: float = 5.0) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        if not alive:
            return set()
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("batched", [False, True])
def test_dataset_error_names_the_sample_and_shuts_down(workers, batched):
    nw, wt = workers
    before = children()
    loader = Loader(FailingDS(batched=batched), batch_size=8, num_workers=nw, worker_type=wt)
    t0 = time.monotonic()
    got = 0
    with pytest.raises(ValueError) as exc:
        for _ in loader:
            got += 1
    assert time.monotonic() - t0 < 5
    assert got == 2  # batches before the failing one were delivered, in order
    text = str(exc.value) + "".join(getattr(exc.value, "__notes__", []))
    assert "sample index 17" in text
    assert "corrupt record" in text
    if wt == "process":
        assert "Traceback" in text  # the worker's original traceback travels with the error
    # as in torch, the iterator survives a batch's error (the next batch can be asked for); its
    # workers end as soon as nothing holds it: here, the traceback's frames (a cycle through torch's
    # ExceptionWrapper.reraise frame, which holds the exception it raised: freed by the collector)
    del exc
    gc.collect()
    assert not wait_gone(children() - before)


def test_killed_worker_is_reported_not_hung():
    loader = Loader(SlowDS(delay=0.02), batch_size=4, num_workers=2, worker_type="process")
    it = iter(loader)
    next(it)
    victim = it.source.pids[1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {victim}\) exited unexpectedly") as exc:
        for _ in it:
            pass
    assert str(exc.value.__cause__) == f"DataLoader worker (pid {victim}) is killed by signal: Killed. "  # torch's
    assert time.monotonic() - t0 < 5
    assert not wait_gone(set(it.source.pids if it.source else []) | {victim})


@pytest.mark.parametrize("wt", ["thread", "process"])
def test_timeout_raises(wt):
    loader = Loader(SlowDS(n=8, delay=3.0), batch_size=4, num_workers=1, worker_type=wt, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        next(iter(loader))
    assert time.monotonic() - t0 < 10  # the batch takes 12 s: the timeout ended the wait (bound: a slow worker start)


@pytest.mark.parametrize("how", ["break", "del", "close"])
def test_mid_epoch_abandon_leaves_no_processes_or_shm(how):
    before, shm_before = children(), shm_entries()
    loader = Loader(SlowDS(delay=0.001), batch_size=8, num_workers=2, worker_type="process")
    it = iter(loader)
    for _ in range(3):
        next(it)
    spawned = children() - before
    assert len(spawned) >= 2
    if how == "close":
        loader.close()
    elif how == "del":
        del it, loader
        gc.collect()
    else:
        for i, _ in enumerate(iter(loader)):  # a new epoch replaces the old iterator
            if i == 2:
                break
        del it, loader
        gc.collect()
    assert not wait_gone(spawned)
    assert not leaked_shm(shm_before, spawned | {os.getpid()})


def test_persistent_workers_survive_epochs_and_close():
    before = children()
    loader = Loader(SlowDS(n=40, delay=0.0), batch_size=8, num_workers=2, persistent_workers=True)
    run1 = [b.clone() for b in loader]
    pids = children() - before
    run2 = [b.clone() for b in loader]
    assert children() - before == pids and len(pids) == 2  # same processes
    assert all(torch.equal(a, b) for a, b in zip(run1, run2))
    loader.close()
    assert not wait_gone(pids)


def test_ctrl_c_in_a_training_script_cleans_up(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        import numpy as np
        sys.path.insert(0, {os.getcwd()!r})
        from fastload.loader import Loader

        class DS:
            def __len__(self): return 10_000
            def __getitem__(self, i):
                time.sleep(0.001)
                return np.zeros(1000, np.float32)

        loader = Loader(DS(), batch_size=16, num_workers=2, worker_type="process")
        it = iter(loader)
        for k, b in enumerate(it):
            if k == 3:
                print(" ".join(map(str, it.source.pids)), flush=True)
                os.kill(os.getpid(), signal.SIGINT)
    """))
    shm_before = shm_entries()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    pids = {int(p) for p in out.split()}
    assert len(pids) == 2
    assert not wait_gone(pids)
    assert not leaked_shm(shm_before, pids | {proc.pid})


class ColDS:
    def __init__(self, n: int = 200) -> None:
        self.x = np.arange(n * 6, dtype=np.float32).reshape(n, 6)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i]}

    def get_batch(self, idx) -> dict:
        return {"x": self.x[np.asarray(idx)]}


@pytest.mark.parametrize("workers", WORKERS)
def test_buffer_ring_reuses_slots_but_never_overwrites_kept_batches(workers):
    nw, wt = workers
    ds = ColDS()
    kw = dict(batch_size=16, shuffle=True, seed=1, num_workers=nw, worker_type=wt, buffer_ring=True, ring_slots=4)
    ref = [b["x"].clone() for b in Loader(ds, **{**kw, "buffer_ring": False})]
    loader = Loader(ds, **kw)
    it = iter(loader)
    streamed = [b["x"].sum().item() for b in it]  # nothing kept: slots are recycled
    assert streamed == [r.sum().item() for r in ref]
    assert it.ring.allocations <= 4
    kept = list(Loader(ds, **kw))  # everything kept: full slots are retired, never rewritten
    assert all(torch.equal(k["x"], r) for k, r in zip(kept, ref))


def test_process_slots_are_reused_when_streaming():
    loader = Loader(SlowDS(n=400, delay=0.0), batch_size=8, num_workers=2, worker_type="process")
    it = iter(loader)
    total = sum(float(b.sum()) for b in it)
    assert total == float(np.arange(400).sum() * 64)
    src = it.source
    assert src is None or max(src.slots_per_worker) <= 6


def test_device_cpu_stage_is_a_noop():
    ds = ColDS()
    ref = [b["x"] for b in Loader(ds, batch_size=32)]
    loader = Loader(ds, batch_size=32, device="cpu", prefetch=3)
    out = [b["x"] for b in loader]
    assert all(torch.equal(a, b) and b.device.type == "cpu" for a, b in zip(ref, out))


@pytest.mark.parametrize("kwargs", [
    {"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "pin_memory": True},
    {"num_workers": 2, "worker_type": "process"}, {"num_workers": 0, "device": "cpu", "prefetch": 2},
    {"num_workers": 2, "device": "cpu", "prefetch": 2}, {"num_workers": 2, "device": "cpu", "worker_type": "process"},
], ids=["inline", "threads", "threads-pinned", "processes", "device", "device-threads", "device-processes"])
def test_every_batch_before_a_sampler_error_arrives(kwargs):
    """The workers are handed their next fetches after the batch to return was taken (with a device
    stage, after its copies are issued); a batch sampler that fails there costs no batch: every batch
    it yielded arrives, in order, and its error is raised once, by a later `next()`."""

    class Failing:
        def __iter__(self):
            for k in range(6):
                yield list(range(8 * k, 8 * k + 8))
            raise RuntimeError("sampler broke")

        def __len__(self):
            return 10

    ds = ColDS()
    loader = Loader(ds, batch_sampler=Failing(), **kwargs)
    it, got, errors = iter(loader), [], []
    while True:
        try:
            got.append(next(it)["x"])
        except RuntimeError as exc:
            errors.append(str(exc))
        except StopIteration:
            break
    assert errors == ["sampler broke"]
    assert len(got) == 6
    for k, x in enumerate(got):
        assert torch.equal(x, torch.from_numpy(ds.x[8 * k : 8 * k + 8]))


def test_stats_report_stages_throughput_and_stall():
    class Collate:
        def __call__(self, batch):
            return torch.utils.data.default_collate(batch)

        def component_stats(self):
            return {"padding_waste": 0.25, "batches": -1}

    loader = Loader(SlowDS(n=64, delay=0.002), batch_size=8, collate_fn=Collate())
    for _ in loader:
        time.sleep(0.001)
    s = loader.stats()
    for k in ("read_s", "transform_s", "collate_s", "pin_s", "h2d_s", "wait_s", "wall_s", "batches_per_s",
              "samples_per_s", "data_stall"):
        assert k in s
    assert s["batches"] == 8 and s["samples"] == 64  # a collate's counters sit under its role
    assert s["components"] == {"collate_fn": {"padding_waste": 0.25, "batches": -1}}
    assert s["read_s"] >= 64 * 0.002
    assert 0.5 < s["data_stall"] <= 1.0  # the dataset is slower than the "training step"
    assert s["samples_per_s"] == pytest.approx(s["samples"] / s["wall_s"])
    loader.reset_stats()
    assert loader.stats()["batches"] == 0


def test_rss_is_flat_over_epochs():
    ds = ColDS(4000)
    loader = Loader(ds, batch_size=64, shuffle=True, seed=0, num_workers=2, worker_type="thread")
    proc = psutil.Process()
    rss = []
    for _ in range(20):
        for _b in loader:
            pass
        rss.append(proc.memory_info().rss)
    assert rss[-1] - rss[2] < 16 * 2**20


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("workers", WORKERS)
def test_cuda_device_batches_match(workers):
    nw, wt = workers
    ds = ColDS()
    ref = [b["x"] for b in Loader(ds, batch_size=16, shuffle=True, seed=2)]
    loader = Loader(ds, batch_size=16, shuffle=True, seed=2, device="cuda", num_workers=nw, worker_type=wt)
    out = []
    for b in loader:
        assert b["x"].device.type == "cuda" and b["x"].is_cuda
        out.append((b["x"] * 1).cpu())
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    assert loader.stats()["h2d_s"] > 0


@cuda
def test_cuda_pin_memory_uses_pinned_ring():
    loader = Loader(ColDS(), batch_size=16, pin_memory=True)
    it = iter(loader)
    b = next(it)
    assert b["x"].is_pinned()
    for _ in it:
        pass
    # bounded: at most `capacity` buffers, plus one for each the user kept (retired, never rewritten)
    assert it.ring is not None and it.ring.allocations <= it.ring.capacity + it.ring.retired
    assert it.ring.live == 0  # the epoch is over: the ring let go of its pinned memory


def test_persistent_pool_with_dead_worker_is_replaced():
    loader = Loader(SlowDS(n=200, delay=0.005), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    os.kill(it.source.pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _ in it:
            pass
    assert sum(1 for _ in loader) == 50  # the next epoch runs on fresh workers
    loader.close()
