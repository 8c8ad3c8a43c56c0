"""`fastload convert` from LitData optimized chunks (written by `litdata.optimize`) and Grain's
ArrayRecord files (written by `array_record`'s writer): sample for sample against each format's own
reader, deterministic for any worker count, resumable, corrupt inputs named and skipped."""

from __future__ import annotations

import glob
import json
import os
import sys
import textwrap
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest

from fastload.cli import main
from fastload.formats import FastloadDataset, FormatError
from fastload.formats.array_record_source import ArrayRecordFiles
from fastload.formats.litdata_chunks import LitDataChunks
from fastload.formats.sources import detect_kind

N = 80


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(p, root): Path(p).read_bytes()
            for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p)}


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buf = BytesIO()
    Image.new("RGB", (8 + i % 3, 6), (i * 5 % 256, 10, 20)).save(buf, format="JPEG")
    return buf.getvalue()


def _lit_sample(i: int) -> dict:
    """One sample of every data format `optimize` infers that fastload reads."""
    import torch
    from PIL import Image

    return {
        "id": i,
        "score": i / 3,
        "text": f"sample {i} " * (i % 4),
        "raw": bytes([i % 256]) * (i % 6),
        "tokens": np.arange(i % 7, dtype=np.int32),  # 1-D numpy: no_header_numpy, lengths vary
        "grid": np.full((2, 1 + i % 3), i, dtype=np.float64),  # N-D numpy: header per item, shapes vary
        "mask": torch.full((2, 3), i % 2, dtype=torch.int16),  # N-D tensor: header per item, one shape
        "pixels": Image.new("RGB", (3 + i % 2, 2), (i, 1, 2)),  # PIL: raw pixels
        "photo": Image.open(BytesIO(_jpeg(i))),  # a JPEG file: its bytes as written
    }


def _optimize(out, n: int = N, fn=_lit_sample, chunk_bytes: int = 4000) -> None:
    litdata = pytest.importorskip("litdata")
    litdata.optimize(fn=fn, inputs=list(range(n)), output_dir=str(out), chunk_bytes=chunk_bytes, num_workers=1,
                     start_method="fork", verbose=False)


@pytest.fixture(scope="module")
def lit_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lit") / "optimized"
    _optimize(out)
    return out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.asarray(a).shape == np.asarray(b).shape and np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


@pytest.mark.migrate
@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # LitData's own tensor reads
def test_litdata_samples_equal_litdatas_own_reader(lit_dir):
    from litdata import StreamingDataset
    from litdata.streaming.serializers import BytesSerializer

    src = LitDataChunks(lit_dir)
    assert detect_kind(str(lit_dir)) == "litdata" and len(glob.glob(str(lit_dir / "*.bin"))) > 1
    kinds = {f.name: (f.kind, f.dtype.str, f.shape) for f in src.schema}
    assert kinds == {
        "id": ("scalar", "<i8", ()), "score": ("scalar", "<f8", ()), "text": ("string", "|u1", ()),
        "raw": ("bytes", "|u1", ()), "tokens": ("varray", "<i4", ()), "grid": ("vndarray", "<f8", (2, -1)),
        "mask": ("ndarray", "<i2", (2, 3)), "pixels": ("vndarray", "|u1", (2, -1, 3)), "photo": ("image", "|u1", ()),
    }
    # LitData's reader with its JPEG leaves left as the stored bytes (it would decode them to pixels)
    theirs = StreamingDataset(str(lit_dir), serializers={"jpeg": BytesSerializer()})
    assert len(src) == len(theirs) == N
    for i in range(N):
        ours, ref = src[i], theirs[i]
        assert ours["photo"] == ref["photo"] == _jpeg(i)
        ref = {**ref, "mask": ref["mask"].numpy(), "pixels": np.asarray(ref["pixels"])}
        assert all(_same(ours[k], ref[k]) for k in ours), i


@pytest.mark.migrate
def test_convert_litdata_round_trip_any_workers_and_resume(lit_dir, tmp_path):
    args = ["--quiet", "--shard-size", "4KiB"]
    assert main(["convert", str(lit_dir), str(tmp_path / "one"), "--workers", "1", *args]) == 0
    assert main(["convert", str(lit_dir), str(tmp_path / "three"), "--workers", "3", *args]) == 0
    assert _files(tmp_path / "one") == _files(tmp_path / "three")
    ds, src = FastloadDataset(tmp_path / "one"), LitDataChunks(lit_dir)
    manifest = json.loads((tmp_path / "one" / "index.json").read_text())
    assert len(ds) == N and manifest["attrs"]["source"] == "litdata"
    for i in range(N):
        got, want = ds[i], src[i]
        assert all(_same(got[k], want[k]) for k in want), i
    # a corrupt item stops the conversion naming it; restored, --resume gives the same bytes
    src_copy = tmp_path / "src"
    os.makedirs(src_copy)
    for p in glob.glob(str(lit_dir / "*")):
        Path(src_copy / os.path.basename(p)).write_bytes(Path(p).read_bytes())
    last = sorted(glob.glob(str(src_copy / "*.bin")))[-1]
    good = Path(last).read_bytes()
    Path(last).write_bytes(good[:8] + b"\xff\xff\xff\x7f" + good[12:])  # first item's end offset: past the file
    assert main(["convert", str(src_copy), str(tmp_path / "cut"), *args]) == 2
    assert not (tmp_path / "cut" / "index.json").exists()
    Path(last).write_bytes(good)
    assert main(["convert", str(src_copy), str(tmp_path / "cut"), "--resume", *args]) == 0
    assert _files(tmp_path / "cut") == _files(tmp_path / "one")


