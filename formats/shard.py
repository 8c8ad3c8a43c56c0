"""One shard file: writing it atomically, and reading it through mmap with every offset checked.

Readers treat the file as untrusted: the header, the field table and every offsets table are
bounds-checked on open (vectorized), so a later gather can never read outside the file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import xxhash

from .columns import Block
from .errors import FormatError
from .layout import ALIGN, COLUMN_ALIGN, ENTRY_DTYPE, FORMAT_VERSION, HEADER_DTYPE, SHARD_MAGIC, align_up
from .ragged import Ragged
from .schema import KIND_CODES, Schema

__all__ = ["ShardInfo", "ShardReader", "file_xxh3", "write_shard"]

_PAD = bytes(ALIGN)


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records about one shard."""

    file: str
    num_samples: int
    bytes: int
    xxh3: str


def file_xxh3(path: str, *, chunk: int = 8 << 20) -> str:
    """xxh3-64 of a whole file, hex."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while buf := fh.read(chunk):
            h.update(buf)
    return h.hexdigest()


class _HashingWriter:
    """Writes to a file and hashes the same bytes, tracking the position."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.pos, self.hash = fh, 0, xxhash.xxh3_64()

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        self.fh.write(view)
        self.hash.update(view)
        self.pos += view.nbytes

    def pad_to(self, offset: int) -> None:
        assert offset >= self.pos
        while self.pos < offset:
            self.write(_PAD[: min(ALIGN, offset - self.pos)])


def _plan(blocks: list[Block], schema: Schema) -> tuple[np.ndarray, int]:
    """Field table with absolute offsets, and the total file size."""
    n = sum(b.num_samples for b in blocks)
    table = np.zeros(len(schema), dtype=ENTRY_DTYPE)
    pos = align_up(HEADER_DTYPE.itemsize + ENTRY_DTYPE.itemsize * len(schema))
    for k, f in enumerate(schema):
        entry = table[k]
        entry["kind"] = KIND_CODES[f.kind]
        if f.is_fixed or f.kind == "image":
            if f.kind == "ndarray":
                pos = align_up(pos, COLUMN_ALIGN)
            entry["item_bytes"] = f.item_bytes
            entry["fixed_offset"], entry["fixed_bytes"] = pos, n * f.item_bytes
            pos = align_up(pos + n * f.item_bytes)
        if not f.is_fixed:
            blob = sum(b.columns[f.name].values.nbytes for b in blocks)
            entry["offsets_offset"] = pos
            pos = align_up(pos + 8 * (n + 1))
            entry["blob_offset"], entry["blob_bytes"] = pos, blob
            pos = align_up(pos + blob)
    return table, pos


def _joined_offsets(cols: list[Ragged]) -> np.ndarray:
    """The offsets table of several Ragged parts written one after another."""
    out = [np.zeros(1, dtype="<u8")]
    base = 0
    for col in cols:
        out.append((col.offsets[1:] - col.offsets[0] + base).astype("<u8"))
        base += len(col.values)
    return np.concatenate(out)


def write_shard(path: str, blocks: list[Block], schema: Schema, *, name: str) -> ShardInfo:
    """Write `blocks` (consecutive samples) as one shard: to `path + '.tmp'`, fsync, then rename.

    Each field's parts are streamed straight from the blocks (no concatenated copy); returns the
    shard's manifest entry.
    """
    table, total = _plan(blocks, schema)
    n = sum(b.num_samples for b in blocks)
    header = np.zeros(1, dtype=HEADER_DTYPE)
    header["magic"], header["version"] = SHARD_MAGIC, FORMAT_VERSION
    header["num_fields"], header["num_samples"], header["file_bytes"] = len(schema), n, total
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        out = _HashingWriter(fh)
        out.write(header.tobytes())
        out.write(table.tobytes())
        for k, f in enumerate(schema):
            entry = table[k]
            if f.is_fixed or f.kind == "image":
                out.pad_to(int(entry["fixed_offset"]))
                for b in blocks:
                    data = b.image_hw[f.name] if f.kind == "image" else b.columns[f.name]
                    out.write(np.ascontiguousarray(data, dtype=np.uint32 if f.kind == "image" else f.dtype))
            if not f.is_fixed:
                cols = [b.columns[f.name] for b in blocks]
                out.pad_to(int(entry["offsets_offset"]))
                out.write(_joined_offsets(cols))
                out.pad_to(int(entry["blob_offset"]))
                for col in cols:
                    out.write(np.ascontiguousarray(col.values, dtype=f.dtype))
        out.pad_to(total)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return ShardInfo(file=name, num_samples=n, bytes=total, xxh3=out.hash.hexdigest())


