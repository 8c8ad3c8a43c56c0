"""`open_dataset`: one entry point for local directories and fsspec URLs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastload.formats import FastloadDataset
from fastload.formats.resume import incomplete_conversion
from fastload.formats.storage import is_url

if TYPE_CHECKING:
    from fastload.formats.arrow_dataset import LanceDataset, ParquetDataset

__all__ = ["open_dataset", "read_ray"]


# Reading in place, where a class exists; every kind converts with `fastload convert SRC OUT`.
_IN_PLACE = {".h5": "fastload.HDF5Dataset", ".hdf5": "fastload.HDF5Dataset", ".mdb": "fastload.LMDBDataset"}
# fsspec protocols whose package is an extra of fastload
_EXTRAS = {"s3": "s3", "s3a": "s3"}


def _check_local(path: str) -> None:
    """A clear error for a local path that is not a fastload dataset directory (a file, an LMDB, ...)."""
    if os.path.isfile(path) and os.path.basename(path) == "index.json":
        raise FileNotFoundError(f"{path!r} is a dataset's manifest; open its directory: {os.path.dirname(path)!r}")
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        reader = _IN_PLACE.get(ext)
        read = f"read it in place with {reader}({path!r}), or " if reader else ""
        raise FileNotFoundError(
            f"{path!r} is a file, not a fastload dataset directory; {read}convert it first: "
            f"fastload convert {path} OUT_DIR"
        )
    incomplete = incomplete_conversion(path) if os.path.isdir(path) else None
    if incomplete is not None:
        raise FileNotFoundError(f"not a dataset yet: {incomplete}")
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "data.mdb")):
        raise FileNotFoundError(
            f"{path!r} is an LMDB environment, not a fastload dataset; read it in place with "
            f"fastload.LMDBDataset({path!r}), or convert it: fastload convert {path} OUT_DIR"
        )


def _open_in_place(
    kind: str, path: str, verify: str | None
) -> ParquetDataset | LanceDataset:
    if verify not in (None, "auto"):
        raise ValueError(
            f"{path!r} is read in place ({kind}): it has no fastload block checksums to verify, only the "
            "checks its own format makes (see docs/migrate.md); convert it for verified reads"
        )
    from fastload.formats.arrow_dataset import LanceDataset, ParquetDataset

    return ParquetDataset(path) if kind == "parquet" else LanceDataset(path)


def _check_protocol(url: str) -> None:
    """Raise naming the package (and fastload's extra) when the URL's fsspec protocol is not installed.

    The backend's packages are looked up, not imported: s3fs and its async stack cost about 200
    modules, which a read through obstore never needs (process workers import them on fallback).
    """
    import fsspec
    from fsspec.registry import known_implementations, registry

    protocol = url.split("://", 1)[0]
    known = known_implementations.get(protocol)
    if protocol in registry or (known is not None and _backend_present(known["class"], protocol)):
        return
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'fastload[{extra}]'" if extra else str(exc)
        raise ImportError(f"reading {url!r} needs the fsspec backend for {protocol}://: {hint}") from exc
    except ValueError as exc:
        raise ValueError(f"{url!r}: unknown storage protocol {protocol!r} ({exc})") from exc


# fsspec's own implementations whose third-party packages its registry does not name
_BACKEND_NEEDS = {"http": ("aiohttp",), "https": ("aiohttp",)}


def _backend_present(class_path: str, protocol: str) -> bool:
    """Whether the modules an fsspec backend imports are installed, found without importing them."""
    import importlib.util

    modules = (class_path.split(".", 1)[0], *_BACKEND_NEEDS.get(protocol, ()))
    return all(importlib.util.find_spec(name) is not None for name in modules)


def open_dataset(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | str | None = None,
    verify: str | None = None,
    max_open_shards: int | None = None,
    transport: str = "auto",
) -> FastloadDataset | ParquetDataset | LanceDataset:
    """Open a fastload dataset from a local directory (zero-copy mmap) or any fsspec URL (through a shard cache).

    A Parquet file, a folder of Parquet files or a Lance dataset is read in place instead
    (`ParquetDataset`, `LanceDataset`: batches through `get_batch`, no fastload checksums), so a
    Loader can run on it before it is converted.

    `verify`: "auto" (default: every byte read is checked against its block checksum once per
    process), "full" (also every shard whole when opened) or "none" (structure only); see
    `FastloadDataset`.
    """
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if not is_url(text):
        from fastload.formats.arrow_dataset import in_place_kind

        kind = in_place_kind(text)
        if kind is not None:
            return _open_in_place(kind, text, verify)
        _check_local(text)
        return FastloadDataset(
            text, verify=verify, max_open_shards=max_open_shards or 64
        )
    _check_protocol(text)
    from fastload.remote.storage import RemoteStorage

    # The remote storage sizes the number of pinned shards from the cache budget when not given.
    storage = RemoteStorage(
        text,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        max_open_shards=max_open_shards,
        transport=transport,
    )
    # the storage's `max_open_shards` follows its share of a cache shared with other readers
    return FastloadDataset(
        storage=storage, verify=verify, max_open_shards=max_open_shards or 64
    )


def read_ray(
    path_or_url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    override_num_blocks: int | None = None,
) -> Any:
    """A fastload dataset (directory or fsspec URL) as a `ray.data.Dataset` of its samples, in dataset order.

    Each read task opens the dataset with `open_dataset` (a URL through the shard cache), reads a
    run of whole shards and yields one block per shard; `override_num_blocks` sets the number of
    tasks (at most one per shard). Needs `fastload[ray]`.
    """
    import ray.data

    from fastload.formats.ray_io import FastloadDatasource

    return ray.data.read_datasource(
        FastloadDatasource(os.fspath(path_or_url), opener=open_dataset, storage_options=storage_options),
        override_num_blocks=override_num_blocks,
    )
