"""`open_under(folder)`: the files under `folder` this process has open now (Linux: /proc/self/fd)."""

from __future__ import annotations

import os

LISTS_OPEN_FILES = os.path.isdir("/proc/self/fd")


def open_under(folder: str) -> list[str]:
    """The paths under `folder` of this process's open file descriptors."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(folder):
            out.append(target)
    return out
