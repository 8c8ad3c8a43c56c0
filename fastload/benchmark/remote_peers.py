"""Peer loaders on the same server: a table of fastload's cold and warm epochs, the raw pipeline and
other streaming loaders' cold epochs over the same samples served by one object store.

Rows, each measured once per round with the row order rotated every round:

- `raw obstore`: `threads` threads of whole-object GET (obstore, the client of fastload's default
  transport) + xxh3 + write + rename per shard (`raw_pipeline`);
- `fastload w<k> cold` / `warm`: `open_dataset(url, cache_dir=<empty>)` and a sequential `Loader`
  epoch with `k` thread workers, then the same dataset's second epoch;
- `<peer> w<k> cold` / `warm`: a peer's own dataset and DataLoader over its own format (`PEERS`), its
  local cache emptied first, `k` DataLoader worker processes, then the same loader's second epoch,
  in a fresh Python process (so that no client state, such as obstore's runtime, crosses a fork into
  the peer's workers).

Every cold row starts with the dataset's construction (index or manifest fetch included) and ends
after the last batch; its CPU seconds are those of the process and of its worker processes over that
span (imports excluded), per GB of the row's own format on the server; `first_batch_s` runs from the
same start. Before the raw pass and each cold epoch (untimed) as many bytes as the dataset holds are
written to a scratch file and deleted (`limits.recycle_page_cache`). The server's CPU seconds per GB
(process and children, psutil) are taken around each row (around both epochs of a peer, given to its
cold row).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from fastload.benchmark.remote import _span, raw_pipeline

__all__ = ["PEERS", "format_peers", "peer_epoch", "run_peers"]

#: Peer name -> how its rows read (their defaults, apart from the cache location).
PEERS = {
    "litdata": "litdata.StreamingDataset(url, storage_options=..., cache_dir=<emptied>) with its defaults "
               "(shuffle=False, chunks fetched by its downloader) in "
               "litdata.StreamingDataLoader(batch_size, num_workers)",
}


def _cpu_now() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and of its children it has waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def _cpu_since(c0: tuple[float, float]) -> dict[str, float]:
    """{"cpu_s", "user_s"} since `_cpu_now` gave `c0` (the total summed from the parts: never below
    the user time by rounding)."""
    user, system = _cpu_now()
    return {"cpu_s": (user - c0[0]) + (system - c0[1]), "user_s": user - c0[0]}


def _iterate(loader: Iterable[Any], t0: float, c0: tuple[float, float], expected: int, what: str) -> dict[str, float]:
    """Run one epoch of `loader`, counting samples; seconds and CPU since `t0` / `c0`."""
    n = 0
    first = 0.0
    for batch in loader:
        if not n:
            first = time.perf_counter() - t0
        n += len(batch["x"])
    wall = time.perf_counter() - t0
    cpu = _cpu_since(c0)
    if n != expected:
        raise RuntimeError(f"{what}: the epoch saw {n} samples, the dataset has {expected}")
    return {"wall_s": wall, "first_batch_s": first, **cpu}


def peer_epoch(peer: str, url: str, storage_options: dict[str, Any], cache_dir: str, workers: int,
               batch_size: int, samples: int) -> dict[str, dict[str, float]]:
    """A cold epoch of `peer` (a key of `PEERS`) over its dataset at `url`, `cache_dir` emptied first,
    then a warm one of the same dataset (its chunks cached): per epoch {"cold", "warm"} the wall seconds,
    seconds to the first batch, CPU and user CPU seconds of this process and its worker processes."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    if peer != "litdata":
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    import litdata

    t0, c0 = time.perf_counter(), _cpu_now()
    ds = litdata.StreamingDataset(url, storage_options=storage_options, cache_dir=cache_dir)
    loader = litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers)
    cold = _iterate(loader, t0, c0, samples, f"{peer} at {url}")
    warm = _iterate(loader, time.perf_counter(), _cpu_now(), samples, f"{peer} at {url}, second epoch")
    return {"cold": cold, "warm": warm}


