"""Conversion on Ray Data (`write_ray`, `--engine ray`) and `read_ray`: same bytes as the local converter,
faults (killed worker, killed driver + resume, bad records), S3 output. One Ray session for the module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from io import BytesIO

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from s3_fixtures import moto, s3_bucket, storage_options  # noqa: E402, F401

from fastload.cli import main  # noqa: E402
from fastload.formats import FastloadDataset, write  # noqa: E402
from fastload.formats.errors import FormatError, SchemaError  # noqa: E402
from fastload.formats.sources import open_source  # noqa: E402
from fastload.formats.verify import verify_dataset  # noqa: E402

pytestmark = pytest.mark.ray

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


@pytest.fixture(scope="module")
def ray_session():
    """A 2-CPU local Ray cluster shared by the module's tests (small object store, no dashboard)."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             logging_level="WARNING", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _jsonl(path, n, *, seed=0, bad_line=None):
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for i in range(n):
            row = {"ids": rng.integers(0, 30000, int(rng.integers(1, 120))).tolist(), "label": i, "text": f"t{i}"}
            fh.write((bad_line if i == 3 and bad_line else json.dumps(row)) + "\n")
    return str(path)


def _jpeg(seed, size):
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _local(src, out, shard_size, kind=None):
    # One writer thread and no encoder processes: this process runs Ray, which must not be forked.
    source, schema, attrs = open_source(str(src), kind)
    return write(source, out, schema=schema, attrs=attrs, shard_size=shard_size, workers=1, progress=False)


def _same_files(a, b):
    names = sorted(os.listdir(os.path.join(a, "shards")))
    assert names == sorted(os.listdir(os.path.join(b, "shards")))
    for name in ["index.json", "meta.bin"] + [f"shards/{n}" for n in names]:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    return len(names)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-src")
    images = root / "images"
    for c, cls in enumerate(("cat", "dog", "eel")):
        (images / cls).mkdir(parents=True)
        for i in range(40):
            (images / cls / f"{i:03d}.jpg").write_bytes(_jpeg(c * 100 + i, (16 + i % 7, 12 + i % 5)))
    np.save(root / "x.npy", np.arange(6000 * 3, dtype=np.float32).reshape(6000, 3))
    return {"jsonl": _jsonl(root / "a.jsonl", 2500), "imagefolder": str(images), "npy": str(root / "x.npy")}


@pytest.mark.parametrize("kind, shard_size", [("jsonl", "32KiB"), ("imagefolder", "8KiB"), ("npy", "16KiB")])
def test_same_bytes_as_local_converter(ray_session, sources, tmp_path, kind, shard_size):
    from fastload.formats.ray_io import _PathSource, write_ray

    _local(sources[kind], tmp_path / "local", shard_size)
    result = write_ray(_PathSource(sources[kind], None), tmp_path / "ray", shard_size=shard_size)
    assert _same_files(tmp_path / "local", tmp_path / "ray") >= 4  # shards, meta.bin and index.json, byte for byte
    assert verify_dataset(tmp_path / "ray") == []
    assert sum(result.shards_per_node.values()) == len(result.manifest.shards) and result.kept == 0
    assert not os.path.exists(tmp_path / "ray" / ".fastload-progress.json")


def test_ray_dataset_round_trip_and_read_ray(ray_session, tmp_path):
    from fastload.formats.ray_io import read_ray, write_ray

    rows = [{"id": i, "blob": bytes([i % 251]) * (i % 37), "tokens": np.arange(i % 50, dtype=np.int64),
             "vec": np.full(4, i, np.float32), "name": f"n{i}"} for i in range(700)]
    ds = ray.data.from_items(rows, override_num_blocks=7)
    result = write_ray(ds, tmp_path / "ray", shard_size="8KiB")
    assert len(result.manifest.shards) >= 3
    # The local converter given the very rows Ray hands out writes the same files.
    write(ds.take_all(), tmp_path / "local", shard_size="8KiB", workers=1, progress=False)
    _same_files(tmp_path / "local", tmp_path / "ray")
    out = FastloadDataset(tmp_path / "ray")
    assert len(out) == len(rows)
    for i in (0, 1, 350, 699):
        got = out[i]
        assert got["id"] == i and got["blob"] == rows[i]["blob"] and got["name"] == rows[i]["name"]
        assert np.array_equal(got["tokens"], rows[i]["tokens"]) and np.array_equal(got["vec"], rows[i]["vec"])

    n = len(result.manifest.shards)
    assert read_ray(tmp_path / "ray", override_num_blocks=n).materialize().num_blocks() == n  # a task per shard
    got = read_ray(tmp_path / "ray").take_all()
    assert [r["id"] for r in got] == list(range(700))  # dataset order
    for r, want in zip(got, rows):
        assert r["blob"] == want["blob"] and r["name"] == want["name"]
        assert np.array_equal(r["tokens"], want["tokens"]) and np.array_equal(r["vec"], want["vec"])


def test_bad_record_fails_like_local_and_leaves_no_dataset(ray_session, tmp_path):
    from fastload.formats.ray_io import _PathSource, write_ray

    src = _jsonl(tmp_path / "bad.jsonl", 600, bad_line='{"ids": [1, 2], "label": "x", "text": "t"}')
    with pytest.raises(SchemaError) as local:
        _local(src, tmp_path / "local", "16KiB")
    with pytest.raises(SchemaError) as remote:
        write_ray(_PathSource(src, None), tmp_path / "ray", shard_size="16KiB")
    assert str(remote.value) == str(local.value)
    assert "sample 3" in str(remote.value) and "'label'" in str(remote.value)
    assert not os.path.exists(tmp_path / "ray" / "index.json")
    with pytest.raises((FileNotFoundError, FormatError)):
        FastloadDataset(tmp_path / "ray")


