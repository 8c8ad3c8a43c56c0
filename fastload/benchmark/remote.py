"""`fastload bench --remote URL`: a remote dataset's first and second Loader epochs vs the raw pipeline.

For a fastload dataset at any fsspec URL, measured in one run, interleaved per round:

- raw: `threads` threads of whole-object GET + xxh3 check + write + rename per shard, the pipeline
  a user writes by hand (GET by `urllib` for http(s), boto3 for s3, fsspec's `cat_file` otherwise);
- cold: `fastload.Loader` over `open_dataset(url, cache_dir=<empty>)`, the first epoch;
- warm: the same dataset object's second epoch (every shard cached);
- local (when `local` names the same dataset on disk): that epoch over the local copy;

for `num_workers` in `workers` (thread workers) and two orders: shuffled (`ShardWindowSampler`,
`window` shards at a time) and sequential. Each cold row carries the `remote_*` stage timings its
epoch added to `loader.stats()`, and each raw and cold pass the CPU seconds per GB this process spent
(all its threads: a cost that the machine's load changes far less than it changes wall time), and
the user-mode part of it alone: system time includes the page faults of writing new page-cache
pages, which on a VM that hands free memory back to its host swings with the host, while user time
(receiving, hashing, bookkeeping, the Loader's batches) is the loader's own. A Loader row's fetch
cost is its cold epoch's user CPU minus its warm epoch's, per round (`fetch_costs`), printed beside
the raw pipeline's user CPU.
Every epoch reads the whole dataset: point it at a small one (a few hundred MB). `watch_pids`:
processes (a local server) whose CPU share is reported. Before each raw pass and each cold epoch
(untimed) as many bytes as the dataset holds are written to a scratch file and deleted
(`limits.recycle_page_cache`), so that both write into recently used page-cache pages: on a VM that
hands free pages back to its host, the pass that got never-touched pages would otherwise lose by
several times.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import psutil
import xxhash

__all__ = ["STAGES", "fetch_costs", "format_remote", "raw_pipeline", "run_remote"]

STAGES = ("request_s", "receive_s", "write_s", "verify_s", "fsync_s", "commit_s", "wait_s", "state_s", "state_updates",
          "get_busy_s")


def _whole_object_get(url: str, storage_options: dict[str, Any] | None) -> Callable[[str], bytes]:
    """The plainest fast GET of a whole object a user would write: `urllib` for http(s), boto3's
    `get_object` for s3 (when installed), fsspec's `cat_file` otherwise."""
    protocol = url.split("://", 1)[0].lower()
    opts = dict(storage_options or {})
    if protocol in ("http", "https"):
        import urllib.request

        def get_http(rel: str) -> bytes:
            with urllib.request.urlopen(f"{url.rstrip('/')}/{rel}", timeout=60) as r:
                return r.read()

        return get_http
    if protocol in ("s3", "s3a"):
        try:
            import boto3
        except ImportError:
            boto3 = None
        if boto3 is not None:
            kw = dict(opts.get("client_kwargs") or {})
            for src, dst in (("key", "aws_access_key_id"), ("secret", "aws_secret_access_key")):
                if src in opts:
                    kw[dst] = opts[src]
            client = boto3.client("s3", **kw)
            bucket, _, prefix = url.split("://", 1)[1].partition("/")

            def get_s3(rel: str) -> bytes:
                return client.get_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{rel}")["Body"].read()

            return get_s3
    fs, root = fsspec.core.url_to_fs(url, **opts)
    return lambda rel: fs.cat_file(f"{root.rstrip('/')}/{rel}")


def _obstore_get(url: str, storage_options: dict[str, Any] | None) -> Callable[[str], bytes]:
    """A whole-object GET through obstore (the client of fastload's obstore transport)."""
    import obstore

    from fastload.remote.transport_obstore import ObstoreTransport

    store = ObstoreTransport(url, dict(storage_options or {}), connect_timeout=60, read_timeout=60).store
    return lambda rel: obstore.get(store, rel).bytes()


def _streamed_fetch(url: str, storage_options: dict[str, Any] | None,
                    receive: str) -> Callable[[str, str], tuple[int, str]]:
    """A GET streamed into a file by fastload's obstore transport, received by `receive` ("http":
    `HttpReceiver`, from the URL obstore gives; "obstore": obstore's stream) in pieces of
    `DOWNLOAD_CHUNK`, each written and hashed as it comes: (bytes, xxh3 hex)."""
    from fastload.remote.storage import DOWNLOAD_CHUNK
    from fastload.remote.transfer_stats import TransferStats
    from fastload.remote.transport_obstore import ObstoreTransport

    transport = ObstoreTransport(url, dict(storage_options or {}), connect_timeout=60, read_timeout=60,
                                 receive=receive)
    if receive == "http" and transport.url_of("probe") is None:
        raise ValueError(f"{url}: no URL to GET without obstore (the store cannot sign)")

    class Sink:
        def __init__(self, fd: int) -> None:
            self.fd, self.hash, self.size = fd, xxhash.xxh3_64(), 0

        def write(self, piece: Any) -> None:
            os.write(self.fd, piece)
            self.hash.update(piece)
            self.size += len(piece)

    def fetch(rel: str, dst: str) -> tuple[int, str]:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            sink = Sink(fd)
            transport.stream_into(rel, sink, TransferStats(), chunk=DOWNLOAD_CHUNK)
        finally:
            os.close(fd)
        return sink.size, sink.hash.hexdigest()

    return fetch


