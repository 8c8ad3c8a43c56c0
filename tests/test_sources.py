"""Sources users already have: `.npy` folders (+ meta.json), tokens + offsets, Megatron `.bin/.idx`,
Parquet, image folders with a labels file. Each: a byte-exact round trip and an error for bad input."""

from __future__ import annotations

import json
import re
import struct
from io import BytesIO

import numpy as np
import pytest

from fastload.cli import main
from fastload.formats import FastloadDataset
from fastload.formats.errors import FormatError, SchemaError
from fastload.formats.sources import detect_kind, open_source


def _convert(src, out, *extra) -> FastloadDataset:
    assert main(["convert", str(src), str(out), "--quiet", *extra]) == 0
    return FastloadDataset(out)


def test_npy_folder_of_different_shapes_with_meta_json(tmp_path, capsys):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((int(rng.integers(1, 30)), 8)).astype(np.float32) for _ in range(40)]
    src = tmp_path / "feats"
    src.mkdir()
    for i, a in enumerate(arrays):
        np.save(src / f"utt{i:03d}.npy", a)
    (src / "meta.json").write_text(json.dumps({"sample_rate": 16000, "features": "fbank"}))
    assert detect_kind(str(src)) == "npyfiles"
    ds = _convert(src, tmp_path / "ds", "--shard-size", "8KiB")
    assert ds.schema["data"].kind == "vndarray" and ds.schema["data"].shape == (-1, 8)
    assert ds.attrs["meta"] == {"sample_rate": 16000, "features": "fbank"}
    for i, a in enumerate(arrays):
        got = ds[i]
        assert got["file"] == f"utt{i:03d}.npy" and got["data"].shape == a.shape
        assert got["data"].tobytes() == a.tobytes()


def test_npy_folder_errors_name_the_first_file_and_count_the_rest(tmp_path, capsys):
    src = tmp_path / "feats"
    src.mkdir()
    for i in range(50):
        np.save(src / f"f{i:03d}.npy", np.zeros((i + 1, 4), np.float32 if i not in (7, 9, 30) else np.int16))
    with pytest.raises(SchemaError) as info:
        open_source(str(src))
    msg = str(info.value)
    assert msg.startswith(f"{src}/f007.npy has dtype int16, but {src}/f000.npy has float32 (and 2 more files)")
    assert len(msg) < 300 and "f009" not in msg
    (src / "f010.npy").write_bytes(b"not numpy")
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "f010.npy: not a readable .npy file" in err and len(err) < 400


def test_npy_columns_with_meta_json_stay_columns(tmp_path):
    src = tmp_path / "cols"
    src.mkdir()
    x, y = np.arange(60, dtype=np.int16).reshape(20, 3), np.arange(20, dtype=np.int64)
    np.save(src / "x.npy", x)
    np.save(src / "y.npy", y)
    (src / "meta.json").write_text('{"split": "train"}')
    assert detect_kind(str(src)) == "npy"
    ds = _convert(src, tmp_path / "ds")
    batch = ds.get_batch(np.arange(20))
    assert batch["x"].tobytes() == x.tobytes() and batch["y"].tobytes() == y.tobytes()
    assert ds.attrs["meta"] == {"split": "train"}


def test_tokens_and_offsets(tmp_path, capsys):
    src = tmp_path / "corpus"
    src.mkdir()
    tokens = np.arange(1000, dtype=np.uint16)
    offsets = np.array([0, 3, 3, 400, 999, 1000], dtype=np.int64)
    np.save(src / "tokens.npy", tokens)
    np.save(src / "offsets.npy", offsets)
    ds = _convert(src, tmp_path / "ds", "--shard-size", "4KiB")
    assert ds.schema["tokens"].dtype == np.uint16 and len(ds) == 5
    for i in range(5):
        assert ds[i]["tokens"].tobytes() == tokens[offsets[i] : offsets[i + 1]].tobytes()
    np.save(src / "offsets.npy", np.array([0, 5, 4, 1000]))
    assert main(["convert", str(src), str(tmp_path / "bad")]) == 2
    assert "offsets.npy: offsets decrease at sample 1" in capsys.readouterr().err


def _megatron(prefix, seqs, dtype_code, dtype, doc_idx=None, *, magic=b"MMIDIDX\x00\x00", n=None) -> None:
    sizes = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = np.zeros(len(seqs), dtype="<i8")
    np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.arange(len(seqs) + 1, dtype="<i8") if doc_idx is None else np.asarray(doc_idx, "<i8")
    header = struct.pack("<9sQBQQ", magic, 1, dtype_code, len(seqs) if n is None else n, len(doc_idx))
    index = header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes()
    (prefix.parent / (prefix.name + ".idx")).write_bytes(index)
    (prefix.parent / (prefix.name + ".bin")).write_bytes(b"".join(np.asarray(s, dtype).tobytes() for s in seqs))


