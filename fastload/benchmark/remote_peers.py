"""Peer loaders on the same server: a table of fastload's and other streaming loaders' cold and warm
epochs and the raw pipeline, over the same samples served by one object store.

Rows, each measured once per round with the row order rotated every round:

- `raw obstore`: `threads` threads of whole-object GET (obstore, the client of fastload's default
  transport) + xxh3 + write + rename per shard (`raw_pipeline`), in this process;
- `<loader> w<k> cold` / `warm` / `cold again`, for fastload and each peer (`LOADERS`): the loader's own
  dataset over its own format, its local cache emptied first, and its own DataLoader (fastload:
  `Loader` with `k` thread workers; a peer: `k` worker processes), then the same dataset's second
  epoch, then a new dataset over the emptied cache (`loader_epochs`); the three in a fresh Python
  process (no client state, such as obstore's runtime, crosses a fork into a peer's workers; no
  loader runs on another's warmed-up state), so "cold" includes what a first epoch pays once (lazy
  imports, client set-up) and "cold again" does not.

Every epoch is checked against the dataset: its sample count, and the sum of its labels when the
caller gives it (`label_sum`).

MosaicML Streaming runs from `streaming.base.dataset` with the package `__init__` files of `streaming`
and `streaming.base` left unrun (`import_streaming_base`, in its own process only): those two files
import `streaming.vision` (torchvision at module level; the torchvision build for torch 2.13 links
CUDA libraries the CPU torch wheel lacks) and `StreamingDataLoader` (transformers), neither of which
`StreamingDataset`, its S3 downloader or `MDSWriter` uses. Its shared memory is cleaned
(`streaming.base.util.clean_stale_shared_memory`) before and after its epochs, and its file locks
are kept beside its cache, so that none outlives the row.

A cold epoch's clock starts before the dataset is opened (after `import <loader>`; the index or
manifest fetch included) and stops after the last batch; its CPU seconds are those of the process
and of the worker processes it waited for over that span, per GB of the loader's own format on the
server; `first_batch_s` runs from the same start. Before the raw pass and each cold epoch (untimed) as
many bytes as the dataset holds are written to a scratch file and deleted
(`limits.recycle_page_cache`). The server's CPU seconds per GB (process and children, psutil) are
taken around the raw pass and around each epoch.
"""

from __future__ import annotations

import contextlib
import functools
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

from fastload.benchmark.remote import ProcessCpu, _span, raw_pipeline

__all__ = ["LOADERS", "PEERS", "format_peers", "import_streaming_base", "loader_epochs", "run_peers"]

#: Loader name -> how its rows read (their defaults, apart from the cache location).
LOADERS = {
    "fastload": "fastload.open_dataset(url, storage_options=..., cache_dir=<emptied>) (transport \"auto\": obstore "
                "for s3) in fastload.Loader(batch_size, num_workers, worker_type=\"thread\"), sequential order",
    "litdata": "litdata.StreamingDataset(url, storage_options=..., cache_dir=<emptied>) with its defaults "
               "(shuffle=False, chunks fetched by its downloader) in "
               "litdata.StreamingDataLoader(batch_size, num_workers)",
    "streaming": "streaming.base.dataset.StreamingDataset(remote=url, local=<emptied>, batch_size, shuffle=False), "
                 "its other defaults (shards fetched by its boto3 downloader), in "
                 "torch.utils.data.DataLoader(batch_size, num_workers); its storage_options are the environment "
                 "variables it reads (S3_ENDPOINT_URL, AWS_*), set in its own process",
}
#: The loaders other than fastload.
PEERS = tuple(k for k in LOADERS if k != "fastload")


def _cpu_now() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and of its children it has waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def _cpu_since(c0: tuple[float, float]) -> dict[str, float]:
    """{"cpu_s", "user_s"} since `_cpu_now` gave `c0` (the total summed from the parts: never below
    the user time by rounding)."""
    user, system = _cpu_now()
    return {"cpu_s": (user - c0[0]) + (system - c0[1]), "user_s": user - c0[0]}


