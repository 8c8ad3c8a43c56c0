"""One fixed-size column spread over many shard files, mapped as one array of rows.

A shuffled batch touches every shard. Gathering it shard by shard costs one `take` per shard plus
a pass that puts the rows back in the caller's order; a raw flat file needs one `take`. This module
maps each shard's column into one reserved range of address space, each part placed so that its
rows fall on one common grid: row `i` of the dataset is then row `i + shift[shard(i)]` of a single
numpy array, and a whole batch, in any order, is one `take`.

Linux only (it places mappings with `mmap(MAP_FIXED)` through libc); elsewhere, or when the parts
cannot be placed on a common grid, `splice_column` returns None and callers gather shard by shard.
The address range is unmapped when the last array viewing it is garbage-collected, so a reader
thread still inside a `take` never sees its memory disappear.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import math
import mmap
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import buffers as batch_buffers
from .rows import gather_rows

__all__ = [
    "ColumnPart", "OpenFiles", "SplicedColumn", "advise_huge", "hold_while_mapped", "splice_available", "splice_column",
]

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # placements congruent modulo this let the kernel map large page-cache folios whole
HUGE_RESERVE_LIMIT = 4 << 40  # past this much address space for one column, places are only page-aligned
TABLE_ROWS = 8 << 20  # columns up to this many rows keep a row -> virtual row table (8 bytes a row)
MAX_PARTS = 8192  # each part is one kernel mapping (vm.max_map_count is 65530 by default)

# Linux values (x86_64, aarch64, riscv64 share them).
_MADV_HUGEPAGE = 14
_PROT_READ = 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True)
class ColumnPart:
    """Rows `[0, num_rows)` of a column stored at byte `offset` of `path`."""

    path: str
    offset: int
    num_rows: int


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def splice_available() -> bool:
    """True where columns can be spliced (Linux, 64-bit, libc reachable through ctypes)."""
    return _LIBC is not None


def advise_huge(target: mmap.mmap | tuple[int, int]) -> None:
    """Ask the kernel to handle a file mapping (an `mmap.mmap`, or (address, length)) in huge-page
    units: a fault on a page not in the cache reads the whole aligned 2 MiB around it as one large
    page-cache folio, and later mappings of resident large folios take one fault per folio rather
    than one per 64 KiB. Best effort: a kernel without transparent huge pages ignores it."""
    if isinstance(target, mmap.mmap):
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # THP not built in: the mapping stays in small pages
                target.madvise(advice)
    elif _LIBC is not None:
        _LIBC.madvise(target[0], target[1], _MADV_HUGEPAGE)


def _layout(parts: list[ColumnPart], row_bytes: int, align: int) -> tuple[list[int], int, int] | None:
    """Where each part's mapping goes, relative to a reserved range that starts on `align`: a
    place congruent to the part's file offset modulo `align` (the kernel maps large page-cache
    folios only where the two agree), with its rows on the common grid. Returns the places, the
    byte where virtual row 0 starts, and the range's size; None when no common grid exists."""
    candidates = row_bytes // math.gcd(align, row_bytes)  # placements to try before the grid repeats
    places, base, end = [], 0, 0
    for k, part in enumerate(parts):
        lead = part.offset % PAGE
        map_offset = part.offset - lead
        first = end + (map_offset - end) % align  # smallest place >= end congruent to map_offset
        if k == 0:
            base = first + lead
        for j in range(candidates):
            place = first + j * align
            if (place + lead - base) % row_bytes == 0:
                places.append(place)
                break
        else:
            return None
        end = places[-1] + lead + part.num_rows * row_bytes
    return places, base, -(-end // PAGE) * PAGE


class SplicedColumn:
    """`rows` views every part on one grid; row `i` of the column (over all parts, in order) is
    `rows[i + shift[part of i]]`. Up to `TABLE_ROWS` rows, the virtual row of every row is kept in
    a table, so a batch costs two `take`s; above, the part is found by binary search."""

    def __init__(self, rows: np.ndarray, shift: np.ndarray, part_starts: np.ndarray, *, table: bool = True) -> None:
        """`table=False`: never keep the row table (a caller that locates rows itself)."""
        self.rows = rows
        self.check: Callable[[np.ndarray], None] | None = None  # sees every row number before it is read
        self.owner: Any = None  # what `check` needs alive while the column is in use (the dataset handing it out)
        self.shift = shift
        self.part_starts = part_starts  # first row of each part, plus the total
        n = int(part_starts[-1])
        self.table: np.ndarray | None = None
        if table and n <= TABLE_ROWS:
            counts = np.diff(part_starts)
            self.table = np.arange(n, dtype=np.int64) + np.repeat(shift, counts)

    def __len__(self) -> int:
        return int(self.part_starts[-1])

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Rows at `indices` (int64, negative ones counted from the end), in that order, in a new
        (recycled, `buffers.empty`) array.

        Raises IndexError for an index out of range.
        """
        rows = self.row_numbers(indices)
        return gather_rows(self.rows, rows, batch_buffers.empty((len(rows), *self.rows.shape[1:]), self.rows.dtype))

    def row_numbers(self, indices: np.ndarray) -> np.ndarray:
        """Where the rows at `indices` are in `rows` (`take` is `rows.take(row_numbers(indices), axis=0)`),
        passed to `check` (when set: e.g. verifying the blocks under them) before they are returned.

        Raises IndexError for an index out of range, so the result is always in bounds.
        """
        rows = self._row_numbers(indices)
        check = self.check
        if check is not None:
            check(rows)
        return rows

    def virtual_starts(self) -> np.ndarray:
        """The row of `rows` where each part's first row lies."""
        return self.part_starts[:-1] + self.shift

    def _row_numbers(self, indices: np.ndarray) -> np.ndarray:
        if self.table is not None:
            return self.table.take(indices)
        n = len(self)
        if len(indices):
            lo, hi = int(indices.min()), int(indices.max())
            if lo < -n or hi >= n:
                raise IndexError(f"index {lo if lo < -n else hi} is out of bounds for {n} rows")
            if lo < 0:
                indices = np.where(indices < 0, indices + n, indices)
        part = self.part_starts.searchsorted(indices, side="right") - 1
        return indices + self.shift[part]


def _reserve(libc: ctypes.CDLL, parts: list[ColumnPart], row_bytes: int) -> tuple[int, tuple | None]:
    """Reserve address space (read-only, gaps read as zeros) for the best placement that exists:
    huge-page congruent, else page-aligned. Returns (start, plan); plan None when none exists."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
    for align in (HUGE, PAGE):
        plan = _layout(parts, row_bytes, align)
        if plan is None or (align == HUGE and plan[2] > HUGE_RESERVE_LIMIT):
            continue
        total = plan[2]
        raw = libc.mmap(None, total + align, _PROT_READ, flags, -1, 0)
        if raw is None or raw == _MAP_FAILED:
            err = ctypes.get_errno()
            if align == PAGE:
                raise OSError(err, f"reserving {total} bytes of address space: {os.strerror(err)}")
            continue
        start = -(-raw // align) * align  # trim the range to [start, start + total)
        if start > raw:
            libc.munmap(raw, start - raw)
        if raw + align > start:
            libc.munmap(start + total, raw + align - start)
        return start, plan
    return 0, None


def hold_while_mapped(fd: int) -> None:
    """Take a shared `flock` on the open file behind `fd`, before mapping it: the kernel keeps it
    until the last descriptor and mapping of that open file are gone, so a shard cache can tell that
    a file is still mapped (its exclusive probe fails) and keep its blocks in its budget. Where
    `flock` is not supported, nothing is held."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


class OpenFiles:
    """Files opened read-only (and held, `hold_while_mapped`) once each for several mappings;
    `close()` closes them (the mappings keep what they need)."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        """The descriptor of `path`, opened on first use."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            hold_while_mapped(fd)
        return fd

    def close(self) -> None:
        """Close every descriptor opened here."""
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def splice_column(
    parts: list[ColumnPart],
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    table: bool = True,
    huge: bool = False,
    files: OpenFiles | None = None,
) -> SplicedColumn | None:
    """Map the parts of a fixed column as one `SplicedColumn`, or None where that is not possible.
    `table`: as for `SplicedColumn` (a variable field's blob, spliced as items of shape (), passes False);
    `huge`: `advise_huge` on the parts' mappings; `files`: map from these descriptors (a caller
    splicing several columns of the same files opens each once), else each file is opened here.

    Each part's file must hold `num_rows` rows of `dtype` x `shape` from `offset` on (callers pass
    columns of shards they have validated). Raises OSError when the kernel refuses a mapping.
    """
    libc = _LIBC
    row_bytes = int(np.dtype(dtype).itemsize * math.prod(shape))
    if libc is None or not parts or row_bytes == 0 or len(parts) > MAX_PARTS:
        return None
    start, plan = _reserve(libc, parts, row_bytes)
    if plan is None:
        return None
    places, base, total = plan
    opened = OpenFiles() if files is None else files
    try:
        for part, place in zip(parts, places):
            lead = part.offset % PAGE
            length = lead + part.num_rows * row_bytes
            if length == lead:
                continue
            fd = opened.fd(part.path)
            got = libc.mmap(start + place, length, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, part.offset - lead)
            if got != start + place:
                err = ctypes.get_errno()
                raise OSError(err, f"{part.path}: mapping its column failed: {os.strerror(err)}")
        if huge:  # one call for every part (and the gaps between them, which are never read)
            advise_huge((start, total))
    except BaseException:
        libc.munmap(start, total)
        raise
    finally:
        if files is None:
            opened.close()
    owner = (ctypes.c_char * total).from_address(start)
    weakref.finalize(owner, libc.munmap, start, total)  # runs once no array views the range
    num_virtual = (total - base) // row_bytes
    flat = np.frombuffer(owner, dtype=np.uint8, count=num_virtual * row_bytes, offset=base)
    rows = flat.view(dtype).reshape(num_virtual, *shape)
    rows.flags.writeable = False
    shift = np.array(
        [(place + part.offset % PAGE - base) // row_bytes for part, place in zip(parts, places)], dtype=np.int64
    )
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([p.num_rows for p in parts], out=starts[1:])
    return SplicedColumn(rows, shift - starts[:-1], starts, table=table)
