"""`fastload.order.index_shuffle` and the seeded order built on it: a bijection for every n, exactly
once per epoch over ranks and workers, exact and checked resume, and randomness measured
against `np.random.permutation` with the same statistics and thresholds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fastload.loader import Loader
from fastload.order.index_shuffle import IndexShuffle, index_shuffle
from fastload.order.position import ORDER_VERSION
from fastload.order.sampling import SeededOrder, epoch_permutation, rank_indices

pytestmark = pytest.mark.timeout(120)

PRIMES = [3, 5, 7, 13, 31, 61, 127, 257, 509, 1021, 2039, 4093]
SMALL_N = sorted(set(range(1, 130)) | set(PRIMES) | {255, 256, 511, 512, 513, 1000, 1024, 1025, 4096, 4097})


def test_a_bijection_for_every_small_n_and_its_inverse():
    for n in SMALL_N:
        for seed in (0, 1, 2**63 + 5):
            s = IndexShuffle(n, seed=seed, epoch=n % 3)
            got = s(np.arange(n))
            assert got.dtype == np.int64 and np.array_equal(np.sort(got), np.arange(n)), (n, seed)
            assert np.array_equal(s.inverse(got), np.arange(n)), (n, seed)
            assert np.array_equal(s.inverse(np.arange(n))[got], np.arange(n)), (n, seed)


def test_any_shape_and_scalar_in_one_call():
    s = IndexShuffle(10**9, seed=4, epoch=2)
    pos = np.array([[0, 5], [999_999_999, 123_456_789]], dtype=np.uint64)
    got = s(pos)
    assert got.shape == (2, 2) and got.dtype == np.int64
    assert got[1, 1] == s(123_456_789) == index_shuffle(123_456_789, n=10**9, seed=4, epoch=2)
    assert np.array_equal(s.inverse(got), pos.astype(np.int64))
    assert s(np.zeros(0, dtype=np.int64)).shape == (0,)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        IndexShuffle(0, seed=0)
    s = IndexShuffle(10, seed=0)
    for bad in (10, -1, [3, 11]):
        with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
            s(np.asarray(bad))
    with pytest.raises(TypeError, match="integers"):
        s(np.array([1.5]))


def test_orders_differ_across_epochs_and_seeds_and_are_pure():
    n = 10_000
    orders = {(seed, e): epoch_permutation(n, seed=seed, epoch=e, shuffle=True) for seed in (0, 1) for e in range(3)}
    assert np.array_equal(orders[(0, 0)], epoch_permutation(n, seed=0, epoch=0, shuffle=True))
    keys = list(orders)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            # two independent permutations agree at ~1 position in expectation; 10 is far in the tail
            assert np.count_nonzero(orders[a] == orders[b]) < 10, (a, b)
    assert np.array_equal(epoch_permutation(5, seed=0, epoch=0, shuffle=False), np.arange(5))


# ------------------------------------------------------------------------------------- randomness
# Every statistic is computed the same way for np.random.permutation, which must pass the same
# threshold: the thresholds test the index shuffle, not luck in the reference. They are ~5
# standard deviations of the statistic under a uniform random permutation, so a correct shuffle
# fails them about once in millions of runs (the seeds are fixed anyway: no flakes).


def _ks_triangular(d: np.ndarray, n: int) -> float:
    """KS distance of |displacement| / n from the law of |U - V| (U, V uniform): CDF 1 - (1-x)^2."""
    x = np.sort(d.astype(np.float64) / n)
    cdf = 1.0 - (1.0 - x) ** 2
    emp = np.arange(1, len(x) + 1) / len(x)
    return float(max(np.max(emp - cdf), np.max(cdf - (emp - 1 / len(x)))))


@pytest.mark.parametrize("n", [2**17 + 1, 300_007])  # just past a power of two: the longest cycle walks
def test_displacement_and_neighbour_statistics_match_a_random_permutation(n):
    ours = epoch_permutation(n, seed=7, epoch=3, shuffle=True)
    ref = np.random.default_rng(7).permutation(n)
    pos = np.arange(n)
    # KS at the 1e-6 level for n iid draws is ~2.7/sqrt(n); a permutation's values are slightly
    # dependent (negatively), which only narrows the statistic
    ks_limit = 2.7 / np.sqrt(n)
    corr_limit = 5 / np.sqrt(n)  # a correlation of n near-independent pairs has sd 1/sqrt(n)
    for order in (ref, ours):
        assert _ks_triangular(np.abs(order - pos), n) < ks_limit  # where a sample lands vs where it was
        assert _ks_triangular(np.abs(np.diff(order)), n) < ks_limit  # consecutive positions: unrelated values
        assert abs(np.corrcoef(pos, order)[0, 1]) < corr_limit
        for lag in (1, 2, 64, 256):  # consecutive (and batch-distance) indices: uncorrelated
            assert abs(np.corrcoef(order[:-lag], order[lag:])[0, 1]) < corr_limit, lag
        low = order & 1  # low bits, the Feistel's least mixed half if any: balanced and uncorrelated
        assert abs(low.mean() - 0.5) < 5 * 0.5 / np.sqrt(n)
        assert abs(np.corrcoef(low[:-1], low[1:])[0, 1]) < corr_limit
    nxt = epoch_permutation(n, seed=7, epoch=4, shuffle=True)
    assert abs(np.corrcoef(ours, nxt)[0, 1]) < corr_limit  # epoch to epoch: unrelated


def _pair_chi2(batches_per_epoch: list[np.ndarray], n: int) -> tuple[float, float, float]:
    """(chi2 of the pair co-occurrence counts, its expectation, its sd) under uniform shuffling."""
    counts = np.zeros((n, n))
    for batches in batches_per_epoch:
        onehot = np.zeros((len(batches), n))
        for b, batch in enumerate(batches):
            onehot[b, batch] = 1
        counts += onehot.T @ onehot
    iu = np.triu_indices(n, 1)
    c = counts[iu]
    nb, bs = batches_per_epoch[0].shape
    q = nb * bs * (bs - 1) / (n * (n - 1))  # P(two given samples share a batch) in one epoch
    e = len(batches_per_epoch) * q
    chi2 = float(((c - e) ** 2 / e).sum())
    pairs = len(c)
    return chi2, pairs * (1 - q), np.sqrt(2 * pairs) * (1 - q)


def test_pair_co_occurrence_within_batches_matches_a_random_permutation():
    """n=64 samples in 8 batches of 8, 1500 epochs: how often each of the 2016 pairs shares a
    batch. Under uniform shuffling each count is Binomial(epochs, 7/63); the chi-square over pairs
    has mean pairs*(1-q) and sd ~sqrt(2*pairs)*(1-q); the threshold is 6 sd."""
    n, bs, epochs = 64, 8, 1500
    order = SeededOrder(n, batch_size=bs, shuffle=True, drop_last=False, seed=3, rank=0, world_size=1)
    ours = [order.indices(e).reshape(-1, bs) for e in range(epochs)]
    rng = np.random.default_rng(3)
    ref = [rng.permutation(n).reshape(-1, bs) for _ in range(epochs)]
    for batches in (ref, ours):
        chi2, mean, sd = _pair_chi2(batches, n)
        assert abs(chi2 - mean) < 6 * sd, (chi2, mean, sd)
    # over ranks: which 16 samples rank 0 of 4 gets in an epoch is as random (q = 16*15/(64*63))
    ranked = [
        SeededOrder(n, batch_size=bs, shuffle=True, drop_last=False, seed=3, rank=0, world_size=4).indices(e)
        for e in range(epochs)
    ]
    chi2, mean, sd = _pair_chi2([r.reshape(1, -1) for r in ranked], n)
    assert abs(chi2 - mean) < 6 * sd, (chi2, mean, sd)


# ------------------------------------------------------------------------------- exactly once


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 7, 103, 1031])
def test_exactly_once_over_ranks_and_workers(n, world, drop_last):
    bs, workers, epoch = 4, 3, 2
    if drop_last and n < world:
        with pytest.raises(ValueError, match="cannot be split"):
            SeededOrder(n, batch_size=bs, shuffle=True, drop_last=True, seed=1, rank=0, world_size=world)
        return
    perm = epoch_permutation(n, seed=1, epoch=epoch, shuffle=True)
    everything: list[int] = []
    lengths = set()
    for r in range(world):
        order = SeededOrder(n, batch_size=bs, shuffle=True, drop_last=drop_last, seed=1, rank=r, world_size=world)
        mine = order.indices(epoch)
        kw = dict(base=0, world_size=world, rank=r, batch_size=bs, drop_last=drop_last)
        assert np.array_equal(mine, rank_indices(perm, sort=True, **kw))  # == dealing the whole permutation
        streamed = [b for b, _, _ in order.epoch(epoch)[2]]
        assert len(streamed) == len(order) and np.array_equal(np.concatenate(streamed or [mine[:0]]), mine)
        shares = [order.indices(epoch, skip=w, step=workers) for w in range(workers)]  # worker w: batches w::3
        assert sorted(np.concatenate(shares).tolist()) == sorted(mine.tolist())
        for w, share in enumerate(shares):
            assert np.array_equal(share, np.concatenate([streamed[k] for k in range(w, len(streamed), workers)]
                                                        or [mine[:0]]))
        lengths.add(len(streamed))
        everything += mine.tolist()
    assert len(lengths) == 1  # every rank the same number of batches
    counts = Counter(everything)
    if drop_last:
        assert max(counts.values(), default=1) == 1 and len(everything) == (n // world) // bs * bs * world
    else:
        assert set(counts) == set(range(n))
        assert len(everything) - n == (-n) % world  # DistributedSampler's padding, nothing else


def test_exactly_once_for_large_n_and_many_ranks():
    n, world, bs = 1_000_003, 64, 256
    seen = np.zeros(n, dtype=np.int64)
    for r in range(world):
        order = SeededOrder(n, batch_size=bs, shuffle=True, drop_last=False, seed=9, rank=r, world_size=world)
        for batch, _, _ in order.epoch(0)[2]:
            np.add.at(seen, batch, 1)
    padding = (-n) % world
    assert seen.min() == 1 and seen.sum() == n + padding and (seen == 2).sum() == padding


# ------------------------------------------------------------------------------- resume, bad input


class IdxDS:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


def _loader(n: int, **kw) -> Loader:
    return Loader(IdxDS(n), **{"batch_size": 4, "shuffle": True, "seed": 3, **kw})


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("world", "new_world"), [(4, 3), (3, 5), (4, 7)])
def test_resume_with_a_world_size_that_does_not_divide_the_rest(world, new_world, drop_last):
    """The unseen rest is re-dealt exactly: nothing seen twice, nothing lost except what drop_last
    drops (fewer than new_world * batch_size samples), padding only at the very end otherwise."""
    n, bs = 250, 4
    before, states = [], []
    for r in range(world):
        order = SeededOrder(n, batch_size=bs, shuffle=True, drop_last=drop_last, seed=2, rank=r, world_size=world)
        it = order.epoch(1)[2]
        for _ in range(5):
            batch, pos, _ = next(it)
            before += batch.tolist()
        states.append(pos)
    after = []
    for r in range(new_world):
        order = SeededOrder(n, batch_size=bs, shuffle=True, drop_last=drop_last, seed=2, rank=r,
                            world_size=new_world)
        after += [i for b, _, _ in order.epoch(1, resume=states[0])[2] for i in b.tolist()]
    assert len(set(before)) == len(before) == 5 * bs * world and not set(before) & set(after)
    rest = n - len(before)
    if drop_last:
        assert len(set(after)) == len(after) and rest - len(after) < new_world * bs
    else:
        assert set(before) | set(after) == set(range(n)) and len(after) - rest == (-rest) % new_world


def test_empty_dataset_and_fewer_samples_than_ranks():
    empty = _loader(0, shuffle=False)
    assert len(empty) == 0 and list(empty) == []
    with pytest.raises(ValueError):  # torch's RandomSampler refuses an empty dataset, as DataLoader does
        _loader(0)
    parts = [list(_loader(3, rank=r, world_size=5)) for r in range(5)]
    got = sorted(int(b[0]) for p in parts for b in p)
    assert all(len(p) == 1 for p in parts) and set(got) == {0, 1, 2} and len(got) == 5  # documented padding
    too_few = _loader(3, rank=0, world_size=5, drop_last=True)  # rank and world apply from the first iter()
    with pytest.raises(ValueError, match="cannot be split over 5 ranks with drop_last=True"):
        iter(too_few)


def test_a_state_from_another_dataset_length_or_order_version_is_refused():
    a = _loader(100)
    it = iter(a)
    next(it), next(it)
    state = a.state_dict()
    assert state["position"]["order"] == ORDER_VERSION and state["position"]["n"] == 100
    with pytest.raises(ValueError, match="dataset of 100 samples, this Loader's has 101"):
        _loader(101).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True"):
        _loader(100, shuffle=False).load_state_dict(state)
    old = {**state, "position": {k: v for k, v in state["position"].items() if k not in ("order", "n", "shuffle")}}
    b = _loader(100)
    with pytest.raises(ValueError, match="order is version 1.*'position' set to None"):
        b.load_state_dict(old)
    b.load_state_dict({**old, "position": None})  # the documented way out: that epoch from its start
    assert [x.tolist() for x in b] == [x.tolist() for x in _loader(100)]
    c = _loader(100)
    c.load_state_dict(state)
    assert [x.tolist() for x in c] == [x.tolist() for x in _loader(100)][2:]


def test_a_huge_epoch_is_streamed_not_planned():
    """An epoch plan needs the rank's whole epoch of indices: it is offered one only while that
    fits `PLAN_MAX_BYTES`; past it the epoch is streamed and nothing of size n is built."""
    import tracemalloc

    calls: list[int] = []

    class Planner:
        def plan(self, indices, batch_size):
            calls.append(len(indices))
            return None

        def prepare_plan(self, indices, batch_size):
            calls.append(len(indices))

    plan = Planner()

    kw = dict(batch_size=256, shuffle=True, drop_last=False, seed=0, rank=0, world_size=1)
    tracemalloc.start()
    it = SeededOrder(10**9, **kw).epoch(0, plan=plan)[2]
    batches = [next(it)[0] for _ in range(600)]  # past the first chunks
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert calls == [] and peak < 8 << 20 and all(len(b) == 256 for b in batches)
    assert len(np.unique(np.concatenate(batches))) == 600 * 256
    small = SeededOrder(1000, **kw)
    got = [b for b, _, _ in small.epoch(0, plan=plan, ahead=False)[2]]
    assert calls == [1000] and np.array_equal(np.concatenate(got), small.indices(0))


def test_a_torch_order_state_is_refused_by_a_seeded_loader():
    torch_mode = Loader(IdxDS(100), batch_size=4, shuffle=True)
    it = iter(torch_mode)
    next(it)
    with pytest.raises(ValueError, match="saved with a sampler order, this Loader has a seeded order"):
        _loader(100).load_state_dict(torch_mode.state_dict())
