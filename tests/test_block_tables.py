"""`BlockTables`: shards' block tables from pages of `blocks.bin`, one GET a page, safe when it fails."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fastload.remote.block_tables import BlockTables

SIZES = [40, 8, 0, 104, 24]  # bytes of each shard's table (0: none)


def _file() -> tuple[bytes, np.ndarray]:
    data = bytes(range(256))[: sum(SIZES)]
    offsets = np.zeros(len(SIZES) + 1, dtype=np.int64)
    np.cumsum(SIZES, out=offsets[1:])
    return data, offsets


class Fetcher:
    """`blocks.bin` served from memory, counting the GETs (`calls`) and able to fail or ignore ranges."""

    def __init__(self, data: bytes, *, delay: float = 0.0) -> None:
        self.data, self.delay = data, delay
        self.calls: list[tuple[int, int]] = []
        self.fail: BaseException | None = None
        self.whole = False  # answer every range with the whole file, as a store that ignores `Range`
        self._lock = threading.Lock()

    def __call__(self, start: int, end: int) -> bytes:
        with self._lock:
            self.calls.append((start, end))
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return self.data if self.whole else self.data[start:end]


@pytest.mark.parametrize("page", [16, 32, 1 << 20])
def test_every_table_comes_byte_for_byte_whatever_the_page_size(page):
    data, offsets = _file()
    fetch = Fetcher(data)
    tables = BlockTables(offsets, fetch, page_bytes=page, pages_kept=64)
    for k in [3, 0, 4, 1, 2, 3]:
        want = data[offsets[k] : offsets[k + 1]] or None
        assert tables.table(k) == want
    assert sorted(set(fetch.calls)) == sorted(fetch.calls)  # each page fetched once
    assert tables.pages_fetched == len(fetch.calls) == -(-len(data) // page)


def test_threads_asking_for_one_page_share_its_get():
    data, offsets = _file()
    fetch = Fetcher(data, delay=0.05)
    tables = BlockTables(offsets, fetch, page_bytes=1 << 20)
    got: list[bytes | None] = []
    threads = [threading.Thread(target=lambda k=k: got.append(tables.table(k % 5))) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fetch.calls == [(0, len(data))]
    assert sorted(g for g in got if g is not None) == sorted(
        data[offsets[k % 5] : offsets[k % 5 + 1]] for k in range(8) if SIZES[k % 5]
    )


def test_pages_beyond_those_kept_are_fetched_again():
    data, offsets = _file()
    fetch = Fetcher(data)
    tables = BlockTables(offsets, fetch, page_bytes=32, pages_kept=2)
    for k in (0, 3, 4, 0):
        assert tables.table(k) == data[offsets[k] : offsets[k + 1]]
    assert fetch.calls.count((0, 32)) == 2


def test_a_forgotten_table_is_fetched_again():
    data, offsets = _file()
    fetch = Fetcher(data)
    tables = BlockTables(offsets, fetch, page_bytes=1 << 20)
    tables.table(1)
    tables.forget(1)
    assert tables.table(1) == data[offsets[1] : offsets[2]]
    assert len(fetch.calls) == 2


@pytest.mark.parametrize("how", ["error", "whole"])
def test_a_page_that_cannot_be_had_turns_the_tables_off(how):
    """A failed GET, or an answer of another length (a store that ignores `Range`), gives no table, now
    or later, and nothing more is fetched: every shard's own table stands in."""
    data, offsets = _file()
    fetch = Fetcher(data)
    if how == "error":
        fetch.fail = ConnectionError("gone")
    else:
        fetch.whole = True
    tables = BlockTables(offsets, fetch, page_bytes=64)
    assert tables.table(3) is None
    assert tables.table(0) is None and tables.table(4) is None
    assert len(fetch.calls) == 1
