"""Convert sources from other loaders' formats read by their own packages' layouts: Lance datasets,
LitData optimized chunks, Grain's ArrayRecord files (detection and opening for `sources.open_source`)."""

from __future__ import annotations

import os
from typing import Any

from .schema import Schema

__all__ = ["MIGRATE_KINDS", "detect_migrate_kind", "open_migrate_source"]

MIGRATE_KINDS = ("lance", "litdata", "arrayrecord")


def detect_migrate_kind(src: str) -> str | None:
    """The kind of `src` when it is one of `MIGRATE_KINDS`, else None."""
    from .array_record_source import is_array_record
    from .arrow_dataset import is_lance
    from .litdata_chunks import is_litdata

    if os.path.isdir(src) and is_lance(src):
        return "lance"
    if os.path.isdir(src) and is_litdata(src):
        return "litdata"
    if is_array_record(src):
        return "arrayrecord"
    return None


def open_migrate_source(src: str, kind: str, *, decode: str | None = None) -> tuple[Any, Schema, dict[str, Any]]:
    """(source for `write`, schema, attrs) of a `MIGRATE_KINDS` source; `decode`: ArrayRecord's plug-in."""
    if decode is not None and kind != "arrayrecord":
        raise ValueError(f"--decode applies to ArrayRecord sources, not to a {kind} source ({src})")
    if kind == "lance":
        from .arrow_dataset import LanceDataset, in_place_source

        source = in_place_source(LanceDataset(src))
        return source, source.schema, {"source": "lance"}
    if kind == "litdata":
        from .litdata_chunks import LitDataChunks

        chunks = LitDataChunks(src)
        return chunks, chunks.schema, {"source": "litdata"}
    from .array_record_source import ArrayRecordFiles

    records = ArrayRecordFiles(src, decode=decode)
    return records, records.schema, {"source": "arrayrecord", **({"decode": decode} if decode else {})}
