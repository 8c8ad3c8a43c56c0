"""Remote datasets: the Loader's cold and warm epochs vs the raw GET + xxh3 + write + rename pipeline.

Against a dataset you name (`--url s3://bucket/ds`, any fsspec URL of a converted dataset; options
with `--storage-option key=value`), or against one this script writes and serves locally
(`--server nginx`, the default: one worker, sendfile, almost no CPU; `--server moto`: a Python S3
server that shares the client's cores, whose CPU share is reported). Measures in one run,
interleaved per round, `num_workers` 0 and 2, shuffled (`ShardWindowSampler`) and sequential:
the raw pipeline (8 threads of urllib/boto3, and of obstore), the Loader's first epoch (empty cache)
and second epoch per transport (`--transport`, default: "auto", which is obstore for http/s3, and
"fsspec"), and with a local server the same epoch over the local copy. Every row: median and range
over the rounds of MB/s, user and total CPU s/GB of this process, seconds to the first batch.
See `fastload.benchmark.run_remote` (also `fastload bench --remote URL`).

Run: `python -m bench.remote [--server nginx|moto] [--shards 12 --shard-size 32MB --rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from fastload.benchmark import format_remote, run_remote
from fastload.formats import write
from fastload.formats.units import parse_size

__all__ = ["Nginx", "main", "make_dataset", "write_json"]

SAMPLE_BYTES = 8192


def make_dataset(out: str, *, shards: int, shard_size: int) -> None:
    """`shards` shards of about `shard_size` bytes: 8 KiB uint8 records and an int label."""
    per_shard = max(1, shard_size // (SAMPLE_BYTES + 64))
    n = shards * per_shard

    def gen():
        rng = np.random.default_rng(0)
        base = rng.integers(0, 255, size=(64, SAMPLE_BYTES), dtype=np.uint8)
        for i in range(n):
            yield {"x": base[i % 64], "label": i // per_shard}

    write(gen(), out, shard_size=shard_size, progress=False)


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


def _serve(kind: str, root: str, work: str) -> tuple[str, dict[str, Any], int, Any]:
    """Serve `root/ds`: (URL, storage options, server pid, stop function)."""
    if kind == "nginx":
        server = Nginx(root, work)
        return f"{server.url}/ds", {}, server.proc.pid, server.stop
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from s3_fixtures import MotoServer, storage_options, upload_dir

    moto = MotoServer().start()
    client = moto.client()
    client.create_bucket(Bucket="bench")
    upload_dir(client, os.path.join(root, "ds"), "bench", "ds")
    return "s3://bench/ds", storage_options(moto.endpoint, timeout=60), moto.proc.pid, moto.kill


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the rounds, print the table; returns the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="an existing fastload dataset at an fsspec URL (no local server)")
    ap.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--server", choices=("nginx", "moto"), default="nginx")
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--shard-size", default="32MB")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=8, help="threads of the raw pipeline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--transport", dest="transports", action="append", choices=("auto", "obstore", "fsspec"),
                    help="Loader rows per transport (repeatable; default: auto and fsspec)")
    args = ap.parse_args(argv)
    args.transports = tuple(args.transports or ("auto", "fsspec"))
    opts = dict(kv.split("=", 1) for kv in args.storage_option)
    common = {"rounds": args.rounds, "threads": args.threads, "batch_size": args.batch_size}
    if args.url:
        res = run_remote(args.url, storage_options=opts, transports=args.transports, **common)
    else:
        work = tempfile.mkdtemp(prefix="fastload-bench-remote-")
        root = os.path.join(work, "root")
        try:
            make_dataset(os.path.join(root, "ds"), shards=args.shards, shard_size=parse_size(args.shard_size))
            url, opts, pid, stop = _serve(args.server, root, work)
            try:
                res = run_remote(url, storage_options=opts, local=os.path.join(root, "ds"), watch_pids=(pid,),
                                 transports=args.transports, raw_clients=("plain", "obstore"), **common)
            finally:
                stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        res["server"] = args.server
    print(format_remote(res))
    write_json(args.json, res)
    return res


def write_json(path: str | None, obj: Any) -> None:
    """Write `obj` as JSON to `path` (nothing when None)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


if __name__ == "__main__":
    main()
