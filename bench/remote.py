"""Remote datasets: epoch 1 from S3 vs raw GET bandwidth, epoch 2 (warm cache) vs local disk.

Starts a local `moto` S3 server, writes a dataset, uploads it, then measures in one run:

- raw: whole-object GETs of every shard through the same fsspec client, `--threads` in parallel
  (best of two passes each of `cat_file` and of the streamed GET the cache uses, bytes dropped:
  the first pass over an object is slower, moto warms up);
- GET + write: the same streamed GETs written and hashed into files in the cache directory and
  nothing more (no cache state, no reader): the work any on-disk shard cache adds to a GET;
- epoch 1: `fastload.Loader` over `RemoteStorage` with an empty cache (fetch + verify + read);
- epoch 2: the same loader again (cache warm) vs the same loader over the local directory
  (warm epochs are short: best of epochs 2-4 on each side, interleaved);
- the shard-window shuffle's randomness against a full permutation.

Bars: epoch 1 >= 80% of raw GET bandwidth; epoch 2 >= 90% of local disk. CPU seconds (this process
plus the server) are reported per pass for the raw GET, GET + write, and epoch 1.
Run: `python -m bench.remote [--shards 12 --shard-size 16MB --threads 4]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil

from fastload.cache import Download
from fastload.formats import FastloadDataset, write
from fastload.formats.units import parse_size
from fastload.loader import Loader
from fastload.remote import RemoteStorage
from fastload.shard_shuffle import ShardWindowSampler, randomness_report
from fastload.system import usable_cores

__all__ = ["main"]

SAMPLE_BYTES = 8192
_RATES = ("raw", "floor", "e1", "e2", "local")  # per-round entries in bytes/s


def _make_dataset(out: str, *, shards: int, shard_size: int) -> None:
    per_shard = max(1, shard_size // (SAMPLE_BYTES + 64))
    n = shards * per_shard

    def gen():
        rng = np.random.default_rng(0)
        base = rng.integers(0, 255, size=(64, SAMPLE_BYTES), dtype=np.uint8)
        for i in range(n):
            yield {"x": base[i % 64], "label": i // per_shard}

    write(gen(), out, shard_size=shard_size, progress=False)


def _epoch(ds: Any, sampler: ShardWindowSampler, *, epoch: int, batch_size: int, workers: int) -> tuple[float, int]:
    sampler.set_epoch(epoch)
    loader = Loader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, worker_type="thread")
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += int(batch["x"].shape[0])
    return time.perf_counter() - t0, n


class _Discard:
    """A download sink that only counts bytes (the raw GET limit writes nothing)."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes | memoryview) -> None:
        self.written += len(data)


def _raw_gets(storage: RemoteStorage, paths: list[str], threads: int, *, passes: int = 2) -> float:
    """Bytes/s of parallel whole-object GETs, the faster of `cat_file` and the streamed GET that
    the cache's fetch path uses (with the bytes dropped instead of written and hashed)."""

    def streamed(path: str) -> int:
        sink = _Discard()
        storage._get_into(path, sink)
        return sink.written

    best = 0.0
    gets = [streamed] if passes == 1 else [lambda p: len(storage.fs.cat_file(p)), streamed] * passes
    for get in gets:  # the first pass over an object warms the server
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(get, paths))
        best = max(best, total / (time.perf_counter() - t0))
    return best


def _gets_into_files(storage: RemoteStorage, shards: list[Any], threads: int, tmp_dir: str) -> float:
    """Bytes/s of the same parallel streamed GETs written and hashed into files in `tmp_dir` (the
    cache's `Download` sink) and nothing else: no cache state, no reader. Any cache that keeps
    shards on local disk does at least this much work per byte."""

    def one(info: Any) -> int:
        path = os.path.join(tmp_dir, f"floor-{os.path.basename(info.file)}")
        sink = Download(path, size=info.bytes, xxh3=info.xxh3, where=info.file)
        try:
            storage._get_into(storage.remote_path(info.file), sink)
            sink.check()
            sink.finish(fsync=False)
        finally:
            sink.close()
            os.unlink(path)
        return sink.written

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, shards))
    return total / (time.perf_counter() - t0)


