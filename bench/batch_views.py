"""Batch views vs torch-typed batches vs torch's DataLoader, in interleaved rounds on `make demo`'s data.

    python -m bench.batch_views [--rounds R] [--seconds S] [--workers 0,1,2] [--size 192MiB]

Builds the embedded default of `fastload bench` (mixed records: JPEG bytes, token lists, a 12 KiB
array, a label; batch 256) once, then runs, in each of `--rounds` rounds, every loader kind of
`fastload.benchmark.run_loader` at every worker count, one after the other (`run_loader`: shuffled
epochs, steady-state samples/s as the training loop sees them, torch's workers persistent). Per
round it takes each kind's best worker count, and reports the per-round ratios (best fastload
views / best torch row, best fastload torch-typed / best torch row, views / torch-typed) and
their medians: rows compared within one round saw the same machine state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from fastload.benchmark import LABELS, LOADER_KINDS, TORCH_KINDS, build, run_loader
from fastload.formats import FastloadDataset
from fastload.formats.units import parse_size


def _round(ds: FastloadDataset, workers: list[int], seconds: float, seed: int) -> dict[str, tuple[int, float]]:
    """{kind: (best worker count, its samples/s)} for one round."""
    best: dict[str, tuple[int, float]] = {}
    for kind in LOADER_KINDS:
        for w in workers:
            run = run_loader(kind, ds, batch_size=256, num_workers=w, seconds=seconds,
                             device=torch.device("cpu"), seed=seed)
            rate = run.samples_per_s
            print(f"  {LABELS.get(kind, kind):24s} w={w}: {rate:10,.0f} samples/s", flush=True)
            if kind not in best or rate > best[kind][1]:
                best[kind] = (w, rate)
    return best


def main() -> None:
    """Run the rounds and print the per-round and median ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--size", type=parse_size, default=192 << 20)
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="fastload-views-") as tmp:
        data = build(os.path.join(tmp, "data"), size=args.size, backends=(), seed=0)
        ds = FastloadDataset(data.fastload)
        ratios: dict[str, list[float]] = {"views / torch": [], "torch-typed / torch": [], "views / torch-typed": []}
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            best = _round(ds, workers, args.seconds, seed=r)
            torch_kind = max(TORCH_KINDS, key=lambda k: best[k][1])
            views, typed, base = best["fastload-views"], best["fastload"], best[torch_kind]
            ratios["views / torch"].append(views[1] / base[1])
            ratios["torch-typed / torch"].append(typed[1] / base[1])
            ratios["views / torch-typed"].append(views[1] / typed[1])
            print(f"  best: views w={views[0]} {views[1]:,.0f}, torch-typed w={typed[0]} {typed[1]:,.0f}, "
                  f"best torch row {torch_kind} w={base[0]} {base[1]:,.0f}", flush=True)
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        for name, values in ratios.items():
            print(f"{name}: median {statistics.median(values):.2f}x  rounds {[round(v, 2) for v in values]}")


if __name__ == "__main__":
    main()