def _section(buf: np.ndarray, offset: int, size: int, what: str, where: str) -> np.ndarray:
    if offset < 0 or size < 0 or offset + size > len(buf) or (size and offset < HEADER_DTYPE.itemsize):
        raise FormatError(
            f"{where}: {what} section [{offset}, {offset + size}) lies outside the file ({len(buf)} bytes)"
        )
    return buf[offset : offset + size]


class ShardReader:
    """A shard mapped read-only; `fixed[name]` and `ragged[name]` are zero-copy views into it."""

    def __init__(self, path: str, schema: Schema, *, num_samples: int, nbytes: int, where: str | None = None) -> None:
        self.path, self.schema = path, schema
        where = where or path
        self.where = where
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise FormatError(f"{where}: shard file is missing") from exc
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise FormatError(f"{where}: file is {size} bytes, manifest says {nbytes} (truncated or replaced?)")
            if size < HEADER_DTYPE.itemsize:
                raise FormatError(f"{where}: file too small for a shard header ({size} bytes)")
            self._mmap = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        buf = np.frombuffer(self._mmap, dtype=np.uint8)
        header = buf[: HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
        if bytes(header["magic"]) != SHARD_MAGIC:
            raise FormatError(f"{where}: bad magic {bytes(header['magic'])!r}, not a fastload shard")
        if int(header["version"]) != FORMAT_VERSION:
            raise FormatError(
                f"{where}: format version {int(header['version'])}, this reader supports {FORMAT_VERSION}"
            )
        if int(header["num_fields"]) != len(schema):
            raise FormatError(f"{where}: {int(header['num_fields'])} fields in shard, schema has {len(schema)}")
        n = int(header["num_samples"])
        if n != num_samples:
            raise FormatError(f"{where}: {n} samples in shard header, manifest says {num_samples}")
        if int(header["file_bytes"]) != size:
            raise FormatError(f"{where}: header says {int(header['file_bytes'])} bytes, file has {size}")
        self.num_samples = n
        table = _section(buf, HEADER_DTYPE.itemsize, ENTRY_DTYPE.itemsize * len(schema), "field table", where)
        table = table.view(ENTRY_DTYPE)
        self.fixed: dict[str, np.ndarray] = {}
        self.fixed_offset: dict[str, int] = {}  # file offset of each fixed column (validated above)
        self.ragged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.image_hw: dict[str, np.ndarray] = {}
        for f, entry in zip(schema, table):
            fw = f"{where}, field {f.name!r}"
            if int(entry["kind"]) != KIND_CODES[f.kind]:
                raise FormatError(f"{fw}: kind code {int(entry['kind'])} does not match schema kind {f.kind!r}")
            if f.is_fixed or f.kind == "image":
                if int(entry["item_bytes"]) != f.item_bytes or int(entry["fixed_bytes"]) != n * f.item_bytes:
                    raise FormatError(f"{fw}: fixed column size does not match {n} samples of {f.item_bytes} bytes")
                col = _section(buf, int(entry["fixed_offset"]), n * f.item_bytes, "fixed column", fw)
                if f.kind == "image":
                    self.image_hw[f.name] = col.view("<u4").reshape(n, 2)
                else:
                    self.fixed[f.name] = col.view(f.dtype).reshape(n, *f.shape)
                    self.fixed_offset[f.name] = int(entry["fixed_offset"])
            if not f.is_fixed:
                offsets = _section(buf, int(entry["offsets_offset"]), 8 * (n + 1), "offsets table", fw).view("<u8")
                blob = _section(buf, int(entry["blob_offset"]), int(entry["blob_bytes"]), "blob", fw)
                if int(entry["blob_bytes"]) % f.dtype.itemsize:
                    raise FormatError(f"{fw}: blob size is not a multiple of the {f.dtype} item size")
                values = blob.view(f.dtype)
                if offsets[0] != 0 or offsets[-1] != len(values):
                    raise FormatError(f"{fw}: offsets table must run from 0 to {len(values)} items")
                if n and np.any(offsets[1:] < offsets[:-1]):
                    bad = int(np.flatnonzero(offsets[1:] < offsets[:-1])[0])
                    raise FormatError(f"{fw}: offsets decrease at sample {bad} (corrupt offsets table)")
                self.ragged[f.name] = (offsets.view(np.int64), values)

    def close(self) -> None:
        """Forget the mapping; it is unmapped once no reader or returned array refers to it.

        Views stay valid for anyone still holding this reader (e.g. a batch that spans more shards
        than the reader keeps open), and on POSIX a mapped file stays readable after a cache evicts it.
        """
        self._mmap = None
