"""Block checksums (format version 2): computing a shard's table, and verifying blocks on first touch.

Every shard stores one xxh3-64 per 64 KiB block of its bytes (FORMAT.md, "Block checksums").
A reader verifies a block the first time a read touches it and remembers that in a `BlockLedger`
(one bit per block of the dataset, per process), so later reads of it cost one vectorized
bitmap lookup per batch, and nothing once every block a column spans is verified.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash

from .errors import ChecksumError

try:  # the C extension hashes a run of blocks in one call, GIL released (optional: a Python loop otherwise)
    from ._ranges import missing_blocks as _c_missing_blocks
    from ._ranges import write_blocks as _c_write_blocks
    from ._ranges import xxh3_blocks as _c_xxh3_blocks
except ImportError:  # pragma: no cover - a build without the C extension
    _c_xxh3_blocks = _c_write_blocks = _c_missing_blocks = None

__all__ = ["BlockLedger", "ColumnGuard", "block_digests", "block_ids", "file_identity", "missing_blocks",
           "share_verified", "table_span", "verify_blocks", "vouch_file", "vouched", "write_blocks"]


def block_digests(buf: bytes | bytearray | memoryview, ids: np.ndarray, shift: int, end: int) -> np.ndarray:
    """The xxh3-64 of each block `ids[i]` of `buf` (bytes [ids[i] << shift, min((ids[i] + 1) << shift,
    end))) as uint64, hashed in one C call with the GIL released where the extension is built."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty(len(ids), dtype=np.uint64)
    if _c_xxh3_blocks is not None:
        _c_xxh3_blocks(buf, ids, shift, end, out)
        return out
    view = memoryview(buf).cast("B")
    for i, j in enumerate(ids.tolist()):
        if j < 0 or j << shift >= end:
            raise ValueError(f"block {j} is outside the {end} bytes hashed")
        out[i] = xxhash.xxh3_64_intdigest(view[j << shift : min((j + 1) << shift, end)])
    return out


def write_blocks(fd: int, offset: int, piece: bytes | bytearray | memoryview, shift: int, end: int, table: np.ndarray,
                 published: np.ndarray, carry: bytes | bytearray | memoryview | None = None,
                 ) -> tuple[list[int], int, float, float]:
    """Write one received piece of a shard verified by block and check the blocks wholly inside it.

    `piece` holds the file's bytes [offset, offset + len(piece)) within [0, `end`) (where the
    checksummed sections end; blocks of 2**shift bytes, the last ending at `end`); `table`: the
    shard's block checksums (uint64), `published`: one bool per block, True for blocks verified
    already, which are neither written nor hashed again. The bytes of unpublished blocks are written
    to `fd` at their offsets; then each unpublished block wholly inside the piece is hashed and
    compared with `table`, in order, stopping at the first mismatch. Returns (the blocks that matched,
    the first that did not or -1, seconds writing, seconds hashing). Blocks the piece covers in part
    are written and left to the caller, but for `carry`: the bytes [offset - len(carry), offset),
    written already, that begin a block the piece completes (the previous piece of the same stream
    ended inside it): that block is hashed from `carry` and the piece and checked first. One C call
    with the GIL released where the extension is built."""
    if _c_write_blocks is not None:
        return _c_write_blocks(fd, offset, piece, shift, end, table, published, carry)
    view = memoryview(piece).cast("B")
    stop = offset + view.nbytes
    count = -(-end >> shift) if end else 0
    if offset < 0 or stop > end:
        raise ValueError(f"bytes [{offset}, {stop}) lie outside the sections' [0, {end})")
    held = memoryview(carry or b"").cast("B")
    carry_from = offset - held.nbytes
    if held.nbytes and (carry_from < 0 or carry_from % (1 << shift) or held.nbytes >= 1 << shift
                        or stop < min(carry_from + (1 << shift), end)):
        raise ValueError(f"carry [{carry_from}, {offset}) is not the start of a block that bytes up to {stop} complete")
    if len(table) != count or len(published) != count:
        raise ValueError(f"{count} blocks of 2**{shift} bytes end at {end}: table holds {len(table)}, "
                         f"published {len(published)}")
    if not view.nbytes:
        return [], -1, 0.0, 0.0
    t0 = time.perf_counter()
    first, last = offset >> shift, (stop - 1) >> shift
    for j in range(first, last + 1):
        if not published[j]:
            lo, hi = max(offset, j << shift), min(stop, (j + 1) << shift)
            while lo < hi:
                lo += os.pwrite(fd, view[lo - offset : hi - offset], lo)
    t1 = time.perf_counter()
    whole_lo, whole_hi = -(-offset >> shift), (last + 1 if stop == end else stop >> shift)
    done: list[int] = []
    bad = -1
    if held.nbytes and not published[carry_from >> shift]:
        c = carry_from >> shift
        digest = xxhash.xxh3_64(held)
        digest.update(view[: min(carry_from + (1 << shift), end) - offset])
        if digest.intdigest() != int(table[c]):
            return done, c, t1 - t0, time.perf_counter() - t1
        done.append(c)
    for j in range(whole_lo, whole_hi):
        if published[j]:
            continue
        a = j << shift
        if xxhash.xxh3_64_intdigest(view[a - offset : min(end, a + (1 << shift)) - offset]) != int(table[j]):
            bad = j
            break
        done.append(j)
    return done, bad, t1 - t0, time.perf_counter() - t1


