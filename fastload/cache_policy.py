"""`LruPolicy`: which cached shards make room for a new one, and when waiting for room cannot end.

Runs under the state lock of `fastload.cache_state.CacheState` on the state dict it yields; it
decides from the entries, pins, soft pins, reservations and waiters recorded there, never from a
process's own view. Rules:

- pinned entries are never evicted;
- a prefetch (`soft=True`) evicts only least recently used entries that nobody pins or soft-pins
  (prefetched files wait for their reader), a demand fetch may evict soft-pinned ones too;
- waiting for room is a deadlock when every owner that pins or demand-downloads something is
  itself waiting (a prefetch in flight ends on its own and leaves an evictable file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .cache_state import CacheState, unlink
from .formats.units import format_size

__all__ = ["LruPolicy", "Room"]


@dataclass
class Room:
    """Whether a download fits now; when not, what it waits on."""

    ok: bool
    waiting_on: str = ""


class LruPolicy:
    """Least-recently-used eviction of unpinned files in `data_dir`, keeping bytes within `limit`."""

    def __init__(self, *, limit: int, data_dir: str) -> None:
        self.limit, self.data_dir = limit, data_dir

    def make_room(self, state: dict[str, Any], size: int, *, soft: bool) -> Room:
        """Evict least recently used unpinned files until `size` more bytes fit (files and entries
        removed); `Room(False)` and nothing evicted when they cannot."""
        free = self.limit - CacheState.used(state)
        if free >= size:
            return Room(True)
        unpinned = [(e["used"], k) for k, e in state["entries"].items() if not state["pins"].get(k)]
        cold = sorted((u, k) for u, k in unpinned if k not in state["soft"])
        warm = sorted((u, k) for u, k in unpinned if k in state["soft"])
        chosen = []
        for _, k in cold if soft else cold + warm:
            if free >= size:
                break
            chosen.append(k)
            free += state["entries"][k]["size"]
        if free < size:
            return Room(False, waiting_on="room held by pinned shards")
        for k in chosen:
            unlink(os.path.join(self.data_dir, k))
            del state["entries"][k]
            state["soft"].pop(k, None)
        return Room(True)

    @staticmethod
    def deadlocked(state: dict[str, Any], me: str) -> bool:
        """Every owner that pins or demand-downloads something is itself waiting for room, `me` too."""
        holders = {o for pins in state["pins"].values() for o, n in pins.items() if n > 0}
        holders |= {r["owner"] for r in state["reserved"].values() if not r.get("soft")}
        return bool(holders) and holders <= set(state["waiting"]) and me in state["waiting"]

    def deadlock_message(self, state: dict[str, Any], *, size: int, where: str, root: str) -> str:
        """The `CacheBudgetError` text for a deadlocked wait: what is pinned, by whom, what to raise."""
        pinned = sum(state["entries"].get(k, {}).get("size", 0) for k, p in state["pins"].items() if p)
        holders = sorted({o.split("-")[0] for p in state["pins"].values() for o in p})
        return (
            f"{where}: cache_limit={format_size(self.limit)} ({root}) cannot hold the shards in use at once: "
            f"{format_size(pinned)} are pinned by process(es) {', '.join(holders) or '-'} and every one of them "
            f"waits for room for another shard ({format_size(size)}). Raise cache_limit to at least the sum, "
            f"over every reader sharing the cache (each dataset object in each process, loader workers "
            f"included), of (max_open_shards + 1) x (largest shard), or open fewer shards at once."
        )
