"""What integrity by default costs: verify="auto" (block checksums) against verify="none", in one run.

    python -m bench.integrity [--path DIR] [--samples N] [--rounds R] [--skip-bench]

On `bench.loader`'s dataset (N x 3 KiB fixed records, built once in --path), in paired rounds
(the two modes back to back, order alternating; the median of the per-round ratios):

* the Loader (seeded shuffle, batch 256, 1 and 2 thread workers) over 3 epochs, timed from the
  first batch as `bench.loader` does, in a new process for each run: its first epoch verifies
  every block it touches (the cost a new process pays once), later ones nothing; and on a dataset
  object kept across runs (what `bench.loader`'s rows measure: verified already);
* bytes read from storage (`/proc/self/io` read_bytes) by one random epoch and by a random 5%
  of the samples, page cache dropped before each (`posix_fadvise(DONTNEED)`);
* the embedded `fastload bench` (fastload loader and backend, its defaults otherwise): its best
  fastload Loader row with `open_dataset` verifying (default) and with verify="none".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

import fastload.dataset
from bench.loader import BATCH, build, dict_size, epochs_of, paired_rounds, rate
from fastload.formats import FastloadDataset
from fastload.loader import Loader

__all__ = ["main"]

EPOCHS = 3
MODES = ("none", "auto")


def _read_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("read_bytes"):
                return int(line.split()[1])
    return 0


def _drop_cache(ds_dir: str) -> None:
    for path in glob.glob(os.path.join(ds_dir, "shards", "*.fls")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _loader_rate(ds: FastloadDataset, nw: int, limit: int) -> float:
    loader = Loader(ds, batch_size=BATCH, shuffle=True, num_workers=nw, worker_type="thread", seed=0)
    return rate(epochs_of(loader, EPOCHS), limit, dict_size)


def _cold_bytes(ds_dir: str, mode: str, fraction: float) -> int:
    ds = FastloadDataset(ds_dir, verify=mode)
    n = len(ds)
    order = np.random.default_rng(7).permutation(n)[: max(BATCH, int(n * fraction))]
    _drop_cache(ds_dir)
    before = _read_bytes()
    loader = Loader(ds, batch_size=BATCH, sampler=order.tolist(), num_workers=0)
    for _ in loader:
        pass
    got = _read_bytes() - before
    ds.close()
    del ds, loader
    gc.collect()
    return got


def _bench_best(mode: str, workdir: str) -> float:
    """The embedded `fastload bench`'s best fastload Loader row (median samples/s of its repeats) with
    `open_dataset(verify=mode)`."""
    from fastload.benchmark import add_arguments, config_from_args, run_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--backends", "fastload", "--loaders", "fastload", "--no-progress", "--workdir", workdir, "--keep"]
    )
    with _open_dataset_verifying(mode):
        res = run_benchmark(config_from_args(args))
    return max(row["samples_per_s"]["median"] for row in res["loaders"] if row["loader"].startswith("fastload"))


@contextlib.contextmanager
def _open_dataset_verifying(mode: str) -> Iterator[None]:
    original = fastload.dataset.open_dataset
    fastload.dataset.open_dataset = functools.partial(original, verify=mode)
    try:
        yield
    finally:
        fastload.dataset.open_dataset = original


def _ratio_line(name: str, runs: dict[str, list[float]]) -> str:
    ratios = [a / b for a, b in zip(runs["auto"], runs["none"])]
    return (
        f"{name:<44} none best {max(runs['none']):>11,.0f}  auto best {max(runs['auto']):>11,.0f}  "
        f"best ratio {max(runs['auto']) / max(runs['none']):.3f}  median paired ratio {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}]"
    )


def _embedded_rows(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        runs: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                t0 = time.perf_counter()
                runs[mode].append(_bench_best(mode, workdir))
                print(f"  fastload bench verify={mode}: {runs[mode][-1]:,.0f} samples/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        print(_ratio_line("fastload bench (embedded), best fastload row", runs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "fastload-bench-integrity"))
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-bench", action="store_true", help="leave out the embedded `fastload bench` rows")
    ap.add_argument("--only-bench", action="store_true", help="only the embedded `fastload bench` rows")
    args = ap.parse_args(argv)
    ds_dir, _ = build(args.path, args.samples)
    limit = EPOCHS * args.samples - 2 * BATCH
    print(f"dataset {ds_dir}: {args.samples} x 3 KiB; {args.rounds} paired rounds; {os.cpu_count()} cores (shared)")

    if args.only_bench:
        _embedded_rows(args.rounds)
        return 0
    kept = {mode: FastloadDataset(ds_dir, verify=mode) for mode in MODES}
    for ds in kept.values():  # verified and mapped before the kept rows are timed
        _loader_rate(ds, 0, limit)

    def row(nw: int, mode: str, fresh: bool) -> Callable[[], float]:
        def timed() -> float:
            if fresh:  # a new process: nothing verified yet
                code = (
                    "from bench.integrity import _loader_rate; from fastload.formats import FastloadDataset; "
                    f"print(_loader_rate(FastloadDataset({ds_dir!r}, verify={mode!r}), {nw}, {limit}))"
                )
                out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                return float(out.stdout.split()[-1])
            return _loader_rate(kept[mode], nw, limit)

        return timed

    for fresh in (True, False):
        for nw in (1, 2):
            runs = paired_rounds({mode: row(nw, mode, fresh) for mode in MODES}, args.rounds)
            what = "new process per run" if fresh else "dataset kept (verified)"
            print(_ratio_line(f"Loader nw={nw}, {EPOCHS} epochs, {what}", runs), flush=True)

    for ds in kept.values():
        ds.close()
    kept.clear()
    gc.collect()  # no mapping left: pages still mapped somewhere are not dropped from the page cache
    for fraction in (1.0, 0.05):
        got = {mode: [_cold_bytes(ds_dir, mode, fraction) for _ in range(2)] for mode in MODES}
        none, auto = min(got["none"]), min(got["auto"])
        print(
            f"cold random {'epoch' if fraction == 1 else f'{fraction:.0%} of the samples'}: bytes read none "
            f"{none / 1e6:,.1f} MB, auto {auto / 1e6:,.1f} MB, ratio {auto / max(1, none):.3f}",
            flush=True,
        )

    if not args.skip_bench:
        _embedded_rows(args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
