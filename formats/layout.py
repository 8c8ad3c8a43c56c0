"""The shard file layout as numpy structured dtypes (see FORMAT.md, "Shard file").

A shard is: a 64-byte header, a table of one 64-byte entry per field (in schema order), the field
sections, each starting on a 64-byte boundary, and (version 2) a table of block checksums.
The section layout is canonical: `section_table` computes it from the schema, the sample count
and the blob sizes, and readers require a shard's field table to equal it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np
import xxhash

from .schema import KIND_CODES, Field, Schema

__all__ = [
    "ALIGN",
    "BLOCK_LOG2",
    "COLUMN_ALIGN",
    "ENTRY_DTYPE",
    "FORMAT_VERSION",
    "HEADER_DTYPE",
    "READ_VERSIONS",
    "SHARD_MAGIC",
    "align_up",
    "field_xxh3",
    "min_sample_bytes",
    "section_table",
    "shard_name",
]

SHARD_MAGIC = b"FLDSHARD"
FORMAT_VERSION = 2  # what writers write
READ_VERSIONS = (1, 2)  # what readers open (version 1: no block checksums, no shard identity)
ALIGN = 64
COLUMN_ALIGN = 4096  # fixed ndarray columns start on a page, so readers can splice shards (FORMAT.md)
BLOCK_LOG2 = 16  # 64 KiB checksum blocks: small enough that verifying one to read a record stays cheap

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("num_fields", "<u4"),
        ("num_samples", "<u8"),
        ("file_bytes", "<u8"),
        # version 2 (zero in version 1): the shard's identity and where its block checksums are
        ("dataset_id", "<u8"),
        ("first_sample", "<u8"),
        ("shard_index", "<u4"),
        ("block_log2", "<u4"),
        ("checksums_offset", "<u8"),  # u8 xxh3-64 per block of bytes [0, checksums_offset)
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
        ("field_xxh3", "<u8"),  # version 2: xxh3-64 of the field's schema entry (zero in version 1)
        ("reserved", "V8"),
    ]
)
assert ENTRY_DTYPE.itemsize == 64


def shard_name(k: int) -> str:
    """Relative path of shard `k` in a dataset directory."""
    return f"shards/shard-{k:05d}.fls"


def align_up(n: int, align: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `align`."""
    return (n + align - 1) // align * align


@functools.lru_cache(maxsize=4096)
def field_xxh3(f: Field) -> int:
    """The checksum of a field's schema entry that version-2 shards record (name, kind, dtype, shape);
    kept per field definition (every shard of a dataset repeats it)."""
    return xxhash.xxh3_64_intdigest(json.dumps(f.to_json(), sort_keys=True, separators=(",", ":")).encode())


def min_sample_bytes(schema: Schema) -> int:
    """The bytes every sample takes in a shard at least: its rows of the fixed columns and one
    8-byte offset per variable field (so `num_samples * min_sample_bytes <= file size`)."""
    return sum(f.item_bytes for f in schema if f.has_fixed_column) + 8 * sum(1 for f in schema if not f.is_fixed)


def section_table(schema: Schema, num_samples: int, blob_bytes: Sequence[int]) -> tuple[np.ndarray, int]:
    """The field table of a shard of `num_samples` samples whose variable fields hold `blob_bytes`
    (one per schema field, 0 for fixed ones), and the byte where the sections end.

    Sections follow the header and table in schema order (per field: fixed column, offsets table,
    blob), each on a 64-byte boundary, fixed `ndarray` columns on a page.
    """
    n = num_samples
    rows = []
    pos = align_up(HEADER_DTYPE.itemsize + ENTRY_DTYPE.itemsize * len(schema))
    for k, f in enumerate(schema):
        item_bytes = fixed_offset = fixed_bytes = offsets_offset = blob_offset = blob = 0
        if f.has_fixed_column:
            if f.kind == "ndarray":
                pos = align_up(pos, COLUMN_ALIGN)
            item_bytes, fixed_offset, fixed_bytes = f.item_bytes, pos, n * f.item_bytes
            pos = align_up(pos + n * f.item_bytes)
        if not f.is_fixed:
            offsets_offset = pos
            pos = align_up(pos + 8 * (n + 1))
            blob_offset, blob = pos, int(blob_bytes[k])
            pos = align_up(pos + blob)
        rows.append((KIND_CODES[f.kind], item_bytes, fixed_offset, fixed_bytes, offsets_offset, blob_offset, blob,
                     field_xxh3(f), bytes(8)))
    return np.array(rows, dtype=ENTRY_DTYPE), pos
