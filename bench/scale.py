"""Epoch order at scale: a billion samples, 1,024 ranks x 8 workers, batches of 256.

    python -m bench.scale                 # n = 10^9 (index shuffle), the permutation up to 10^8
    python -m bench.scale --quick         # n = 10^8, the permutation up to 10^7 (smoke run)

One process plays one rank (and its workers) at a time; no data is read (the dataset returns
its indices), so what is timed is the order alone:

* time to a rank's first batch of indices from `Loader(...)` construction, from `set_epoch`, from
  `load_state_dict` (same world size, and a resume on 1,000 ranks: the elastic re-deal), over
  several ranks: median and max;
* one rank's whole epoch of indices (n / 1,024 samples) through the Loader's order, and one
  worker's share (every 8th batch) computed by the worker itself;
* the peak memory the order allocates meanwhile (`tracemalloc`, which sees numpy's buffers);
* exactly once: every rank x worker simulated in full at n = 10^7 (each sample counted), and at
  n = 10^9 a random sample of positions mapped and checked against the inverse map and against
  the batch of the rank and worker that owns it;
* beside it, the previous approach (an `np.random` permutation of the whole epoch, drawn by
  every rank and dealt with `rank_indices`) at the sizes where it still fits here;
* length bucketing (`TokenBudgetBatchSampler`, 1,024 ranks, max_tokens 16384, pad to 8) from
  10^6 samples up to `--bucketing-max` (default 10^8): time and peak memory to the first batch
  (construction, the lengths' validation, the first window's plan), the time of each further
  window, and the first window's padding waste and rank imbalance. The lengths array itself
  (int32, as `ds.lengths()` gives it) is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.epoch_start import IndexDS
from fastload.loader import Loader
from fastload.order.bucketing import TokenBudgetBatchSampler, padding_stats, step_imbalance
from fastload.order.index_shuffle import IndexShuffle
from fastload.order.sampling import SeededOrder, rank_indices

__all__ = ["main"]

BS, WORLD, WORKERS = 256, 1024, 8


def _ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def _peak_mb(fn: Callable[[], Any]) -> tuple[float, Any]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        out = fn()
        return tracemalloc.get_traced_memory()[1] / 2**20, out
    finally:
        tracemalloc.stop()


def _loader(n: int, rank: int, world: int = WORLD) -> Loader:
    return Loader(IndexDS(n), batch_size=BS, shuffle=True, seed=0, rank=rank, world_size=world)


def _first(loader: Loader) -> np.ndarray:
    return next(iter(loader))["i"].numpy()


def first_batch_times(n: int, ranks: list[int], repeats: int = 3) -> dict[str, list[float]]:
    """Milliseconds to the first batch of indices, `repeats` times per rank, from each starting point."""
    out: dict[str, list[float]] = {"construction": [], "set_epoch": [], "load_state_dict": [], "elastic": []}
    for r in ranks:
        loader = _loader(n, r)
        it = iter(loader)
        for _ in range(100):
            next(it)
        state = loader.state_dict()  # 100 batches into epoch 0
        for e in range(repeats):
            ms, _ = _ms(lambda: _first(_loader(n, r)))  # noqa: B023
            out["construction"].append(ms)
            loader.set_epoch(7 + e)
            ms, _ = _ms(lambda: _first(loader))  # noqa: B023
            out["set_epoch"].append(ms)
            fresh = _loader(n, r)
            ms, _ = _ms(lambda: (fresh.load_state_dict(state), _first(fresh)))  # noqa: B023
            out["load_state_dict"].append(ms)
            smaller = _loader(n, r % 1000, 1000)
            ms, _ = _ms(lambda: (smaller.load_state_dict(state), _first(smaller)))  # noqa: B023
            out["elastic"].append(ms)
    return out


def whole_epoch(n: int, rank: int, repeats: int = 3) -> tuple[float, float, int, float, float]:
    """(median ms, peak MB, samples) for one rank's whole epoch streamed through the order, and
    (median ms, peak MB) for one worker's share computed by the worker."""
    order = SeededOrder(n, batch_size=BS, shuffle=True, drop_last=False, seed=0, rank=rank, world_size=WORLD)

    def stream() -> int:
        return sum(len(b) for b, _, _ in order.epoch(3)[2])

    def share() -> np.ndarray:
        return order.indices(3, skip=5, step=WORKERS)

    peak, total = _peak_mb(stream)
    wpeak, _ = _peak_mb(share)
    ms = statistics.median(_ms(stream)[0] for _ in range(repeats))
    wms = statistics.median(_ms(share)[0] for _ in range(repeats))
    return ms, peak, total, wms, wpeak


