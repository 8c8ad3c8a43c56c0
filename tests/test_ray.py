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

from ray_fixtures import RAY_ENV, local_ray  # noqa: E402
from s3_fixtures import moto, s3_bucket, storage_options  # noqa: E402, F401

from fastload.cli import main  # noqa: E402
from fastload.formats import FastloadDataset, write  # noqa: E402
from fastload.formats.errors import FormatError, SchemaError  # noqa: E402
from fastload.formats.sources import open_source  # noqa: E402
from fastload.formats.verify import verify_dataset  # noqa: E402

pytestmark = pytest.mark.ray

@pytest.fixture(scope="module")
def ray_session():
    """A 2-CPU local Ray cluster shared by the module's tests (`ray_fixtures.local_ray`)."""
    with local_ray() as address:
        yield address


def _jsonl(path, n, *, seed=0, bad_line=None, bad=None):
    """`n` JSON lines; line 4 is `bad_line` when given, and line i+1 is `bad[i]` for each i in `bad`."""
    rng = np.random.default_rng(seed)
    bad = {3: bad_line} if bad_line else dict(bad or {})
    with open(path, "w") as fh:
        for i in range(n):
            row = {"ids": rng.integers(0, 30000, int(rng.integers(1, 120))).tolist(), "label": i, "text": f"t{i}"}
            fh.write(bad.get(i, json.dumps(row)) + "\n")
    return str(path)


UNREADABLE = {3: "{oops", 700: "[1, 2]", 701: "{", 2300: "not json"}  # inputs --on-error=skip leaves out


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


def _same_files(a, b, *extra):
    """The shards, meta.bin, blocks.bin, index.json and `extra` files of two datasets are byte-identical."""
    names = sorted(os.listdir(os.path.join(a, "shards")))
    assert names == sorted(os.listdir(os.path.join(b, "shards")))
    for name in ["index.json", "meta.bin", "blocks.bin", *extra] + [f"shards/{n}" for n in names]:
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
    return {"jsonl": _jsonl(root / "a.jsonl", 2500), "imagefolder": str(images), "npy": str(root / "x.npy"),
            "unreadable": _jsonl(root / "bad.jsonl", 2500, bad=UNREADABLE), "small": _jsonl(root / "s.jsonl", 600)}


