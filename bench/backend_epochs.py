"""Where a `fastload bench` backend row's time goes: open, first epoch, second epoch, page faults.

    python -m bench.backend_epochs              # the embedded default (192 MiB), 7 rounds
    python -m bench.backend_epochs --size 64MiB --rounds 3
    python -m bench.backend_epochs --cold       # fastload with and without huge-page advice: cold, then warm

Each backend row of `fastload bench` opens the dataset afresh and reads one shuffled epoch (the
embedded default's epoch is ~30 batches). This reads, per round and per backend, in turn: open,
epoch 1 (fresh mappings: every page is faulted in once), epoch 2 on the same open dataset (steady
state), with CPU time of this process (robust to neighbours' load on a shared machine) and minor
page faults for each phase; medians over the rounds. Backends: fastload (default verification
and `verify="none"`), LMDB in place, and the raw random gather of the same byte ranges from a flat
file (the `fastload bench` limit). The page cache is warm throughout: filled by a sequential read
of the files, or (`--warm-by epoch`) as `fastload bench`'s warm rows find it after its cold rows.

`--cold`: fastload only, with and without huge-page advice in turn, each round an epoch from an
evicted cache then a warm one (as `fastload bench` runs its rows), wall and CPU time. (The folios
a cold epoch leaves in the page cache serve every later mapping, so the two are compared only
from an evicted cache.)
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fastload.benchmark import RawRanges, build, dataset_files, evict, release, sequential_read
from fastload.formats.ragged import gather_ranges
from fastload.formats.units import parse_size

__all__ = ["main"]

BATCH = 256


class _Raw:
    """The raw gather limit as a dataset: each sample's payload bytes from one flat file."""

    def __init__(self, raw: RawRanges) -> None:
        self.raw, self.file = raw, np.memmap(raw.path, dtype=np.uint8, mode="r")

    def __len__(self) -> int:
        return len(self.raw.starts)

    def get_batch(self, idx: np.ndarray) -> np.ndarray:
        return gather_ranges(self.file, self.raw.starts.take(idx), self.raw.lengths.take(idx))[0]


def _small_pages(ds: Any) -> Any:
    """The dataset mapped without huge-page advice (what a dataset too large for memory gets)."""
    ds._huge = False
    return ds


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _round(open_fn: Callable[[], Any], seed: int) -> list[float]:
    """[open ms, epoch 1 ms, epoch 1 faults, epoch 2 ms, epoch 2 faults] (CPU time)."""
    c0, _ = _usage()
    ds = open_fn()
    c1, _ = _usage()
    out = [1e3 * (c1 - c0)]
    for epoch in (1, 2):
        order = np.random.default_rng(seed * 10 + epoch).permutation(len(ds))
        a, fa = _usage()
        for s in range(0, len(order), BATCH):
            ds.get_batch(order[s : s + BATCH])
        b, fb = _usage()
        out += [1e3 * (b - a), fb - fa]
    release(ds)
    return out


def _cold_rounds(path: str, rounds: int) -> None:
    """Per round, advice on and off in turn: evict, open + epoch (cold), open + epoch (warm)."""
    from fastload.dataset import open_dataset

    files = dataset_files(path)
    out: dict[str, list[list[float]]] = {"huge-page advice": [], "4K pages": []}
    for k in range(rounds):
        for name, runs in out.items():
            evict(files)
            row = []
            for _ in ("cold", "warm"):
                w0, (c0, _f) = time.perf_counter(), _usage()
                ds = open_dataset(path) if name == "huge-page advice" else _small_pages(open_dataset(path))
                order = np.random.default_rng(k).permutation(len(ds))
                for s in range(0, len(order), BATCH):
                    ds.get_batch(order[s : s + BATCH])
                row += [len(order) / (time.perf_counter() - w0), 1e3 * (_usage()[0] - c0)]
                release(ds)
            runs.append(row)
    print(f"\nfastload, {rounds} rounds (medians): cold epoch then warm epoch, each from a fresh open\n")
    print(f"{'':>17}  {'cold samples/s':>15}  {'cold CPU ms':>12}  {'warm samples/s':>15}  {'warm CPU ms':>12}")
    for name, runs in out.items():
        med = np.median(np.array(runs), axis=0)
        print(f"{name:>17}  {med[0]:>15,.0f}  {med[1]:>12.1f}  {med[2]:>15,.0f}  {med[3]:>12.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=192 << 20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--cold", action="store_true", help="fastload cold then warm, huge-page advice on/off")
    parser.add_argument("--warm-by", choices=("sequential", "epoch"), default="sequential",
                        help="fill the page cache by reading the files front to back (default), or as "
                        "`fastload bench` leaves it: by one shuffled epoch of each backend from an evicted cache")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fastload-bench-epochs-", dir=args.dir)
    try:
        syn = build(root, size=args.size, backends=("lmdb",))
        from fastload.dataset import open_dataset
        from fastload.formats import LMDBDataset

        if args.cold:
            _cold_rounds(syn.fastload, args.rounds)
            return
        assert syn.lmdb is not None
        lmdb_path = syn.lmdb
        opens: dict[str, Callable[[], Any]] = {
            "fastload": lambda: open_dataset(syn.fastload),
            'fastload verify="none"': lambda: open_dataset(syn.fastload, verify="none"),
            "LMDB in place": lambda: LMDBDataset(lmdb_path),
            "raw random gather": lambda: _Raw(syn.raw),
        }
        if args.warm_by == "sequential":
            sequential_read(dataset_files(root))
        else:
            evict(dataset_files(root))
            for fn in opens.values():
                _round(fn, args.rounds)
        rows: dict[str, list[list[float]]] = {name: [] for name in opens}
        for k in range(args.rounds):  # interleaved: load from neighbours hits every backend alike
            for name, fn in opens.items():
                rows[name].append(_round(fn, k))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = syn.nbytes / 1e6
    print(f"\n{syn.num_samples:,} samples, {mb:,.0f} MB of payload, batch {BATCH}, {args.rounds} rounds "
          "(medians; CPU ms of this process)\n")
    head = ["backend", "open ms", "epoch 1 ms", "epoch 1 faults", "epoch 2 ms", "epoch 2 faults", "open+epoch 1 GB/s"]
    print("  ".join(f"{h:>17}" for h in head))
    for name, runs in rows.items():
        med = np.median(np.array(runs), axis=0)
        rate = mb / 1e3 / max((med[0] + med[1]) / 1e3, 1e-9)
        cells = [name, f"{med[0]:.1f}", f"{med[1]:.1f}", f"{med[2]:,.0f}", f"{med[3]:.1f}", f"{med[4]:,.0f}",
                 f"{rate:.2f}"]
        print("  ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
