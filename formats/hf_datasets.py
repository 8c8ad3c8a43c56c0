"""Hugging Face `datasets` as a source: a `datasets.Dataset` or a `save_to_disk` directory (Arrow).

Columns map to fields by their Arrow data, not only by their declared feature, so a column
declared as a variable-length list whose rows all have the same length (what `Dataset.from_dict`
makes of a 2-D array) is a fixed `ndarray` field: numbers keep their dtype (float32[16] stays a
float32 (16,) field, int32 stays int32) and reach the model as tensors, not `Ragged`.

* numbers (`Value`, `ClassLabel`): ``scalar`` of that dtype (ClassLabel: int64)
* lists / `ArrayND` of numbers with one shape in every row: ``ndarray`` of that shape
* lists of numbers of varying length: ``varray``; nested lists (a 2-D or deeper array per row)
  whose lengths vary between rows: ``vndarray`` (``-1`` in the dimensions that vary, each row's
  shape stored with it; a row whose inner lists differ in length raises); `Value("string")`: ``string``;
  `Value("binary")`: ``bytes``; `Image`: ``image`` (the encoded bytes as stored)

Fixed columns are read as whole Arrow slices (no per-sample Python); other types raise naming
the column. Requires the `datasets` package (extra ``hf``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from .columns import Block, encode_samples
from .errors import FormatError
from .schema import VARIES, Field, Schema
from .writer import BlockSource

__all__ = ["HF_MARKERS", "hf_block_source", "is_hf_dataset", "open_hf_dir", "open_parquet"]

HF_MARKERS = ("state.json", "dataset_info.json")  # what `save_to_disk` writes beside the Arrow files
_BLOCK_ROWS = 8192


def is_hf_dataset(obj: Any) -> bool:
    """Whether `obj` is a `datasets.Dataset` (checked without importing `datasets`)."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "Dataset" for c in type(obj).__mro__)


def open_hf_dir(src: str) -> BlockSource:
    """The `save_to_disk` directory `src` as a `BlockSource` (a `DatasetDict` directory: name a split)."""
    if os.path.exists(os.path.join(src, "dataset_dict.json")):
        with open(os.path.join(src, "dataset_dict.json")) as fh:
            splits = json.load(fh).get("splits", [])
        raise FormatError(f"{src}: a DatasetDict with splits {splits}; convert one split: {src}/<split>")
    import datasets

    return hf_block_source(datasets.load_from_disk(src), where=src)


def open_parquet(src: str) -> BlockSource:
    """A Parquet file, or a folder of them (read in name order, one table), as a `BlockSource`;
    Hugging Face features stored in the files' metadata (e.g. `Image`, `ClassLabel`) are kept.
    Without the `datasets` package, the files are read through pyarrow alone (`ParquetDataset`'s
    fields: lists stay ``varray`` unless their Arrow type has a fixed size)."""
    import pyarrow.parquet as pq

    try:
        import datasets
    except ImportError:
        from .arrow_dataset import ParquetDataset, in_place_source

        return in_place_source(ParquetDataset(src))

    files = [src] if os.path.isfile(src) else sorted(
        os.path.join(src, e) for e in os.listdir(src) if e.endswith(".parquet") and not e.startswith(".")
    )
    if not files:
        raise FormatError(f"{src}: no .parquet files")
    try:
        table = pq.read_table(files if len(files) > 1 else files[0])
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise FormatError(f"{src}: cannot read as Parquet ({exc})") from exc
    return hf_block_source(datasets.Dataset(datasets.table.InMemoryTable(table)), where=src)


def _leaf_dtype(arrow_type: Any, column: str, where: str) -> np.dtype:
    import pyarrow as pa

    if pa.types.is_boolean(arrow_type) or pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return np.dtype(arrow_type.to_pandas_dtype())
    raise FormatError(f"{where}: column {column!r}: Arrow type {arrow_type} is not supported (numbers, strings, bytes)")


