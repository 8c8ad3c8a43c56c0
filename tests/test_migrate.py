"""`fastload convert` from other loaders' formats, with files their own writers wrote: WebDataset
(webdataset's ShardWriter), TFRecord (the tfrecord package's TFRecordWriter and protobuf's
`tf.train.Example`), MosaicML Streaming MDS (streaming's MDSWriter). Each converts sample for
sample, byte-identically for any worker count, resumes, and names every bad input."""

from __future__ import annotations

import importlib.util
import io
import json
import os
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from open_files import LISTS_OPEN_FILES, open_under

from fastload.benchmark.remote_peers import import_streaming_base
from fastload.cli import main
from fastload.formats import FastloadDataset
from fastload.formats.errors import ChecksumError, FormatError, SchemaError
from fastload.formats.sources import detect_kind, open_source
from fastload.formats.verify import verify_dataset
from fastload.formats.webdataset import WebDataset

pytestmark = pytest.mark.migrate

wds = pytest.importorskip("webdataset", reason="webdataset's ShardWriter (fastload[migrate-test]) is not installed")
tfrecord = pytest.importorskip("tfrecord", reason="the tfrecord package (fastload[migrate-test]) is not installed")


def _files(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, fs in os.walk(root)
        for f in fs
    }


def _image(i: int, fmt: str = "JPEG") -> bytes:
    from PIL import Image

    arr = np.random.default_rng(i).integers(0, 255, (6 + i % 5, 9, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def _convert(src, out, *extra: str) -> int:
    return main(["convert", str(src), str(out), "--quiet", "--shard-size", "4096", *extra])


# ---------------------------------------------------------------- WebDataset


def _wds_sample(i: int) -> dict:
    return {
        "__key__": f"dir/s{i:05d}",
        "jpg": _image(i),
        "cls": i % 7,
        "txt": f"a caption for {i} ✓",
        "json": {"width": 9, "score": i / 4, "tags": [i, 2, 3], "meta": None if i % 2 else {"a": i}},
        "npy": np.arange(i % 5 + 1, dtype=np.float32) * i,
    }


def _write_wds(root, n: int = 60, per_shard: int = 13) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    samples = [_wds_sample(i) for i in range(n)]
    with wds.ShardWriter(str(root / "shards-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for s in samples:
            sink.write(s)
    return samples


def _check_wds(ds: FastloadDataset, src_paths: list[str]) -> None:
    """The converted samples equal what webdataset's own reader gives, sample for sample."""
    ref = list(wds.WebDataset(src_paths, shardshuffle=False, empty_check=False))
    assert len(ds) == len(ref)
    for i, want in enumerate(ref):
        got = ds[i]
        obj = json.loads(want["json"])
        assert got["__key__"] == want["__key__"]
        assert got["jpg"] == want["jpg"]
        assert got["cls"] == int(want["cls"])
        assert got["txt"] == want["txt"].decode()
        assert got["json.width"] == obj["width"] and got["json.score"] == obj["score"]
        assert got["json.tags"].tolist() == obj["tags"]
        assert json.loads(got["json.meta"]) == obj["meta"]  # null / objects: kept as their JSON text
        arr = np.load(io.BytesIO(want["npy"]), allow_pickle=False)
        assert got["npy"].dtype == arr.dtype and np.array_equal(got["npy"], arr)


def test_webdataset_round_trip_any_worker_count(tmp_path):
    src = tmp_path / "wds"
    _write_wds(src)
    assert detect_kind(str(src)) == "webdataset"
    assert _convert(src, tmp_path / "w1", "--workers", "1") == 0
    assert _convert(src, tmp_path / "w3", "--workers", "3") == 0
    assert _files(tmp_path / "w1") == _files(tmp_path / "w3")
    ds = FastloadDataset(tmp_path / "w1")
    assert ds.attrs["source"] == "webdataset"
    kinds = {f.name: f.kind for f in ds.schema}
    assert kinds == {"__key__": "string", "cls": "scalar", "jpg": "image", "json.width": "scalar",
                     "json.score": "scalar", "json.tags": "varray", "json.meta": "string", "npy": "varray",
                     "txt": "string"}
    _check_wds(ds, sorted(str(p) for p in src.iterdir()))
    assert verify_dataset(tmp_path / "w1") == []


def test_webdataset_pattern_file_url_and_fields(tmp_path):
    src = tmp_path / "wds"
    samples = _write_wds(src, n=30, per_shard=10)
    pattern = str(src / "shards-{000000..000001}.tar")
    assert detect_kind(pattern) == "webdataset"
    assert _convert(pattern, tmp_path / "pat") == 0
    assert _convert(f"file://{pattern}", tmp_path / "url") == 0
    assert _files(tmp_path / "pat") == _files(tmp_path / "url")
    import fsspec

    memory = fsspec.filesystem("memory")  # an object-store-like URL folder (forked workers see it too)
    for name in ("shards-000000.tar", "shards-000001.tar"):
        memory.pipe(f"/migrate-test/{name}", (src / name).read_bytes())
    try:
        assert detect_kind("memory://migrate-test") == "webdataset"
        assert _convert("memory://migrate-test", tmp_path / "mem", "--workers", "2") == 0
    finally:
        memory.rm("/migrate-test", recursive=True)
    assert _files(tmp_path / "pat") == _files(tmp_path / "mem")
    ds = FastloadDataset(tmp_path / "pat")
    assert [ds[i]["__key__"] for i in range(len(ds))] == [s["__key__"] for s in samples[:20]]
    assert _convert(src, tmp_path / "sub", "--fields", "jpg,cls,json.score") == 0
    sub = FastloadDataset(tmp_path / "sub")
    assert sub.schema.names == ["cls", "jpg", "json.score"] and len(sub) == 30
    assert sub[29]["jpg"] == samples[29]["jpg"] and sub[29]["json.score"] == 29 / 4
    assert _convert(src, tmp_path / "js", "--fields", "json") == 0  # a JSON member's extension: all its keys
    assert FastloadDataset(tmp_path / "js").schema.names == ["json.width", "json.score", "json.tags", "json.meta"]
    with pytest.raises(SchemaError, match="no field 'nope' to keep") as info:  # naming every field there is
        WebDataset(str(src), fields=["jpg", "nope"])
    listed = str(info.value).split("the fields are ")[1]
    for name in ("__key__", "cls", "jpg", "json", "json.score", "json.meta", "npy", "txt"):
        assert repr(name) in listed, name


def test_webdataset_pickles_are_refused_by_name(tmp_path, capsys):
    src = tmp_path / "wds"
    src.mkdir()
    with wds.ShardWriter(str(src / "p-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i}", "cls": i, "pyd": {"any": "object"}})
    assert _convert(src, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "p-000000.tar: sample 0 (key 'k0'): member extension 'pyd' is a pickle" in err and "--fields" in err
    assert _convert(src, tmp_path / "out", "--fields", "cls") == 0
    assert [FastloadDataset(tmp_path / "out")[i]["cls"] for i in range(5)] == list(range(5))
    # an .npy member holding objects (a pickle inside) is refused by np.load(allow_pickle=False), named
    objects = io.BytesIO()
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with wds.ShardWriter(str(src / "q-%06d.tar"), maxcount=100, verbose=0) as sink:
        sink.write({"__key__": "n0", "cls": 0, "npy": np.arange(3)})
        sink.write({"__key__": "n1", "cls": 1, "npy": objects.getvalue()})
    source, _, _ = open_source(str(src / "q-000000.tar"))
    with pytest.raises(SchemaError, match=r"q-000000\.tar: sample 1 \(key 'n1'\): member 'npy' is not a readable "
                                          r"numeric \.npy array .*allow_pickle=False"):
        source[1]


def test_webdataset_bad_inputs_are_named_and_skipped(tmp_path, capsys):
    src = tmp_path / "wds"
    samples = _write_wds(src, n=30, per_shard=10)
    import tarfile

    _rewrite_shard(src / "shards-000001.tar", lambda m: {**m, "jpg": m["jpg"][:40]} if m["__key__"] == "dir/s00013"
                   else m)
    _rewrite_shard(src / "shards-000002.tar", lambda m: {k: v for k, v in m.items() if k != "txt"}
            if m["__key__"] == "dir/s00025" else m)
    assert _convert(src, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "shards-000001.tar: sample 3 (key 'dir/s00013')" in err and "not a decodable image" in err
    assert _convert(src, tmp_path / "out", "--on-error", "skip", "--overwrite") == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == ["{}: sample 3 (key 'dir/s00013')".format(src / "shards-000001.tar"),
                                            "{}: sample 5 (key 'dir/s00025')".format(src / "shards-000002.tar")]
    assert "no member for ['txt']" in report[1]["reason"]
    ds = FastloadDataset(tmp_path / "out")
    assert [ds[i]["__key__"] for i in range(len(ds))] == [s["__key__"] for s in samples if s["__key__"]
                                                          not in ("dir/s00013", "dir/s00025")]
    # a corrupt header in the middle of a shard: the members after it are one bad input, named
    data = bytearray((src / "shards-000000.tar").read_bytes())
    with tarfile.open(src / "shards-000000.tar") as tf:
        sixth = next(m for m in tf.getmembers() if m.name.startswith("dir/s00006.")).offset
    data[sixth + 100 : sixth + 108] = b"garbage!"
    (src / "shards-000000.tar").write_bytes(bytes(data))
    assert _convert(src, tmp_path / "out", "--on-error", "skip", "--overwrite") == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert report[0]["input"].startswith(f"{src / 'shards-000000.tar'}: sample 6 (members from byte {sixth} on)")
    assert "corrupt tar header" in report[0]["reason"] or "not a readable tar" in report[0]["reason"]
    assert len(FastloadDataset(tmp_path / "out")) == 30 - 4 - 2  # s06..s09 lost with the header, 2 bad samples


def _rewrite_shard(path, edit) -> None:
    """Rebuild one shard with webdataset's own TarWriter, each sample passed through `edit`."""
    members = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
    with wds.TarWriter(str(path)) as tw:
        for m in members:
            tw.write(edit({k: v for k, v in m.items() if k != "__url__"}))


def test_webdataset_resume_after_a_failure_gives_identical_output(tmp_path):
    src = tmp_path / "wds"
    _write_wds(src, n=700, per_shard=100)  # past the writer's first encode chunk (512 samples)
    assert _convert(src, tmp_path / "ref", "--workers", "2") == 0
    last = src / "shards-000006.tar"
    good = last.read_bytes()
    _rewrite_shard(last, lambda m: {**m, "jpg": m["jpg"][:40]} if m["__key__"] == "dir/s00650" else m)
    out = tmp_path / "out"
    assert _convert(src, out, "--workers", "2") == 2
    assert not (out / "index.json").exists() and len(os.listdir(out / "shards")) > 2
    last.write_bytes(good)  # the input fixed: the finished shards are kept, the rest written
    assert _convert(src, out, "--workers", "2", "--resume") == 0
    assert _files(out) == _files(tmp_path / "ref")


def test_webdataset_grouping_follows_webdataset(tmp_path):
    """Members grouped by key as webdataset groups them: the key is the path up to the first dot of
    the basename, multi-dot extensions stay whole, __meta__ members and dot-less names are skipped."""
    import tarfile

    path = tmp_path / "g.tar"
    entries = [("a/x.1.seg.png", _image(1, "PNG")), ("a/x.1.cls", b"1"), ("__meta__", b"m"), ("README", b"r"),
               ("a/x.2.seg.png", _image(2, "PNG")), ("a/x.2.cls", b"2"), ("b.y.seg.png", _image(3, "PNG")),
               ("b.y.cls", b" 3\n")]
    with tarfile.open(path, "w") as tf:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    ref = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
    source, schema, _ = open_source(str(path))
    assert schema.names == ["__key__", "1.seg.png", "1.cls", "2.seg.png", "2.cls"]
    assert [f.kind for f in schema] == ["string", "image", "scalar", "image", "scalar"]
    assert [r["__key__"] for r in ref] == ["a/x", "b"] and len(source) == 2
    assert source[0]["1.seg.png"] == ref[0]["1.seg.png"] and source[0]["2.cls"] == 2
    with pytest.raises(SchemaError, match=r"g\.tar: sample 1 \(key 'b'\): no member for \['1\.seg\.png'"):
        source[1]
    with tarfile.open(tmp_path / "dup.tar", "w") as tf:  # one extension twice in a sample: that sample is bad
        for name, data in [("k1.cls", b"1"), ("k1.cls", b"2"), ("k1.txt", b"t"), ("k2.cls", b"3"), ("k2.txt", b"u")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    source, schema, _ = open_source(str(tmp_path / "dup.tar"))
    assert len(source) == 2 and source[1] == {"__key__": "k2", "cls": 3, "txt": "u"}
    with pytest.raises(FormatError, match=r"dup\.tar: sample 0 \(key 'k1'\): a second member 'k1\.cls'"):
        source[0]


# ---------------------------------------------------------------- TFRecord


def _write_tfrecords(root, files: int = 2, per_file: int = 25) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    samples = []
    for f in range(files):
        writer = tfrecord.TFRecordWriter(str(root / f"train-{f:05d}.tfrecord"))
        for j in range(per_file):
            i = f * per_file + j
            s = {"image/encoded": _image(i), "image/class/label": i % 10 - 3, "vec": [i / 2, -1.5, 2.0],
                 "tokens": list(range(-(i % 4), i % 9)) + [2**40], "name": f"r{i}".encode()}
            writer.write({"image/encoded": (s["image/encoded"], "byte"),
                          "image/class/label": (s["image/class/label"], "int"), "vec": (s["vec"], "float"),
                          "tokens": (s["tokens"], "int"), "name": (s["name"], "byte")})
            samples.append(s)
        writer.close()
    return samples


def test_tfrecord_round_trip_against_the_tfrecord_reader(tmp_path):
    src = tmp_path / "tf"
    samples = _write_tfrecords(src)
    assert detect_kind(str(src)) == "tfrecord" and detect_kind(str(src / "train-00000.tfrecord")) == "tfrecord"
    assert _convert(src, tmp_path / "w1", "--workers", "1") == 0
    assert _convert(src, tmp_path / "w3", "--workers", "3") == 0
    assert _files(tmp_path / "w1") == _files(tmp_path / "w3")
    ds = FastloadDataset(tmp_path / "w1")
    assert {f.name: (f.kind, f.dtype.name, f.shape) for f in ds.schema} == {
        "image.encoded": ("image", "uint8", ()), "image.class.label": ("scalar", "int64", ()),
        "vec": ("ndarray", "float32", (3,)), "tokens": ("varray", "int64", ()), "name": ("bytes", "uint8", ())}
    from tfrecord.reader import tfrecord_loader

    ref = [r for f in range(2) for r in tfrecord_loader(str(src / f"train-{f:05d}.tfrecord"), None)]
    assert len(ds) == len(ref) == len(samples)
    for i, (want, s) in enumerate(zip(ref, samples)):
        got = ds[i]
        assert got["image.encoded"] == bytes(want["image/encoded"]) == s["image/encoded"]
        assert got["image.class.label"] == int(want["image/class/label"][0]) == s["image/class/label"]
        assert np.array_equal(got["vec"], want["vec"]) and got["tokens"].tolist() == s["tokens"]
        assert got["name"] == s["name"]


def test_crc32c_and_framing_match_the_reference_writer(tmp_path):
    from fastload.formats.tfrecord import masked_crc32c

    def unmasked(data: bytes) -> int:  # TFRecord's mask undone: subtract the constant, rotate left 15
        rotated = (masked_crc32c(data) - 0xA282EAD8) & 0xFFFFFFFF
        return ((rotated << 15) | (rotated >> 17)) & 0xFFFFFFFF

    assert unmasked(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert unmasked(b"\0" * 32) == 0x8A9136AA  # RFC 3720 B.4 test vector
    path = tmp_path / "one.tfrecord"
    writer = tfrecord.TFRecordWriter(str(path))
    writer.write({"x": ([1, 2, 3], "int")})
    writer.close()
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    assert int.from_bytes(data[8:12], "little") == masked_crc32c(data[:8])
    assert int.from_bytes(data[12 + length : 16 + length], "little") == masked_crc32c(data[12 : 12 + length])


_feature_values = st.one_of(
    st.tuples(st.just("bytes_list"), st.lists(st.binary(max_size=20), max_size=4)),
    st.tuples(st.just("float_list"), st.lists(st.floats(width=32, allow_nan=False), max_size=6)),
    st.tuples(st.just("int64_list"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)),
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), _feature_values, max_size=5))
def test_example_parser_agrees_with_protobuf(features):
    """`parse_example` reads what protobuf's own serializer writes (packed lists, negative int64s,
    empty lists, unicode keys)."""
    from tfrecord import example_pb2

    from fastload.formats.tfrecord import parse_example

    ex = example_pb2.Example()
    for key, (kind, values) in features.items():
        getattr(ex.features.feature[key], kind).value.extend(values)
    parsed = parse_example(ex.SerializeToString())
    assert set(parsed) == set(features)
    for key, (kind, values) in features.items():
        code, got = parsed[key]
        assert code == {"bytes_list": 1, "float_list": 2, "int64_list": 3}[kind]
        if kind == "bytes_list":
            assert got == values
        else:
            assert got.tolist() == np.array(values, np.float32 if kind == "float_list" else np.int64).tolist()


def test_tfrecord_corrupt_records_are_named(tmp_path, capsys):
    src = tmp_path / "tf"
    _write_tfrecords(src, files=2, per_file=10)
    path = src / "train-00001.tfrecord"
    data = bytearray(path.read_bytes())
    pos = 0
    starts = []
    while pos < len(data):
        starts.append(pos)
        pos += 16 + int.from_bytes(data[pos : pos + 8], "little")
    data[starts[4] + 40] ^= 0xFF  # record 4's data
    path.write_bytes(bytes(data))
    assert _convert(src, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{path}: record 4: the data's CRC does not match" in err
    data[starts[7] + 2] ^= 0x01  # record 7's length: the rest of the file cannot be framed
    path.write_bytes(bytes(data))
    assert _convert(src, tmp_path / "out", "--on-error", "skip", "--overwrite") == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == [f"{path}: record 4", f"{path}: record 7"]
    assert "length's CRC does not match" in report[1]["reason"]
    assert len(FastloadDataset(tmp_path / "out")) == 10 + 6


def _in_memory(folder, name: str) -> str:
    """The files of `folder` copied to fsspec's in-memory filesystem under /`name`; its ``memory://`` URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)
    for f in sorted(os.listdir(folder)):
        fs.pipe(f"/{name}/{f}", (folder / f).read_bytes())
    return f"memory://{name}"


def test_tfrecord_from_fsspec_urls_as_from_local_files(tmp_path, capsys):
    src = tmp_path / "tf"
    _write_tfrecords(src, files=2, per_file=25)
    assert _convert(src, tmp_path / "local") == 0
    url = _in_memory(src, f"tf-{tmp_path.name}")
    assert _convert(url, tmp_path / "mem", "--kind", "tfrecord", "--workers", "2") == 0
    assert _convert(f"file://{src}", tmp_path / "file", "--kind", "tfrecord") == 0
    assert _files(tmp_path / "local") == _files(tmp_path / "mem") == _files(tmp_path / "file")
    assert _convert(f"{url}/train-00001.tfrecord", tmp_path / "one", "--kind", "tfrecord") == 0
    assert len(FastloadDataset(tmp_path / "one")) == 25
    # a corrupt record at a URL is named by the URL, and left out with --on-error=skip
    import fsspec

    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat(f"/{url[9:]}/train-00001.tfrecord"))
    data[16 + int.from_bytes(data[:8], "little") + 40] ^= 0xFF  # record 1's data
    fs.pipe(f"/{url[9:]}/train-00001.tfrecord", bytes(data))
    capsys.readouterr()
    assert _convert(url, tmp_path / "bad", "--kind", "tfrecord") == 2
    assert f"{url}/train-00001.tfrecord: record 1: the data's CRC does not match" in capsys.readouterr().err
    assert _convert(url, tmp_path / "skip", "--kind", "tfrecord", "--on-error", "skip") == 0
    report = [json.loads(line) for line in (tmp_path / "skip" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == [f"{url}/train-00001.tfrecord: record 1"]
    fs.rm(f"/{url[9:]}", recursive=True)


# ---------------------------------------------------------------- MosaicML Streaming MDS


def _mds_writer():
    """streaming's MDSWriter, imported without running `streaming/__init__.py`, which imports its
    dataloader's transformers and torchvision (not installed: their pins do not fit torch 2.13):
    `fastload.benchmark.remote_peers.import_streaming_base`."""
    if importlib.util.find_spec("streaming") is None:
        pytest.skip("mosaicml-streaming is not installed (the Makefile installs it with --no-deps)")
    import_streaming_base()
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


_MDS_COLUMNS = {
    "u8": "uint8", "i64": "int64", "f16": "float16", "f64": "float64", "i": "int", "s": "str", "si": "str_int",
    "sf": "str_float", "dec": "str_decimal", "b": "bytes", "jpg": "jpeg", "png": "png", "pil": "pil",
    "meta": "json", "nd": "ndarray", "ndf": "ndarray:float32", "nds": "ndarray:int16:2,3",
}


def _mds_sample(i: int) -> dict:
    from PIL import Image

    img = Image.open(io.BytesIO(_image(i, "PNG"))).convert("RGB")
    return {"u8": i % 256, "i64": -(i**3), "f16": np.float16(i / 8), "f64": i / 3, "i": i - 10, "s": f"text {i} ✓",
            "si": 10**15 + i, "sf": i / 7, "dec": Decimal("1.10") * i, "b": bytes([i % 256]) * (i % 4),
            "jpg": img, "png": img, "pil": img, "meta": {"id": i, "tags": [1, i]},
            "nd": np.arange(i % 3 + 1, dtype=np.int32).reshape(1, -1), "ndf": np.full((2, i % 2 + 1), i, np.float32),
            "nds": np.full((2, 3), i, np.int16)}


def _write_mds(root, n: int = 40, compression: str | None = None, hashes=("sha1", "xxh64"), columns=None) -> list:
    writer = _mds_writer()
    samples = [_mds_sample(i) for i in range(n)]
    with writer(out=str(root), columns=columns or _MDS_COLUMNS, compression=compression, hashes=list(hashes),
                size_limit=1 << 13) as w:
        for s in samples:
            w.write({k: s[k] for k in (columns or _MDS_COLUMNS)})
    return samples


def test_mds_every_encoding_round_trips(tmp_path):
    from PIL import Image

    src = tmp_path / "mds"
    samples = _write_mds(src)
    assert detect_kind(str(src)) == "mds"
    assert _convert(src, tmp_path / "w1", "--workers", "1") == 0
    assert _convert(src, tmp_path / "w3", "--workers", "3") == 0
    assert _files(tmp_path / "w1") == _files(tmp_path / "w3")
    ds = FastloadDataset(tmp_path / "w1")
    assert len(ds) == len(samples) and ds.attrs["source"] == "mds"
    for i, s in enumerate(samples):
        got = ds[i]
        for k in ("u8", "i64", "i", "s", "si", "sf", "b"):
            assert got[k] == s[k], k
        assert got["f16"] == float(s["f16"]) and got["f64"] == s["f64"] and got["dec"] == str(s["dec"])
        for k in ("jpg", "png", "pil"):  # jpeg/png: the stored bytes; pil: re-encoded as PNG, same pixels
            with Image.open(io.BytesIO(got[k])) as img:
                ref = np.asarray(s[k]) if k != "jpg" else np.asarray(Image.open(io.BytesIO(_jpeg_of(s[k]))))
                assert np.array_equal(np.asarray(img), ref), k
        assert got["meta.id"] == i and got["meta.tags"].tolist() == [1, i]
        for k in ("nd", "ndf", "nds"):
            assert got[k].dtype == s[k].dtype and np.array_equal(got[k], s[k]), k


def _jpeg_of(img) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG")  # what streaming's JPEG encoding stores for an in-memory image
    return out.getvalue()


@pytest.mark.parametrize("compression", ["zstd", "gz", "bz2", "br", "snappy"])
def test_mds_compressed_shards_convert_as_the_plain_ones(tmp_path, compression):
    cols = {k: _MDS_COLUMNS[k] for k in ("i64", "s", "png", "nd")}
    _write_mds(tmp_path / "plain", n=25, columns=cols)
    _write_mds(tmp_path / "zip", n=25, compression=compression, columns=cols)
    assert not [f for f in os.listdir(tmp_path / "zip") if f.endswith(".mds")]  # only the compressed files
    assert _convert(tmp_path / "plain", tmp_path / "a") == 0
    assert _convert(tmp_path / "zip", tmp_path / "b", "--workers", "2") == 0
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_mds_pickles_and_image_lists_are_refused_by_name(tmp_path, capsys):
    cols = {"x": "int", "obj": "pkl", "imgs": "list[png]"}
    writer = _mds_writer()
    from PIL import Image

    with writer(out=str(tmp_path / "mds"), columns=cols) as w:
        for i in range(4):
            w.write({"x": i, "obj": {"a": i}, "imgs": [Image.new("RGB", (2, 2))]})
    assert _convert(tmp_path / "mds", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "column 'imgs' has encoding 'list[png]' (a variable-length list of images per sample" in err
    assert "none a list of byte strings); leave it out with --fields" in err
    assert _convert(tmp_path / "mds", tmp_path / "out", "--fields", "x,imgs") == 2
    assert _convert(tmp_path / "mds", tmp_path / "out", "--fields", "obj") == 2
    assert "column 'obj' has encoding 'pkl' (pickle: fastload never unpickles" in capsys.readouterr().err
    assert _convert(tmp_path / "mds", tmp_path / "out", "--fields", "x") == 0
    assert [FastloadDataset(tmp_path / "out")[i]["x"] for i in range(4)] == [0, 1, 2, 3]


def test_mds_fields_pick_json_keys(tmp_path):
    _write_mds(tmp_path / "mds", n=10, columns={k: _MDS_COLUMNS[k] for k in ("i", "meta", "s")})
    assert _convert(tmp_path / "mds", tmp_path / "a", "--fields", "meta.tags,s") == 0
    ds = FastloadDataset(tmp_path / "a")
    assert ds.schema.names == ["meta.tags", "s"] and ds[7]["meta.tags"].tolist() == [1, 7]
    assert _convert(tmp_path / "mds", tmp_path / "b", "--fields", "meta") == 0
    assert FastloadDataset(tmp_path / "b").schema.names == ["meta.id", "meta.tags"]


def test_mds_corrupt_shards_are_named(tmp_path, capsys):
    src = tmp_path / "mds"
    _write_mds(src, n=30, hashes=())
    index = json.loads((src / "index.json").read_text())
    second = src / index["shards"][1]["raw_data"]["basename"]
    data = bytearray(second.read_bytes())
    n = int.from_bytes(data[:4], "little")
    first_sample = int.from_bytes(data[4:8], "little")
    data[first_sample : first_sample + 4] = (10**6).to_bytes(4, "little")  # sample 0's first column size
    second.write_bytes(bytes(data))
    assert _convert(src, tmp_path / "out") == 2
    assert f"{second}: sample 0: the columns' sizes add up to" in capsys.readouterr().err
    assert _convert(src, tmp_path / "out", "--on-error", "skip", "--overwrite") == 0
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert [r["input"] for r in report] == [f"{second}: sample 0"]
    assert len(FastloadDataset(tmp_path / "out")) == 29 and n > 1
    # with hashes in the index, a changed byte anywhere in a shard is named by the hash
    _write_mds(tmp_path / "hashed", n=30)
    index = json.loads((tmp_path / "hashed" / "index.json").read_text())
    last = tmp_path / "hashed" / index["shards"][-1]["raw_data"]["basename"]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0x01
    last.write_bytes(bytes(data))
    source, _, _ = open_source(str(tmp_path / "hashed"))
    with pytest.raises(ChecksumError, match=f"{last}: sha1 is .*, the index records"):
        source[len(source) - 1]
    last.write_bytes(bytes(data[:100]))  # truncated: the header's sample count no longer fits
    source, _, _ = open_source(str(tmp_path / "hashed"), fields=["i64"])
    with pytest.raises(FormatError, match=str(last)):
        source[len(source) - 1]


@pytest.mark.parametrize("compression", [None, "gz"])
def test_mds_from_fsspec_urls_as_from_a_local_directory(tmp_path, capsys, compression):
    src = tmp_path / "mds"
    _write_mds(src, n=40, compression=compression)
    assert _convert(src, tmp_path / "local") == 0
    url = _in_memory(src, f"mds-{tmp_path.name}")
    assert _convert(url, tmp_path / "mem", "--kind", "mds", "--workers", "2") == 0
    assert _convert(f"file://{src}", tmp_path / "file", "--kind", "mds") == 0
    assert _files(tmp_path / "local") == _files(tmp_path / "mem") == _files(tmp_path / "file")
    # a shard missing at the URL is named by its URL
    import fsspec

    fs = fsspec.filesystem("memory")
    index = json.loads(fs.cat(f"/{url[9:]}/index.json"))
    entry = index["shards"][1]
    fs.rm(f"/{url[9:]}/{(entry['zip_data'] or entry['raw_data'])['basename']}")
    capsys.readouterr()
    assert _convert(url, tmp_path / "bad", "--kind", "mds") == 2
    assert f"{url}/{entry['raw_data']['basename']}: the shard file is missing" in capsys.readouterr().err
    fs.rm(f"/{url[9:]}", recursive=True)


def test_mds_resume_after_a_failure_gives_identical_output(tmp_path):
    src = tmp_path / "mds"
    cols = {k: _MDS_COLUMNS[k] for k in ("i64", "s", "nd")}
    _write_mds(src, n=700, hashes=("xxh64",), columns=cols)  # past the writer's first encode chunk (512 samples)
    assert _convert(src, tmp_path / "ref", "--workers", "2") == 0
    index = json.loads((src / "index.json").read_text())
    last = src / index["shards"][-1]["raw_data"]["basename"]
    good = last.read_bytes()
    last.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    out = tmp_path / "out"
    assert _convert(src, out, "--workers", "2") == 2
    assert not (out / "index.json").exists() and len(os.listdir(out / "shards")) > 1
    last.write_bytes(good)
    assert _convert(src, out, "--workers", "2", "--resume") == 0
    assert _files(out) == _files(tmp_path / "ref")


def test_fields_is_refused_for_other_sources(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n')
    assert _convert(tmp_path / "a.jsonl", tmp_path / "out", "--fields", "x") == 2
    assert "--fields applies to webdataset, tfrecord, mds sources" in capsys.readouterr().err


# ---------------------------------------------------------------- Ray


@pytest.mark.ray
def test_on_ray_the_local_bytes_and_report(tmp_path, monkeypatch):
    """`--engine ray` writes what the local converter writes, for each of the three sources (the
    WebDataset one with a bad sample left out and reported)."""
    pytest.importorskip("ray", reason="Ray Data (fastload[ray]) is not installed")
    from ray_fixtures import local_ray
    _write_wds(tmp_path / "wds", n=40, per_shard=15)
    _rewrite_shard(tmp_path / "wds" / "shards-000001.tar",
                   lambda m: {**m, "jpg": m["jpg"][:40]} if m["__key__"] == "dir/s00020" else m)
    _write_tfrecords(tmp_path / "tf", files=2, per_file=10)
    _write_mds(tmp_path / "mds", n=30, compression="zstd")
    runs = {"wds": ("--fields", "__key__,jpg,cls,npy", "--on-error", "skip"), "tf": (), "mds": ()}
    for name, args in runs.items():
        assert _convert(tmp_path / name, tmp_path / f"{name}-local", *args) == 0
    with local_ray():
        for name, args in runs.items():
            assert _convert(tmp_path / name, tmp_path / f"{name}-ray", "--engine", "ray", "--workers", "2", *args) == 0
    for name in runs:
        assert _files(tmp_path / f"{name}-local") == _files(tmp_path / f"{name}-ray"), name
    report = (tmp_path / "wds-ray" / "skipped-inputs.jsonl").read_text()
    assert f"{tmp_path / 'wds' / 'shards-000001.tar'}: sample 5 (key 'dir/s00020')" in report


@pytest.mark.skipif(not LISTS_OPEN_FILES, reason="lists open files through /proc")
def test_file_ranges_close_what_they_open(tmp_path):
    """A source's per-thread file handles: at most `_OPEN_PER_THREAD` open at once, each read exact,
    and none left open once their thread ended or the `FileRanges` is gone (a long-lived process
    converting many datasets must not run out of descriptors)."""
    import gc
    import threading

    from fastload.formats import foreign

    folder = tmp_path / "files"
    folder.mkdir()
    paths = []
    for i in range(foreign._OPEN_PER_THREAD + 4):
        path = folder / f"f{i}.bin"
        path.write_bytes(bytes([i]) * 100 + b"end")
        paths.append(str(path))
    ranges = foreign.FileRanges()

    def read_all(reader: foreign.FileRanges) -> None:
        for i, path in enumerate(paths):
            assert reader.read(path, 98, 5) == bytes([i, i]) + b"end"
            assert len(open_under(str(folder))) <= foreign._OPEN_PER_THREAD

    worker = threading.Thread(target=read_all, args=(ranges,))
    worker.start()
    worker.join()
    gc.collect()
    assert open_under(str(folder)) == []  # the thread's handles went with it
    read_all(ranges)
    assert len(open_under(str(folder))) == foreign._OPEN_PER_THREAD
    with pytest.raises(FormatError, match="f0.bin: the file ends at byte 103"):
        ranges.read(paths[0], 100, 10)
    del ranges
    gc.collect()
    assert open_under(str(folder)) == []
