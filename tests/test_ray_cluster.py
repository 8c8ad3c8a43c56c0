"""`fastload convert --engine ray` on a real two-node Ray cluster on this machine (two raylets), and
packaging: nothing imports Ray unless asked, and a clear error names the extra when Ray is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from fastload.formats import write
from fastload.formats.sources import open_source
from fastload.formats.verify import verify_dataset

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_nodes(ray_bin, port, count, env, timeout=120.0):
    """Until `count` nodes are alive in the cluster at 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    # Cheap first: the raylets' processes exist (a `ray status` call costs a Python start-up each).
    def raylets():
        return sum("raylet" in " ".join(p.info["cmdline"] or []) for p in _processes_of(port))

    while time.monotonic() < deadline and raylets() < count:
        time.sleep(0.2)
    while time.monotonic() < deadline:
        res = subprocess.run([ray_bin, "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True,
                             text=True, timeout=60)
        active = res.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in res.stdout else ""
        if active.count("node_") >= count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the Ray cluster on port {port} has fewer than {count} nodes after {timeout}s")


def _forget_cluster(port):
    """Remove Ray's pointer to the stopped test cluster (what `ray stop` does), so `ray.init()` starts afresh."""
    marker = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        with open(marker) as fh:
            if fh.read().strip().endswith(f":{port}"):
                os.remove(marker)
    except OSError:
        pass


def _processes_of(port):
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if f"{port}" in " ".join(p.info["cmdline"] or []) and "ray" in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.ray
def test_two_raylets_write_shards_byte_identical_to_local(tmp_path):
    pytest.importorskip("ray")
    rng = np.random.default_rng(1)
    src = tmp_path / "a.jsonl"
    with open(src, "w") as fh:
        for i in range(1500):
            fh.write(json.dumps({"ids": rng.integers(0, 9, int(rng.integers(1, 90))).tolist(), "label": i}) + "\n")
    source, schema, attrs = open_source(str(src))
    write(source, tmp_path / "local", schema=schema, attrs=attrs, shard_size="16KiB", progress=False)

    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, **RAY_ENV}
    port = _free_port()
    small = ["--num-cpus=1", "--object-store-memory=78643200", "--block"]
    # `ray start --block` in the foreground, one per node, each terminated by this test: it stops that
    # node's processes (`ray stop` would stop every Ray process on the machine, other users' too).
    nodes = [subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false",
                               "--disable-usage-stats", *small], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_nodes(ray_bin, port, 1, env)
        nodes.append(subprocess.Popen([ray_bin, "start", f"--address=127.0.0.1:{port}", *small], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_nodes(ray_bin, port, 2, env)
        out = subprocess.run(
            [sys.executable, "-m", "fastload.cli", "convert", str(src), str(tmp_path / "ray"), "--engine", "ray",
             "--address", f"127.0.0.1:{port}", "--shard-size", "16KiB", "--quiet"],
            env=env, capture_output=True, text=True, timeout=240,
        )
    finally:
        for node in reversed(nodes):
            node.terminate()
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        for proc in _processes_of(port):
            proc.kill()
        _forget_cluster(port)
    assert not _processes_of(port), "Ray processes of the test cluster outlived it"
    assert out.returncode == 0, out.stderr[-3000:]
    assert "written by tasks on 2 nodes," in out.stdout, out.stdout
    names = sorted(os.listdir(tmp_path / "local" / "shards"))
    assert len(names) >= 4 and names == sorted(os.listdir(tmp_path / "ray" / "shards"))
    for name in ["index.json", "meta.bin"] + [f"shards/{n}" for n in names]:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes(), name
    assert verify_dataset(tmp_path / "ray") == []


def test_ray_is_imported_only_when_used_and_missing_ray_names_the_extra():
    code = """
import sys
import fastload, fastload.formats, fastload.cli
fastload.cli.build_parser()
assert "ray" not in sys.modules, "importing fastload imported ray"
sys.modules["ray"] = None  # as if Ray were not installed
try:
    fastload.formats.write_ray
except ImportError as exc:
    assert "pip install 'fastload[ray]'" in str(exc), exc
else:
    raise AssertionError("no ImportError without ray")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
