"""Block checksums (format version 2): computing a shard's table, and verifying blocks on first touch.

Every shard stores one xxh3-64 per 64 KiB block of its bytes (FORMAT.md, "Block checksums").
A reader verifies a block the first time a read touches it and remembers that in a `BlockLedger`
(one bit per block of the dataset, per process), so later reads of it cost one vectorized
bitmap lookup per batch, and nothing once every block a column spans is verified.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import xxhash

from .errors import ChecksumError

__all__ = ["BlockLedger", "ColumnGuard", "block_ids", "file_identity", "share_verified", "verify_blocks", "vouch_file",
           "vouched"]


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


class BlockLedger:
    """Which blocks of a dataset's shards this process has verified.

    One bool per block, for all shards in one array (shard k's blocks start at `base[k]`), owned
    by the dataset; shard readers hold views of their part. Lock-free by design: a bit goes from
    False to True only after that block's bytes matched its checksum, and never back, so reader
    threads may test and set bits concurrently; two threads racing on one block both hash it,
    which is harmless. Not shared between processes: a process worker starts with a fresh ledger
    and verifies what it reads itself.
    """

    def __init__(self, max_blocks: list[int], shift: int, verify: Callable[[int, np.ndarray], None]) -> None:
        """`max_blocks[k]`: an upper bound on shard k's blocks; `verify(k, local_ids)` checks blocks
        of shard k (raising ChecksumError) and sets their bits."""
        self.shift = shift
        self.base = np.zeros(len(max_blocks) + 1, dtype=np.int64)
        np.cumsum(max_blocks, out=self.base[1:])
        self.bits = np.zeros(int(self.base[-1]), dtype=bool)
        self._verify = verify

    def shard_bits(self, k: int) -> np.ndarray:
        """Shard k's verified-block bits: a view into `bits` (not a copy), indexed by the shard's local
        block ids, so a shard reader sets bits in the shared ledger."""
        return self.bits[self.base[k] : self.base[k + 1]]

    def ensure(self, ids: np.ndarray) -> int:
        """Verify the blocks with global ids `ids` that are not verified yet; returns how many."""
        missing = ids[~self.bits[ids]]
        if not missing.size:
            return 0
        missing = np.unique(missing)
        shard_of = self.base.searchsorted(missing, side="right") - 1
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        for part in np.split(np.arange(len(missing)), cuts):
            k = int(shard_of[part[0]])
            self._verify(k, missing[part] - self.base[k])
        return len(missing)


def verify_blocks(
    buf: memoryview, table: np.ndarray, bits: np.ndarray, ids: np.ndarray, shift: int, where: str
) -> None:
    """Hash the blocks `ids` (local, unique) of `buf` against `table`, setting their `bits`;
    raise ChecksumError naming the byte range of the first that differs (its bit stays False)."""
    size, end = 1 << shift, len(buf)
    for j in ids.tolist():
        if j >= len(table):
            raise ChecksumError(f"{where}: block {j} lies past the checksum table (corrupt shard)")
        a = j * size
        b = min(a + size, end)
        if xxhash.xxh3_64_intdigest(buf[a:b]) != int(table[j]):
            raise ChecksumError(
                f"{where}: bytes [{a}, {b}) (block {j}) do not match their checksum: the shard is corrupt "
                f"(run `fastload verify`; re-convert or restore it)"
            )
        bits[j] = True


class ColumnGuard:
    """Verifies, through a `BlockLedger`, the blocks under rows of a fixed column spread over shards
    (a spliced column's virtual rows) before they are read; `done` once all of them are verified.

    `parts`: per shard in order `(shard, file offset of its column, virtual row of its first row,
    rows)`. Set as a `SplicedColumn.check`; the owner drops it once `done`.
    """

    RECHECK = 32  # calls between full recounts (another column may verify blocks shared with this one)

    def __init__(self, ledger: BlockLedger, parts: list[tuple[int, int, int, int]], row_bytes: int) -> None:
        self.ledger, self.row_bytes = ledger, row_bytes
        shift = ledger.shift
        self.vstarts = np.array([p[2] for p in parts], dtype=np.int64)
        # global byte of virtual row v in part k: origin[k] + v * row_bytes (shard k's blocks start at base[k])
        self.origin = np.array(
            [(int(ledger.base[k]) << shift) + off - vstart * row_bytes for k, off, vstart, _ in parts], dtype=np.int64
        )
        lo = np.array([(int(ledger.base[k]) << shift) + off for k, off, _, _ in parts], dtype=np.int64)
        hi = lo + np.array([n * row_bytes for _, _, _, n in parts], dtype=np.int64)
        self.needed = np.unique(block_ids(lo, hi, shift))
        self.done = False
        self._calls = 0
        self._recount()

    def _recount(self) -> None:
        self._left = int(np.count_nonzero(~self.ledger.bits[self.needed]))
        self.done = self._left == 0

    def __call__(self, rows: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Verify the blocks under virtual rows `rows` (with `counts`: under the runs of `counts[i]`
        rows from `rows[i]`, each within one part, as a variable field's items are)."""
        if self.done or not len(rows):
            return
        part = self.vstarts.searchsorted(rows, side="right") - 1
        lo = self.origin.take(part) + rows * self.row_bytes
        hi = lo + (self.row_bytes if counts is None else counts * self.row_bytes)
        verified = self.ledger.ensure(block_ids(lo, hi, self.ledger.shift))
        self._calls += 1
        self._left -= verified
        if self._left <= 0 or self._calls % self.RECHECK == 0:
            self._recount()
