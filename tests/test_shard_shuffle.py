"""ShardWindowSampler: exactly-once over ranks, shard locality, exact resume, measured randomness."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastload.order.shard_shuffle import (
    ShardWindowSampler,
    randomness_report,
    shards_in_order,
)

SIZES = [37, 50, 50, 12, 50, 49, 50, 50, 3, 50, 50, 44]  # uneven shards, 495 samples


def shard_of(idx, sampler):
    return np.searchsorted(sampler.starts, np.asarray(idx), side="right") - 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_cover_every_sample_once_with_padding(world):
    samplers = [ShardWindowSampler(SIZES, window=3, seed=5, rank=r, world_size=world) for r in range(world)]
    parts = [list(s) for s in samplers]
    n = sum(SIZES)
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(samplers[0]) == -(-n // world)
    flat = np.concatenate(parts)
    counts = np.bincount(flat, minlength=n)
    assert (counts >= 1).all() and counts.sum() - n == len(flat) - n < world  # padding only
    dropped = [list(ShardWindowSampler(SIZES, window=3, rank=r, world_size=world, drop_last=True))
               for r in range(world)]
    flat = np.concatenate(dropped)
    assert len(flat) == n // world * world and len(set(flat.tolist())) == len(flat)


def test_window_locality_and_shard_order():
    s = ShardWindowSampler(SIZES, window=3, seed=1)
    order = np.array(list(s))
    assert sorted(order.tolist()) == list(range(sum(SIZES)))
    shards = shard_of(order, s)
    for b in range(0, len(order), 32):  # any batch touches at most 2 windows of shards
        assert len(set(shards[b : b + 32].tolist())) <= 6
    # each window's samples are contiguous in the order: shards change windows len(SIZES)/3 times
    first_use = s.shard_order()
    assert sorted(first_use) == list(range(len(SIZES)))
    assert first_use == shards_in_order(order, s.starts)
    windows = [set(first_use[w : w + 3]) for w in range(0, len(SIZES), 3)]
    pos = 0
    for w in windows:
        size = sum(SIZES[k] for k in w)
        assert set(shards[pos : pos + size].tolist()) == w
        pos += size


def test_epochs_and_seeds_change_the_order_deterministically():
    a = ShardWindowSampler(SIZES, window=2, seed=3)
    e0 = list(a)
    assert list(ShardWindowSampler(SIZES, window=2, seed=3)) == e0
    a.set_epoch(1)
    assert list(a) != e0
    assert list(ShardWindowSampler(SIZES, window=2, seed=4)) != e0
    assert list(ShardWindowSampler(SIZES, shuffle=False)) == list(range(sum(SIZES)))


@pytest.mark.parametrize("stop", [0, 1, 100, 247])
def test_resume_is_exact(stop):
    s = ShardWindowSampler(SIZES, window=3, seed=9, rank=1, world_size=2)
    s.set_epoch(4)
    full = list(ShardWindowSampler(SIZES, window=3, seed=9, rank=1, world_size=2).indices(4))
    it = iter(s)
    head = [next(it) for _ in range(stop)]
    state = s.state_dict()
    assert state["epoch"] == 4 and state["consumed"] == stop
    fresh = ShardWindowSampler(SIZES, window=3, seed=9, rank=1, world_size=2)
    fresh.load_state_dict(state)
    fresh.set_epoch(4)  # a loader calling set_epoch with the same epoch keeps the resume point
    assert head + list(fresh) == full
    assert list(fresh) == full  # the next pass is a whole epoch again
    with pytest.raises(ValueError, match="window"):
        ShardWindowSampler(SIZES, window=2, seed=9, rank=1, world_size=2).load_state_dict(state)


def test_randomness_against_full_permutation():
    # worst case for a windowed shuffle: the dataset is sorted by label, one label per 2 shards
    sizes = [100] * 100
    labels = np.repeat(np.arange(50), 200)
    rng = np.random.default_rng(0)
    full = randomness_report(rng.permutation(10_000), labels, batch_size=64)
    seq = randomness_report(np.arange(10_000), labels, batch_size=64)
    reports = {w: randomness_report(list(ShardWindowSampler(sizes, window=w, seed=0)), labels, batch_size=64)
               for w in (1, 4, 16, 100)}
    for w, r in reports.items():
        assert abs(r["position_index_corr"]) < 0.2, (w, r)
    assert seq["position_index_corr"] > 0.99 and abs(full["position_index_corr"]) < 0.05
    lpb = [reports[w]["labels_per_batch"] for w in (1, 4, 16, 100)]
    assert lpb == sorted(lpb), "more shards per window must mix more labels"
    assert 2.5 < reports[4]["labels_per_batch"] < full["labels_per_batch"]
    assert abs(reports[100]["labels_per_batch"] - full["labels_per_batch"]) < 1.0  # window = all shards
    assert reports[16]["batch_label_tv"] < reports[1]["batch_label_tv"]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("world", "start"), [(1, 0), (3, 0), (3, 77), (7, 5), (4, 120)])
def test_shard_order_is_the_first_use_order_of_the_rest(world, start, shuffle):
    sizes = [*SIZES, 0, 5, 0]  # empty shards are never read
    for rank in range(world):
        s = ShardWindowSampler(sizes, window=3, seed=2, rank=rank, world_size=world, shuffle=shuffle)
        s.set_epoch(3)
        rest = s.indices()[start:]
        assert s.shard_order(start=start) == shards_in_order(rest, s.starts)
        assert np.array_equal(s.global_order(), np.concatenate([s.global_order()]))  # pure
    assert sorted(ShardWindowSampler(sizes, window=3, seed=2).global_order().tolist()) == list(range(sum(sizes)))


def test_a_billion_samples_need_no_per_sample_arrays():
    """10^9 samples in 10^5 shards, rank 7 of 1,024: its first indices, its shard order and a
    resume point cost per-shard arrays and a chunk, not one entry per sample."""
    import tracemalloc

    sizes = np.full(100_000, 10_000)
    tracemalloc.start()
    s = ShardWindowSampler(sizes, window=8, seed=1, rank=7, world_size=1024)
    it = iter(s)
    head = [next(it) for _ in range(1000)]
    shards = s.shard_order()
    s.load_state_dict({**s.state_dict(), "consumed": 500_000})
    tail = list(itertools.islice(iter(s), 10))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert len(set(head)) == 1000 and shards[0] == head[0] // 10_000
    per_rank = len(s)
    assert per_rank == 976_563 and shards == shards_in_order(s.indices(0), s.starts)  # 13-14 windows of 8
    assert tail == s.indices(0)[500_000:500_010].tolist()


def test_a_state_of_another_order_version_is_refused():
    s = ShardWindowSampler(SIZES, window=3, seed=9)
    state = s.state_dict()
    assert state["order"] == 2
    with pytest.raises(ValueError, match="order is version 1"):
        ShardWindowSampler(SIZES, window=3, seed=9).load_state_dict({**state, "order": 1})
    del state["order"]
    with pytest.raises(ValueError, match="order is version 1"):
        ShardWindowSampler(SIZES, window=3, seed=9).load_state_dict(state)


def _torch_cut(sampler, batch_size, drop_last):
    """torch's `BatchSampler` over the sampler's indices one by one, with the state after each batch."""
    import torch

    out = []
    for batch in torch.utils.data.BatchSampler(sampler, batch_size, drop_last):
        out.append((list(batch), sampler.get_state()))
    return out, sampler.get_state()


@pytest.mark.parametrize("batch_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world,shuffle,resume", [(1, True, 0), (3, True, 40), (2, False, 13), (4, True, 123)])
def test_batches_are_torchs_batches_with_the_same_state_after_each(batch_size, drop_last, world, shuffle, resume,
                                                                  monkeypatch):
    """`batches` cuts what torch's `BatchSampler` cuts from the indices one by one, resumed or not, and the
    state after each batch is the same; it is what the Loader iterates for a `BatchSampler` over it."""
    import torch

    import fastload.order.shard_shuffle as shard_shuffle
    from fastload.order.sampling import torch_batches

    monkeypatch.setattr(shard_shuffle, "_CHUNK", 50)  # batches straddle the sampler's chunks

    def make():
        s = ShardWindowSampler(SIZES, window=3, seed=7, shuffle=shuffle, rank=world - 1, world_size=world)
        s.set_epoch(2)
        if resume:
            probe = ShardWindowSampler(SIZES, window=3, seed=7, shuffle=shuffle, rank=world - 1, world_size=world)
            probe.set_epoch(2)
            it = iter(probe)
            for _ in range(resume):
                next(it)
            s.set_state(probe.get_state())
        return s

    want, end = _torch_cut(make(), batch_size, drop_last)
    s = make()
    got = []
    for batch in s.batches(batch_size, drop_last):
        assert batch.dtype == np.int64
        got.append((batch.tolist(), s.get_state()))
    assert got == want and s.get_state() == end
    fast = torch_batches(torch.utils.data.BatchSampler(make(), batch_size, drop_last))
    assert fast is not None and [b.tolist() for b, _ in fast(None)] == [b for b, _ in want]