def _numbers(i: int) -> dict:
    return {"x": i, "v": np.arange(3, dtype=np.int16) + i}


@pytest.mark.migrate
def test_litdata_corrupt_items_are_named_and_skipped(tmp_path):
    src = tmp_path / "lit"
    _optimize(src, 30, _numbers, chunk_bytes=256)
    index = json.loads(Path(src / "index.json").read_text())
    names = [c["filename"] for c in index["chunks"]]
    sizes = [c["chunk_size"] for c in index["chunks"]]
    assert len(names) >= 3
    # chunk 0: item 1's "v" leaf size changed (sizes no longer add up); chunk 1: removed
    data = bytearray(Path(src / names[0]).read_bytes())
    start = int(np.frombuffer(bytes(data[4:8 + 4]), "<u4")[1])
    data[start + 4] = 5
    Path(src / names[0]).write_bytes(bytes(data))
    os.remove(src / names[1])
    chunks = LitDataChunks(src)
    with pytest.raises(FormatError, match=rf"{names[0]}: item 1 \(sample 1\): .*do not add up"):
        chunks[1]
    with pytest.raises(FormatError, match=rf"{names[1]}: item 0 \(sample {sizes[0]}\): cannot read the chunk file"):
        chunks[sizes[0]]
    assert main(["convert", str(src), str(tmp_path / "strict"), "--quiet"]) == 2
    assert main(["convert", str(src), str(tmp_path / "out"), "--quiet", "--on-error", "skip"]) == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    bad = [1, *range(sizes[0], sizes[0] + sizes[1])]
    assert [r["input"] for r in report] == [chunks.describe(i) for i in bad]
    kept = [i for i in range(30) if i not in bad]
    ds = FastloadDataset(tmp_path / "out")
    assert ds.get_batch(np.arange(len(ds)))["x"].tolist() == kept
    assert np.array_equal(ds.get_batch([0])["v"][0], np.arange(3, dtype=np.int16))


def _pickled(i: int) -> dict:
    return {"x": i, "obj": {1, 2}}  # a set: LitData pickles it


@pytest.mark.migrate
def test_litdata_pickled_leaves_are_refused_by_name(tmp_path):
    _optimize(tmp_path / "lit", 4, _pickled)
    with pytest.raises(FormatError, match="field 'obj' is pickled .*never unpickles"):
        LitDataChunks(tmp_path / "lit")


def _write_records(path, records, group_size: int = 4) -> None:
    from array_record.python import array_record_module

    writer = array_record_module.ArrayRecordWriter(str(path), f"group_size:{group_size}")
    for r in records:
        writer.write(r)
    writer.close()


def _record(i: int) -> bytes:
    return json.dumps({"id": i, "caption": f"caption {i} " * 8, "vec": list(range(i % 5))}).encode()


@pytest.fixture
def record_dir(tmp_path):
    pytest.importorskip("array_record.python.array_record_module")
    d = tmp_path / "records"
    d.mkdir()
    _write_records(d / "train.array_record-00000-of-00002", [_record(i) for i in range(25)])
    _write_records(d / "train.array_record-00001-of-00002", [_record(i) for i in range(25, 60)])
    return d


def test_array_record_records_round_trip_as_bytes(record_dir, tmp_path):
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    assert detect_kind(str(record_dir)) == "arrayrecord"
    theirs = ArrayRecordDataSource(sorted(glob.glob(str(record_dir / "*"))))
    assert len(theirs) == 60
    assert main(["convert", str(record_dir), str(tmp_path / "one"), "--quiet", "--workers", "1",
                 "--shard-size", "4KiB"]) == 0
    assert main(["convert", str(record_dir), str(tmp_path / "two"), "--quiet", "--workers", "2",
                 "--shard-size", "4KiB"]) == 0
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    ds = FastloadDataset(tmp_path / "one")
    assert ds.get_batch(np.arange(60))["record"].to_list() == [theirs[i] for i in range(60)]


