"""One shard download over fsspec: a streamed whole-object GET or ranged GETs, and how many to run.

Both run as coroutines on the file system's event loop and hand each piece to the sink as it
arrives (`Download.write` in order, `Download.write_at` for ranged parts), so bytes are written
and hashed while they are in the CPU cache, with no whole-object buffer. `network_options` adds
connect/read timeouts and turns off the file system's inner retries.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

from fsspec.asyn import AbstractAsyncStreamedFile, AsyncFileSystem

from fastload.remote.transfer_stats import TransferStats

__all__ = [
    "BYTES_IN_FLIGHT",
    "CONNECT_TIMEOUT_S",
    "MAX_GETS",
    "PARTS_IN_FLIGHT",
    "PART_BYTES",
    "READ_TIMEOUT_S",
    "STREAM_CHUNK",
    "NoRanges",
    "NoStream",
    "gets_in_flight",
    "network_options",
    "ranged_into",
    "stream_into",
    "takes_ranges",
]

CONNECT_TIMEOUT_S = 5.0  # to open a connection
READ_TIMEOUT_S = 15.0  # with no byte received, per read of a response

# Bytes asked of the response stream per read on the event loop: about one socket read's worth
# (asyncio receives 256 KB at a time), so a read rarely joins buffered pieces into a new object and
# the bytes are written and hashed while they are still in the CPU cache.
STREAM_CHUNK = 256 << 10


class NoStream(Exception):
    """`open_async` gave a file that does not read one response as a stream."""


class NoRanges(Exception):
    """A ranged GET came back with another length than asked (the store ignores `Range`)."""


PART_BYTES = 16 << 20  # one ranged GET of a large shard
PARTS_IN_FLIGHT = 4  # ranged GETs of one shard outstanding at once


def takes_ranges(fs: Any) -> bool:
    """Whether an async file system implements ranged `_cat_file` (s3fs, gcsfs, http do)."""
    return isinstance(fs, AsyncFileSystem) and type(fs)._cat_file is not AsyncFileSystem._cat_file


async def ranged_into(fs: AsyncFileSystem, rpath: str, sink: Any, part: int, stats: TransferStats) -> None:
    """The object in ranged GETs of `part` bytes, `PARTS_IN_FLIGHT` at a time, each handed to
    `sink.write_at` as it arrives (the sink hashes in file order). A part of the wrong length
    raises `NoRanges`; on any failure the other parts are cancelled (their responses closed)."""
    size = sink.size
    gate = asyncio.Semaphore(PARTS_IN_FLIGHT)

    async def one(start: int) -> None:
        end = min(size, start + part)
        async with gate:
            t0 = time.perf_counter()
            data = await fs._cat_file(rpath, start=start, end=end)
            stats.add_many(receive_s=time.perf_counter() - t0, bytes=len(data), ranged_parts=1)
        if len(data) != end - start:
            raise NoRanges
        sink.write_at(start, data)

    tasks = [asyncio.ensure_future(one(start)) for start in range(0, size, part)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # every response closed before the retry
        raise


async def stream_into(fs: AsyncFileSystem, rpath: str, sink: Any, chunk: int, stats: TransferStats) -> None:
    """One whole-object GET of `rpath`, each piece handed to `sink.write` on the event loop as it arrives.

    Run as one coroutine per object: no thread hand-over per piece (each costs a loop round trip and
    a GIL switch that the fetch threads, the loader and the server on the same cores all wait on).
    Time to the first body byte counts as `request_s`, the other waits on the socket as `receive_s`.
    """
    t0 = time.perf_counter()
    # the size is known (the manifest's): a file system that would ask for it first (http: a HEAD,
    # then a GET without body) is told, so an attempt is one request and one read timeout at most
    sized = "size" in inspect.signature(fs.open_async).parameters
    f = await (fs.open_async(rpath, "rb", size=sink.size) if sized else fs.open_async(rpath, "rb"))
    first: float | None = None
    recv = 0.0
    try:
        if not _streams(f):
            raise NoStream
        while True:
            t = time.perf_counter()
            b = await f.read(chunk)
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                recv += now - t
            if not b:
                break
            stats.add("bytes", len(b))  # as it arrives: `GetWindow` measures throughput from it
            sink.write(b)
    finally:
        await _close_stream(f)
        if first is not None:
            stats.add_many(request_s=first - t0, receive_s=recv)


async def _close_stream(f: Any) -> None:
    """Close the response body (drops a half-read connection), then the file itself: its `close` is a
    coroutine (fsspec's async files), and a file left open would have `__del__` call it un-awaited."""
    for obj in (getattr(f, "r", None), f):  # s3fs / http keep the response body in `.r`
        close = getattr(obj, "close", None)
        if callable(close):
            try:
                res = close()
                if hasattr(res, "__await__"):
                    await res
            except Exception:  # noqa: BLE001 - best effort on a stream that may already be broken
                pass


def _streams(f: Any) -> bool:
    """Whether an `open_async` file reads one response as a stream (s3fs, http), not a range GET per read."""
    return type(f).read is not AbstractAsyncStreamedFile.read


BYTES_IN_FLIGHT = 256 << 20  # whole-shard GETs outstanding at once: a 10 Gb/s link's bandwidth x 200 ms
MAX_GETS = 16


def gets_in_flight(shard_bytes: int, cache_limit: int) -> int:
    """Whole-shard GETs to keep outstanding for shards of up to `shard_bytes`: `BYTES_IN_FLIGHT`
    worth, at least 2 and at most `MAX_GETS`, and at most what `cache_limit` holds beside the two
    shards a reader pins while it swaps (prefetched shards wait in the cache until they are read)."""
    if shard_bytes <= 0:
        return 2
    want = min(MAX_GETS, max(2, -(-BYTES_IN_FLIGHT // shard_bytes)))
    return max(1, min(want, cache_limit // shard_bytes - 2))


def network_options(
    url: str, options: dict[str, Any], *, connect_timeout: float, read_timeout: float
) -> dict[str, Any]:
    """fsspec `storage_options` for `url` with connect/read timeouts and no inner retries added
    where the caller gave none (s3: botocore's `connect_timeout`, `read_timeout`, one attempt;
    http(s): an aiohttp `ClientTimeout`; other protocols: `timeout`, when they take one)."""
    protocol = url.split("://", 1)[0].lower()
    opts = dict(options)
    if protocol in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", connect_timeout)
        config.setdefault("read_timeout", read_timeout)
        config.setdefault("retries", {"total_max_attempts": 1})  # botocore: the first try only
        opts["config_kwargs"] = config
    elif protocol in ("http", "https"):
        import aiohttp

        client = dict(opts.get("client_kwargs") or {})
        client.setdefault(
            "timeout", aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
        )
        opts["client_kwargs"] = client
    elif protocol in ("gs", "gcs", "abfs", "az"):
        opts.setdefault("timeout", connect_timeout + read_timeout)
    return opts