def _peer_epoch_in_child(args: dict[str, Any], work: str, timeout: float) -> dict[str, dict[str, float]]:
    """`peer_epoch(**args)` in a fresh Python process (its result through a JSON file)."""
    out = os.path.join(work, "peer-result.json")
    code = ("import json, sys; from fastload.benchmark.remote_peers import peer_epoch; "
            "a = json.load(open(sys.argv[1])); json.dump(peer_epoch(**a), open(sys.argv[2], 'w'))")
    with open(os.path.join(work, "peer-args.json"), "w") as f:
        json.dump(args, f)
    try:
        proc = subprocess.run([sys.executable, "-c", code, f.name, out], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{args['peer']} w{args['workers']}: no result after {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{args['peer']} w{args['workers']} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


class _ServerCpu:
    """CPU seconds of a process and its children (psutil), read on demand."""

    def __init__(self, pid: int | None) -> None:
        self.procs: list[psutil.Process] = []
        if pid is not None:
            root = psutil.Process(pid)
            self.procs = [root, *root.children(recursive=True)]

    def seconds(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total


def run_peers(url: str, *, storage_options: dict[str, Any], peers: dict[str, dict[str, Any]], rounds: int = 5,
              workers: tuple[int, ...] = (0, 2), batch_size: int = 256, threads: int = 8,
              server_pid: int | None = None, workdir: str | None = None,
              epoch_timeout: float = 600.0) -> dict[str, Any]:
    """Measure the rows of the module docstring over `rounds` rounds.

    `url`/`storage_options`: the fastload dataset; `peers`: peer name -> {"url", "storage_options",
    "bytes" (its format's size on the server)} of the same samples; `server_pid`: the server, whose CPU
    is taken around each row. Per row and round: MB/s, CPU and user CPU s/GB, first batch s, server
    CPU s/GB."""
    from fastload.benchmark.limits import recycle_page_cache
    from fastload.dataset import open_dataset
    from fastload.loader import Loader

    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    work = tempfile.mkdtemp(prefix="fastload-bench-peers-", dir=workdir)
    server = _ServerCpu(server_pid)
    res: dict[str, Any] = {"rows": {}, "cpu_s_per_GB": {}, "user_cpu_s_per_GB": {}, "first_batch_s": {},
                           "server_cpu_s_per_GB": {}}

    def record(name: str, nbytes: int, m: dict[str, float], server_s: float | None) -> None:
        gb = nbytes / 1e9
        res["rows"].setdefault(name, []).append(nbytes / m["wall_s"])
        res["cpu_s_per_GB"].setdefault(name, []).append(m["cpu_s"] / gb)
        res["user_cpu_s_per_GB"].setdefault(name, []).append(m["user_s"] / gb)
        if "first_batch_s" in m:
            res["first_batch_s"].setdefault(name, []).append(m["first_batch_s"])
        if server_s is not None:
            res["server_cpu_s_per_GB"].setdefault(name, []).append(server_s / gb)

    try:
        probe = open_dataset(url, storage_options=storage_options, cache_dir=os.path.join(work, "probe"),
                             cache_limit="1TB")
        shards, samples = list(probe.manifest.shards), len(probe)
        nbytes = sum(s.bytes for s in shards)
        probe.storage.close()
        del probe

        def raw() -> None:
            recycle_page_cache(work, nbytes)
            s0, c0 = server.seconds(), _cpu_now()
            rate = raw_pipeline(url, shards, os.path.join(work, "raw"), threads=threads,
                                storage_options=storage_options, client="obstore")
            record("raw obstore", nbytes, {"wall_s": nbytes / rate, **_cpu_since(c0)}, server.seconds() - s0)

        def fastload_rows(w: int) -> None:
            cache = os.path.join(work, f"fastload-cache-w{w}")
            recycle_page_cache(work, nbytes)
            s0, t0, c0 = server.seconds(), time.perf_counter(), _cpu_now()
            ds = open_dataset(url, storage_options=storage_options, cache_dir=cache, cache_limit=2 * nbytes)
            try:
                for temp in ("cold", "warm"):
                    if temp == "warm":
                        s0, t0, c0 = server.seconds(), time.perf_counter(), _cpu_now()
                    loader = Loader(ds, batch_size=batch_size, num_workers=w, worker_type="thread")
                    try:
                        m = _iterate(loader, t0, c0, samples, f"fastload at {url}")
                    finally:
                        loader.close()
                    record(f"fastload w{w} {temp}", nbytes, m, server.seconds() - s0)
            finally:
                ds.storage.close()
                shutil.rmtree(cache, ignore_errors=True)

        def peer_row(name: str, spec: dict[str, Any], w: int) -> None:
            recycle_page_cache(work, int(spec["bytes"]))
            args = {"peer": name, "url": spec["url"], "storage_options": spec.get("storage_options") or {},
                    "cache_dir": os.path.join(work, f"{name}-cache"), "workers": w, "batch_size": batch_size,
                    "samples": samples}
            s0 = server.seconds()
            m = _peer_epoch_in_child(args, work, epoch_timeout)
            shutil.rmtree(args["cache_dir"], ignore_errors=True)
            # the server's CPU over the child's whole run (both epochs) goes to the cold row
            record(f"{name} w{w} cold", int(spec["bytes"]), m["cold"], server.seconds() - s0)
            record(f"{name} w{w} warm", int(spec["bytes"]), m["warm"], None)

        groups: list[Callable[[], None]] = [raw]
        groups += [lambda w=w: fastload_rows(w) for w in workers]
        groups += [lambda n=n, s=s, w=w: peer_row(n, s, w) for n, s in peers.items() for w in workers]
        for r in range(rounds):
            for i in range(len(groups)):
                groups[(i + r) % len(groups)]()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.update({"url": url, "bytes": nbytes, "shards": len(shards), "samples": samples, "rounds": rounds,
                "threads": threads,
                "peers": {n: {"url": s["url"], "bytes": int(s["bytes"])} for n, s in peers.items()}})
    return res


def format_peers(res: dict[str, Any]) -> str:
    """The table: per row, median [min-max] over the rounds of MB/s, user and total CPU s/GB of the
    client, seconds to the first batch and the server's CPU s/GB."""
    lines = [f"{res['url']}: {res['samples']} samples, fastload {res['bytes'] / 1e6:.0f} MB in {res['shards']} shards"
             + "".join(f"; {n} {p['bytes'] / 1e6:.0f} MB at {p['url']}" for n, p in res["peers"].items())
             + f"; {res['rounds']} rounds, rows in rotated order"]
    if res.get("server"):
        lines.append(f"server: {res['server']}")
    lines.append(f"{'medians [min-max] over rounds':22s} {'MB/s':>17s} {'user CPU s/GB':>17s} {'CPU s/GB':>17s} "
                 f"{'first batch s':>17s} {'server CPU s/GB':>17s}")
    for k, v in res["rows"].items():
        cells = [_span(v, 1e-6, 0)] + [_span(res[f].get(k), 1, 2) for f in (
            "user_cpu_s_per_GB", "cpu_s_per_GB", "first_batch_s", "server_cpu_s_per_GB")]
        lines.append(f"{k:22s} " + " ".join(f"{c:>17s}" for c in cells))
    for name, why in (res.get("not_run") or {}).items():
        lines.append(f"not run: {name}: {why}")
    return "\n".join(lines)