def test_array_record_decode_plugin(record_dir, tmp_path, monkeypatch, capsys):
    plugin = tmp_path / "plug"
    plugin.mkdir()
    (plugin / "my_records.py").write_text(textwrap.dedent("""
        import json
        import numpy as np

        def decode(data):
            obj = json.loads(data)
            return {"id": obj["id"], "caption": obj["caption"], "vec": np.asarray(obj["vec"], np.int64)}
    """))
    monkeypatch.syspath_prepend(str(plugin))
    assert main(["convert", str(record_dir), str(tmp_path / "out"), "--quiet", "--decode", "my_records:decode",
                 "--workers", "2"]) == 0
    ds = FastloadDataset(tmp_path / "out")
    assert [(f.name, f.kind) for f in ds.schema] == [("id", "scalar"), ("caption", "string"), ("vec", "varray")]
    batch = ds.get_batch(np.arange(60))
    assert batch["id"].tolist() == list(range(60)) and batch["caption"][59] == "caption 59 " * 8
    assert [v.tolist() for v in batch["vec"].to_list()] == [list(range(i % 5)) for i in range(60)]
    with pytest.raises(ValueError, match="expected MODULE:FUNC"):
        ArrayRecordFiles(record_dir, decode="my_records.decode")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "x"), "--decode", "my_records:decode"]) == 2
    assert "--decode applies to ArrayRecord sources, not to a fastload source" in capsys.readouterr().err


def test_array_record_decode_plugin_found_in_the_current_directory(record_dir, tmp_path, monkeypatch):
    """`--decode mypkg.records:decode` run from the folder that holds `mypkg/`, as docs/migrate.md
    shows: the `fastload` command's `sys.path` has no entry for the current directory, yet the
    module is found there, in the converting process and its workers."""
    here = tmp_path / "project"
    (here / "mypkg").mkdir(parents=True)
    (here / "mypkg" / "__init__.py").write_text("")
    (here / "mypkg" / "records.py").write_text("import json\n\ndef decode(data):\n"
                                                "    return {'id': json.loads(data)['id']}\n")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(here))])
    assert main(["convert", str(record_dir), str(tmp_path / "out"), "--quiet", "--decode", "mypkg.records:decode",
                 "--workers", "2"]) == 0
    assert FastloadDataset(tmp_path / "out").get_batch(np.arange(60))["id"].tolist() == list(range(60))


def test_array_record_bad_records_and_files_are_named(record_dir, tmp_path, monkeypatch):
    plugin = tmp_path / "plug"
    plugin.mkdir()
    (plugin / "picky.py").write_text("import json\n\ndef decode(data):\n"
                                     "    obj = json.loads(data)\n"
                                     "    if obj['id'] % 10 == 7:\n        raise ValueError('no sevens')\n"
                                     "    return {'id': obj['id']}\n")
    monkeypatch.syspath_prepend(str(plugin))
    (record_dir / "zz.array_record").write_bytes(b"not an array record file at all" * 10)
    files = ArrayRecordFiles(record_dir, decode="picky:decode")
    first = str(record_dir / "train.array_record-00000-of-00002")
    with pytest.raises(FormatError, match=rf"{first}: record 7 \(sample 7\): picky:decode failed .*no sevens"):
        files[7]
    with pytest.raises(FormatError, match=r"zz\.array_record: cannot open as ArrayRecord"):
        files[60]
    assert main(["convert", str(record_dir), str(tmp_path / "out"), "--quiet", "--decode", "picky:decode",
                 "--on-error", "skip"]) == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == [files.describe(i) for i in (7, 17, 27, 37, 47, 57)] + [
        str(record_dir / "zz.array_record")]
    assert FastloadDataset(tmp_path / "out").get_batch(np.arange(54))["id"].tolist() == [
        i for i in range(60) if i % 10 != 7]


def test_array_record_flipped_byte_is_caught_by_its_chunk_hash(tmp_path):
    pytest.importorskip("array_record.python.array_record_module")
    path = tmp_path / "one.array_record"
    _write_records(path, [f"record-{i:04d}-".encode() * 20 for i in range(100)], group_size=1)
    raw = bytearray(path.read_bytes())
    raw[raw.find(b"record-0050-") + 3] ^= 0x01  # inside record 50's payload
    path.write_bytes(bytes(raw))
    assert main(["convert", str(path), str(tmp_path / "out"), "--quiet", "--on-error", "skip"]) == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == [f"{path}: record 50 (sample 50)"]
    assert "hash mismatch" in report[0]["reason"]
    records = FastloadDataset(tmp_path / "out").get_batch(np.arange(99))["record"].to_list()
    assert records == [f"record-{i:04d}-".encode() * 20 for i in range(100) if i != 50]
