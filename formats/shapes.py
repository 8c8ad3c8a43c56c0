"""Variable-shape array fields (`vndarray`): the batch form, and the checks on stored shapes.

A shard stores each sample's shape (`<u4[ndim]`) beside its flattened elements; a batch keeps the
same split (`ShapedBatch`: one flat buffer, offsets, shapes), from which it gives the nested form
(a list of arrays, each exactly as written) or the padded form (one array of the batch's largest
shape, plus the shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FormatError
from .schema import VARIES, Field

__all__ = ["ShapedBatch", "check_shapes"]

_LIMIT = 1 << 62  # products above this cannot match a stored element count


def check_shapes(shapes: np.ndarray, lengths: np.ndarray, f: Field, where: str) -> None:
    """Every stored shape (untrusted, (n, ndim)) must fit the schema's and hold exactly its
    sample's element count; raise naming `where` and the first bad local sample."""
    n = len(lengths)
    bad = np.zeros(n, dtype=bool)
    count = np.ones(n, dtype=np.int64)
    for d, want in enumerate(f.shape):
        dim = shapes[:, d].astype(np.int64)
        if want != VARIES:
            bad |= dim != want
        over = (dim > 0) & (count > _LIMIT // np.maximum(dim, 1))
        bad |= over
        count = np.where(over, 0, count * dim)
    bad |= count != lengths
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FormatError(
            f"{where}: local sample {i} has stored shape {tuple(int(x) for x in shapes[i])}, which does not fit "
            f"{f.shape} or its {int(lengths[i])} stored elements (corrupt shape column; run `fastload verify`)"
        )


@dataclass(frozen=True)
class ShapedBatch:
    """A batch of a `vndarray` field: sample i is ``values[offsets[i]:offsets[i + 1]]`` reshaped to
    ``shapes[i]``.

    `to_list()` gives the nested form (one array per sample); `padded(fill)` the padded form."""

    values: np.ndarray
    offsets: np.ndarray
    shapes: np.ndarray

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a batch of {len(self)}")
        i %= len(self)
        return self.values[self.offsets[i] : self.offsets[i + 1]].reshape(tuple(int(d) for d in self.shapes[i]))

    def to_list(self) -> list[np.ndarray]:
        """The nested form: every sample as an array of its own shape (views into `values`)."""
        return [self[i] for i in range(len(self))]

    def padded(self, fill: Any = 0) -> tuple[np.ndarray, np.ndarray]:
        """The padded form: ``(array, shapes)`` where `array` has shape ``(B, *max_shape)`` with
        sample i at ``array[i, :shapes[i][0], :shapes[i][1], ...]`` and `fill` elsewhere."""
        top = tuple(int(d) for d in self.shapes.max(axis=0)) if len(self) else (0,) * self.shapes.shape[1]
        out = np.full((len(self), *top), fill, dtype=self.values.dtype)
        for i in range(len(self)):
            sample = self[i]
            out[(i, *(slice(0, d) for d in sample.shape))] = sample
        return out, self.shapes.copy()
