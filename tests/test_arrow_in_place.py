"""Parquet and Lance read in place (`ParquetDataset`, `LanceDataset`, `open_dataset`), through the
Loader, and converted (`fastload convert`): files written by pyarrow and `lance.write_dataset`."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload
from fastload.cli import main
from fastload.formats import FastloadDataset, FormatError, LanceDataset, ParquetDataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 300


def _table(n: int = N, first: int = 0):
    """Every column kind read in place: scalars, a fixed-size list, a list, strings, bytes."""
    i = np.arange(first, first + n)
    return pa.table({
        "id": i.astype(np.int64),
        "score": (i / 7).astype(np.float32),
        "flag": i % 3 == 0,
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 4, dtype=np.float32) + first * 4), 4),
        "tokens": pa.array([list(range(k % 9)) for k in i], pa.list_(pa.int32())),
        "text": [f"row {k} " * (k % 5) for k in i],
        "blob": [bytes([k % 256]) * (k % 11) for k in i],
    })


def _expected(table, rows) -> dict:
    """The rows of `table` as the columns `get_batch` returns them (plain Python / numpy)."""
    sub = table.take(pa.array(np.asarray(rows, dtype=np.int64))).to_pydict()
    return {
        "id": np.asarray(sub["id"]), "score": np.asarray(sub["score"], np.float32), "flag": np.asarray(sub["flag"]),
        "emb": np.asarray(sub["emb"], np.float32).reshape(-1, 4),
        "tokens": [np.asarray(t, np.int32) for t in sub["tokens"]],
        "text": sub["text"], "blob": sub["blob"],
    }


def _assert_batch(batch, table, rows) -> None:
    want = _expected(table, rows)
    for name in ("id", "score", "flag", "emb"):
        assert isinstance(batch[name], np.ndarray) and np.array_equal(batch[name], want[name]), name
    got_tokens = batch["tokens"].to_list()
    assert len(got_tokens) == len(want["tokens"])
    assert all(g.dtype == np.int32 and np.array_equal(g, w) for g, w in zip(got_tokens, want["tokens"]))
    assert batch["text"].to_list() == want["text"] and batch["blob"].to_list() == want["blob"]


@pytest.fixture
def parquet_dir(tmp_path):
    """Two Parquet files (written by pyarrow, 64-row row groups) making one table of N rows."""
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(_table(200), d / "part-0.parquet", row_group_size=64)
    pq.write_table(_table(N - 200, first=200), d / "part-1.parquet", row_group_size=64)
    return d


@pytest.fixture
def lance_dir(tmp_path):
    lance = pytest.importorskip("lance")
    path = tmp_path / "data.lance"
    lance.write_dataset(_table(), str(path), max_rows_per_file=70)  # 5 fragments
    return path


def test_open_dataset_reads_parquet_in_place(parquet_dir):
    ds = fastload.open_dataset(parquet_dir)
    assert isinstance(ds, ParquetDataset) and len(ds) == N
    assert [(f.name, f.kind) for f in ds.schema] == [
        ("id", "scalar"), ("score", "scalar"), ("flag", "scalar"), ("emb", "ndarray"), ("tokens", "varray"),
        ("text", "string"), ("blob", "bytes")]
    rows = [299, 0, 63, 64, 64, 199, 200, -1]  # across row groups and files, repeats, a negative index
    _assert_batch(ds.get_batch(rows), _table(), [r % N for r in rows])
    assert ds[201]["id"] == 201 and ds[201]["text"] == "row 201 "
    assert np.array_equal(ds.lengths("tokens"), np.arange(N) % 9)
    assert np.array_equal(ds.lengths("blob"), np.arange(N) % 11)
    with pytest.raises(IndexError, match=f"sample index {N} out of range"):
        ds.get_batch([1, N])
    (parquet_dir / "_SUCCESS").write_bytes(b"")  # what Spark leaves beside its files
    assert isinstance(fastload.open_dataset(parquet_dir), ParquetDataset)
    single = fastload.open_dataset(parquet_dir / "part-1.parquet")
    assert isinstance(single, ParquetDataset) and len(single) == N - 200 and single[0]["id"] == 200


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, N - 1), min_size=1, max_size=80), cache=st.sampled_from([1, 1 << 30]))
def test_parquet_batches_equal_the_table_for_any_indices(tmp_path_factory, rows, cache):
    d = tmp_path_factory.mktemp("pq")
    pq.write_table(_table(), d / "t.parquet", row_group_size=32)
    ds = ParquetDataset(d / "t.parquet", group_cache_bytes=cache)  # 1 byte: every batch evicts
    _assert_batch(ds.get_batch(rows), _table(), rows)


def test_parquet_threads_share_the_group_cache(parquet_dir):
    from concurrent.futures import ThreadPoolExecutor

    ds = ParquetDataset(parquet_dir, group_cache_bytes=20_000)  # a few groups: threads evict each other's
    table = _table()
    batches = [np.random.default_rng(s).integers(0, N, 24) for s in range(16)]
    with ThreadPoolExecutor(4) as pool:
        for rows, batch in zip(batches, pool.map(ds.get_batch, batches)):
            _assert_batch(batch, table, rows)


def test_inspect_an_in_place_source(parquet_dir, capsys):
    assert main(["inspect", str(parquet_dir)]) == 0
    out = capsys.readouterr().out
    assert "ParquetDataset: read in place, no fastload checksums" in out and f"samples   {N}" in out
    assert "tokens               varray   dtype=<i4" in out and "length: min 0, mean 4.0" in out


def test_parquet_page_crcs_are_checked_where_written(tmp_path):
    table = pa.table({"text": [f"value {i:05d}" for i in range(2000)]})
    for name, crc in (("crc", True), ("plain", False)):
        pq.write_table(table, tmp_path / f"{name}.parquet", compression="none", write_page_checksum=crc)
        raw = bytearray((tmp_path / f"{name}.parquet").read_bytes())
        raw[raw.find(b"value 01500") + 6] ^= 0x01  # one flipped bit inside a data page
        (tmp_path / f"{name}.parquet").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"crc\.parquet: row group 0: cannot read .*CRC"):
        ParquetDataset(tmp_path / "crc.parquet").get_batch([1500])
    # Without stored CRCs nothing can notice: the flipped byte is read (what docs/migrate.md says).
    assert ParquetDataset(tmp_path / "plain.parquet").get_batch([1500])["text"].to_list() == ["value 11500"]


def test_parquet_nulls_and_unreadable_types_are_named(tmp_path):
    pq.write_table(pa.table({"x": [1, None, 3]}), tmp_path / "n.parquet")
    ds = ParquetDataset(tmp_path / "n.parquet")
    assert ds.get_batch([0, 2])["x"].tolist() == [1, 3]
    with pytest.raises(FormatError, match=r"n\.parquet \(row group 0\): sample 1, column 'x': missing value"):
        ds.get_batch([0, 1])
    pq.write_table(pa.table({"m": pa.array([{"a": 1}], pa.map_(pa.string(), pa.int64()))}), tmp_path / "m.parquet")
    with pytest.raises(FormatError, match=r"m\.parquet: column .m.: Arrow type map<string, int64.*> cannot be read"):
        ParquetDataset(tmp_path / "m.parquet")
    with pytest.raises(ValueError, match="no fastload block checksums"):
        fastload.open_dataset(tmp_path / "n.parquet", verify="full")


def test_loader_reads_parquet_and_lance_in_place(parquet_dir, lance_dir):
    for path in (parquet_dir, lance_dir):
        ds = fastload.open_dataset(path)
        seen = []
        loader = fastload.Loader(ds, batch_size=32, shuffle=True, seed=3, num_workers=2)
        described = loader.describe()  # the batched fast path: one get_batch per batch, on threads
        assert (described["mode"], described["worker_kind"]) == ("columns", "thread")
        for batch in loader:
            assert batch["emb"].shape[1:] == (4,) and batch["emb"].dtype == torch.float32
            assert torch.equal(batch["emb"][:, 0], batch["id"].float() * 4)
            seen.extend(batch["id"].tolist())
        assert sorted(seen) == list(range(N)), path


def test_lance_in_place_matches_the_source(lance_dir):
    ds = fastload.open_dataset(lance_dir)
    assert isinstance(ds, LanceDataset) and len(ds) == N and ds.schema.names == _table().column_names
    rows = np.random.default_rng(0).integers(0, N, 100)
    _assert_batch(ds.get_batch(rows), _table(), rows)
    assert np.array_equal(ds.lengths("tokens"), np.arange(N) % 9)
    assert LanceDataset(lance_dir, columns=["text"]).get_batch([4])["text"].to_list() == ["row 4 " * 4]


@pytest.mark.filterwarnings("ignore:lance is not fork-safe")
def test_lance_refuses_a_forked_process(lance_dir):
    ds = LanceDataset(lance_dir)
    ds.get_batch([0])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports the error text through the pipe
        try:
            ds.get_batch([1])
            msg = b"read"
        except FormatError as exc:
            msg = str(exc).encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as fh:
        text = fh.read()
    assert b"not fork-safe" in text and str(lance_dir).encode() in text
    assert ds.get_batch([1])["id"].tolist() == [1]  # the parent reads on


def test_lance_corrupt_file_is_named(lance_dir):
    victim = sorted(glob.glob(str(lance_dir / "data" / "*.lance")))[0]
    raw = bytearray(Path(victim).read_bytes())
    raw[-1] ^= 0xFF  # the file's trailing magic
    Path(victim).write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=rf"{lance_dir}.*cannot read rows"):
        LanceDataset(lance_dir).get_batch(np.arange(N))


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(p, root): Path(p).read_bytes()
            for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p)}


def _assert_converted(out, table) -> None:
    ds = FastloadDataset(out)
    assert len(ds) == table.num_rows
    _assert_batch(ds.get_batch(np.arange(table.num_rows)), table, np.arange(table.num_rows))


def test_convert_lance_is_deterministic_and_resumable(lance_dir, tmp_path):
    args = ["--quiet", "--shard-size", "4KiB"]
    assert main(["convert", str(lance_dir), str(tmp_path / "one"), "--workers", "1", *args]) == 0
    assert main(["convert", str(lance_dir), str(tmp_path / "four"), "--workers", "4", *args]) == 0
    _assert_converted(tmp_path / "one", _table())
    assert json.loads(Path(tmp_path / "one" / "index.json").read_text())["attrs"]["source"] == "lance"
    assert _files(tmp_path / "one") == _files(tmp_path / "four")
    # an unreadable fragment stops the conversion naming the dataset; fixed, --resume finishes it
    victim = sorted(glob.glob(str(lance_dir / "data" / "*.lance")), key=os.path.getmtime)[-1]
    good = Path(victim).read_bytes()
    Path(victim).write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    assert main(["convert", str(lance_dir), str(tmp_path / "cut"), *args]) == 2
    assert not (tmp_path / "cut" / "index.json").exists()
    Path(victim).write_bytes(good)
    assert main(["convert", str(lance_dir), str(tmp_path / "cut"), "--resume", *args]) == 0
    assert _files(tmp_path / "cut") == _files(tmp_path / "one")
    # --on-error=skip: refused up front, saying why, before anything is written
    with pytest.raises(SystemExit, match=r"cannot apply to the Lance dataset .*name a data file or page, not a row"):
        main(["convert", str(lance_dir), str(tmp_path / "skip"), "--on-error", "skip", *args])
    assert not (tmp_path / "skip").exists()


def test_convert_parquet_without_datasets_goes_through_pyarrow(parquet_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert main(["convert", str(parquet_dir), str(tmp_path / "out"), "--quiet"]) == 0
    _assert_converted(tmp_path / "out", _table())


def test_hf_image_column_reads_in_place_as_image(tmp_path):
    datasets = pytest.importorskip("datasets")
    from io import BytesIO

    from PIL import Image

    def png(i: int) -> bytes:
        buf = BytesIO()
        Image.new("RGB", (5 + i, 3), (i, 0, 0)).save(buf, format="PNG")
        return buf.getvalue()

    images = [png(i) for i in range(6)]
    hf = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in images], "label": list(range(6))},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    hf.to_parquet(str(tmp_path / "img.parquet"))
    ds = fastload.open_dataset(tmp_path / "img.parquet")
    assert ds.schema["image"].kind == "image"
    assert ds.get_batch([4, 1])["image"].to_list() == [images[4], images[1]]
    assert main(["convert", str(tmp_path / "img.parquet"), str(tmp_path / "out"), "--quiet"]) == 0
    assert FastloadDataset(tmp_path / "out").get_batch([4])["image"].to_list() == [images[4]]


@pytest.mark.filterwarnings("ignore:lance is not fork-safe")
def test_bench_on_lance_compares_in_place_with_converted(lance_dir, capsys):
    """`fastload bench DATASET` on a Lance dataset: in-place and converted rows, the gain in the summary,
    and torch DataLoader workers (spawned for Lance) reading it."""
    assert main(["bench", str(lance_dir), "--tiny", "--no-progress", "--loaders", "fastload,torch", "--workers", "0,1",
                 "--repeats", "1", "--seconds", "0.1", "--json", str(lance_dir.parent / "bench.json")]) == 0
    res = json.loads((lance_dir.parent / "bench.json").read_text())
    assert res["dataset"]["kind"] == "lance" and res["dataset"]["samples"] == N
    rows = {(r["backend"], r["cache"]) for r in res["backends"]}
    assert rows == {(b, c) for b in ("lance", "fastload (converted)") for c in ("cold", "warm")}
    gains = [line for line in res["summary"]["lines"] if line.startswith("converting would gain")]
    assert len(gains) == 2 and "lance in place" in gains[0]
    assert {(r["loader"], r["num_workers"]) for r in res["loaders"]} == {
        (k, w) for k in ("fastload", "torch") for w in (0, 1)}
    assert "fastload (converted)" in capsys.readouterr().out


def test_nulls_inside_lists_are_named(tmp_path):
    table = pa.table({"v": pa.array([[1, 2], [3], [4, None]], pa.list_(pa.int64())),
                      "m": pa.FixedSizeListArray.from_arrays(pa.array([1.0, 2.0, None, 4.0, 5.0, 6.0]), 2)})
    pq.write_table(table, tmp_path / "n.parquet")
    ds = ParquetDataset(tmp_path / "n.parquet")
    assert [a.tolist() for a in ds.get_batch([1, 0], fields=["v"])["v"].to_list()] == [[3], [1, 2]]
    with pytest.raises(FormatError, match=r"sample 2, column 'v': missing value"):
        ds.get_batch([0, 2], fields=["v"])
    with pytest.raises(FormatError, match=r"sample 1, column 'm': missing value"):
        ds.get_batch([0, 1, 2], fields=["m"])