_SEEN: dict[tuple, np.ndarray] = {}  # file identity + table checksum -> the latest ledger bits of that file
_SEEN_LOCK = threading.Lock()  # guards _SEEN and _WHOLE (the bit arrays themselves are monotone, see BlockLedger)
_WHOLE: dict[tuple, None] = {}  # identities of files this process hashed whole against the manifest's xxh3
_WHOLE_MAX = 1 << 16  # the oldest are dropped past this (a dropped one is verified per block again)


def _new_seen_lock_after_fork() -> None:
    """A child forked while a thread held `_SEEN_LOCK` would inherit it locked forever."""
    global _SEEN_LOCK
    _SEEN_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_seen_lock_after_fork)


def share_verified(key: tuple, bits: np.ndarray) -> None:
    """Take into `bits` (a shard's part of a ledger) what this process verified of the same file
    through other datasets, and make `bits` the record later ones take from.

    `key`: the file's (device, inode, size, mtime, ctime) and its table's checksum, so a file
    rewritten or replaced since is verified again. Within a process only: a forked worker
    inherits the record as of the fork (the same mapped pages), a spawned one starts empty.
    """
    with _SEEN_LOCK:
        seen = _SEEN.get(key)
        if seen is not None and seen is not bits and seen.shape == bits.shape:
            np.logical_or(bits, seen, out=bits)
        _SEEN[key] = bits


