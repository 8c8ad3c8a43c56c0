"""`OpenColumns`: the fixed columns of a dataset's open shards, read by dataset index in one C call per field.

Before every shard of a remote dataset is at hand (a cold epoch) there is no column spliced over all
shards (`spliced.py`), and the general read finds each row's shard, waits for and verifies the blocks
under the batch, then copies, in some hundred Python calls a batch. Most batches of a cold epoch need
none of that: their shards are open and the blocks under their rows already verified (by this
process's download as they arrived, or by an earlier read). For those, `read` is one
`_ranges.take_sharded` call per field: it finds each row's shard, checks the blocks under the row in
that shard's record of verified blocks (`ShardReader.ready_blocks`), sets them in this process's
ledger of verified blocks when it took them from an arriving file's download (as the general read
does, so that columns spliced over the shards later find them verified), and copies the rows, the GIL
released; a batch with any row elsewhere (a shard not open, a block not verified yet, an index out of
range) gets None, having copied nothing, and is read the general way.

A shard is listed while its reader is open: the dataset adds it when the reader opens and removes it
before the reader closes, both under the dataset's lock, so no closed shard's mapping is kept alive
here (a shared cache counts a mapped shard against its budget until its last mapping goes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import buffers as batch_buffers
from .shard import ShardReader

try:
    from ._ranges import take_sharded as _c_take_sharded
except ImportError:  # pragma: no cover - a build without the C extension
    _c_take_sharded = None

__all__ = ["OpenColumns"]


class OpenColumns:
    """The fixed fields `fields` (schema fields) of the open shards of a dataset whose shard k holds
    samples [starts[k], starts[k + 1]), blocks of 2**block_log2 bytes."""

    def __init__(self, fields: list[Any], starts: np.ndarray, block_log2: int) -> None:
        count = len(starts) - 1
        self._starts, self._shift = starts, int(block_log2)
        # per field: name, row shape, dtype, row bytes, each shard's column (None: not listed), its offset in the file
        self._fields = [(f.name, tuple(f.shape), f.dtype, f.item_bytes, [None] * count, np.zeros(count, np.int64))
                        for f in fields]
        self._ready: list[np.ndarray | None] = [None] * count  # each listed shard's blocks verified so far
        self._ledger: list[np.ndarray | None] = [None] * count  # where blocks read from `_ready` are recorded

    @staticmethod
    def available() -> bool:
        """Whether the C extension that reads them is built."""
        return _c_take_sharded is not None

    def add(self, k: int, reader: ShardReader) -> None:
        """List shard k's open reader (caller holds the dataset's lock, and removes it before the reader closes)."""
        self._ready[k], self._ledger[k] = reader.ready_blocks()
        for name, _, _, _, columns, offsets in self._fields:
            offsets[k] = reader.fixed_offset[name]
            columns[k] = reader.fixed[name]

    def remove(self, k: int) -> None:
        """Shard k's reader closes (caller holds the dataset's lock): its columns are no longer read here."""
        for _, _, _, _, columns, _ in self._fields:
            columns[k] = None
        self._ready[k] = self._ledger[k] = None

    def read(self, indices: Any) -> dict[str, np.ndarray] | None:
        """Every field at `indices`, each into a recycled batch buffer (`buffers.empty`), when every row lies
        in a listed shard over verified blocks; else None (nothing to use: read the batch the general way)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        ready, ledger, starts, shift = self._ready, self._ledger, self._starts, self._shift
        out = {}
        for name, shape, dtype, row_bytes, columns, offsets in self._fields:
            col = batch_buffers.empty((len(idx), *shape), dtype)
            if _c_take_sharded(columns, starts, idx, row_bytes, col, ready, offsets, shift, ledger) >= 0:
                return None  # a field after the first fails only if a shard was removed meanwhile
            out[name] = col
        return out
