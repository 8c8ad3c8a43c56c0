"""How fast one process receives whole objects over HTTP, by receive strategy.

Serves `--objects` objects of `--size` bytes with nginx and receives them all (each body hashed with
xxh3 as it arrives, nothing written) with:

- `shared-stream`: fsspec's one shared event loop, `open_async` + `read(chunk)` per object, all GETs
  on that loop (`chunk` in `--chunks`);
- `shared-cat`: the shared loop, `_cat_file` (the whole body read and joined, then hashed);
- `shared-any`: the shared loop, the response's `content.readany()` (one buffered piece per call, no join);
- `loops-K`: K private event loops in K threads, each with its own fsspec file system instance
  (`loop=`), the objects dealt round-robin, `readany()` per piece (K in `--loops`);
- `sync-open`: fsspec's sync `open(block_size=...)` + `readinto` in a thread pool;
- `urllib`: `threads` threads of `urllib` GET + read, the raw pipeline's receive.

`--concurrency` GETs are in flight in every strategy. Interleaved over `--rounds` rounds; prints
MB/s per strategy (median, per round) and the process's CPU seconds per GB received.

Run: `python -m bench.remote_receive [--objects 12 --size 32MB --rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import fsspec
import xxhash
from fsspec.asyn import sync as fsspec_sync

from fastload.formats.units import parse_size

__all__ = ["main"]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _urllib(urls: list[str], conc: int) -> int:
    def one(u: str) -> int:
        with urllib.request.urlopen(u, timeout=60) as r:
            data = r.read()
        xxhash.xxh3_64(data).digest()
        return len(data)

    with ThreadPoolExecutor(conc) as pool:
        return sum(pool.map(one, urls))


async def _gather(fs, urls: list[str], conc: int, one) -> int:
    gate = asyncio.Semaphore(conc)

    async def guarded(u: str) -> int:
        async with gate:
            return await one(fs, u)

    return sum(await asyncio.gather(*(guarded(u) for u in urls)))


def _stream(chunk: int):
    async def one(fs, u: str) -> int:
        f = await fs.open_async(u, "rb")
        h = xxhash.xxh3_64()
        n = 0
        try:
            while b := await f.read(chunk):
                h.update(b)
                n += len(b)
        finally:
            await f.close()
        return n

    return one


async def _cat(fs, u: str) -> int:
    data = await fs._cat_file(u)
    xxhash.xxh3_64(data).digest()
    return len(data)


async def _any(fs, u: str) -> int:
    session = await fs.set_session()
    h = xxhash.xxh3_64()
    n = 0
    async with session.get(u) as r:
        r.raise_for_status()
        while b := await r.content.readany():
            h.update(b)
            n += len(b)
    return n


def _shared(one) -> Callable[[list[str], int], int]:
    def run(urls: list[str], conc: int) -> int:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        return fsspec_sync(fs.loop, _gather, fs, urls, conc, one)

    return run


def _loops(k: int) -> Callable[[list[str], int], int]:
    def run(urls: list[str], conc: int) -> int:
        loops = [asyncio.new_event_loop() for _ in range(k)]
        threads = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops]
        for t in threads:
            t.start()
        try:
            fss = [fsspec.filesystem("http", skip_instance_cache=True, loop=lp) for lp in loops]
            per = max(1, conc // k)
            with ThreadPoolExecutor(k) as pool:
                futs = [pool.submit(fsspec_sync, fss[i].loop, _gather, fss[i], urls[i::k], per, _any)
                        for i in range(k)]
                total = sum(f.result() for f in futs)
            for fs in fss:
                if fs._session is not None:
                    fsspec_sync(fs.loop, fs._session.close)
            return total
        finally:
            for lp in loops:
                lp.call_soon_threadsafe(lp.stop)
            for t in threads:
                t.join()
            for lp in loops:
                lp.close()

    return run


def _sync_open(block: int) -> Callable[[list[str], int], int]:
    def run(urls: list[str], conc: int) -> int:
        fs = fsspec.filesystem("http", skip_instance_cache=True)

        def one(u: str) -> int:
            h = xxhash.xxh3_64()
            buf = bytearray(block)
            n = 0
            with fs.open(u, "rb", block_size=block, cache_type="none") as f:
                while k := f.readinto(buf):
                    h.update(memoryview(buf)[:k])
                    n += k
            return n

        with ThreadPoolExecutor(conc) as pool:
            return sum(pool.map(one, urls))

    return run


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Run the strategies interleaved; print and return MB/s per strategy and round."""
    from bench.remote import Nginx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=12)
    ap.add_argument("--size", default="32MB")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="256KB,4MB")
    ap.add_argument("--loops", default="2,4")
    ap.add_argument("--only", default=None, help="comma-separated strategy names")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    strategies: dict[str, Callable[[list[str], int], int]] = {"urllib": _urllib}
    for c in args.chunks.split(","):
        strategies[f"shared-stream-{c}"] = _shared(_stream(parse_size(c)))
    strategies["shared-cat"] = _shared(_cat)
    strategies["shared-any"] = _shared(_any)
    for k in args.loops.split(","):
        strategies[f"loops-{k}"] = _loops(int(k))
    strategies["sync-open-8MB"] = _sync_open(8 << 20)
    if args.only:
        strategies = {k: v for k, v in strategies.items() if k in args.only.split(",")}
    work = tempfile.mkdtemp(prefix="fastload-receive-")
    root = os.path.join(work, "root")
    os.makedirs(root)
    for i in range(args.objects):
        with open(os.path.join(root, f"o{i}"), "wb") as f:
            f.write(os.urandom(size))
    server = Nginx(root, work)
    urls = [f"{server.url}/o{i}" for i in range(args.objects)]
    rates: dict[str, list[float]] = {k: [] for k in strategies}
    cpu: dict[str, list[float]] = {k: [] for k in strategies}
    try:
        for run in strategies.values():  # warm-up: page cache, connections
            run(urls[:2], 2)
        for _ in range(args.rounds):
            for name, run in strategies.items():
                t0, c0 = time.perf_counter(), _cpu()
                n = run(urls, args.concurrency)
                took = time.perf_counter() - t0
                if n != size * len(urls):
                    raise RuntimeError(f"{name}: received {n} bytes")
                rates[name].append(n / took / 1e6)
                cpu[name].append((_cpu() - c0) / (n / 1e9))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.objects} x {args.size}, {args.concurrency} GETs in flight, load {os.getloadavg()[0]:.2f}")
    for name, v in rates.items():
        med = sorted(v)[len(v) // 2]
        cps = sorted(cpu[name])[len(v) // 2]
        print(f"{name:22s} {med:7.0f} MB/s  [{' '.join(f'{x:.0f}' for x in v)}]  cpu {cps:.2f} s/GB")
    return rates


if __name__ == "__main__":
    main()