def full_simulation(n: int) -> tuple[float, bool, int]:
    """Every rank's every worker's batches at `n`: (seconds, exactly once (+ padding), padding)."""
    t0 = time.perf_counter()
    seen = np.zeros(n, dtype=np.uint8)
    for r in range(WORLD):
        order = SeededOrder(n, batch_size=BS, shuffle=True, drop_last=False, seed=0, rank=r, world_size=WORLD)
        for w in range(WORKERS):
            np.add.at(seen, order.indices(0, skip=w, step=WORKERS), 1)
    padding = (-n) % WORLD
    ok = bool(seen.min() == 1 and seen.max() <= 2 and int((seen == 2).sum()) == padding)
    return time.perf_counter() - t0, ok, padding


def sampled_check(n: int, samples: int, owners: int) -> tuple[float, bool]:
    """`samples` random positions of epoch 0 at `n`: the inverse map gives each back, no two share a
    sample, and for `owners` of them the batch of the rank and worker that own the position holds it."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(1)
    pos = np.unique(rng.integers(0, n, samples, dtype=np.int64))
    shuffle = IndexShuffle(n, seed=0, epoch=0)
    idx = shuffle(pos)
    ok = bool(np.array_equal(shuffle.inverse(idx), pos)) and len(np.unique(idx)) == len(idx)
    orders: dict[int, SeededOrder] = {}
    for p, i in zip(pos[:owners].tolist(), idx[:owners].tolist()):
        r, t = p % WORLD, p // WORLD  # the rank dealt position p, and its t-th sample
        k = t // BS  # ... in its batch k, fetched by worker k % WORKERS
        order = orders.setdefault(
            r, SeededOrder(n, batch_size=BS, shuffle=True, drop_last=False, seed=0, rank=r, world_size=WORLD)
        )
        ok &= i in order.indices(0, skip=k, stop=k + 1).tolist()
    return time.perf_counter() - t0, ok


def permutation_approach(n: int, rank: int) -> tuple[float, float]:
    """The previous order: each rank draws the whole epoch's permutation, then deals itself its
    share (sorted in batches): (ms to the rank's indices, peak MB)."""

    def draw() -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([0, 3]))
        order = rng.permutation(n).astype(np.int64, copy=False)
        return rank_indices(order, base=0, world_size=WORLD, rank=rank, batch_size=BS, drop_last=False, sort=True)

    peak, _ = _peak_mb(draw)
    ms, _ = _ms(draw)
    return ms, peak


def _lengths(n: int) -> np.ndarray:
    """bench.bucketing's log-normal lengths (median 200, sigma 1, in [16, 2048]) as int32, made in parts."""
    out = np.empty(n, dtype=np.int32)
    rng = np.random.default_rng(0)
    for a in range(0, n, 10**7):
        m = min(n, a + 10**7) - a
        out[a : a + m] = np.clip(rng.lognormal(np.log(200), 1.0, m), 16, 2048)
    return out