class _CpuMeter:
    """CPU seconds (user + system) of this process plus the S3 server's process."""

    def __init__(self, server_pid: int) -> None:
        self._procs = [psutil.Process(), psutil.Process(server_pid)]

    def now(self) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self._procs))


def randomness_table(
    *, shards: int = 1000, per_shard: int = 1000, batch_size: int = 256
) -> dict[str, dict[str, float]]:
    """Worst case for windows: labels sorted by shard (10 shards per label)."""
    sizes = [per_shard] * shards
    labels = np.repeat(np.arange(shards // 10), 10 * per_shard)
    table = {
        "full permutation": randomness_report(
            np.random.default_rng(0).permutation(shards * per_shard), labels, batch_size=batch_size
        )
    }
    for w in (1, 4, 16, 64):
        table[f"window={w}"] = randomness_report(
            list(ShardWindowSampler(sizes, window=w, seed=0)), labels, batch_size=batch_size
        )
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--shard-size", default="16MB")
    ap.add_argument("--threads", type=int, default=4, help="parallel GETs (raw and prefetch)")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from s3_fixtures import MotoServer, storage_options, upload_dir

    work = tempfile.mkdtemp(prefix="fastload-bench-remote-")
    server = MotoServer().start()
    try:
        local_dir = os.path.join(work, "ds")
        _make_dataset(local_dir, shards=args.shards, shard_size=parse_size(args.shard_size))
        client = server.client()
        client.create_bucket(Bucket="bench")
        upload_dir(client, local_dir, "bench", "ds")
        local = FastloadDataset(local_dir)
        data_bytes = sum(s.bytes for s in local.manifest.shards)
        opts = storage_options(server.endpoint, timeout=60)
        cpu = _CpuMeter(server.proc.pid)
        rounds = []
        for r in range(args.rounds):  # paired measurements per round: this box may be shared and noisy
            cache_dir = os.path.join(work, f"cache{r}")
            storage = RemoteStorage(
                "s3://bench/ds",
                storage_options=opts,
                cache_dir=cache_dir,
                cache_limit=2 * data_bytes,
                prefetch_depth=2 * args.threads,
                fetch_threads=args.threads,
            )
            remote = FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)
            paths = [storage.remote_path(s.file) for s in local.manifest.shards]
            raw = _raw_gets(storage, paths, args.threads)
            c0 = cpu.now()
            _raw_gets(storage, paths, args.threads, passes=1)  # one streamed pass, for its CPU seconds
            c1 = cpu.now()
            os.makedirs(cache_dir, exist_ok=True)
            floor = _gets_into_files(storage, list(local.manifest.shards), args.threads, cache_dir)
            c2 = cpu.now()
            sampler = ShardWindowSampler.from_dataset(remote, window=args.window, seed=r)
            t1, n1 = _epoch(remote, sampler, epoch=0, batch_size=args.batch_size, workers=args.workers)
            c3 = cpu.now()
            assert n1 == len(local)
            # warm epochs last ~0.1 s here: take the best of 3 for both sides, epochs interleaved
            local_sampler = ShardWindowSampler.from_dataset(local, window=args.window, seed=r)
            t2 = tl = float("inf")
            for e in (1, 2, 3):
                t2 = min(t2, _epoch(remote, sampler, epoch=e, batch_size=args.batch_size, workers=args.workers)[0])
                tl = min(tl, _epoch(local, local_sampler, epoch=e, batch_size=args.batch_size, workers=args.workers)[0])
            rounds.append(
                {
                    "raw": raw,
                    "floor": floor,
                    "e1": data_bytes / t1,
                    "e2": data_bytes / t2,
                    "local": data_bytes / tl,
                    "cpu_raw": c1 - c0,
                    "cpu_floor": c2 - c1,
                    "cpu_e1": c3 - c2,
                    "stats": storage.stats(),
                }
            )
            storage.close()
            remote.close()
            shutil.rmtree(cache_dir, ignore_errors=True)

        def med(f: Any) -> float:
            return float(np.median([f(x) for x in rounds]))

        res = {
            "dataset_bytes": data_bytes,
            "shards": len(local.manifest.shards),
            "samples": len(local),
            "rounds": args.rounds,
            "raw_get_MBps": med(lambda x: x["raw"]) / 1e6,
            "epoch1_MBps": med(lambda x: x["e1"]) / 1e6,
            "epoch1_vs_raw": med(lambda x: x["e1"] / x["raw"]),
            "get_write_MBps": med(lambda x: x["floor"]) / 1e6,
            "get_write_vs_raw": med(lambda x: x["floor"] / x["raw"]),
            "epoch1_vs_get_write": med(lambda x: x["e1"] / x["floor"]),
            "epoch2_MBps": med(lambda x: x["e2"]) / 1e6,
            "local_MBps": med(lambda x: x["local"]) / 1e6,
            "epoch2_vs_local": med(lambda x: x["e2"] / x["local"]),
            "cpu_s": {k: med(lambda x, k=k: x[f"cpu_{k}"]) for k in ("raw", "floor", "e1")},
            "cores": usable_cores(),
            "per_round": [{k: (v / 1e6 if k in _RATES else v) for k, v in x.items()} for x in rounds],
            "randomness": randomness_table(),
        }
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"dataset: {res['shards']} shards, {res['dataset_bytes'] / 1e6:.0f} MB, {res['samples']} samples; "
        f"{args.threads} parallel GETs, window={args.window}, batch={args.batch_size}, {args.workers} workers"
    )
    print(
        f"medians of {res['rounds']} paired rounds (MB/s: raw, GET+write, epoch1, epoch2, local): "
        + "; ".join(
            f"{x['raw']:.0f}/{x['floor']:.0f}/{x['e1']:.0f}/{x['e2']:.0f}/{x['local']:.0f}" for x in res["per_round"]
        )
    )
    print(f"raw whole-object GET (fsspec, parallel): {res['raw_get_MBps']:8.1f} MB/s")
    ok1 = "PASS" if res["epoch1_vs_raw"] >= 0.8 else "FAIL"
    print(
        f"epoch 1 from S3 (cold cache):            {res['epoch1_MBps']:8.1f} MB/s = "
        f"{100 * res['epoch1_vs_raw']:.0f}% of raw (bar 80%) {ok1}"
    )
    print(
        f"  GET + write + xxh3 into cache_dir only: {res['get_write_MBps']:8.1f} MB/s = "
        f"{100 * res['get_write_vs_raw']:.0f}% of raw (the work any on-disk cache adds; epoch 1 = "
        f"{100 * res['epoch1_vs_get_write']:.0f}% of it)"
    )
    c, cores = res["cpu_s"], res["cores"]
    raw_wall = res["dataset_bytes"] / (res["raw_get_MBps"] * 1e6)
    print(
        f"  CPU seconds, client + S3 server, per pass over the data: raw GET {c['raw']:.2f}, "
        f"GET+write {c['floor']:.2f}, epoch 1 {c['e1']:.2f}; spread perfectly over {cores} cores, "
        f"GET+write's work alone allows at most {100 * min(1.0, raw_wall / (c['floor'] / cores)):.0f}% of raw"
    )
    ok2 = "PASS" if res["epoch2_vs_local"] >= 0.9 else "FAIL"
    print(
        f"epoch 2 (warm cache):                    {res['epoch2_MBps']:8.1f} MB/s = "
        f"{100 * res['epoch2_vs_local']:.0f}% of local disk {res['local_MBps']:.1f} MB/s (bar 90%) {ok2}"
    )
    print("randomness (1000 shards x 1000 samples, labels sorted by shard, batch 256):")
    print(f"  {'order':18s} {'corr(pos,idx)':>14s} {'labels/batch':>13s} {'batch TV':>9s} {'same-label nbrs':>16s}")
    for name, r in res["randomness"].items():
        print(
            f"  {name:18s} {r['position_index_corr']:14.3f} {r['labels_per_batch']:13.1f} "
            f"{r['batch_label_tv']:9.3f} {r['same_label_neighbors']:16.3f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