def file_identity(st: os.stat_result) -> tuple:
    """A file's (device, inode, size, mtime, ctime): any write, truncate or rename since gives another."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def vouch_file(st: os.stat_result) -> None:
    """Record that the file `st` describes matched its whole-file xxh3 from the manifest, hashed by this
    process (a shard cache's download or check): readers of that very file in this process then take
    every block as verified instead of hashing its bytes a second time. `st` must be taken before the
    hash began or after it ended, with nothing writing the file in between."""
    with _SEEN_LOCK:
        _WHOLE[file_identity(st)] = None
        if len(_WHOLE) > _WHOLE_MAX:
            del _WHOLE[next(iter(_WHOLE))]


def vouched(key: tuple) -> bool:
    """Whether `vouch_file` recorded the file whose `file_identity` is `key`."""
    with _SEEN_LOCK:
        return key in _WHOLE


def table_span(size: int, shift: int) -> tuple[int, int] | None:
    """(where the checksummed sections end, number of blocks) of a version-2 shard of `size` bytes
    with blocks of `2**shift` bytes: its checksum table (8 bytes a block) ends the file, so
    `end + 8 * ceil(end / 2**shift) == size` (at most one `end` fits); None when none does."""
    block = 1 << shift
    count = -(-size // (block + 8))  # size <= count * (block + 8) < size + block
    end = size - 8 * count
    if count < 1 or end < 1 or -(-end // block) != count:
        return None
    return end, count


def block_ids(lo: np.ndarray, hi: np.ndarray, shift: int) -> np.ndarray:
    """Every block that the byte ranges [lo[i], hi[i]) touch (with repeats; empty ranges touch none)."""
    keep = hi > lo
    if not keep.all():
        lo, hi = lo[keep], hi[keep]
    first = lo >> shift
    last = (hi - 1) >> shift
    counts = last - first + 1
    if not len(counts) or counts.max() <= 2:
        return np.concatenate([first, last])
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.repeat(first - (ends - counts), counts) + np.arange(total, dtype=np.int64)


def missing_blocks(lo: np.ndarray, hi: np.ndarray, shift: int, bits: np.ndarray) -> np.ndarray:
    """The blocks that the byte ranges [lo[i], hi[i]) touch whose entry in `bits` (one bool per block) is
    False, ascending and each once (int64): in one C call where the extension is built. IndexError for
    a range past the blocks `bits` covers."""
    lo = np.ascontiguousarray(lo, dtype=np.int64)
    hi = np.ascontiguousarray(hi, dtype=np.int64)
    if _c_missing_blocks is not None and bits.dtype == np.bool_ and bits.flags.c_contiguous:
        out = np.empty(len(bits), dtype=np.int64)
        return out[: _c_missing_blocks(lo, hi, shift, bits, out)]
    ids = block_ids(lo, hi, shift)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(bits)):
        raise IndexError(f"byte ranges reach block {int(ids.max())}, past the {len(bits)} blocks of 2**{shift} bytes")
    return np.unique(ids[~bits[ids]])


class BlockLedger:
    """Which blocks of a dataset's shards this process has verified.

    One bool per block, one array per shard, owned by the dataset; a shard's array is made when the
    shard is first opened, sized from its checksum table (so after its file was found to hold the
    size the manifest says: a manifest's size never sizes memory by itself), and shard readers hold
    it. Lock-free by design: a bit goes from False to True only after that block's bytes matched
    its checksum, and never back, so reader threads may test and set bits concurrently; two threads
    racing on one block both hash it, which is harmless. Not shared between processes: a process
    worker starts with a fresh ledger and verifies what it reads itself.
    """

    def __init__(self, num_shards: int, shift: int, verify: Callable[[int, np.ndarray], None]) -> None:
        """`verify(k, local_ids)` checks blocks of shard k (raising ChecksumError) and sets their bits."""
        self.shift = shift
        self._parts: list[np.ndarray | None] = [None] * num_shards
        self._verify = verify

    def shard_bits(self, k: int, count: int | None = None) -> np.ndarray:
        """Shard k's verified-block bits, indexed by its local block ids (the array readers set, not a
        copy); made with `count` blocks on the first call, which must give it (the shard's opening)."""
        part = self._parts[k]
        if part is None:
            if count is None:
                raise LookupError(f"shard {k} has not been opened: its block count is unknown")
            part = self._parts[k] = np.zeros(count, dtype=bool)
        return part

    def ensure(self, k: int, ids: np.ndarray) -> None:
        """Verify the blocks `ids` (local, unique) of opened shard k that are not verified yet."""
        bits = self.shard_bits(k)
        missing = ids[~bits[ids]]
        if missing.size:
            self._verify(k, missing)

    def verified_blocks(self) -> int:
        """How many blocks this process has verified, over all shards."""
        return sum(int(np.count_nonzero(p)) for p in self._parts if p is not None)


def verify_blocks(
    buf: memoryview, table: np.ndarray, bits: np.ndarray, ids: np.ndarray, shift: int, where: str
) -> None:
    """Hash the blocks `ids` (local, unique) of `buf` against `table`, setting their `bits`;
    raise ChecksumError naming the byte range of the first that differs (its bit stays False)."""
    ids = np.asarray(ids, dtype=np.int64)
    past = ids >= len(table)
    if past.any():
        raise ChecksumError(f"{where}: block {int(ids[past][0])} lies past the checksum table (corrupt shard)")
    size, end = 1 << shift, len(buf)
    bad = np.flatnonzero(block_digests(buf, ids, shift, end) != table[ids].astype(np.uint64, copy=False))
    good = ids if not bad.size else ids[: bad[0]]
    bits[good] = True  # blocks before the first that differs were checked
    if bad.size:
        j = int(ids[bad[0]])
        a, b = j * size, min(j * size + size, end)
        raise ChecksumError(
            f"{where}: bytes [{a}, {b}) (block {j}) do not match their checksum: the shard is corrupt "
            f"(run `fastload verify`; re-convert or restore it)"
        )


class ColumnGuard:
    """Verifies, through a `BlockLedger`, the blocks under rows of a fixed column spread over shards
    (a spliced column's virtual rows) before they are read; `done` once all of them are verified.

    `parts`: per shard in order `(shard, file offset of its column, virtual row of its first row,
    rows)`; every one of these shards must have been opened (its ledger bits exist). The guard numbers
    the blocks of its shards one after another (`seen`: which of them it knows to be verified, a
    subset of the ledger's bits, refreshed from them every `RECHECK` calls). Set as a
    `SplicedColumn.check`; the owner drops it once `done`.
    """

    RECHECK = 32  # calls between full recounts (another column may verify blocks shared with this one)

    def __init__(self, ledger: BlockLedger, parts: list[tuple[int, int, int, int]], row_bytes: int) -> None:
        self.ledger, self.row_bytes = ledger, row_bytes
        shift = ledger.shift
        self.shards = [k for k, _, _, _ in parts]
        self.bits = [ledger.shard_bits(k) for k in self.shards]
        # each part's column spans local blocks [first, stop) of its shard
        spans = [(off >> shift, ((off + n * row_bytes - 1) >> shift) + 1) if n * row_bytes else (0, 0)
                 for _, off, _, n in parts]
        self.done = all(bits[a:b].all() for bits, (a, b) in zip(self.bits, spans))
        if self.done:  # every block verified already (by this process): nothing to keep
            return
        self.base = np.zeros(len(parts) + 1, dtype=np.int64)  # part p's blocks: [base[p], base[p + 1])
        np.cumsum([len(b) for b in self.bits], out=self.base[1:])
        self.seen = np.zeros(int(self.base[-1]), dtype=bool)
        self.vstarts = np.array([p[2] for p in parts], dtype=np.int64)
        # the guard's byte of virtual row v in part p: origin[p] + v * row_bytes
        self.origin = np.array(
            [(int(self.base[p]) << shift) + off - vstart * row_bytes for p, (_, off, vstart, _) in enumerate(parts)],
            dtype=np.int64,
        )
        base = self.base.tolist()
        self.needed = np.concatenate(  # ascending and unique: the parts' block numbers do not overlap
            [np.zeros(0, dtype=np.int64)] + [np.arange(base[p] + a, base[p] + b) for p, (a, b) in enumerate(spans)]
        )
        self._calls = 0
        self._recount()

    def _recount(self) -> None:
        if len(self.bits):
            np.concatenate(self.bits, out=self.seen)
        self._left = int(np.count_nonzero(~self.seen[self.needed]))
        self.done = self._left == 0

    def __call__(self, rows: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Verify the blocks under virtual rows `rows` (with `counts`: under the runs of `counts[i]`
        rows from `rows[i]`, each within one part, as a variable field's items are)."""
        if self.done or not len(rows):
            return
        part = self.vstarts.searchsorted(rows, side="right") - 1
        lo = self.origin.take(part) + rows * self.row_bytes
        hi = lo + (self.row_bytes if counts is None else counts * self.row_bytes)
        ids = block_ids(lo, hi, self.ledger.shift)
        missing = ids[~self.seen[ids]]
        if missing.size:
            missing = np.unique(missing)
            part_of = self.base.searchsorted(missing, side="right") - 1
            firsts = np.flatnonzero(np.diff(part_of, prepend=-1))
            ends = [*firsts[1:].tolist(), len(missing)]
            for a, b, p in zip(firsts.tolist(), ends, part_of[firsts].tolist()):
                self.ledger.ensure(self.shards[p], missing[a:b] - self.base[p])
            self.seen[missing] = True
        self._calls += 1
        self._left -= missing.size
        if self._left <= 0 or self._calls % self.RECHECK == 0:
            self._recount()
