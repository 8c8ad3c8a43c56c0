"""`index.json`: the dataset manifest, parsed as untrusted input.

It names the schema, every shard (relative path, sample count, byte size, xxh3), the
`meta.bin` sidecar holding per-sample lengths of variable fields and image sizes, so that
length bucketing and crop planning need no data reads, and (version 2) the `blocks.bin` sidecar
holding every shard's block checksum table, so that a remote reader verifies a shard as it
arrives without a GET of its table. The manifest checksums itself.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .blocks import table_span
from .errors import ChecksumError, FormatError
from .layout import BLOCK_LOG2, FORMAT_VERSION, READ_VERSIONS, min_sample_bytes
from .schema import Schema
from .shard import ShardInfo

__all__ = [
    "BLOCKS_NAME",
    "FORMAT_NAME",
    "MANIFEST_NAME",
    "MAX_FILE_BYTES",
    "META_NAME",
    "Manifest",
    "MetaColumn",
    "check_relative_path",
]

MANIFEST_NAME = "index.json"
META_NAME = "meta.bin"
BLOCKS_NAME = "blocks.bin"
FORMAT_NAME = "fastload-dataset"
MAX_FILE_BYTES = 2**63 - 1  # the largest file size (off_t) a POSIX file system can hold
_META_DTYPES = {"<i8", "<u4"}
_META_MAX_DIMS = 8
_DATASET_ID = re.compile(r"[0-9a-f]{16}")


def check_relative_path(name: Any, where: str) -> str:
    """Reject absolute paths, '..', backslashes and empty names: files must stay inside the dataset root."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise FormatError(f"{where}: invalid file name {name!r}")
    norm = posixpath.normpath(name)
    if (
        name.startswith("/")
        or norm.startswith("/")
        or norm == ".."
        or norm.startswith("../")
        or ".." in name.split("/")
    ):
        raise FormatError(f"{where}: file name {name!r} leaves the dataset root")
    return norm


