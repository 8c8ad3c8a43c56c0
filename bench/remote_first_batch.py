"""Time to the first batch of a cold epoch of a remote dataset, with shards read while they arrive
(the default) and with every shard awaited whole (`arriving_min_bytes=None`), in alternating rounds.

Writes `--shards` shards of `--shard-size` (8 KiB records and a label, as `bench.remote`), serves
them with nginx on 127.0.0.1 and, per round and mode, opens the dataset with an empty cache (page
cache recycled first, as `bench.remote` does), times the open and the first batch of a Loader
(`num_workers=0`, shuffled by `ShardWindowSampler` and sequential; the modes' order alternates by
round), then drains the epoch (so no download runs into the next pass), timing it too with this
process's user CPU and the MB readers' own GETs fetched ahead of the downloads. Also per round:
one 64 KiB ranged GET of a shard (obstore), the bound's other part. Prints medians and ranges over
the rounds.

Run: `python -m bench.remote_first_batch [--shards 3 --shard-size 256MB --rounds 5]`; on code
without `arriving_min_bytes` only the whole mode runs.
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from bench.remote import Nginx, make_dataset, write_json
from fastload.formats import FastloadDataset
from fastload.formats.units import parse_size
from fastload.remote.storage import RemoteStorage

__all__ = ["main"]


def _modes() -> dict[str, dict[str, Any]]:
    """The storage settings compared: shards read while they arrive or whole, and (where this tree has it)
    arriving with obstore receiving the bodies (`transport="obstore-stream"`)."""
    from fastload.remote.transport_obstore import TRANSPORTS

    if "arriving_min_bytes" not in inspect.signature(RemoteStorage).parameters:
        return {"whole": {}}
    modes: dict[str, dict[str, Any]] = {"arriving": {}, "whole": {"arriving_min_bytes": None}}
    if "obstore-stream" in TRANSPORTS:
        modes["arriving-stream"] = {"transport": "obstore-stream"}
    return modes


def _first_batch(url: str, cache: str, kw: dict[str, Any], *, shuffled: bool, batch_size: int) -> dict[str, float]:
    """On an empty cache: seconds to open the dataset (`open`), from the epoch's start to its first batch
    (`first batch`) and to its end (`epoch`), this process's user CPU seconds over the epoch (`user
    CPU`), and MB readers' own GETs fetched ahead of the downloads (`side MB`; the downloads skip them)."""
    from fastload.loader import Loader
    from fastload.order.shard_shuffle import ShardWindowSampler

    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    storage = RemoteStorage(url, cache_dir=cache, **kw)
    ds = FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)
    opened = time.perf_counter() - t0
    sampler = ShardWindowSampler.from_dataset(ds, window=2, seed=0) if shuffled else None
    loader = Loader(ds, batch_size=batch_size, sampler=sampler, num_workers=0)
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    first = 0.0
    n = 0
    for batch in loader:
        if not n:
            first = time.perf_counter() - t0
        n += len(batch["label"])
    took = time.perf_counter() - t0
    user = resource.getrusage(resource.RUSAGE_SELF).ru_utime - c0
    if n != len(ds):
        raise RuntimeError(f"epoch saw {n} samples of {len(ds)}")
    side = storage.stats().get("remote_side_bytes", 0.0) / 1e6
    loader.close()
    ds.close()
    storage.close()
    return {"open": opened, "first batch": first, "epoch": took, "user CPU": user, "side MB": side}


def _block_get_s(url: str, name: str) -> float:
    """Seconds for one 64 KiB ranged GET of `name` through obstore (a fresh client: connection included)."""
    import obstore
    from obstore.store import from_url

    store = from_url(url, client_options={"allow_http": True})
    t0 = time.perf_counter()
    data = obstore.get_range(store, name, start=0, end=64 << 10)
    took = time.perf_counter() - t0
    assert len(data) == 64 << 10
    return took


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the rounds, print the medians; returns the results."""
    from fastload.benchmark.limits import recycle_page_cache

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--shard-size", default="256MB")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="fastload-bench-first-")
    root = os.path.join(work, "root")
    res: dict[str, list[float]] = {}
    try:
        make_dataset(os.path.join(root, "ds"), shards=args.shards, shard_size=parse_size(args.shard_size))
        local = FastloadDataset(os.path.join(root, "ds"))
        nbytes = sum(s.bytes for s in local.manifest.shards)
        server = Nginx(root, work)
        url = f"{server.url}/ds"
        try:
            for r in range(args.rounds):
                res.setdefault("block GET", []).append(_block_get_s(url, local.manifest.shards[0].file))
                modes = list(_modes().items())
                for order in ("sequential", "shuffled"):
                    for mode, kw in modes[:: 1 if r % 2 else -1]:  # alternating which mode goes first
                        recycle_page_cache(work, nbytes)
                        got = _first_batch(url, os.path.join(work, "cache"), kw,
                                           shuffled=order == "shuffled", batch_size=args.batch_size)
                        for what, value in got.items():
                            res.setdefault(f"{mode} {order} {what}", []).append(value)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.shards} shards of {args.shard_size}, {nbytes / 1e6:.0f} MB, nginx on 127.0.0.1, "
          f"{args.rounds} rounds: median [min, max] seconds")
    for key, vals in res.items():
        print(f"{key:32s} {np.median(vals):8.4f}  [{min(vals):.4f}, {max(vals):.4f}]")
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
