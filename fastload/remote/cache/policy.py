"""`LruPolicy`: which cached shards make room for a new one, and when waiting for room cannot end.

Runs under the state lock of `fastload.remote.cache.state.CacheState` on the state dict it yields; it
decides from the entries, pins, soft pins, reservations and waiters recorded there, never from a
process's own view. Rules:

- pinned entries are never evicted, nor are files that something still maps or reads (`in_use`: a
  reader of another process, a forked worker's inherited mapping, a reader thread still gathering
  from a shard its dataset closed): their blocks stay on the disk until the last mapping goes, so
  they stay in the budget until then;
- a file that must leave the cache while still mapped (found corrupt) is retired: moved to `tmp/`
  and counted until nothing maps it, then removed (`reap`, on every look for room);
- every file is counted at its size rounded up to the file system's block, and the state file
  (`state.db`, with room for its growth between two looks) is counted too, so the bytes the cache
  occupies on its file system never exceed `limit`;
- a prefetch (`soft=True`) evicts only least recently used entries that nobody pins or soft-pins
  (prefetched files wait for their reader), a demand fetch may evict soft-pinned ones too;
- waiting for room is a deadlock when every owner that pins or demand-downloads something is
  itself waiting (a prefetch in flight ends on its own and leaves an evictable file).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastload.formats.units import format_size
from fastload.remote.cache.files import footprint, in_use
from fastload.remote.cache.state import STATE_SLACK, CacheState, unlink

__all__ = ["LruPolicy", "Room", "split_budget"]


@dataclass
class Room:
    """Whether a download fits now; when not, what it waits on."""

    ok: bool
    waiting_on: str = ""
    mapped: bool = False  # room is held (also) by unpinned files still mapped: it frees without any pin dropping


class LruPolicy:
    """Least-recently-used eviction of unpinned, unmapped files in `data_dir`, keeping the bytes the
    cache occupies (on a file system of `block`-byte blocks) within `limit`; `state_file_bytes`
    says how large the state's own file is now."""

    def __init__(
        self, *, limit: int, data_dir: str, tmp_dir: str, state_file_bytes: Callable[[], int], block: int = 1
    ) -> None:
        self.limit, self.data_dir, self.tmp_dir, self.block = limit, data_dir, tmp_dir, max(1, int(block))
        self._state_file_bytes = state_file_bytes
        self._retire_seq = 0

    def state_overhead(self) -> int:
        """Bytes the budget counts for the state file: its footprint with `STATE_SLACK` to spare for
        its growth before the next look for room."""
        return footprint(self._state_file_bytes() + STATE_SLACK, self.block)

    def occupied(self, state: dict[str, Any]) -> int:
        """Bytes the cache occupies: its files at their block footprint plus the state file."""
        return CacheState.used(state, self.block) + self.state_overhead()

    def make_room(self, state: dict[str, Any], size: int, *, soft: bool) -> Room:
        """Evict least recently used unpinned, unmapped files until `size` more bytes fit (files and
        entries removed); `Room(False)` and nothing evicted when they cannot."""
        self.reap(state)
        need = footprint(size, self.block)
        free = self.limit - self.occupied(state)
        if free >= need:
            return Room(True)
        chosen: list[str] = []
        mapped = False

        def candidates() -> Iterator[tuple[str, int]]:
            """Unpinned entries, least recently used first, soft-pinned ones last (demand fetches only);
            the entries are read only as far as the room needs."""
            warm = []
            for k, size in state["entries"].least_recently_used():
                if state["pins"].get(k):
                    continue
                if k in state["soft"]:
                    if not soft:
                        warm.append((k, size))
                    continue
                yield k, size
            if not soft:
                yield from warm

        for k, size in candidates():
            if free >= need:
                break
            if in_use(os.path.join(self.data_dir, k)):
                mapped = True
                continue
            chosen.append(k)
            free += footprint(size, self.block)
        mapped = mapped or bool(state["retired"])
        if free < need:
            held = "room held by pinned shards" + (" and by shards still mapped" if mapped else "")
            return Room(False, waiting_on=held, mapped=mapped)
        for k in chosen:
            unlink(os.path.join(self.data_dir, k))
            del state["entries"][k]
            state["soft"].pop(k, None)
        return Room(True)

    def remove(self, state: dict[str, Any], key: str) -> None:
        """Take `key` out of the cache now (found corrupt): its file is removed, or retired to `tmp/`
        (still counted) while something maps it."""
        entry = state["entries"].pop(key, None)
        state["soft"].pop(key, None)
        path = os.path.join(self.data_dir, key)
        if entry is not None and in_use(path):
            self._retire_seq += 1
            name = f"{key}.retired.{os.getpid()}.{self._retire_seq}"
            try:
                os.replace(path, os.path.join(self.tmp_dir, name))
            except FileNotFoundError:
                return
            state["retired"][name] = int(entry["size"])
            return
        unlink(path)

    def reap(self, state: dict[str, Any]) -> None:
        """Remove retired files that nothing maps any more."""
        for name in list(state["retired"]):
            path = os.path.join(self.tmp_dir, name)
            if not in_use(path):
                unlink(path)
                del state["retired"][name]

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
            f"included), of (max_open_shards + 1) x (largest shard, rounded up to the file system's block), plus "
            f"the state file, or open fewer shards at once."
        )


def split_budget(available: int, claims: dict[str, Any]) -> dict[str, int] | None:
    """Each claimant's share of `available` bytes: `claims[owner]` is `[least, most]` (an int: both).
    Everyone gets its least; what is left is split evenly among those that want more, none above
    its most (water-filling, so every process computes the same shares from the same state).
    None when the leasts alone exceed `available`."""
    bounds = {o: (c, c) if isinstance(c, int) else (int(c[0]), int(c[1])) for o, c in claims.items()}
    shares = {o: lo for o, (lo, _) in bounds.items()}
    left = available - sum(shares.values())
    if left < 0:
        return None
    hungry = sorted((hi - lo, o) for o, (lo, hi) in bounds.items() if hi > lo)
    for i, (room, o) in enumerate(hungry):
        give = min(room, left // (len(hungry) - i))
        shares[o] += give
        left -= give
    return shares