def import_streaming_base() -> None:
    """Make MosaicML Streaming's `streaming.base.*` modules importable without running the package
    `__init__` files of `streaming` and `streaming.base` (the module docstring says why): both are
    registered as bare packages over their directories. Call it only in a process that needs nothing
    else of streaming's (a peer's own process, a test's writer): afterwards `import streaming` there
    gives the bare package."""
    import importlib.machinery
    import importlib.util

    for name in ("streaming", "streaming.base"):
        if name in sys.modules:  # imported before, bare or whole
            continue
        if name == "streaming":
            found = importlib.util.find_spec(name)
            if found is None or found.origin is None:
                raise ImportError("mosaicml-streaming is not installed (the Makefile installs it with --no-deps)")
            path = os.path.dirname(found.origin)
        else:
            path = os.path.join(next(iter(sys.modules["streaming"].__path__)), "base")
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [path]
        sys.modules[name] = importlib.util.module_from_spec(spec)


def _iterate(loader: Iterable[Any], t0: float, c0: tuple[float, float], expected: int, label_sum: int | None,
             what: str, server: ProcessCpu) -> dict[str, float]:
    """Run one epoch of `loader`, counting samples and summing their labels (checked against `expected`
    and `label_sum`, unless None); seconds and CPU since `t0` / `c0`, and the server's CPU seconds over
    the epoch."""
    s0 = server.seconds()
    n = labels = 0
    first = 0.0
    for batch in loader:
        if not n:
            first = time.perf_counter() - t0
        n += len(batch["x"])
        labels += int(batch["label"].sum())
    wall = time.perf_counter() - t0
    cpu = _cpu_since(c0)
    if n != expected:
        raise RuntimeError(f"{what}: the epoch saw {n} samples, the dataset has {expected}")
    if label_sum is not None and labels != label_sum:
        raise RuntimeError(f"{what}: the epoch's labels sum to {labels}, the dataset's to {label_sum}")
    return {"wall_s": wall, "first_batch_s": first, **cpu, "server_s": server.seconds() - s0}


