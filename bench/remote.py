"""Remote datasets: the Loader's cold and warm epochs vs the raw GET + xxh3 + write + rename pipeline.

Against a dataset you name (`--url s3://bucket/ds`, any fsspec URL of a converted dataset; options
with `--storage-option key=value`), or against one this script writes and serves locally
(`--server nginx`, the default: one worker, sendfile, almost no CPU; `--server moto`: a Python S3
server that shares the client's cores, whose CPU share is reported). Measures in one run,
interleaved per round, `num_workers` 0 and 2, shuffled (`ShardWindowSampler`) and sequential:
the raw pipeline (8 threads of urllib/boto3 whole-object GETs, of obstore's, and of GETs streamed
through fastload's receiver), the Loader's first epoch (empty cache) and second epoch per transport
(`--transport`, default: "auto", which is obstore for http/s3 with bodies received by `http.client`,
and "obstore-stream", where obstore receives them; "fsspec" on request), and with a local server the
same epoch over the local copy. Every row: median and range over the rounds of MB/s, user and total
CPU s/GB of this process, seconds to the first batch.
See `fastload.benchmark.run_remote` (also `fastload bench --remote URL`).

`--peers`: the peer table instead (`fastload.benchmark.remote_peers`): the same samples written once
in fastload's format, LitData's (`litdata.optimize`) and MosaicML Streaming's MDS (its `MDSWriter`, no
compression), kept under `--data-dir`, all served by one moto S3 server over HTTPS; per row (raw
obstore pipeline; fastload, LitData and Streaming cold, cold again and warm, w0 and w2) MB/s, user
and total CPU s/GB, first batch and the server's CPU s/GB. Every epoch is checked against the
dataset's sample count and label sum.

Streaming (mosaicml-streaming 0.13.0, installed by the Makefile with --no-deps, plus `catalogue` from
`fastload[migrate-test]`) runs `streaming.base.dataset.StreamingDataset` in a torch DataLoader, in
processes of its own that import `streaming.base.*` without running the `__init__` files of
`streaming` and `streaming.base` (`remote_peers.import_streaming_base`). Those two files are what
makes `import streaming` fail here: they import `streaming.vision`, which imports torchvision at module
level (the torchvision build for torch 2.13 links CUDA libraries the CPU torch wheel lacks), and
`StreamingDataLoader`, which imports transformers; the dataset, its boto3 S3 downloader and
`MDSWriter` use neither, and none of streaming's modules is replaced. Its boto3 client reads moto's
endpoint from `S3_ENDPOINT_URL`, the credentials from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`
and the CA from `AWS_CA_BUNDLE`.

Run: `python -m bench.remote [--server nginx|moto] [--shards 12 --shard-size 32MB --rounds 3]`, or
`python -m bench.remote --peers --shard-size 16MB --rounds 5`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any
from unittest import mock

import numpy as np

from fastload.benchmark import format_peers, format_remote, run_peers, run_remote
from fastload.formats import write
from fastload.formats.units import parse_size

__all__ = ["Nginx", "label_sum", "main", "make_dataset", "peer_data", "per_shard", "run_peer_table", "sample",
           "write_json", "write_litdata", "write_mds", "write_mds_here"]

SAMPLE_BYTES = 8192
#: How the Streaming rows run (the module docstring says more).
STREAMING_NOTE = ("mosaicml-streaming 0.13.0's StreamingDataset (streaming.base.dataset; the __init__ files of "
                  "streaming and streaming.base not run, as they import torchvision and transformers, which "
                  "StreamingDataset does not use) in a torch DataLoader, over uncompressed MDS shards; boto3 "
                  "pointed at moto by S3_ENDPOINT_URL and AWS_CA_BUNDLE")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def _payloads() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, size=(64, SAMPLE_BYTES), dtype=np.uint8)


def sample(i: int, per_shard: int) -> dict[str, Any]:
    """Sample `i` of the bench dataset: 8 KiB of uint8 `x` (one of 64 payloads) and an int `label`."""
    return {"x": _payloads()[i % 64], "label": i // per_shard}


def per_shard(shard_size: int) -> int:
    """Samples per shard of about `shard_size` bytes."""
    return max(1, shard_size // (SAMPLE_BYTES + 64))


def make_dataset(out: str, *, shards: int, shard_size: int) -> None:
    """`shards` shards of about `shard_size` bytes: 8 KiB uint8 records and an int label."""
    k = per_shard(shard_size)
    write((sample(i, k) for i in range(shards * k)), out, shard_size=shard_size, progress=False)


def write_litdata(out: str, *, shards: int, shard_size: int) -> None:
    """`make_dataset`'s samples, in order, as LitData chunks of about `shard_size` bytes (`litdata.optimize`,
    one worker so that the order is kept)."""
    import litdata

    k = per_shard(shard_size)
    litdata.optimize(fn=functools.partial(sample, per_shard=k), inputs=list(range(shards * k)), output_dir=out,
                     chunk_bytes=shard_size, num_workers=1, start_method="fork", verbose=False)


def write_mds(out: str, *, shards: int, shard_size: int) -> None:
    """`make_dataset`'s samples, in order, as MosaicML Streaming MDS shards of about `shard_size` bytes
    (streaming's `MDSWriter`, one writer, no compression; `x` as `ndarray:uint8:8192`, `label` as
    `int`), written by a Python process of its own: streaming's modules are imported there
    (`remote_peers.import_streaming_base`), never in this one."""
    code = ("import sys; from bench.remote import write_mds_here; "
            "write_mds_here(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))")
    proc = subprocess.run([sys.executable, "-c", code, os.path.abspath(out), str(shards), str(shard_size)],
                          cwd=_REPO, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"writing MDS shards to {out} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def write_mds_here(out: str, shards: int, shard_size: int) -> None:
    """`write_mds` in this process (which then holds streaming's modules: see `write_mds`)."""
    from fastload.benchmark.remote_peers import import_streaming_base

    import_streaming_base()
    from streaming.base.format.mds.writer import MDSWriter

    k = per_shard(shard_size)
    columns = {"x": f"ndarray:uint8:{SAMPLE_BYTES}", "label": "int"}
    with MDSWriter(out=out, columns=columns, compression=None, size_limit=shard_size, progress_bar=False) as w:
        for i in range(shards * k):
            w.write(sample(i, k))


def peer_data(data_dir: str, *, shards: int, shard_size: int) -> dict[str, str]:
    """The bench dataset in fastload's format and in each peer's (`write_litdata`, `write_mds`), each
    written once and kept under `data_dir` per size: {"fastload": dir, "litdata": dir, "streaming": dir}."""
    root = os.path.join(data_dir, f"remote-{shards}x{shard_size}")
    writers = {"fastload": make_dataset, "litdata": write_litdata, "streaming": write_mds}
    paths = {name: os.path.join(root, name) for name in writers}
    for name, writer in writers.items():
        complete = os.path.join(root, f"{name}.complete")
        if not os.path.exists(complete):
            shutil.rmtree(paths[name], ignore_errors=True)
            writer(paths[name], shards=shards, shard_size=shard_size)
            open(complete, "w").close()
    return paths


def label_sum(*, shards: int, shard_size: int) -> int:
    """The sum of the bench dataset's labels (`sample`): every epoch of every row must reproduce it."""
    return per_shard(shard_size) * sum(range(shards))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_peer_table(data_dir: str, *, shards: int, shard_size: int, rounds: int, batch_size: int = 256,
                   threads: int = 8, workers: tuple[int, ...] = (0, 2)) -> dict[str, Any]:
    """fastload's and the peers' rows (`fastload.benchmark.remote_peers`) over the same samples, every
    format served by one moto S3 server over HTTPS on 127.0.0.1 (LitData's obstore client refuses plain
    HTTP endpoints); the clients trust its CA through `SSL_CERT_FILE` and `AWS_CA_BUNDLE`. Streaming's
    options are the environment variables its boto3 client reads."""
    import moto as moto_pkg

    _tests_on_path()
    from s3_fixtures import REGION, MotoServer, make_tls_files, storage_options, upload_dir

    paths = peer_data(data_dir, shards=shards, shard_size=shard_size)
    work = tempfile.mkdtemp(prefix="fastload-bench-peers-")
    try:
        tls = make_tls_files(work)
        with mock.patch.dict(os.environ, {"SSL_CERT_FILE": tls.ca, "AWS_CA_BUNDLE": tls.ca}):
            server = MotoServer(tls=tls).start()
            try:
                client = server.client()
                client.create_bucket(Bucket="bench")
                for name, path in paths.items():
                    upload_dir(client, path, "bench", name)
                lit = {"endpoint_url": server.endpoint, "aws_access_key_id": "testing",
                       "aws_secret_access_key": "testing", "region_name": REGION}
                env = {"S3_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}
                peers = {"litdata": {"url": "s3://bench/litdata", "storage_options": lit},
                         "streaming": {"url": "s3://bench/streaming", "storage_options": env}}
                for name, spec in peers.items():
                    spec["bytes"] = _dir_bytes(paths[name])
                assert server.proc is not None
                res = run_peers("s3://bench/fastload", storage_options=storage_options(server.endpoint, timeout=60),
                                peers=peers, rounds=rounds, workers=workers, batch_size=batch_size, threads=threads,
                                server_pid=server.proc.pid,
                                label_sum=label_sum(shards=shards, shard_size=shard_size))
            finally:
                server.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["server"] = (f"moto {moto_pkg.__version__} (python -m moto.server, one process on 127.0.0.1, HTTPS) "
                     "for every row, sharing the client's cores")
    res["notes"] = {"streaming": STREAMING_NOTE}
    return res


class Nginx:
    """nginx serving `root` on a free 127.0.0.1 port (one worker, sendfile; over HTTPS with `tls`, a
    (certificate, key) pair of PEM files; each response sent at most `limit_rate` bytes a second
    when given, so that GETs last long enough to overlap); `stop()` ends it, and so does the
    interpreter's exit or the object's collection (a script that fails before `stop()` leaves no
    server). nginx gets none of the caller's standard streams: a caller reading this process's
    output through a pipe sees its end when this process ends."""

    def __init__(self, root: str, work: str, *, tls: tuple[str, str] | None = None,
                 limit_rate: int | None = None) -> None:
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
                f"  server {{ listen 127.0.0.1:{self.port}{' ssl' if tls else ''}; root {root};"
                + (f" ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]};" if tls else "")
                + (f" limit_rate {int(limit_rate)};" if limit_rate else "")
                + " } }\n"
            )
        self.proc = subprocess.Popen([exe, "-c", conf, "-p", work], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._end = weakref.finalize(self, _end_process, self.proc)
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
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._end()


def _end_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate `proc` (killed after 10 s) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tests_on_path() -> None:
    """Make tests/s3_fixtures importable (the moto server and its helpers)."""
    tests = os.path.join(_REPO, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def _serve(kind: str, root: str, work: str) -> tuple[str, dict[str, Any], int, Any]:
    """Serve `root/ds`: (URL, storage options, server pid, stop function)."""
    if kind == "nginx":
        server = Nginx(root, work)
        return f"{server.url}/ds", {}, server.proc.pid, server.stop
    _tests_on_path()
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
    ap.add_argument("--transport", dest="transports", action="append",
                    choices=("auto", "obstore", "obstore-stream", "fsspec"),
                    help="Loader rows per transport (repeatable; default: auto and obstore-stream)")
    ap.add_argument("--peers", action="store_true",
                    help="the peer table instead: fastload, the raw pipeline, LitData and Streaming over one moto S3 "
                         "server")
    ap.add_argument("--data-dir", default=os.path.join("build", "bench-data"),
                    help="--peers: where the dataset and its peer formats are written once and kept")
    args = ap.parse_args(argv)
    if args.peers:
        if args.url:
            ap.error("--peers writes and serves its own data: no --url")
        res = run_peer_table(args.data_dir, shards=args.shards, shard_size=parse_size(args.shard_size),
                             rounds=args.rounds, batch_size=args.batch_size, threads=args.threads)
        print(format_peers(res))
        write_json(args.json, res)
        return res
    args.transports = tuple(args.transports or ("auto", "obstore-stream"))
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
                                 transports=args.transports, raw_clients=("plain", "obstore", "http"), **common)
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
