"""`run_benchmark`: limits, backends, loaders (and the training-step simulation) in one run."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fastload.benchmark import limits as lim
from fastload.benchmark.backends import Backend, measure_backend, open_backend, read_epoch, release, remote_epochs
from fastload.benchmark.loaders import FASTLOAD_KINDS, LABELS, LOADER_KINDS, TORCH_KINDS, Step, bottleneck, run_loader
from fastload.benchmark.measure import payload_bytes, summarize
from fastload.formats.units import plural
from fastload.system import usable_cores

__all__ = ["SCHEMA_VERSION", "BenchConfig", "run_benchmark"]

SCHEMA_VERSION = 1
BACKENDS = ("fastload", "lmdb", "hdf5", "parquet", "lance", "remote")
IN_PLACE = ("parquet", "lance")  # read in place; their bench also reads a converted copy ("fastload (converted)")
CONVERTED = "fastload (converted)"
INPUT_BOUND_STALL = 0.10  # a data stall above this fraction of wall time means input-bound


@dataclass
class BenchConfig:
    """What `fastload bench` measures; see `fastload bench --help`."""

    dataset: str | None = None
    backends: tuple[str, ...] = BACKENDS
    loaders: tuple[str, ...] = LOADER_KINDS
    batch_size: int = 256
    workers: tuple[int, ...] = (0, 1, 2)
    seconds: float = 2.0
    repeats: int = 3
    step_ms: float | None = None
    step_kind: str = "auto"
    device: str = "auto"
    size: int = 192 << 20
    seed: int = 0
    workdir: str | None = None
    keep: bool = False
    progress: bool = True


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not enabled, leave=False)

    def run(self, label: str, fn: Callable[[], Any]) -> Any:
        self.bar.set_description(label)
        try:
            return fn()
        finally:
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _kind_of(path: str) -> str:
    from fastload.formats.storage import is_url

    if is_url(path):
        return "remote"
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "data.mdb")):
        return "lmdb"
    if os.path.isfile(path) and path.lower().endswith((".h5", ".hdf5", ".hdf")):
        return "hdf5"
    from fastload.formats.arrow_dataset import in_place_kind

    in_place = in_place_kind(path)
    if in_place is not None:
        return in_place
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist")
    return "fastload"


def _mean_sample_bytes(ds: Any, seed: int) -> float:
    n = len(ds)
    idx = np.sort(np.random.default_rng(seed).choice(n, size=min(n, 2048), replace=False))
    return payload_bytes(ds.get_batch(idx)) / max(1, len(idx))


def _jpegs_from(ds: Any, seed: int) -> list[bytes]:
    """Up to 64 JPEGs from the dataset's first image field; synthetic 224-px JPEGs when it has none."""
    schema = getattr(ds, "schema", None)
    for f in schema or ():
        if f.kind == "image":
            idx = np.random.default_rng(seed).choice(len(ds), size=min(len(ds), 64), replace=False)
            col = ds.get_batch(np.sort(idx))[f.name]
            jpegs = [bytes(col[i]) for i in range(len(col))]
            jpegs = [j for j in jpegs if j[:3] == b"\xff\xd8\xff"]
            if jpegs:
                return jpegs
    from fastload.benchmark.synthetic import make_jpegs

    return make_jpegs(16, seed=seed, min_side=224, max_side=224)[0]


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _plan(cfg: BenchConfig, backends: list[str], url: bool) -> int:
    r = cfg.repeats
    limits = 2 * r + 2 + (r if url else 0) + (2 * r if cfg.dataset is None else 0)
    per_backend = [r if b == "remote" else 2 * r for b in backends]
    loaders = len(cfg.loaders) * len(cfg.workers) * r
    step = loaders if cfg.step_ms else 0
    return limits + sum(per_backend) + loaders + step


def _download_rate(url: str, files: list[str]) -> float:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    total, t0 = 0, time.perf_counter()
    for name in files:
        total += len(fs.cat_file(f"{root.rstrip('/')}/{name}"))
    return total / max(time.perf_counter() - t0, 1e-9)


