"""`index.json`: the dataset manifest, parsed as untrusted input.

It names the schema, every shard (relative path, sample count, byte size, xxh3), and the
`meta.bin` sidecar holding per-sample lengths of variable fields and image sizes, so that
length bucketing and crop planning need no data reads. The manifest checksums itself.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .errors import ChecksumError, FormatError
from .layout import BLOCK_LOG2, FORMAT_VERSION, READ_VERSIONS
from .schema import Schema
from .shard import ShardInfo

__all__ = ["FORMAT_NAME", "MANIFEST_NAME", "META_NAME", "Manifest", "MetaColumn", "check_relative_path"]

MANIFEST_NAME = "index.json"
META_NAME = "meta.bin"
FORMAT_NAME = "fastload-dataset"
_META_DTYPES = {"<i8", "<u4"}


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
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


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
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{where}: not valid JSON ({exc})") from exc
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
                meta_bytes=_nonneg_int(meta["bytes"], f"{where} meta bytes"),
                meta_xxh3=str(meta["xxh3"]),
                meta_columns=columns,
                attrs=dict(body.get("attrs") or {}),
                version=version,
            )
            if version >= 2:
                manifest.dataset_id = int(str(body["dataset_id"]), 16)
                manifest.block_log2 = _nonneg_int(body["block_log2"], f"{where} block_log2")
                if not 12 <= manifest.block_log2 <= 30:
                    raise FormatError(f"{where}: block_log2 {manifest.block_log2} out of range [12, 30]")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from exc
        if manifest.num_samples != body.get("num_samples"):
            raise FormatError(
                f"{where}: num_samples {body.get('num_samples')} != sum over shards {manifest.num_samples}"
            )
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


def _nonneg_int(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(f"{where}: expected a non-negative integer, got {v!r}")
    return v


def _shard_info(s: Any, where: str, k: int, version: int) -> ShardInfo:
    w = f"{where} shard #{k}"
    if not isinstance(s, dict):
        raise FormatError(f"{w}: malformed entry {s!r}")
    blocks = s.get("blocks_xxh3") if version >= 2 else ""
    if not isinstance(blocks, str):
        raise FormatError(f"{w}: malformed blocks_xxh3 {blocks!r}")
    return ShardInfo(
        file=check_relative_path(s.get("file"), w),
        num_samples=_nonneg_int(s.get("num_samples"), f"{w} num_samples"),
        bytes=_nonneg_int(s.get("bytes"), f"{w} bytes"),
        xxh3=str(s.get("xxh3")),
        blocks_xxh3=blocks,
    )


def _meta_column(c: Any, where: str) -> MetaColumn:
    if not isinstance(c, dict) or c.get("dtype") not in _META_DTYPES:
        raise FormatError(f"{where}: malformed meta column {c!r}")
    shape = tuple(_nonneg_int(s, f"{where} meta shape") for s in c.get("shape", []))
    return MetaColumn(name=str(c["name"]), dtype=c["dtype"], shape=shape, offset=_nonneg_int(c.get("offset"), where))
