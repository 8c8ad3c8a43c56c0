"""Receiving streamed bodies: fastload's `HttpReceiver` (`http.client` into a reused buffer) vs obstore's
stream, over HTTP and over HTTPS.

nginx (one worker, sendfile; with `--tls`, HTTPS with a test CA the clients trust through
`SSL_CERT_FILE`) serves `--objects` objects of `--size` bytes; 4 threads GET them through
`ObstoreTransport.stream_into` in 1 MiB pieces, each written to a file at its offset and hashed with
xxh3 as it comes (what a shard's download does), with `receive="http"` (the default) and
`receive="obstore"`, alternating, over `--rounds` rounds. Per receiver: MB/s and this process's user
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
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import numpy as np
import xxhash

from bench.remote import Nginx, write_json
from fastload.formats.units import parse_size

__all__ = ["main"]

RECEIVERS = ("http", "obstore")
THREADS = 4


class _Sink:
    """Writes each piece at its offset and hashes it (a shard download's work per piece)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.hash, self.pos = fd, xxhash.xxh3_64(), 0

    def write(self, piece: Any) -> None:
        os.pwrite(self.fd, piece, self.pos)
        self.hash.update(piece)
        self.pos += len(piece)


def _pass(transport: Any, names: list[str], out: str, digests: dict[str, str]) -> float:
    """Receive every object once on `THREADS` threads; seconds taken (each body's xxh3 checked)."""
    from fastload.remote.storage import DOWNLOAD_CHUNK
    from fastload.remote.transfer_stats import TransferStats

    def one(name: str) -> None:
        fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            sink = _Sink(fd)
            transport.stream_into(name, sink, TransferStats(), chunk=DOWNLOAD_CHUNK)
        finally:
            os.close(fd)
        if sink.hash.hexdigest() != digests[name]:
            raise RuntimeError(f"{name}: xxh3 mismatch")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(one, names))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the rounds, print the table; returns the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tls", action="store_true", help="serve over HTTPS")
    ap.add_argument("--objects", type=int, default=12)
    ap.add_argument("--size", default="32MB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from fastload.remote.transport_obstore import ObstoreTransport

    size = parse_size(args.size)
    work = tempfile.mkdtemp(prefix="fastload-bench-receivers-")
    res: dict[str, dict[str, list[float]]] = {r: {"MB/s": [], "user s/GB": [], "CPU s/GB": []} for r in RECEIVERS}
    try:
        root, out = os.path.join(work, "root"), os.path.join(work, "out")
        os.makedirs(root)
        os.makedirs(out)
        rng = np.random.default_rng(0)
        names, digests = [], {}
        for i in range(args.objects):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            names.append(f"o{i}")
            digests[f"o{i}"] = xxhash.xxh3_64_hexdigest(data)
            with open(os.path.join(root, f"o{i}"), "wb") as f:
                f.write(data)
        tls, env = None, {}
        if args.tls:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            from s3_fixtures import make_tls_files

            files = make_tls_files(work)
            tls, env = (files.cert, files.key), {"SSL_CERT_FILE": files.ca}
        server = Nginx(root, work, tls=tls)
        try:
            with mock.patch.dict(os.environ, env):
                transports = {r: ObstoreTransport(server.url, {}, connect_timeout=10, read_timeout=60, receive=r)
                              for r in RECEIVERS}
                for t in transports.values():  # connections, TLS sessions, first calls: outside the rounds
                    _pass(t, names[:THREADS], out, digests)
                gb = args.objects * size / 1e9
                for r in range(args.rounds):
                    for name in RECEIVERS if r % 2 == 0 else RECEIVERS[::-1]:
                        u0 = resource.getrusage(resource.RUSAGE_SELF)
                        took = _pass(transports[name], names, out, digests)
                        u1 = resource.getrusage(resource.RUSAGE_SELF)
                        user = u1.ru_utime - u0.ru_utime
                        res[name]["MB/s"].append(gb * 1e3 / took)
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
