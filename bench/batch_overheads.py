"""Per-batch Python of a shuffled cold epoch: two steps, each against the way it replaced, in one run.

- `block check`: the blocks a batch's rows (64 per shard, every field) touch that are not verified
  yet (`formats.blocks.missing_blocks`), in its one C call against the numpy steps without the
  extension (`block_ids`, a mask, `np.unique`); us per call, on a real shard's byte ranges, with
  nothing verified yet (a shard that is still arriving).
- `sampler batches`: a `ShardWindowSampler` epoch cut into batches of 256 as the Loader takes them
  (`SamplerOrder`'s path: `ShardWindowSampler.batches`) against torch's `BatchSampler` pulling one
  index at a time; ms per epoch.

The two ways alternate within each of `--rounds` rounds; each figure is the best of `--repeats`
passes (this process's time, nothing else running), median [min-max] over the rounds.

Run: `python -m bench.batch_overheads [--samples 48768 --shards 12 --rounds 5]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.remote import write_json
from fastload.formats import FastloadDataset, blocks, write
from fastload.order.shard_shuffle import ShardWindowSampler

__all__ = ["main"]


def _best(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _block_check_inputs(root: str, samples: int, shards: int, seed: int) -> tuple[list[tuple[Any, Any]], int, int]:
    """(byte ranges [lo, hi) of 64 random rows of every field, per batch), shift, block count of shard 0."""
    per_shard = samples // shards
    write(({"x": np.full(8192, i % 251, np.uint8), "label": np.int64(i)} for i in range(samples)), root,
          shard_size=per_shard * 8300, progress=False)
    ds = FastloadDataset(root)
    reader = ds.shard(0)
    rng = np.random.default_rng(seed)
    spans = []
    for _ in range(200):
        rows = np.sort(rng.choice(reader.num_samples, 64, replace=False))
        parts = [reader.rows_span(f.name, rows) for f in ds.schema]
        spans.append((np.concatenate([lo for lo, _ in parts]), np.concatenate([hi for _, hi in parts])))
    shift, count = ds.manifest.block_log2, len(reader.table)
    ds.close()
    return spans, shift, count


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48768)
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="fastload-batch-overheads-")
    try:
        spans, shift, count = _block_check_inputs(os.path.join(work, "ds"), args.samples, args.shards, seed=0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c_ext = blocks._c_missing_blocks
    if c_ext is None:
        sys.exit("formats._ranges is not built: nothing to compare")

    def checked(extension: Any) -> list[list[int]]:
        blocks._c_missing_blocks = extension
        try:
            return [blocks.missing_blocks(lo, hi, shift, np.zeros(count, dtype=bool)).tolist() for lo, hi in spans]
        finally:
            blocks._c_missing_blocks = c_ext

    if checked(c_ext) != checked(None):
        sys.exit("the two block checks disagree")

    def block_check(extension: Any) -> float:
        def calls() -> None:
            for lo, hi in spans:
                blocks.missing_blocks(lo, hi, shift, np.zeros(count, dtype=bool))

        blocks._c_missing_blocks = extension
        try:
            return _best(calls, args.repeats) / len(spans) * 1e6
        finally:
            blocks._c_missing_blocks = c_ext

    per_shard = args.samples // args.shards
    sampler = ShardWindowSampler([per_shard] * args.shards, window=4, seed=1)

    def by_batches() -> None:
        for _ in sampler.batches(256, False):
            pass

    def by_index() -> None:
        for _ in torch.utils.data.BatchSampler(sampler, 256, False):
            pass

    rows: dict[str, Callable[[], float]] = {
        "block check, C (us/call)": lambda: block_check(c_ext),
        "block check, numpy (us/call)": lambda: block_check(None),
        "sampler batches (ms/epoch)": lambda: _best(by_batches, args.repeats) * 1e3,
        "sampler one index at a time (ms/epoch)": lambda: _best(by_index, args.repeats) * 1e3,
    }
    res: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            res[name].append(rows[name]())
    print(f"{args.samples} samples of 8 KiB in {args.shards} shards, {args.rounds} rounds: median [min-max]")
    for name, vals in res.items():
        print(f"{name:40s} {np.median(vals):8.2f}  [{min(vals):.2f}-{max(vals):.2f}]")
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
