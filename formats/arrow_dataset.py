"""Parquet and Lance read in place: `ParquetDataset`, `LanceDataset` (map-style, batched through `get_batch`).

Columns map to fields by their Arrow type, the same for both formats:

* bool, integer and float columns: ``scalar`` of that dtype
* ``fixed_size_list`` of numbers (nested too): ``ndarray`` of that shape
* ``list`` / ``large_list`` of numbers: ``varray``
* string: ``string``; binary: ``bytes``; a Hugging Face ``Image`` column (a ``{bytes, path}``
  struct named in the file's ``huggingface`` metadata): ``image`` (the encoded bytes)

Other types raise naming the column. A batch is one vectorized row take (Lance ``take``; for
Parquet, the row groups the batch touches, read whole into a bounded cache of decoded groups,
then one ``Table.take``) and arrives in the forms a fastload dataset gives: (B, *shape) arrays for
fixed fields and `Ragged` for variable ones, built from the Arrow buffers without per-sample
Python. A null anywhere in a batch raises naming the file, sample and column.

What is verified is what each format checks itself, not fastload's block checksums: Parquet
page CRCs where the writer stored them (pyarrow writes none by default;
``write_page_checksum=True`` does), checked on every page read; Lance's own structure checks when a
file or page is decoded. Convert (`fastload convert SRC OUT`) for checksummed, mapped reads.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import FormatError
from .ragged import Ragged
from .schema import Field, Schema

if TYPE_CHECKING:
    from .writer import BlockSource

__all__ = [
    "DEFAULT_GROUP_CACHE",
    "LanceDataset",
    "ParquetDataset",
    "arrow_fields",
    "in_place_kind",
    "in_place_source",
    "is_lance",
]

DEFAULT_GROUP_CACHE = 512 << 20  # decoded Parquet row groups kept per process
_BLOCK_ROWS = 8192


def is_lance(path: str) -> bool:
    """Whether `path` is a Lance dataset directory (its ``_versions`` folder of manifests)."""
    return os.path.isdir(os.path.join(path, "_versions"))


def in_place_kind(path: str) -> str | None:
    """"parquet" for a Parquet file or a folder of only Parquet files (besides names starting with "." or
    "_"), "lance" for a Lance dataset, else None."""
    if os.path.isfile(path):
        return "parquet" if path.lower().endswith(".parquet") else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "index.json")):
        return None
    if is_lance(path):
        return "lance"
    data = [e for e in os.listdir(path) if not e.startswith((".", "_"))]  # Spark's _SUCCESS, .crc files
    return "parquet" if data and all(e.endswith(".parquet") for e in data) else None


def _hf_images(metadata: dict[bytes, bytes] | None) -> set[str]:
    """Columns a Hugging Face writer declared as `Image` in the schema metadata."""
    raw = (metadata or {}).get(b"huggingface")
    if raw is None:
        return set()
    try:
        features = json.loads(raw).get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return set()
    return {k for k, v in features.items() if isinstance(v, dict) and v.get("_type") == "Image"}


def _field(name: str, t: Any, images: set[str], where: str) -> Field:
    import pyarrow as pa

    if name in images and pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return Field(name, "image")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Field(name, "string")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return Field(name, "bytes")
    shape: list[int] = []
    inner = t
    while pa.types.is_fixed_size_list(inner):
        shape.append(inner.list_size)
        inner = inner.value_type
    if not shape and (pa.types.is_list(inner) or pa.types.is_large_list(inner)):
        leaf = inner.value_type
        if _is_number(leaf):
            return Field(name, "varray", np.dtype(leaf.to_pandas_dtype()))
    if _is_number(inner):
        dtype = np.dtype(inner.to_pandas_dtype())
        return Field(name, "ndarray", dtype, tuple(shape)) if shape else Field(name, "scalar", dtype)
    raise FormatError(
        f"{where}: column {name!r}: Arrow type {t} cannot be read in place (numbers, fixed-size lists of "
        "numbers, lists of numbers, strings, binary, Hugging Face images)"
    )


def _is_number(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t))


def arrow_fields(schema: Any, where: str) -> Schema:
    """The fastload schema of an Arrow schema (the mapping in the module docstring)."""
    images = _hf_images(schema.metadata)
    return Schema(tuple(_field(f.name, f.type, images, where) for f in schema))


def _flat(chunked: Any) -> Any:
    """One contiguous Arrow array of a (chunked) column."""
    import pyarrow as pa

    if isinstance(chunked, pa.ChunkedArray):
        return chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
    return chunked


def _ragged(arr: Any, kind: str, dtype: np.dtype) -> Ragged:
    """A Ragged over an Arrow binary/string/list array: its offsets and values, zero-copy where Arrow allows."""
    import pyarrow as pa

    if kind == "varray":
        arr = arr.cast(pa.large_list(arr.type.value_type))
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=dtype)
    else:
        arr = arr.cast(pa.large_binary())
        buffers = arr.buffers()
        offsets = np.frombuffer(buffers[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = buffers[2]
        values = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    base = int(offsets[0]) if len(offsets) else 0
    values = values[base : int(offsets[-1])] if len(offsets) else values[:0]
    return Ragged(values, offsets - base, kind)


def _first_null(arr: Any) -> int | None:
    """The first row of `arr` that is null or holds a null at any list level; None when there is none."""
    import pyarrow as pa
    import pyarrow.compute as pc

    levels = [arr]
    while any(check(levels[-1].type) for check in (pa.types.is_list, pa.types.is_large_list,
                                                     pa.types.is_fixed_size_list)):
        levels.append(pc.list_flatten(levels[-1]))
    if not any(a.null_count for a in levels):  # the common case: counts only, no per-row work
        return None
    bad = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    row_of = np.arange(len(arr))  # the row each item of the current level belongs to
    for outer, inner in zip(levels, levels[1:]):
        row_of = row_of[np.asarray(pc.list_parent_indices(outer).to_numpy(zero_copy_only=False), dtype=np.int64)]
        nulls = np.asarray(inner.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        bad[row_of[nulls]] = True
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def _fixed(arr: Any, f: Field) -> np.ndarray:
    import pyarrow.compute as pc

    for _ in f.shape:
        arr = pc.list_flatten(arr)
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=f.dtype).reshape((-1, *f.shape))


class _ArrowDataset:
    """What Parquet and Lance share: the schema mapping, bounds checks and Arrow -> fastload columns."""

    path: str
    schema: Schema
    _n: int

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, samples={len(self)}, fields={self.schema.names})"

    def _check(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -self._n or idx.max() >= self._n):
            bad = int(idx[(idx < -self._n) | (idx >= self._n)][0])
            raise IndexError(f"sample index {bad} out of range for {self._n} samples in {self.path}")
        return np.where(idx < 0, idx + self._n, idx)

    def _rows(self, idx: np.ndarray, names: list[str]) -> Any:
        raise NotImplementedError

    def _where(self, i: int) -> str:
        return f"{self.path}: sample {i}"

    def get_batch(self, indices: Any, *, fields: list[str] | None = None) -> dict[str, Any]:
        """Samples `indices` (any order, repeats and negative indices allowed; IndexError when out of
        range) as columns: (B, *shape) arrays for fixed fields, `Ragged` for variable ones."""
        idx = self._check(indices)
        wanted = self.schema.fields if fields is None else tuple(self.schema[name] for name in fields)
        table = self._rows(idx, [f.name for f in wanted])
        out: dict[str, Any] = {}
        for f in wanted:
            arr = _flat(table.column(f.name))
            if f.kind == "image":
                arr = arr.field("bytes")
            row = _first_null(arr)
            if row is not None:
                raise FormatError(f"{self._where(int(idx[row]))}, column {f.name!r}: missing value (null)")
            out[f.name] = _fixed(arr, f) if f.is_fixed else _ragged(arr, f.kind, f.dtype)
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        batch = self.get_batch([index])
        return {f.name: (batch[f.name][0].item() if f.kind == "scalar" else batch[f.name][0]) for f in self.schema}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        batch = self.get_batch(indices)
        return [
            {f.name: (batch[f.name][i].item() if f.kind == "scalar" else batch[f.name][i]) for f in self.schema}
            for i in range(len(indices))
        ]

    def _whole_column(self, name: str) -> Any:
        raise NotImplementedError

    def lengths(self, field: str) -> np.ndarray:
        """Per-sample lengths of a variable field (items for varray, bytes otherwise); reads that column
        whole. ValueError for a fixed-size field."""
        import pyarrow.compute as pc

        f = self.schema[field]
        if f.is_fixed:
            raise ValueError(f"field {field!r} is fixed-size")
        arr = _flat(self._whole_column(field))
        if f.kind == "image":
            arr = arr.field("bytes")
        counts = pc.list_value_length(arr) if f.kind == "varray" else pc.binary_length(arr)
        return np.asarray(counts.to_numpy(zero_copy_only=False), dtype=np.int64)


class ParquetDataset(_ArrowDataset):
    """A Parquet file, or a folder of them (one table, files in name order), read in place.

    A batch reads each row group it touches whole (decoded once, kept in a cache of decoded groups
    bounded by `group_cache_bytes`, random eviction) and takes its rows with one `Table.take`.
    Page CRCs are checked where the files carry them (`page_checksum_verification`). Each thread
    reads through its own open files; the cache is shared by the process's threads.
    """

    fork_safe = True

    def __init__(
        self, path: str | os.PathLike[str], *, columns: list[str] | None = None,
        group_cache_bytes: int = DEFAULT_GROUP_CACHE,
    ) -> None:
        import pyarrow.parquet as pq

        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            self.files = sorted(
                os.path.join(self.path, e) for e in os.listdir(self.path)
                if e.endswith(".parquet") and not e.startswith((".", "_"))
            )
        else:
            self.files = [self.path]
        if not self.files:
            raise FormatError(f"{self.path}: no .parquet files")
        self.group_cache_bytes = group_cache_bytes
        self._pid = -1
        self._local = threading.local()  # this thread's open files
        self._lock = threading.Lock()  # guards the cache
        starts, groups = [0], []  # global first row of each row group; (file, group) of each
        first = None
        for k, name in enumerate(self.files):
            try:
                meta = pq.read_metadata(name)
            except (OSError, ValueError) as exc:  # ArrowInvalid is a ValueError
                raise FormatError(f"{name}: cannot read as Parquet ({exc})") from exc
            arrow = meta.schema.to_arrow_schema()
            if first is None:
                first = arrow
            elif not arrow.remove_metadata().equals(first.remove_metadata()):
                raise FormatError(f"{name}: its columns differ from {self.files[0]}'s ({arrow} vs {first})")
            for g in range(meta.num_row_groups):
                starts.append(starts[-1] + meta.row_group(g).num_rows)
                groups.append((k, g))
        assert first is not None
        keep = first if columns is None else _select(first, columns, self.path)
        self.schema = arrow_fields(keep, self.path)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._groups = groups
        self._n = int(self._starts[-1])
        self._cache: dict[int, Any] = {}
        self._cache_bytes = 0
        self._rng = random.Random(0)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"], state["_lock"]
        state.update(_pid=-1, _cache={}, _cache_bytes=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _local=threading.local(), _lock=threading.Lock())

    def _process(self) -> None:
        """In a process other than the one that last read (a forked child): fresh files, lock and cache."""
        if self._pid != os.getpid():
            self._local, self._lock = threading.local(), threading.Lock()
            self._cache, self._cache_bytes, self._pid = {}, 0, os.getpid()

    def _file(self, k: int) -> Any:
        import pyarrow.parquet as pq

        handles = getattr(self._local, "files", None)
        if handles is None:
            handles = self._local.files = [None] * len(self.files)
        if handles[k] is None:
            handles[k] = pq.ParquetFile(self.files[k], page_checksum_verification=True)
        return handles[k]

    def close(self) -> None:
        """Drop this thread's open files and the cached row groups (a later read opens them again)."""
        for h in getattr(self._local, "files", None) or []:
            if h is not None:
                h.close()
        self._local.files = None
        with self._lock:
            self._cache, self._cache_bytes = {}, 0

    def _group(self, g: int) -> Any:
        self._process()
        with self._lock:
            table = self._cache.get(g)
        if table is not None:
            return table
        k, local = self._groups[g]
        try:  # decoded outside the lock: pyarrow releases the GIL, threads decode in parallel
            table = self._file(k).read_row_group(local, columns=self.schema.names)
        except (OSError, ValueError) as exc:
            raise FormatError(f"{self.files[k]}: row group {local}: cannot read ({exc})") from exc
        with self._lock:
            if g not in self._cache:
                self._cache[g] = table
                self._cache_bytes += table.nbytes
            while self._cache_bytes > self.group_cache_bytes and len(self._cache) > 1:
                # random eviction, as for HDF5 chunks: a shuffled epoch is a scan an LRU cache always misses
                victim = next(itertools.islice(iter(self._cache), self._rng.randrange(len(self._cache) - 1), None))
                self._cache_bytes -= self._cache.pop(victim).nbytes
        return table

    def _rows(self, idx: np.ndarray, names: list[str]) -> Any:
        import pyarrow as pa

        group_of = np.searchsorted(self._starts, idx, side="right") - 1
        touched, local = np.unique(group_of, return_inverse=True)
        tables = [self._group(int(g)).select(names) for g in touched]
        if not tables:
            return self._empty(names)
        sizes = np.asarray([t.num_rows for t in tables], dtype=np.int64)
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        rows = base[local] + (idx - self._starts[group_of])
        return pa.concat_tables(tables).take(pa.array(rows, type=pa.int64()))

    def _empty(self, names: list[str]) -> Any:
        return self._group(0).select(names).slice(0, 0) if self._groups else None

    def _where(self, i: int) -> str:
        g = int(np.searchsorted(self._starts, i, side="right") - 1)
        k, local = self._groups[g]
        return f"{self.files[k]} (row group {local}): sample {i}"

    def _whole_column(self, name: str) -> Any:
        import pyarrow as pa

        self._process()
        return pa.chunked_array([self._file(k).read(columns=[name]).column(name) for k in range(len(self.files))])


