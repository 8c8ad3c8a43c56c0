"""Mixed records on a dataset kept open, in CPU time: `python -m bench.mixed_records [--size 192MiB]`.

The embedded default of `fastload bench` (`fastload.benchmark.synthetic`: per sample a fixed
(3, 64, 64) uint8 record, an int64 label, a JPEG and int32 token ids) written as fastload and
LMDB, its files read whole first (warm page cache). In one process, all timed with this thread's
CPU time (`time.thread_time`: the work, which load from other processes changes little):

- shuffled epochs (batch 256) of `get_batch` on datasets kept open, epochs 2..`--epochs`,
  interleaved epoch by epoch on the same orders (each reader first in turn): fastload (one
  gather per field: the record rows, the JPEG bytes, the tokens; labels resident), LMDB read in
  place (`LMDBDataset`: one ranged copy per value, from spans learnt in its first epoch), and
  the raw gather of each sample's payload as one contiguous byte range of `raw.bin` (one copy
  per sample, no format: what a row-interleaved layout could at best reach), and the same bytes
  gathered in file order (each batch 256 consecutive samples: the copy with no random placement).
  LMDB, both raw rows and fastload's variable fields copy through the same C gather
  (`fastload.formats._ranges`, which reads the next ranges ahead);
- the first batch after an open (`--opens` fresh opens of each, after one untimed open so the
  code paths are warm; blocks this process verified already stay verified, see formats/blocks.py);
- `fastload bench`'s loader rows with 0 workers (everything in this thread): the Loader with
  `BatchViews()` and torch's DataLoader (`__getitems__`, and per sample) over the fastload copy,
  shuffled epochs in CPU time (`--loader-epochs`; 0 skips them).
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastload import open_dataset
from fastload.benchmark.loaders import make_loader
from fastload.benchmark.synthetic import build
from fastload.formats.lmdb_dataset import LMDBDataset
from fastload.formats.ragged import gather_ranges
from fastload.formats.units import parse_size

BATCH = 256


def _read_whole(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def _epoch(read: Callable[[np.ndarray], object], order: np.ndarray) -> float:
    t0 = time.thread_time()
    for s in range(0, len(order), BATCH):
        read(order[s : s + BATCH])
    return time.thread_time() - t0


def _raw_reader(path: str, ds: Any, *, in_order: bool = False) -> Callable[[np.ndarray], object]:
    """Each sample's payload (record, label, JPEG, tokens) as one byte range of `path` (raw.bin), gathered;
    `in_order`: a batch of k samples reads samples [j, j + k) instead, j its first index (about the same
    bytes per epoch)."""
    n = len(ds)
    lengths = np.full(n, 3 * 64 * 64 + 8, dtype=np.int64)
    lengths += ds.lengths("jpeg") + 4 * ds.lengths("tokens")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    raw = np.frombuffer(mapped, dtype=np.uint8)
    if len(raw) != int(lengths.sum()):
        raise ValueError(f"raw.bin holds {len(raw)} bytes, the samples {int(lengths.sum())}")
    if in_order:
        def consecutive(idx: np.ndarray) -> object:
            j = min(int(idx[0]), n - len(idx))
            return gather_ranges(raw, starts[j : j + len(idx)], lengths[j : j + len(idx)])

        return consecutive
    return lambda idx: gather_ranges(raw, starts[idx], lengths[idx])


def _ms(seconds: list[float]) -> str:
    return f"{1e3 * float(np.median(seconds)):.2f} ({1e3 * min(seconds):.2f}-{1e3 * max(seconds):.2f})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="192MiB", help="embedded default size (default 192MiB, as fastload bench)")
    ap.add_argument("--epochs", type=int, default=8, help="epochs per reader; 2.. are timed (default 8)")
    ap.add_argument("--opens", type=int, default=15, help="fresh opens timed for the first batch (default 15)")
    ap.add_argument("--loader-epochs", type=int, default=5, help="epochs per loader row, 0 workers (default 5)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        data = build(root, size=parse_size(args.size), backends=("lmdb",))
        _read_whole(root)
        fl, lm = open_dataset(data.fastload), LMDBDataset(data.lmdb)
        n = len(fl)
        print(f"embedded default: {n} samples, {data.nbytes / 2**20:.0f} MiB of payload, batch {BATCH}; "
              f"load average {os.getloadavg()[0]:.2f}")
        readers = {
            "fastload": fl.get_batch,
            "LMDB in place, learnt spans": lm.get_batch,
            "raw: one range per sample": _raw_reader(data.raw.path, fl),
            "raw: the same, in file order": _raw_reader(data.raw.path, fl, in_order=True),
        }
        rng = np.random.default_rng(0)
        times: dict[str, list[float]] = {name: [] for name in readers}
        for epoch in range(1, args.epochs + 1):
            order = rng.permutation(n)
            names = list(readers)
            for name in names[epoch % len(names) :] + names[: epoch % len(names)]:  # each reader first in turn
                t = _epoch(readers[name], order)
                if epoch > 1:
                    times[name].append(t)
        lmdb = np.array(times["LMDB in place, learnt spans"])
        print(f"CPU ms per shuffled epoch, epochs 2-{args.epochs} (median, min-max); "
              f"LMDB / row, paired by epoch (median, min-max)")
        for name, ts in times.items():
            ratio = lmdb / np.array(ts)
            print(f"  {name:30s} {_ms(ts):>20s}  {float(np.median(ratio)):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")
        print(f"first batch after an open, CPU ms, median (min-max) of {args.opens} fresh opens")
        openers: dict[str, Callable[[], Any]] = {
            "fastload": lambda: open_dataset(data.fastload),
            "LMDB": lambda: LMDBDataset(data.lmdb),
        }
        for name, opener in openers.items():
            opener().get_batch(np.arange(1))  # the code paths warm
            opens, firsts = [], []
            for k in range(args.opens):
                t0 = time.thread_time()
                ds = opener()
                t1 = time.thread_time()
                ds.get_batch(np.random.default_rng(k).permutation(n)[:BATCH])
                opens.append(t1 - t0)
                firsts.append(time.thread_time() - t1)
                close = getattr(ds, "close", None)
                if close is not None:
                    close()
            print(f"  {name:9s} open {_ms(opens)}, first batch {_ms(firsts)}")
        _first_batch_steps(data.fastload, n, args.opens)
        if args.loader_epochs:
            _loader_rows(fl, args.loader_epochs)
        fl.close()


def _loader_rows(ds: Any, epochs: int) -> None:
    """CPU ms per shuffled epoch of `fastload bench`'s loaders with 0 workers, interleaved epoch by epoch."""
    kinds = {"fastload (batch views)": "fastload-views", "torch, __getitems__": "torch-batched", "torch": "torch"}
    loaders = {
        name: make_loader(kind, ds, batch_size=BATCH, num_workers=0, device=torch.device("cpu"), seed=0)
        for name, kind in kinds.items()
    }
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for epoch in range(epochs + 1):
        for name, loader in loaders.items():
            t0 = time.thread_time()
            for _ in loader:
                pass
            if epoch:  # the first epoch warms the code paths
                times[name].append(time.thread_time() - t0)
    best_torch = min(float(np.median(times[name])) for name in loaders if name != "fastload (batch views)")
    print(f"loaders, 0 workers: CPU ms per shuffled epoch, median (min-max) of {epochs}; best torch row / row")
    for name, ts in times.items():
        print(f"  {name:24s} {_ms(ts):>22s}  {best_torch / float(np.median(ts)):.2f}")


