"""Spliced columns: one mapping of a fixed column over all shards, gathered with one `take`."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.formats import FastloadDataset, Field, Schema, write
from fastload.formats import spliced as spliced_mod
from fastload.formats.spliced import ColumnPart, splice_available, splice_column

pytestmark = pytest.mark.skipif(not splice_available(), reason="column splicing needs Linux (mmap MAP_FIXED)")


def _write(path, data: np.ndarray, shard_size: int, extra_field: bool = False) -> None:
    fields = [Field("x", "ndarray", data.dtype, data.shape[1:])]
    if extra_field:
        fields.append(Field("tokens", "varray", np.int32))
    samples = [
        {"x": data[i], **({"tokens": np.arange(i % 5, dtype=np.int32)} if extra_field else {})}
        for i in range(len(data))
    ]
    write(samples, str(path), schema=Schema(tuple(fields)), shard_size=shard_size, progress=False)


def _maps_of(path) -> int:
    with open("/proc/self/maps") as fh:
        return sum(str(path) in line for line in fh)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    row_shape=st.sampled_from([(3072,), (3001,), (65,), (7, 13), (3, 5, 5)]),
    dtype=st.sampled_from([np.uint8, np.float32, np.int64, np.float16]),
    n=st.integers(1, 700),
    shard_size=st.sampled_from([16 << 10, 100 << 10, 1 << 20]),
    seed=st.integers(0, 2**16),
    use_table=st.booleans(),
)
def test_shuffled_batches_match_numpy(tmp_path_factory, monkeypatch, row_shape, dtype, n, shard_size, seed, use_table):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 100, (n, *row_shape)).astype(dtype)
    if data[0].nbytes <= 64:
        return  # small fields are kept resident, not spliced
    path = tmp_path_factory.mktemp("ds") / "ds"
    _write(path, data, max(shard_size, 8 * data[0].nbytes + 8192), extra_field=bool(seed % 2))
    monkeypatch.setattr(spliced_mod, "TABLE_ROWS", 1 << 30 if use_table else 0)
    ds = FastloadDataset(path)
    assert "x" in ds.spliced_columns(), "a local dataset's large fixed field is spliced"
    for idx in (rng.permutation(n)[:256], np.arange(n), rng.integers(-n, n, 50), [n - 1, -n, 0, 0], []):
        got = ds.get_batch(idx, fields=["x"])["x"]
        want = data[np.asarray(idx, dtype=np.int64)]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    with pytest.raises(IndexError, match=f"sample index {n} out of range.*{path}"):
        ds.get_batch([0, n])
    with pytest.raises(IndexError, match=f"sample index {-n - 1} out of range"):
        ds.get_batch([-n - 1])
    ds.close()


def test_mixed_fields_keep_schema_order_and_values(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, (900, 200), dtype=np.uint8)
    _write(tmp_path / "ds", data, 32 << 10, extra_field=True)
    ds = FastloadDataset(tmp_path / "ds")
    assert ds.num_shards > 3
    idx = np.random.default_rng(1).permutation(900)[:300]
    batch = ds.get_batch(idx)
    assert list(batch) == ["x", "tokens"]
    np.testing.assert_array_equal(batch["x"], data[idx])
    assert [len(t) for t in batch["tokens"].to_list()] == [i % 5 for i in idx]


def test_unplaceable_parts_fall_back_to_per_shard_gathers(tmp_path):
    """Parts whose offsets cannot share a row grid are refused; the reader then gathers per shard."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(3 * 8192))
    parts = [ColumnPart(str(path), 0, 1), ColumnPart(str(path), 64, 1)]
    assert splice_column(parts, np.dtype(np.uint8), (4096,)) is None
    assert splice_column([], np.dtype(np.uint8), (4096,)) is None


def test_columns_of_a_file_are_spliced_in_place(tmp_path):
    """Two parts of one file: each row reads back the bytes at its file offset."""
    raw = np.random.default_rng(2).integers(0, 255, 40_000, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(raw.tobytes())
    parts = [ColumnPart(str(path), 4096, 3), ColumnPart(str(path), 20_000, 2), ColumnPart(str(path), 64, 0)]
    col = splice_column(parts, np.dtype(np.uint8), (3000,))
    assert col is not None and len(col) == 5
    want = [raw[4096 + i * 3000 : 4096 + (i + 1) * 3000] for i in range(3)]
    want += [raw[20_000 + i * 3000 : 20_000 + (i + 1) * 3000] for i in range(2)]
    np.testing.assert_array_equal(col.take(np.array([4, 0, 3, 1, 2, -1])), np.stack(want)[[4, 0, 3, 1, 2, -1]])
    with pytest.raises(IndexError):
        col.take(np.array([5]))


def test_mapping_lives_until_the_last_array_is_gone(tmp_path):
    data = np.random.default_rng(3).integers(0, 255, (400, 1000), dtype=np.uint8)
    _write(tmp_path / "ds", data, 64 << 10)
    shards = tmp_path / "ds" / "shards"
    ds = FastloadDataset(tmp_path / "ds", max_open_shards=1)
    ds.get_batch([0, 399])
    column = ds.spliced_columns()["x"]
    ds.close()
    gc.collect()
    assert _maps_of(shards) >= 1, "the spliced column still maps its shards while referenced"
    np.testing.assert_array_equal(column.take(np.array([5, 300])), data[[5, 300]])
    del column
    gc.collect()
    assert _maps_of(shards) == 0, "every mapping is released once nothing refers to it"
    np.testing.assert_array_equal(ds.get_batch([7])["x"], data[[7]])  # a closed dataset reopens on use
    del ds
    gc.collect()
    assert _maps_of(shards) == 0


def test_pickled_and_forked_datasets_splice_their_own(tmp_path):
    data = np.random.default_rng(4).integers(0, 255, (500, 700), dtype=np.uint8)
    _write(tmp_path / "ds", data, 64 << 10)
    ds = FastloadDataset(tmp_path / "ds")
    ds.get_batch([1])
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone.get_batch([499, 2])["x"], data[[499, 2]])
    assert clone.spliced_columns()["x"] is not ds.spliced_columns()["x"]  # its own mapping
    read, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reads through the mapping it inherited
        ok = ds.get_batch([10, 400])["x"].tobytes() == data[[10, 400]].tobytes()
        os.write(write_end, b"1" if ok else b"0")
        os._exit(0)
    os.close(write_end)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)


