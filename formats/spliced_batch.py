"""`SplicedBatch`: a batch of every field of a local dataset whose variable fields are spliced,
read with one ranged gather over all of each sample's byte ranges.

A mixed sample (a fixed record row, an encoded image, token ids) lies in one column per field.
Read field by field, a batch is one copy pass per field. Here the block checks of every field
run first (`SplicedColumn.row_numbers`, `SplicedRagged.ranges`: no unverified byte is copied),
then one `gather_fields` call copies, sample by sample with the GIL released once, each
sample's row and ranges into the batch's columns. Small resident fields (labels) stay one `take`.
"""

from __future__ import annotations

import numpy as np

from .ragged import gather_fields
from .spliced import SplicedColumn
from .spliced_ragged import SplicedRagged

__all__ = ["SplicedBatch"]


class SplicedBatch:
    """`batch(indices)` -> {field: column}, every field of `order` read from `resident` (in-memory
    arrays), `fixed` (spliced columns) or `ragged` (spliced variable fields)."""

    def __init__(
        self,
        order: list[str],
        *,
        resident: dict[str, np.ndarray],
        fixed: dict[str, SplicedColumn],
        ragged: dict[str, SplicedRagged],
    ) -> None:
        missing = [name for name in order if name not in resident and name not in fixed and name not in ragged]
        if missing:
            raise ValueError(f"fields {missing} are neither resident nor spliced")
        self.order, self.resident, self.fixed, self.ragged = order, resident, fixed, ragged

    def __call__(self, indices: np.ndarray) -> dict[str, object]:
        """The columns of the samples at `indices` (int64, negative ones from the end): (B, *shape)
        arrays for fixed fields, `Ragged` for variable ones. Raises IndexError for an index out of
        range and ChecksumError for a corrupt block, before any byte is copied."""
        out: dict[str, object] = {}
        jobs = []
        ones = None
        for name, column in self.fixed.items():
            rows = column.row_numbers(indices)  # bounds and blocks checked
            dst = np.empty((len(rows), *column.rows.shape[1:]), dtype=column.rows.dtype)
            if ones is None:
                ones = np.ones(len(rows), dtype=np.int64)
            jobs.append((column.rows, rows, ones, dst))
            out[name] = dst
        for name, field in self.ragged.items():
            starts, lengths = field.ranges(indices)  # bounds and blocks checked
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values = np.empty(int(offsets[-1]), dtype=field.items.rows.dtype)
            jobs.append((field.items.rows, starts, lengths, values))
            out[name] = field.batch(values, offsets, indices)
        for name, column in self.resident.items():
            out[name] = column.take(indices, axis=0)
        gather_fields(jobs)
        return {name: out[name] for name in self.order}
