"""Variable-length fields read as batch views: one vectorized lookup and one ranged copy per field.

A mixed dataset over several shards is read with `get_batch` (spliced blobs, `SplicedRagged`) and
checked byte for byte against `ds[i]`, with and without the C gather, and against the shard-by-shard
path; a hypothesis fuzz corrupts shard bytes and checks that a batch either comes back exact or
raises an error naming shard, sample and field.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.fetch.text_collate import TextCollate
from fastload.formats import ChecksumError, FastloadDataset, Field, FormatError, Ragged, Schema, write
from fastload.formats import ragged as ragged_module
from fastload.formats import reader as reader_module
from fastload.formats.ragged import gather_ranges
from fastload.loader import Loader

SCHEMA = Schema(
    (
        Field("blob", "bytes"),
        Field("text", "string"),
        Field("tokens", "varray", np.dtype(np.int32)),
        Field("wide", "varray", np.dtype(np.float64)),
        Field("label", "scalar", np.dtype(np.int64)),
    )
)
N = 150


def _samples() -> list[dict]:
    rng = np.random.default_rng(5)
    return [
        {
            "blob": rng.bytes(int(rng.integers(0, 3000))),
            "text": "ß" * int(rng.integers(0, 9)) + str(i),
            "tokens": rng.integers(-9, 30000, int(rng.integers(0, 120)), dtype=np.int32),
            "wide": rng.normal(size=int(rng.integers(0, 5))),
            "label": i,
        }
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("ragged") / "ds"
    samples = _samples()
    write(samples, root, schema=SCHEMA, shard_size=110_000, workers=1, progress=False)
    return root, samples


def _same_as_samples(batch: dict, idx, samples: list[dict]) -> None:
    for name in ("blob", "text", "tokens", "wide"):
        col = batch[name]
        assert isinstance(col, Ragged) and len(col) == len(idx)
        for j, i in enumerate(idx):
            want, got = samples[i][name], col[j]
            if isinstance(want, np.ndarray):
                assert got.dtype == want.dtype and np.array_equal(got, want)
            else:
                assert type(got) is type(want) and got == want
    assert batch["label"].tolist() == [samples[i]["label"] for i in idx]


def test_batches_are_exact_in_any_order_over_shards(mixed, monkeypatch):
    root, samples = mixed
    ds = FastloadDataset(root)
    assert ds.num_shards >= 3
    rng = np.random.default_rng(0)
    batches = [rng.integers(-N, N, 40) for _ in range(6)] + [np.arange(N), np.zeros(0, np.int64), [N - 1, 0, 0]]
    ds.get_batch([0])  # maps the columns
    for idx in batches:
        _same_as_samples(ds.get_batch(idx), [int(i) % N for i in np.asarray(idx)], samples)
    monkeypatch.setattr(ragged_module, "_c_gather", None)  # the pure-Python gather: same bytes
    for idx in batches[:3]:
        _same_as_samples(ds.get_batch(idx), [int(i) % N for i in idx], samples)
    monkeypatch.setattr(reader_module, "splice_available", lambda: False)  # shard by shard: same bytes
    by_shard = FastloadDataset(root)
    for idx in batches[:3]:
        _same_as_samples(by_shard.get_batch(idx), [int(i) % N for i in idx], samples)
    with pytest.raises(IndexError, match="out of range"):
        ds.get_batch([0, N])


def test_loader_keeps_default_collate_types_and_text_collate_takes_the_view(mixed):
    root, samples = mixed
    ds = FastloadDataset(root)
    order = np.random.default_rng(1).permutation(N).tolist()
    seen = 0
    for batch in Loader(ds, batch_size=32, sampler=order, num_workers=2):
        idx = order[seen : seen + len(batch["label"])]
        assert isinstance(batch["blob"], list) and batch["blob"] == [samples[i]["blob"] for i in idx]
        assert batch["text"] == [samples[i]["text"] for i in idx]
        assert [t.tolist() for t in batch["tokens"].to_list()] == [samples[i]["tokens"].tolist() for i in idx]
        seen += len(idx)
    assert seen == N
    idx = order[:16]
    out = TextCollate(field="tokens")(ds.get_batch(idx))
    for row, i in zip(out["input_ids"], idx):
        want = samples[i]["tokens"]
        assert row[: len(want)].tolist() == want.tolist()


@pytest.mark.parametrize("c_gather", [True, False])
def test_gather_ranges_checks_bounds_before_copying(monkeypatch, c_gather):
    if not c_gather:
        monkeypatch.setattr(ragged_module, "_c_gather", None)
    src = np.arange(10, dtype=np.int32)
    values, offsets = gather_ranges(src, np.array([8, 0, 3]), np.array([2, 0, 3]))
    assert values.tolist() == [8, 9, 3, 4, 5] and offsets.tolist() == [0, 2, 2, 5]
    for starts, lengths in (([9], [2]), ([-1], [1]), ([0], [-1])):
        with pytest.raises(IndexError, match="range 0"):
            gather_ranges(src, np.array(starts), np.array(lengths))


def _blob_positions(root) -> tuple[list[tuple[int, int, int]], set[tuple[int, int]]]:
    """(shard, first byte, end) of the variable fields' blobs, and the (shard, block) pairs that
    opening a shard verifies (header, field table, offsets tables: corruption there names no sample)."""
    ds = FastloadDataset(root)
    spans, opened = [], set()
    for k in range(ds.num_shards):
        reader = ds.shard(k)
        opened.add((k, 0))
        for name in ("blob", "text", "tokens", "wide"):
            start = reader.blob_offset[name]
            spans.append((k, start, start + reader.ragged[name][1].nbytes))
            offs = reader.ragged[name][0]
            first = offs.ctypes.data - reader.ragged[name][1].ctypes.data + start  # file offset of the table
            opened.update((k, b) for b in range(first >> reader.shift, (first + offs.nbytes - 1 >> reader.shift) + 1))
    ds.close()
    return [(k, lo, hi) for k, lo, hi in spans if hi > lo], opened


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupt_blob_bytes_never_reach_the_caller(mixed, tmp_path_factory, data):
    root, samples = mixed
    spans, opened = _blob_positions(root)
    k, lo, hi = data.draw(st.sampled_from(spans))
    pos = data.draw(st.integers(lo, hi - 1))
    flip = data.draw(st.integers(1, 255))
    copy = tmp_path_factory.mktemp("corrupt") / "ds"
    shutil.copytree(root, copy)
    shard = copy / "shards" / f"shard-{k:05d}.fls"
    raw = bytearray(shard.read_bytes())
    raw[pos] ^= flip
    shard.write_bytes(bytes(raw))
    ds = FastloadDataset(copy)
    idx = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=60))
    try:
        batch = ds.get_batch(idx)
        ds.get_batch(idx)  # the spliced path, once the first call mapped the columns
        batch = ds.get_batch(idx)
    except ChecksumError as exc:
        msg = str(exc)
        assert f"shard-{k:05d}.fls (shard {k})" in msg, msg
        if (k, pos >> 16) not in opened:  # a data block: the error names the sample and field read
            assert "sample " in msg and "field '" in msg, msg
        return
    except FormatError as exc:  # structure checks on open (never for blob bytes, but named all the same)
        assert f"shard {k}" in str(exc)
        return
    _same_as_samples(batch, idx, samples)  # untouched blocks only: exact bytes


def test_lmdb_batch_keys_and_values_match_per_record_reads(tmp_path):
    import lmdb

    from fastload.formats import LMDBDataset

    rng = np.random.default_rng(3)
    records = {f"k{i:04d}".encode(): rng.bytes(int(rng.integers(0, 5000))) for i in range(60)}
    env = lmdb.open(str(tmp_path / "db"), map_size=16 << 20)
    with env.begin(write=True) as txn:
        for k, v in records.items():
            txn.put(k, v)
    env.close()
    db = LMDBDataset(tmp_path / "db")
    keys = sorted(records)
    idx = [5, -1, 0, 59, 5, 17]
    batch = db.get_batch(idx)
    assert batch["key"].to_list() == [keys[i] for i in idx]
    assert batch["value"].to_list() == [records[keys[i]] for i in idx]
    assert len(db.get_batch([])["value"]) == 0
    with pytest.raises(IndexError, match="out of range"):
        db.get_batch([60])


@pytest.mark.parametrize("c_split", [True, False])
def test_to_list_gives_the_same_items_with_and_without_the_extension(monkeypatch, c_split):
    if not c_split:
        monkeypatch.setattr(ragged_module, "_c_split", None)
    words = ["", "ß", "abc", "", "日本"]
    assert Ragged.from_list(words, kind="string").to_list() == words
    blobs = [b"", b"\x00\xff", b"xyz"]
    col = Ragged.from_list(blobs, kind="bytes")
    assert col.to_list() == blobs and all(type(b) is bytes for b in col.to_list())
    strided = Ragged(np.frombuffer(b"a.b.c.", np.uint8)[::2], np.array([0, 1, 3]), "bytes")  # not contiguous
    assert strided.to_list() == [b"a", b"bc"]
    bad = Ragged(np.frombuffer(b"ok\xff", np.uint8), np.array([0, 2, 3]), "string")
    with pytest.raises(FormatError, match="sample 1 of a Ragged batch: invalid UTF-8"):
        bad.to_list()


def test_hdf5_chunked_unfiltered_rows_come_from_the_mapped_chunks(tmp_path):
    import h5py

    from fastload.formats import HDF5Dataset

    n = 1000
    x = np.random.default_rng(0).random((n, 3, 4)).astype(">f4")  # not native order: stays exact
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(96, 3, 4))  # last chunk partly past the end
        f.create_dataset("part", data=x, chunks=(96, 3, 2))  # chunks split rows: through h5py
        f.create_dataset("z", data=np.arange(n), chunks=(64,), compression="gzip")
        f.create_dataset("sparse", shape=(n,), dtype=np.int16, chunks=(100,))  # never written: fill value
    ds = HDF5Dataset(tmp_path / "c.h5")
    assert ds.direct_fields == ["x"]
    idx = [999, -1, 0, 95, 96, 500, 500]
    b = ds.get_batch(idx)
    assert b["x"].dtype == x.dtype and np.array_equal(b["x"], x[idx])  # the stored bytes, byte order kept
    assert np.array_equal(b["part"], x[idx])
    assert b["z"].tolist() == [i % n for i in idx] and b["sparse"].tolist() == [0] * len(idx)
    assert ds.get_batch([])["x"].shape == (0, 3, 4)
    with pytest.raises(IndexError, match="out of range"):
        ds.get_batch([n])