def test_cached_remote_dataset_splices_once_every_shard_is_open(tmp_path):
    """A remote dataset whose cache holds it all gathers per shard until every shard is open
    (pinned), then switches to the spliced path; batches are identical throughout."""
    import fsspec

    from fastload.remote.storage import RemoteStorage

    data = np.random.default_rng(5).integers(0, 255, (600, 500), dtype=np.uint8)
    _write(tmp_path / "ds", data, 64 << 10, extra_field=True)
    fs = fsspec.filesystem("memory")
    for dirpath, _, files in os.walk(tmp_path / "ds"):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as fh:
                fs.pipe_file(f"/splice-ds/{os.path.relpath(full, tmp_path / 'ds')}", fh.read())
    try:
        storage = RemoteStorage("memory://splice-ds", cache_dir=tmp_path / "cache", cache_limit="20MB")
        ds = FastloadDataset(storage=storage, max_open_shards=storage.max_open_shards)
        assert ds.num_shards > 3 and storage.max_open_shards >= ds.num_shards
        order = np.random.default_rng(6).permutation(600)
        for epoch in range(2):
            for s in range(0, 600, 64):
                idx = order[s : s + 64]
                batch = ds.get_batch(idx)
                np.testing.assert_array_equal(batch["x"], data[idx])
                assert [len(t) for t in batch["tokens"].to_list()] == [i % 5 for i in idx]
            if epoch == 0:
                assert "x" in ds.spliced_columns(), "every shard is open after one epoch: spliced"
        ds.close()
    finally:
        fs.rm("/splice-ds", recursive=True)


def test_huge_alignment_gives_way_to_page_alignment_past_the_reserve_limit(tmp_path, monkeypatch):
    """Huge-page congruent placement can cost ~1 GiB of address space a part; past the limit the
    parts are placed page-aligned, with the same rows."""
    data = np.random.default_rng(7).integers(0, 255, (600, 3064), dtype=np.uint8)
    _write(tmp_path / "ds", data, 512 << 10)
    huge = FastloadDataset(tmp_path / "ds")
    span_huge = huge.spliced_columns()["x"].rows.nbytes
    monkeypatch.setattr(spliced_mod, "HUGE_RESERVE_LIMIT", 0)
    paged = FastloadDataset(tmp_path / "ds")
    column = paged.spliced_columns()["x"]
    assert huge.num_shards > 2 and column.rows.nbytes < span_huge // 100
    idx = np.random.default_rng(8).permutation(600)
    np.testing.assert_array_equal(paged.get_batch(idx)["x"], data[idx])


def _huge_advised_maps(path) -> tuple[int, int]:
    """(mappings of files under `path`, those of them with huge-page advice) in this process."""
    total = advised = 0
    mapped = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                mapped = str(path) in line
                total += mapped
            elif mapped and first == "VmFlags:":
                advised += " hg" in line
    return total, advised


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages")
@pytest.mark.parametrize("fits", [True, False])
def test_datasets_that_fit_in_memory_are_mapped_in_huge_page_units(tmp_path, monkeypatch, fits):
    from fastload.formats import reader as reader_mod

    data = np.random.default_rng(9).integers(0, 255, (300, 3064), dtype=np.uint8)
    _write(tmp_path / "ds", data, 256 << 10, extra_field=True)
    if not fits:
        monkeypatch.setattr(reader_mod, "_physical_memory", lambda: 1 << 20)
    ds = FastloadDataset(tmp_path / "ds")
    idx = np.random.default_rng(10).permutation(300)
    np.testing.assert_array_equal(ds.get_batch(idx)["x"], data[idx])
    total, advised = _huge_advised_maps(tmp_path / "ds")
    assert ds.num_shards > 2 and total >= 2 * ds.num_shards  # each shard, and its parts of spliced columns
    assert advised == (total if fits else 0)