def _ray_workers(name_part):
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith("ray::") and name_part in cmd:
            out.append(p)
    return out


def test_killed_worker_is_retried_without_lost_or_doubled_samples(ray_session, sources, tmp_path):
    from fastload.formats.ray_io import _PathSource, write_ray

    _local(sources["jsonl"], tmp_path / "local", "8KiB")
    killed = []

    def killer():
        deadline = time.monotonic() + 60
        shards = tmp_path / "ray" / "shards"
        while time.monotonic() < deadline and not killed:
            if shards.is_dir() and len(os.listdir(shards)) >= 3:
                for p in _ray_workers("Write"):
                    try:
                        p.kill()
                        killed.append(p.pid)
                        break
                    except OSError:
                        pass
            time.sleep(0.01)

    t = threading.Thread(target=killer)
    t.start()
    try:
        result = write_ray(_PathSource(sources["jsonl"], None), tmp_path / "ray", shard_size="8KiB")
    finally:
        t.join()
    assert killed, "no Ray write worker was running to kill"
    assert len(result.manifest.shards) >= 50
    _same_files(tmp_path / "local", tmp_path / "ray")  # every sample once, in order
    assert not [n for n in os.listdir(tmp_path / "ray" / "shards") if ".part-" in n or n.endswith(".tmp")]


def test_driver_killed_then_resume_keeps_finished_shards(ray_session, sources, tmp_path):
    from fastload.formats.ray_io import _PathSource, write_ray

    out = tmp_path / "ray"
    _local(sources["jsonl"], tmp_path / "local", "8KiB")
    cmd = [sys.executable, "-m", "fastload.cli", "convert", sources["jsonl"], str(out), "--engine", "ray",
           "--address", ray_session, "--shard-size", "8KiB", "--quiet"]
    proc = subprocess.Popen(cmd, env={**os.environ, **RAY_ENV}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            shards = out / "shards"
            if shards.is_dir() and len([n for n in os.listdir(shards) if n.endswith(".fls")]) >= 5:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the conversion ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "index.json").exists()
    with pytest.raises(Exception, match="index.json"):
        FastloadDataset(out)
    finished = len([n for n in os.listdir(out / "shards") if n.endswith(".fls")])
    result = write_ray(_PathSource(sources["jsonl"], None), out, shard_size="8KiB", resume=True)
    assert result.kept >= min(finished, 5) - 2  # the last renames may race the kill; the rest are kept
    assert result.kept >= 1
    _same_files(tmp_path / "local", out)
    assert verify_dataset(out) == []


def test_s3_output_and_read_back(ray_session, sources, tmp_path, moto, s3_bucket):  # noqa: F811
    from fastload.dataset import open_dataset
    from fastload.formats.ray_io import _PathSource, read_ray, write_ray

    opts = storage_options(moto.endpoint)
    url = f"s3://{s3_bucket}/data/ds"
    _local(sources["jsonl"], tmp_path / "local", "32KiB")
    result = write_ray(_PathSource(sources["jsonl"], None), url, shard_size="32KiB", storage_options=opts)
    client = moto.client()
    for name in ["index.json", "meta.bin"] + [s.file for s in result.manifest.shards]:
        body = client.get_object(Bucket=s3_bucket, Key=f"data/ds/{name}")["Body"].read()
        assert body == (tmp_path / "local" / name).read_bytes(), name
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="data/ds/")["Contents"]}
    assert not [k for k in keys if ".part-" in k or "progress" in k]
    remote = open_dataset(url, storage_options=opts, cache_dir=tmp_path / "cache")
    local = FastloadDataset(tmp_path / "local")
    assert len(remote) == len(local) == 2500
    assert remote[2499]["text"] == local[2499]["text"] == "t2499"
    rows = read_ray(url, storage_options=opts).take_all()
    assert [r["label"] for r in rows] == list(range(2500))


def test_cli_engine_ray_and_overwrite_rules(ray_session, sources, tmp_path, capsys):
    out = str(tmp_path / "ray")
    args = ["convert", sources["npy"], out, "--engine", "ray", "--address", ray_session, "--shard-size", "16KiB",
            "--quiet"]
    assert main(args) == 0
    assert "shards written by tasks on 1 node," in capsys.readouterr().out
    assert main(args) == 2  # the dataset exists: refused without --overwrite
    assert "already holds a dataset" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0
    assert main(args + ["--resume"]) == 0  # finished: resume returns it as is
    assert verify_dataset(out) == []
    assert main(["convert", sources["npy"], out + "2", "--address", "x:1"]) == 2
    assert "--address needs --engine ray" in capsys.readouterr().err
    for flag in ("--on-error=skip", "--upgrade", "--no-decode-check"):  # refused, never silently ignored
        assert main(args[:-1] + [flag]) == 2
        assert f"{flag} cannot be used with --engine ray" in capsys.readouterr().err


def test_parquet_source(ray_session, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastload.formats.ray_io import convert_ray

    table = pa.table({"a": np.arange(900, dtype=np.int64), "s": [f"r{i}" for i in range(900)]})
    (tmp_path / "pq").mkdir()
    cuts = [0, 400, 430, 600, 610, 900]  # files of unequal sizes: the order must still be the files' order
    for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(table.slice(lo, hi - lo), tmp_path / "pq" / f"p{k}.parquet")
    result = convert_ray(str(tmp_path / "pq"), str(tmp_path / "out"), shard_size="8KiB")
    ds = FastloadDataset(tmp_path / "out")
    assert len(ds) == 900 and len(result.manifest.shards) >= 2
    assert [ds[i]["a"] for i in range(900)] == list(range(900)) and ds[899]["s"] == "r899"