def _first_batch_steps(path: str, n: int, opens: int) -> None:
    """Where a fresh fastload open's first batch goes, step by step through the public API, and the
    minor page faults of its reads (fresh mappings), medians over `opens` opens."""
    steps: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}

    def mark(name: str, t0: float, f0: int) -> tuple[float, int]:
        t, f = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        steps.setdefault(name, []).append(t - t0)
        faults.setdefault(name, []).append(f - f0)
        return t, f

    for k in range(opens):
        rng = np.random.default_rng(k)
        first, second = rng.permutation(n)[:BATCH], rng.permutation(n)[:BATCH]
        t, f = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        ds = open_dataset(path)
        t, f = mark("open (manifest, meta.bin)", t, f)
        for shard in range(ds.num_shards):
            ds.shard(shard)
        t, f = mark(f"map and check its {ds.num_shards} shards", t, f)
        ds.spliced_columns()
        t, f = mark("splice the columns, resident ones read", t, f)
        ds.get_batch(first)
        t, f = mark("first batch: its reads", t, f)
        ds.get_batch(second)
        mark("another batch, for comparison", t, f)
        ds.close()
    print("  fastload, step by step (median CPU ms, median minor page faults):")
    for name, ts in steps.items():
        print(f"    {name:40s} {1e3 * float(np.median(ts)):6.2f}  {float(np.median(faults[name])):5.0f}")


if __name__ == "__main__":
    main()
