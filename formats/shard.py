"""One shard file: writing it atomically, and reading it through mmap with every offset checked.

Readers treat the file as untrusted: the header, the field table and every offsets table are
bounds-checked on open (vectorized), so a later gather can never read outside the file.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import xxhash

from .blocks import file_identity, missing_blocks, share_verified, verify_blocks, vouched
from .columns import Block
from .errors import ChecksumError, FormatError
from .layout import (
    BLOCK_LOG2,
    ENTRY_DTYPE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    READ_VERSIONS,
    SHARD_MAGIC,
    min_sample_bytes,
    section_table,
)
from .ragged import Ragged
from .schema import KIND_CODES, Schema
from .shapes import check_shapes
from .spliced import advise_huge, hold_while_mapped

try:  # optional C extension (setup.py): an offsets table checked in one pass
    from ._ranges import offsets_match as _offsets_match
except ImportError:  # pragma: no cover - built everywhere CI runs; the numpy checks below
    _offsets_match = None

if TYPE_CHECKING:
    from .storage import Arrival

__all__ = ["ShardIdentity", "ShardInfo", "ShardReader", "file_xxh3", "write_shard"]

_PAD = bytes(4096)


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records about one shard (`blocks_xxh3`: of its block checksum table, version 2)."""

    file: str
    num_samples: int
    bytes: int
    xxh3: str
    blocks_xxh3: str = ""


@dataclass(frozen=True)
class ShardIdentity:
    """Who a shard says it is (version 2 headers): checked against its place in the manifest."""

    dataset_id: int
    index: int
    first_sample: int


def file_xxh3(path: str, *, chunk: int = 8 << 20) -> str:
    """xxh3-64 of a whole file, hex."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while buf := fh.read(chunk):
            h.update(buf)
    return h.hexdigest()


class _HashingWriter:
    """Writes to a file, hashing the same bytes whole and per block of `1 << BLOCK_LOG2` bytes."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.pos, self.hash = fh, 0, xxhash.xxh3_64()
        self.block, self.block_sums = xxhash.xxh3_64(), []

    def write(self, data: bytes | memoryview | np.ndarray, *, blocks: bool = True) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        self.fh.write(view)
        self.hash.update(view)
        size = 1 << BLOCK_LOG2
        pos, done = self.pos, 0
        while blocks and done < len(view):
            take = min(size - pos % size, len(view) - done)
            self.block.update(view[done : done + take])
            done += take
            pos += take
            if pos % size == 0:
                self.block_sums.append(self.block.intdigest())
                self.block.reset()
        self.pos += view.nbytes

    def block_table(self) -> np.ndarray:
        """Checksums of every block written so far (the last one may be partial)."""
        sums = list(self.block_sums)
        if self.pos % (1 << BLOCK_LOG2):
            sums.append(self.block.intdigest())
        return np.array(sums, dtype="<u8")

    def pad_to(self, offset: int) -> None:
        assert offset >= self.pos
        while self.pos < offset:
            self.write(_PAD[: min(len(_PAD), offset - self.pos)])


def _joined_offsets(cols: list[Ragged]) -> np.ndarray:
    """The offsets table of several Ragged parts written one after another."""
    out = [np.zeros(1, dtype="<u8")]
    base = 0
    for col in cols:
        out.append((col.offsets[1:] - col.offsets[0] + base).astype("<u8"))
        base += len(col.values)
    return np.concatenate(out)


