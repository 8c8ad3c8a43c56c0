"""Megatron-style indexed token datasets (`PREFIX.bin` + `PREFIX.idx`, `MMapIndexedDataset`) as a source.

The `.idx` file (little-endian), read as untrusted input:

```
magic    9 bytes   b"MMIDIDX\\x00\\x00"
version  u64       1
dtype    u8        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
n        u64       number of sequences
d        u64       number of entries in doc_idx
sizes    i32[n]    elements per sequence
pointers i64[n]    byte offset of each sequence in the .bin file
doc_idx  i64[d]    first sequence of each document, then n
```

Every count is checked against the file's size before anything is read, and every sequence
against the `.bin` file's size. Sample i is sequence i (a ``varray`` field ``tokens``); when
documents hold more than one sequence, a ``scalar`` field ``doc`` gives each sequence's document.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import numpy as np

from .columns import Block
from .errors import FormatError
from .ragged import Ragged
from .schema import Field, Schema
from .writer import BlockSource

__all__ = ["DTYPE_CODES", "MAGIC", "megatron_paths", "megatron_source"]

MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: "|u1", 2: "|i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, n, d
_BLOCK_ROWS = 8192


def megatron_paths(src: str) -> tuple[str, str] | None:
    """(`.bin`, `.idx`) for a prefix or either file of a Megatron pair, or None when the pair is not there."""
    prefix = src[: -len(".bin")] if src.endswith((".bin", ".idx")) else src
    pair = (prefix + ".bin", prefix + ".idx")
    return pair if all(os.path.isfile(p) for p in pair) else None


def _read_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sizes, pointers, doc_idx) from an `.idx` file, its header checked against its size."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as fh:
        head = fh.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise FormatError(f"{idx_path}: {size} bytes, shorter than the {_HEADER.size}-byte header of an .idx file")
    magic, version, code, n, d = _HEADER.unpack(head)
    if magic != MAGIC:
        raise FormatError(f"{idx_path}: bad magic {magic!r}, not a Megatron MMapIndexedDataset index")
    if version != 1:
        raise FormatError(f"{idx_path}: index version {version}; only version 1 is known")
    if code not in DTYPE_CODES:
        raise FormatError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    want = _HEADER.size + 12 * n + 8 * d
    if want != size:
        raise FormatError(
            f"{idx_path}: the header counts {n} sequences and {d} document entries ({want} bytes), "
            f"the file has {size} bytes (truncated or corrupt)"
        )
    if size == _HEADER.size:
        raise FormatError(f"{idx_path}: no doc_idx (an index holds at least one document entry)")
    arrays = np.memmap(idx_path, dtype=np.uint8, mode="r", offset=_HEADER.size, shape=(size - _HEADER.size,))
    sizes = np.asarray(arrays[: 4 * n]).view("<i4")
    pointers = np.asarray(arrays[4 * n : 12 * n]).view("<i8")
    doc_idx = np.asarray(arrays[12 * n :]).view("<i8")
    return np.dtype(DTYPE_CODES[code]), sizes, pointers, doc_idx


def _check(idx_path: str, bin_size: int, dtype: np.dtype, sizes: np.ndarray, pointers: np.ndarray,
           doc_idx: np.ndarray) -> None:
    """Every sequence inside the `.bin` file, doc_idx a non-decreasing run from 0 to n."""
    n = len(sizes)
    ends = pointers + sizes.astype(np.int64) * dtype.itemsize
    outside = (pointers > bin_size) | (sizes.astype(np.int64) > bin_size // dtype.itemsize)  # (ends cannot overflow)
    bad = np.flatnonzero((sizes < 0) | (pointers < 0) | (pointers % dtype.itemsize != 0) | outside | (ends > bin_size))
    if bad.size:
        i = int(bad[0])
        more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
        raise FormatError(
            f"{idx_path}: sequence {i} (pointer {int(pointers[i])}, {int(sizes[i])} elements of {dtype}) lies "
            f"outside the {bin_size}-byte .bin file or is misaligned{more}"
        )
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise FormatError(f"{idx_path}: doc_idx must run from 0 to {n} without decreasing")


def megatron_source(src: str) -> BlockSource:
    """The Megatron pair at `src` (prefix, `.bin` or `.idx`) as a `BlockSource`."""
    paths = megatron_paths(src)
    if paths is None:
        raise FormatError(f"{src}: a Megatron indexed dataset needs both PREFIX.bin and PREFIX.idx")
    bin_path, idx_path = paths
    dtype, sizes, pointers, doc_idx = _read_index(idx_path)
    bin_size = os.path.getsize(bin_path)
    _check(idx_path, bin_size, dtype, sizes, pointers, doc_idx)
    n = len(sizes)
    data = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.zeros(0, np.uint8)
    lengths = sizes.astype(np.int64)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths * dtype.itemsize, out=starts[1:])
    contiguous = bool(np.array_equal(starts[:-1], pointers))
    docs = None
    if not np.array_equal(doc_idx, np.arange(n + 1)):
        docs = np.searchsorted(doc_idx, np.arange(n), side="right") - 1
    fields = (Field("tokens", "varray", dtype),) + ((Field("doc", "scalar", np.int64),) if docs is not None else ())

    def block(s: int, e: int) -> Block:
        if contiguous:
            raw = np.array(data[int(starts[s]) : int(starts[e])])
        else:
            raw = np.concatenate([data[p : p + k * dtype.itemsize] for p, k in zip(pointers[s:e], lengths[s:e])]
                                 + [np.zeros(0, np.uint8)])
        offsets = np.zeros(e - s + 1, dtype=np.int64)
        np.cumsum(lengths[s:e], out=offsets[1:])
        cols: dict[str, np.ndarray | Ragged] = {"tokens": Ragged(raw.view(dtype), offsets)}
        if docs is not None:
            cols["doc"] = docs[s:e]
        return Block(e - s, cols)

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    return BlockSource(schema=Schema(fields), num_samples=n, blocks=blocks, block=block, describe=lambda i: bin_path)