@dataclass(frozen=True)
class MetaColumn:
    """One column of meta.bin: `name` (e.g. ``text.length``), numpy `dtype` string, `shape`, byte `offset`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Size of the column in meta.bin, in bytes."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass
class Manifest:
    """A dataset's `index.json`: schema, shards, meta.bin's table, attrs and identity (FORMAT.md)."""

    schema: Schema
    shards: list[ShardInfo]
    meta_file: str = META_NAME
    meta_bytes: int = 0
    meta_xxh3: str = ""
    meta_columns: list[MetaColumn] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    dataset_id: int = 0  # version 2: also in every shard header
    block_log2: int = BLOCK_LOG2  # version 2: checksum block size, log2
    blocks_file: str = ""  # version 2: every shard's block checksum table, in shard order ("": none)

    def table_offsets(self) -> np.ndarray:
        """Where each shard's block checksum table starts in `blocks_file`, and (last) its size: int64[n + 1]
        (version 2; a table is 8 bytes a block, its length follows from the shard's `bytes`)."""
        sizes = []
        for k, s in enumerate(self.shards):
            span = table_span(s.bytes, self.block_log2)
            if span is None:
                raise FormatError(f"shard #{k} ({s.file}): {s.bytes} bytes cannot hold a block checksum table")
            sizes.append(8 * span[1])
        out = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=out[1:])
        return out

    @property
    def num_samples(self) -> int:
        """Samples in the dataset: the sum over its shards."""
        return sum(s.num_samples for s in self.shards)

    def _body(self) -> dict[str, Any]:
        shards = [{"file": s.file, "num_samples": s.num_samples, "bytes": s.bytes, "xxh3": s.xxh3} for s in self.shards]
        extra: dict[str, Any] = {}
        if self.version >= 2:
            for entry, s in zip(shards, self.shards):
                entry["blocks_xxh3"] = s.blocks_xxh3
            extra = {"dataset_id": f"{self.dataset_id:016x}", "block_log2": self.block_log2}
            if self.blocks_file:
                extra["blocks"] = {"file": self.blocks_file, "bytes": int(self.table_offsets()[-1])}
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            **extra,
            "num_samples": self.num_samples,
            "schema": self.schema.to_json(),
            "shards": shards,
            "meta": {
                "file": self.meta_file,
                "bytes": self.meta_bytes,
                "xxh3": self.meta_xxh3,
                "columns": [
                    {"name": c.name, "dtype": c.dtype, "shape": list(c.shape), "offset": c.offset}
                    for c in self.meta_columns
                ],
            },
            "attrs": self.attrs,
        }

    def dumps(self) -> bytes:
        """The manifest as `index.json` bytes, with its checksum over the canonical JSON."""
        body = self._body()
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["checksum"] = xxhash.xxh3_64_hexdigest(canonical)
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def loads(cls, data: bytes, *, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and check `index.json` bytes (untrusted: every field checked); errors name `where`."""
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:  # not JSON, an integer of over 4300 digits, nesting too deep
            raise FormatError(f"{where}: not valid JSON ({type(exc).__name__}: {exc!s:.200})") from exc
        if not isinstance(body, dict):
            raise FormatError(f"{where}: manifest must be a JSON object")
        if body.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a fastload manifest (format={body.get('format')!r})")
        version = body.get("version")
        if type(version) is not int or version not in READ_VERSIONS:
            raise FormatError(f"{where}: format version {version!r}, this reader supports {list(READ_VERSIONS)}")
        checksum = body.pop("checksum", None)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        if checksum != xxhash.xxh3_64_hexdigest(canonical):
            raise ChecksumError(f"{where}: manifest checksum mismatch (edited or corrupted)")
        try:
            schema = Schema.from_json(body["schema"])
            if not isinstance(body["shards"], list):
                raise TypeError("shards must be a list")
            shards = [_shard_info(s, where, k, version) for k, s in enumerate(body["shards"])]
            meta = body["meta"]
            columns = [_meta_column(c, where) for c in meta["columns"]]
            manifest = cls(
                schema=schema,
                shards=shards,
                meta_file=check_relative_path(meta["file"], f"{where} meta"),
                meta_bytes=_size(meta["bytes"], f"{where} meta bytes"),
                meta_xxh3=str(meta["xxh3"]),
                meta_columns=columns,
                attrs=dict(body.get("attrs") or {}),
                version=version,
            )
            if version >= 2:
                dataset_id = body["dataset_id"]
                if not isinstance(dataset_id, str) or not _DATASET_ID.fullmatch(dataset_id):
                    raise FormatError(f"{where} dataset_id: expected 16 hex digits, got {dataset_id!r}")
                manifest.dataset_id = int(dataset_id, 16)
                manifest.block_log2 = _size(body["block_log2"], f"{where} block_log2", 12, 30)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from exc
        total = _size(body.get("num_samples"), f"{where} num_samples")
        if manifest.num_samples != total:
            raise FormatError(f"{where}: num_samples {total} != sum over shards {manifest.num_samples}")
        _check_shard_sizes(manifest, where)
        if version >= 2 and "blocks" in body:  # after the shards' sizes are known to add up to a file size
            manifest.blocks_file = _blocks_file(body["blocks"], manifest, where)
        for c in columns:
            if c.offset + c.nbytes > manifest.meta_bytes:
                raise FormatError(f"{where}: meta column {c.name!r} lies outside {manifest.meta_file}")
        return manifest

    def meta_arrays(self, data: bytes, *, where: str) -> dict[str, np.ndarray]:
        """Split and verify `meta.bin` into its named columns (read-only views)."""
        if len(data) != self.meta_bytes:
            raise FormatError(f"{where}: {len(data)} bytes, manifest says {self.meta_bytes}")
        if xxhash.xxh3_64_hexdigest(data) != self.meta_xxh3:
            raise ChecksumError(f"{where}: checksum mismatch")
        buf = np.frombuffer(data, dtype=np.uint8)
        out = {}
        for c in self.meta_columns:
            out[c.name] = buf[c.offset : c.offset + c.nbytes].view(c.dtype).reshape(c.shape)
        return out


def _blocks_file(entry: Any, manifest: Manifest, where: str) -> str:
    """The `blocks` entry's file, once its `bytes` equal the size of every shard's table together (the
    shards' sizes checked first: their tables' sizes then add up within an int64)."""
    if not isinstance(entry, dict):
        raise FormatError(f"{where} blocks: expected {{\"file\", \"bytes\"}}, got {entry!r:.80}")
    name = check_relative_path(entry.get("file"), f"{where} blocks")
    try:
        expected = int(manifest.table_offsets()[-1])
    except FormatError as exc:
        raise FormatError(f"{where} blocks: {exc}") from exc
    got = _size(entry.get("bytes"), f"{where} blocks bytes")
    if got != expected:
        raise FormatError(f"{where} blocks: {name} has {got} bytes, the shards' checksum tables take {expected}")
    return name


def _size(v: Any, where: str, low: int = 0, high: int = MAX_FILE_BYTES) -> int:
    """`v` when it is an integer (not a bool) in [low, high]; otherwise a FormatError naming `where`."""
    if type(v) is not int:
        raise FormatError(f"{where}: expected an integer, got {v!r:.60}")
    if not low <= v <= high:
        bounds = "2**63 - 1, the largest file size" if high == MAX_FILE_BYTES else str(high)
        raise FormatError(f"{where}: {v} is out of range [{low}, {bounds}]")
    return v


def _check_shard_sizes(manifest: Manifest, where: str) -> None:
    """Every shard's `bytes` must hold its `num_samples` (each sample takes the bytes of its fixed
    columns and one offset per variable field), and the dataset's sizes must add up to a file size."""
    per_sample = min_sample_bytes(manifest.schema)
    for k, s in enumerate(manifest.shards):
        if s.num_samples * per_sample > s.bytes:
            raise FormatError(
                f"{where} shard #{k} ({s.file}) num_samples: {s.num_samples} samples need at least "
                f"{s.num_samples * per_sample} bytes, the shard's bytes say {s.bytes}"
            )
    _size(sum(s.bytes for s in manifest.shards), f"{where}: the shards' bytes, summed")
    _size(manifest.num_samples, f"{where}: the shards' num_samples, summed")


