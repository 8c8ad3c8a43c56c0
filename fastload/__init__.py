"""fastload: keeps GPUs fed during training.

Public API (imported lazily, so `import fastload` is cheap and never fails for a missing
optional dependency such as DALI):

- `fastload.Loader`: drop-in replacement for `torch.utils.data.DataLoader`.
- `fastload.open_dataset(path_or_url, ...)`: a fastload dataset, local (mmap) or remote (cached);
  `fastload.read_ray(path_or_url)`: the same as a `ray.data.Dataset` (`fastload[ray]`).
- `fastload.formats`: the on-disk format (`write`, readers for fastload/LMDB/HDF5).
- `fastload.TokenBudgetBatchSampler`, `fastload.TextCollate`: variable-length text batches.
- `fastload.BatchViews`: a `collate_fn` that yields each batch as its columns (`Ragged` views
  of variable fields, no per-sample Python objects; see `fastload.fetch.views`).
- `fastload.ShardWindowSampler`, `fastload.RemoteStorage`: object storage through a shard cache.
- `fastload.vision`: DALI / CPU image presets; `fastload.cuda_ops`: fused CUDA kernels.
- `fastload.RunContext`, `fastload.RunAware` (`fastload.run`): the run's facts (seed, epoch,
  rank, world size, workers) a Loader hands to the components it holds.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Loader": "fastload.loader",
    "open_dataset": "fastload.dataset",
    "read_ray": "fastload.dataset",
    "TokenBudgetBatchSampler": "fastload.order.bucketing",
    "TextCollate": "fastload.fetch.text_collate",
    "BatchViews": "fastload.fetch.views",
    "RunContext": "fastload.run",
    "RunAware": "fastload.run",
    "ShardWindowSampler": "fastload.order.shard_shuffle",
    "RemoteStorage": "fastload.remote.storage",
    "RetryPolicy": "fastload.remote.storage",
    "RemoteFetchError": "fastload.remote.storage",
    "CacheBudgetError": "fastload.remote.cache.shard_cache",
    "FastloadDataset": "fastload.formats",
    "LMDBDataset": "fastload.formats",
    "HDF5Dataset": "fastload.formats",
    "ParquetDataset": "fastload.formats",
    "LanceDataset": "fastload.formats",
    "Ragged": "fastload.formats",
    "ShapedBatch": "fastload.formats",
    "Schema": "fastload.formats",
    "Field": "fastload.formats",
    "write": "fastload.formats",
}

__all__ = ["__version__", *_EXPORTS]


_SUBMODULES = ("vision", "cuda_ops", "formats", "benchmark", "run")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fastload.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