def test_megatron_indexed_dataset(tmp_path):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 50000, int(rng.integers(0, 300))).astype(np.uint16) for _ in range(30)]
    prefix = tmp_path / "my_text_document"
    _megatron(prefix, seqs, 8, np.uint16, doc_idx=[0, 10, 10, 25, 30])
    assert detect_kind(str(prefix)) == "megatron" and detect_kind(f"{prefix}.idx") == "megatron"
    ds = _convert(prefix, tmp_path / "ds", "--shard-size", "4KiB")
    assert len(ds.manifest.shards) > 1 and ds.schema["tokens"].dtype == np.uint16
    docs = [0] * 10 + [2] * 15 + [3] * 5
    for i, s in enumerate(seqs):
        got = ds[i]
        assert got["tokens"].tobytes() == s.tobytes() and got["doc"] == docs[i]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"magic": b"NOTMAGIC\x00"}, "bad magic"),
        ({"dtype_code": 42}, "unknown dtype code 42"),
        ({"n": 2**60}, r"header counts 1152921504606846976 sequences .*truncated or corrupt"),
        ({"doc_idx": [0, 2]}, "doc_idx must run from 0 to 3"),
    ],
)
def test_megatron_bad_index_is_refused(tmp_path, change, match):
    seqs = [np.arange(5, dtype=np.int32)] * 3
    kw = {"dtype_code": 4, "dtype": np.int32, **change}
    _megatron(tmp_path / "d", seqs, kw.pop("dtype_code"), kw.pop("dtype"), **kw)
    with pytest.raises(FormatError, match=match):
        open_source(str(tmp_path / "d"), "megatron")


def test_megatron_pointer_outside_bin(tmp_path):
    _megatron(tmp_path / "d", [np.arange(5, dtype=np.int32)] * 3, 4, np.int32)
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-4])  # the last sequence runs past
    with pytest.raises(FormatError, match="sequence 2 .* outside the 56-byte .bin file"):
        open_source(str(tmp_path / "d"), "megatron")


def test_parquet_files(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    src = tmp_path / "pq"
    src.mkdir()
    ids = [[1, 2, 3], [4], [], [5, 6]]
    pq.write_table(pa.table({"label": pa.array([0, 1], pa.int64()), "ids": pa.array(ids[:2], pa.list_(pa.int32()))}),
                   src / "part-0.parquet")
    pq.write_table(pa.table({"label": pa.array([2, 3], pa.int64()), "ids": pa.array(ids[2:], pa.list_(pa.int32()))}),
                   src / "part-1.parquet")
    ds = _convert(src, tmp_path / "ds")
    assert [ds[i]["label"] for i in range(4)] == [0, 1, 2, 3]
    for i in range(4):
        assert ds[i]["ids"].tobytes() == np.array(ids[i], np.int32).tobytes()
    (src / "part-1.parquet").write_bytes(b"PAR1 garbage")
    assert main(["convert", str(src), str(tmp_path / "bad")]) == 2
    assert "cannot read as Parquet" in capsys.readouterr().err


def _png(value: int) -> bytes:
    from PIL import Image

    buf = BytesIO()
    Image.fromarray(np.full((4, 6, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_image_folder_with_a_labels_file(tmp_path, capsys):
    src = tmp_path / "imgs"
    (src / "sub").mkdir(parents=True)
    names = ["a.png", "b.png", "sub/c.png"]
    for i, n in enumerate(names):
        (src / n).write_bytes(_png(i * 40))
    (src / "labels.csv").write_text("file,label\na.png,dog\nb.png,cat\nsub/c.png,dog\n")
    ds = _convert(src, tmp_path / "ds")
    assert ds.attrs["classes"] == ["cat", "dog"]
    assert [ds[i]["label"] for i in range(3)] == [1, 0, 1]
    assert [ds[i]["image"] for i in range(3)] == [(src / n).read_bytes() for n in names]
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"a.png": 3, "b.png": 7, "sub/c.png": 3}))
    ds = _convert(src, tmp_path / "ds2", "--labels", str(labels))
    assert [ds[i]["label"] for i in range(3)] == [3, 7, 3] and "classes" not in ds.attrs
    labels.write_text(json.dumps({"a.png": 3}))
    assert main(["convert", str(src), str(tmp_path / "bad"), "--labels", str(labels)]) == 2
    assert f"{labels} has no label for images under {src}: b.png (and 1 more)" in capsys.readouterr().err


def test_flat_image_folder_without_labels_warns(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.png").write_bytes(_png(i))
    assert detect_kind(str(src)) == "imagefolder"
    with pytest.warns(UserWarning, match="every label is 0; pass a labels file"):
        source, _, _ = open_source(str(src))
    assert [source[i]["label"] for i in range(3)] == [0, 0, 0]


# -- every conversion error names the input file (and line or key, sample and field) ---------------


def _convert_error(capsys, src, out, *extra) -> str:
    assert main(["convert", str(src), str(out), "--quiet", "--workers", "1", *extra]) == 2
    assert not (out / "index.json").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"text": "b", "label": "x", "ids": [3]}', "sample 2, field 'label': expected scalar of int64, got str"),
        ('{"text": "b", "label": 2, "ids": [1.5, "x"]}', "sample 2, field 'ids': expected numbers of int32"),
        ('{"text": 7, "label": 2, "ids": [3]}', "sample 2, field 'text': expected str, got int"),
        ('{"text": "b", "ids": [3]}', r"sample 2: fields differ from the schema \(missing \['label'\], extra \[\]\)"),
        ('{"text": "b", "label": 2, "ids": [3], "x": 1}', r"sample 2: fields differ .*extra \['x'\]"),
        ('{"text": "b", "label": 2', "sample 2 is not valid JSON"),
        ("[1, 2, 3]", "sample 2 is not a JSON object"),
    ],
)
def test_jsonl_errors_name_the_file_line_sample_and_field(tmp_path, capsys, bad_line, message):
    """Blank lines hold no sample: the bad line is line 4 of the file and sample 2."""
    src = tmp_path / "d.jsonl"
    good = '{"text": "a", "label": 1, "ids": [1, 2]}'
    src.write_text(f"{good}\n\n{good}\n{bad_line}\n{good}\n")
    err = _convert_error(capsys, src, tmp_path / "out")
    assert re.search(rf"error: {re.escape(str(src))}:4: {message}", err), err


