"""Receiving streamed bodies: fastload's `HttpReceiver` (`http.client` into a reused buffer) vs obstore's
stream, over HTTP and over HTTPS.

nginx (one worker, sendfile; with `--tls`, HTTPS with a test CA the clients trust through
`SSL_CERT_FILE`) serves `--objects` objects of `--size` bytes; `raw_pipeline` GETs them on 4 threads
through the obstore transport in `DOWNLOAD_CHUNK` pieces (2 MiB), each written to a file and hashed with xxh3 as it
comes (what a shard's download does), with client "http" (the default receiver) and
"obstore-stream", alternating, over `--rounds` rounds. Per receiver: MB/s and this process's user
and total CPU seconds per GB (`getrusage`; nginx's CPU is its own process's, not counted), median
[min-max] over the rounds.

Run: `python -m bench.remote_receivers [--tls] [--objects 12 --size 32MB --rounds 5]`.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import xxhash

from bench.remote import Nginx, write_json
from fastload.benchmark.remote import raw_pipeline
from fastload.formats.units import parse_size

__all__ = ["main"]

CLIENTS = {"http": "http", "obstore": "obstore-stream"}  # row -> `raw_pipeline` client
THREADS = 4


def _objects(root: str, count: int, size: int) -> list[SimpleNamespace]:
    """`count` objects of random bytes under `root`, described as `raw_pipeline` wants (file, xxh3)."""
    rng = np.random.default_rng(0)
    infos = []
    for i in range(count):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        with open(os.path.join(root, f"o{i}"), "wb") as f:
            f.write(data)
        infos.append(SimpleNamespace(file=f"o{i}", xxh3=xxhash.xxh3_64_hexdigest(data)))
    return infos


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the rounds, print the table; returns the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tls", action="store_true", help="serve over HTTPS")
    ap.add_argument("--objects", type=int, default=12)
    ap.add_argument("--size", default="32MB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    work = tempfile.mkdtemp(prefix="fastload-bench-receivers-")
    res: dict[str, dict[str, list[float]]] = {r: {"MB/s": [], "user s/GB": [], "CPU s/GB": []} for r in CLIENTS}
    try:
        root, out = os.path.join(work, "root"), os.path.join(work, "out")
        os.makedirs(root)
        infos = _objects(root, args.objects, size)
        tls, env = None, {}
        if args.tls:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            from s3_fixtures import make_tls_files

            files = make_tls_files(work)
            tls, env = (files.cert, files.key), {"SSL_CERT_FILE": files.ca}
        server = Nginx(root, work, tls=tls)
        try:
            with mock.patch.dict(os.environ, env):
                gb = args.objects * size / 1e9
                for client in CLIENTS.values():  # imports, clients, first calls: outside the rounds
                    raw_pipeline(server.url, infos[:THREADS], out, threads=THREADS, client=client)
                for r in range(args.rounds):
                    for name in CLIENTS if r % 2 == 0 else list(CLIENTS)[::-1]:
                        u0 = resource.getrusage(resource.RUSAGE_SELF)
                        rate = raw_pipeline(server.url, infos, out, threads=THREADS, client=CLIENTS[name])
                        u1 = resource.getrusage(resource.RUSAGE_SELF)
                        user = u1.ru_utime - u0.ru_utime
                        res[name]["MB/s"].append(rate / 1e6)
                        res[name]["user s/GB"].append(user / gb)
                        res[name]["CPU s/GB"].append((user + u1.ru_stime - u0.ru_stime) / gb)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.objects} objects of {args.size} over {'HTTPS' if args.tls else 'HTTP'} (nginx), {THREADS} threads, "
          f"{args.rounds} rounds: median [min-max]")
    for name, cols in res.items():
        print(f"{name:8s} " + "  ".join(
            f"{k} {np.median(v):.{0 if k == 'MB/s' else 3}f} [{min(v):.{0 if k == 'MB/s' else 3}f}-"
            f"{max(v):.{0 if k == 'MB/s' else 3}f}]" for k, v in cols.items()))
    out_res: dict[str, Any] = {"tls": args.tls, "objects": args.objects, "size": size, "rows": res}
    write_json(args.json, out_res)
    return out_res


if __name__ == "__main__":
    main()
