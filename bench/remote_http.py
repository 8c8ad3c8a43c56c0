"""Remote datasets over HTTP from nginx: the Loader's cold first epoch vs the raw GET pipeline.

Serves a converted dataset with nginx (one worker, sendfile, a generated config on 127.0.0.1)
and measures in one run, interleaved per round:

- raw: 8 threads of whole-object GET + xxh3 + write + rename per shard (what a user writes by hand);
- cold: `fastload.Loader` over `open_dataset("http://127.0.0.1:PORT/ds", cache_dir=...)` with an
  empty cache, `num_workers` 0 and 2, shuffled (`ShardWindowSampler`) and sequential;
- warm: the same loader's second epoch (cache full).

Run: `python -m bench.remote_http [--shards 12 --shard-size 32MB --rounds 2]`. Needs `nginx` on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from bench.remote import _make_dataset
from fastload.dataset import open_dataset
from fastload.formats import FastloadDataset
from fastload.formats.units import parse_size
from fastload.loader import Loader
from fastload.shard_shuffle import ShardWindowSampler

__all__ = ["Nginx", "main"]


class Nginx:
    """nginx serving `root` on a free 127.0.0.1 port (one worker, sendfile); `stop()` ends it."""

    def __init__(self, root: str, work: str) -> None:
        exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if exe is None:
            raise RuntimeError("nginx not found on PATH (apt-get install -y nginx)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        conf = os.path.join(work, "nginx.conf")
        # as root, nginx's workers would switch to `nobody` and could not read a private temp dir
        user = "user root;\n" if os.geteuid() == 0 else ""
        with open(conf, "w") as f:
            f.write(
                f"{user}worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/error.log;\n"
                "events { worker_connections 256; }\n"
                f"http {{ access_log off; sendfile on; tcp_nopush on; client_body_temp_path {work}/b;"
                f" proxy_temp_path {work}/p; fastcgi_temp_path {work}/f; uwsgi_temp_path {work}/u;"
                f" scgi_temp_path {work}/s;\n"
                f"  server {{ listen 127.0.0.1:{self.port}; root {root}; }} }}\n"
            )
        self.proc = subprocess.Popen([exe, "-c", conf, "-p", work], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("nginx did not start") from None
                time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def raw_pipeline(url: str, shards: list[Any], out_dir: str, threads: int = 8) -> float:
    """Bytes/s of `threads` whole-object GET + xxh3 + write + rename, one shard per task."""
    os.makedirs(out_dir, exist_ok=True)

    def one(info: Any) -> int:
        with urllib.request.urlopen(f"{url}/{info.file}", timeout=60) as r:
            data = r.read()
        if xxhash.xxh3_64_hexdigest(data) != info.xxh3.lower():
            raise RuntimeError(f"{info.file}: xxh3 mismatch")
        dst = os.path.join(out_dir, os.path.basename(info.file))
        with open(dst + ".part", "wb") as f:
            f.write(data)
        os.rename(dst + ".part", dst)
        return len(data)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, shards))
    return total / (time.perf_counter() - t0)


STAGES = ("request_s", "receive_s", "write_s", "verify_s", "fsync_s", "commit_s", "wait_s", "get_busy_s")


def _epoch(ds: Any, *, shuffled: bool, workers: int, batch_size: int, seed: int) -> tuple[float, dict[str, Any]]:
    """Seconds for one epoch and the `remote_*` stages this epoch added to `loader.stats()`."""
    sampler = ShardWindowSampler.from_dataset(ds, window=4, seed=seed) if shuffled else None
    loader = Loader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, worker_type="thread")
    before = ds.storage.stats()
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += int(batch["x"].shape[0])
    took = time.perf_counter() - t0
    if n != len(ds):
        raise RuntimeError(f"epoch saw {n} samples, dataset has {len(ds)}")
    after = loader.stats()
    stages = {k: after[f"remote_{k}"] - before[f"remote_{k}"] for k in STAGES}
    stages["gets_in_flight_mean"] = after["remote_gets_in_flight_mean"]
    stages["read_s"] = after.get("read_s", 0.0)
    return took, stages


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--shard-size", default="32MB")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="fastload-bench-http-")
    root = os.path.join(work, "root")
    _make_dataset(os.path.join(root, "ds"), shards=args.shards, shard_size=parse_size(args.shard_size))
    local = FastloadDataset(os.path.join(root, "ds"))
    shards = list(local.manifest.shards)
    nbytes = sum(s.bytes for s in shards)
    server = Nginx(root, work)
    url = f"{server.url}/ds"
    rows: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            out = os.path.join(work, f"raw{r}")
            rows.setdefault("raw", []).append(raw_pipeline(url, shards, out))
            shutil.rmtree(out)
            for workers in (0, 2):
                for shuffled in (True, False):
                    key = f"w{workers}-{'shuffled' if shuffled else 'sequential'}"
                    cache = os.path.join(work, f"cache-{r}-{key}")
                    ds = open_dataset(url, cache_dir=cache, cache_limit=2 * nbytes)
                    cold, st = _epoch(ds, shuffled=shuffled, workers=workers, batch_size=args.batch_size, seed=r)
                    warm, _ = _epoch(ds, shuffled=shuffled, workers=workers, batch_size=args.batch_size, seed=r + 1)
                    print(f"round {r} {key} cold {cold:.2f}s " + " ".join(f"{k}={v:.2f}" for k, v in st.items()),
                          flush=True)
                    rows.setdefault(f"{key} cold", []).append(nbytes / cold)
                    rows.setdefault(f"{key} warm", []).append(nbytes / warm)
                    del ds
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    raw = sorted(rows["raw"])[len(rows["raw"]) // 2]
    print(f"data {nbytes / 1e6:.0f} MB in {len(shards)} shards; rounds {args.rounds} (medians)")
    result: dict[str, Any] = {}
    for k, v in rows.items():
        med = sorted(v)[len(v) // 2]
        result[k] = {"MB/s": med / 1e6, "x_raw": med / raw}
        print(f"{k:24s} {med / 1e6:8.0f} MB/s  {med / raw:5.2f}x raw")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
