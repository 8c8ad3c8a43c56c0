"""Restart markers for JPEG image fields, so a window decoder reads only the window's restart intervals.

`add_restart_index` re-encodes a JPEG losslessly (its DCT coefficients are copied: every decoder
gives the same pixels) as a baseline JPEG whose restart intervals cut every MCU row into equal
column groups (about 64 pixels wide) and an APP9 "FLRST" segment listing where each restart
interval starts (FORMAT.md, "JPEG restart index"). Progressive JPEGs become baseline ones;
Huffman tables are optimised; APPn and COM segments (EXIF, ICC, ...) are kept. The image preset's
window decoder then entropy-decodes only the restart intervals a crop window covers: no MCU row
above or below it, no column group beside it. Other decoders ignore the APP9 segment.

The re-encoder is libjpeg-turbo's transform API in the `fastload.vision._jpegwin` extension
(built where libjpeg-turbo's headers are installed). Without it, or for bytes it cannot re-encode
(not a JPEG, corrupt data, 12-bit samples), the bytes are kept as they are.
"""

from __future__ import annotations

import functools
from types import ModuleType

__all__ = ["add_restart_index", "restart_index", "restart_supported"]


@functools.cache
def _extension() -> ModuleType | None:
    """The `_jpegwin` extension, imported on first use (it imports `fastload.vision`, i.e. torch:
    sources without images never pay for it); None where it was not built."""
    try:
        from fastload.vision import _jpegwin
    except ImportError:
        return None
    return _jpegwin


def restart_supported() -> bool:
    """Whether this install can re-encode JPEGs with restart markers (the `_jpegwin` extension is
    built where libjpeg-turbo's headers were present at install time)."""
    return _extension() is not None


def add_restart_index(data: bytes, *, interval: int = 0) -> bytes:
    """`data` re-encoded with restart markers and the restart index, if it is a JPEG libjpeg-turbo
    re-encodes; otherwise (not a JPEG, corrupt data, 12-bit samples, no extension) `data` itself,
    which the preset decodes as before. `interval`: MCUs per restart interval, a divisor of the
    image's MCUs per row (the MCUs per row: one interval per MCU row); 0 picks the divisor nearest
    64 image columns. With an `interval` given, a JPEG that cannot be re-encoded with it raises
    ValueError."""
    ext = _extension()
    if ext is None or len(data) < 3 or bytes(data[:3]) != b"\xff\xd8\xff":
        return data
    try:
        return ext.transcode_restart(data, interval)
    except ValueError:  # not re-encodable: stored as it came
        if interval:
            raise
        return data


def restart_index(data: bytes) -> tuple[int, ...] | None:
    """The restart-interval offsets of `data`'s restart index (each the byte after a restart marker,
    from the start of the entropy-coded data) if the index passes every check the window decoder
    makes before using it; else None (the decoder then reads the whole stream)."""
    ext = _extension()
    return None if ext is None else ext.restart_index(data)
