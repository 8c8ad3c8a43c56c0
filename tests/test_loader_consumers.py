"""What frameworks and torch's own DataLoader tests expect of `fastload.Loader` (issue 26):
epoch semantics for consumers that stop after `len(loader)` batches, rank resolved at the first
`iter()`, pickling, states that cannot apply, torch's per-batch error semantics, iterator
lifetime and clean interpreter exit."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from test_loader_resume import IdxDS  # sample i is i, batched protocol
from torch.utils.data import DistributedSampler

from fastload.loader import Loader

pytestmark = pytest.mark.timeout(120)
WORKERS = [(0, "auto"), (2, "thread"), (2, "process")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ids(batch) -> list[int]:
    return (batch["i"] if isinstance(batch, dict) else batch).tolist()


def take(loader, k: int) -> list[list[int]]:
    """k batches of a new iterator, then leave it (as Lightning does after len(loader) batches)."""
    return [ids(b) for b in itertools.islice(iter(loader), k)]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def wait_gone(pids: set[int], seconds: float = 5.0) -> set[int]:
    deadline = time.monotonic() + seconds
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.05)
    return alive


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = f"import sys\nsys.path.insert(0, {REPO!r})\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


# ---- item 1: epochs


@pytest.mark.parametrize("workers", WORKERS)
def test_taking_len_batches_then_iter_starts_the_next_epoch(workers):
    nw, wt = workers
    make = lambda: Loader(IdxDS(50), batch_size=8, shuffle=True, seed=3, num_workers=nw, worker_type=wt)  # noqa: E731
    full = make()
    expected = [[ids(b) for b in full] for _ in range(3)]  # each epoch to StopIteration
    assert expected[0] != expected[1] != expected[2]
    lightning_like = make()
    got = []
    for _ in range(3):
        got.append(take(lightning_like, len(lightning_like)))
    assert got == expected
    assert lightning_like.epoch == 3
    for epoch in got:
        assert sorted(i for b in epoch for i in b) == list(range(50))


def test_new_iter_mid_epoch_restarts_that_epoch_and_set_epoch_overrides():
    loader = Loader(IdxDS(50), batch_size=8, shuffle=True, seed=3)
    first = take(loader, 2)
    assert take(loader, 7) == [ids(b) for b in Loader(IdxDS(50), batch_size=8, shuffle=True, seed=3)]
    assert take(loader, 2) != first  # the previous take delivered the whole epoch 0: this is epoch 1
    loader.set_epoch(0)
    assert take(loader, 2) == first


def test_sampler_order_epochs_advance_too():
    loader = Loader(IdxDS(50), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    take(loader, len(loader))
    assert loader.epoch == 1 and loader.state_dict()["position"] is None


def test_state_after_the_last_batch_is_the_next_epoch():
    loader = Loader(IdxDS(50), batch_size=8, shuffle=True, seed=5)
    take(loader, len(loader))
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] is None
    resumed = Loader(IdxDS(50), batch_size=8, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    assert [ids(b) for b in resumed] == [ids(b) for b in loader]


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_len_after_resume_is_what_the_next_iter_yields(new_world):
    old = [Loader(IdxDS(50), batch_size=4, shuffle=True, seed=1, rank=r, world_size=2) for r in range(2)]
    states = []
    for loader in old:
        it = iter(loader)
        for _ in range(3):
            next(it)
        states.append(loader.state_dict())
    seen = set()
    for r in range(new_world):
        loader = Loader(IdxDS(50), batch_size=4, shuffle=True, seed=1, rank=r, world_size=new_world)
        loader.load_state_dict(states[0])
        n = len(loader)
        batches = [ids(b) for b in loader]
        assert len(batches) == n
        seen |= {i for b in batches for i in b}
        assert len(loader) == len(Loader(IdxDS(50), batch_size=4, rank=r, world_size=new_world))  # then full epochs
    done = {i for loader in old for b in take_first(loader, 3) for i in b}
    assert seen | done == set(range(50)) and not (seen & done)


def take_first(loader: Loader, k: int) -> list[list[int]]:
    fresh = Loader(IdxDS(50), batch_size=4, shuffle=True, seed=1, rank=loader.rank, world_size=loader.world_size)
    return take(fresh, k)


# ---- item 3: rank and world size


def test_rank_is_resolved_at_the_first_iter(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = Loader(IdxDS(50), batch_size=5, shuffle=False)  # built before the launcher set RANK: no guess
    with pytest.raises(ValueError, match="RANK is not set"):
        iter(loader)
    monkeypatch.setenv("RANK", "1")
    assert len(loader) == 5
    assert take(loader, 1) == [[1, 3, 5, 7, 9]]
    monkeypatch.setenv("RANK", "0")
    assert loader.rank == 1  # fixed at the first iter()


# ---- item 4: pickling


@pytest.mark.parametrize("workers", WORKERS)
def test_pickled_loader_continues_with_the_same_batches(workers):
    nw, wt = workers
    loader = Loader(IdxDS(50), batch_size=8, shuffle=True, seed=2, num_workers=nw, worker_type=wt)
    it = iter(loader)
    head = [ids(next(it)) for _ in range(2)]
    copy = pickle.loads(pickle.dumps(loader))  # workers, threads and buffers are not pickled
    rest = [ids(b) for b in it]
    assert [ids(b) for b in copy] == rest
    assert [ids(b) for b in copy] == [ids(b) for b in loader]  # the next epochs agree too
    assert head + rest == [ids(b) for b in Loader(IdxDS(50), batch_size=8, shuffle=True, seed=2)]


def test_pickled_fresh_loader_with_torch_sampler():
    gen = torch.Generator().manual_seed(7)
    loader = Loader(IdxDS(50), batch_size=8, shuffle=True, generator=gen)
    copy = pickle.loads(pickle.dumps(loader))
    assert [ids(b) for b in copy] == [ids(b) for b in loader]


# ---- item 5: states that cannot apply


def test_sampler_state_from_another_world_size_raises():
    saved = Loader(IdxDS(50), batch_size=4, sampler=DistributedSampler(IdxDS(50), num_replicas=2, rank=0))
    take(saved, 3)
    state = saved.state_dict()
    assert state["world_size"] == 2
    other = Loader(IdxDS(50), batch_size=4, sampler=DistributedSampler(IdxDS(50), num_replicas=1, rank=0))
    with pytest.raises(ValueError, match="world_size=2"):
        other.load_state_dict(state)
    same = Loader(IdxDS(50), batch_size=4, sampler=DistributedSampler(IdxDS(50), num_replicas=2, rank=0))
    same.load_state_dict(state)
    assert len(same) == len(saved) - 3 == len([ids(b) for b in same])


def test_states_for_another_dataset_or_order_kind_raise():
    seeded = Loader(IdxDS(50), batch_size=4, shuffle=True, seed=1)
    take(seeded, 2)
    with pytest.raises(ValueError, match="dataset of 50 samples"):
        Loader(IdxDS(60), batch_size=4, shuffle=True, seed=1).load_state_dict(seeded.state_dict())
    with pytest.raises(ValueError, match="seeded order"):
        Loader(IdxDS(50), batch_size=4, shuffle=True).load_state_dict(seeded.state_dict())


# ---- item 7: torch's public behaviour


class EveryOtherFails(IdxDS):
    get_batch = None  # type: ignore[assignment]

    def __getitem__(self, i: int) -> int:
        if (i // 5) % 2:
            raise NotImplementedError(f"sample {i}")
        return int(i)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_batch_error_leaves_the_iterator_usable(workers):
    nw, wt = workers
    loader = Loader(EveryOtherFails(50), batch_size=5, num_workers=nw, worker_type=wt)
    it = iter(loader)
    good, errors = [], 0
    while True:
        try:
            good.append(ids(next(it)))
        except NotImplementedError:
            errors += 1
        except StopIteration:
            break
    assert errors == 5
    assert good == [list(range(k, k + 5)) for k in range(0, 50, 10)]
    assert loader.epoch == 1


def _failing_init(wid: int) -> None:
    raise RuntimeError(f"init of worker {wid} failed")


def test_worker_init_fn_error_is_reported_as_such():
    for _ in range(4):  # the worker exits right after reporting: that report must win every time
        loader = Loader(IdxDS(50), batch_size=5, num_workers=2, worker_type="process", worker_init_fn=_failing_init)
        with pytest.raises(RuntimeError, match=r"init of worker \d failed"):
            next(iter(loader))


def _nested_collate(batch):
    return torch.nested.nested_tensor([torch.arange(i % 3 + 1, dtype=torch.float32) for i in batch])


@pytest.mark.parametrize("workers", WORKERS)
def test_nested_tensors_from_a_custom_collate(workers):
    nw, wt = workers
    loader = Loader(IdxDS(12), batch_size=4, num_workers=nw, worker_type=wt, collate_fn=_nested_collate)
    batches = list(loader)
    assert len(batches) == 3 and all(b.is_nested for b in batches)
    for k, b in enumerate(batches):
        assert [t.tolist() for t in b.unbind()] == [list(map(float, range(i % 3 + 1))) for i in range(4 * k, 4 * k + 4)]


def test_subscriptable_and_frozen_attributes_like_torch():
    assert Loader[int] is not None
    loader = Loader(IdxDS(50), batch_size=4)
    for name, value in [("batch_size", 8), ("sampler", None), ("batch_sampler", None), ("drop_last", True)]:
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, value)
    with pytest.raises(ValueError):
        loader.dataset = IdxDS(3)
    loader.num_workers = 0  # torch allows the others
    assert take(loader, 1) == [[0, 1, 2, 3]]


def test_deleting_the_iterator_ends_its_workers():
    before = children()
    loader = Loader(IdxDS(200), batch_size=4, num_workers=2, worker_type="process")
    it = iter(loader)
    next(it)
    workers = children() - before
    assert len(workers) == 2
    del it  # no garbage collection needed
    assert not wait_gone(workers)
    assert take(loader, 1) == [[0, 1, 2, 3]]  # a mid-epoch iterator deleted: the epoch restarts


def test_exit_while_holding_an_iterator_over_large_index_batches():
    """pytorch issue 48666: a process (here a multiprocessing child, as in torch's own test, where
    no atexit hook runs) raises while its iterator's task queues are full of large index batches."""
    proc = run_script(
        """
        import multiprocessing as mp
        import numpy as np
        from fastload.loader import Loader

        class DS:
            def __len__(self): return 10
            def __getitem__(self, idx): return np.zeros(1, np.float32)
            def __getitems__(self, idx): return [np.zeros(1, np.float32)]  # cheap: the queues are the point

        class Big:
            def __len__(self): return 1000
            def __iter__(self):
                for _ in range(1000):
                    yield list(range(300_000))  # 1.5 MB pickled: a few fill a pipe

        def scenario():
            loader = Loader(DS(), batch_sampler=Big(), num_workers=2, worker_type="process", prefetch_factor=8)
            it = iter(loader)
            next(it)
            raise RuntimeError("the training step failed")

        p = mp.get_context("fork").Process(target=scenario)
        p.start()
        p.join(30)
        print("hung" if p.is_alive() else f"exit {p.exitcode}")
        if p.is_alive():
            p.kill()
        """,
        timeout=90,
    )
    assert proc.stdout.strip() == "exit 1", proc.stdout + proc.stderr
    assert "the training step failed" in proc.stderr


