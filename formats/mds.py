"""MosaicML Streaming MDS datasets as a source, read without the streaming library.

`SRC` is a directory (local or an fsspec URL, read through `foreign.FileRanges`) with streaming's
``index.json`` and its ``.mds`` shards (``format: mds``; its
JSON/CSV/TSV shard formats are refused). A shard is ``uint32 n, uint32 offsets[n + 1], config
JSON, samples``; a sample holds a ``uint32`` size per variable-size column, then every column's
bytes in column order. Shards compressed by the writer are decompressed whole, once per process:
``gz``, ``bz2`` (standard library), ``zstd`` (``zstandard``, from ``fastload[migrate]``), ``br``
(``brotli``) and ``snappy`` (``python-snappy``) when those packages are installed. Hashes the
index records (hashlib's and xxhash's algorithms) are checked when a shard is first read.

Column encodings -> fields (``/`` in a column name becomes ``.``):

* ``int8`` ... ``uint64``, ``float16`` ... ``float64`` -> ``scalar`` of that dtype; ``int`` and
  ``str_int`` -> int64 ``scalar``; ``str_float`` -> float64 ``scalar``
* ``str`` -> ``string``; ``str_decimal`` -> ``string`` (the decimal's exact text); ``bytes`` -> ``bytes``
* ``jpeg``, ``png`` -> ``image`` (the stored bytes); ``pil`` (raw pixels) -> ``image`` re-encoded
  as PNG (lossless)
* ``ndarray:DTYPE:SHAPE`` -> ``ndarray``; ``ndarray`` / ``ndarray:DTYPE`` -> inferred from the
  first samples (fixed ``ndarray``, ``varray`` or ``vndarray``)
* ``json`` -> `JsonFields` (objects spread into ``COLUMN.KEY`` fields)
* refused by name: ``pkl`` (pickle: fastload never unpickles), ``list[pil]``, ``list[jpeg]``,
  ``list[png]``, ``jpeg_array`` (a variable list of images per sample: no field kind holds a list of
  byte strings); leave them out
  with `fields`
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ChecksumError, FormatError, SchemaError
from .foreign import INFER_SAMPLES, FileRanges, ForeignSource, JsonFields, utf8_text
from .image_folder import check_image
from .manifest import check_relative_path
from .schema import Field, Schema

__all__ = ["REFUSED_ENCODINGS", "MDSDataset", "is_mds_index"]

_SCALARS = {n: np.dtype(n) for n in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                      "float16", "float32", "float64")}
_SCALARS["int"] = np.dtype(np.int64)
_IMAGE_LIST = ("a variable-length list of images per sample: every fastload field holds one byte string or one "
               "array per sample (an `image` field one image), none a list of byte strings")
REFUSED_ENCODINGS = {
    "pkl": "pickle: fastload never unpickles dataset files",
    "list[pil]": _IMAGE_LIST,
    "list[jpeg]": _IMAGE_LIST,
    "list[png]": _IMAGE_LIST,
    "jpeg_array": _IMAGE_LIST,
    "jpegarray": _IMAGE_LIST,
}
# streaming's NDArray codes: value dtypes and shape dtypes
_ND_VALUES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
              34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_ND_SHAPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
_MAX_INDEX_BYTES = 256 << 20
_CACHED_SHARDS = 2  # decompressed shards kept per process


def is_mds_index(path: str) -> bool:
    """Whether the JSON file at `path` is a MosaicML Streaming index (a list of shards with formats)."""
    try:
        if os.path.getsize(path) > _MAX_INDEX_BYTES:
            return False
        with open(path, "rb") as fh:
            obj = json.load(fh)
    except (OSError, ValueError):
        return False
    shards = obj.get("shards") if isinstance(obj, dict) else None
    return isinstance(shards, list) and "format" not in obj and all(isinstance(s, dict) and "format" in s
                                                                     for s in shards)


@dataclass(frozen=True)
class _Column:
    name: str  # the field name
    column: str  # the MDS column name
    encoding: str
    size: int | None  # bytes per sample when fixed


@dataclass(frozen=True)
class _ShardEntry:
    raw: str  # path of the uncompressed shard
    raw_hashes: dict[str, str]
    zipped: str | None  # path of the compressed shard, when the index names one
    zip_hashes: dict[str, str]
    compression: str | None
    samples: int


def _fixed_size(encoding: str) -> int | None:
    if encoding in _SCALARS:
        return _SCALARS[encoding].itemsize
    if encoding.startswith("ndarray:"):
        parts = encoding.split(":")
        if len(parts) == 3:
            return int(np.prod([int(d) for d in parts[2].split(",")])) * np.dtype(parts[1]).itemsize
    return None


def _check_hashes(data: bytes, hashes: dict[str, str], where: str) -> None:
    import xxhash

    for algo, want in hashes.items():
        if algo in xxhash.algorithms_available:
            got = getattr(xxhash, algo)(data).hexdigest()
        elif algo in hashlib.algorithms_available and not algo.startswith("shake_"):
            got = hashlib.new(algo, data).hexdigest()
        else:
            continue  # an algorithm neither library has: nothing to check it with
        if got != want:
            raise ChecksumError(f"{where}: {algo} is {got}, the index records {want} (corrupt shard)")


def _decompress(codec: str | None, data: bytes, where: str) -> bytes:
    name = (codec or "").split(":")[0]
    try:
        if name == "gz":
            import gzip

            return gzip.decompress(data)
        if name == "bz2":
            import bz2

            return bz2.decompress(data)
        if name == "zstd":
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
                return reader.read()
        if name == "br":
            import brotli

            return brotli.decompress(data)
        if name == "snappy":
            import snappy

            return snappy.decompress(data)
    except ImportError as exc:
        package = {"zstd": "fastload[migrate]", "br": "brotli", "snappy": "python-snappy"}[name]
        raise ImportError(f"{where}: {name}-compressed MDS shards need {package}: pip install '{package}'") from exc
    except Exception as exc:  # noqa: BLE001 - each codec raises its own error type on corrupt input
        raise FormatError(f"{where}: cannot decompress ({name}: {exc})") from None
    raise FormatError(f"{where}: compression {codec!r} is not one fastload reads (gz, bz2, zstd, br, snappy)")


class MDSDataset(ForeignSource):
    """A MosaicML Streaming MDS directory as a map-style source (see the module docstring).

    `fields` keeps a subset (field names; a JSON column's name keeps all its keys); `decode_check`
    decodes every image fully as it is read.
    """

    def __init__(self, src: str, *, fields: Sequence[str] | None = None, decode_check: bool = True) -> None:
        self.src, self.decode_check = src, decode_check
        self.ranges = FileRanges()
        index_path = self.ranges.join(src, "index.json")
        if not self.ranges.isfile(index_path):
            raise FormatError(f"{src}: no index.json (an MDS dataset directory holds index.json and its shards)")
        if self.ranges.size(index_path) > _MAX_INDEX_BYTES:
            raise FormatError(f"{index_path}: larger than {_MAX_INDEX_BYTES} bytes; not an MDS index")
        try:
            index = json.loads(self.ranges.read_all(index_path))
        except (OSError, ValueError) as exc:
            raise FormatError(f"{index_path}: not valid JSON ({exc})") from exc
        self.shards, columns = self._read_index(index, index_path)
        counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        if self._starts[-1] == 0:
            raise FormatError(f"{index_path}: no samples")
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, tuple[np.ndarray, bytes | None]] = OrderedDict()
        self._pid = os.getpid()
        self.columns = columns  # every column, in the shard's order (all are needed to walk a sample)
        self.schema = self._infer(fields)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_lock": None, "_cache": OrderedDict(), "_pid": -1}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _read_index(self, index: Any, where: str) -> tuple[list[_ShardEntry], list[_Column]]:
        shards = index.get("shards") if isinstance(index, dict) else None
        if not isinstance(shards, list) or not shards:
            raise FormatError(f"{where}: no list of shards")
        entries, columns = [], None
        for k, s in enumerate(shards):
            at = f"{where}: shard {k}"
            if not isinstance(s, dict) or s.get("format") != "mds":
                fmt = s.get("format") if isinstance(s, dict) else s
                raise FormatError(f"{at}: format {fmt!r}; fastload reads streaming's MDS shards only")
            try:
                names, encodings, sizes = s["column_names"], s["column_encodings"], s["column_sizes"]
                raw = s["raw_data"]
                samples = int(s["samples"])
                shard_cols = [
                    _Column(str(n).replace("/", "."), str(n), str(e), None if z is None else int(z))
                    for n, e, z in zip(names, encodings, sizes, strict=True)
                ]
                zipped = s.get("zip_data")
                entry = _ShardEntry(
                    raw=self.ranges.join(self.src, check_relative_path(raw["basename"], at)),
                    raw_hashes=dict(raw.get("hashes") or {}),
                    zipped=(self.ranges.join(self.src, check_relative_path(zipped["basename"], at))
                            if zipped else None),
                    zip_hashes=dict((zipped or {}).get("hashes") or {}),
                    compression=s.get("compression"),
                    samples=samples,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise FormatError(f"{at}: malformed shard entry ({type(exc).__name__}: {exc})") from None
            if samples < 0 or any(c.size is not None and c.size != _fixed_size(c.encoding) for c in shard_cols):
                raise FormatError(f"{at}: a sample count or column size that does not fit its encoding")
            if columns is None:
                columns = shard_cols
            elif shard_cols != columns:
                raise FormatError(f"{at}: its columns differ from shard 0's "
                                  f"({[(c.column, c.encoding) for c in shard_cols]} vs "
                                  f"{[(c.column, c.encoding) for c in columns]})")
            entries.append(entry)
        assert columns is not None
        return entries, columns

    def describe(self, i: int) -> str:
        """The shard file and the sample's number in it."""
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        s = self.shards[k]
        name = s.zipped if s.zipped is not None and not self.ranges.isfile(s.raw) else s.raw
        return f"{name}: sample {i - int(self._starts[k])}"

    # ------------------------------------------------------------ shard bytes

    def _shard(self, k: int) -> tuple[np.ndarray, bytes | None]:
        """Shard k's sample offsets, and its decompressed bytes (None: read the raw file by range)."""
        if self._pid != os.getpid():
            self._lock, self._cache, self._pid = threading.Lock(), OrderedDict(), os.getpid()
        with self._lock:
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
            loaded = self._load(k)
            self._cache[k] = loaded
            if len(self._cache) > _CACHED_SHARDS:
                self._cache.popitem(last=False)
            return loaded

    def _load(self, k: int) -> tuple[np.ndarray, bytes | None]:
        s = self.shards[k]
        data: bytes | None = None
        if self.ranges.isfile(s.raw):
            if s.raw_hashes:
                _check_hashes(self.ranges.read_all(s.raw), s.raw_hashes, s.raw)
            size = self.ranges.size(s.raw)
            head = self.ranges.read(s.raw, 0, 4)
            n = int(np.frombuffer(head, "<u4")[0])
            table = self.ranges.read(s.raw, 4, 4 * (n + 1)) if 4 * (n + 2) <= size else b""
        elif s.zipped is not None and self.ranges.isfile(s.zipped):
            packed = self.ranges.read_all(s.zipped)
            _check_hashes(packed, s.zip_hashes, s.zipped)
            data = _decompress(s.compression, packed, s.zipped)
            _check_hashes(data, s.raw_hashes, s.zipped + " (decompressed)")
            size = len(data)
            n = int(np.frombuffer(data[:4], "<u4")[0]) if size >= 4 else -1
            table = data[4 : 4 * (n + 2)] if n >= 0 and 4 * (n + 2) <= size else b""
        else:
            raise FormatError(f"{s.raw}: the shard file is missing" + (f" (and {s.zipped})" if s.zipped else ""))
        where = s.raw if data is None else s.zipped
        if n != s.samples or len(table) != 4 * (n + 1):
            raise FormatError(f"{where}: holds {n} samples by its header, the index says {s.samples} (or truncated)")
        offsets = np.frombuffer(table, "<u4").astype(np.int64)
        if offsets[0] < 4 * (n + 2) or (np.diff(offsets) < 0).any() or offsets[-1] > size:
            raise FormatError(f"{where}: the sample offsets are out of order or past the file's {size} bytes (corrupt)")
        return offsets, data

    def _sample_bytes(self, i: int) -> bytes:
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        offsets, data = self._shard(k)
        j = i - int(self._starts[k])
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        return data[lo:hi] if data is not None else self.ranges.read(self.shards[k].raw, lo, hi - lo)

    def _split(self, blob: bytes) -> dict[str, bytes]:
        """Each column's bytes in one sample (sizes checked against the sample's length)."""
        variable = [c for c in self.columns if c.size is None]
        head = 4 * len(variable)
        if len(blob) < head:
            raise FormatError(f"the sample is {len(blob)} bytes, shorter than its column sizes (corrupt)")
        sizes = iter(np.frombuffer(blob[:head], "<u4").tolist())
        out, pos = {}, head
        for c in self.columns:
            n = c.size if c.size is not None else next(sizes)
            out[c.column] = blob[pos : pos + n]
            pos += n
        if pos != len(blob):
            raise FormatError(f"the columns' sizes add up to {pos} bytes, the sample is {len(blob)} (corrupt)")
        return out

    # ------------------------------------------------------------ fields

    def _infer(self, fields: Sequence[str] | None) -> Schema:
        keep = set(fields) if fields is not None else None
        chosen = [c for c in self.columns if keep is None or c.name in keep
                  or (c.encoding == "json" and any(k.startswith(f"{c.name}.") for k in keep))]
        for c in chosen:
            base = c.encoding.split(":")[0]
            if c.encoding in REFUSED_ENCODINGS or base not in (*_SCALARS, "str_int", "str_float", "str", "str_decimal",
                                                               "bytes", "jpeg", "png", "pil", "ndarray", "json"):
                why = REFUSED_ENCODINGS.get(c.encoding, "an encoding fastload does not know")
                raise FormatError(f"{self.src}: column {c.column!r} has encoding {c.encoding!r} ({why}); leave it out "
                                  f"with --fields (the columns: {[x.name for x in self.columns]})")
        self._chosen = chosen
        self._json: dict[str, JsonFields] = {}
        need_head = [c for c in chosen if c.encoding == "json" or (c.encoding.startswith("ndarray") and c.size is None)]
        head = self._head(need_head) if need_head else []
        out: list[Field] = []
        for c in chosen:
            enc = c.encoding
            if enc in _SCALARS:
                out.append(Field(c.name, "scalar", _SCALARS[enc]))
            elif enc == "str_int":
                out.append(Field(c.name, "scalar", np.dtype(np.int64)))
            elif enc == "str_float":
                out.append(Field(c.name, "scalar", np.dtype(np.float64)))
            elif enc in ("str", "str_decimal"):
                out.append(Field(c.name, "string"))
            elif enc == "bytes":
                out.append(Field(c.name, "bytes"))
            elif enc in ("jpeg", "png", "pil"):
                out.append(Field(c.name, "image"))
            elif enc == "json":
                jf = JsonFields(c.name, [h[c.column] for h in head])
                self._json[c.column] = jf
                out += [f for f in jf.fields() if keep is None or c.name in keep or f.name in keep]
            elif c.size is not None:  # ndarray:DTYPE:SHAPE
                _, dtype, shape = enc.split(":")
                out.append(Field(c.name, "ndarray", np.dtype(dtype), tuple(int(d) for d in shape.split(","))))
            else:
                arrays = [h[c.column] for h in head]
                out.append(Schema.infer([{c.name: a} for a in arrays]).fields[0])
        if fields is not None:
            names = [f.name for f in out]
            unknown = [f for f in fields if f not in names and f not in {c.name for c in chosen}]
            if unknown:
                raise SchemaError(f"{self.src}: no field {unknown[0]!r} to keep; the fields are "
                                  f"{[c.name for c in self.columns]}")
        if not out:
            raise SchemaError(f"{self.src}: no field left to convert")
        return Schema(tuple(out))

    def _head(self, columns: list[_Column]) -> list[dict[str, Any]]:
        """`columns` decoded in the first readable samples (a bad one is left to fail when converted)."""
        head: list[dict[str, Any]] = []
        first_error = None
        for i in range(len(self)):
            try:
                parts = self._split(self._sample_bytes(i))
                head.append({c.column: _json_value(parts[c.column], c.column) if c.encoding == "json"
                             else _ndarray(parts[c.column], c.encoding, c.column) for c in columns})
            except (FormatError, SchemaError) as exc:
                first_error = first_error or f"{self.describe(i)}: {exc}"
                continue
            if len(head) == INFER_SAMPLES:
                break
        if not head:
            raise FormatError(f"{self.src}: no readable sample (the first: {first_error})")
        return head

    def read(self, i: int) -> dict[str, Any]:
        """Sample `i` as a dict of the schema's fields."""
        parts = self._split(self._sample_bytes(i))
        names = set(self.schema.names)
        sample: dict[str, Any] = {}
        for c in self._chosen:
            raw, enc = parts[c.column], c.encoding
            if enc in _SCALARS:
                sample[c.name] = np.frombuffer(raw, _SCALARS[enc].newbyteorder("<"))[0]
            elif enc in ("str_int", "str_float"):
                sample[c.name] = _number(raw, enc, c.column)
            elif enc in ("str", "str_decimal"):
                sample[c.name] = utf8_text(raw, f"column {c.column!r}")
            elif enc == "bytes":
                sample[c.name] = raw
            elif enc in ("jpeg", "png"):
                if self.decode_check:
                    check_image(raw, f"column {c.column!r}")
                sample[c.name] = raw
            elif enc == "pil":
                sample[c.name] = _pil_png(raw, c.column)
            elif enc == "json":
                sample.update(self._json[c.column].values(_json_value(raw, c.column), names))
            else:
                sample[c.name] = _ndarray(raw, enc, c.column)
        return sample



def _number(raw: bytes, encoding: str, column: str) -> int | float:
    text = utf8_text(raw, f"column {column!r}")
    try:
        value: int | float = int(text) if encoding == "str_int" else float(text)
    except ValueError:
        raise SchemaError(f"column {column!r} ({encoding}) is {text[:40]!r}, not a number") from None
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise SchemaError(f"column {column!r} ({encoding}) is {text[:40]}, outside int64")
    return value


def _json_value(raw: bytes, column: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SchemaError(f"column {column!r} is not valid JSON ({exc})") from None


def _ndarray(raw: bytes, encoding: str, column: str) -> np.ndarray:
    """streaming's NDArray encoding: [dtype code] [ndim << 2 | shape dtype code] [shape] values; the
    parts the encoding string fixes are absent."""
    parts = encoding.split(":")
    dtype_name = parts[1] if len(parts) > 1 else None
    shape: tuple[int, ...] | None = tuple(int(d) for d in parts[2].split(",")) if len(parts) > 2 else None
    pos = 0
    try:
        if dtype_name is None:
            dtype_name = _ND_VALUES[raw[pos]]
            pos += 1
        if shape is None:
            ndim, code = raw[pos] >> 2, raw[pos] & 3
            pos += 1
            width = np.dtype(_ND_SHAPES[code]).itemsize
            shape = tuple(np.frombuffer(raw, _ND_SHAPES[code], ndim, pos).tolist())
            pos += ndim * width
    except (IndexError, KeyError, ValueError):
        raise SchemaError(f"column {column!r}: a malformed ndarray header (corrupt)") from None
    dtype = np.dtype(dtype_name).newbyteorder("<")
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - pos != count * dtype.itemsize:
        raise SchemaError(f"column {column!r}: {len(raw) - pos} bytes of values for shape {shape} of {dtype} "
                          f"({count * dtype.itemsize} expected; corrupt)")
    return np.frombuffer(raw, dtype, count, pos).reshape(shape)


def _pil_png(raw: bytes, column: str) -> bytes:
    """streaming's raw PIL encoding ([width, height, mode length] uint32, mode, pixels) as PNG bytes."""
    from PIL import Image

    try:
        width, height, mode_len = np.frombuffer(raw, "<u4", 3).tolist()
        mode = raw[12 : 12 + mode_len].decode("ascii")
        img = Image.frombytes(mode, (width, height), raw[12 + mode_len :])
        out = io.BytesIO()
        img.save(out, format="PNG")
    except (ValueError, OSError, UnicodeDecodeError, KeyError) as exc:
        raise SchemaError(f"column {column!r}: a raw PIL image that cannot be stored as PNG ({exc})") from None
    return out.getvalue()