def write_shard(path: str, blocks: list[Block], schema: Schema, *, name: str, identity: ShardIdentity) -> ShardInfo:
    """Write `blocks` (consecutive samples) as one shard: to `path + '.tmp'`, fsync, then rename.

    Each field's parts are streamed straight from the blocks (no concatenated copy); the block
    checksum table is computed by reading the written bytes back. Returns the shard's manifest entry.
    """
    blobs = [0 if f.is_fixed else sum(b.columns[f.name].values.nbytes for b in blocks) for f in schema]
    n = sum(b.num_samples for b in blocks)
    table, end = section_table(schema, n, blobs)
    num_blocks = -(-end // (1 << BLOCK_LOG2))
    header = np.zeros(1, dtype=HEADER_DTYPE)
    header["magic"], header["version"] = SHARD_MAGIC, FORMAT_VERSION
    header["num_fields"], header["num_samples"], header["file_bytes"] = len(schema), n, end + 8 * num_blocks
    header["dataset_id"], header["first_sample"] = identity.dataset_id, identity.first_sample
    header["shard_index"], header["block_log2"], header["checksums_offset"] = identity.index, BLOCK_LOG2, end
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        out = _HashingWriter(fh)
        out.write(header.tobytes())
        out.write(table.tobytes())
        for k, f in enumerate(schema):
            entry = table[k]
            if f.has_fixed_column:
                out.pad_to(int(entry["fixed_offset"]))
                for b in blocks:
                    data = {"image": b.image_hw, "vndarray": b.shapes}.get(f.kind, b.columns)[f.name]
                    out.write(np.ascontiguousarray(data, dtype=f.dtype if f.is_fixed else np.uint32))
            if not f.is_fixed:
                cols = [b.columns[f.name] for b in blocks]
                out.pad_to(int(entry["offsets_offset"]))
                out.write(_joined_offsets(cols))
                out.pad_to(int(entry["blob_offset"]))
                for col in cols:
                    out.write(np.ascontiguousarray(col.values, dtype=f.dtype))
        out.pad_to(end)
        checksums = out.block_table()
        out.write(checksums, blocks=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return ShardInfo(
        file=name,
        num_samples=n,
        bytes=out.pos,
        xxh3=out.hash.hexdigest(),
        blocks_xxh3=xxhash.xxh3_64_hexdigest(checksums.tobytes()),
    )


def _section(buf: np.ndarray, offset: int, size: int, what: str, where: str) -> np.ndarray:
    if offset < 0 or size < 0 or offset + size > len(buf) or (size and offset < HEADER_DTYPE.itemsize):
        raise FormatError(
            f"{where}: {what} section [{offset}, {offset + size}) lies outside the file ({len(buf)} bytes)"
        )
    return buf[offset : offset + size]


def _open_map(path: str, nbytes: int, where: str, huge: bool = False) -> tuple[mmap.mmap, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise FormatError(f"{where}: shard file is missing") from exc
    except IsADirectoryError as exc:
        raise FormatError(f"{where}: is a directory, not a shard file") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{where}: not a regular file")
        if st.st_size != nbytes:
            raise FormatError(f"{where}: file is {st.st_size} bytes, manifest says {nbytes} (truncated or replaced?)")
        if st.st_size < HEADER_DTYPE.itemsize:
            raise FormatError(f"{where}: file too small for a shard header ({st.st_size} bytes)")
        hold_while_mapped(fd)
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        if huge:
            advise_huge(mm)
        return mm, st
    finally:
        os.close(fd)


class ShardReader:
    """A shard mapped read-only; `fixed[name]` and `ragged[name]` are zero-copy views into it.

    Opening checks the whole structure against the manifest (see FORMAT.md, "Reading"). With
    `bits` (this shard's part of the dataset's `BlockLedger`), a version-2 shard is read verified:
    the blocks holding the header, field table and offsets tables are verified on open, and the
    caller verifies the blocks a read touches before delivering it (`ensure_bytes`, `ensure_fields`).
    """

    on_corrupt: Callable[[ChecksumError], BaseException] | None = None  # set by the opener (see verify_blocks)
    on_lost: Callable[[BaseException], BaseException] | None = None  # set by the opener: an arrival that failed

    def __init__(
        self,
        path: str,
        schema: Schema,
        *,
        num_samples: int,
        nbytes: int,
        where: str | None = None,
        identity: ShardIdentity | None = None,
        blocks_xxh3: str | None = None,
        block_log2: int | None = None,
        lengths: dict[str, np.ndarray] | None = None,
        bits: Callable[[int], np.ndarray] | None = None,
        huge: bool = False,
        version: int | None = None,
        arrival: Arrival | None = None,
    ) -> None:
        """`identity`, `blocks_xxh3`, `block_log2`: what the manifest says this shard is (checked
        when given, for version-2 shards); `version`: the manifest's format version, which the
        shard's header must repeat (a version-2 shard's checksum table is read only under a
        version-2 manifest); `lengths`: this shard's per-sample lengths of each variable field from
        meta.bin (the offsets tables must agree); `bits`: called with the shard's number of checksum
        blocks once its table is located, returns this shard's verified-block bits (a version-2
        shard is then read verified); `huge`: read the file in huge-page units (`spliced.advise_huge`);
        `arrival` (with `bits`): the file is still arriving: every block is awaited before it is
        verified or read (`verify_blocks`), block 0 and the checksum table before opening."""
        self._path, self.schema = path, schema
        where = where or path
        self.where = where
        self.arrival = arrival
        if arrival is not None:
            arrival.wait(np.zeros(1, dtype=np.int64))  # the header's block (the table arrives before any block)
            self._mmap, st = self._open_arriving(arrival, nbytes, where, huge)
        else:
            self._mmap, st = _open_map(path, nbytes, where, huge)
        # the mapped file's identity: a file rewritten or replaced since has another
        self.file_key = file_identity(st)
        size = nbytes
        buf = np.frombuffer(self._mmap, dtype=np.uint8)
        # the bytes verification reads: kept past close(), like the views handed out (a reader
        # thread may still verify what it is about to read after another thread closed this reader)
        self._bytes = memoryview(buf)
        raw_header = buf[: HEADER_DTYPE.itemsize]
        header = dict(zip(HEADER_DTYPE.names, raw_header.view(HEADER_DTYPE)[0].item()))  # Python values
        if header["magic"] != SHARD_MAGIC:
            raise FormatError(f"{where}: bad magic {header['magic']!r}, not a fastload shard")
        self.version = header["version"]
        if self.version not in READ_VERSIONS:
            raise FormatError(f"{where}: format version {self.version}, this reader supports {list(READ_VERSIONS)}")
        if version is not None and self.version != version:
            raise FormatError(
                f"{where}: the shard is format version {self.version}, the manifest says version {version} "
                f"(a manifest's version must be its shards': edited manifest, or a shard from another dataset)"
            )
        self.table: np.ndarray | None = None  # block checksums (version 2)
        self._all_verified = False  # every block verified: reads skip the per-read check
        self._calls = 0
        self.shift = BLOCK_LOG2
        self.bits = None
        end = size
        self.sections_end = size  # where the checksummed bytes end (version 2: the checksum table starts)
        if self.version >= 2:
            end = self.sections_end = self._checksum_table(buf, header, size, blocks_xxh3, block_log2, where)
            assert self.table is not None
            verified = self.bits = None if bits is None else bits(len(self.table))
            if verified is not None and len(verified) != len(self.table):
                raise FormatError(f"{where}: {len(self.table)} checksum blocks, the ledger holds {len(verified)}")
            if verified is not None and blocks_xxh3 is not None:  # what this process verified of this very file
                share_verified((*self.file_key, blocks_xxh3), verified)
            if verified is not None and vouched(self.file_key):  # hashed whole against the manifest in this process
                verified[:] = True
            self._verify_range(0, HEADER_DTYPE.itemsize + ENTRY_DTYPE.itemsize * len(schema), ahead=True)
            if identity is not None:
                got = ShardIdentity(header["dataset_id"], header["shard_index"], header["first_sample"])
                if got != identity:
                    raise FormatError(
                        f"{where}: the shard says it is shard #{got.index} (samples from {got.first_sample}) "
                        f"of dataset {got.dataset_id:016x}; the manifest has it as shard #{identity.index} "
                        f"(samples from {identity.first_sample}) of dataset {identity.dataset_id:016x} "
                        f"(misplaced or swapped shard)"
                    )
        elif raw_header[32:].tobytes() != bytes(32):
            raise FormatError(f"{where}: version-1 header has non-zero reserved bytes")
        if header["num_fields"] != len(schema):
            raise FormatError(f"{where}: {header['num_fields']} fields in shard, schema has {len(schema)}")
        n = header["num_samples"]
        if n != num_samples:
            raise FormatError(f"{where}: {n} samples in shard header, manifest says {num_samples}")
        if header["file_bytes"] != size:
            raise FormatError(f"{where}: header says {header['file_bytes']} bytes, file has {size}")
        if n * min_sample_bytes(schema) > size:
            raise FormatError(f"{where}: {n} samples in shard header cannot fit in its {size} bytes")
        self.num_samples = n
        table = _section(buf, HEADER_DTYPE.itemsize, ENTRY_DTYPE.itemsize * len(schema), "field table", where)
        table = table.view(ENTRY_DTYPE)
        self._check_layout(table, n, end, where)
        self.fixed: dict[str, np.ndarray] = {}
        self.fixed_offset: dict[str, int] = {}  # file offset of each fixed column (validated above)
        self.ragged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.blob_offset: dict[str, int] = {}
        self.image_hw: dict[str, np.ndarray] = {}
        self.shapes: dict[str, np.ndarray] = {}  # vndarray fields: (n, ndim) per-sample shapes
        for f, values_of_entry in zip(schema, table.tolist()):
            entry = dict(zip(ENTRY_DTYPE.names, values_of_entry))  # Python values
            fw = f"{where}, field {f.name!r}"
            if f.has_fixed_column:
                col = _section(buf, int(entry["fixed_offset"]), n * f.item_bytes, "fixed column", fw)
                if not f.is_fixed:
                    self._verify_range(int(entry["fixed_offset"]), int(entry["fixed_offset"]) + n * f.item_bytes,
                                       ahead=True)
                if f.kind == "image":
                    self.image_hw[f.name] = col.view("<u4").reshape(n, 2)
                elif f.kind == "vndarray":
                    self.shapes[f.name] = col.view("<u4").reshape(n, len(f.shape))
                else:
                    self.fixed[f.name] = col.view(f.dtype).reshape(n, *f.shape)
                    self.fixed_offset[f.name] = int(entry["fixed_offset"])
            if not f.is_fixed:
                offsets = _section(buf, int(entry["offsets_offset"]), 8 * (n + 1), "offsets table", fw).view("<u8")
                self._verify_range(int(entry["offsets_offset"]), int(entry["offsets_offset"]) + 8 * (n + 1),
                                   ahead=True)
                blob = _section(buf, int(entry["blob_offset"]), int(entry["blob_bytes"]), "blob", fw)
                if int(entry["blob_bytes"]) % f.dtype.itemsize:
                    raise FormatError(f"{fw}: blob size is not a multiple of the {f.dtype} item size")
                values = blob.view(f.dtype)
                expected = None if lengths is None else lengths.get(f.name)
                agree = None if expected is None else np.ascontiguousarray(expected, dtype=np.int64)
                if _offsets_match is not None and _offsets_match(offsets.view(np.int64), agree, len(values)):
                    pass  # runs from 0 to the blob's end, never decreases, agrees with meta.bin: nothing to report
                elif offsets[0] != 0 or offsets[-1] != len(values):
                    raise FormatError(f"{fw}: offsets table must run from 0 to {len(values)} items")
                elif n and np.any(offsets[1:] < offsets[:-1]):
                    bad = int(np.flatnonzero(offsets[1:] < offsets[:-1])[0])
                    raise FormatError(f"{fw}: offsets decrease at sample {bad} (corrupt offsets table)")
                elif expected is not None:
                    diff = np.diff(offsets.view(np.int64))
                    if expected.shape != diff.shape or not np.array_equal(diff, expected):
                        bad = int(np.flatnonzero(diff != expected)[0]) if expected.shape == diff.shape else 0
                        raise FormatError(
                            f"{fw}: offsets table disagrees with meta.bin's lengths at local sample {bad} "
                            f"(corrupt offsets table or meta.bin)"
                        )
                self.ragged[f.name] = (offsets.view(np.int64), values)
                self.blob_offset[f.name] = int(entry["blob_offset"])
                if f.kind == "vndarray":
                    check_shapes(self.shapes[f.name], np.diff(offsets.view(np.int64)), f, fw)

    @property
    def arriving(self) -> bool:
        """Whether the mapped file is still arriving (its download has not completed)."""
        arrival = self.arrival
        return arrival is not None and not arrival.complete

    @property
    def path(self) -> str:
        """The mapped file's path (where an arriving file is now: it moves once, when it completes)."""
        return self._path if self.arrival is None else self.arrival.path

    @staticmethod
    def _open_arriving(arrival: Arrival, nbytes: int, where: str, huge: bool) -> tuple[mmap.mmap, os.stat_result]:
        """Map an arriving file: at its temp path, or where the download renamed it meanwhile."""
        path = arrival.path
        try:
            return _open_map(path, nbytes, where, huge)
        except FormatError:
            if arrival.path == path:
                raise
            return _open_map(arrival.path, nbytes, where, huge)

    def _checksum_table(
        self, buf: np.ndarray, header: dict[str, Any], size: int, blocks_xxh3: str | None, block_log2: int | None,
        where: str,
    ) -> int:
        """Locate and authenticate the block checksum table (`header`: the shard header's fields);
        returns where the sections end."""
        self.shift = int(header["block_log2"])
        if self.shift != (BLOCK_LOG2 if block_log2 is None else block_log2) or not 12 <= self.shift <= 30:
            raise FormatError(f"{where}: checksum block of 2**{self.shift} bytes, the dataset uses 2**{block_log2}")
        end = int(header["checksums_offset"])
        count = -(-end // (1 << self.shift))
        if end < HEADER_DTYPE.itemsize or end + 8 * count != size:
            raise FormatError(f"{where}: checksum table at {end} does not end the file ({size} bytes)")
        self.table = buf[end:].view("<u8")
        if blocks_xxh3 is not None and xxhash.xxh3_64_hexdigest(buf[end:]) != blocks_xxh3:
            raise ChecksumError(f"{where}: block checksum table does not match the manifest (corrupt shard)")
        return end

    def _check_layout(self, table: np.ndarray, n: int, end: int, where: str) -> None:
        """The field table must be exactly the canonical layout (FORMAT.md): sections in schema
        order, aligned, never overlapping, ending where the checksum table starts."""
        blobs = [0 if f.is_fixed else int(e) for f, e in zip(self.schema, table["blob_bytes"].tolist())]
        if max(blobs, default=0) <= end:  # the common case: the table is byte for byte the canonical one
            expected, stop = section_table(self.schema, n, blobs)
            if self.version < 2:
                expected["field_xxh3"] = 0
            if stop <= end and (self.version < 2 or stop == end) and table.tobytes() == expected.tobytes():
                return
        for f, entry in zip(self.schema, table):
            fw = f"{where}, field {f.name!r}"
            if int(entry["kind"]) != KIND_CODES[f.kind]:
                raise FormatError(f"{fw}: kind code {int(entry['kind'])} does not match schema kind {f.kind!r}")
            sizes = (int(entry["item_bytes"]), int(entry["fixed_bytes"]))
            if f.has_fixed_column and sizes != (f.item_bytes, n * f.item_bytes):
                raise FormatError(f"{fw}: fixed column size does not match {n} samples of {f.item_bytes} bytes")
        for f, blob in zip(self.schema, blobs):
            if blob > end:  # before it sizes the layout: a sum of such sizes would overflow the table's u64
                raise FormatError(f"{where}, field {f.name!r}: blob_bytes {blob} exceed the file's {end} bytes")
        expected, stop = section_table(self.schema, n, blobs)
        if stop > end or (self.version >= 2 and stop != end):
            raise FormatError(f"{where}: sections end at byte {stop}, past their space ({end} bytes)")
        for f, got, want in zip(self.schema, table, expected):
            for key in ("fixed_offset", "fixed_bytes", "offsets_offset", "blob_offset", "blob_bytes", "item_bytes"):
                if int(got[key]) != int(want[key]):
                    raise FormatError(
                        f"{where}, field {f.name!r}: {key} is {int(got[key])}, the layout puts it at {int(want[key])} "
                        f"(sections out of order, overlapping or moved: corrupt field table)"
                    )
            if bytes(got["reserved"]) != bytes(8):
                raise FormatError(f"{where}, field {f.name!r}: reserved bytes are not zero")
            if int(got["field_xxh3"]) != (int(want["field_xxh3"]) if self.version >= 2 else 0):
                raise FormatError(
                    f"{where}, field {f.name!r}: the shard was written for another definition of this field "
                    f"than the schema's {f.to_json()} (manifest edited or shard from another dataset)"
                )

    def content_xxh3(self) -> str:
        """xxh3-64 (hex) of the whole mapped file, as the manifest records it."""
        self._await_all()
        return xxhash.xxh3_64_hexdigest(self._bytes)

    # -- verified reads ----------------------------------------------------------------------------
    @property
    def verifying(self) -> bool:
        """Whether reads of this shard are verified (a version-2 shard opened with `bits`)."""
        return self.bits is not None

    @property
    def all_verified(self) -> bool:
        """Whether no read of this shard needs a block check any more (every block verified, or
        reads not verified at all)."""
        return self.bits is None or self._all_verified

    def ready_blocks(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """For reads that check blocks themselves: (ready, ledger). `ready`: one bool per block, True where a
        read may take the block as verified now, in an array that only ever gains blocks (an arriving
        file's: those its download verified and published; else those this process verified); None when
        every block is verified (or reads are not). `ledger`: this process's record of verified blocks, in
        which such a read sets the blocks it took from `ready` (as `verify_blocks` does for an arriving
        file), or None when `ready` is that record."""
        if self.all_verified:
            return None, None
        arrival = self.arrival
        return (arrival.published, self.bits) if arrival is not None else (self.bits, None)

    def verify_blocks(self, ids: np.ndarray, *, ahead: bool = False) -> None:
        """Verify the blocks `ids` (unique, local) now, whatever their bits say. A mismatch raises
        `on_corrupt(error)` when the opener set that hook (a cached copy: it says so), else the error.
        An arriving file's blocks are awaited first: blocks nobody fetches yet are fetched out of order
        for the wait, and with `ahead` also those the download's GETs would bring only later (else the
        wait follows those GETs, which stream the shard: out-of-order GETs cost requests and break the
        streams); those its download verified in this process are taken as verified (a failed download
        raises `on_lost(error)`, or the error)."""
        assert self.table is not None and self.bits is not None
        arrival = self.arrival
        if arrival is not None and self._arrived(arrival, ids, ahead):
            return
        try:
            verify_blocks(self._bytes[: self.sections_end], self.table, self.bits, ids, self.shift, self.where)
        except ChecksumError as exc:
            if self.on_corrupt is None:
                raise
            raise self.on_corrupt(exc) from exc

    def _arrived(self, arrival: Arrival, ids: np.ndarray, ahead: bool) -> bool:
        """Wait for blocks `ids` of the arriving file; True when its download verified them here (their
        bits are set: every bit, and the file is no longer arriving, once the download completed)."""
        assert self.bits is not None
        try:
            trusted = arrival.wait(ids, ahead=ahead)
        except Exception as exc:
            lost = exc if self.on_lost is None else self.on_lost(exc)
            if lost is exc:
                raise
            raise lost from exc
        if not trusted:
            return False
        if arrival.complete:
            self.bits[:] = True
            self._path, self.arrival = arrival.path, None
        else:
            self.bits[ids] = True
        return True

    def _await_all(self) -> None:
        """Wait until an arriving file is complete (whole-file reads)."""
        arrival = self.arrival
        if arrival is not None and self.table is not None:
            arrival.wait(np.arange(len(self.table)))

    def verify_all_blocks(self) -> None:
        """Verify every block of a version-2 shard (whatever this process verified before)."""
        self._await_all()
        if self.table is not None:
            scratch = np.zeros(len(self.table), dtype=bool)
            ids = np.arange(len(self.table))
            verify_blocks(self._bytes[: self.sections_end], self.table, scratch, ids, self.shift, self.where)

    def ensure_bytes(self, lo: np.ndarray, hi: np.ndarray, *, ahead: bool = False) -> None:
        """Verify every not-yet-verified block that the byte ranges [lo[i], hi[i]) touch (`ahead`: see
        `verify_blocks`)."""
        bits = self.bits
        if bits is None or self._all_verified:
            return
        missing = missing_blocks(lo, hi, self.shift, bits)
        self._calls += 1
        if missing.size:
            self.verify_blocks(missing, ahead=ahead)
        if missing.size or self._calls % 64 == 1:  # other readers of the file may have verified the rest
            assert self.table is not None
            self._all_verified = bool(bits[: len(self.table)].all())

    def _verify_range(self, lo: int, hi: int, *, ahead: bool = False) -> None:
        """Verify the not-yet-verified blocks under bytes [lo, hi)."""
        bits = self.bits
        if bits is None or self._all_verified or hi <= lo:
            return
        first, stop = lo >> self.shift, ((hi - 1) >> self.shift) + 1
        if stop <= len(bits) and bits[first:stop].all():
            return
        self.ensure_bytes(np.array([lo], dtype=np.int64), np.array([hi], dtype=np.int64), ahead=ahead)

    def rows_span(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges [lo, hi) of rows `rows` of fixed field `name`."""
        item = self.fixed[name].strides[0] if self.fixed[name].ndim else self.fixed[name].itemsize
        lo = self.fixed_offset[name] + rows.astype(np.int64, copy=False) * item
        return lo, lo + item

    def items_span(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges [lo, hi) of the items of rows `rows` of variable field `name`."""
        offs, values = self.ragged[name]
        lo = self.blob_offset[name] + offs[rows] * values.itemsize
        return lo, self.blob_offset[name] + offs[rows + 1] * values.itemsize

    def ensure_fields(self, fields: list[Any], rows: np.ndarray, *, ahead: bool = False) -> None:
        """Verify the blocks holding rows `rows` of `fields` (schema fields) in one pass: an arriving
        file waits for all of them at once, so the fetches of every field's blocks run together
        (`ahead`: see `verify_blocks`)."""
        if self.bits is None or self._all_verified:
            return
        self.ensure_bytes(*self._fields_span(fields, rows), ahead=ahead)

    def _fields_span(self, fields: list[Any], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges [lo, hi) of rows `rows` of `fields` (fixed: their rows; variable: their items)."""
        spans = [self.rows_span(f.name, rows) if f.is_fixed else self.items_span(f.name, rows) for f in fields]
        return np.concatenate([lo for lo, _ in spans]), np.concatenate([hi for _, hi in spans])

    def request_fields(self, fields: list[Any], rows: np.ndarray, *, ahead: bool = False) -> None:
        """Ask for the blocks `ensure_fields` would wait for, without waiting (an arriving file only):
        a batch over several arriving shards asks for each shard's blocks before it waits for any."""
        arrival, bits = self.arrival, self.bits
        if arrival is None or bits is None or self._all_verified:
            return
        missing = missing_blocks(*self._fields_span(fields, rows), self.shift, bits)
        if missing.size:
            arrival.ask(missing, ahead=ahead)

    def ensure_column(self, name: str) -> None:
        """Verify the blocks holding the whole column of fixed field `name`."""
        column = self.fixed[name]
        self._verify_range(self.fixed_offset[name], self.fixed_offset[name] + column.nbytes)

    def close(self) -> None:
        """Forget the mapping; it is unmapped once no reader or returned array refers to it.

        Views stay valid for anyone still holding this reader (e.g. a batch that spans more shards
        than the reader keeps open), and on POSIX a mapped file stays readable after a cache evicts it.
        """
        self._mmap = None