def _convert(capsys, src, out, *flags, ray_address=None):
    """`fastload convert` through the CLI: (exit status, stdout, stderr); local runs use one process."""
    engine = ["--engine", "ray", "--address", ray_address] if ray_address else ["--workers", "1"]
    code = main(["convert", str(src), str(out), "--quiet", *engine, *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _said(err, out):
    """fastload's own stderr lines (Ray logs its own there too), with the output path as OUT."""
    return [ln.replace(str(out), "OUT") for ln in err.splitlines() if ln.startswith(("skipped ", "fastload convert:"))]


def _local_skip_reference(capsys, src, out, *flags):
    code, _, err = _convert(capsys, src, out, "--on-error=skip", *flags)
    assert code == 0, err
    return err


@pytest.mark.parametrize("kind, shard_size", [("jsonl", "32KiB"), ("imagefolder", "8KiB"), ("npy", "16KiB")])
def test_same_bytes_as_local_converter(ray_session, sources, tmp_path, kind, shard_size):
    from fastload.formats.ray_io import PathSource, write_ray

    _local(sources[kind], tmp_path / "local", shard_size)
    result = write_ray(PathSource(sources[kind], None), tmp_path / "ray", shard_size=shard_size)
    assert _same_files(tmp_path / "local", tmp_path / "ray") >= 4  # shards, meta.bin and index.json, byte for byte
    assert verify_dataset(tmp_path / "ray") == []
    assert sum(result.shards_per_node.values()) == len(result.manifest.shards) and result.kept == 0
    assert not os.path.exists(tmp_path / "ray" / ".fastload-progress.json")


def test_ray_dataset_round_trip_and_read_ray(ray_session, tmp_path):
    from fastload import read_ray
    from fastload.formats.ray_io import write_ray

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
    from fastload.formats.ray_io import PathSource, write_ray

    src = _jsonl(tmp_path / "bad.jsonl", 600, bad_line='{"ids": [1, 2], "label": "x", "text": "t"}')
    with pytest.raises(SchemaError) as local:
        _local(src, tmp_path / "local", "16KiB")
    with pytest.raises(SchemaError) as remote:
        write_ray(PathSource(src, None), tmp_path / "ray", shard_size="16KiB")
    assert str(remote.value) == str(local.value)
    assert "sample 3" in str(remote.value) and "'label'" in str(remote.value)
    assert not os.path.exists(tmp_path / "ray" / "index.json")
    with pytest.raises((FileNotFoundError, FormatError)):
        FastloadDataset(tmp_path / "ray")


def _ray_workers(name_part):
    """Ray workers of this test process's own cluster (its descendants: other users' Ray jobs are left alone)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith("ray::") and name_part in cmd:
            out.append(p)
    return out


def test_killed_worker_is_retried_without_lost_or_doubled_samples(ray_session, sources, tmp_path):
    from fastload.formats.ray_io import PathSource, write_ray

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
        result = write_ray(PathSource(sources["jsonl"], None), tmp_path / "ray", shard_size="8KiB")
    finally:
        t.join()
    assert killed, "no Ray write worker was running to kill"
    assert len(result.manifest.shards) >= 50
    _same_files(tmp_path / "local", tmp_path / "ray")  # every sample once, in order
    assert not [n for n in os.listdir(tmp_path / "ray" / "shards") if ".part-" in n or n.endswith(".tmp")]


def _finished_shards(out):
    """{name: (inode, mtime_ns)} of the finished shards in `out`, once no Ray task renames any more."""
    last, stable_since, deadline = None, time.monotonic(), time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {e.name: (e.inode(), e.stat().st_mtime_ns) for e in os.scandir(out / "shards") if e.name.endswith(".fls")}
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 3.0:  # the killed job's tasks are gone (Ray ends them)
            return now
        time.sleep(0.1)
    raise AssertionError("shards kept appearing after the driver was killed")


def test_cli_driver_killed_then_cli_resume_keeps_finished_shards(ray_session, sources, tmp_path, capsys):
    """SIGKILL a `fastload convert --engine ray --on-error=skip` mid-job, then run the same command with
    --resume: the shards finished before the kill stay untouched (same inode and mtime), the rest are
    written, and the result (report included) is byte-identical to a local conversion."""
    out, flags = tmp_path / "ray", ["--shard-size", "8KiB", "--on-error=skip"]
    expected_err = _local_skip_reference(capsys, sources["unreadable"], tmp_path / "local", *flags)
    cmd = [sys.executable, "-m", "fastload.cli", "convert", sources["unreadable"], str(out), "--quiet",
           "--engine", "ray", "--address", ray_session, *flags]
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
    finished = _finished_shards(out)
    assert len(finished) >= 5
    code, stdout, err = _convert(capsys, sources["unreadable"], out, *flags, "--resume", ray_address=ray_session)
    assert code == 0, err
    assert f", {len(finished)} kept from the interrupted run" in stdout
    after = {e.name: (e.inode(), e.stat().st_mtime_ns) for e in os.scandir(out / "shards")}
    assert {name: after[name] for name in finished} == finished  # not rewritten, not replaced
    assert len(after) > len(finished)
    _same_files(tmp_path / "local", out, "skipped-inputs.jsonl")
    assert _said(err, out) == _said(expected_err, tmp_path / "local") != []
    assert verify_dataset(out) == []


def test_s3_output_and_read_back(ray_session, sources, tmp_path, moto, s3_bucket):  # noqa: F811
    from fastload import read_ray
    from fastload.dataset import open_dataset
    from fastload.formats.ray_io import PathSource, write_ray

    opts = storage_options(moto.endpoint)
    url = f"s3://{s3_bucket}/data/ds"
    _local(sources["small"], tmp_path / "local", "8KiB")
    result = write_ray(PathSource(sources["small"], None), url, shard_size="8KiB", storage_options=opts)
    client = moto.client()
    for name in ["index.json", "meta.bin", "blocks.bin"] + [s.file for s in result.manifest.shards]:
        body = client.get_object(Bucket=s3_bucket, Key=f"data/ds/{name}")["Body"].read()
        assert body == (tmp_path / "local" / name).read_bytes(), name
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="data/ds/")["Contents"]}
    assert not [k for k in keys if ".part-" in k or "progress" in k]
    remote = open_dataset(url, storage_options=opts, cache_dir=tmp_path / "cache")
    local = FastloadDataset(tmp_path / "local")
    assert len(remote) == len(local) == 600 and len(result.manifest.shards) >= 3
    assert remote[599]["text"] == local[599]["text"] == "t599"
    rows = read_ray(url, storage_options=opts).take_all()
    assert [r["label"] for r in rows] == list(range(600))


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
    assert main(args + ["--on-error=skip", "--overwrite"]) == 2  # as locally: npy has no per-input reads
    assert "--on-error=skip applies to per-input sources, not " in capsys.readouterr().err


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


def test_on_error_skip_same_shards_and_report_as_local(ray_session, sources, tmp_path, capsys):
    flags = ["--shard-size", "8KiB"]
    expected_err = _local_skip_reference(capsys, sources["unreadable"], tmp_path / "local", *flags)
    code, _, err = _convert(capsys, sources["unreadable"], tmp_path / "ray", "--on-error=skip", *flags,
                            ray_address=ray_session)
    assert code == 0, err
    assert _same_files(tmp_path / "local", tmp_path / "ray", "skipped-inputs.jsonl") >= 20
    report = [json.loads(line) for line in (tmp_path / "ray" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == [f"{sources['unreadable']}:{i + 1}" for i in UNREADABLE]  # FILE:LINE
    assert "is not valid JSON" in report[0]["reason"] and "not a JSON object" in report[1]["reason"]
    assert _said(err, tmp_path / "ray") == _said(expected_err, tmp_path / "local") != []
    assert "skipped 4 input(s) that failed to read" in err
    assert len(FastloadDataset(tmp_path / "ray")) == 2500 - len(UNREADABLE)


def test_on_error_skip_then_a_bad_field_stops_with_the_local_error(ray_session, tmp_path, capsys):
    # Lines that do not read are left out; a line that reads but does not fit the schema stops both
    # engines, named by its position among the samples kept (here 1 before it is left out).
    src = _jsonl(tmp_path / "a.jsonl", 1500, bad={2: "{", 1200: '{"ids": [1], "label": "x", "text": "t"}'})
    local = _convert(capsys, src, tmp_path / "local", "--on-error=skip", "--shard-size", "8KiB")
    remote = _convert(capsys, src, tmp_path / "ray", "--on-error=skip", "--shard-size", "8KiB",
                      ray_address=ray_session)
    assert local[0] == remote[0] == 2
    # The local engine has written shards by then and adds how to continue; Ray stops in its plan
    # pass, before any shard exists: the error itself is the same.
    local_said = [ln.split("; OUT is an incomplete conversion")[0] for ln in _said(local[2], tmp_path / "local")]
    assert _said(remote[2], tmp_path / "ray") == local_said != []
    assert "continue with: " in local[2]
    assert "sample 1199" in remote[2] and "'label'" in remote[2]
    assert not (tmp_path / "ray" / "index.json").exists()


def test_image_folder_skip_and_no_decode_check_as_local(ray_session, tmp_path, capsys):
    images = tmp_path / "images"
    for c, cls in enumerate(("ant", "bee")):
        (images / cls).mkdir(parents=True)
        for i in range(30):
            (images / cls / f"{i:03d}.jpg").write_bytes(_jpeg(c * 100 + i, (20, 16)))
    whole = (images / "ant" / "004.jpg").read_bytes()
    (images / "ant" / "004.jpg").write_bytes(whole[:-40])  # truncated: its header is intact
    (images / "bee" / "017.jpg").write_bytes(b"not an image at all")
    for name, flags in (("checked", []), ("unchecked", ["--no-decode-check"])):
        flags = ["--shard-size", "8KiB", *flags]
        expected_err = _local_skip_reference(capsys, images, tmp_path / f"local-{name}", *flags)
        code, _, err = _convert(capsys, images, tmp_path / name, "--on-error=skip", *flags, ray_address=ray_session)
        assert code == 0, err
        assert _same_files(tmp_path / f"local-{name}", tmp_path / name, "skipped-inputs.jsonl") >= 3
        assert _said(err, tmp_path / name) == _said(expected_err, tmp_path / f"local-{name}") != []
        report = [json.loads(line) for line in (tmp_path / name / "skipped-inputs.jsonl").open()]
        truncated = [str(images / "ant" / "004.jpg")] if name == "checked" else []
        assert [r["input"] for r in report] == truncated + [str(images / "bee" / "017.jpg")]
        assert report[-1]["reason"].endswith("image (not in any image format PIL reads)")  # no memory address
    assert len(FastloadDataset(tmp_path / "unchecked")) == len(FastloadDataset(tmp_path / "checked")) + 1


def _new_kind_source(root, kind):
    """A small input of each newer local-converter source kind: (SRC, extra CLI flags)."""
    rng = np.random.default_rng(7)
    src = root / kind
    src.mkdir()
    if kind == "npyfiles":  # one sample per file, shapes differ (a vndarray field), meta.json into attrs
        for i in range(60):
            np.save(src / f"u{i:03d}.npy", rng.standard_normal((int(rng.integers(1, 20)), 6)).astype(np.float32))
        (src / "meta.json").write_text(json.dumps({"sample_rate": 16000}))
    elif kind == "tokens":
        np.save(src / "tokens.npy", rng.integers(0, 50000, 20000).astype(np.uint16))
        np.save(src / "offsets.npy", np.concatenate([[0], np.sort(rng.integers(0, 20000, 299)), [20000]]))
    elif kind == "megatron":
        from test_sources import _megatron

        _megatron(src / "corpus", [rng.integers(0, 60000, int(rng.integers(1, 90))) for _ in range(300)], 8, np.uint16)
        return src / "corpus", []
    else:  # an image folder labelled by labels.csv inside it, or by a labels file passed with --labels
        (src / "sub").mkdir()
        names = [f"{'sub/' if i % 3 == 0 else ''}{i:03d}.jpg" for i in range(40)]
        for i, n in enumerate(names):
            (src / n).write_bytes(_jpeg(i, (16 + i % 5, 12)))
        if kind == "labels.csv":
            (src / "labels.csv").write_text("file,label\n" + "".join(f"{n},{['cat', 'dog', 'eel'][i % 3]}\n"
                                                                     for i, n in enumerate(names)))
            return src, []
        (root / "labels.json").write_text(json.dumps({n: i % 4 for i, n in enumerate(names)}))
        return src, ["--labels", str(root / "labels.json")]
    return src, []


@pytest.mark.parametrize("kind", ["npyfiles", "tokens", "megatron", "labels.csv", "--labels"])
def test_new_source_kinds_same_bytes_as_local(ray_session, tmp_path, capsys, kind):
    src, flags = _new_kind_source(tmp_path, kind)
    flags += ["--shard-size", "4KiB"]
    assert _convert(capsys, src, tmp_path / "local", *flags)[0] == 0
    code, out, err = _convert(capsys, src, tmp_path / "ray", *flags, ray_address=ray_session)
    assert code == 0, err
    assert "shards written by tasks on 1 node" in out
    assert _same_files(tmp_path / "local", tmp_path / "ray") >= 3  # 3+ shards, meta.bin, index.json: same bytes
    assert verify_dataset(tmp_path / "ray") == []
    ds = FastloadDataset(tmp_path / "ray")
    if kind == "npyfiles":
        assert ds.schema["data"].kind == "vndarray" and ds.attrs["meta"] == {"sample_rate": 16000}
    if kind == "labels.csv":
        assert ds.attrs["classes"] == ["cat", "dog", "eel"]
    if kind == "--labels":  # files in sorted order, each with its label from the file
        table = json.loads((tmp_path / "labels.json").read_text())
        assert [ds[i]["label"] for i in range(len(ds))] == [table[n] for n in sorted(table)]


@pytest.mark.filterwarnings("ignore:.*version-1")
def test_upgrade_same_bytes_as_local(ray_session, sources, tmp_path, capsys):
    from test_integrity import _downgrade_to_v1

    _local(sources["small"], tmp_path / "v2", "8KiB")
    _downgrade_to_v1(tmp_path / "v2", tmp_path / "v1")
    flags = ["--upgrade", "--shard-size", "8KiB"]
    assert _convert(capsys, tmp_path / "v1", tmp_path / "local", *flags)[0] == 0
    code, _, err = _convert(capsys, tmp_path / "v1", tmp_path / "ray", *flags, ray_address=ray_session)
    assert code == 0, err
    assert _same_files(tmp_path / "local", tmp_path / "ray") >= 4
    assert verify_dataset(tmp_path / "ray") == []