def loader_epochs(loader: str, url: str, storage_options: dict[str, Any], cache_dir: str, workers: int,
                  batch_size: int, samples: int, nbytes: int, server_pid: int | None = None,
                  label_sum: int | None = None) -> dict[str, dict[str, float]]:
    """Epochs of `loader` (a key of `LOADERS`) over its dataset at `url` (`nbytes` on the server), each
    measured as the wall seconds, seconds to the first batch, CPU and user CPU seconds of this process
    and its worker processes: "cold" (`cache_dir` emptied first; the clock starts before the dataset
    is opened, after `import <loader>`), "warm" (the same dataset's second epoch), "cold again" (a new
    dataset over the emptied cache: first-use costs such as lazy imports and client set-up now paid).
    Before each cold epoch the page cache is recycled (`limits.recycle_page_cache`, untimed). `server_pid`:
    the server, whose CPU seconds over each epoch are given as "server_s" (0 without one); `label_sum`:
    the sum of the dataset's labels, which every epoch must reproduce (not checked when None)."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r}; known: {', '.join(LOADERS)}")
    what = f"{loader} at {url}"
    server = ProcessCpu(() if server_pid is None else (server_pid,))
    if loader == "fastload":
        import fastload

        def epochs() -> dict[str, dict[str, float]]:
            t0, c0 = time.perf_counter(), _cpu_now()
            ds = fastload.open_dataset(url, storage_options=storage_options, cache_dir=cache_dir, cache_limit="1TB")
            out = {}
            try:
                for temp in ("cold", "warm"):
                    if temp == "warm":
                        t0, c0 = time.perf_counter(), _cpu_now()
                    epoch = fastload.Loader(ds, batch_size=batch_size, num_workers=workers, worker_type="thread")
                    try:
                        out[temp] = _iterate(epoch, t0, c0, samples, label_sum, what, server)
                    finally:
                        epoch.close()
            finally:
                ds.close()
                ds.storage.close()
            return out
    elif loader == "litdata":
        import litdata

        def epochs() -> dict[str, dict[str, float]]:
            t0, c0 = time.perf_counter(), _cpu_now()
            ds = litdata.StreamingDataset(url, storage_options=storage_options, cache_dir=cache_dir)
            dl = litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers)
            cold = _iterate(dl, t0, c0, samples, label_sum, what, server)
            return {"cold": cold,
                    "warm": _iterate(dl, time.perf_counter(), _cpu_now(), samples, label_sum, what, server)}
    else:
        return _streaming_epochs(url, storage_options, cache_dir, workers, batch_size, samples, nbytes,
                                 label_sum, what, server)
    return _cold_warm_cold_again(epochs, cache_dir, nbytes)


def _cold_warm_cold_again(epochs: Callable[[], dict[str, dict[str, float]]], cache_dir: str,
                          nbytes: int) -> dict[str, dict[str, float]]:
    """`epochs()` ({"cold", "warm"}) over an emptied `cache_dir`, then its "cold" again as "cold again";
    the page cache recycled before each (`nbytes`: as many bytes as the dataset holds)."""
    from fastload.benchmark.limits import recycle_page_cache

    res = {}
    for again in (False, True):
        shutil.rmtree(cache_dir, ignore_errors=True)
        recycle_page_cache(os.path.dirname(cache_dir), nbytes)
        got = epochs()
        if again:
            res["cold again"] = got["cold"]
        else:
            res.update(got)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return res


def _streaming_epochs(url: str, env: dict[str, Any], cache_dir: str, workers: int, batch_size: int, samples: int,
                      nbytes: int, label_sum: int | None, what: str,
                      server: ProcessCpu) -> dict[str, dict[str, float]]:
    """`loader_epochs` for MosaicML Streaming (this process runs it alone: `import_streaming_base`, and
    `env`, the variables its S3 downloader reads, are set here). Its shared memory is cleaned before
    and after, and its file locks (under `tempfile.gettempdir()`) go to a folder beside `cache_dir`
    that is removed afterwards."""
    import torch.utils.data

    import_streaming_base()
    from streaming.base.dataset import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    os.environ.update({k: str(v) for k, v in env.items()})
    locks = f"{cache_dir}-locks"
    os.makedirs(locks, exist_ok=True)
    tempfile.tempdir = locks

    def epochs() -> dict[str, dict[str, float]]:
        t0, c0 = time.perf_counter(), _cpu_now()
        ds = StreamingDataset(remote=url, local=cache_dir, batch_size=batch_size, shuffle=False)
        dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
        cold = _iterate(dl, t0, c0, samples, label_sum, what, server)
        warm = _iterate(dl, time.perf_counter(), _cpu_now(), samples, label_sum, what, server)
        del dl, ds  # releases its local directory, so that "cold again" may use it
        clean_stale_shared_memory()
        return {"cold": cold, "warm": warm}

    clean_stale_shared_memory()
    try:
        return _cold_warm_cold_again(epochs, cache_dir, nbytes)
    finally:
        clean_stale_shared_memory()
        shutil.rmtree(locks, ignore_errors=True)


def _epochs_in_child(args: dict[str, Any], work: str, timeout: float) -> dict[str, dict[str, float]]:
    """`loader_epochs(**args)` in a fresh Python process (its result through a JSON file)."""
    out = os.path.join(work, "epochs-result.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(out)  # a previous row's: never read as this one's
    code = ("import json, sys; from fastload.benchmark.remote_peers import loader_epochs; "
            "a = json.load(open(sys.argv[1])); json.dump(loader_epochs(**a), open(sys.argv[2], 'w'))")
    with open(os.path.join(work, "epochs-args.json"), "w") as f:
        json.dump(args, f)
    try:
        proc = subprocess.run([sys.executable, "-c", code, f.name, out], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{args['loader']} w{args['workers']}: no result after {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{args['loader']} w{args['workers']} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def run_peers(url: str, *, storage_options: dict[str, Any], peers: dict[str, dict[str, Any]], rounds: int = 5,
              workers: tuple[int, ...] = (0, 2), batch_size: int = 256, threads: int = 8,
              server_pid: int | None = None, workdir: str | None = None,
              epoch_timeout: float = 600.0, label_sum: int | None = None) -> dict[str, Any]:
    """Measure the rows of the module docstring over `rounds` rounds.

    `url`/`storage_options`: the fastload dataset; `peers`: peer name -> {"url", "storage_options",
    "bytes" (its format's size on the server)} of the same samples; `server_pid`: the server, whose CPU
    is taken around each row; `label_sum`: the sum of the samples' labels, which every loader's epoch
    must reproduce (only their count is checked when None). Per row and round: MB/s, CPU and user CPU
    s/GB, first batch s, server CPU s/GB."""
    from fastload.benchmark.limits import recycle_page_cache
    from fastload.dataset import open_dataset

    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    work = tempfile.mkdtemp(prefix="fastload-bench-peers-", dir=workdir)
    server = ProcessCpu(() if server_pid is None else (server_pid,))
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
            record("raw obstore", nbytes, {"wall_s": nbytes / rate, **_cpu_since(c0)},
                   server.seconds() - s0 if server_pid else None)

        def loader_rows(name: str, spec: dict[str, Any], w: int) -> None:
            args = {"loader": name, "url": spec["url"], "storage_options": spec.get("storage_options") or {},
                    "cache_dir": os.path.join(work, f"{name}-cache"), "workers": w, "batch_size": batch_size,
                    "samples": samples, "nbytes": int(spec["bytes"]), "server_pid": server_pid,
                    "label_sum": label_sum}
            m = _epochs_in_child(args, work, epoch_timeout)
            for temp in ("cold", "cold again", "warm"):
                record(f"{name} w{w} {temp}", int(spec["bytes"]), m[temp], m[temp]["server_s"] if server_pid else None)

        specs = {"fastload": {"url": url, "storage_options": storage_options, "bytes": nbytes}, **peers}
        groups: list[Callable[[], None]] = [raw]
        groups += [functools.partial(loader_rows, n, s, w) for n, s in specs.items() for w in workers]
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
    client, seconds to the first batch and the server's CPU s/GB; then `res["notes"]` and
    `res["not_run"]` (name -> text), when given."""
    lines = [f"{res['url']}: {res['samples']} samples, fastload {res['bytes'] / 1e6:.0f} MB in {res['shards']} shards"
             + "".join(f"; {n} {p['bytes'] / 1e6:.0f} MB at {p['url']}" for n, p in res["peers"].items())
             + f"; {res['rounds']} rounds, rows in rotated order"]
    if res.get("server"):
        lines.append(f"server: {res['server']}")
    width = max(22, *(len(k) for k in res["rows"]))
    lines.append(f"{'medians [min-max] over rounds':{width}s} {'MB/s':>17s} {'user CPU s/GB':>17s} {'CPU s/GB':>17s} "
                 f"{'first batch s':>17s} {'server CPU s/GB':>17s}")
    for k, v in res["rows"].items():
        cells = [_span(v, 1e-6, 0)] + [_span(res[f].get(k), 1, 2) for f in (
            "user_cpu_s_per_GB", "cpu_s_per_GB", "first_batch_s", "server_cpu_s_per_GB")]
        lines.append(f"{k:{width}s} " + " ".join(f"{c:>17s}" for c in cells))
    for name, note in (res.get("notes") or {}).items():
        lines.append(f"note: {name}: {note}")
    for name, why in (res.get("not_run") or {}).items():
        lines.append(f"not run: {name}: {why}")
    return "\n".join(lines)
