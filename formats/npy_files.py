"""`.npy` sources: a folder of per-sample files, columns of one length, or flat tokens + offsets.

* A folder whose `.npy` files all have the same first dimension (at most `MAX_COLUMNS` of them) is
  a set of columns: file `NAME.npy` is field `NAME`, row i of every file is sample i.
* Any other folder of `.npy` files holds one sample per file (`NpyFiles`, kind ``npyfiles``):
  ``{"data": the array, "file": its name}``; arrays of one dtype and rank whose shapes differ
  become a ``vndarray`` field (``-1`` where they differ).
* A folder with `tokens.npy` (1-D) and `offsets.npy` (``n + 1`` integers from 0 to
  ``len(tokens)``) is a token corpus (kind ``tokens``): sample i is
  ``tokens[offsets[i]:offsets[i + 1]]``, a ``varray`` field ``tokens``.

A `meta.json` beside the files (a JSON object) is stored in the manifest's ``attrs["meta"]``.
Arrays are read with ``allow_pickle=False``; errors name the first bad file and how many more.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.lib import format as npformat

from .columns import Block
from .errors import FormatError, SchemaError
from .ragged import Ragged
from .schema import VARIES, Field, Schema
from .writer import BlockSource

__all__ = [
    "MAX_COLUMNS",
    "NpyFiles",
    "is_column_folder",
    "npy_columns",
    "read_meta_json",
    "token_source",
]

MAX_COLUMNS = 32  # more same-length files than this are samples, not columns
META_JSON = "meta.json"
_BLOCK_ROWS = 8192


def _header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a `.npy` header alone (no data read, no pickle)."""
    try:
        with open(path, "rb") as fh:
            version = npformat.read_magic(fh)
            read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
            shape, _, dtype = read(fh)
    except (OSError, ValueError, SyntaxError) as exc:
        raise FormatError(f"{path}: not a readable .npy file ({exc})") from exc
    if dtype.kind not in "biuf" or dtype.fields is not None:
        raise FormatError(f"{path}: dtype {dtype} is not numeric (bool/int/uint/float only)")
    return tuple(shape), dtype


def _first_and_more(paths: list[str], what: str) -> str:
    more = len(paths) - 1
    return f"{paths[0]} {what}" + (f" (and {more} more file{'s' if more != 1 else ''})" if more else "")


