"""Format benchmark: conversion and batched reads, each against its raw limit measured in the same run.

    python -m bench.formats            # 200k x 3 KiB records, ~1-2 minutes
    python -m bench.formats --quick    # 20k records, seconds

Rows:
- conversion MB/s vs raw sequential write bandwidth (the same bytes written and fsynced to one file);
- fastload batched random read (batch 256, shuffled, warm page cache) vs the raw gather of the
  same bytes in one flat `np.memmap`: the fastest of fancy indexing (`raw[idx]`), `np.take` and
  the C extension's row copy (`formats.rows.gather_rows`) (the limit); both in the caller's order
  and with the batch's indices sorted; for the shuffled order also the same dataset with its
  columns spliced page-aligned only, and not spliced at all;
- LMDB: batched `get_batch` vs per-record `txn.get`; HDF5 contiguous and chunked: `get_batch`
  vs per-record `ds[i]`.
Throughputs are best-of-N passes (CPU time of this process, robust to other load on the machine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np

from fastload.formats import (
    Block,
    BlockSource,
    FastloadDataset,
    Field,
    HDF5Dataset,
    LMDBDataset,
    Schema,
    spliced,
    write,
)
from fastload.formats.rows import gather_rows

__all__ = ["main"]

RECORD = 3072
BATCH = 256


def _rate(fn: Callable[[np.ndarray], object], batches: list[np.ndarray], repeats: int) -> float:
    """Best records/s over `repeats` passes (process CPU time: the work itself, not the neighbours')."""
    best = 0.0
    n = sum(len(b) for b in batches)
    for _ in range(repeats):
        t0 = time.process_time()
        for b in batches:
            fn(b)
        best = max(best, n / max(time.process_time() - t0, 1e-9))
    return best


def _interleaved(fns: list[Callable[[np.ndarray], object]], batches: list[np.ndarray], repeats: int) -> list[float]:
    """Best records/s of each function, passes interleaved so that load from neighbours hits all alike."""
    best = [0.0] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = max(best[i], _rate(fn, batches, 1))
    return best


def _variants(path: str) -> tuple[FastloadDataset, FastloadDataset]:
    """The same dataset read two older ways, to show what each step of the spliced read buys:
    columns spliced page-aligned (not congruent to file offsets modulo 2 MiB), and no splice."""
    paged = FastloadDataset(path)
    huge_limit = spliced.HUGE_RESERVE_LIMIT
    spliced.HUGE_RESERVE_LIMIT = 0
    try:
        paged._spliced_columns()
    finally:
        spliced.HUGE_RESERVE_LIMIT = huge_limit
    by_shard = FastloadDataset(path)
    by_shard._spliced = {}  # as if splicing were unavailable: every large column gathered per shard
    return paged, by_shard


def _raw_write_mbps(path: str, data: np.ndarray) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for s in range(0, len(data), 8192):
            fh.write(memoryview(data[s : s + 8192]).cast("B"))
        fh.flush()
        os.fsync(fh.fileno())
    return data.nbytes / 1e6 / (time.perf_counter() - t0)


def _blocks(data: np.ndarray) -> Callable[[int], Iterator[Block]]:
    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, len(data), 8192):
            yield Block(min(s + 8192, len(data)) - s, {"x": data[s : s + 8192]})

    return blocks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--kv-records", type=int, default=50_000, help="records for the LMDB/HDF5 rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.kv_records, args.repeats = 20_000, 10_000, 2

    root = tempfile.mkdtemp(prefix="fastload-bench-formats-", dir=args.dir)
    rows: list[tuple[str, str, str]] = []
    try:
        rng = np.random.default_rng(0)
        data = rng.integers(0, 255, (args.records, RECORD), dtype=np.uint8)
        schema = Schema((Field("x", "ndarray", np.uint8, (RECORD,)),))

        raw_mbps = _raw_write_mbps(os.path.join(root, "raw.bin"), data)
        t0 = time.perf_counter()
        write(BlockSource(schema, len(data), _blocks(data)), os.path.join(root, "ds"), progress=False)
        conv_mbps = data.nbytes / 1e6 / (time.perf_counter() - t0)
        rows.append(
            (
                "convert (write + xxh3 + fsync)",
                f"{conv_mbps:,.0f} MB/s",
                f"{conv_mbps / raw_mbps:.0%} of raw write {raw_mbps:,.0f} MB/s",
            )
        )

        raw = np.memmap(os.path.join(root, "raw.bin"), dtype=np.uint8, mode="r", shape=data.shape)
        ds = FastloadDataset(os.path.join(root, "ds"))
        perm = rng.permutation(args.records)
        batches = [perm[s : s + BATCH] for s in range(0, args.records, BATCH)]
        sorted_batches = [np.sort(b) for b in batches]
        for b in batches[:50]:
            assert np.array_equal(ds.get_batch(b)["x"], raw[b])
        _rate(lambda b: raw[b], batches, 1)  # warm the page cache and mappings
        _rate(ds.get_batch, batches, 1)
        fancy, take = (lambda b: raw[b]), (lambda b: raw.take(b, axis=0))
        c_rows = lambda b: gather_rows(raw, b)  # noqa: E731 - the C row copy fastload's own gathers use
        paged, by_shard = _variants(os.path.join(root, "ds"))
        raw_fancy, raw_take, raw_c, fl_rate, paged_rate, by_shard_rate = _interleaved(
            [fancy, take, c_rows, ds.get_batch, paged.get_batch, by_shard.get_batch], batches, args.repeats
        )
        raw_rate = max(raw_fancy, raw_take, raw_c)
        raw_sorted_fancy, raw_sorted_take, raw_sorted_c, fl_sorted = _interleaved(
            [fancy, take, c_rows, ds.get_batch], sorted_batches, args.repeats
        )
        raw_sorted = max(raw_sorted_fancy, raw_sorted_take, raw_sorted_c)
        rows.append(("raw np.memmap raw[idx], shuffled", f"{raw_fancy / 1e6:.2f} M rec/s", ""))
        rows.append(("raw np.memmap take(idx), shuffled", f"{raw_take / 1e6:.2f} M rec/s", ""))
        rows.append(("raw np.memmap gather_rows(idx) (C), shuffled", f"{raw_c / 1e6:.2f} M rec/s", ""))
        rows.append(
            (
                "fastload get_batch, shuffled",
                f"{fl_rate / 1e6:.2f} M rec/s",
                f"{fl_rate / raw_rate:.0%} of raw (faster)",
            )
        )
        for name, rate in (
            ("  same, splice placed page-aligned only", paged_rate),
            ("  same, gathered shard by shard (no splice)", by_shard_rate),
        ):
            rows.append((name, f"{rate / 1e6:.2f} M rec/s", f"{rate / raw_rate:.0%} of raw (faster)"))
        rows.append(("raw np.memmap gather, sorted batch", f"{raw_sorted / 1e6:.2f} M rec/s", "fastest of the three"))
        rows.append(
            (
                "fastload get_batch, sorted batch",
                f"{fl_sorted / 1e6:.2f} M rec/s",
                f"{fl_sorted / raw_sorted:.0%} of raw",
            )
        )

        n = args.kv_records
        kv_perm = rng.permutation(n)
        kv_batches = [kv_perm[s : s + BATCH] for s in range(0, n, BATCH)]  # whole batches over the first n
        _lmdb_rows(root, data[:n], kv_batches, args.repeats, rows)
        _hdf5_rows(root, data[:n], kv_batches, args.repeats, rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"\nfastload format benchmark: {args.records:,} records of {RECORD} B, batch {BATCH}, warm page cache\n")
    print(f"{'path':<{width}}  {'throughput':>16}  vs baseline")
    for name, rate, ratio in rows:
        print(f"{name:<{width}}  {rate:>16}  {ratio}")


