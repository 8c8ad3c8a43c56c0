"""Conversion benchmark: the local converter vs `--engine ray` (Ray Data) on the same inputs, same run.

    python -m bench.convert                   # demo dataset (192 MiB) + 3000-JPEG folder, 3 rounds
    python -m bench.convert --quick           # small inputs, 1 round

Inputs: the embedded default that `fastload bench` builds (its HDF5 copy, read as `--kind hdf5`) and
a folder of JPEGs (`root/<class>/<n>.jpg`). Rounds interleave the engines (local, ray, local, ...),
each conversion in a fresh process, so both pay the same start-up and neither inherits caches
from the other. Ray runs against a cluster started once here (`ray start --head --num-cpus=N --block`);
"job" time includes the driver's connect to it, "convert" time starts after the connect.
MB/s counts the bytes of the written shards. Prints a table and the arithmetic for a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


def _one(engine: str, src: str, out: str, kind: str, shard_size: str, address: str | None) -> dict[str, float]:
    """Two conversions in this process (cold: the first, warm: the second); seconds, bytes and samples."""
    t_job = time.perf_counter()
    if engine == "ray":
        import ray

        ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    times = []
    for _ in range(2):
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        if engine == "local":
            from fastload.formats import write
            from fastload.formats.sources import open_source

            source, schema, attrs = open_source(src, kind)
            manifest = write(source, out, schema=schema, attrs=attrs, shard_size=shard_size, progress=False)
        else:
            from fastload.formats.ray_io import convert_ray

            manifest = convert_ray(src, out, kind=kind, shard_size=shard_size).manifest
        times.append((t0, time.perf_counter()))
    return {"cold_s": times[0][1] - times[0][0], "job_s": times[0][1] - t_job, "warm_s": times[1][1] - times[1][0],
            "bytes": sum(s.bytes for s in manifest.shards), "samples": manifest.num_samples}


def _run(engine: str, src: str, out: str, kind: str, shard_size: str, address: str | None) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "bench.convert", "--one", engine, src, out, kind, shard_size, address or ""]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **RAY_ENV}, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{engine} conversion failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _wait_port(port: int, timeout: float = 300.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"no Ray head on 127.0.0.1:{port} after {timeout}s")


def _forget_cluster(port: int) -> None:
    """Remove Ray's pointer to our stopped cluster (`ray stop` would), so a later `ray.init()` starts afresh."""
    marker = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        with open(marker) as fh:
            stale = fh.read().strip().endswith(f":{port}")
        if stale:
            os.remove(marker)
    except OSError:
        pass


def _jpeg_folder(root: str, count: int) -> str:
    from fastload.benchmark import make_jpegs

    jpegs, _ = make_jpegs(64, seed=3, min_side=160, max_side=320)
    folder = os.path.join(root, "jpegs")
    for i in range(count):
        d = os.path.join(folder, f"class{i % 10:02d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as fh:
            fh.write(jpegs[i % len(jpegs)])
    return folder


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with `--one`, one timed conversion in this process); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--one":
        engine, src, out, kind, shard_size, address = argv[1:7]
        print(json.dumps(_one(engine, src, out, kind, shard_size, address or None)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", default="192MiB", help="demo dataset size (default 192MiB)")
    parser.add_argument("--jpegs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-size", default="16MiB")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the Ray node")
    parser.add_argument("--nodes", type=int, default=16, help="cluster size for the arithmetic")
    parser.add_argument("--total", default="1.3TB", help="dataset size for the arithmetic (decimal units)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.jpegs, args.rounds, args.shard_size = "24MiB", 400, 1, "4MiB"

    from fastload.benchmark import build
    from fastload.formats.units import parse_size

    root = tempfile.mkdtemp(prefix="fastload-bench-convert-")
    head: subprocess.Popen[bytes] | None = None
    port = 26000 + os.getpid() % 3000
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, **RAY_ENV}
    try:
        demo = build(os.path.join(root, "demo"), size=parse_size(args.size), backends=("hdf5",))
        assert demo.hdf5 is not None
        inputs = {"demo (HDF5 copy)": (demo.hdf5, "hdf5"), f"JPEG folder ({args.jpegs})": (
            _jpeg_folder(root, args.jpegs), "imagefolder")}
        # In the foreground (--block) and terminated below: `ray stop` would stop every Ray on the machine.
        head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", f"--num-cpus={args.cpus}",
                                 "--include-dashboard=false", "--disable-usage-stats", "--block"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        address = f"127.0.0.1:{port}"
        _wait_port(port)
        results: dict[str, dict[str, list[dict[str, float]]]] = {}
        for r in range(args.rounds):
            for name, (src, kind) in inputs.items():
                order = ("local", "ray") if r % 2 == 0 else ("ray", "local")
                for engine in order:
                    res = _run(engine, src, os.path.join(root, "out"), kind, args.shard_size, address)
                    results.setdefault(name, {}).setdefault(engine, []).append(res)
                    print(f"round {r + 1} {name:<22} {engine:<5} warm {res['warm_s']:.2f}s "
                          f"cold {res['cold_s']:.2f}s job {res['job_s']:.2f}s", flush=True)
    finally:
        if head is not None:
            head.terminate()
            head.wait(120)
            _forget_cluster(port)
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nshard size {args.shard_size}, {args.rounds} interleaved round(s), medians; Ray node: {args.cpus} CPUs")
    print("warm: a second conversion in the same process (Ray's workers already started); cold: the first;")
    print("job: process start to the end of the first conversion (imports, Ray connect, worker start-up)")
    head = ["input", "engine", "MB", "samples", "warm s", "MB/s", "samples/s", "cold s", "job s", "ray/local"]
    print("{:<22} {:<6} {:>7} {:>8} {:>7} {:>7} {:>10} {:>7} {:>7} {:>9}".format(*head))
    per_node = []
    for name, by_engine in results.items():
        med = {e: {k: statistics.median(x[k] for x in runs) for k in ("warm_s", "cold_s", "job_s")}
               for e, runs in by_engine.items()}
        for engine, runs in by_engine.items():
            mb, n, m = runs[0]["bytes"] / 1e6, runs[0]["samples"], med[engine]
            ratio = f"{med['local']['warm_s'] / m['warm_s']:.2f}x" if engine == "ray" else ""
            print(f"{name:<22} {engine:<6} {mb:>7.1f} {n:>8} {m['warm_s']:>7.2f} {mb / m['warm_s']:>7.1f} "
                  f"{n / m['warm_s']:>10.0f} {m['cold_s']:>7.2f} {m['job_s']:>7.2f} {ratio:>9}")
        per_node.append((name, by_engine["ray"][0]["bytes"] / 1e6 / med["ray"]["warm_s"],
                         med["ray"]["job_s"] - med["ray"]["warm_s"]))
    total = float(args.total.upper().rstrip("B").replace("T", "e12").replace("G", "e9"))
    for name, mbps, start in per_node:
        secs = total / (args.nodes * mbps * 1e6)
        print(f"{name}: Ray per node {mbps:.1f} MB/s -> {args.total} on {args.nodes} nodes = {total / 1e6:.0f} MB "
              f"/ ({args.nodes} x {mbps:.1f} MB/s) = {secs:.0f} s = {secs / 3600:.2f} h, plus ~{start:.0f} s "
              "start-up once (arithmetic, not measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
