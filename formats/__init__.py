"""fastload's on-disk formats: the sharded fastload format (spec: FORMAT.md), and LMDB/HDF5 readers.

Installed as `fastload.formats`. Every public name is imported on first use (PEP 562), so importing
one submodule (e.g. `fastload.formats.errors`) does not load the reader, the writer, LMDB, HDF5 or Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .arrow_dataset import LanceDataset, ParquetDataset
    from .columns import Block
    from .errors import ChecksumError, FormatError, SchemaError
    from .hdf5_dataset import HDF5Dataset
    from .lmdb_dataset import LMDBDataset
    from .manifest import Manifest
    from .ragged import Ragged
    from .ray_io import write_ray
    from .reader import FastloadDataset
    from .schema import Field, Schema
    from .shapes import ShapedBatch
    from .storage import LocalStorage, Storage
    from .units import parse_size
    from .writer import BlockSource, WriteInterrupted, write

# public name -> submodule that defines it; LMDB, HDF5 and Ray (fastload[ray]) load their
# libraries only when their names are used
_EXPORTS = {
    "Block": "columns",
    "BlockSource": "writer",
    "ChecksumError": "errors",
    "FastloadDataset": "reader",
    "Field": "schema",
    "FormatError": "errors",
    "HDF5Dataset": "hdf5_dataset",
    "LanceDataset": "arrow_dataset",
    "ParquetDataset": "arrow_dataset",
    "LMDBDataset": "lmdb_dataset",
    "LocalStorage": "storage",
    "Manifest": "manifest",
    "Ragged": "ragged",
    "Schema": "schema",
    "SchemaError": "errors",
    "ShapedBatch": "shapes",
    "Storage": "storage",
    "WriteInterrupted": "writer",
    "parse_size": "units",
    "write": "writer",
    "write_ray": "ray_io",
}

__all__ = [
    "Block",
    "BlockSource",
    "ChecksumError",
    "FastloadDataset",
    "Field",
    "FormatError",
    "HDF5Dataset",
    "LMDBDataset",
    "LanceDataset",
    "LocalStorage",
    "Manifest",
    "ParquetDataset",
    "Ragged",
    "Schema",
    "SchemaError",
    "ShapedBatch",
    "Storage",
    "WriteInterrupted",
    "parse_size",
    "write",
    "write_ray",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastload.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    if module not in ("hdf5_dataset", "lmdb_dataset", "ray_io", "arrow_dataset"):
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
