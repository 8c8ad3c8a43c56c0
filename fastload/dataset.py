"""`open_dataset`: one entry point for local directories and fsspec URLs."""

from __future__ import annotations

import os
from typing import Any

from fastload.formats import FastloadDataset

__all__ = ["is_url", "open_dataset"]


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...); ``file://`` counts as local."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def open_dataset(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | str | None = None,
    verify: str | None = None,
    verify_checksums: bool | None = None,
    max_open_shards: int | None = None,
) -> FastloadDataset:
    """Open a fastload dataset from a local directory (zero-copy mmap) or any fsspec URL (through a shard cache).

    `verify`: "auto" (default: every byte read is checked against its block checksum once per
    process), "full" (also every shard whole when opened) or "none" (structure only); see
    `FastloadDataset`. `verify_checksums=True`/`False` is the older spelling of "full"/"none".
    """
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if not is_url(text):
        return FastloadDataset(
            text, verify=verify, verify_checksums=verify_checksums, max_open_shards=max_open_shards or 64
        )
    from fastload.remote import RemoteStorage

    # The remote storage sizes the number of pinned shards from the cache budget when not given.
    storage = RemoteStorage(
        text,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        max_open_shards=max_open_shards,
    )
    return FastloadDataset(
        storage=storage, verify=verify, verify_checksums=verify_checksums, max_open_shards=storage.max_open_shards
    )
