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
  per sample, no format: what a row-interleaved layout could at best reach);
- the first batch after an open (`--opens` fresh opens of each, after one untimed open so the
  code paths are warm; blocks this process verified already stay verified, see formats/blocks.py).
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fastload import open_dataset
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


def _raw_reader(path: str, ds: Any) -> Callable[[np.ndarray], object]:
    """Each sample's payload (record, label, JPEG, tokens) as one byte range of `path` (raw.bin), gathered."""
    n = len(ds)
    lengths = np.full(n, 3 * 64 * 64 + 8, dtype=np.int64)
    lengths += ds.lengths("jpeg") + 4 * ds.lengths("tokens")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    raw = np.frombuffer(mapped, dtype=np.uint8)
    if len(raw) != int(lengths.sum()):
        raise ValueError(f"raw.bin holds {len(raw)} bytes, the samples {int(lengths.sum())}")
    return lambda idx: gather_ranges(raw, starts[idx], lengths[idx])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="192MiB", help="embedded default size (default 192MiB, as fastload bench)")
    ap.add_argument("--epochs", type=int, default=8, help="epochs per reader; 2.. are timed (default 8)")
    ap.add_argument("--opens", type=int, default=5, help="fresh opens timed for the first batch (default 5)")
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
        lmdb = float(np.median(times["LMDB in place, learnt spans"]))
        print(f"CPU ms per shuffled epoch, epochs 2-{args.epochs} (median, min-max); LMDB / row")
        for name, ts in times.items():
            med = float(np.median(ts))
            print(f"  {name:30s} {1e3 * med:7.2f} ({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f})  {lmdb / med:.2f}")
        print(f"first batch after an open, CPU ms (open / first batch; {args.opens} fresh opens)")
        openers: dict[str, Callable[[], Any]] = {
            "fastload": lambda: open_dataset(data.fastload),
            "LMDB": lambda: LMDBDataset(data.lmdb),
        }
        for name, opener in openers.items():
            opener().get_batch(np.arange(1))  # the code paths warm
            cells = []
            for k in range(args.opens):
                t0 = time.thread_time()
                ds = opener()
                t1 = time.thread_time()
                ds.get_batch(np.random.default_rng(k).permutation(n)[:BATCH])
                cells.append(f"{1e3 * (t1 - t0):.1f} / {1e3 * (time.thread_time() - t1):.1f}")
                close = getattr(ds, "close", None)
                if close is not None:
                    close()
            print(f"  {name:9s} " + ", ".join(cells))
        fl.close()


if __name__ == "__main__":
    main()
