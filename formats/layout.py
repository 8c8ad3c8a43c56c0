"""The shard file layout as numpy structured dtypes (see FORMAT.md, "Shard file").

A shard is: a 64-byte header, a table of one 64-byte entry per field (in schema order),
then the field sections, each starting on a 64-byte boundary.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ALIGN",
    "COLUMN_ALIGN",
    "ENTRY_DTYPE",
    "FORMAT_VERSION",
    "HEADER_DTYPE",
    "SHARD_MAGIC",
    "align_up",
]

SHARD_MAGIC = b"FLDSHARD"
FORMAT_VERSION = 1
ALIGN = 64
COLUMN_ALIGN = 4096  # fixed ndarray columns start on a page, so readers can splice shards (FORMAT.md)

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("num_fields", "<u4"),
        ("num_samples", "<u8"),
        ("file_bytes", "<u8"),
        ("reserved", "V32"),
    ]
)
assert HEADER_DTYPE.itemsize == 64

# Offsets are absolute file offsets; a zero size means "section absent".
ENTRY_DTYPE = np.dtype(
    [
        ("kind", "<u4"),
        ("item_bytes", "<u4"),  # bytes per sample in the fixed column (0 when absent)
        ("fixed_offset", "<u8"),
        ("fixed_bytes", "<u8"),
        ("offsets_offset", "<u8"),  # u8[num_samples + 1], element offsets into the blob
        ("blob_offset", "<u8"),
        ("blob_bytes", "<u8"),
        ("reserved", "V16"),
    ]
)
assert ENTRY_DTYPE.itemsize == 64


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align