def _gather_limits(cfg: BenchConfig, raw: Any, prog: _Progress) -> dict[str, Any]:
    """The raw random gather of the embedded default's sample byte ranges (`limits.random_gather`),
    cold (file evicted first) and warm, as samples/s and bytes/s."""
    out: dict[str, Any] = {}
    for cache in ("cold", "warm"):
        if cache == "warm":
            lim.sequential_read([raw.path])  # every page cached, whatever the cold runs got to
        runs = []
        for k in range(cfg.repeats):
            def once(k: int = k, cache: str = cache) -> tuple[int, int, float]:
                if cache == "cold":
                    lim.evict([raw.path])
                return lim.random_gather(raw.path, raw.starts, raw.lengths, batch_size=cfg.batch_size,
                                         seconds=cfg.seconds, seed=cfg.seed + k)

            runs.append(prog.run(f"limits: random gather {cache}", once))
        out[f"gather_{cache}"] = {
            "samples_per_s": summarize([n / max(t, 1e-9) for n, _, t in runs]),
            "bytes_per_s": summarize([b / max(t, 1e-9) for _, b, t in runs]),
            "method": "shuffled batches of each sample's payload bytes from one flat file, one ranged copy",
        }
    return out


def _limits(
    cfg: BenchConfig, files: list[str], ds: Any, jpegs: list[bytes], prog: _Progress, url: str | None
) -> dict[str, Any]:
    r = cfg.repeats
    cold, warm, resident = [], [], []
    for _ in range(r):
        def cold_once() -> None:
            lim.evict(files)
            resident.append(lim.resident_fraction(files))
            nbytes, secs = lim.sequential_read(files)
            cold.append(nbytes / secs)

        prog.run("limits: cold read", cold_once)
    lim.sequential_read(files)  # warm the cache
    for _ in range(r):
        warm.append(prog.run("limits: warm read", lambda: (lambda b, s: b / s)(*lim.sequential_read(files))))
    out: dict[str, Any] = {
        "files": len(files),
        "bytes": sum(os.path.getsize(p) for p in files),
        "read_cold": {"bytes_per_s": summarize(cold), "method": "posix_fadvise(POSIX_FADV_DONTNEED)",
                      "resident_after_evict": max((x for x in resident if x is not None), default=None)},
        "read_warm": {"bytes_per_s": summarize(warm)},
    }
    res_after = out["read_cold"]["resident_after_evict"]
    if res_after is not None and res_after > 0.1:
        out["read_cold"]["warning"] = "eviction incomplete: cold figures are partly warm"
    elif np.median(cold) > 0.8 * np.median(warm):
        out["read_cold"]["warning"] = "cold ~ warm: storage may be cached below the page cache"
    secs = min(0.3, cfg.seconds)
    mem = prog.run("limits: memcpy", lambda: [lim.memcpy_bandwidth(seconds=secs) for _ in range(r)])
    out["memcpy"] = {"bytes_per_s": summarize(mem)}
    decodes = prog.run("limits: jpeg decode", lambda: [lim.jpeg_decode_rate(jpegs, seconds=secs) for _ in range(r)])
    decoder = decodes[0][1]
    per_core = summarize([rate for rate, _ in decodes])
    out["jpeg_decode"] = {"images_per_s_per_core": per_core, "cores": usable_cores(), "decoder": decoder,
                          "images_per_s": per_core["median"] * usable_cores(),
                          "mean_jpeg_bytes": float(np.mean([len(j) for j in jpegs]))}
    if url:
        shard_files = [s.file for s in ds.manifest.shards]
        rates = [prog.run("limits: download", lambda: _download_rate(url, shard_files)) for _ in range(r)]
        out["download"] = {"bytes_per_s": summarize(rates)}
    return out


def _backend_rows(cfg: BenchConfig, backends: list[Backend], limits: dict[str, Any], prog: _Progress,
                  url: str | None, cache_root: str) -> list[dict[str, Any]]:
    rows = []
    for b in backends:
        for cache in ("cold", "warm"):
            if cache == "warm":  # a cold row that ran out of time leaves part of the files unread
                lim.sequential_read(b.files)
            runs = [prog.run(f"backend {b.name} {cache}", lambda b=b, cache=cache, k=k: measure_backend(
                b, cold=cache == "cold", batch_size=cfg.batch_size, seconds=cfg.seconds, seed=cfg.seed + k))
                for k in range(cfg.repeats)]
            reads, resident = [r[0] for r in runs], [r[1] for r in runs]
            limit = "read_cold" if cache == "cold" else "read_warm"
            rows.append(_backend_row(b.name, cache, reads, limits, limit,
                                     max((x for x in resident if x is not None), default=None)))
            gather = limits.get(f"gather_{cache}")
            rows[-1]["vs_gather"] = (rows[-1]["samples_per_s"]["median"] / gather["samples_per_s"]["median"]
                                     if gather else None)
    if url:
        pairs = [prog.run("backend remote", lambda k=k: remote_epochs(
            url, batch_size=cfg.batch_size, seconds=cfg.seconds, seed=cfg.seed + k, cache_root=cache_root))
            for k in range(cfg.repeats)]
        firsts, seconds = [p[0] for p in pairs], [p[1] for p in pairs]
        rows.append(_backend_row("remote", "cold", firsts, limits, "download" if "download" in limits else None, None))
        rows.append(_backend_row("remote", "warm", seconds, limits, "read_warm", None))
    return rows


