"""Whole-dataset integrity check: every checksum, every header, every offsets table."""

from __future__ import annotations

import os

from .errors import FormatError
from .manifest import MANIFEST_NAME, Manifest
from .shard import ShardReader, file_xxh3
from .storage import LocalStorage

__all__ = ["verify_dataset"]


def verify_dataset(root: str | os.PathLike[str]) -> list[str]:
    """Return one message per problem found (empty when the dataset is intact)."""
    storage = LocalStorage(root)
    where = os.path.join(storage.root, MANIFEST_NAME)
    try:
        manifest = Manifest.loads(storage.read_small(MANIFEST_NAME), where=where)
    except FormatError as exc:
        return [str(exc)]
    problems = []
    try:
        manifest.meta_arrays(
            storage.read_small(manifest.meta_file), where=os.path.join(storage.root, manifest.meta_file)
        )
    except FormatError as exc:
        problems.append(str(exc))
    for info in manifest.shards:
        try:
            path = storage.path(info.file)
            if not os.path.exists(path):
                raise FormatError(f"{path}: shard file is missing")
            if os.path.getsize(path) != info.bytes:
                raise FormatError(f"{path}: {os.path.getsize(path)} bytes, manifest says {info.bytes} (truncated?)")
            if file_xxh3(path) != info.xxh3:
                raise FormatError(f"{path}: checksum mismatch (corrupted shard)")
            ShardReader(path, manifest.schema, num_samples=info.num_samples, nbytes=info.bytes).close()
        except FormatError as exc:
            problems.append(str(exc))
    return problems