def _field_for(name: str, column: Any, feature: Any, where: str) -> Field:
    """The field for one Arrow column (a ChunkedArray) of the whole dataset."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if type(feature).__name__ == "Image":
        return Field(name, "image")
    if type(feature).__name__ == "ClassLabel":
        return Field(name, "scalar", np.int64)
    t = column.type
    if isinstance(t, pa.ExtensionType):  # ArrayND: lists of lists in its storage
        column = pa.chunked_array([c.storage for c in column.chunks], type=t.storage_type)
        t = column.type
    if column.null_count:
        raise FormatError(f"{where}: column {name!r} has {column.null_count} missing values (nulls)")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Field(name, "string")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return Field(name, "bytes")
    dims: list[int] = []  # per list level: its length, or VARIES where rows differ
    arr = column
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        if arr.null_count:
            raise FormatError(f"{where}: column {name!r} has {arr.null_count} missing lists (nulls) inside its rows")
        lengths = pc.list_value_length(arr)
        lo, hi = pc.min(lengths).as_py(), pc.max(lengths).as_py()
        dims.append(int(lo or 0) if lo == hi else VARIES)
        arr = pc.list_flatten(arr)
    if arr.null_count:
        raise FormatError(f"{where}: column {name!r} has {arr.null_count} missing values (nulls) inside its lists")
    dtype = _leaf_dtype(arr.type, name, where)
    if not dims:
        return Field(name, "scalar", dtype)
    if VARIES not in dims:
        return Field(name, "ndarray", dtype, tuple(dims))
    if len(dims) == 1:
        return Field(name, "varray", dtype)
    return Field(name, "vndarray", dtype, tuple(dims))


def _nested_array(value: list[Any], field: Field, where: str) -> np.ndarray:
    """One row of a vndarray column (nested lists) as an array of the field's rank and dtype; a
    row whose lists differ in length inside it is not an array and raises."""
    try:
        a = np.array(value, dtype=field.dtype)
    except ValueError as exc:  # numpy: "inhomogeneous shape"
        raise FormatError(f"{where}: the nested lists are not rectangular (lists of one level differ "
                          f"in length inside this row), so they are not an array of rank {len(field.shape)}") from exc
    if a.size == 0 and a.ndim < len(field.shape):  # [] or [[]]: numpy cannot see the inner levels
        a = a.reshape(a.shape + tuple(max(d, 0) for d in field.shape[a.ndim:]))
    return a


def _fixed_values(column: Any, field: Field, n: int) -> np.ndarray:
    """An Arrow column slice of a fixed field as an (n, *shape) array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column.type, pa.ExtensionType):
        column = pa.chunked_array([c.storage for c in column.chunks], type=column.type.storage_type)
    for _ in field.shape:
        column = pc.list_flatten(column)
    return np.asarray(column.to_numpy(), dtype=field.dtype).reshape((n, *field.shape))


def hf_block_source(ds: Any, *, where: str = "datasets.Dataset") -> BlockSource:
    """`ds` (a `datasets.Dataset`) as a `BlockSource` with the fields described in the module docstring."""
    table = ds.with_format("arrow")[:] if len(ds) else ds.data.table
    features = ds.features
    schema = Schema(tuple(_field_for(name, table.column(name), features.get(name), where) for name in ds.column_names))
    fixed = [f for f in schema if f.is_fixed]
    variable = Schema(tuple(f for f in schema if not f.is_fixed))
    images = [f.name for f in variable if f.kind == "image"]
    nested = [f for f in variable if f.kind == "vndarray"]
    n = len(ds)

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            e = min(s + _BLOCK_ROWS, n)
            part = table.slice(s, e - s)
            cols = {f.name: _fixed_values(part.column(f.name), f, e - s) for f in fixed}
            hw: dict[str, np.ndarray] = {}
            shapes: dict[str, np.ndarray] = {}
            if variable.fields:
                rows = part.select(list(variable.names)).to_pylist()
                for i, row in enumerate(rows):
                    for name in images:
                        value = row[name]
                        if not isinstance(value, dict) or value.get("bytes") is None:
                            raise FormatError(f"{where}: sample {s + i}, field {name!r}: the image has no stored bytes")
                        row[name] = value["bytes"]
                    for f in nested:
                        row[f.name] = _nested_array(row[f.name], f, f"{where}: sample {s + i}, column {f.name!r}")
                block = encode_samples(rows, variable, first_index=s, describe=lambda i: where)
                cols.update(block.columns)
                hw, shapes = block.image_hw, block.shapes
            yield Block(e - s, {f.name: cols[f.name] for f in schema}, hw, shapes)

    return BlockSource(schema=schema, num_samples=n, blocks=blocks, attrs={"source": "hf"}, describe=lambda i: where)
