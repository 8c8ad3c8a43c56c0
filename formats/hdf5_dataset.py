"""`HDF5Dataset`: a map-style dataset over the datasets of an HDF5 file that share a first dimension.

Contiguous, unfiltered datasets are mapped directly with numpy at their file offset (no HDF5 call
per read). Chunked, unfiltered datasets whose chunks hold whole rows are read the same way: each
chunk's file offset is looked up once at open, and a batch's rows are one ranged copy out of the
mapped file (`gather_ranges`), with no HDF5 call and nothing to decode. Compressed datasets are
read through h5py, each chunk a batch touches whole and decoded once, into a cache of decoded
chunks. Variable-length datasets (vlen numbers, strings, bytes) become `varray`/`string`/`bytes` fields.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import numpy as np

from .errors import FormatError
from .ragged import Ragged, gather_ranges
from .schema import Field, Schema

__all__ = ["HDF5Dataset"]

DEFAULT_CHUNK_CACHE = 512 << 20  # decoded chunks kept per process


def _field_for(name: str, ds: Any) -> Field:
    import h5py

    vlen = h5py.check_vlen_dtype(ds.dtype)
    string = h5py.check_string_dtype(ds.dtype)
    if ds.ndim == 0:
        raise FormatError(f"{ds.file.filename}:{ds.name}: scalar dataset has no samples")
    if string is not None:
        if ds.ndim != 1:
            raise FormatError(f"{ds.file.filename}:{ds.name}: string datasets must be 1-D")
        return Field(name, "string" if string.encoding == "utf-8" else "bytes")
    if vlen is not None:
        if ds.ndim != 1:
            raise FormatError(f"{ds.file.filename}:{ds.name}: variable-length datasets must be 1-D")
        return Field(name, "varray", np.dtype(vlen))
    if ds.dtype.kind not in "biuf":
        raise FormatError(f"{ds.file.filename}:{ds.name}: dtype {ds.dtype} is not supported")
    if ds.ndim == 1:
        return Field(name, "scalar", ds.dtype)
    return Field(name, "ndarray", ds.dtype, ds.shape[1:])


def _chunk_table(ds: Any, file_size: int) -> np.ndarray | None:
    """File offset of each chunk of a chunked, unfiltered dataset whose chunks hold whole rows; None
    for any other layout, or when a chunk is unallocated, of another size, or outside the file."""
    if ds.chunks is None or ds.id.get_create_plist().get_nfilters() or tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
        return None
    step = ds.chunks[0]
    chunk_bytes = step * ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
    table = np.empty(-(-ds.shape[0] // step), dtype=np.int64)
    for c in range(len(table)):
        try:
            info = ds.id.get_chunk_info_by_coord((c * step,) + (0,) * (ds.ndim - 1))
        except (KeyError, RuntimeError, ValueError):
            return None
        if info.byte_offset is None or info.size != chunk_bytes or info.byte_offset + chunk_bytes > file_size:
            return None
        table[c] = info.byte_offset
    return table


def _cached_bytes(block: Any, rows: int) -> int:
    """Memory held by a cached chunk; variable-length (object) rows are estimated at 64 bytes each."""
    return block.nbytes if isinstance(block, np.ndarray) and block.dtype != object else rows * 64


class HDF5Dataset:
    """Read-only HDF5 source with the batched dataset protocol (`get_batch`, `__getitems__`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fields: list[str] | None = None,
        chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE,
    ) -> None:
        import h5py

        self.path = os.fspath(path)
        self.chunk_cache_bytes = chunk_cache_bytes
        self._file: Any = None
        self._pid = -1
        h5 = self._h5()
        if fields is None:
            fields = []
            h5.visititems(lambda name, obj: fields.append(name) if isinstance(obj, h5py.Dataset) else None)
        if not fields:
            raise FormatError(f"{self.path}: no datasets in the HDF5 file")
        lengths = {}
        for name in fields:
            if name not in h5 or not isinstance(h5[name], h5py.Dataset):
                raise FormatError(f"{self.path}: no dataset {name!r}")
            lengths[name] = h5[name].shape[0] if h5[name].ndim else 0
        if len(set(lengths.values())) != 1:
            raise FormatError(f"{self.path}: datasets differ in length (first dimension): {lengths}")
        self._n = next(iter(lengths.values()))
        self.schema = Schema(tuple(_field_for(name, h5[name]) for name in fields))
        self._direct: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        self._chunked: dict[str, tuple[np.ndarray, int, tuple[int, ...], np.dtype]] = {}  # table, rows/chunk
        size = os.path.getsize(self.path)
        for f in self.schema:
            ds = h5[f.name]
            offset = ds.id.get_offset() if f.is_fixed and ds.chunks is None and ds.compression is None else None
            if offset is not None:
                if offset + ds.size * ds.dtype.itemsize > size:
                    raise FormatError(f"{self.path}:{f.name}: data offset {offset} + size lies outside the file")
                self._direct[f.name] = (offset, ds.shape, ds.dtype)
            elif f.is_fixed:
                table = _chunk_table(ds, size)
                if table is not None:
                    self._chunked[f.name] = (table, ds.chunks[0], ds.shape, ds.dtype)
        self._maps: dict[str, np.ndarray] = {}
        self._chunks: dict[tuple[str, int], Any] = {}
        self._chunk_bytes = 0
        self._rng = random.Random(0)

    def _h5(self) -> Any:
        import h5py

        if self._file is None or self._pid != os.getpid():
            try:
                self._file = h5py.File(self.path, "r", rdcc_nbytes=4 << 20)
            except OSError as exc:
                raise FormatError(f"{self.path}: cannot open as HDF5 ({exc})") from exc
            self._pid = os.getpid()
            self._maps = {}
        return self._file

    def _map(self, name: str) -> np.ndarray:
        arr = self._maps.get(name)
        if arr is None or self._pid != os.getpid():
            self._h5()
            offset, shape, dtype = self._direct[name]
            arr = self._maps[name] = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)
        return arr

    def _read_chunked(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Rows `idx` (in bounds) of a chunked, unfiltered field: one ranged copy out of the mapped file."""
        table, step, shape, dtype = self._chunked[name]
        whole = self._maps.get("")
        if whole is None or self._pid != os.getpid():
            self._h5()
            whole = self._maps[""] = np.memmap(self.path, dtype=np.uint8, mode="r")
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        starts = table.take(idx // step) + (idx % step) * row_bytes
        values, _ = gather_ranges(whole, starts, np.full(len(idx), row_bytes, dtype=np.int64))
        return values.view(dtype).reshape(len(idx), *shape[1:])

    def close(self) -> None:
        """Close the HDF5 file and drop this dataset's mappings of it and its cached chunks (so that
        their pages can be evicted); a later read opens them again."""
        file, self._file, self._pid = self._file, None, -1
        self._maps, self._chunks, self._chunk_bytes = {}, {}, 0
        if file is not None:
            file.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"], state["_pid"], state["_maps"] = None, -1, {}
        state["_chunks"], state["_chunk_bytes"] = {}, 0
        return state

    def __repr__(self) -> str:
        return f"HDF5Dataset({self.path!r}, samples={len(self)}, fields={self.schema.names})"

    def __len__(self) -> int:
        return self._n

    @property
    def direct_fields(self) -> list[str]:
        """Fields read through a direct numpy mapping (contiguous or chunked, unfiltered)."""
        return [*self._direct, *self._chunked]

    def _check(self, idx: np.ndarray) -> np.ndarray:
        if idx.size and (idx.min() < -self._n or idx.max() >= self._n):
            bad = idx[(idx < -self._n) | (idx >= self._n)][0]
            raise IndexError(f"sample index {int(bad)} out of range for {self._n} samples in {self.path}")
        return np.where(idx < 0, idx + self._n, idx)

    def _chunk(self, name: str, ds: Any, c: int, step: int) -> Any:
        """Decoded rows of chunk `c`, from a cache of decoded chunks bounded by `chunk_cache_bytes`."""
        key = (name, c)
        block = self._chunks.get(key)
        if block is not None:
            return block
        block = ds[c * step : min((c + 1) * step, self._n)]
        self._chunks[key] = block
        self._chunk_bytes += _cached_bytes(block, step)
        while self._chunk_bytes > self.chunk_cache_bytes and len(self._chunks) > 1:
            # Random eviction, not LRU: a batch visits its chunks in sorted order, a scan that would
            # make an LRU cache smaller than the data miss every time.
            victim = next(itertools.islice(iter(self._chunks), self._rng.randrange(len(self._chunks) - 1), None))
            old = self._chunks.pop(victim)
            self._chunk_bytes -= _cached_bytes(old, step)
        return block

    def _read_h5(self, name: str, idx: np.ndarray) -> Any:
        """Rows `idx` through h5py, back in caller order.

        h5py point selections are very slow on chunked data, so each touched chunk is read whole (one
        aligned hyperslab, decompressed once) into a cache of decoded chunks, and rows are gathered from it.
        """
        ds = self._h5()[name]
        uniq, inverse = np.unique(idx, return_inverse=True)
        if len(uniq) == 0:
            return ds[:0]
        row_bytes = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:])))
        step = ds.chunks[0] if ds.chunks else max(1, (1 << 20) // row_bytes)
        chunk_of = uniq // step
        cuts = np.flatnonzero(chunk_of[1:] != chunk_of[:-1]) + 1
        parts = [self._chunk(name, ds, int(rows[0]) // step, step)[rows % step] for rows in np.split(uniq, cuts)]
        return np.concatenate(parts)[inverse]

    def get_batch(self, indices: Any) -> dict[str, Any]:
        """Samples `indices` (any order, repeats and negative indices allowed; IndexError when out of
        range) as columns: field -> numpy array for fixed-size fields, `Ragged` for variable ones."""
        idx = self._check(np.asarray(indices, dtype=np.int64).reshape(-1))
        out: dict[str, Any] = {}
        for f in self.schema:
            if f.name in self._direct:
                out[f.name] = self._map(f.name)[idx]
            elif f.name in self._chunked:
                out[f.name] = self._read_chunked(f.name, idx)
            elif f.is_fixed:
                out[f.name] = np.asarray(self._read_h5(f.name, idx))
            else:
                rows = self._read_h5(f.name, idx)
                if f.kind == "string":
                    rows = [r.decode("utf-8") if isinstance(r, bytes) else str(r) for r in rows]
                elif f.kind == "bytes":
                    rows = [bytes(r) for r in rows]
                out[f.name] = Ragged.from_list(list(rows), kind=f.kind, dtype=f.dtype)
        return out

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        batch = self.get_batch(indices)
        return [self._sample(batch, i) for i in range(len(indices))]

    def _sample(self, batch: dict[str, Any], i: int) -> dict[str, Any]:
        out = {}
        for f in self.schema:
            col = batch[f.name]
            out[f.name] = col[i].item() if f.kind == "scalar" else col[i]
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._sample(self.get_batch([index]), 0)

    def lengths(self, field: str) -> np.ndarray:
        """Per-sample lengths of a variable field (items for varray, bytes for strings); reads the whole
        column, as HDF5 keeps no index of lengths. ValueError for a fixed-size field."""
        f = self.schema[field]
        if f.is_fixed:
            raise ValueError(f"field {field!r} is fixed-size")
        return np.fromiter((len(r) for r in self._h5()[field]), dtype=np.int64, count=self._n)
