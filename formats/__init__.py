"""fastload's on-disk formats: the sharded fastload format (spec: FORMAT.md), and LMDB/HDF5 readers.

Installed as `fastload.formats`.
"""

from __future__ import annotations

from typing import Any

from .columns import Block
from .errors import ChecksumError, FormatError, SchemaError
from .manifest import Manifest
from .ragged import Ragged
from .reader import FastloadDataset
from .schema import Field, Schema
from .shapes import ShapedBatch
from .storage import LocalStorage, Storage
from .units import parse_size
from .writer import BlockSource, WriteInterrupted, write

__all__ = [
    "Block",
    "BlockSource",
    "ChecksumError",
    "FastloadDataset",
    "Field",
    "FormatError",
    "HDF5Dataset",
    "LMDBDataset",
    "LocalStorage",
    "Manifest",
    "Ragged",
    "Schema",
    "SchemaError",
    "ShapedBatch",
    "Storage",
    "WriteInterrupted",
    "parse_size",
    "read_ray",
    "write",
    "write_ray",
]


def __getattr__(name: str) -> Any:
    # LMDB and HDF5 readers import their libraries only when asked for.
    if name == "LMDBDataset":
        from .lmdb_dataset import LMDBDataset

        return LMDBDataset
    if name == "HDF5Dataset":
        from .hdf5_dataset import HDF5Dataset

        return HDF5Dataset
    if name in ("write_ray", "read_ray"):  # Ray Data is imported only when these are used (fastload[ray])
        from . import ray_io

        return getattr(ray_io, name)
    raise AttributeError(f"module 'fastload.formats' has no attribute {name!r}")