def _backend_row(name: str, cache: str, reads: list[Any], limits: dict[str, Any], limit: str | None,
                 resident: float | None) -> dict[str, Any]:
    bps = summarize([x.bytes_per_s for x in reads])
    ref = limits[limit]["bytes_per_s"]["median"] if limit else None
    return {
        "backend": name, "cache": cache,
        "samples_per_s": summarize([x.samples_per_s for x in reads]), "bytes_per_s": bps,
        "pct_of_limit": bps["median"] / ref if ref else None, "limit": limit or "-",
        "resident_after_evict": resident, "samples_read": int(sum(x.samples for x in reads)),
    }


def _loader_rows(cfg: BenchConfig, ds: Any, device: torch.device, limits: dict[str, Any],
                 prog: _Progress) -> list[dict[str, Any]]:
    rows = []
    for kind in cfg.loaders:
        for w in cfg.workers:
            runs = [prog.run(f"loader {kind} w={w}", lambda kind=kind, w=w, k=k: run_loader(
                kind, ds, batch_size=cfg.batch_size, num_workers=w, seconds=cfg.seconds, device=device,
                seed=cfg.seed + k)) for k in range(cfg.repeats)]
            bps = summarize([x.bytes_per_s for x in runs])
            rows.append({
                "loader": kind, "num_workers": w, "pin_memory": device.type == "cuda",
                "samples_per_s": summarize([x.samples_per_s for x in runs]), "bytes_per_s": bps,
                "pct_of_limit": bps["median"] / limits["read_warm"]["bytes_per_s"]["median"],
                "vs_torch": None,
                "first_batch_ms": summarize([1e3 * x.first_batch_s for x in runs]),
                "p50_ms": summarize([x.latency_ms(50) for x in runs]),
                "p99_ms": summarize([x.latency_ms(99) for x in runs]),
                "cpu_percent": summarize([x.cpu_percent for x in runs]),
                "peak_rss_bytes": max(x.peak_rss for x in runs),
                "batches": int(sum(x.batches for x in runs)),
                "best": False,
                "stats": runs[-1].stats,
            })
    best = _best(rows)
    torch_best = _best_of(best, TORCH_KINDS)
    for r in rows:
        r["best"] = best.get(r["loader"]) is r
        if torch_best:
            r["vs_torch"] = r["samples_per_s"]["median"] / max(torch_best["samples_per_s"]["median"], 1e-9)
    return rows