def read_meta_json(folder: str) -> dict[str, Any] | None:
    """The JSON object in `folder/meta.json`, or None when there is none."""
    path = os.path.join(folder, META_JSON)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _npy_paths(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    paths = sorted(os.path.join(src, e) for e in os.listdir(src) if e.endswith(".npy") and not e.startswith("."))
    if not paths:
        raise FormatError(f"{src}: no .npy files")
    return paths


def is_column_folder(src: str) -> bool:
    """Whether the `.npy` files at `src` are columns (a file, or few files of one first dimension)."""
    paths = _npy_paths(src)
    if len(paths) == 1 or len(paths) > MAX_COLUMNS:
        return len(paths) == 1
    firsts = {(_header(p)[0] or (None,))[0] for p in paths}
    return len(firsts) == 1 and None not in firsts


def npy_columns(src: str) -> BlockSource:
    """`.npy` files of one length as columns (a single file is field ``data``)."""
    paths = _npy_paths(src)
    arrays = {}
    for p in paths:
        name = os.path.splitext(os.path.basename(p))[0] if len(paths) > 1 else "data"
        _header(p)  # numeric, readable: checked before mapping
        arrays[name] = np.load(p, mmap_mode="r", allow_pickle=False)
    if any(a.ndim == 0 for a in arrays.values()):
        raise FormatError(f"{src}: a 0-d array has no samples")
    n = len(next(iter(arrays.values())))
    schema = Schema(
        tuple(
            Field(k, "scalar", a.dtype) if a.ndim == 1 else Field(k, "ndarray", a.dtype, a.shape[1:])
            for k, a in arrays.items()
        )
    )

    def block(s: int, e: int) -> Block:
        return Block(e - s, {k: np.ascontiguousarray(a[s:e]) for k, a in arrays.items()})

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    return BlockSource(schema=schema, num_samples=n, blocks=blocks, block=block, describe=lambda i: src)


class NpyFiles:
    """One sample per `.npy` file, files sorted by name: ``{"data": array, "file": file name}``."""

    def __init__(self, src: str) -> None:
        self.paths = _npy_paths(src)
        headers = [_header(p) for p in self.paths]
        shape0, dtype0 = headers[0]
        for what, bad in (
            (f"has dtype {{}}, but {self.paths[0]} has {dtype0}", [i for i, h in enumerate(headers) if h[1] != dtype0]),
            (f"has {{}} dimensions, but {self.paths[0]} has {len(shape0)}",
             [i for i, h in enumerate(headers) if len(h[0]) != len(shape0)]),
        ):
            if bad:
                got = headers[bad[0]][1] if "dtype" in what else len(headers[bad[0]][0])
                raise SchemaError(
                    _first_and_more([self.paths[i] for i in bad], what.format(got))
                    + ": every file must hold an array of one dtype and one number of dimensions"
                )
        shapes = [h[0] for h in headers]
        if not shape0 or len(set(shapes)) == 1:
            data = Field("data", "scalar" if not shape0 else "ndarray", dtype0, shape0)
        else:
            dims = tuple(VARIES if len({s[d] for s in shapes}) > 1 else shape0[d] for d in range(len(shape0)))
            data = Field("data", "vndarray", dtype0, dims)
        self.schema = Schema((data, Field("file", "string")))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path = self.paths[i]
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise SchemaError(f"{path}: cannot read as a numeric .npy array ({exc})") from exc
        return {"data": arr, "file": os.path.basename(path)}

    def describe(self, i: int) -> str:
        """The file sample `i` comes from (for error reports)."""
        return self.paths[i]


def token_source(src: str) -> BlockSource:
    """`src/tokens.npy` + `src/offsets.npy` as a ``varray`` field ``tokens`` (offsets checked)."""
    tok_path, off_path = os.path.join(src, "tokens.npy"), os.path.join(src, "offsets.npy")
    for p in (tok_path, off_path):
        if not os.path.isfile(p):
            raise FormatError(f"{src}: a token corpus needs tokens.npy and offsets.npy; {p} is missing")
    tokens = np.load(tok_path, mmap_mode="r", allow_pickle=False)
    offsets = np.load(off_path, allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype.kind not in "biuf":
        raise FormatError(f"{tok_path}: expected a 1-D numeric array, got {tokens.dtype} of shape {tokens.shape}")
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2:
        raise FormatError(f"{off_path}: expected a 1-D integer array of n + 1 offsets, got {offsets.dtype} "
                          f"of shape {offsets.shape}")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != len(tokens):
        raise FormatError(f"{off_path}: offsets must run from 0 to len(tokens) = {len(tokens)}, "
                          f"got {int(offsets[0])}..{int(offsets[-1])}")
    down = np.flatnonzero(np.diff(offsets) < 0)
    if down.size:
        raise FormatError(f"{off_path}: offsets decrease at sample {int(down[0])}"
                          + (f" (and {down.size - 1} more)" if down.size > 1 else ""))
    n = len(offsets) - 1
    schema = Schema((Field("tokens", "varray", tokens.dtype),))

    def block(s: int, e: int) -> Block:
        lo, hi = int(offsets[s]), int(offsets[e])
        return Block(e - s, {"tokens": Ragged(np.ascontiguousarray(tokens[lo:hi]), offsets[s : e + 1] - lo)})

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    return BlockSource(schema=schema, num_samples=n, blocks=blocks, block=block, describe=lambda i: tok_path)
