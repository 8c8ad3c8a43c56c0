"""LitData optimized chunks as a convert source: `index.json` + `chunk-*.bin`, read without LitData.

The layout LitData's `optimize` writes (PyTreeLoader, no compression, no encryption): each chunk
file is ``uint32 n`` + ``uint32 offsets[n + 1]`` (from the file's start) + the items; an item is
``uint32 size`` per leaf + the leaves' bytes. `config.data_format` names each leaf's serializer
and `config.data_spec` (a torch pytree spec) its place in the sample; a dict's keys become field
names (nested keys joined with "."), a list's or tuple's positions "0", "1", ...

Leaf formats and their fields: ``int``/``float``/``bool`` -> ``scalar`` (int64/float64/bool);
``str``/``text`` -> ``string``; ``bytes`` -> ``bytes``; ``jpeg`` and ``image:EXT`` -> ``image``
(the encoded bytes as stored); ``numpy``, ``tensor`` (with their shape header) and
``no_header_numpy:N``/``no_header_tensor:N`` (1-D) -> ``ndarray`` when every sample has one shape,
else ``varray`` (1-D) or ``vndarray``; ``pil`` (raw pixels) -> a uint8 (H, W[, C]) array (int32 for
mode I, float32 for F). ``pickle`` leaves are refused by name (fastload never unpickles data
read from a file), as are other formats (json, video, audio, ...).

Every item's sizes and array headers are read once at open (no payload decoded); an item whose
bytes do not add up, or every item of a chunk file that is missing or whose header is broken, is
recorded with its reason and raises when read, naming the chunk file and item, so
``--on-error=skip`` leaves exactly those out.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

import numpy as np

from .errors import FormatError
from .schema import VARIES, Field, Schema

__all__ = ["LitDataChunks", "is_litdata"]

# LitData's dtype tables (litdata.constants): index -> numpy dtype; None where numpy has no
# plain numeric equivalent (complex, bfloat16, object, bytes, str, void).
_NUMPY_DTYPES: list[str | None] = [
    "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", None, None, "?", None, None, None, None
]
_TORCH_DTYPES: list[str | None] = [
    "f4", "f4", "f8", "f8", None, None, None, None, "f2", "f2", None, "u1", "i1", "i2", "i2", "i4", "i4", "i8", "i8",
    "?", "u2",
]
_PIL_MODES = {"L": ((), "u1"), "LA": ((2,), "u1"), "RGB": ((3,), "u1"), "RGBA": ((4,), "u1"), "CMYK": ((4,), "u1"),
              "YCbCr": ((3,), "u1"), "I": ((), "<i4"), "F": ((), "<f4")}
_SCALARS = {"int": ("<i8", 8), "float": ("<f8", 8), "bool": ("?", 1)}


def is_litdata(path: str) -> bool:
    """Whether the folder `path` holds a LitData `index.json` (its ``chunks`` and ``config``)."""
    try:
        with open(os.path.join(path, "index.json"), "rb") as fh:
            head = json.loads(fh.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(head, dict) and "chunks" in head and isinstance(head.get("config"), dict)


def _leaf_names(spec_text: Any, count: int, where: str) -> list[str]:
    """Field names of the pytree's leaves, in LitData's flattening order."""
    try:
        spec = json.loads(spec_text)[1]
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise FormatError(f"{where}: config.data_spec is not a pytree spec ({exc})") from exc
    names: list[str] = []

    def walk(node: Any, path: list[str]) -> None:
        if not isinstance(node, dict):
            raise FormatError(f"{where}: config.data_spec has a node that is not an object")
        kind, children = node.get("type"), node.get("children_spec") or []
        if kind is None:
            names.append(".".join(path) or "value")
            return
        if kind in ("builtins.dict", "collections.OrderedDict"):
            keys = json.loads(node.get("context") or "[]")
        elif kind in ("builtins.list", "builtins.tuple"):
            keys = [str(i) for i in range(len(children))]
        else:
            raise FormatError(f"{where}: config.data_spec holds a {kind}; only dicts, lists, tuples and leaves")
        if len(keys) != len(children):
            raise FormatError(f"{where}: config.data_spec names {len(keys)} keys for {len(children)} children")
        for key, child in zip(keys, children):
            walk(child, [*path, str(key)])

    walk(spec, [])
    if len(names) != count or len(set(names)) != count:
        raise FormatError(f"{where}: config.data_spec has leaves {names} for {count} data formats")
    return names


def _array_dtype(fmt: str, name: str, where: str) -> np.dtype | None:
    """The element dtype of a header-less array format; None for formats that carry it per item."""
    base, _, sub = fmt.partition(":")
    table = {"no_header_numpy": _NUMPY_DTYPES, "no_header_tensor": _TORCH_DTYPES}.get(base)
    if table is None:
        return None
    try:
        code = table[int(sub)]
    except (ValueError, IndexError):
        code = None
    if code is None:
        raise FormatError(f"{where}: field {name!r}: format {fmt!r} has no numeric numpy dtype fastload stores")
    return np.dtype(code)


class LitDataChunks:
    """A LitData optimized dataset (`optimize`'s output folder) as a map-style source of sample dicts."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        where = os.path.join(self.path, "index.json")
        try:
            with open(where, "rb") as fh:
                index = json.load(fh)
        except (OSError, ValueError) as exc:
            raise FormatError(f"{where}: cannot read as JSON ({exc})") from exc
        config = index.get("config") if isinstance(index, dict) else None
        chunks = index.get("chunks") if isinstance(index, dict) else None
        if not isinstance(config, dict) or not isinstance(chunks, list):
            raise FormatError(f"{where}: not a LitData index (needs 'chunks' and 'config')")
        for key in ("compression", "encryption"):
            if config.get(key):
                raise FormatError(f"{where}: chunks written with {key}={config[key]!r}; only uncompressed, "
                                  "unencrypted chunks are read (write them with the default optimize settings)")
        loader = config.get("item_loader", "PyTreeLoader")
        if loader != "PyTreeLoader":
            raise FormatError(f"{where}: item_loader {loader!r}; only PyTreeLoader chunks (optimize's default)")
        formats = config.get("data_format")
        if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
            raise FormatError(f"{where}: config.data_format is not a list of format names")
        self.formats: list[str] = formats
        self.names = _leaf_names(config.get("data_spec"), len(formats), where)
        for name, fmt in zip(self.names, formats):
            self._check_format(name, fmt, where)
        self.files: list[str] = []
        counts = []
        for c in chunks:
            name = c.get("filename") if isinstance(c, dict) else None
            size = c.get("chunk_size") if isinstance(c, dict) else None
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise FormatError(f"{where}: chunk file name {name!r} is not a plain file name")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise FormatError(f"{where}: chunk {name!r} has chunk_size {size!r}")
            self.files.append(name)
            counts.append(size)
        self._first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._n = int(self._first[-1])
        self.bad: dict[int, str] = {}  # sample -> why it cannot be read
        self._item_start = np.zeros(self._n, dtype=np.int64)
        self._leaf_sizes = np.zeros((self._n, len(formats)), dtype=np.int64)
        self._maps: dict[int, Any] = {}
        self._pid = os.getpid()
        self._shapes: dict[str, list[tuple[int, ...]]] = {}
        self._dtypes: dict[str, np.dtype] = {}
        for k in range(len(self.files)):
            self._index_chunk(k)
        self.schema = self._infer_schema()

    def _check_format(self, name: str, fmt: str, where: str) -> None:
        if fmt == "pickle":
            raise FormatError(f"{where}: field {name!r} is pickled (LitData format 'pickle'); fastload never "
                              "unpickles data read from a file: re-optimize it with numpy/str/bytes/int/float leaves")
        known = (fmt in _SCALARS or fmt in ("str", "text", "bytes", "jpeg", "pil", "numpy", "tensor")
                 or fmt.startswith("image:") or _array_dtype(fmt, name, where) is not None)
        if not known:
            raise FormatError(f"{where}: field {name!r} has LitData format {fmt!r}, which fastload does not read "
                              "(int, float, bool, str, text, bytes, jpeg, image, pil, numpy, tensor)")

    def __len__(self) -> int:
        return self._n

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}, "_pid": -1}

    def _chunk_bytes(self, k: int) -> Any:
        if self._pid != os.getpid():
            self._maps, self._pid = {}, os.getpid()
        m = self._maps.get(k)
        if m is None:
            with open(os.path.join(self.path, self.files[k]), "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(fh.fileno()).st_size else b""
            self._maps[k] = m
        return m

    def describe(self, i: int) -> str:
        """Where sample `i` comes from (chunk file and item), for error reports."""
        k = int(np.searchsorted(self._first, i, side="right") - 1)
        return f"{os.path.join(self.path, self.files[k])}: item {i - int(self._first[k])} (sample {i})"

    def _mark(self, first: int, stop: int, reason: str) -> None:
        for i in range(first, stop):
            self.bad.setdefault(i, reason)

    def _index_chunk(self, k: int) -> None:
        """Item and leaf places of chunk k, checked against its header; array leaves' dtypes and shapes."""
        a, b = int(self._first[k]), int(self._first[k + 1])
        try:
            data = self._chunk_bytes(k)
        except OSError as exc:
            self._mark(a, b, f"cannot read the chunk file ({exc.strerror or exc})")
            return
        n, size, leaves = b - a, len(data), len(self.formats)
        header = 4 + 4 * (n + 1)
        if size < header or struct.unpack_from("<I", data, 0)[0] != n:
            got = struct.unpack_from("<I", data, 0)[0] if size >= 4 else "nothing"
            self._mark(a, b, f"the chunk header says {got} items where index.json says {n}, or the file is cut short")
            return
        offsets = np.frombuffer(data, dtype="<u4", count=n + 1, offset=4).astype(np.int64)
        if offsets[0] != header or np.any(np.diff(offsets) < 0) or offsets[-1] > size:
            self._mark(a, b, "the chunk's item offsets are out of order or past the end of the file")
            return
        lengths = np.diff(offsets)
        if n and not lengths.any():
            self._mark(a, b, "the items are stored in an Arrow footer, not as items; not read by fastload")
            return
        self._item_start[a:b] = offsets[:-1]
        short = np.flatnonzero(lengths < 4 * leaves)
        for j in short.tolist():
            self.bad.setdefault(a + j, f"the item is {lengths[j]} bytes, shorter than its {leaves} leaf sizes")
        whole = np.frombuffer(data, dtype=np.uint8)
        ok = np.flatnonzero(lengths >= 4 * leaves)
        pos = offsets[ok][:, None] + 4 * np.arange(leaves)[None, :]
        sizes = (whole[pos] | (whole[pos + 1].astype(np.int64) << 8) | (whole[pos + 2].astype(np.int64) << 16)
                 | (whole[pos + 3].astype(np.int64) << 24)).astype(np.int64)
        self._leaf_sizes[a + ok] = sizes
        mismatch = ok[sizes.sum(axis=1) + 4 * leaves != lengths[ok]]
        for j in mismatch.tolist():
            self.bad.setdefault(a + j, "the item's leaf sizes do not add up to its length (corrupt chunk)")
        for col, (name, fmt) in enumerate(zip(self.names, self.formats)):
            if fmt in _SCALARS:
                wrong = sizes[:, col] != _SCALARS[fmt][1]
                for j, got in zip(ok[wrong].tolist(), sizes[wrong, col].tolist()):
                    self.bad.setdefault(a + j, f"field {name!r}: a {fmt} leaf of {got} bytes, not {_SCALARS[fmt][1]}")
            elif fmt in ("numpy", "tensor", "pil") or fmt.startswith("no_header_"):
                for i in range(a, b):
                    if i not in self.bad:
                        self._note_array(i, col, data)

    def _leaf(self, i: int, col: int, data: Any) -> memoryview:
        start = int(self._item_start[i]) + 4 * len(self.formats) + int(self._leaf_sizes[i, :col].sum())
        return memoryview(data)[start : start + int(self._leaf_sizes[i, col])]

    def _array_header(self, i: int, col: int, leaf: memoryview) -> tuple[np.dtype, tuple[int, ...], int]:
        """(dtype, shape, where the elements start) of an array leaf, checked against its size."""
        name, fmt = self.names[col], self.formats[col]
        fixed = _array_dtype(fmt, name, self.path)
        if fixed is not None:
            if len(leaf) % fixed.itemsize:
                raise FormatError(f"field {name!r}: {len(leaf)} bytes is not a whole number of {fixed} items")
            return fixed, (len(leaf) // fixed.itemsize,), 0
        if fmt == "pil":
            if len(leaf) < 12:
                raise FormatError(f"field {name!r}: the PIL header is cut short")
            width, height, mode_len = struct.unpack_from("<III", leaf, 0)
            mode = bytes(leaf[12 : 12 + mode_len]).decode("ascii", "replace")
            if mode not in _PIL_MODES:
                raise FormatError(f"field {name!r}: PIL mode {mode!r} is not read (modes {sorted(_PIL_MODES)})")
            channels, code = _PIL_MODES[mode]
            return np.dtype(code), (height, width, *channels), 12 + mode_len
        big = fmt == "tensor"  # TensorSerializer: big-endian header; NumpySerializer: native (little-endian)
        if len(leaf) < 8:
            raise FormatError(f"field {name!r}: the array header is cut short")
        code, ndim = struct.unpack_from(">II" if big else "<II", leaf, 0)
        table = _TORCH_DTYPES if big else _NUMPY_DTYPES
        dtype = table[code] if code < len(table) else None
        if dtype is None:
            raise FormatError(f"field {name!r}: dtype code {code} is not a numeric numpy dtype fastload stores")
        if len(leaf) < 8 + 4 * ndim:
            raise FormatError(f"field {name!r}: the array header is cut short")
        shape = struct.unpack_from(f"{'>' if big else '<'}{ndim}I", leaf, 8)
        return np.dtype(dtype), tuple(shape), 8 + 4 * ndim

    def _note_array(self, i: int, col: int, data: Any) -> None:
        name = self.names[col]
        try:
            dtype, shape, start = self._array_header(i, col, self._leaf(i, col, data))
            if (len(self._leaf(i, col, data)) - start) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise FormatError(f"field {name!r}: shape {shape} of {dtype} does not match the leaf's size")
            seen = self._dtypes.setdefault(name, dtype)
            if seen != dtype:
                raise FormatError(f"field {name!r}: dtype {dtype}, where other samples have {seen}")
        except FormatError as exc:
            self.bad.setdefault(i, str(exc))
            return
        self._shapes.setdefault(name, []).append(shape)

    def _infer_schema(self) -> Schema:
        fields = []
        for name, fmt in zip(self.names, self.formats):
            if fmt in _SCALARS:
                fields.append(Field(name, "scalar", np.dtype(_SCALARS[fmt][0])))
            elif fmt in ("str", "text"):
                fields.append(Field(name, "string"))
            elif fmt == "bytes":
                fields.append(Field(name, "bytes"))
            elif fmt == "jpeg" or fmt.startswith("image:"):
                fields.append(Field(name, "image"))
            else:
                fields.append(self._array_field(name))
        return Schema(tuple(fields))

    def _array_field(self, name: str) -> Field:
        shapes = set(self._shapes.get(name, []))
        dtype = self._dtypes.get(name, np.dtype(np.uint8))
        if len(shapes) <= 1:
            shape = next(iter(shapes), (0,))
            return Field(name, "ndarray", dtype, shape) if shape else Field(name, "scalar", dtype)
        ranks = {len(s) for s in shapes}
        if len(ranks) > 1:
            raise FormatError(f"{self.path}: field {name!r} has arrays of ranks {sorted(ranks)}; fastload stores "
                              "one rank per field")
        if ranks == {1}:
            return Field(name, "varray", dtype)
        dims = tuple(VARIES if len({s[d] for s in shapes}) > 1 else next(iter(shapes))[d] for d in range(ranks.pop()))
        return Field(name, "vndarray", dtype, dims)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = int(i)
        if not 0 <= i < self._n:
            raise IndexError(f"sample index {i} out of range for {self._n} samples in {self.path}")
        problem = self.bad.get(i)
        if problem is not None:
            raise FormatError(f"{self.describe(i)}: {problem}")
        k = int(np.searchsorted(self._first, i, side="right") - 1)
        data = self._chunk_bytes(k)
        out: dict[str, Any] = {}
        for col, f in enumerate(self.schema):
            leaf, fmt = self._leaf(i, col, data), self.formats[col]
            if fmt in _SCALARS:
                out[f.name] = np.frombuffer(leaf, dtype=_SCALARS[fmt][0])[0]
            elif fmt in ("str", "text"):
                try:
                    out[f.name] = str(leaf, "utf-8")
                except UnicodeDecodeError as exc:
                    raise FormatError(f"{self.describe(i)}: field {f.name!r}: invalid UTF-8 ({exc.reason})") from exc
            elif f.kind in ("bytes", "image"):
                out[f.name] = bytes(leaf)
            else:
                dtype, shape, start = self._array_header(i, col, leaf)
                out[f.name] = np.frombuffer(leaf[start:], dtype=dtype).reshape(shape).copy()
        return out
