"""The stall at the start of every epoch: time from `iter(loader)` to its first batch.

    python -m bench.epoch_start            # 200k and 2M samples
    python -m bench.epoch_start --quick    # 20k samples (smoke run)

A seeded epoch is a permutation of the whole dataset, dealt to the rank and sorted inside each
batch, O(n) work before the first batch of the epoch can be read. `fastload.Loader` computes the
next epoch's order on a background thread while the current epoch runs (`fastload.ahead`). This
bench measures the first batch of epochs 2-4 both ways in one run: with the order computed ahead
(`order_ahead=True`, the default wherever the epoch's fetching leaves a core idle) and computed
when the epoch starts (`order_ahead=False`).
The dataset returns its indices (no read cost), and the loop sleeps 1 ms every 64 batches, as a
training step that leaves the CPU idle would.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20k samples, one trial")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    sizes, trials = ((20_000,), 1) if args.quick else ((200_000, 2_000_000), args.trials)
    print("first batch of epochs 2-4 (ms, median of trials; batch 256, shuffled, seeded)")
    print(f"{'samples':>12}  {'order computed ahead':>21}  {'order at epoch start':>21}  {'ratio':>7}")
    for n in sizes:
        ahead = statistics.median(first_batch_ms(n, ahead=True) for _ in range(trials))
        start = statistics.median(first_batch_ms(n, ahead=False) for _ in range(trials))
        print(f"{n:>12,}  {ahead:>21.2f}  {start:>21.2f}  {start / ahead:>6.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
