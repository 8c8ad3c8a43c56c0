"""Files of the shard cache: `Download` (a temp file filled, hashed and checked as it arrives), the
verification stamp of a cached file, and key checks.

A download is hashed while it is written, so verifying it costs no second pass; `ShardCache`
renames it into `data/` only after `check` passed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time

import xxhash

from fastload.formats.errors import ChecksumError
from fastload.remote.transfer_stats import TransferStats

__all__ = ["Download", "check_key", "file_xxh3", "footprint", "in_use", "stamp"]


class Download:
    """Sink for one download: writes to the temp file and hashes the same bytes.

    A fetch callback writes the whole object with `write` in order, or in parts with `write_at`
    (ranged GETs arriving in any order; one mode per attempt, `reset` before a retry); `check`
    raises `ChecksumError` on a size or checksum mismatch. Bytes are hashed in file order as soon
    as they are contiguous from the start: a part that arrives in order is hashed from its buffer,
    later parts are read back from the page cache when the gap before them fills.
    """

    def __init__(self, path: str, *, size: int, xxh3: str, where: str, stats: TransferStats | None = None) -> None:
        self.path, self.size, self.xxh3, self.where = path, size, xxh3.lower(), where
        self._fh = open(path, "w+b")  # noqa: SIM115 - closed in close(); read back by `write_at`
        self._hash = xxhash.xxh3_64()
        self.written = 0
        self._hashed = 0  # bytes [0, _hashed) are in the running xxh3
        self._parts: dict[int, int] = {}  # start -> end of parts written past `_hashed`
        self.stats = stats if stats is not None else TransferStats()

    def reset(self) -> None:
        """Discard what was written (before a retry). An empty file is not truncated: on ext4,
        truncating a file to zero length (even an empty one) makes its `close` start the writeback of
        everything written after it (block allocation and I/O submission in the downloading thread)."""
        self._fh.seek(0)  # writes a failed write left buffered reach the file first
        if self.written or os.fstat(self._fh.fileno()).st_size:
            self._fh.truncate()
        self._hash.reset()
        self.written = self._hashed = 0
        self._parts.clear()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data` to the temp file and to the running xxh3 (`ChecksumError` past `size`)."""
        view = memoryview(data).cast("B")
        if self.written + view.nbytes > self.size:
            raise ChecksumError(f"{self.where}: more than the {self.size} bytes the manifest records")
        t0 = time.perf_counter()
        self._fh.write(view)
        t1 = time.perf_counter()
        self._hash.update(view)  # verified while received: `check` only compares the digest
        self.stats.add_many(write_s=t1 - t0, verify_s=time.perf_counter() - t1)
        self.written += view.nbytes
        self._hashed = self.written

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write one part at `offset` (parts must not overlap; any order) and hash what became contiguous."""
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if offset < self._hashed or end > self.size or offset in self._parts:
            raise ChecksumError(f"{self.where}: part [{offset}, {end}) overlaps another or passes {self.size} bytes")
        t0 = time.perf_counter()
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self._fh.fileno(), view[done:], offset + done)
        t1 = time.perf_counter()
        self.written += view.nbytes
        if offset == self._hashed:
            self._hash.update(view)
            self._hashed = end
        else:
            self._parts[offset] = end
        while self._hashed in self._parts:  # parts that arrived early, now contiguous: read back and hash
            stop = self._parts.pop(self._hashed)
            while self._hashed < stop:
                piece = os.pread(self._fh.fileno(), min(8 << 20, stop - self._hashed), self._hashed)
                if not piece:
                    raise ChecksumError(f"{self.where}: temp file shorter than the parts written to it")
                self._hash.update(piece)
                self._hashed += len(piece)
        self.stats.add_many(write_s=t1 - t0, verify_s=time.perf_counter() - t1)

    def check(self) -> None:
        """Raise `ChecksumError` unless exactly `size` bytes with the manifest's xxh3 were written."""
        if self.written != self.size or self._hashed != self.size:
            raise ChecksumError(f"{self.where}: got {self.written} bytes, the manifest records {self.size}")
        got = self._hash.hexdigest()
        if got != self.xxh3:
            raise ChecksumError(f"{self.where}: xxh3 {got} != {self.xxh3} recorded in the manifest")

    def finish(self, *, fsync: bool) -> None:
        """Flush and close the temp file; `fsync` forces it to the device first (timed as `fsync_s`)."""
        self._fh.flush()
        if fsync:
            t0 = time.perf_counter()
            os.fsync(self._fh.fileno())
            self.stats.add("fsync_s", time.perf_counter() - t0)
        self._fh.close()

    def close(self) -> None:
        """Close the temp file (idempotent)."""
        if not self._fh.closed:
            self._fh.close()


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
