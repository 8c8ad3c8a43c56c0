"""The stall at the start of every epoch: time from `iter(loader)` to its first batch.

    python -m bench.epoch_start            # 200k and 2M samples
    python -m bench.epoch_start --quick    # 20k samples (smoke run)
    python -m bench.epoch_start --rounds 16   # and the throughput cost of the background thread

A seeded epoch planned on the direct path (`fastload.fetch.plan`) needs the rank's whole epoch of
indices, O(n) work before the first batch of the epoch can be read; `fastload.Loader` computes the
next epoch's order on a background thread while the current epoch runs (`fastload.order.ahead`).
`IndexDS` below is not on the direct path: its order is streamed batch by batch (see
docs/order.md), so there both rows time that streamed order and nothing is computed ahead. This
bench measures the first batch of epochs 2-4 both ways in one run: with the order computed ahead
(`order_ahead=True`, the default wherever the epoch's fetching leaves a core idle) and computed
when the epoch starts (`order_ahead=False`).
The dataset returns its indices (no read cost), and the loop sleeps 1 ms every 64 batches, as a
training step that leaves the CPU idle would.

With `--rounds R` it also measures what that background thread costs where the fetching already
fills every core: `bench.loader`'s 3 KiB records (built once under --path), a Loader with one
thread worker (plus the stealing consumer), 3 epochs per loader, `order_ahead=False` against
`order_ahead=True` back to back in alternating order, R paired rounds, the median and quartiles
of the per-round throughput ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from fastload.loader import Loader

__all__ = ["first_batch_ms", "main"]


class IndexDS:
    """Sample i is i, read in batches (no I/O: only the order's cost shows)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def get_batch(self, indices: Any) -> dict[str, np.ndarray]:
        return {"i": np.asarray(indices, dtype=np.int64)}


def first_batch_ms(n: int, *, ahead: bool, epochs: int = 4, step_every: int = 64, step_s: float = 0.001) -> float:
    """Median milliseconds from `iter()` to the first batch over epochs 2..`epochs`."""
    loader = Loader(IndexDS(n), batch_size=256, shuffle=True, seed=0, order_ahead=ahead)
    waits = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        waits.append((time.perf_counter() - t0) * 1e3)
        for k, _ in enumerate(it):
            if k % step_every == 0:
                time.sleep(step_s)
    return statistics.median(waits[1:])


def ahead_cost(path: str, n: int, rounds: int, workers: int = 1) -> list[float]:
    """Per-round throughput ratios, order computed at epoch start / computed ahead (sorted)."""
    from bench.loader import BATCH, TIMED_EPOCHS, build, dict_size, epochs_of, rate
    from fastload.formats import FastloadDataset

    ds = FastloadDataset(build(path, n)[0])
    limit = TIMED_EPOCHS * n - 2 * BATCH

    def run(ahead: bool) -> float:
        loader = Loader(
            ds, batch_size=BATCH, shuffle=True, num_workers=workers, worker_type="thread", seed=0, order_ahead=ahead
        )
        return rate(epochs_of(loader, TIMED_EPOCHS), limit, dict_size)

    ratios = []
    for r in range(rounds):
        first, second = (False, True) if r % 2 == 0 else (True, False)
        a, b = run(first), run(second)
        at_start, ahead = (a, b) if first is False else (b, a)
        ratios.append(at_start / ahead)
    return sorted(ratios)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20k samples, one trial")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=0, help="paired throughput rounds (0: skip)")
    ap.add_argument("--path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "fastload-bench-loader"))
    args = ap.parse_args(argv)
    sizes, trials = ((20_000,), 1) if args.quick else ((200_000, 2_000_000), args.trials)
    print("first batch of epochs 2-4 (ms, median of trials; batch 256, shuffled, seeded)")
    print(f"{'samples':>12}  {'order computed ahead':>21}  {'order at epoch start':>21}  {'ratio':>7}")
    for n in sizes:
        ahead = statistics.median(first_batch_ms(n, ahead=True) for _ in range(trials))
        start = statistics.median(first_batch_ms(n, ahead=False) for _ in range(trials))
        print(f"{n:>12,}  {ahead:>21.2f}  {start:>21.2f}  {start / ahead:>6.1f}x")
    if args.rounds:
        n = 20_000 if args.quick else 200_000
        ratios = ahead_cost(args.path, n, args.rounds)
        q = len(ratios) // 4
        print(
            f"\nthroughput, {n:,} x 3 KiB, 1 thread worker, 3 epochs: order at epoch start / computed ahead = "
            f"{statistics.median(ratios):.3f} (median of {len(ratios)} paired rounds; quartiles "
            f"{ratios[q]:.3f}-{ratios[-q - 1]:.3f}; {os.cpu_count()} cores)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