def raw_pipeline(url: str, shards: list[Any], out_dir: str, *, threads: int = 8,
                 storage_options: dict[str, Any] | None = None, client: str = "plain") -> float:
    """Bytes/s of `threads` threads doing GET + xxh3 + write + rename, one shard each. `client`: "plain"
    (a whole-object GET: urllib for http(s), boto3 for s3, fsspec otherwise), "obstore" (a whole-object
    GET through obstore), or streamed and each piece written and hashed as it comes: "http" (received
    by fastload's `HttpReceiver`) or "obstore-stream" (by obstore's stream)."""
    if client in ("http", "obstore-stream"):
        fetch = _streamed_fetch(url, storage_options, "http" if client == "http" else "obstore")
    else:
        get = _obstore_get(url, storage_options) if client == "obstore" else _whole_object_get(url, storage_options)

        def fetch(rel: str, dst: str) -> tuple[int, str]:
            data = get(rel)
            digest = xxhash.xxh3_64_hexdigest(data)
            with open(dst, "wb") as f:
                f.write(data)
            return len(data), digest

    os.makedirs(out_dir, exist_ok=True)

    def one(info: Any) -> int:
        dst = os.path.join(out_dir, os.path.basename(info.file))
        n, digest = fetch(info.file, dst + ".part")
        if digest != info.xxh3.lower():
            raise RuntimeError(f"{url}/{info.file}: xxh3 mismatch")
        os.rename(dst + ".part", dst)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, shards))
    took = time.perf_counter() - t0
    shutil.rmtree(out_dir, ignore_errors=True)
    return total / took


def _cpu_since(t0: resource.struct_rusage) -> tuple[float, float]:
    """(CPU seconds, user-mode CPU seconds) of this process since `getrusage` gave `t0` (microsecond
    resolution: `os.times` counts 10 ms ticks, which a short epoch may not reach)."""
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    user = t1.ru_utime - t0.ru_utime
    return user + (t1.ru_stime - t0.ru_stime), user  # summed from the parts: never below `user` by rounding


def _epoch(ds: Any, *, shuffled: bool, workers: int, batch_size: int, window: int, seed: int) -> tuple[float, dict]:
    """Seconds for one epoch over `ds` and the `remote_*` stage seconds it added to `loader.stats()`
    (with `cpu_s` and `user_s`: this process's CPU and user-mode CPU seconds over the epoch, imports
    and loader set-up excluded)."""
    from fastload.loader import Loader
    from fastload.order.shard_shuffle import ShardWindowSampler

    sampler = ShardWindowSampler.from_dataset(ds, window=window, seed=seed) if shuffled else None
    loader = Loader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, worker_type="thread")
    storage = getattr(ds, "storage", None)
    before = storage.stats() if callable(getattr(storage, "stats", None)) else {}
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    n = 0
    first_s = 0.0
    for batch in loader:
        if not n:
            first_s = time.perf_counter() - t0
        n += len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch[0])
    took = time.perf_counter() - t0
    cpu_s, user_s = _cpu_since(c0)
    if n != len(ds):
        raise RuntimeError(f"epoch saw {n} samples, the dataset has {len(ds)}")
    after = loader.stats()
    stages = {k: after[f"remote_{k}"] - before[f"remote_{k}"] for k in STAGES if f"remote_{k}" in after}
    stages["cpu_s"], stages["user_s"], stages["first_batch_s"] = cpu_s, user_s, first_s
    for k in ("gets_in_flight_mean", "gets_target"):  # the GETs in flight, and how many the window chose
        if f"remote_{k}" in after:
            stages[k] = after[f"remote_{k}"]
    loader.close()
    return took, stages