# -- mixed records: fixed rows, resident labels and variable fields, all read over every shard ----

MIXED = Schema(
    (
        Field("record", "ndarray", np.dtype(np.uint8), (3, 20, 20)),  # a spliced fixed column (not resident)
        Field("label", "scalar", np.dtype(np.int64)),  # resident
        Field("jpeg", "bytes"),
        Field("tokens", "varray", np.dtype(np.int32)),
        Field("caption", "string"),
    )
)


def _mixed_samples(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "record": rng.integers(0, 256, (3, 20, 20), dtype=np.uint8),
            "label": int(rng.integers(-(2**40), 2**40)),
            "jpeg": rng.bytes(int(rng.integers(0, 3000))),
            "tokens": rng.integers(-(2**31), 2**31, int(rng.integers(0, 400)), dtype=np.int32),
            "caption": "é" * int(rng.integers(0, 6)) + str(i),
        }
        for i in range(n)
    ]


def _as_bytes(batch: dict, i: int) -> dict:
    out = {}
    for name, col in batch.items():
        item = col[i] if not hasattr(col, "offsets") else col.to_list()[i]
        out[name] = item if isinstance(item, (bytes, str)) else np.asarray(item).tobytes()
    return out


def _sample_bytes(sample: dict) -> dict:
    return {k: v if isinstance(v, (bytes, str)) else np.asarray(v).tobytes() for k, v in sample.items()}


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "ds"
    samples = _mixed_samples(600, 5)  # shards of several 64 KiB blocks per field
    write(samples, str(path), schema=MIXED, shard_size=600 << 10, progress=False, workers=1)
    return path, samples


@pytest.mark.parametrize("c_extension", [True, False])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), size=st.integers(0, 90))
def test_mixed_batches_are_byte_for_byte_the_samples(mixed_dataset, monkeypatch, c_extension, seed, size):
    """Shuffled batches (negative indices too) of a dataset of mixed records, read from the spliced
    columns, with and without the `_ranges` extension."""
    from fastload.formats import ragged as ragged_mod

    if not c_extension:
        monkeypatch.setattr(ragged_mod, "_c_gather", None)
    path, samples = mixed_dataset
    ds = FastloadDataset(path)
    assert ds.num_shards >= 3
    ds.get_batch([0])  # maps and splices every field
    rng = np.random.default_rng(seed)
    idx = rng.integers(-len(samples), len(samples), size)
    batch = ds.get_batch(idx)
    assert list(batch) == [f.name for f in MIXED]
    assert batch["record"].shape == (size, 3, 20, 20) and batch["label"].shape == (size,)
    for pos, i in enumerate(idx.tolist()):
        assert _as_bytes(batch, pos) == _sample_bytes(samples[i])
    ds.close()


@pytest.mark.parametrize("field", ["record", "jpeg", "tokens"])
def test_mixed_batch_never_copies_an_unverified_byte(mixed_dataset, tmp_path, field):
    """A flipped byte in one shard's column of `field`: once the columns are spliced, a batch
    touching that block raises ChecksumError naming the file, shard and field's sample; batches
    elsewhere still read correct bytes."""
    import shutil

    from fastload.formats import ChecksumError

    src, samples = mixed_dataset
    path = tmp_path / "ds"
    shutil.copytree(src, path)
    ds = FastloadDataset(path)
    shard = ds.shard(2)
    first, stop = (int(b) for b in ds.shard_boundaries[2:4])

    def nbytes(i: int) -> int:
        return np.asarray(samples[i][field]).nbytes if field != "jpeg" else len(samples[i][field])

    start = shard.fixed_offset[field] if field == "record" else shard.blob_offset[field]
    places = start + np.concatenate([[0], np.cumsum([nbytes(i) for i in range(first, stop)])])
    block = 1 << 16
    # a sample whose first byte lies in a block of this field's bytes only (not one verified on open)
    sample, where = next(
        (first + k, int(p)) for k, p in enumerate(places[:-1])
        if nbytes(first + k) and p // block * block >= start and (p // block + 1) * block <= places[-1]
    )
    file = os.path.join(path, ds.manifest.shards[2].file)
    ds.close()
    with open(file, "r+b") as fh:
        fh.seek(where)
        old = fh.read(1)
        fh.seek(where)
        fh.write(bytes([old[0] ^ 0x40]))
    ds = FastloadDataset(path)
    clean = np.arange(0, int(ds.shard_boundaries[1]))  # shard 0 only
    batch = ds.get_batch(clean[:5])
    batch = ds.get_batch(clean[::-1])  # through the spliced columns, now in place
    for pos, i in enumerate(clean[::-1].tolist()):
        assert _as_bytes(batch, pos) == _sample_bytes(samples[i])
    with pytest.raises(ChecksumError, match=rf"{ds.manifest.shards[2].file}.*shard 2"):
        ds.get_batch(np.array([0, sample, 1]))
    with pytest.raises(ChecksumError):
        ds.get_batch(np.array([sample]))  # still refused: a failed block is never taken as verified
    ds.close()
