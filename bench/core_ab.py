"""Two checkouts of fastload, same Loader rows, interleaved: each Loader row's ratio to the raw gather limit.

    python -m bench.core_ab --old /work/base [--new .] [--rounds 3] [--trials 4] [--samples 200000]

Each round runs one child process per checkout (the order alternating between rounds), each
with its own checkout's venv (`<tree>/.venv/bin/python`, the tree as working directory). A
child uses `bench.loader`'s dataset (200k x 3 KiB records, batch 256, 3 passes per row, cached
under --path) and times `fastload.Loader(seed=0, shuffle=True, worker_type="thread")` with
num_workers 0, 1 and 2 at that checkout's defaults, each run between two runs of the raw gather
limit (`np.take` over the memmap on one thread per core), `--trials` times; a row's figure is
the median of its ratios to the mean of the two limit runs around it. The parent prints every
round and, per checkout, the median over rounds of the best Loader row's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

__all__ = ["main"]

ROWS = (0, 1, 2)


def child(path: str, samples: int, trials: int) -> dict[str, float]:
    """One checkout's rows in this process (run in the checkout's venv): ratio to the limit per row."""
    from bench.loader import BATCH, TIMED_EPOCHS, build, dict_size, epochs_of, rate, raw_gather, raw_gather_parallel
    from fastload.formats import FastloadDataset
    from fastload.loader import Loader
    from fastload.system import usable_cores

    ds_dir, raw = build(path, samples)
    fds = FastloadDataset(ds_dir)
    epochs, cores = TIMED_EPOCHS, usable_cores()
    limit = epochs * samples - 2 * BATCH
    for _ in raw_gather(raw, 1):  # warm the page cache once
        pass
    fds.get_batch(list(range(BATCH)))

    def loader(nw: int) -> float:
        ld = Loader(fds, batch_size=BATCH, shuffle=True, num_workers=nw, worker_type="thread", seed=0)
        try:
            return rate(epochs_of(ld, epochs), limit, dict_size)
        finally:
            ld.close()

    ratios: dict[str, list[float]] = {f"Loader nw={w}": [] for w in ROWS}
    for t in range(trials):  # each Loader row between two runs of the limit: ratios of like machine states
        for w in ROWS if t % 2 == 0 else ROWS[::-1]:
            before = raw_gather_parallel(raw, epochs, cores)
            row = loader(w)
            after = raw_gather_parallel(raw, epochs, cores)
            ratios[f"Loader nw={w}"].append(row / ((before + after) / 2))
    return {name: statistics.median(values) for name, values in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the checkout measured as 'old' (required)")
    ap.add_argument("--new", default=".", help="the checkout measured as 'new'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=4, help="paired trials per row in each child (median)")
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "fastload-bench-loader"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.path, args.samples, args.trials)))
        return 0
    if args.old is None:
        ap.error("--old is required")
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    script = os.path.abspath(__file__)
    best: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            tree = trees[name]
            argv_child = [script, "--child", "--path", args.path, "--samples", str(args.samples),
                          "--trials", str(args.trials)]
            code = f"import runpy, sys; sys.argv = {argv_child!r}; runpy.run_path({script!r}, run_name='__main__')"
            out = subprocess.run([os.path.join(tree, ".venv/bin/python"), "-c", code], cwd=tree, check=True,
                                 capture_output=True, text=True).stdout
            ratios = json.loads(out.strip().splitlines()[-1])
            top = max(ratios, key=lambda k: ratios[k])
            best[name].append(ratios[top])
            rows = ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            print(f"round {r} {name}: vs limit (median of {args.trials} paired trials): {rows}; best {top}", flush=True)
    med = {k: statistics.median(v) for k, v in best.items()}
    change = med["new"] / med["old"]
    print(f"median best Loader / limit: old {med['old']:.3f}, new {med['new']:.3f}, new/old {change:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
