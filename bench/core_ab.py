"""Two checkouts of fastload, same Loader rows, interleaved: the best Loader row's ratio to the raw gather limit.

    python -m bench.core_ab --old /work/base [--new .] [--rounds 3] [--trials 2] [--samples 200000]

Each round runs one child process per checkout (the order alternating between rounds), each
with its own checkout's venv (`<tree>/.venv/bin/python`, the tree as working directory). A
child measures, on `bench.loader`'s dataset (200k x 3 KiB records, batch 256, 3 passes per row,
cached under --path), the raw gather limit (the faster of `np.take` on one thread per core and
`torch.index_select` on torch's intra-op threads) and `fastload.Loader(seed=0, shuffle=True,
worker_type="thread")` with num_workers 0, 1 and 2 at each checkout's defaults, best of
`--trials`; it prints each row's ratio to that child's limit. The parent prints every round and
the median per checkout of the best Loader row's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

__all__ = ["main"]

ROWS = (0, 1, 2)


def child(path: str, samples: int, trials: int) -> dict[str, float]:
    """One checkout's rows in this process (run in the checkout's venv): samples/s per row."""
    from bench.loader import (
        BATCH,
        TIMED_EPOCHS,
        build,
        dict_size,
        epochs_of,
        rate,
        raw_gather,
        raw_gather_parallel,
        raw_torch_gather,
    )
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

    rows: dict[str, Any] = {
        "raw np.take": lambda: raw_gather_parallel(raw, epochs, cores),
        "raw index_select": lambda: rate(raw_torch_gather(raw, epochs), limit, len),
        **{f"Loader nw={w}": (lambda w=w: loader(w)) for w in ROWS},
    }
    best: dict[str, float] = {}
    for t in range(trials):
        for name in list(rows) if t % 2 == 0 else list(rows)[::-1]:
            best[name] = max(best.get(name, 0.0), rows[name]())
    best["limit"] = max(best["raw np.take"], best["raw index_select"])
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the checkout measured as 'old' (required)")
    ap.add_argument("--new", default=".", help="the checkout measured as 'new'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=2)
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
            res = json.loads(out.strip().splitlines()[-1])
            ratios = {k: v / res["limit"] for k, v in res.items() if k.startswith("Loader")}
            top = max(ratios, key=lambda k: ratios[k])
            best[name].append(ratios[top])
            rows = ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            print(f"round {r} {name}: limit {res['limit']:,.0f}/s; vs limit: {rows}; best {top} {ratios[top]:.3f}",
                  flush=True)
    med = {k: statistics.median(v) for k, v in best.items()}
    change = med["new"] / med["old"]
    print(f"median best Loader / limit: old {med['old']:.3f}, new {med['new']:.3f}, new/old {change:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