class ProcessCpu:
    """CPU seconds of some processes and their children at construction: `seconds()` so far, `share()`
    since construction."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        self.procs = []
        for pid in pids:
            with_children = [psutil.Process(pid)]
            with_children += with_children[0].children(recursive=True)
            self.procs += with_children
        self.t0 = time.perf_counter()
        self.c0 = self.seconds()

    def seconds(self) -> float:
        """User + system seconds of the processes so far (those that ended count no more)."""
        total = 0.0
        for p in self.procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def share(self) -> float:
        """Their CPU seconds / (wall seconds x usable cores) since construction."""
        from fastload.system import usable_cores

        wall = time.perf_counter() - self.t0
        return (self.seconds() - self.c0) / (wall * usable_cores()) if wall > 0 else 0.0


def run_remote(url: str, *, storage_options: dict[str, Any] | None = None, rounds: int = 3, threads: int = 8,
               batch_size: int = 256, window: int = 4, workers: tuple[int, ...] = (0, 2), local: str | None = None,
               watch_pids: tuple[int, ...] = (), workdir: str | None = None,
               transports: tuple[str, ...] = ("auto",), raw_clients: tuple[str, ...] = ("plain",)) -> dict[str, Any]:
    """Measure `rounds` interleaved rounds (see the module docstring); rates in bytes/s per round.

    `transports`: the Loader rows' `open_dataset(transport=...)`, each row named with the transport
    as a prefix except "auto"'s; `raw_clients`: the raw rows' GET clients ("plain": row "raw", the
    baseline of the ratios; "obstore": row "raw obstore"; "http": row "raw http")."""
    from fastload.benchmark.limits import recycle_page_cache
    from fastload.dataset import open_dataset
    from fastload.formats import FastloadDataset

    work = tempfile.mkdtemp(prefix="fastload-bench-remote-", dir=workdir)
    rows: dict[str, list[float]] = {}
    cost: dict[str, list[float]] = {}  # raw and cold rows: this process's CPU seconds per GB
    user: dict[str, list[float]] = {}  # the same, user-mode CPU only
    stages: dict[str, list[dict]] = {}
    first: dict[str, list[float]] = {}  # Loader rows: seconds from the epoch's start to its first batch
    shares: list[float] = []
    try:
        probe = open_dataset(url, storage_options=storage_options, cache_dir=os.path.join(work, "probe"),
                             cache_limit="1TB")
        shards = list(probe.manifest.shards)
        nbytes = sum(s.bytes for s in shards)
        del probe
        local_ds = FastloadDataset(local) if local else None
        for r in range(rounds):
            cpu = ProcessCpu(watch_pids) if watch_pids else None
            for client in raw_clients:
                name = "raw" if client == "plain" else f"raw {client}"
                recycle_page_cache(work, nbytes)
                c0 = resource.getrusage(resource.RUSAGE_SELF)
                rows.setdefault(name, []).append(raw_pipeline(
                    url, shards, os.path.join(work, "raw"), threads=threads, storage_options=storage_options,
                    client=client))
                cpu_s, user_s = _cpu_since(c0)
                cost.setdefault(name, []).append(cpu_s / (nbytes / 1e9))
                user.setdefault(name, []).append(user_s / (nbytes / 1e9))
            for transport, w, shuffled in ((t, w, s) for t in transports for w in workers for s in (True, False)):
                key = ("" if transport == "auto" else f"{transport} ") + (
                    f"w{w} {'shuffled' if shuffled else 'sequential'}")
                cache = os.path.join(work, f"cache-{r}-{transport}-{w}-{int(shuffled)}")
                ds = open_dataset(url, storage_options=storage_options, cache_dir=cache, cache_limit=2 * nbytes,
                                  transport=transport)
                args = {"shuffled": shuffled, "workers": w, "batch_size": batch_size, "window": window}
                recycle_page_cache(work, nbytes)
                cold, st = _epoch(ds, seed=r, **args)
                cost.setdefault(f"{key} cold", []).append(st.pop("cpu_s") / (nbytes / 1e9))
                user.setdefault(f"{key} cold", []).append(st.pop("user_s") / (nbytes / 1e9))
                warm, wst = _epoch(ds, seed=r + 1, **args)
                cost.setdefault(f"{key} warm", []).append(wst["cpu_s"] / (nbytes / 1e9))
                user.setdefault(f"{key} warm", []).append(wst["user_s"] / (nbytes / 1e9))
                first.setdefault(f"{key} cold", []).append(st.pop("first_batch_s"))
                first.setdefault(f"{key} warm", []).append(wst["first_batch_s"])
                rows.setdefault(f"{key} cold", []).append(nbytes / cold)
                rows.setdefault(f"{key} warm", []).append(nbytes / warm)
                stages.setdefault(f"{key} cold", []).append(st)
                if local_ds is not None and transport == transports[0]:
                    rows.setdefault(f"{key} local", []).append(nbytes / _epoch(local_ds, seed=r + 1, **args)[0])
                ds.close()  # its shard mappings go now, not when a garbage collection finds them
                ds.storage.close()
                del ds
                shutil.rmtree(cache, ignore_errors=True)
            if cpu is not None:
                shares.append(cpu.share())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"url": url, "bytes": nbytes, "shards": len(shards), "rounds": rounds, "threads": threads,
            "rows": rows, "cpu_s_per_GB": cost, "user_cpu_s_per_GB": user, "stages": stages, "server_cpu_share": shares,
            "first_batch_s": first, "fetch_cost_s_per_GB": fetch_costs(user)}


def fetch_costs(user: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per Loader row (its name without " cold"), per round: the user CPU s/GB of its cold epoch
    minus its warm epoch's (the same Loader and order, every shard cached): what fetching cost."""
    return {k[: -len(" cold")]: [c - w for c, w in zip(v, user[k[: -len("cold")] + "warm"], strict=True)]
            for k, v in user.items() if k.endswith(" cold") and k[: -len("cold")] + "warm" in user}


