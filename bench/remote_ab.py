"""Old vs new fastload on the remote path: alternating processes against one nginx server, one run.

Each process runs one round of `fastload.benchmark.remote.run_remote` (this tree's file, loaded by
path, so the old tree needs no copy of it) with its own raw pipeline, so every ratio pairs a Loader
epoch with a raw pass measured minutes apart at most; the two trees alternate (new, old, old, new, ...).

Run: `python -m bench.remote_ab --old-python /work/base/.venv/bin/python [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from bench.remote import Nginx, make_dataset, write_json
from fastload.formats.units import parse_size

__all__ = ["main"]

_RUNNER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("harness", sys.argv[1])
harness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness)
print("JSON" + json.dumps(harness.run_remote(sys.argv[2], rounds=1)))
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the alternating rounds; print per-round ratios to raw and the stage timings; return them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-python", required=True, help="python of the old checkout's environment")
    ap.add_argument("--new-python", default=sys.executable)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--shard-size", default="32MB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    harness = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fastload", "benchmark",
                           "remote.py")
    work = tempfile.mkdtemp(prefix="fastload-bench-ab-")
    root = os.path.join(work, "root")
    make_dataset(os.path.join(root, "ds"), shards=args.shards, shard_size=parse_size(args.shard_size))
    server = Nginx(root, work)
    url = f"{server.url}/ds"
    pythons = {"new": args.new_python, "old": args.old_python}
    out: dict[str, list[Any]] = {"new": [], "old": []}
    try:
        for r in range(args.rounds):
            for name in ("new", "old") if r % 2 == 0 else ("old", "new"):
                p = subprocess.run([pythons[name], "-W", "error::RuntimeWarning", "-c", _RUNNER, harness, url],
                                   capture_output=True, text=True, cwd=work, check=False)
                line = [x for x in p.stdout.splitlines() if x.startswith("JSON")]
                if not line:
                    raise RuntimeError(f"{name} round {r} failed:\n{p.stderr[-3000:]}")
                res = json.loads(line[0][4:])
                out[name].append(res)
                raw = res["rows"]["raw"][0]
                print(f"round {r} {name}: raw {raw / 1e6:.0f} MB/s; " + "; ".join(
                    f"{k} {v[0] / raw:.2f}x" for k, v in res["rows"].items() if k != "raw"), flush=True)
                for k, st in res["stages"].items():
                    if st and st[0]:
                        print(f"    {k}: " + " ".join(f"{s}={x:.2f}" for s, x in st[0].items()), flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