def _lmdb_rows(root: str, data: np.ndarray, batches: list[np.ndarray], repeats: int, rows: list) -> None:
    import lmdb

    path = os.path.join(root, "db")
    env = lmdb.open(path, map_size=data.nbytes * 2 + (64 << 20), writemap=True, sync=False)
    with env.begin(write=True) as txn:
        for i in range(len(data)):
            txn.put(f"{i:09d}".encode(), data[i].tobytes())
    env.sync()
    env.close()
    db = LMDBDataset(path)
    keys = db.keys()

    def naive(b: np.ndarray, db: LMDBDataset = db) -> list[bytes]:
        with db._environment().begin() as txn:  # the dataset's own environment (readahead off)
            return [txn.get(keys[i]) for i in b.tolist()]

    for b in batches[:20]:
        assert db.get_batch(b)["value"].to_list() == naive(b)
    first = _rate(db.get_batch, batches, 1)  # the first pass looks every key up and learns its value's place
    naive_rate, batched = _interleaved([naive, db.get_batch], batches, repeats)
    rows.append(("LMDB per-record txn.get", f"{naive_rate / 1e6:.2f} M rec/s", "baseline"))
    rows.append(("LMDB get_batch, first pass", f"{first / 1e6:.2f} M rec/s", f"{first / naive_rate:.1f}x per-record"))
    rows.append(("LMDB get_batch", f"{batched / 1e6:.2f} M rec/s", f"{batched / naive_rate:.1f}x per-record"))
    _lmdb_cold_rows(db, naive, batches, repeats, rows)


