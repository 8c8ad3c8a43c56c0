"""`fastload convert|inspect|verify`: every source kind, kill-and-resume, exit codes; LMDB/HDF5 readers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from io import BytesIO

import numpy as np
import pytest
from open_files import LISTS_OPEN_FILES, open_under

from fastload.cli import main
from fastload.formats import FastloadDataset, HDF5Dataset, LMDBDataset
from fastload.formats.jpeg_restart import add_restart_index
from fastload.formats.verify import verify_dataset


def _jpeg(seed: int, size=(24, 16)) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_convert_imagefolder(tmp_path, capsys):
    src = tmp_path / "images"
    files = {}
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(5):
            data = _jpeg(i + (10 if cls == "dog" else 0), size=(20 + i, 10 + i))
            (src / cls / f"{i}.jpg").write_bytes(data)
            files[(cls, i)] = data
    (src / "cat" / "notes.txt").write_text("ignored")
    assert main(["convert", str(src), str(tmp_path / "out"), "--quiet"]) == 0
    ds = FastloadDataset(tmp_path / "out")
    assert len(ds) == 10 and ds.attrs["classes"] == ["cat", "dog"]
    # JPEGs are stored re-encoded with restart markers (--jpeg-restart, the default; same pixels)
    assert ds[0]["image"] == add_restart_index(files[("cat", 0)]) and ds[0]["label"] == 0
    assert ds[9]["image"] == add_restart_index(files[("dog", 4)]) and ds[9]["label"] == 1
    assert ds.image_sizes("image")[9].tolist() == [14, 24]
    assert main(["inspect", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "samples   10" in out and "image" in out and "height 10..14" in out


def test_convert_npy_file_and_directory(tmp_path):
    arr = np.arange(5000 * 6, dtype=np.float32).reshape(5000, 6)
    np.save(tmp_path / "x.npy", arr)
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "a"), "--quiet", "--shard-size", "32KiB"]) == 0
    ds = FastloadDataset(tmp_path / "a")
    assert ds.num_shards > 1
    np.testing.assert_array_equal(ds.get_batch(np.arange(5000))["data"], arr)

    (tmp_path / "cols").mkdir()
    np.save(tmp_path / "cols" / "features.npy", arr)
    np.save(tmp_path / "cols" / "label.npy", np.arange(5000, dtype=np.int16))
    assert main(["convert", str(tmp_path / "cols"), str(tmp_path / "b"), "--quiet"]) == 0
    ds = FastloadDataset(tmp_path / "b")
    assert ds[4321]["label"] == 4321 and ds.schema["label"].dtype == np.int16
    np.testing.assert_array_equal(ds[4321]["features"], arr[4321])


def test_convert_jsonl_tokens(tmp_path, capsys):
    # More lines than one encoder chunk (512), so several worker processes read the file at once.
    lines = [{"input_ids": list(range(i % 50 + 1)), "text": f"doc {i}", "score": i / 2} for i in range(3000)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["convert", str(tmp_path / "d.jsonl"), str(tmp_path / "out"), "--quiet"]) == 0
    ds = FastloadDataset(tmp_path / "out")
    assert ds.schema["input_ids"].kind == "varray" and ds.schema["input_ids"].dtype == np.int32
    assert ds[123]["input_ids"].tolist() == lines[123]["input_ids"] and ds[123]["text"] == "doc 123"
    np.testing.assert_array_equal(ds.lengths("input_ids"), [i % 50 + 1 for i in range(3000)])
    assert [ds[i]["text"] for i in range(0, 3000, 7)] == [f"doc {i}" for i in range(0, 3000, 7)]
    main(["inspect", str(tmp_path / "out")])
    assert "length: min 1" in capsys.readouterr().out


def test_jsonl_type_mismatch_names_the_sample(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": "oops"}\n')
    assert main(["convert", str(tmp_path / "d.jsonl"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "sample 1, field 'input_ids'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "index.json").exists()


def _make_lmdb(path, n=200):
    import lmdb

    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"{i:08d}".encode(), bytes([i % 256]) * (i % 40 + 1))
    env.close()


def test_lmdb_reader_and_conversion(tmp_path):
    _make_lmdb(tmp_path / "db", n=1200)  # > one encoder chunk: forked workers read the environment too
    db = LMDBDataset(tmp_path / "db")
    assert len(db) == 1200 and db[7] == {"key": b"00000007", "value": bytes([7]) * 8}
    batch = db.get_batch([150, 3, 150])
    assert batch["value"].to_list() == [bytes([150]) * 31, bytes([3]) * 4, bytes([150]) * 31]
    assert db.__getitems__([3])[0] == db[3]
    assert main(["convert", str(tmp_path / "db"), str(tmp_path / "out"), "--quiet"]) == 0
    ds = FastloadDataset(tmp_path / "out")
    assert [ds[i] for i in range(1200)] == [db[i] for i in range(1200)]


def test_hdf5_reader_contiguous_chunked_vlen_and_conversion(tmp_path):
    import h5py

    n = 1000
    x = np.random.default_rng(0).random((n, 8), dtype=np.float32)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=np.arange(n), chunks=(64,), compression="gzip")
        vlen = f.create_dataset("tok", (n,), dtype=h5py.vlen_dtype(np.int32))
        for i in range(n):
            vlen[i] = np.arange(i % 7, dtype=np.int32)
    ds = HDF5Dataset(tmp_path / "d.h5")
    assert ds.direct_fields == ["x"]
    idx = [999, 3, 3, 500]
    b = ds.get_batch(idx)
    np.testing.assert_array_equal(b["x"], x[idx])
    np.testing.assert_array_equal(b["y"], np.array(idx))
    assert [len(t) for t in b["tok"].to_list()] == [i % 7 for i in idx]
    assert ds[10]["y"] == 10
    assert main(["convert", str(tmp_path / "d.h5"), str(tmp_path / "out"), "--quiet"]) == 0
    out = FastloadDataset(tmp_path / "out")
    np.testing.assert_array_equal(out.get_batch(np.arange(n))["x"], x)
    assert out[999]["tok"].tolist() == list(range(999 % 7))


def test_hdf5_close_unmaps_and_a_later_read_reopens(tmp_path):
    """`HDF5Dataset.close()` closes the file and unmaps it (its pages can be evicted: what the
    benchmarks' cold reads rely on); a read after it opens them again, byte for byte."""
    import h5py
    if not LISTS_OPEN_FILES:
        pytest.skip("needs /proc/self/fd and /proc/self/maps")
    path = str(tmp_path / "d.h5")
    x = np.random.default_rng(0).integers(0, 255, (300, 8), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x)  # contiguous: mapped
        f.create_dataset("y", data=np.arange(300), chunks=(32,))  # chunked, unfiltered: mapped whole
        f.create_dataset("z", data=np.arange(300) * 3, chunks=(32,), compression="gzip")  # read by h5py

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith(path) for line in maps)

    ds = HDF5Dataset(path)
    idx = [299, 0, 17, 17]
    for _ in range(2):  # the second time after close(): opened and mapped again
        b = ds.get_batch(idx)
        np.testing.assert_array_equal(b["x"], x[idx])
        np.testing.assert_array_equal(b["y"], np.array(idx))
        np.testing.assert_array_equal(b["z"], np.array(idx) * 3)
        assert mapped() and open_under(path)
        del b
        ds.close()
        assert not open_under(path) and not mapped()