def test_jsonl_skip_report_names_file_and_line(tmp_path, capsys):
    src = tmp_path / "d.jsonl"
    src.write_text('{"a": 1}\n\n{"a": 2}\nnot json\n{"a": 3}\n')
    assert main(["convert", str(src), str(tmp_path / "out"), "--quiet", "--on-error", "skip"]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert row["input"] == f"{src}:4" and row["reason"].startswith(f"{src}:4: sample 2 is not valid JSON")


def test_npy_files_sample_too_big_names_the_file(tmp_path, capsys):
    src = tmp_path / "arrays"
    src.mkdir()
    for i, n in enumerate([10, 10, 5000]):
        np.save(src / f"{i:02d}.npy", np.zeros(n, np.float32))
    err = _convert_error(capsys, src, tmp_path / "out", "--shard-size", "4KiB")
    assert f"error: {src}/02.npy: sample 2 is " in err and "larger than the shard size 4096" in err


def test_npy_columns_sample_too_big_names_the_file(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((3, 2000), np.float32))
    err = _convert_error(capsys, tmp_path / "x.npy", tmp_path / "out", "--shard-size", "4KiB")
    assert f"error: {tmp_path}/x.npy: sample 0 is 8000 bytes, larger than the shard size 4096" in err


def test_megatron_sequence_too_big_names_the_bin_file(tmp_path, capsys):
    _megatron(tmp_path / "d", [np.arange(5, dtype=np.int32), np.arange(2000, dtype=np.int32)], 4, np.int32)
    err = _convert_error(capsys, tmp_path / "d", tmp_path / "out", "--shard-size", "4KiB")
    assert f"error: {tmp_path}/d.bin: sample 1 is 8008 bytes, larger than the shard size 4096" in err


def test_megatron_pointer_past_any_file_is_refused(tmp_path):
    _megatron(tmp_path / "d", [np.arange(5, dtype=np.int32)] * 3, 4, np.int32)
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    pointer = 34 + 4 * 3 + 8 * 2  # the third sequence's pointer: near 2**63, so pointer + size overflows int64
    raw[pointer : pointer + 8] = (2**63 - 4).to_bytes(8, "little")
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="sequence 2 .* outside the 60-byte .bin file"):
        open_source(str(tmp_path / "d"), "megatron")


def test_image_folder_image_too_big_names_the_file(tmp_path, capsys):
    src = tmp_path / "images"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        (src / cls / "0.png").write_bytes(_png(1))
    rng = np.random.default_rng(0)
    from PIL import Image

    buf = BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    (src / "cat" / "1.png").write_bytes(buf.getvalue())  # noise: ~12 KB
    err = _convert_error(capsys, src, tmp_path / "out", "--shard-size", "4KiB")
    assert f"error: {src}/cat/1.png: sample 1 is " in err and "larger than the shard size" in err


def test_lmdb_value_too_big_names_the_database_and_key(tmp_path, capsys):
    import lmdb

    env = lmdb.open(str(tmp_path / "db"), map_size=16 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"x" * 10)
        txn.put(b"b", b"y" * 9000)
    env.close()
    err = _convert_error(capsys, tmp_path / "db", tmp_path / "out", "--shard-size", "4KiB")
    assert f"error: {tmp_path}/db: key b'b': sample 1 is " in err


def test_hdf5_row_too_big_names_the_file(tmp_path, capsys):
    import h5py

    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("x", data=np.zeros((2, 3000), np.float32))
    err = _convert_error(capsys, tmp_path / "d.h5", tmp_path / "out", "--shard-size", "4KiB")
    assert f"error: {tmp_path}/d.h5: sample 0 is 12000 bytes" in err
