"""Files of the shard cache: `Download` (a temp file filled, hashed and checked as it arrives), the
verification stamp of a cached file, and key checks.

A download is hashed while it is written, so verifying it costs no second pass; `ShardCache`
renames it into `data/` only after `check` passed. A download with an `Arrival` publishes each
verified block as it arrives, for readers of the shard while it is still downloading.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time

import numpy as np
import xxhash

from fastload.formats.blocks import write_blocks
from fastload.formats.errors import ChecksumError
from fastload.remote.cache.arrival import Arrival
from fastload.remote.transfer_stats import TransferStats

__all__ = ["Download", "check_key", "disk_bytes", "file_xxh3", "footprint", "in_use", "stamp"]


class Download:
    """Sink for one download: writes to the temp file and verifies the same bytes.

    The temp file is created at its full size and every byte is written in place (`pwrite`), so a
    retry rewrites ranges and never shrinks a file a reader may map. A fetch callback writes the
    whole object with `write` in order, or in parts with `write_at` (ranged GETs arriving in any
    order; one mode per attempt, `reset` before a retry); `check` raises `ChecksumError` on a size
    or checksum mismatch.

    Two ways to verify:
    - whole (no `arrival`, or no table installed): bytes are hashed in file order as soon as they
      are contiguous from the start (a part that arrives in order is hashed from its buffer, later
      parts are read back from the page cache when the gap before them fills), and `check`
      compares the manifest's xxh3;
    - by block (an `arrival`, after `put_table` installed the shard's block checksum table, which
      must match the manifest's `blocks_xxh3`): bytes come in runs of whole blocks claimed in the
      arrival's ledger (`Arrival.claim_next`, `Arrival.claim_wanted`) and are written with
      `write_claimed`, from any thread; only the claim that holds a block writes it. Each block is
      hashed as it completes and checked against the table, then published to `arrival` (readers may
      read it from then on). A block that does not match fails its claim. A published block is never
      written again. `check` passes once every block is published: every byte then matched a
      checksum the manifest authenticates (the same guarantee as the whole-file xxh3, and one hash
      pass over the bytes, not two).
    """

    def __init__(
        self,
        path: str,
        *,
        size: int,
        xxh3: str,
        where: str,
        stats: TransferStats | None = None,
        arrival: Arrival | None = None,
    ) -> None:
        self.path, self.size, self.xxh3, self.where = path, size, xxh3.lower(), where
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(self._fd, size)  # full size up front: written in place from here on
        except BaseException:
            os.close(self._fd)
            raise
        self.arrival = arrival
        self._hash = xxhash.xxh3_64()
        self.written = 0  # bytes received in this attempt
        self._pos = 0  # where the next `write` goes
        self._hashed = 0  # whole mode: bytes [0, _hashed) are in the running xxh3
        self._parts: dict[int, int] = {}  # whole mode: start -> end of parts written past `_hashed`
        self._table: np.ndarray | None = None  # by-block mode: the authenticated checksum table
        self._sums: list[int] = []
        self._no_table = arrival is None
        self._filled = np.zeros(0 if arrival is None else len(arrival.published), dtype=np.int64)
        self._filler: dict[int, int] = {}  # block -> the claim whose bytes `_filled` counts
        # claim -> (offset, bytes) of the block its last piece ended inside, not counted in `_filled` yet
        self._tails: dict[int, tuple[int, memoryview]] = {}
        self.stats = stats if stats is not None else TransferStats()
        self._block_times = [0.0, 0.0]  # by-block mode: write_s and verify_s not in `stats` yet (added as claims end)
        self._lock = threading.Lock()  # by-block mode: writes and claim releases from several threads
        if arrival is not None:
            arrival.created(os.fstat(self._fd))

    # -- the block checksum table ------------------------------------------------------------------
    @property
    def wants_table(self) -> bool:
        """Whether the fetcher should hand over the block checksum table (`table_range`) before the body."""
        return not self._no_table and self._table is None

    @property
    def by_block(self) -> bool:
        """Whether the block checksum table is installed: bytes come through claims (`write_claimed`)."""
        return self._table is not None

    def table_range(self) -> tuple[int, int]:
        """[start, end) of the shard's block checksum table (its last bytes)."""
        assert self.arrival is not None
        return self.arrival.sections_end, self.size

    def put_table(self, data: bytes | bytearray | memoryview) -> None:
        """Install the block checksum table (`ChecksumError` unless it matches the manifest's
        `blocks_xxh3`): blocks are verified and published as they arrive from now on."""
        assert self.arrival is not None
        start, end = self.table_range()
        view = memoryview(data).cast("B")
        if view.nbytes != end - start:
            raise ChecksumError(f"{self.where}: block table of {view.nbytes} bytes, expected {end - start}")
        if xxhash.xxh3_64_hexdigest(view) != self.arrival.spec.blocks_xxh3.lower():
            raise ChecksumError(f"{self.where}: the block checksum table received does not match the manifest")
        _pwrite_all(self._fd, view, start)
        self._table = np.frombuffer(bytes(view), dtype="<u8")
        self._sums = self._table.tolist()  # plain ints: compared once per block

    def skip_table(self) -> None:
        """No table for this download (the store cannot send a range): verified whole, published at the end."""
        self._no_table = True

    # -- writes ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Discard this attempt's progress (before a retry); the file keeps its size and what was published."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._tails.clear()
        self._hash.reset()
        self.written = self._hashed = self._pos = 0
        self._parts.clear()
        if self.arrival is not None:
            self.arrival.progress()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write `data` after the previous `write` (`ChecksumError` past `size`)."""
        view = memoryview(data).cast("B")
        offset = self._pos
        if offset + view.nbytes > self.size:
            raise ChecksumError(f"{self.where}: more than the {self.size} bytes the manifest records")
        self._pos += view.nbytes
        self._put(offset, view)

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write one part at `offset` (parts must not overlap; any order)."""
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if (self._table is None and (offset < self._hashed or offset in self._parts)) or end > self.size or offset < 0:
            raise ChecksumError(f"{self.where}: part [{offset}, {end}) overlaps another or passes {self.size} bytes")
        self._put(offset, view)

    def write_claimed(self, claim: int, offset: int, data: bytes | bytearray | memoryview) -> bool:
        """By-block mode, from any thread: bytes of claim `claim` at `offset` (pieces of a claim in any
        order, not overlapping). Only the blocks the claim still holds are written; verified and published
        as they complete. Ignored once the download ended; a mismatch raises `ChecksumError` (the
        caller then `release`s the claim). Returns whether the GET should go on: the claim holds a block
        soon after where these bytes end (`Arrival.take`; False: the GET may stop here)."""
        view = memoryview(data).cast("B")
        arrival = self.arrival
        assert arrival is not None and self._table is not None
        end = offset + view.nbytes
        if offset < 0 or end > arrival.sections_end:
            raise ValueError(f"{self.where}: [{offset}, {end}) passes the blocks' end ({arrival.sections_end} bytes)")
        if not view.nbytes:
            return True
        shift = arrival.spec.shift
        first, last, upto = offset >> shift, (end - 1) >> shift, end >> shift
        with self._lock:
            if self._fd < 0:
                return False
            self.written += view.nbytes
            held, more = arrival.take(claim, first, upto)  # the blocks written, the one the next byte goes to
            mine = None if held is None else held[: last + 1 - first]
            if mine is None or mine.all():
                self._put_blocks(claim, offset, view)
            else:  # blocks taken over by another claim are left alone; each run of held ones in one call
                bounded = np.zeros(len(mine) + 2, dtype=bool)
                bounded[1:-1] = mine
                edges = np.flatnonzero(bounded[1:] != bounded[:-1]).tolist()  # each run's start and end
                for a, b in zip(edges[::2], edges[1::2]):
                    lo, hi = max(offset, (first + a) << shift), min(end, (first + b) << shift)
                    self._put_blocks(claim, lo, view[lo - offset : hi - offset])
        return more and end < arrival.sections_end

    def release(self, claim: int) -> None:
        """Claim `claim` ended (failed, cut short or taken back): its unpublished blocks' partial bytes
        are forgotten and the blocks are free in the ledger for another claim."""
        arrival = self.arrival
        assert arrival is not None
        with self._lock:
            self._add_block_times()
            self._tails.pop(claim, None)
            held = np.flatnonzero(arrival.owned(claim, 0, len(arrival.published)) & ~arrival.published)
            self._filled[held] = 0
            for j in self._filler.keys() & set(held.tolist()):
                del self._filler[j]
            arrival.unclaim(claim)

    def _add_block_times(self) -> None:
        """Add the time spent writing and verifying blocks since the last call to `stats` (caller holds `_lock`)."""
        write_s, verify_s = self._block_times
        if write_s or verify_s:
            self.stats.add_many(write_s=write_s, verify_s=verify_s)
            self._block_times = [0.0, 0.0]

    def _forget_partial(self, j: int) -> None:
        self._filled[j] = 0
        self._filler.pop(j, None)

    def _put(self, offset: int, view: memoryview) -> None:
        if self._table is not None:
            raise ValueError(f"{self.where}: a download verified by block is written through claims (`write_claimed`)")
        self.written += view.nbytes
        t0 = time.perf_counter()
        _pwrite_all(self._fd, view, offset)
        t1 = time.perf_counter()
        end = offset + view.nbytes
        if offset == self._hashed:
            self._hash.update(view)  # verified while received: `check` only compares the digest
            self._hashed = end
        else:
            self._parts[offset] = end
        while self._hashed in self._parts:  # parts that arrived early, now contiguous: read back and hash
            stop = self._parts.pop(self._hashed)
            while self._hashed < stop:
                piece = os.pread(self._fd, min(8 << 20, stop - self._hashed), self._hashed)
                if not piece:
                    raise ChecksumError(f"{self.where}: temp file shorter than the parts written to it")
                self._hash.update(piece)
                self._hashed += len(piece)
        self.stats.add_many(write_s=t1 - t0, verify_s=time.perf_counter() - t1)

    def _put_blocks(self, claim: int, offset: int, view: memoryview) -> None:
        """By-block mode: write claim `claim`'s bytes of unpublished blocks, verify each block they
        complete, publish it. The piece's bytes are written and the blocks it completes checked in
        one call (`write_blocks`); a block a piece ends inside is finished by the claim's next piece
        when that one continues it (`_tails`: the block's bytes so far, hashed with the next piece's),
        else counted byte by byte until complete (`_partial`)."""
        arrival = self.arrival
        assert arrival is not None and self._table is not None
        sections_end, shift = arrival.sections_end, arrival.spec.shift
        stop = min(offset + view.nbytes, sections_end)  # the table's own bytes are in place already
        if offset >= stop:
            return
        published = arrival.published
        size = 1 << shift
        first, last = offset >> shift, (stop - 1) >> shift
        carry = None
        tail = self._tails.pop(claim, None)
        if tail is not None:
            at, held = tail
            if at + held.nbytes == offset and stop >= min(at + size, sections_end):
                carry = held  # this piece completes the block the last one ended inside
            elif arrival.owned(claim, at >> shift, (at >> shift) + 1)[0]:  # else another claim fetches it anew
                self._count_partial(claim, at, held)
        done, bad, write_s, verify_s = write_blocks(self._fd, offset, view[: stop - offset], shift, sections_end,
                                                    self._table, published, carry)
        if bad >= 0:
            if done:
                arrival.publish(done)
            a, b = bad << shift, min((bad + 1) << shift, sections_end)
            raise ChecksumError(f"{self.where}: bytes [{a}, {b}) (block {bad}) received do not match their checksum")
        t0 = time.perf_counter()
        if offset & (size - 1) and carry is None:  # the piece starts inside a block another piece began
            done += self._count_partial(claim, offset, view[: min(stop, (first + 1) << shift) - offset])
        tail_at = last << shift
        if stop != sections_end and stop & (size - 1) and tail_at >= offset and not published[last]:
            # the piece ends inside a block it began: the claim's next piece is likely to finish it (unless
            # some of the block's later bytes are counted already: pieces may come in any order)
            # copied: the piece's buffer may be reused once this call returns (`HttpReceiver`)
            tail = (tail_at, memoryview(bytes(view[tail_at - offset : stop - offset])))
            if last in self._filler:
                done += self._count_partial(claim, *tail)
            else:
                self._tails[claim] = tail
        if done:
            arrival.publish(done)
        times = self._block_times  # added to `stats` when the claim ends (`release`): not a call per piece
        times[0] += write_s
        times[1] += verify_s + time.perf_counter() - t0

    def _count_partial(self, claim: int, lo: int, piece: memoryview) -> list[int]:
        """Bytes [lo, lo + len(piece)) of one block, for `claim`, counted towards that block (`_partial`):
        [the block] once all its bytes arrived and matched, else []."""
        arrival = self.arrival
        assert arrival is not None
        shift, end = arrival.spec.shift, arrival.sections_end
        j = lo >> shift
        a, b = j << shift, min((j + 1) << shift, end)
        if arrival.published[j]:
            return []
        digest = self._partial(claim, j, a, b, lo, lo + piece.nbytes, piece)
        if digest is None:
            return []
        if digest != self._sums[j]:
            raise ChecksumError(f"{self.where}: bytes [{a}, {b}) (block {j}) received do not match their checksum")
        return [j]

    def _partial(self, claim: int, j: int, a: int, b: int, lo: int, hi: int, piece: memoryview) -> int | None:
        """Bytes [lo, hi) of block j ([a, b)) arrived for `claim`, not in the order of a stream (that order
        goes through `_tails`): the block's digest, read back from the file, once all of it did, else
        None. Bytes an earlier claim left in the block (it was taken over) no longer count."""
        if self._filler.get(j, claim) != claim:
            self._forget_partial(j)
        self._filler[j] = claim
        self._filled[j] += hi - lo
        if self._filled[j] > b - a:
            raise ChecksumError(f"{self.where}: parts overlap in bytes [{a}, {b}) (block {j})")
        if self._filled[j] < b - a:
            return None
        self._filler.pop(j, None)
        return xxhash.xxh3_64_intdigest(os.pread(self._fd, b - a, a))

    def check(self) -> None:
        """Raise `ChecksumError` unless every byte arrived and matched the manifest (see the class)."""
        if self._table is not None:
            assert self.arrival is not None
            missing = np.flatnonzero(~self.arrival.published)
            if missing.size:
                raise ChecksumError(
                    f"{self.where}: {missing.size} blocks did not arrive (the first: block {int(missing[0])})"
                )
            return
        if self.written != self.size or self._hashed != self.size:
            raise ChecksumError(f"{self.where}: got {self.written} bytes, the manifest records {self.size}")
        got = self._hash.hexdigest()
        if got != self.xxh3:
            raise ChecksumError(f"{self.where}: xxh3 {got} != {self.xxh3} recorded in the manifest")

    def finish(self, *, fsync: bool) -> None:
        """Close the temp file; `fsync` forces it to the device first (timed as `fsync_s`)."""
        if fsync:
            t0 = time.perf_counter()
            os.fsync(self._fd)
            self.stats.add("fsync_s", time.perf_counter() - t0)
        self.close()

    def close(self) -> None:
        """Close the temp file (idempotent)."""
        with self._lock:
            self._add_block_times()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def file_xxh3(path: str) -> str:
    """xxh3-64 of a whole file, read in 8 MiB pieces."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        with contextlib.suppress(OSError):  # in use while hashed (see `in_use`)
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        while buf := fh.read(8 << 20):
            h.update(buf)
    return h.hexdigest()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


_BOOT = _boot_id()


def stamp(st: os.stat_result) -> list[int | str]:
    """What a verified file looked like. The boot id makes every file be re-hashed once after a
    reboot, so files written without fsync that a power loss damaged are caught."""
    return [st.st_size, st.st_mtime_ns, st.st_ino, _BOOT]


def check_key(key: str) -> str:
    """`key` when it is a plain file name (no '/', NUL, leading dot); `ValueError` otherwise."""
    if not key or "/" in key or "\x00" in key or key in (".", "..") or key.startswith("."):
        raise ValueError(f"invalid cache key {key!r}")
    return key


def footprint(size: int, block: int) -> int:
    """Bytes a file of `size` bytes occupies on a file system of `block`-byte blocks."""
    return -(-int(size) // block) * block


def disk_bytes(root: str) -> int:
    """Bytes of the files in a cache's `data/` and `tmp/` that exist together, at their sizes, never
    more. The listing is not atomic: `data/` is listed before and after `tmp/`, and a data file counts
    only when the same file (inode) is in both lists, so it existed all through the listing of `tmp/`
    (one evicted meanwhile never coexisted with a download created at its full size). A download
    renamed into `data/` while `data/` was first listed may be missed."""

    def sizes(folder: str) -> dict[tuple[str, int], int]:
        out = {}
        with os.scandir(folder) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    out[entry.name, entry.inode()] = entry.stat().st_size
        return out

    data = os.path.join(root, "data")
    before = sizes(data)
    downloads = sizes(os.path.join(root, "tmp"))
    after = sizes(data)
    return sum(downloads.values()) + sum(n for file, n in before.items() if file in after)


def in_use(path: str) -> bool:
    """Whether some process still maps or reads the file at `path`: shard readers hold a shared
    `flock` on the open file behind each mapping (`fastload.formats` takes it before mapping), which
    the kernel keeps until the last mapping and descriptor of that open file are gone, so an
    exclusive probe fails while any remains. False for a missing file, and where `flock` is not
    supported (nothing can be known there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # drops the probe's lock with the descriptor
    return False
