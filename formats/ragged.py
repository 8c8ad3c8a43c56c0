"""`Ragged`: a batch of variable-length values as one flat buffer plus offsets.

Variable-size fields (bytes, strings, encoded images, token arrays) travel through the
batch path in this form, so a batch of them costs one gather and no per-sample Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import buffers as batch_buffers
from .errors import FormatError

try:  # optional C extension (setup.py): ranged copies with the GIL released, lists of bytes/str
    from ._ranges import gather as _c_gather
    from ._ranges import split as _c_split
except ImportError:  # pragma: no cover - built everywhere CI runs; slower fallbacks below
    _c_gather = _c_split = None

__all__ = ["Ragged", "gather_ranges"]

KINDS = ("bytes", "string", "image", "varray")


@dataclass(frozen=True)
class Ragged:
    """`values[offsets[i]:offsets[i + 1]]` is sample i.

    `kind` says how `to_list` materialises a sample: `bytes`/`image` -> bytes,
    `string` -> str (UTF-8), `varray` -> a 1-D numpy array of `values.dtype`.
    """

    values: np.ndarray
    offsets: np.ndarray
    kind: str = "varray"
    # where sample i came from, for errors (e.g. "DATASET/shards/F (shard k): sample N, field 'text'")
    origin: Callable[[int], str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Ragged kind must be one of {KINDS}, got {self.kind!r}")
        if self.offsets.ndim != 1 or len(self.offsets) == 0:
            raise ValueError("Ragged offsets must be a non-empty 1-D array")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's length in elements of `values` (bytes for bytes/string/image): `diff(offsets)`."""
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> Any:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a Ragged batch of {len(self)}")
        i %= len(self)
        part = self.values[self.offsets[i] : self.offsets[i + 1]]
        if self.kind in ("bytes", "image"):
            return np.asarray(part).tobytes()  # numpy values, or CPU tensors (a Loader's batch views)
        if self.kind == "string":
            try:
                return np.asarray(part).tobytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self._utf8_error(i, exc) from exc
        return part

    def _utf8_error(self, i: int, exc: UnicodeDecodeError) -> FormatError:
        where = self.origin(i) if self.origin is not None else f"sample {i} of a Ragged batch"
        return FormatError(f"{where}: invalid UTF-8 in a string field ({exc.reason}; corrupt? run `fastload verify`)")

    def to_list(self) -> list[Any]:
        """Every sample, materialised as `__getitem__` does; bytes and strings are copied once each
        out of the buffer, by one C call where the `_ranges` extension is built (else out of a
        memoryview, with no per-sample numpy call)."""
        bounds = np.ascontiguousarray(self.offsets, dtype=np.int64)
        values = self.values
        if self.kind == "varray":
            return [values[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        values = values if type(values) is np.ndarray else np.asarray(values)  # CPU tensors: zero copy
        try:
            if _c_split is not None and type(values) is np.ndarray and values.dtype == np.uint8 and values.ndim == 1:
                return _c_split(np.ascontiguousarray(values), bounds, self.kind == "string")
            view = np.ascontiguousarray(values, dtype=np.uint8).data
            pairs = zip(bounds[:-1].tolist(), bounds[1:].tolist())
            if self.kind == "string":
                return [str(view[a:b], "utf-8") for a, b in pairs]
            return [bytes(view[a:b]) for a, b in pairs]
        except UnicodeDecodeError:
            for i in range(len(self)):
                self[i]  # raises naming the first bad sample
            raise

    @classmethod
    def from_list(cls, items: list[Any], *, kind: str, dtype: Any = np.uint8) -> Ragged:
        """Build from per-sample values (bytes / str / 1-D arrays)."""
        if kind == "string":
            parts = [np.frombuffer(s.encode("utf-8"), np.uint8) for s in items]
        elif kind in ("bytes", "image"):
            parts = [np.frombuffer(bytes(b), np.uint8) for b in items]
        else:
            parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in items]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8 if kind != "varray" else dtype)
        return cls(values=values, offsets=offsets, kind=kind)


def gather_ranges(source: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`source[starts[i] : starts[i] + lengths[i]]` for every i, joined -> (values, offsets).

    `source` is 1-D; one copy of each range into one new buffer (recycled, `buffers.empty`), by the
    `_ranges` extension with the GIL released (else by `bytearray.join` over memoryview slices). Raises IndexError for a
    range outside `source` before copying anything.
    """
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if _c_gather is not None and source.flags.c_contiguous:
        values = batch_buffers.empty(max(int(offsets[-1]), 0), source.dtype)  # the C call checks the lengths
        _c_gather(source, starts, lengths, source.itemsize, values)
        return values, offsets
    n = len(source)
    if len(starts) and (starts.min() < 0 or lengths.min() < 0 or (starts + lengths).max() > n):
        bad = int(np.flatnonzero((starts < 0) | (lengths < 0) | (starts + lengths > n))[0])
        raise IndexError(f"range {bad} lies outside the source of {n} items")
    size = source.itemsize
    view = np.ascontiguousarray(source).view(np.uint8).data
    parts = [view[a:b] for a, b in zip((starts * size).tolist(), ((starts + lengths) * size).tolist())]
    return np.frombuffer(bytearray().join(parts), dtype=source.dtype), offsets