def _select(schema: Any, columns: list[str], where: str) -> Any:
    import pyarrow as pa

    missing = [c for c in columns if schema.get_field_index(c) < 0]
    if missing:
        raise FormatError(f"{where}: no column(s) {missing} (columns: {schema.names})")
    return pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)


class LanceDataset(_ArrowDataset):
    """A Lance dataset (its latest version, or `version`) read in place: each batch one Lance `take`.

    Lance is not fork-safe (its I/O runtime's threads do not survive a fork), so a forked process
    refuses to read it: use thread workers (`Loader(worker_type="thread")`), or spawned processes,
    which unpickle the dataset and open it afresh.
    """

    fork_safe = False  # read by `fastload bench`: torch DataLoader workers are spawned, not forked

    def __init__(
        self, path: str | os.PathLike[str], *, columns: list[str] | None = None, version: int | None = None
    ) -> None:
        self.path = os.fspath(path)
        self.version = version
        self._pid = -1
        self._ds: Any = None
        ds = self._dataset()
        self.version = ds.version  # pinned: every process reads the same snapshot
        keep = ds.schema if columns is None else _select(ds.schema, columns, self.path)
        self.schema = arrow_fields(keep, self.path)
        self._n = ds.count_rows()

    def _dataset(self) -> Any:
        if self._ds is None or self._pid != os.getpid():
            import lance

            if self._pid not in (-1, os.getpid()):
                raise FormatError(f"{self.path}: a Lance dataset opened before a fork cannot be read in the forked "
                                  "process (Lance is not fork-safe); use worker_type='thread'")

            try:
                self._ds = lance.dataset(self.path, version=self.version)
            except (OSError, ValueError) as exc:
                raise FormatError(f"{self.path}: cannot open as a Lance dataset ({exc})") from exc
            self._pid = os.getpid()
        return self._ds

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pid=-1, _ds=None)
        return state

    def close(self) -> None:
        """Drop the open dataset (a later read in this process opens it again)."""
        self._ds = None

    def _rows(self, idx: np.ndarray, names: list[str]) -> Any:
        try:
            return self._dataset().take(idx, columns=names)
        except (OSError, ValueError, RuntimeError) as exc:
            raise FormatError(f"{self.path} (Lance version {self.version}): cannot read rows ({exc})") from exc

    def _whole_column(self, name: str) -> Any:
        return self._dataset().to_table(columns=[name]).column(name)


def in_place_source(ds: ParquetDataset | LanceDataset) -> BlockSource:
    """An in-place dataset as a `BlockSource` for `write` (`fastload convert`): blocks of rows in order,
    fixed fields as arrays and variable ones as `Ragged`; image fields' sizes read from their headers."""
    from .columns import Block, image_size
    from .writer import BlockSource

    n = len(ds)
    images = [f.name for f in ds.schema if f.kind == "image"]
    label = {"ParquetDataset": "parquet", "LanceDataset": "lance"}[type(ds).__name__]

    def block(s: int, e: int) -> Block:
        cols = ds.get_batch(np.arange(s, e))
        hw = {}
        for name in images:
            data = cols[name]
            hw[name] = np.asarray(
                [image_size(data[j], f"{ds.path}: sample {s + j}, field {name!r}") for j in range(e - s)],
                dtype=np.uint32,
            ).reshape(e - s, 2)
        return Block(e - s, cols, hw)

    def blocks(start: int) -> Any:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    attrs: dict[str, Any] = {"source": label}
    return BlockSource(schema=ds.schema, num_samples=n, blocks=blocks, block=block, attrs=attrs)

