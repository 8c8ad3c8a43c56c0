"""The epoch plan of the direct path (`fastload.fetch.plan`): the small reads of a whole epoch done at
once change how batches are read, never what they hold, what order they come in, or where a
resume picks up."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload import Loader
from fastload.fetch import plan as plan_mod
from fastload.fetch.fetcher import Fetcher
from fastload.fetch.plan import EpochPlan
from fastload.formats import FastloadDataset, Field, Schema, write
from fastload.formats.spliced import splice_available

pytestmark = pytest.mark.skipif(not splice_available(), reason="the direct path needs spliced columns (Linux)")

N = 700


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> FastloadDataset:
    """Several shards; a large field (spliced, read by row number) and two small ones (in memory)."""
    path = tmp_path_factory.mktemp("plan") / "ds"
    rng = np.random.default_rng(11)
    schema = Schema(
        (
            Field("x", "ndarray", np.uint8, (300,)),
            Field("y", "scalar", np.int64),
            Field("w", "ndarray", np.float32, (3,)),
        )
    )
    samples = [
        {"x": rng.integers(0, 256, 300, dtype=np.uint8), "y": i, "w": rng.random(3, dtype=np.float32)} for i in range(N)
    ]
    write(samples, str(path), schema=schema, shard_size=32 << 10, progress=False)
    ds = FastloadDataset(path)
    assert ds.num_shards > 2
    rows = {name: rows for name, _, rows in ds.direct_plan(np.arange(2))}
    assert rows["x"] is not None and rows["y"] is None and rows["w"] is None  # x spliced, y and w in memory
    return ds


def _batches(loader: Loader, epochs: int = 2, start: int = 0) -> list[dict[str, np.ndarray]]:
    out = []
    for e in range(start, start + epochs):
        loader.set_epoch(e)
        out += [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
    return out


def _same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        list(p) == list(q) and all(p[k].dtype == q[k].dtype and np.array_equal(p[k], q[k]) for k in p)
        for p, q in zip(a, b)
    )


@pytest.fixture
def count_planned(monkeypatch) -> list[int]:
    """[batches read from a plan, batches that came with a plan slice and were not read from it]."""
    counts = [0, 0]
    read = EpochPlan.read

    def counting_read(self, a, b, *, alone):
        counts[0] += 1
        return read(self, a, b, alone=alone)

    monkeypatch.setattr(EpochPlan, "read", counting_read)
    def counting(fetch):
        def counting_fetch(self, indices, planned=None):
            before = counts[0]
            out = fetch(self, indices, planned)
            counts[1] += planned is not None and counts[0] == before
            return out

        return counting_fetch

    for name in ("__call__", "fetch_alone"):
        monkeypatch.setattr(Fetcher, name, counting(getattr(Fetcher, name)))
    return counts


CONFIGS = [
    dict(shuffle=True),
    dict(shuffle=False),
    dict(shuffle=True, drop_last=True),
    dict(shuffle=True, rank=1, world_size=3),
    dict(shuffle=True, rank=2, world_size=3, drop_last=True),
]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_planned_batches_equal_unplanned_ones(dataset, count_planned, workers, config):
    """Every batch of every epoch comes from the plan, and equals what the per-batch takes give."""
    kw = dict(batch_size=64, seed=5, num_workers=workers, worker_type="thread", **config)
    planned = _batches(Loader(dataset, **kw))
    assert count_planned == [len(planned), 0]
    loader = Loader(dataset, epoch_plan=False, **kw)
    unplanned = _batches(loader)
    assert count_planned == [len(planned), 0]  # nothing more planned
    assert loader.describe()["direct_path"]  # the direct path without a plan: the plan is all that differed
    assert _same(planned, unplanned)
    if not config.get("drop_last"):  # every sample of the rank's share, once per epoch
        per_epoch = sum(len(b["y"]) for b in planned) // 2
        assert per_epoch == -(-N // config.get("world_size", 1))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_reads_the_rest_from_a_plan(dataset, count_planned, workers):
    kw = dict(batch_size=50, shuffle=True, seed=9, num_workers=workers, worker_type="thread")
    ref = _batches(Loader(dataset, **kw), epochs=1)
    loader = Loader(dataset, **kw)
    for k, _ in enumerate(loader):
        if k == 4:
            state = loader.state_dict()
            break
    resumed = Loader(dataset, **kw)
    resumed.load_state_dict(state)
    before = count_planned[0]
    rest = [{k: v.numpy().copy() for k, v in b.items()} for b in resumed]
    assert _same(rest, ref[5:])
    # (>=: the abandoned loader's workers may still finish batches they had started)
    assert count_planned[0] - before >= len(rest) and count_planned[1] == 0


def test_a_batch_changed_in_place_changes_no_other_batch(dataset):
    """A batch's small fields are views of the epoch's plan: writing into one touches nothing else."""
    kw = dict(batch_size=64, shuffle=True, seed=1)
    ref = _batches(Loader(dataset, **kw))
    loader = Loader(dataset, **kw)
    got = []
    for e in range(2):
        loader.set_epoch(e)
        for b in loader:
            got.append({k: v.numpy().copy() for k, v in b.items()})
            for v in b.values():
                v.fill_(0)
    assert _same(got, ref)


def test_no_plan_above_the_byte_bound(dataset, monkeypatch, count_planned):
    monkeypatch.setattr(plan_mod, "PLAN_MAX_BYTES", 8)
    monkeypatch.setattr("fastload.fetch.fetcher.PLAN_MAX_BYTES", 8)
    kw = dict(batch_size=64, shuffle=True, seed=3)
    loader = Loader(dataset, **kw)
    got = _batches(loader, epochs=1)
    assert count_planned == [0, 0]
    monkeypatch.undo()
    assert _same(got, _batches(Loader(dataset, **kw), epochs=1))


def test_direct_plan_checks_indices_and_bound(dataset):
    idx = np.array([3, 0, -1, 699])
    fields = dataset.direct_plan(idx)
    by_name = {name: (data, rows) for name, data, rows in fields}
    data, rows = by_name["x"]
    assert np.array_equal(rows.take(data, axis=0), dataset.get_batch(idx)["x"])
    assert by_name["y"][1] is None and by_name["y"][0].tolist() == [3, 0, 699, 699]
    with pytest.raises(IndexError, match=f"sample index 700 out of range.*{dataset.root}"):
        dataset.direct_plan(np.array([1, 700]))
    assert dataset.direct_plan(idx, max_bytes=4 * (8 + 8 + 12) - 1) is None
    assert dataset.direct_plan(idx, max_bytes=4 * (8 + 8 + 12)) is not None


def test_out_of_range_index_is_not_planned_and_raises_in_its_batch(dataset):
    fetch = Fetcher(dataset, mode="columns", collate_fn=None, scalar_fields=frozenset({"y"}))
    fetch.refresh()
    order = np.array([5, 1, N + 3, 2], dtype=np.int64)
    assert fetch.plan(order, 2) is None
    got, _ = fetch(order[:2])
    assert got["y"].tolist() == [5, 1]
    with pytest.raises(IndexError) as info:
        fetch(order[2:])
    assert any(f"sample index {N + 3}" in note for note in info.value.__notes__)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), batch_size=st.integers(1, 70), lead=st.integers(0, 5))
def test_each_planned_batch_reads_its_own_slice(n, batch_size, lead):
    """A plan cuts its array into consecutive batches, and each batch's slice reads exactly that
    batch's planned values."""
    owner = np.arange(lead + n + 3, dtype=np.int64) * 10
    planned = owner[lead : lead + n]
    plan = EpochPlan(planned, batch_size, [("v", planned * 3, None, None)])
    assert np.array_equal(np.concatenate(plan.batches), planned)
    assert [len(b) for b in plan.batches[:-1]] == [batch_size] * (len(plan.batches) - 1)
    assert 0 < len(plan.batches[-1]) <= batch_size
    assert len(plan.slices()) == len(plan.batches)
    for k, (b, piece) in enumerate(zip(plan.batches, plan.slices())):
        assert (piece.plan, piece.start, piece.stop) == (plan, k * batch_size, k * batch_size + len(b))
        for alone in (False, True):
            assert piece.read(alone=alone)["v"].tolist() == (b * 3).tolist()