def _lmdb_cold_rows(db: LMDBDataset, naive: Callable[..., object], batches: list[np.ndarray],
                    repeats: int, rows: list) -> None:
    """One pass over `batches` after the data file left the page cache (wall time, median of the
    interleaved rounds): per-record txn.get, and get_batch with the value places learnt before
    (carried by pickling, as a DataLoader worker gets the dataset)."""
    import pickle

    from fastload.benchmark import evict, release, resident_fraction
    from fastload.formats.writer import fsync_path

    learnt = pickle.dumps(db)
    files = [os.path.join(db.path, "data.mdb")]
    fsync_path(files[0])  # written pages must be clean to be evicted
    n = sum(len(b) for b in batches)
    rates: dict[str, list[float]] = {"naive": [], "batched": []}
    for _ in range(repeats):
        for name in rates:
            release(db)
            evict(files)
            if (resident_fraction(files) or 0.0) > 0.1:
                return  # eviction did not work here: no cold figure
            db = pickle.loads(learnt)
            read = partial(naive, db=db) if name == "naive" else db.get_batch
            t0 = time.perf_counter()
            for b in batches:
                read(b)
            rates[name].append(n / (time.perf_counter() - t0))
    release(db)
    cold_naive, cold_batched = (float(np.median(r)) for r in rates.values())
    rows.append(("LMDB per-record txn.get, cold", f"{cold_naive / 1e6:.3f} M rec/s", "baseline"))
    rows.append(("LMDB get_batch, cold (places learnt)", f"{cold_batched / 1e6:.3f} M rec/s",
                 f"{cold_batched / cold_naive:.1f}x per-record"))


def _hdf5_rows(root: str, data: np.ndarray, batches: list[np.ndarray], repeats: int, rows: list) -> None:
    import h5py

    limit = 0.0  # the same rows gathered from a flat np.memmap of the contiguous copy's bytes
    for layout, chunks in (("contiguous", None), ("chunked 256 rows", (256, RECORD))):
        path = os.path.join(root, f"{layout.split()[0]}.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=data, chunks=chunks)
        ds = HDF5Dataset(path)
        h5 = h5py.File(path, "r")["x"]
        if chunks is None:
            flat = np.memmap(path, dtype=data.dtype, mode="r", offset=h5.id.get_offset(), shape=data.shape)
            limit, batched = _interleaved([lambda b, flat=flat: flat.take(b, axis=0), ds.get_batch], batches, repeats)
            rows.append(("HDF5 limit: flat np.memmap take of the same rows", f"{limit / 1e6:.2f} M rec/s", ""))
        else:
            batched = _rate(ds.get_batch, batches, repeats)
        few = batches[: max(1, len(batches) // 10)]  # per-record h5py reads are slow: time a tenth
        naive_rate = _rate(lambda b, h5=h5: [h5[i] for i in b.tolist()], few, 1)
        rows.append((f"HDF5 {layout}, per-record ds[i]", f"{naive_rate / 1e6:.3f} M rec/s", "baseline"))
        note = f"{batched / naive_rate:.1f}x per-record, {batched / limit:.0%} of the flat memmap take"
        rows.append((f"HDF5 {layout}, get_batch", f"{batched / 1e6:.2f} M rec/s", note))


if __name__ == "__main__":
    main()
