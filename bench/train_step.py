"""Train a small CNN for a fixed number of steps with torch's DataLoader, then with fastload.Loader.

    python -m bench.train_step                      # 64 MiB synthetic dataset, 100 steps each
    python -m bench.train_step --steps 30 --size 8MiB --workers 0   # quick
    python -m bench.train_step --dataset DIR        # a fastload dataset with `record` + `label`

The swap is one line; everything else (dataset object, arguments, training loop) is identical:

    loader = DataLoader(ds, batch_size=B, shuffle=True, num_workers=W, pin_memory=pin)
    loader = Loader(ds, batch_size=B, shuffle=True, num_workers=W, pin_memory=pin)

Reports per loader (means per step): step time = compute + wait for the next batch, the data stall (time
waiting for input / wall time, warm-up steps excluded) and samples/s; for fastload also the
slowest loader stage from `loader.stats()`. Runs on CUDA when available (`--device`), else CPU.
Labels are random: this measures the input pipeline under a real training step, not accuracy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from fastload.benchmark import bottleneck
from fastload.dataset import open_dataset
from fastload.formats import Block, BlockSource, Field, Schema, parse_size, write
from fastload.loader import Loader

__all__ = ["main", "make_model", "train", "write_dataset"]

SHAPE = (3, 64, 64)
SCHEMA = Schema((Field("record", "ndarray", np.dtype(np.uint8), SHAPE), Field("label", "scalar", np.dtype(np.int64))))


def write_dataset(out_dir: str, *, size: int, classes: int = 100, seed: int = 0,
                  shape: tuple[int, ...] = SHAPE) -> int:
    """About `size` bytes of random uint8 `shape` records with labels; returns the sample count."""
    n = max(256, size // int(np.prod(shape)))
    rng = np.random.default_rng(seed)
    schema = SCHEMA if shape == SHAPE else Schema((Field("record", "ndarray", np.dtype(np.uint8), shape),
                                                   Field("label", "scalar", np.dtype(np.int64))))

    def blocks(start: int) -> Iterator[Block]:
        step = max(1, (32 << 20) // int(np.prod(shape)))
        for s in range(start, n, step):
            e = min(s + step, n)
            yield Block(e - s, {"record": rng.integers(0, 256, (e - s, *shape), dtype=np.uint8),
                                "label": rng.integers(0, classes, e - s).astype(np.int64)})

    write(BlockSource(schema=schema, num_samples=n, blocks=blocks), out_dir, schema=schema, progress=False)
    return n


def make_model(classes: int = 100) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )


def _batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def train(loader: Any, *, steps: int, warmup: int, device: torch.device, classes: int = 100) -> dict[str, Any]:
    """Run `steps` optimiser steps; time the wait for each batch and the compute of each step."""
    torch.manual_seed(0)
    model = make_model(classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    waits, computes = [], []
    it = _batches(loader)
    t_start = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        batch = next(it)
        x = batch["record"].to(device, non_blocking=True).float().div_(255)
        y = batch["label"].to(device, non_blocking=True)
        t1 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        if k >= warmup:
            waits.append(t1 - t0)
            computes.append(t2 - t1)
    wall = time.perf_counter() - t_start
    return {
        "step_ms": 1e3 * wall / steps,
        "wait_ms": 1e3 * float(np.mean(waits)),
        "compute_ms": 1e3 * float(np.mean(computes)),
        "data_stall": sum(waits) / wall,
        "samples_per_s": steps * int(batch["label"].shape[0]) / wall,
        "loss": float(loss.detach()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", help="fastload dataset with `record` (uint8 3x64x64) and `label` fields")
    p.add_argument("--size", type=parse_size, default=64 << 20, help="synthetic dataset size (default 64MiB)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda[:N]")
    p.add_argument("--loaders", default="torch,fastload", help="comma list of torch, fastload")
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    pin = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="fastload-train-") as tmp:
        path = args.dataset
        if path is None:
            path = os.path.join(tmp, "ds")
            n = write_dataset(path, size=args.size)
            print(f"wrote {n} synthetic samples ({args.size / 2**20:.0f} MiB) to {path}")
        ds = open_dataset(path)
        print(f"device {device}, batch {args.batch_size}, {args.workers} workers, {args.steps} steps "
              f"(+{args.warmup} warm-up), torch threads {torch.get_num_threads()}")
        print(f"{'loader':<10}{'step ms':>9}{'compute ms':>12}{'wait ms':>9}{'data stall':>12}{'samples/s':>11}"
              "  bottleneck")
        for name in args.loaders.split(","):
            if name == "torch":
                loader: Any = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                         pin_memory=pin)
            elif name == "fastload":
                loader = Loader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                pin_memory=pin)
            else:
                raise SystemExit(f"unknown loader {name!r}: expected torch or fastload")
            r = train(loader, steps=args.steps, warmup=args.warmup, device=device)
            where = bottleneck(loader.stats()) if isinstance(loader, Loader) else "-"
            print(f"{name:<10}{r['step_ms']:>9.1f}{r['compute_ms']:>12.1f}{r['wait_ms']:>9.2f}"
                  f"{100 * r['data_stall']:>11.1f}%{r['samples_per_s']:>11,.0f}  {where}")
            close = getattr(loader, "close", None)
            if callable(close):
                close()
            del loader


if __name__ == "__main__":
    main()
