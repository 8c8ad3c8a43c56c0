"""User CPU of a remote dataset's cold epochs, measured by sampling: `perf record -e cpu-clock:u`.

`bench.remote` reads user CPU from `getrusage`, whose user/system split the kernel takes from the
timer ticks (250 a second) that land in each mode. A raw pass (8 threads of GET + xxh3 + write) is
about 90% system time and lasts a fraction of a second, so its user CPU rests on a handful of
ticks: per round it swings by 5x, and the median of such skewed rounds reads low. This script
measures user CPU by sampling instead (4,000 samples per CPU-second, user mode only), and splits it
by thread (the Loader's reader, the download threads, obstore's runtime).

Each row of each round runs in a child Python process under `perf record -k mono`. The child first
reads a batch through another cache, with the row's own Loader (its workers and sampler), and GETs
one shard raw (what a process pays once: imports, clients, first calls of each code path), then
marks the time windows it measures: the raw pass, or the cold epoch and
then the warm epoch of the same Loader and order; the samples in each window are counted. Rows (the
raw pipeline on obstore, and the Loader with `num_workers` 0 and 2, shuffled and sequential) rotate
within each round; the page cache is recycled before every raw pass and cold epoch (as
`bench.remote` does). The fetch cost is a cold epoch's user CPU minus the warm epoch's, per round,
as in `bench.remote`.

Needs `perf` with user-mode sampling allowed (`kernel.perf_event_paranoid` <= 2, or root).

`--cache-entries 0 N` adds the Loader rows again, each cold epoch starting with N other files (4 KiB
each) already in the cache, as a cache that served other shards before holds them, and prints each
such row's fetch cost over the same row's with an empty cache (it should not depend on N).

`--against TREE` runs every row a second time from another source tree (e.g. `git worktree add
../base <commit>`, its C extensions built in place and `fastload/formats` linked to `../formats`,
as an editable install has it), in the same rounds, alternating with this tree's run of the row,
so both commits see the same state of the machine; those rows carry the suffix " @base", and each
row's fetch cost is printed over its base's, with the per-round ratios, beside its cold epoch's, its
warm epoch's and the two together: a change that moves work into the warm epoch lowers the fetch cost
without saving anything, which only the warm and cold + warm ratios show.

Run: `python -m bench.remote_cpu [--shards 12 --shard-size 32MB --rounds 5 --cache-entries 0 2000]
[--against ../base]`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["count_samples", "main"]

SAMPLE_HZ = 4000
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name_threads() -> None:
    """Give each Python thread its name at the OS level (trailing numbers dropped), so that perf's
    samples say which thread they came from."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None)
    run = threading.Thread.run

    def named(self: threading.Thread) -> None:
        libc.prctl(15, re.sub(r"[_-]?\d+$", "", self.name)[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        run(self)

    threading.Thread.run = named  # type: ignore[method-assign]


def fill_cache(cache: str, entries: int, size: int = 4096) -> None:
    """Put `entries` files of `size` bytes in the cache directory `cache` (other shards cached earlier):
    the cache takes them in as entries when it opens, as it does any file it finds there."""
    data = os.path.join(cache, "data")
    os.makedirs(data, exist_ok=True)
    blob = b"\x5a" * size
    for i in range(entries):
        with open(os.path.join(data, f"earlier-{i:06d}.bin"), "wb") as f:
            f.write(blob)


def child(
    row: str, url: str, seed: int, work: str, out: str, transport: str = "auto", cache_entries: int = 0
) -> None:
    """One row, in this process: the windows measured, as JSON in `out`."""
    _name_threads()
    from fastload.benchmark.limits import recycle_page_cache
    from fastload.benchmark.remote import raw_pipeline
    from fastload.dataset import open_dataset
    from fastload.loader import Loader
    from fastload.order.shard_shuffle import ShardWindowSampler

    cache = os.path.join(work, f"cache-{os.getpid()}")

    def loader(ds: Any, row: str) -> Loader:
        """The row's Loader over `ds`: `num_workers` thread workers, shuffled by shard window or in order."""
        workers, order = int(row.split()[0][1:]), row.split()[1]
        sampler = ShardWindowSampler.from_dataset(ds, window=4, seed=seed) if order == "shuffled" else None
        return Loader(ds, batch_size=256, sampler=sampler, num_workers=workers, worker_type="thread")

    # what a process pays once (imports, clients, first calls) is paid here, before any window: a batch
    # through the row's own Loader configuration (its workers and sampler), from another cache
    warm_up = open_dataset(url, cache_dir=cache + "-warm-up", cache_limit="1TB", transport=transport)
    first = loader(warm_up, row) if not row.startswith("raw ") else Loader(warm_up, batch_size=256)
    next(iter(first))
    first.close()
    client = row.split()[1] if row.startswith("raw ") else "obstore"
    raw_pipeline(url, list(warm_up.manifest.shards[:1]), os.path.join(work, f"raw-{os.getpid()}"), client=client)
    warm_up.close()
    warm_up.storage.close()
    shutil.rmtree(cache + "-warm-up", ignore_errors=True)
    fill_cache(cache, cache_entries)
    ds = open_dataset(url, cache_dir=cache, cache_limit="1TB", transport=transport)
    nbytes = sum(s.bytes for s in ds.manifest.shards)
    windows: dict[str, list[float]] = {}
    if row.startswith("raw "):
        recycle_page_cache(work, nbytes)
        t0 = time.monotonic()
        raw_pipeline(url, list(ds.manifest.shards), os.path.join(work, f"raw-{os.getpid()}"), client=client)
        windows["raw"] = [t0, time.monotonic()]
        ds.close()
        ds.storage.close()
    else:
        for epoch in ("cold", "warm"):
            epoch_loader = loader(ds, row)
            if epoch == "cold":
                recycle_page_cache(work, nbytes)
            t0 = time.monotonic()
            n = sum(len(batch["x"]) for batch in epoch_loader)
            windows[epoch] = [t0, time.monotonic()]
            epoch_loader.close()
            if n != len(ds):
                raise RuntimeError(f"{row} {epoch}: {n} samples, the dataset has {len(ds)}")
        ds.close()
        ds.storage.close()
    shutil.rmtree(cache, ignore_errors=True)
    with open(out, "w") as f:
        json.dump({"bytes": nbytes, "windows": windows}, f)


def _samples(data: str, windows: dict[str, list[float]]) -> dict[str, collections.Counter]:
    """Per window, user-mode samples by thread name, from the perf data file `data`."""
    text = subprocess.run(["perf", "script", "-i", data, "-F", "comm,time"], capture_output=True, text=True,
                          check=True).stdout
    return count_samples(text, windows)


def count_samples(text: str, windows: dict[str, list[float]]) -> dict[str, collections.Counter]:
    """Per window [start, end] (seconds), the samples of `perf script -F comm,time` output (`text`) that
    fall in it, by thread name."""
    counts = {name: collections.Counter() for name in windows}
    for line in text.splitlines():
        m = re.match(r"\s*(.+?)\s+(\d+\.\d+):", line)
        if not m:
            continue
        t = float(m.group(2))
        for name, (a, b) in windows.items():
            if a <= t <= b:
                counts[name][m.group(1).strip()] += 1
    return counts


def check_tree(tree: str) -> str:
    """`tree` as an absolute path, once it holds what a child needs to run fastload from it (its own
    `fastload` package with `fastload/formats`, and the formats C extension built in place: without
    it the blocks would be hashed in Python and the comparison would measure that); else SystemExit
    saying what is missing."""
    tree = os.path.abspath(tree)
    formats = os.path.join(tree, "formats")
    built = os.path.isdir(formats) and any(n.startswith("_ranges") and n.endswith(".so") for n in os.listdir(formats))
    missing = [what for what, ok in (
        ("fastload/__init__.py", os.path.isfile(os.path.join(tree, "fastload", "__init__.py"))),
        ("fastload/formats (a link to ../formats)", os.path.isdir(os.path.join(tree, "fastload", "formats"))),
        ("formats/_ranges*.so (`python setup.py build_ext --inplace` there)", built),
    ) if not ok]
    if missing:
        raise SystemExit(f"--against {tree}: missing {', '.join(missing)}")
    return tree


def run_row(
    row: str, url: str, seed: int, work: str, transport: str = "auto", cache_entries: int = 0,
    tree: str | None = None,
) -> dict[str, Any]:
    """One row in a child process under perf, run from `tree` (default this one): {window: {thread:
    user CPU seconds}, "bytes": n}."""
    out, data = os.path.join(work, "row.json"), os.path.join(work, "row.perf")
    cmd = ["perf", "record", "-q", "-k", "mono", "-e", "cpu-clock:u", "-F", str(SAMPLE_HZ), "-o", data, "--",
           sys.executable, "-m", "bench.remote_cpu", "--child", row, "--url", url, "--seed", str(seed),
           "--work", work, "--out", out, "--transport", transport, "--cache-entries", str(cache_entries)]
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run(cmd, cwd=tree or _REPO, env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{row}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        got = json.load(f)
    counts = _samples(data, got["windows"])
    res: dict[str, Any] = {"bytes": got["bytes"]}
    for name, c in counts.items():
        res[name] = {thread: n / SAMPLE_HZ for thread, n in c.items()}
    return res


def _ratios(mine: list[float], base: list[float]) -> str:
    """Median [min-max] of the per-round ratios mine[r] / base[r] (both runs of a row in one round)."""
    got = [a / b for a, b in zip(mine, base) if b > 0]
    return _med(got) if got else "-"


def _med(v: list[float]) -> str:
    return f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"


RAW_ROWS = ("raw plain", "raw obstore", "raw http")


BASE = " @base"  # the suffix of the rows run from `--against`'s tree


def _row_setup(row: str) -> tuple[str, str, int]:
    """(the child's row, its `transport`, files cached beforehand) of a row name: Loader rows of
    "obstore-stream" carry the prefix "stream ", rows starting with N files cached the suffix " +N cached"
    (before a `BASE` suffix, which `main` strips)."""
    entries = 0
    m = re.fullmatch(r"(.*) \+(\d+) cached", row)
    if m:
        row, entries = m.group(1), int(m.group(2))
    if row.startswith("stream "):
        return row[len("stream "):], "obstore-stream", entries
    return row, "auto", entries


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the rounds, print the table; returns the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--shard-size", default="32MB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--stream-rows", action="store_true",
                    help="also the Loader rows with transport='obstore-stream' (bodies received by obstore)")
    ap.add_argument("--cache-entries", type=int, nargs="+", default=[0],
                    help="files the cache already holds when a cold epoch starts (other shards cached earlier); "
                         "each value beyond 0 adds the Loader rows again with that many")
    ap.add_argument("--against", default=None, metavar="TREE",
                    help="also run every row from this source tree (another commit), alternating with this one's")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.url, args.seed, args.work, args.out, args.transport, args.cache_entries[0])
        return {}
    if shutil.which("perf") is None:
        raise SystemExit("bench.remote_cpu needs `perf` (linux-tools) on PATH")
    from bench.remote import Nginx, make_dataset, write_json
    from fastload.formats.units import parse_size

    loader_rows = [f"w{w} {o}" for w in args.workers for o in ("shuffled", "sequential")]
    if args.stream_rows:
        loader_rows += [f"stream {row}" for row in loader_rows]
    loader_rows += [f"{row} +{n} cached" for n in args.cache_entries if n > 0 for row in loader_rows]
    rows = [*RAW_ROWS, *loader_rows]
    against = None if args.against is None else check_tree(args.against)
    work = tempfile.mkdtemp(prefix="fastload-bench-cpu-")
    user: dict[str, list[float]] = collections.defaultdict(list)  # "row window" -> user s/GB per round
    # "row window" -> user s/GB by thread, mean over rounds (cold and warm epochs)
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    try:
        root = os.path.join(work, "root")
        make_dataset(os.path.join(root, "ds"), shards=args.shards, shard_size=parse_size(args.shard_size))
        server = Nginx(root, work)
        try:
            for r in range(args.rounds):
                at = r % len(rows)
                # a row's base run right beside it, first in every other round
                runs = [(row, None) for row in rows[at:] + rows[:at]] if against is None else [
                    pair for row in rows[at:] + rows[:at]
                    for pair in [(row, None), (row + BASE, against)][:: -1 if r % 2 else 1]]
                for row, tree in runs:
                    name, transport, entries = _row_setup(row.removesuffix(BASE))
                    got = run_row(name, f"{server.url}/ds", r, work, transport=transport, cache_entries=entries,
                                  tree=tree)
                    gb = got.pop("bytes") / 1e9
                    for window, by_thread in got.items():
                        user[f"{row} {window}"].append(sum(by_thread.values()) / gb)
                        if window in ("cold", "warm"):
                            threads[f"{row} {window}"].update({k: v / gb / args.rounds for k, v in by_thread.items()})
                    if "cold" in got:
                        user[f"{row} fetch cost"].append(user[f"{row} cold"][-1] - user[f"{row} warm"][-1])
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw = {name: statistics.median(user[f"{name} raw"]) for name in RAW_ROWS}
    print(f"user CPU s/GB by sampling (perf cpu-clock:u at {SAMPLE_HZ} Hz), median [min-max] over {args.rounds} rounds")
    for name in RAW_ROWS:
        print(f"{name:24s} {_med(user[f'{name} raw'])}")
    for row in loader_rows:
        cost = user[f"{row} fetch cost"]
        print(f"{row:24s} cold {_med(user[f'{row} cold'])}  warm {_med(user[f'{row} warm'])}  fetch cost "
              f"{_med(cost)} = " + ", ".join(f"{statistics.median(cost) / v:.2f}x {k}" for k, v in raw.items()))
    for row in loader_rows:
        base = re.sub(r" \+\d+ cached$", "", row)
        if base != row:
            ratio = statistics.median(user[f"{row} fetch cost"]) / statistics.median(user[f"{base} fetch cost"])
            print(f"{row}: fetch cost / the same row with an empty cache = {ratio:.2f}")
    if against is not None:
        print(f"rows{BASE} ran from {against}; this tree / base, median of the per-round ratios [min-max]:")
        for name in RAW_ROWS:
            print(f"{name:24s} raw user CPU {_ratios(user[f'{name} raw'], user[f'{name}{BASE} raw'])}")
        for row in loader_rows:
            both = [c + w for c, w in zip(user[f"{row} cold"], user[f"{row} warm"])]
            both_base = [c + w for c, w in zip(user[f"{row}{BASE} cold"], user[f"{row}{BASE} warm"])]
            print(f"{row:24s} fetch cost {_ratios(user[f'{row} fetch cost'], user[f'{row}{BASE} fetch cost'])}"
                  f"  cold {_ratios(user[f'{row} cold'], user[f'{row}{BASE} cold'])}"
                  f"  warm {_ratios(user[f'{row} warm'], user[f'{row}{BASE} warm'])}"
                  f"  cold + warm {_ratios(both, both_base)}"
                  f"  (base: fetch cost {_med(user[f'{row}{BASE} fetch cost'])})")
    # a warm epoch's reading threads are the baseline of the fetch cost: with 0 workers the main thread
    # gathers through the epoch plan, with workers they read spliced columns
    print("cold and warm epochs by thread, mean s/GB:")
    for row in loader_rows:
        for window in ("cold", "warm"):
            top = threads[f"{row} {window}"].most_common(6)
            print(f"  {row:22s} {window} " + ", ".join(f"{k}={v:.3f}" for k, v in top))
    res = {"rounds": args.rounds, "cache_entries": args.cache_entries, "against": against, "user_s_per_GB": dict(user),
           "threads": {k: dict(v) for k, v in threads.items()},
           "raw_medians": raw}
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
