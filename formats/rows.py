"""Row gathers: `gather_rows` (whole rows at given row numbers, in that order) and `take_rows_into`
(rows put straight into given places of a batch).

The C extension copies each row with one `memcpy`, the next rows' first cache lines prefetched,
the GIL released (`_ranges.take_rows`): for rows of a few hundred bytes or more that is faster
than `np.take` (which walks the rows through its generic strided loops); smaller rows, arrays
that are not C-contiguous and builds without the extension take `np.take`.
"""

from __future__ import annotations

import numpy as np

try:
    from ._ranges import take_rows as _c_take_rows
except ImportError:  # pragma: no cover - a build without the C extension
    _c_take_rows = None

__all__ = ["C_MIN_ROW_BYTES", "gather_rows", "take_rows_into"]

C_MIN_ROW_BYTES = 256  # rows at least this large are copied by the C extension (np.take is as fast below)


def gather_rows(src: np.ndarray, row_numbers: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`src.take(row_numbers, axis=0)`, written into `out` when given (C-contiguous, of the result's
    shape and dtype) and returned. IndexError for a row number outside `src` (nothing is copied)."""
    rows = np.ascontiguousarray(row_numbers, dtype=np.int64).reshape(-1)
    shape = (len(rows), *src.shape[1:])
    if out is None:
        out = np.empty(shape, dtype=src.dtype)
    elif out.shape != shape or out.dtype != src.dtype or not out.flags.c_contiguous:
        raise ValueError(f"rows of {src.dtype}{list(src.shape[1:])} cannot go into {out.dtype}{list(out.shape)}")
    row_bytes = src.itemsize * (src.size // len(src)) if len(src) else 0
    if _c_take_rows is not None and row_bytes >= C_MIN_ROW_BYTES and src.flags.c_contiguous:
        _c_take_rows((src,), None, rows, row_bytes, out)
        return out
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(src)):  # np.take would wrap negative ones
        bad = int(rows.min()) if int(rows.min()) < 0 else int(rows.max())
        raise IndexError(f"row {bad} is out of bounds for {len(src)} rows")
    return src.take(rows, axis=0, out=out, mode="clip")


def take_rows_into(src: np.ndarray, rows: np.ndarray, out: np.ndarray, places: np.ndarray) -> None:
    """`out[places[i]] = src[rows[i]]` along the first axis: rows gathered straight into their places in
    the batch (one copy; C-contiguous `src` and `out` of one row layout). IndexError for a row or
    place out of range."""
    if out.shape[1:] != src.shape[1:] or out.dtype != src.dtype:
        raise ValueError(
            f"rows of {src.dtype}{list(src.shape[1:])} cannot go into rows of {out.dtype}{list(out.shape[1:])}"
        )
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    places = np.ascontiguousarray(places, dtype=np.int64)
    if _c_take_rows is not None and src.flags.c_contiguous and out.flags.c_contiguous and len(src) and len(out):
        _c_take_rows((src,), None, rows, src.nbytes // len(src), out, places)
        return
    out[places] = src.take(rows, axis=0)
