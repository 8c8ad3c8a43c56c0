"""Backend read throughput: one thread, shuffled batches through `get_batch`, cold and warm page cache.

Each repeat opens the dataset afresh and times the open together with the reads: every backend
does its setup somewhere (LMDB lists its keys when opened, fastload maps and checks its shards on
the first batch), and a row counts all of it.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fastload.benchmark.limits import dataset_files, evict, resident_fraction
from fastload.benchmark.measure import payload_bytes

__all__ = ["Backend", "EpochRead", "measure_backend", "open_backend", "read_epoch", "release", "remote_epochs"]


@dataclass
class Backend:
    """A named way to read the data: `open()` gives a fresh dataset; `files` are what cold eviction drops."""

    name: str
    path: str
    open: Callable[[], Any]
    files: list[str] = field(default_factory=list)


@dataclass
class EpochRead:
    """One timed `read_epoch`: samples, payload bytes and batches read in `seconds` of wall time."""

    samples: int
    nbytes: int
    seconds: float
    batches: int

    @property
    def samples_per_s(self) -> float:
        """Samples read per second of wall time (0 when no time was measured)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes (`payload_bytes` of each batch) read per second (0 when no time was measured)."""
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


def open_backend(name: str, path: str) -> Backend:
    """`fastload` (a dataset directory), `lmdb` (an LMDB environment), `hdf5` (an HDF5 file), `parquet`
    (a Parquet file or folder) or `lance` (a Lance dataset), the last two read in place."""
    if name == "fastload":
        from fastload.dataset import open_dataset

        return Backend(name, path, lambda: open_dataset(path), dataset_files(path))
    if name == "lmdb":
        from fastload.formats import LMDBDataset

        return Backend(name, path, lambda: LMDBDataset(path), dataset_files(path))
    if name == "hdf5":
        from fastload.formats import HDF5Dataset

        return Backend(name, path, lambda: HDF5Dataset(path), dataset_files(path))
    if name in ("parquet", "lance"):  # read in place
        from fastload.formats import LanceDataset, ParquetDataset

        opener = ParquetDataset if name == "parquet" else LanceDataset
        return Backend(name, path, lambda: opener(path), dataset_files(path))
    raise ValueError(
        f"unknown backend {name!r}; expected fastload, lmdb, hdf5, parquet or lance (or pass a URL for remote)"
    )


def release(ds: Any) -> None:
    """Close a dataset's files and mappings so that eviction can drop their pages (an LMDB environment,
    shared per path, closes once no other reader of the path holds it)."""
    close = getattr(ds, "close", None)
    if callable(close):
        close()
    gc.collect()


def read_epoch(ds: Any, *, batch_size: int, seconds: float, seed: int = 0) -> EpochRead:
    """Read shuffled batches with `get_batch` until the epoch ends or `seconds` pass."""
    order = np.random.default_rng(seed).permutation(len(ds))
    samples = nbytes = batches = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        batch = ds.get_batch(idx)
        nbytes += payload_bytes(batch)
        samples += len(idx)
        batches += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return EpochRead(samples, nbytes, elapsed, batches)


def measure_backend(
    backend: Backend, *, cold: bool, batch_size: int, seconds: float, seed: int
) -> tuple[EpochRead, float | None]:
    """One repeat: (evict when cold), open fresh, read -> (result, resident fraction after eviction);
    the result's time includes the open."""
    resident = None
    if cold:
        evict(backend.files)
        resident = resident_fraction(backend.files)
    t0 = time.perf_counter()
    ds = backend.open()
    opened = time.perf_counter() - t0
    try:
        read = read_epoch(ds, batch_size=batch_size, seconds=max(0.0, seconds - opened), seed=seed)
        return replace(read, seconds=read.seconds + opened), resident
    finally:
        release(ds)


def remote_epochs(
    url: str, *, batch_size: int, seconds: float, seed: int, cache_root: str | None = None
) -> tuple[EpochRead, EpochRead]:
    """Epoch 1 through an empty shard cache (downloads), then epoch 2 from the filled cache."""
    from fastload.dataset import open_dataset

    cache = tempfile.mkdtemp(prefix="fastload-bench-cache-", dir=cache_root)
    try:
        ds = open_dataset(url, cache_dir=cache)
        try:
            first = read_epoch(ds, batch_size=batch_size, seconds=seconds, seed=seed)
            second = read_epoch(ds, batch_size=batch_size, seconds=seconds, seed=seed + 1)
        finally:
            release(ds)
            storage_close = getattr(getattr(ds, "storage", None), "close", None)
            if callable(storage_close):
                storage_close()
        return first, second
    finally:
        shutil.rmtree(cache, ignore_errors=True)