def test_no_noise_at_interpreter_exit():
    proc = run_script(
        """
        import numpy as np
        from fastload.loader import Loader

        class DS:
            def __len__(self): return 64
            def __getitem__(self, i): return np.zeros(4, np.float32)
            def get_batch(self, idx): return {"x": np.zeros((len(idx), 4), np.float32)}

        keep = []
        for nw, wt in [(2, "thread"), (2, "process")]:
            loader = Loader(DS(), batch_size=4, num_workers=nw, worker_type=wt, persistent_workers=True)
            it = iter(loader)
            next(it)
            keep.append((loader, it))
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok"
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_worker_stopped_while_it_first_shares_a_slot_exits_without_noise():
    """A process worker's first new slot goes to the parent through multiprocessing's fd sharer,
    which its result queue's feeder thread starts (a socket in the worker's temporary directory). A
    worker told to stop while that start is under way waits for it, so the exit's cleanup of the
    directory does not race it. Staged: worker 1's sharer starts slowly, and the cleanup lists the
    directory, waits, then removes what it listed (as `shutil.rmtree` does, slower)."""
    proc = run_script(
        """
        import os, shutil, time
        import multiprocessing.connection as mp_connection
        import numpy as np
        import torch.utils.data as tud
        from fastload.loader import Loader

        start_listener, rmtree = mp_connection.SocketListener.__init__, shutil.rmtree

        def slow_listener(self, address, *args, **kwargs):
            info = tud.get_worker_info()
            time.sleep(0.4 if info is not None and info.id == 1 else 0.1)
            start_listener(self, address, *args, **kwargs)

        def listing_rmtree(path, *args, **kwargs):
            if not os.path.basename(path).startswith("pymp-"):
                return rmtree(path, *args, **kwargs)
            names = os.listdir(path)
            time.sleep(0.4)
            for name in names:
                os.unlink(os.path.join(path, name))
            os.rmdir(path)

        mp_connection.SocketListener.__init__, shutil.rmtree = slow_listener, listing_rmtree

        class DS:
            def __len__(self): return 64
            def __getitem__(self, i): return np.zeros(4, np.float32)
            def get_batch(self, idx): return {"x": np.zeros((len(idx), 4), np.float32)}

        it = iter(Loader(DS(), batch_size=4, num_workers=2, worker_type="process", persistent_workers=True))
        next(it)
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_resuming_at_the_end_of_an_epoch_moves_to_the_next():
    loader = Loader(IdxDS(50), batch_size=8, shuffle=True, seed=4)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    state = loader.state_dict()
    state["epoch"], state["position"] = 0, it.position  # a state taken at the last batch, before moving on
    resumed = Loader(IdxDS(50), batch_size=8, shuffle=True, seed=4)
    resumed.load_state_dict(state)
    assert len(resumed) == 0 and take(resumed, 5) == []
    assert resumed.epoch == 1
    assert [ids(b) for b in resumed] == [ids(b) for b in loader]