def test_plan_rejects_what_it_cannot_plan():
    with pytest.raises(TypeError):
        EpochPlan(np.arange(4, dtype=np.int32), 2, [])
    with pytest.raises(ValueError):
        EpochPlan(np.arange(8, dtype=np.int64), 0, [])


@pytest.fixture
def plan_calls(monkeypatch, dataset) -> list[str]:
    """The thread of every `direct_plan` call on the module-wide `dataset`, from the test's start: a
    next epoch's order an earlier test's Loader still computes on its own "fastload-order" thread is
    awaited first (it reads the same dataset's plan, and would be counted as this test's)."""
    import threading

    deadline = time.monotonic() + 30
    while any(t.name == "fastload-order" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "an earlier test's order thread did not end"
        time.sleep(0.001)
    calls: list[str] = []
    direct_plan = FastloadDataset.direct_plan

    def spy(self, indices, **kw):
        out = direct_plan(self, indices, **kw)
        if self is dataset:
            calls.append(threading.current_thread().name)  # once read
        return out

    monkeypatch.setattr(FastloadDataset, "direct_plan", spy)
    return calls


def test_the_next_epochs_plan_is_prepared_ahead(dataset, plan_calls, count_planned):
    """With the order computed ahead, the next epoch's plan is read on that background thread and
    used when the epoch starts (no read there); a `set_epoch` elsewhere reads its own."""
    kw = dict(batch_size=64, shuffle=True, seed=4)
    ref = _batches(Loader(dataset, order_ahead=False, **kw), epochs=4)  # its own order threads would be counted
    loader = Loader(dataset, order_ahead=True, **kw)
    plan_calls.clear()
    got = _batches(loader, epochs=3)
    assert plan_calls.count("MainThread") == 1  # epoch 0; epochs 1 and 2 were prepared ahead
    assert plan_calls.count("fastload-order") >= 2
    loader.set_epoch(0)  # not the epoch prepared ahead (3): planned again, at its start
    del plan_calls[:]
    again = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
    assert "MainThread" in plan_calls  # (epoch 3's preparation may still be running beside it)
    assert _same(got, ref[: len(got)]) and _same(again, ref[: len(again)])
    assert count_planned[1] == 0


def test_a_plan_prepared_before_the_dataset_was_reopened_is_not_used(dataset, plan_calls):
    kw = dict(batch_size=64, shuffle=True, seed=6)
    # the reference computes nothing ahead: the only order thread is `loader`'s (one of the reference's
    # would let the wait below end before `loader` prepared epoch 1, which then happens after the
    # close, against the new mappings, and is rightly used)
    ref = _batches(Loader(dataset, order_ahead=False, **kw), epochs=2)
    loader = Loader(dataset, order_ahead=True, **kw)
    first = _batches(loader, epochs=1)  # epoch 1's order and plan are computed ahead meanwhile
    deadline = time.monotonic() + 30
    while "fastload-order" not in plan_calls:  # prepared against the mappings of before the close
        assert time.monotonic() < deadline
        time.sleep(0.001)
    dataset.close()  # its columns are mapped anew when the next epoch starts
    del plan_calls[:]
    second = _batches(loader, epochs=1, start=1)
    assert "MainThread" in plan_calls  # read again against the new mappings
    assert _same(first + second, ref)


def test_the_plan_is_released_when_its_epoch_ends(dataset, monkeypatch):
    import weakref

    plans: list[weakref.ref] = []
    make = Fetcher.plan

    def keep(self, indices, batch_size):
        out = make(self, indices, batch_size)
        plans.append(weakref.ref(out))
        return out

    monkeypatch.setattr(Fetcher, "plan", keep)
    loader = Loader(dataset, batch_size=64, shuffle=True, seed=2)
    it = iter(loader)
    next(it)
    assert len(plans) == 1 and plans[0]() is not None
    for _ in it:
        pass
    assert plans[0]() is None  # its epoch is over: nothing reads it any more
    it = iter(loader)
    next(it)
    assert len(plans) == 2 and plans[1]() is not None
    loader.close()
    assert plans[1]() is None


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "config",
    [dict(shuffle=True), dict(shuffle=False), dict(shuffle=True, drop_last=True)],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_torch_order_is_planned_and_matches_the_dataloader(dataset, count_planned, workers, config):
    """The drop-in mode (torch's own samplers, no seed) reads from plans too, and still yields
    exactly the DataLoader's batches for the same generator, with torch's RNG draws."""
    from torch.utils.data import DataLoader

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(17)

    kw = dict(batch_size=64, **config)
    g = gen()
    want = [b["y"].tolist() for _ in range(2) for b in DataLoader(dataset, generator=g, **kw)]
    after_torch = torch.randint(0, 2**30, (1,), generator=g).item()
    g = gen()
    loader = Loader(dataset, generator=g, num_workers=workers, worker_type="thread", **kw)
    got = [{k: v.numpy().copy() for k, v in b.items()} for _ in range(2) for b in loader]
    assert [b["y"].tolist() for b in got] == want
    assert torch.randint(0, 2**30, (1,), generator=g).item() == after_torch  # the same draws
    assert count_planned == [len(got), 0]
    g = gen()
    unplanned = Loader(dataset, generator=g, epoch_plan=False, num_workers=workers, worker_type="thread", **kw)
    assert _same(got, [{k: v.numpy().copy() for k, v in b.items()} for _ in range(2) for b in unplanned])


def test_torch_order_resume_replays_into_a_plan(dataset, count_planned):
    kw = dict(batch_size=50, shuffle=True)
    ref = [b["y"].tolist() for b in Loader(dataset, generator=torch.Generator().manual_seed(3), **kw)]
    loader = Loader(dataset, generator=torch.Generator().manual_seed(3), **kw)
    for k, _ in enumerate(loader):
        if k == 6:
            state = loader.state_dict()
            break
    resumed = Loader(dataset, generator=torch.Generator().manual_seed(99), **kw)
    resumed.load_state_dict(state)
    before = count_planned[0]
    rest = [b["y"].tolist() for b in resumed]
    assert rest == ref[7:] and count_planned[0] - before == len(rest) and count_planned[1] == 0


def test_no_plan_when_its_batches_objects_alone_exceed_the_bound(dataset, monkeypatch):
    """batch_size=1: a planned batch per sample; their Python objects count against the bound."""
    monkeypatch.setattr("fastload.fetch.fetcher.PLAN_MAX_BYTES", 100 * plan_mod.BATCH_BYTES)
    fetch = Fetcher(dataset, mode="columns", collate_fn=None, scalar_fields=frozenset({"y"}))
    fetch.refresh()
    order = np.arange(101, dtype=np.int64)
    assert fetch.plan(order, 1) is None
    assert fetch.plan(order[:50], 1) is not None  # 50 batches' objects and 50 samples' fields fit
    assert fetch.plan(order, 2) is not None