def _med(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def _span(v: list[float] | None, scale: float, digits: int) -> str:
    """"median [min-max]" of `v` times `scale` with `digits` decimals ("-" when there is nothing)."""
    if not v:
        return "-"
    return f"{_med(v) * scale:.{digits}f} [{min(v) * scale:.{digits}f}-{max(v) * scale:.{digits}f}]"


def format_remote(res: dict[str, Any]) -> str:
    """A table: per row the median MB/s, its ratio to raw (per round, then median) and the spread."""
    rows = res["rows"]
    raw = rows["raw"]
    lines = [f"{res['url']}: {res['bytes'] / 1e6:.0f} MB in {res['shards']} shards; {res['rounds']} rounds, "
             f"raw = {res['threads']} threads of GET + xxh3 + write + rename"]
    lines.append(f"{'row':24s} {'MB/s':>7s} {'x raw':>6s} {'x raw per round':>22s} {'spread':>7s}")
    for k, v in rows.items():
        ratios = [a / b for a, b in zip(v, raw, strict=True)]
        m = _med(ratios)
        spread = (max(ratios) - min(ratios)) / (2 * m) if m > 0 else 0.0
        per = " ".join(f"{x:.2f}" for x in ratios)
        lines.append(f"{k:24s} {_med(v) / 1e6:7.0f} {m:6.2f} {per:>22s} {100 * spread:6.0f}%")
    for k, runs in res["stages"].items():
        if runs and runs[0]:
            keys = list(runs[0])
            lines.append(f"stages {k}: " + " ".join(f"{s}={_med([x[s] for x in runs]):.2f}" for s in keys))
    if res.get("cpu_s_per_GB"):
        lines.append("CPU s/GB of this process: " + " ".join(
            f"{k}={_med(v):.2f}" for k, v in res["cpu_s_per_GB"].items()))
    if res.get("user_cpu_s_per_GB"):
        lines.append("of which user-mode: " + " ".join(
            f"{k}={_med(v):.2f}" for k, v in res["user_cpu_s_per_GB"].items()))
    # against every raw row that ran: the plain pipeline first (the goal's baseline), then the same
    # pipeline on the Loader's receiver and on obstore
    users = res.get("user_cpu_s_per_GB", {})
    bases = [(k, _med(users[k])) for k in ("raw", "raw http", "raw obstore") if users.get(k)]
    bases = [(k, b) for k, b in bases if b > 0]
    if res.get("fetch_cost_s_per_GB") and bases:
        costs = [f"{k}={_span(v, 1, 3)} (" + ", ".join(f"{_med(v) / b:.1f}x {n}" for n, b in bases) + ")"
                 for k, v in res["fetch_cost_s_per_GB"].items()]
        lines.append("fetch cost, user CPU s/GB of the cold epoch minus the warm one, median [min-max] (x each "
                     "raw row's median user CPU: " + ", ".join(f"{k} {b:.3f} s/GB" for k, b in bases)
                     + "; counted in a few timer ticks per round: `python -m bench.remote_cpu` samples it): "
                     + "; ".join(costs))
    lines.append(f"{'medians [min-max] over rounds':40s} {'MB/s':>15s} {'user s/GB':>17s} {'CPU s/GB':>17s} "
                 f"{'first batch s':>17s}")
    for k, v in rows.items():
        cells = [_span(v, 1e-6, 0), _span(res.get("user_cpu_s_per_GB", {}).get(k), 1, 2),
                 _span(res.get("cpu_s_per_GB", {}).get(k), 1, 2), _span(res.get("first_batch_s", {}).get(k), 1, 2)]
        lines.append(f"{k:40s} " + " ".join(f"{c:>17s}" for c in cells))
    if res["server_cpu_share"]:
        sh = res["server_cpu_share"]
        lines.append(f"server CPU share of the cores per round: {' '.join(f'{100 * s:.1f}%' for s in sh)}")
    return "\n".join(lines)
