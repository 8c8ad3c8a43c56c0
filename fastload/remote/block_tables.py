"""`BlockTables`: shards' block checksum tables from the dataset's `blocks.bin`, fetched in pages.

A download verifies a shard's blocks as they arrive against its checksum table. The table ends the
shard file; `blocks.bin` (FORMAT.md) holds every shard's table in shard order, so the tables of many
shards come in one ranged GET of a page of it instead of one GET a shard. Pages are `PAGE_BYTES`
(the tables of about 8 GiB of shards at 64 KiB blocks), fetched on first use, one GET a page however
many threads ask at once, the last `PAGES_KEPT` kept. Nothing here is trusted: the caller checks each
table against the manifest's `blocks_xxh3` before use, and fetches the shard's own table when a
page cannot be had or a table does not match (`forget`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

__all__ = ["PAGES_KEPT", "PAGE_BYTES", "BlockTables"]

PAGE_BYTES = 1 << 20
PAGES_KEPT = 16

log = logging.getLogger("fastload.remote.storage")


class BlockTables:
    """The tables of `blocks.bin` (where each shard's starts: `offsets`, int64[n + 1], the last its
    size) through `fetch(start, end)`, which returns those bytes of the file (a store that ignores
    `Range` may return others: the page is then not used)."""

    def __init__(self, offsets: np.ndarray, fetch: Callable[[int, int], bytes], *, page_bytes: int = PAGE_BYTES,
                 pages_kept: int = PAGES_KEPT) -> None:
        self._offsets = [int(v) for v in offsets]
        self._fetch = fetch
        self._page_bytes, self._pages_kept = int(page_bytes), max(1, int(pages_kept))
        self._lock = threading.Lock()  # guards the fields below
        self._pages: OrderedDict[int, bytes] = OrderedDict()  # page -> its bytes, least recently used first
        self._loading: dict[int, threading.Event] = {}  # page -> set once the GET fetching it ended
        self._failed = False  # a page could not be had: every table comes from its shard from then on
        self.pages_fetched = 0

    def table(self, k: int) -> bytes | None:
        """Shard k's table as `blocks.bin` holds it (unchecked), or None when it cannot be had."""
        start, end = self._offsets[k], self._offsets[k + 1]
        if end <= start or self._failed:
            return None
        size = self._page_bytes
        pages = []
        for p in range(start // size, (end - 1) // size + 1):
            got = self._page(p)
            if got is None:
                return None
            pages.append(got)
        first = start // size * size
        return b"".join(pages)[start - first : end - first]

    def forget(self, k: int) -> None:
        """Shard k's table did not match the manifest: its pages are fetched again when next asked for."""
        size = self._page_bytes
        with self._lock:
            for p in range(self._offsets[k] // size, (self._offsets[k + 1] - 1) // size + 1):
                self._pages.pop(p, None)

    def _page(self, p: int) -> bytes | None:
        """Page p, fetched by the first thread that asks for it (the others wait for that GET)."""
        while True:
            with self._lock:
                if self._failed:
                    return None
                got = self._pages.get(p)
                if got is not None:
                    self._pages.move_to_end(p)
                    return got
                loading = self._loading.get(p)
                if loading is None:
                    loading = self._loading[p] = threading.Event()
                    break
            loading.wait()  # the fetching thread's GET ends within its own timeouts and retries
        start = p * self._page_bytes
        end = min(start + self._page_bytes, self._offsets[-1])
        data: bytes | None = None
        try:
            data = self._fetch(start, end)
            if len(data) != end - start:
                log.warning("blocks.bin: bytes [%d, %d) came back as %d bytes; shards' tables come from the "
                            "shards", start, end, len(data))
                data = None
        except Exception as exc:  # noqa: BLE001 - the shards' own tables stand in
            log.warning("blocks.bin: bytes [%d, %d) could not be fetched (%r); shards' tables come from the "
                        "shards", start, end, exc)
        finally:
            with self._lock:
                if data is None:
                    self._failed = True
                else:
                    self._pages[p] = data
                    self.pages_fetched += 1
                    while len(self._pages) > self._pages_kept:
                        self._pages.popitem(last=False)
                del self._loading[p]
            loading.set()
        return data
