"""`make demo`'s run (`fastload bench`) with each loader row's garbage collections and CPU time.

    python -m bench.demo_gc [--root CHECKOUT] [--out ROWS.json] [--calls] [fastload bench options]
    python -m bench.demo_gc [--root CHECKOUT] --batches N DATASET [--loaders KIND] [--workers W]

Runs `fastload bench` as `make demo` does and, around every loader-row repeat, records what a
loaded machine does not distort: the collections of each generation the row triggered and the
time they took (`gc.callbacks`), the objects the collector tracked and the threads alive when
the row began (what earlier rows left behind), and the CPU time per sample delivered: the
process's (all threads: the consumer, the Loader's workers, the collector) and the consumer
thread's. `--root` imports fastload from another
checkout (its C extensions built in place: `python setup.py build_ext --inplace`), so two
commits compare with one interpreter and one set of packages. `--calls` counts instead the
Python and C function calls per batch of each row, in the consumer thread and in the Loader's
threads (`fastload-*`): how much work a batch costs, whatever the load (the profiler slows the
rows, so their samples/s then mean nothing). `--batches N DATASET` only iterates N batches of one
row (the first of `--loaders` and `--workers`, default batch views with 1 worker) over DATASET and
exits: under `valgrind --tool=callgrind`, runs of two N give the instructions per batch.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Imports `fastload` (with `fastload.formats` and `fastload.cuda_ops`) from a source checkout."""

    def __init__(self, root: str) -> None:
        self.packages = {"fastload": os.path.join(root, "fastload"), "fastload.formats": os.path.join(root, "formats"),
                         "fastload.cuda_ops": os.path.join(root, "cuda_ops")}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname in self.packages:
            where = self.packages[fullname]
            return importlib.util.spec_from_file_location(fullname, os.path.join(where, "__init__.py"),
                                                          submodule_search_locations=[where])
        return None


class _Collections:
    """Collections per generation and seconds spent in them while installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t


class _Calls:
    """Function calls per thread group while installed (`sys.setprofile` / `threading.setprofile`)."""

    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            name = threading.current_thread().name
            group = "consumer" if name == "MainThread" else "loader" if name.startswith("fastload") else "other"
            self.count[group] += 1

    def __enter__(self) -> _Calls:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _counted(run_loader: Callable[..., Any], rows: list[dict[str, Any]]) -> Callable[..., Any]:
    def run(kind: str, dataset: Any, **kw: Any) -> Any:
        with _Calls() as calls:
            res = run_loader(kind, dataset, **kw)
        batches = max(res.batches, 1)
        rows.append({"loader": kind, "num_workers": kw["num_workers"], "batches": res.batches,
                     "consumer_calls_per_batch": calls.count["consumer"] / batches,
                     "loader_calls_per_batch": calls.count["loader"] / batches})
        return res

    return run


def _timed(run_loader: Callable[..., Any], rows: list[dict[str, Any]]) -> Callable[..., Any]:
    def run(kind: str, dataset: Any, **kw: Any) -> Any:
        tracked, threads = len(gc.get_objects()), threading.active_count()
        col = _Collections()
        gc.callbacks.append(col)
        cpu, own = time.process_time(), time.thread_time()
        try:
            res = run_loader(kind, dataset, **kw)
        finally:
            cpu, own = time.process_time() - cpu, time.thread_time() - own
            gc.callbacks.remove(col)
        rows.append({"loader": kind, "num_workers": kw["num_workers"], "samples": res.samples,
                     "samples_per_s": res.samples_per_s, "cpu_us_per_sample": 1e6 * cpu / max(res.samples, 1),
                     "consumer_cpu_us_per_sample": 1e6 * own / max(res.samples, 1),
                     "collections": col.count, "gc_ms": [1e3 * s for s in col.seconds],
                     "tracked_at_start": tracked, "threads_at_start": threads})
        return res

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=None, help="import fastload from this checkout")
    parser.add_argument("--out", default=None, help="write the per-row records as JSON")
    parser.add_argument("--calls", action="store_true", help="count function calls per batch instead")
    parser.add_argument("--batches", type=int, default=None, help="only iterate this many batches of one row")
    args, rest = parser.parse_known_args(argv)
    if args.root:
        sys.meta_path.insert(0, _CheckoutFinder(os.path.abspath(args.root)))
    import fastload
    from fastload.benchmark import cli, runner
    from fastload.benchmark.report import format_table

    bench = argparse.ArgumentParser()
    cli.add_arguments(bench)
    if args.batches is not None:
        return _iterate(cli.config_from_args(bench.parse_args(rest)), args.batches)
    rows: list[dict[str, Any]] = []
    runner.run_loader = (_counted if args.calls else _timed)(runner.run_loader, rows)  # type: ignore[attr-defined]
    res = runner.run_benchmark(cli.config_from_args(bench.parse_args(rest)))
    print(f"fastload from {os.path.dirname(fastload.__file__)}")
    if args.calls:
        _print_calls(rows)
    else:
        print(format_table(res))
        _print_timed(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"fastload": os.path.dirname(fastload.__file__), "rows": rows,
                       "summary": res.get("summary")}, f, indent=1)
    return 0


def _iterate(cfg: Any, batches: int) -> int:
    """`batches` batches of one loader row over `cfg.dataset` (epoch after epoch), nothing else."""
    import torch

    from fastload.benchmark.backends import open_backend
    from fastload.benchmark.loaders import make_loader

    if cfg.dataset is None:
        raise SystemExit("--batches needs a fastload DATASET (e.g. a copy of the demo's: --keep)")
    kind = cfg.loaders[0] if len(cfg.loaders) == 1 else "fastload-views"
    workers = cfg.workers[0] if len(cfg.workers) == 1 else 1
    ds = open_backend("fastload", cfg.dataset).open()
    loader = make_loader(kind, ds, batch_size=cfg.batch_size, num_workers=workers, device=torch.device("cpu"),
                         seed=cfg.seed)
    got = 0
    while got < batches:
        for _ in loader:
            got += 1
            if got >= batches:
                break
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    print(f"{kind}, {workers} workers: {got} batches")
    return 0


def _print_calls(rows: list[dict[str, Any]]) -> None:
    print(f"{'loader':16} {'w':>2} {'batches':>8} {'consumer calls/batch':>21} {'loader-thread calls/batch':>26}")
    for r in rows:
        print(f"{r['loader']:16} {r['num_workers']:>2} {r['batches']:>8} {r['consumer_calls_per_batch']:>21.1f} "
              f"{r['loader_calls_per_batch']:>26.1f}")


def _print_timed(rows: list[dict[str, Any]]) -> None:
    print(f"{'loader':16} {'w':>2} {'samples/s':>10} {'CPU us/sample':>13} {'consumer':>8} "
          f"{'gen0/1/2 collections':>20} {'gc ms (0/1/2)':>16} {'tracked':>9} {'threads':>7}")
    for r in rows:
        print(f"{r['loader']:16} {r['num_workers']:>2} {r['samples_per_s']:>10,.0f} {r['cpu_us_per_sample']:>13.3f} "
              f"{r['consumer_cpu_us_per_sample']:>8.3f} {'/'.join(map(str, r['collections'])):>20} "
              f"{'/'.join(f'{m:.1f}' for m in r['gc_ms']):>16} {r['tracked_at_start']:>9,} {r['threads_at_start']:>7}")


if __name__ == "__main__":
    raise SystemExit(main())
