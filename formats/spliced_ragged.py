"""`SplicedRagged`: a variable-length field over every shard, read as one ranged gather per batch.

The field's blobs (one per shard) are spliced into one array of items (`spliced.py`), and where
each sample's items start in it is kept per sample, from the index's lengths: a batch, in any
order and over any shards, is then two `take`s (starts, lengths), the block check, and one copy
of its ranges into one buffer (`gather_ranges`: C, GIL released) -> a `Ragged`. No per-sample
Python object is made.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from .errors import ChecksumError
from .ragged import Ragged, gather_ranges
from .spliced import SplicedColumn

__all__ = ["SplicedRagged"]


class SplicedRagged:
    """Samples of one variable field of kind `kind`, stored in `items` (a spliced blob of items).

    `lengths`: items per sample over the whole dataset (the index's, which every shard's offsets
    table was checked against when opened); `shard_starts`: first sample of each shard, plus the
    total. `check(starts, lengths)`, when set, sees the item runs of a batch before they are read
    (verifying the blocks under them); `where(sample, field)` names a sample for errors.
    """

    def __init__(
        self,
        *,
        name: str,
        kind: str,
        items: SplicedColumn,
        lengths: np.ndarray,
        shard_starts: np.ndarray,
        where: Callable[[int, str], str] | None = None,
    ) -> None:
        self.name, self.kind, self.items = name, kind, items
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        counts = np.diff(shard_starts)
        before = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=before[1:])
        # items.virtual_starts()[k] is where shard k's first item lies; before[i] - before[first of k]
        # is sample i's place within shard k's blob
        shard_first = np.repeat(before[shard_starts[:-1]] - items.virtual_starts(), counts)
        self.starts = before[:-1] - shard_first
        self.check: Callable[[np.ndarray, np.ndarray], None] | None = None
        self._where = where

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, indices: np.ndarray) -> Ragged:
        """The samples at `indices` (int64; negative ones count from the end) as one `Ragged`.

        Raises IndexError for an index out of range; `check` runs before any byte is copied.
        """
        starts = self.starts.take(indices)
        lengths = self.lengths.take(indices)
        check = self.check
        if check is not None:
            try:
                check(starts, lengths)
            except ChecksumError as exc:
                raise self._named(exc, indices, starts, lengths) from exc
        values, offsets = gather_ranges(self.items.rows, starts, lengths)
        origin = None if self._where is None else partial(_origin, self._where, self.name, indices, len(self))
        return Ragged(values, offsets, self.kind, origin=origin)


    def _named(self, exc: ChecksumError, indices: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> ChecksumError:
        """`exc` with the first sample of the batch whose items lie on a corrupt block named."""
        check = self.check
        for i in range(len(starts)):
            try:
                if check is not None:
                    check(starts[i : i + 1], lengths[i : i + 1])
            except ChecksumError as one:
                if self._where is not None:
                    index = int(indices[i]) % len(self)
                    return ChecksumError(f"{self._where(index, self.name)}: {one}")
                return one
        return exc


def _origin(where: Callable[[int, str], str], name: str, indices: np.ndarray, n: int, i: int) -> str:
    index = int(indices[i])
    return where(index + n if index < 0 else index, name)