def _best(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        cur = best.get(r["loader"])
        if cur is None or r["samples_per_s"]["median"] > cur["samples_per_s"]["median"]:
            best[r["loader"]] = r
    return best


def _best_of(best: dict[str, dict[str, Any]], kinds: tuple[str, ...]) -> dict[str, Any] | None:
    """The fastest of the best rows of `kinds` (None when none ran)."""
    rows = [best[k] for k in kinds if k in best]
    return max(rows, key=lambda r: r["samples_per_s"]["median"]) if rows else None


def _row_name(row: dict[str, Any]) -> str:
    return f"{LABELS.get(row['loader'], row['loader'])}, {plural(row['num_workers'], 'worker')}"


def _step_rows(cfg: BenchConfig, ds: Any, device: torch.device, prog: _Progress) -> dict[str, Any]:
    """Each loader at each worker count under the simulated step; the lowest stall per loader is `best`."""
    assert cfg.step_ms is not None
    kind = cfg.step_kind if cfg.step_kind != "auto" else ("matmul" if device.type == "cuda" else "sleep")
    step = Step(cfg.step_ms, kind=kind, device=device)
    seconds = max(cfg.seconds, 40 * cfg.step_ms / 1e3)
    rows = []
    for name in cfg.loaders:
        for w in cfg.workers:
            runs = [prog.run(f"step {name} w={w}", lambda name=name, w=w, k=k: run_loader(
                name, ds, batch_size=cfg.batch_size, num_workers=w, seconds=seconds, device=device,
                seed=cfg.seed + k, step=step)) for k in range(cfg.repeats)]
            stall = summarize([x.data_stall for x in runs])
            bound = stall["median"] > INPUT_BOUND_STALL
            rows.append({
                "loader": name, "num_workers": w, "data_stall": stall, "input_bound": bound,
                "bottleneck": (bottleneck(runs[-1].stats) if bound else "compute"),
                "stage_s": {k: v for k, v in (runs[-1].stats or {}).items() if k.endswith("_s")} or None,
                "step_wall_ms": summarize([1e3 * x.steady_s / max(1, x.batches - 1) for x in runs]),
                "samples_per_s": summarize([x.samples_per_s for x in runs]),
                "best": False,
            })
    for name in cfg.loaders:
        mine = [r for r in rows if r["loader"] == name]
        min(mine, key=lambda r: r["data_stall"]["median"])["best"] = True
    return {"step_ms": cfg.step_ms, "kind": kind, "device": str(device), "threshold": INPUT_BOUND_STALL, "rows": rows}


def _convert_copy(kind: str, path: str, out: str, cfg: BenchConfig) -> str:
    """`path` (Parquet or Lance) converted to a fastload dataset in `out`, as `fastload convert` writes it."""
    from fastload.formats import write
    from fastload.formats.arrow_dataset import LanceDataset, ParquetDataset, in_place_source

    if cfg.progress:
        print(f"fastload bench: converting {path} to {out} to compare", file=sys.stderr)
    ds = ParquetDataset(path) if kind == "parquet" else LanceDataset(path)
    write(in_place_source(ds), out, progress=False)
    return out


def _conversion_gain(rows: list[dict[str, Any]]) -> list[str]:
    """One line per cache state: the converted copy's samples/s over the in-place reads'."""
    lines = []
    for cache in ("cold", "warm"):
        mine = {r["backend"]: r["samples_per_s"]["median"] for r in rows if r["cache"] == cache}
        converted = mine.pop(CONVERTED, None)
        for name, rate in mine.items():
            if name in IN_PLACE and converted is not None and rate > 0:
                lines.append(f"converting would gain {converted / rate:.2f}x on {cache} reads: {name} in place "
                             f"{rate:,.0f} samples/s, converted {converted:,.0f} samples/s "
                             "(1 thread, shuffled batches).")
    return lines


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    best = _best(res["loaders"])
    out: dict[str, Any] = {"best": {k: {"num_workers": v["num_workers"], "samples_per_s": v["samples_per_s"]["median"]}
                                    for k, v in best.items()}}
    lines = []
    fl = _best_of(best, FASTLOAD_KINDS)
    tb = _best_of(best, TORCH_KINDS)
    if fl:
        out["fastload_pct_of_read_warm"] = fl["pct_of_limit"]
        out["fastload_row"] = {"loader": fl["loader"], "num_workers": fl["num_workers"]}
        text = f"best fastload.Loader row ({_row_name(fl)}): {fl['samples_per_s']['median']:,.0f} samples/s"
        if tb:
            out["fastload_vs_torch"] = fl["vs_torch"]
            out["torch_row"] = {"loader": tb["loader"], "num_workers": tb["num_workers"]}
            text += (f" = {fl['vs_torch']:.2f}x the best torch DataLoader row ({_row_name(tb)}: "
                     f"{tb['samples_per_s']['median']:,.0f} samples/s)")
        lines.append(text + f"; {100 * fl['pct_of_limit']:.0f}% of the warm sequential-read limit.")
    bs = res["config"]["batch_size"]
    for name, r in best.items():
        ms = 1e3 * bs / max(r["samples_per_s"]["median"], 1e-9)
        lines.append(f"{LABELS.get(name, name)}: a training step faster than {ms:.1f} ms per batch of {bs} "
                     "would be input-bound.")
    for s in (res.get("step") or {}).get("rows", []):
        if not s["best"]:
            continue
        where = s["bottleneck"] or "no per-stage stats"
        verdict = f"input-bound (bottleneck: {where})" if s["input_bound"] else "not input-bound"
        workers = plural(s["num_workers"], "worker")
        lines.append(f"with a {res['step']['step_ms']:g} ms step, {s['loader']} ({workers}) stalls "
                     f"{100 * s['data_stall']['median']:.0f}% of the time: {verdict}.")
    lines += _conversion_gain(res.get("backends") or [])
    out["lines"] = lines
    return out


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run everything `cfg` asks for and return the result dict (the JSON schema of `fastload.benchmark`)."""
    t_start = time.perf_counter()
    device = _device(cfg.device)
    if cfg.workdir:
        os.makedirs(cfg.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="fastload-bench-", dir=cfg.workdir)
    url = None
    paths: dict[str, str] = {}
    try:
        if cfg.dataset is None:
            from fastload.benchmark.synthetic import build

            extra = tuple(b for b in ("lmdb", "hdf5") if b in cfg.backends)
            if cfg.progress:
                print(f"fastload bench: writing the embedded default ({cfg.size / 2**20:.0f} MiB) to {workdir}",
                      file=sys.stderr)
            syn = build(os.path.join(workdir, "data"), size=cfg.size, backends=extra, seed=cfg.seed)
            paths = {"fastload": syn.fastload, **({"lmdb": syn.lmdb} if syn.lmdb else {}),
                     **({"hdf5": syn.hdf5} if syn.hdf5 else {})}
            primary = "fastload"
            desc = "embedded default (synthetic records + JPEGs + tokens; fastload, LMDB, HDF5 copies)"
        else:
            primary = _kind_of(cfg.dataset)
            if primary == "remote":
                url = cfg.dataset
            else:
                paths = {primary: cfg.dataset}
            desc = cfg.dataset
            if primary in IN_PLACE and "fastload" in cfg.backends:
                paths["fastload"] = _convert_copy(primary, cfg.dataset, os.path.join(workdir, "converted"), cfg)
        names = [b for b in cfg.backends if b in paths]
        prog = _Progress(_plan(cfg, names, url is not None), cfg.progress)
        try:
            if url:
                from fastload.dataset import open_dataset

                ds = open_dataset(url, cache_dir=os.path.join(workdir, "loader-cache"))
                read_epoch(ds, batch_size=cfg.batch_size, seconds=float("inf"))  # fill the cache
                files = lim.dataset_files(os.path.join(workdir, "loader-cache"))
            else:
                ds = open_backend(primary, paths[primary]).open()
                files = lim.dataset_files(paths[primary])
            res: dict[str, Any] = {
                "schema_version": SCHEMA_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": {"cores": usable_cores(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
                "config": {"dataset": cfg.dataset, "embedded": cfg.dataset is None, "backends": names
                           + (["remote"] if url else []), "loaders": list(cfg.loaders), "batch_size": cfg.batch_size,
                           "workers": list(cfg.workers), "seconds": cfg.seconds, "repeats": cfg.repeats,
                           "step_ms": cfg.step_ms, "device": str(device), "size": cfg.size, "seed": cfg.seed},
                "dataset": {"description": desc, "kind": primary, "samples": len(ds),
                            "bytes": sum(os.path.getsize(p) for p in files), "files": len(files),
                            "mean_sample_bytes": _mean_sample_bytes(ds, cfg.seed)},
            }
            jpegs = _jpegs_from(ds, cfg.seed)
            release(ds)  # unmapped, so that cold reads can evict its pages
            res["limits"] = _limits(cfg, files, ds, jpegs, prog, url)
            if cfg.dataset is None:
                res["limits"].update(_gather_limits(cfg, syn.raw, prog))
            backends = [open_backend(n, paths[n]) for n in names]
            if primary in IN_PLACE:
                backends = [replace(b, name=CONVERTED) if b.name == "fastload" else b for b in backends]
            res["backends"] = _backend_rows(cfg, backends, res["limits"], prog, url, workdir)
            if url is None:
                ds = open_backend(primary, paths[primary]).open()
            res["loaders"] = _loader_rows(cfg, ds, device, res["limits"], prog)
            res["step"] = _step_rows(cfg, ds, device, prog) if cfg.step_ms else None
            release(ds)
        finally:
            prog.close()
        res["wall_s"] = time.perf_counter() - t_start
        res["summary"] = _summary(res)
        if cfg.keep:
            res["workdir"] = workdir
        return res
    finally:
        if not cfg.keep:
            shutil.rmtree(workdir, ignore_errors=True)