def test_verify_exit_codes(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((3000, 100), np.uint8))
    main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "ds"), "--quiet", "--shard-size", "64KiB"])
    assert main(["verify", str(tmp_path / "ds")]) == 0
    shards = sorted((tmp_path / "ds" / "shards").iterdir())
    for bad in (shards[1], shards[3]):
        raw = bytearray(bad.read_bytes())
        raw[-200] ^= 1
        bad.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "ds")]) == 1
    err = capsys.readouterr().err
    assert shards[1].name in err and shards[3].name in err and shards[0].name not in err


def test_cli_errors_exit_nonzero(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--kind", "imagefolder"]) == 2
    assert "no images found" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "empty")]) == 1
    with pytest.raises(SystemExit):
        main(["convert"])


_SLOW_SOURCE = """
import sys, time, numpy as np
from fastload.formats import write
class Slow:
    def __len__(self): return 6000
    def __getitem__(self, i):
        if i % 50 == 0: time.sleep(0.02)
        return {"x": np.full(64, i % 251, np.uint8), "t": np.arange(i % 13, dtype=np.int32).tolist()}
write(Slow(), sys.argv[1], shard_size=16384, workers=2, resume=len(sys.argv) > 2, progress=False)
"""


def test_kill_and_resume_gives_identical_output(tmp_path):
    script = tmp_path / "convert.py"
    script.write_text(_SLOW_SOURCE)
    subprocess.run([sys.executable, str(script), str(tmp_path / "ref")], check=True, timeout=120)
    total = len(os.listdir(tmp_path / "ref" / "shards"))
    assert total > 20
    for finished in (0, 1, total // 2):  # kill before any shard, after the first, half-way
        out = tmp_path / f"killed-{finished}"
        proc = subprocess.Popen([sys.executable, str(script), str(out)], start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            done = [f for f in os.listdir(out / "shards") if f.endswith(".fls")] if (out / "shards").exists() else []
            if (out / "shards").exists() and len(done) >= finished:
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert not (out / "index.json").exists(), "a killed conversion must not look complete"
        with pytest.raises(Exception, match="no manifest"):
            FastloadDataset(out)
        subprocess.run([sys.executable, str(script), str(out), "--resume"], check=True, timeout=120)
        assert verify_dataset(out) == []
        for name in ["index.json", "meta.bin", "blocks.bin",
                     *(f"shards/{f}" for f in os.listdir(tmp_path / "ref" / "shards"))]:
            assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
        assert sorted(os.listdir(out / "shards")) == sorted(os.listdir(tmp_path / "ref" / "shards"))
