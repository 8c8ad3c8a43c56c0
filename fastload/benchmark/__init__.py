"""The engine behind `fastload bench`: how fast is the storage, each way of reading it, and each loader.

One run measures, on the same data (a dataset you name, or the embedded synthetic default):

1. raw limits: sequential read of the dataset files, cold (pages dropped with
   ``posix_fadvise(DONTNEED)``; `mincore` reports how much stayed resident) and warm; memcpy
   bandwidth; single-core JPEG decode rate x cores;
2. backends: one thread reading shuffled batches with `get_batch` (fastload, LMDB, HDF5; an fsspec
   URL: epoch 1 through an empty shard cache, epoch 2 from it), cold and warm;
3. loaders: `fastload.Loader` vs `torch.utils.data.DataLoader` (per-sample `__getitem__`, and
   ``torch-batched`` with `__getitems__`) for each worker count, best count marked;
4. with ``--step-ms``: a simulated training step per batch and the resulting data stall.

Every figure is repeated ``--repeats`` times and reported as ``{"min", "median", "max", "values"}``
(a *stat* below). Rates are per second; bytes are payload bytes (arrays, bytes/str, Ragged values).

JSON schema (``schema_version`` 1)::

    schema_version: 1
    created: ISO-8601 local time
    wall_s: total seconds
    machine: {cores, platform, python, torch, numpy, cuda: device name | null}
    config: {dataset: path | URL | null, embedded: bool, backends: [str], loaders: [str],
             batch_size, workers: [int], seconds, repeats, step_ms: float | null, device, size, seed}
    dataset: {description, kind: fastload|lmdb|hdf5|remote, samples, bytes (files on disk),
              files, mean_sample_bytes}
    limits:
      files, bytes
      read_cold: {bytes_per_s: stat, method, resident_after_evict: fraction | null, warning?: str}
      read_warm: {bytes_per_s: stat}
      memcpy: {bytes_per_s: stat}
      jpeg_decode: {images_per_s_per_core: stat, cores, images_per_s (ceiling), decoder, mean_jpeg_bytes}
      download?: {bytes_per_s: stat}                       # URL datasets only
    backends: [{backend: fastload|lmdb|hdf5|remote, cache: cold|warm, samples_per_s: stat,
                bytes_per_s: stat, pct_of_limit: fraction | null, limit: read_cold|read_warm|download,
                resident_after_evict: fraction | null, samples_read}]
    loaders: [{loader: fastload|fastload-views|torch|torch-batched, num_workers, pin_memory, samples_per_s: stat,
               bytes_per_s: stat, pct_of_limit (of read_warm),
               vs_torch (samples/s / the best row of torch and torch-batched),
               first_batch_ms: stat, p50_ms: stat, p99_ms: stat (consumer wait per batch),
               cpu_percent: stat (process tree CPU / wall, 100 = one core), peak_rss_bytes (process tree),
               batches, best: bool, stats: loader.stats() | null}]
    step: null | {step_ms, kind: sleep|matmul, device, threshold, rows: [{loader, num_workers,
               data_stall: stat, input_bound: bool, bottleneck: stage | "compute" | null,
               stage_s: {read_s, ...} | null, step_wall_ms: stat, samples_per_s: stat,
               best: bool (lowest stall of its loader)}]}         # one row per loader x worker count
    summary: {best: {loader: {num_workers, samples_per_s}}, fastload_vs_torch? (the best fastload row,
              either kind, / the best torch row), fastload_row? and torch_row? ({loader, num_workers}: the
              rows that ratio used), fastload_pct_of_read_warm?, lines: [str]}

Samples/s and MB/s of loaders are steady-state (first batch received to last); the time to the
first batch is reported separately. The data stall is the consumer's wait after the first batch
over the wall time after it; input-bound means a stall above `INPUT_BOUND_STALL` (10%).

The scripts under `bench/` (`python -m bench.NAME`) use this engine through the names exported
here: the synthetic datasets (`build`, `make_jpegs`), the raw limits (`dataset_files`, `evict`,
`sequential_read`, `resident_fraction`), one loader run (`run_loader`, `bottleneck`), the
remote measurement (`run_remote`, `format_remote`) and the peer loaders on the same server
(`run_peers`, `format_peers`).
"""

from __future__ import annotations

from fastload.benchmark.backends import release
from fastload.benchmark.cli import add_arguments, config_from_args, run_cli
from fastload.benchmark.limits import dataset_files, evict, resident_fraction, sequential_read
from fastload.benchmark.loaders import LABELS, LOADER_KINDS, TORCH_KINDS, bottleneck, run_loader
from fastload.benchmark.remote import format_remote, run_remote
from fastload.benchmark.remote_peers import format_peers, run_peers
from fastload.benchmark.runner import INPUT_BOUND_STALL, SCHEMA_VERSION, BenchConfig, run_benchmark
from fastload.benchmark.synthetic import RawRanges, Synthetic, build, make_jpegs

__all__ = [
    "INPUT_BOUND_STALL",
    "LABELS",
    "LOADER_KINDS",
    "SCHEMA_VERSION",
    "TORCH_KINDS",
    "BenchConfig",
    "RawRanges",
    "Synthetic",
    "add_arguments",
    "bottleneck",
    "build",
    "config_from_args",
    "dataset_files",
    "evict",
    "format_peers",
    "format_remote",
    "make_jpegs",
    "release",
    "resident_fraction",
    "run_benchmark",
    "run_cli",
    "run_loader",
    "run_peers",
    "run_remote",
    "sequential_read",
]
