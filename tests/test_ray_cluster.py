"""`fastload convert --engine ray` on a real two-node Ray cluster on this machine (two raylets), and
packaging: nothing imports Ray unless asked, and a clear error names the extra when Ray is missing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from ray_fixtures import RAY_ENV

from fastload.formats import write
from fastload.formats.sources import open_source
from fastload.formats.verify import verify_dataset


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _stop(nodes, port):
    """SIGKILL every process of the test cluster: the `ray start` processes' groups, then whatever they
    started outside them (workers), and wait for each; Ray's pointer to the cluster goes too."""
    import psutil

    procs = []
    for node in nodes:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs += [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
    for proc in procs + _processes_of(port):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)
    for node in nodes:
        node.wait(30)
    _forget_cluster(port)
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.ray
def test_two_raylets_write_shards_byte_identical_to_local(tmp_path, monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    from fastload.cli import main

    rng = np.random.default_rng(1)
    src = tmp_path / "a.jsonl"
    with open(src, "w") as fh:
        for i in range(1500):
            fh.write(json.dumps({"ids": rng.integers(0, 9, int(rng.integers(1, 90))).tolist(), "label": i}) + "\n")
    source, schema, attrs = open_source(str(src))
    write(source, tmp_path / "local", schema=schema, attrs=attrs, shard_size="16KiB", progress=False)

    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    port = _free_port()
    # This interpreter runs the nodes (so their workers import this checkout's fastload, whatever the
    # `ray` script's shebang says); both nodes start at once, the second waits for the head itself.
    ray_start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--num-cpus=1",
                 "--object-store-memory=78643200", "--block"]
    head = [*ray_start, "--head", f"--port={port}", "--include-dashboard=false", "--disable-usage-stats"]
    nodes = [subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for cmd in (head, [*ray_start, f"--address=127.0.0.1:{port}"])]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                ray.init(address=f"127.0.0.1:{port}", logging_level="WARNING", log_to_driver=False)
                break
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, "the second Ray node did not join"
            time.sleep(0.2)
        code = main(["convert", str(src), str(tmp_path / "ray"), "--engine", "ray", "--address",
                     f"127.0.0.1:{port}", "--shard-size", "16KiB", "--quiet"])
        out = capsys.readouterr()
    finally:
        ray.shutdown()
        left = _stop(nodes, port)
    assert not left and not _processes_of(port), "Ray processes of the test cluster outlived it"
    assert code == 0, out.err[-3000:]
    assert "written by tasks on 2 nodes," in out.out, out.out
    names = sorted(os.listdir(tmp_path / "local" / "shards"))
    assert len(names) >= 4 and names == sorted(os.listdir(tmp_path / "ray" / "shards"))
    for name in ["index.json", "meta.bin", "blocks.bin"] + [f"shards/{n}" for n in names]:
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