def bucketing_at_scale(n: int) -> dict[str, float]:
    lengths = _lengths(n)

    def first() -> tuple[TokenBudgetBatchSampler, list[int]]:
        s = TokenBudgetBatchSampler(lengths, 16384, rank=0, world_size=WORLD, pad_to_multiple_of=8, seed=0)
        return s, next(iter(s))

    peak, _ = _peak_mb(first)
    ms, (sampler, _) = _ms(first)
    out = {"first_s": ms / 1e3, "peak_mb": peak, "windows": sampler.num_windows, "next_window_s": float("nan")}
    if sampler.num_windows > 1:
        out["next_window_s"] = _ms(lambda: sampler.window_plan(1))[0] / 1e3
    plan = sampler.window_plan(0)
    out["waste"] = padding_stats(lengths, [b for step in plan for b in step], pad_to_multiple_of=8)["waste"]
    imb = step_imbalance(sampler.step_costs(window=0))
    out["imb_mean"], out["imb_max"] = float(imb.mean()), float(imb.max())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="n = 10^8, the permutation up to 10^7")
    p.add_argument("--n", type=int, default=None, help="samples (default 10^9, 10^8 with --quick)")
    p.add_argument("--ranks", type=int, default=9, help="ranks timed to their first batch")
    p.add_argument("--permutation-max", type=int, default=None, help="largest n for the permutation approach")
    p.add_argument("--bucketing-max", type=int, default=None, help="largest n for length bucketing (default 10^8)")
    args = p.parse_args(argv)
    n = args.n or (10**8 if args.quick else 10**9)
    perm_max = args.permutation_max or (10**7 if args.quick else 10**8)
    ranks = [int(r) for r in np.linspace(0, WORLD - 1, args.ranks)]
    print(f"n = {n:,} samples, {WORLD} ranks x {WORKERS} workers, batch {BS}: {-(-n // WORLD):,} samples a rank")
    first_batch_times(n, ranks[:1])  # warm up (lazy imports, first allocations): not timed
    times = first_batch_times(n, ranks)
    ms, peak, total, wms, wpeak = whole_epoch(n, ranks[len(ranks) // 2])
    sim_n = min(n, 10**7)
    sim_s, sim_ok, padding = full_simulation(sim_n)
    chk_s, chk_ok = sampled_check(n, 10**6, 2000)

    print("\n| index shuffle (this order) | median | max | target |")
    print("|---|---|---|---|")
    names = {
        "construction": "`Loader(...)` to a rank's first batch",
        "set_epoch": "`set_epoch(7)` to the first batch",
        "load_state_dict": "`load_state_dict` (mid-epoch) to the first batch",
        "elastic": "`load_state_dict` on 1,000 ranks (re-deal) to the first batch",
    }
    for key, label in names.items():
        v = times[key]
        print(f"| {label} ({len(ranks)} ranks x 3) | {statistics.median(v):.2f} ms | {max(v):.2f} ms | < 10 ms |")
    print(f"| one rank's whole epoch ({total:,} indices, streamed in batches, median of 3) | {ms:.0f} ms | | < 1 s |")
    print(f"| one worker's share of it (every {WORKERS}th batch, one call) | {wms:.0f} ms | | |")
    print(f"| peak memory the order allocates: rank's epoch / worker's share | {peak:.1f} MB / {wpeak:.1f} MB "
          "| | < 64 MB |")
    print(f"| exactly once, every rank x worker in full at n = {sim_n:,} | {'yes' if sim_ok else 'NO'} "
          f"({padding} padding repeats) | {sim_s:.1f} s | |")
    print(f"| exactly once at n = {n:,}: 10^6 random positions vs the inverse map, 2,000 vs their rank's batch "
          f"| {'yes' if chk_ok else 'NO'} | {chk_s:.1f} s | |")

    print("\n| n | permutation approach: a rank's indices | its peak memory | index shuffle: whole rank epoch |"
          " its peak memory |")
    print("|---|---|---|---|---|")
    size = 10**6
    while size <= max(n, perm_max):
        new_ms, new_peak, _, _, _ = whole_epoch(size, 0)
        if size <= perm_max:
            old_ms, old_peak = permutation_approach(size, 0)
            old = f"{old_ms:,.0f} ms | {old_peak:,.0f} MB"
        else:
            old = f"not run: {8 * size / 2**30:.1f} GiB int64 permutation per rank per epoch | "
        print(f"| {size:.0e} | {old} | {new_ms:,.1f} ms | {new_peak:.1f} MB |")
        size *= 10
    print("\n| n (length bucketing, 1,024 ranks) | first batch | its peak memory | each further window | windows"
          " | window 0: padding waste, rank imbalance mean / max |")
    print("|---|---|---|---|---|---|")
    size, top = 10**6, args.bucketing_max or (10**7 if args.quick else 10**8)
    while size <= top:
        b = bucketing_at_scale(size)
        nxt = "" if b["windows"] == 1 else f"{b['next_window_s']:.2f} s"
        print(f"| {size:.0e} | {b['first_s']:.2f} s | {b['peak_mb']:.0f} MB | {nxt} | {b['windows']} | "
              f"{b['waste']:.2%}, {b['imb_mean']:.2%} / {b['imb_max']:.2%} |")
        size *= 10
    if not (sim_ok and chk_ok):
        raise SystemExit("exactly-once check FAILED")


if __name__ == "__main__":
    main()