def _shard_info(s: Any, where: str, k: int, version: int) -> ShardInfo:
    w = f"{where} shard #{k}"
    if not isinstance(s, dict):
        raise FormatError(f"{w}: malformed entry {s!r}")
    blocks = s.get("blocks_xxh3") if version >= 2 else ""
    if not isinstance(blocks, str):
        raise FormatError(f"{w}: malformed blocks_xxh3 {blocks!r}")
    file = check_relative_path(s.get("file"), w)
    w = f"{w} ({file})"
    return ShardInfo(
        file=file,
        num_samples=_size(s.get("num_samples"), f"{w} num_samples"),
        bytes=_size(s.get("bytes"), f"{w} bytes"),
        xxh3=str(s.get("xxh3")),
        blocks_xxh3=blocks,
    )


def _meta_column(c: Any, where: str) -> MetaColumn:
    if not isinstance(c, dict) or c.get("dtype") not in _META_DTYPES:
        raise FormatError(f"{where}: malformed meta column {c!r:.200}")
    w = f"{where} meta column {str(c.get('name'))!r:.80}"
    shape = c.get("shape", [])
    if not isinstance(shape, list) or len(shape) > _META_MAX_DIMS:
        raise FormatError(f"{w} shape: expected a list of at most {_META_MAX_DIMS} sizes, got {shape!r:.80}")
    dims = tuple(_size(d, f"{w} shape") for d in shape)
    return MetaColumn(name=str(c["name"]), dtype=c["dtype"], shape=dims, offset=_size(c.get("offset"), f"{w} offset"))
