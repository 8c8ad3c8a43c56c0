"""The fastload format: byte-for-byte round trips, batched reads, and every bad-input case."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fastload.dataset import open_dataset
from fastload.formats import FastloadDataset, Field, FormatError, Ragged, Schema, SchemaError, write
from fastload.formats.layout import ENTRY_DTYPE, HEADER_DTYPE
from fastload.formats.verify import verify_dataset

NUMERIC = st.sampled_from([np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_])


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return type(a) is type(b) and a == b


@st.composite
def datasets(draw):
    """A schema covering a random subset of kinds and 1-40 samples of it."""
    fields, gens = [], []
    if draw(st.booleans()):
        dt = np.dtype(draw(NUMERIC))
        fields.append(Field("scalar", "scalar", dt))
        gens.append(hnp.from_dtype(dt).map(lambda v: v.item()))
    if draw(st.booleans()):
        dt = np.dtype(draw(NUMERIC))
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, max_side=4))
        fields.append(Field("array", "ndarray", dt, shape))
        gens.append(hnp.arrays(dt, shape))
    if draw(st.booleans()):
        fields.append(Field("blob", "bytes"))
        gens.append(st.binary(max_size=300))
    if draw(st.booleans()):
        fields.append(Field("text", "string"))
        gens.append(st.text(max_size=50))
    if draw(st.booleans()) or not fields:
        dt = np.dtype(draw(st.sampled_from([np.int32, np.int64, np.uint16, np.float32])))
        fields.append(Field("tokens", "varray", dt))
        gens.append(hnp.arrays(dt, st.integers(0, 70)))
    n = draw(st.integers(1, 40))
    rows = draw(st.lists(st.tuples(*gens), min_size=n, max_size=n))
    samples = [{f.name: v for f, v in zip(fields, row)} for row in rows]
    return Schema(tuple(fields)), samples


def _expected(schema: Schema, sample: dict) -> dict:
    out = {}
    for f in schema:
        v = sample[f.name]
        if f.kind == "scalar":
            out[f.name] = np.asarray(v, dtype=f.dtype).item()
        elif f.kind in ("ndarray", "varray"):
            out[f.name] = np.asarray(v, dtype=f.dtype)
        else:
            out[f.name] = v
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=datasets(), shard_size=st.sampled_from([4096, 8192, 1 << 20]), seed=st.integers(0, 2**16))
def test_round_trip_every_kind(tmp_path_factory, data, shard_size, seed):
    schema, samples = data
    out = tmp_path_factory.mktemp("ds")
    write(samples, out / "ds", schema=schema, shard_size=shard_size, progress=False, workers=1)
    ds = FastloadDataset(out / "ds")
    assert len(ds) == len(samples)
    expected = [_expected(schema, s) for s in samples]
    for i, exp in enumerate(expected):
        got = ds[i]
        assert got.keys() == exp.keys()
        for k in exp:
            assert _equal(got[k], exp[k]), (i, k, got[k], exp[k])
    order = np.random.default_rng(seed).integers(0, len(samples), size=min(64, 3 * len(samples)))
    for got, i in zip(ds.__getitems__(order.tolist()), order):
        for k in expected[i]:
            assert _equal(got[k], expected[i][k])
    batch = ds.get_batch(order)
    for f in schema:
        if f.is_fixed:
            assert batch[f.name].shape == (len(order), *f.shape)
        else:
            assert isinstance(batch[f.name], Ragged)
            np.testing.assert_array_equal(batch[f.name].lengths, ds.lengths(f.name)[order])
    assert verify_dataset(out / "ds") == []


def test_images_store_height_and_width(tmp_path):
    from io import BytesIO

    from PIL import Image

    samples = []
    for i, (h, w) in enumerate([(10, 20), (33, 7), (64, 64)]):
        buf = BytesIO()
        Image.new("RGB", (w, h), (i, 2 * i, 3 * i)).save(buf, format="PNG" if i % 2 else "JPEG")
        samples.append({"image": buf.getvalue(), "label": i})
    schema = Schema((Field("image", "image"), Field("label", "scalar", np.int64)))
    write(samples, tmp_path / "ds", schema=schema, progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    np.testing.assert_array_equal(ds.image_sizes("image"), [[10, 20], [33, 7], [64, 64]])
    assert ds[1]["image"] == samples[1]["image"]
    with pytest.raises(SchemaError, match=r"sample 1, field 'image'.*not a readable image"):
        write(
            [samples[0], {"image": b"not an image", "label": 1}],
            tmp_path / "bad",
            schema=schema,
            progress=False,
        )


def _fixed_dataset(path, n=3000, shard_size=64 << 10, **kw):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, (n, 48), dtype=np.uint8)
    samples = [{"x": data[i], "label": i, "tokens": np.arange(i % 17, dtype=np.int32)} for i in range(n)]
    schema = Schema(
        (
            Field("x", "ndarray", np.uint8, (48,)),
            Field("label", "scalar", np.int64),
            Field("tokens", "varray", np.int32),
        )
    )
    write(samples, path, schema=schema, shard_size=shard_size, progress=False, **kw)
    return data, samples


def test_batched_read_matches_per_sample_in_any_order(tmp_path):
    data, _ = _fixed_dataset(tmp_path / "ds")
    ds = FastloadDataset(tmp_path / "ds")
    assert ds.num_shards > 3
    rng = np.random.default_rng(1)
    for idx in (rng.permutation(3000)[:256], np.sort(rng.permutation(3000)[:256]), [5, 5, 5, -1], []):
        batch = ds.get_batch(idx)
        np.testing.assert_array_equal(batch["x"], data[np.asarray(idx, dtype=np.int64)])
        np.testing.assert_array_equal(batch["label"], np.arange(3000)[np.asarray(idx, dtype=np.int64)])
        assert [len(t) for t in batch["tokens"].to_list()] == [int(i) % 3000 % 17 for i in np.asarray(idx) % 3000]
    with pytest.raises(IndexError, match="3000 out of range"):
        ds.get_batch([0, 3000])


def test_output_is_deterministic_and_independent_of_workers(tmp_path):
    _fixed_dataset(tmp_path / "a", workers=1)
    _fixed_dataset(tmp_path / "b", workers=3)
    files = sorted(os.listdir(tmp_path / "a" / "shards"))
    assert files == sorted(os.listdir(tmp_path / "b" / "shards"))
    for name in [*(f"shards/{f}" for f in files), "index.json", "meta.bin", "blocks.bin"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


class MapSource:
    """A map-style source (encoded in worker processes by `write`)."""

    def __len__(self):
        return 2500

    def __getitem__(self, i):
        return {"v": np.full(10, i, dtype=np.int32), "s": f"sample-{i}"}


def test_inferred_schema_tells_variable_from_fixed_arrays(tmp_path):
    samples = [{"fixed": np.zeros(3, np.float32), "var": np.arange(i % 4, dtype=np.int16)} for i in range(10)]
    write(samples, tmp_path / "ds", progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    assert ds.schema["fixed"].kind == "ndarray" and ds.schema["fixed"].shape == (3,)
    assert ds.schema["var"].kind == "varray" and ds.schema["var"].dtype == np.int16
    assert ds[3]["var"].tolist() == [0, 1, 2]


def test_map_style_source_in_worker_processes(tmp_path):
    write(MapSource(), tmp_path / "ds", shard_size=8192, workers=2, progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    assert len(ds) == 2500
    assert ds[2499]["s"] == "sample-2499" and (ds[1234]["v"] == 1234).all()


# -- bad input ---------------------------------------------------------------------------------


@pytest.fixture()
def small_ds(tmp_path):
    _fixed_dataset(tmp_path / "ds", n=600, shard_size=16 << 10)
    return tmp_path / "ds"


def _manifest(path):
    return json.loads((path / "index.json").read_text())


def _rewrite_manifest(path, body):
    """Write a manifest with a valid self-checksum (so the reader must catch the real problem)."""
    body.pop("checksum", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = xxhash.xxh3_64_hexdigest(canonical)
    (path / "index.json").write_text(json.dumps(body))


def _first_shard(path):
    return path / _manifest(path)["shards"][0]["file"]


def _read_all(path, verify=None):
    ds = FastloadDataset(path, verify=verify)
    return ds.get_batch(np.arange(len(ds)))


def _structure_and_checksum_errors(path, name, message):
    """The structural check names the problem with checksums off; by default the checksum (or it) does."""
    with pytest.raises(FormatError, match=rf"{name}.*{message}"):
        _read_all(path, verify="none")
    with pytest.raises(FormatError, match=rf"{name}.*({message}|checksum)"):
        _read_all(path)


def test_truncated_shard_is_named(small_ds):
    shard = _first_shard(small_ds)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(FormatError, match=rf"{shard.name}.*truncated"):
        _read_all(small_ds)
    assert any(shard.name in p for p in verify_dataset(small_ds))


def test_flipped_bytes_fail_verification_and_checksummed_open(small_ds):
    shard = _first_shard(small_ds)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    problems = verify_dataset(small_ds)
    assert len(problems) == 1 and shard.name in problems[0] and "checksum" in problems[0]
    with pytest.raises(FormatError, match="checksum"):
        ds = FastloadDataset(small_ds, verify="full")
        ds.get_batch(np.arange(len(ds)))


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, b"XXXXXXXX", "bad magic"),
        (8, (99).to_bytes(4, "little"), "format version 99"),
        (16, (7).to_bytes(8, "little"), "7 samples in shard header"),
    ],
)
def test_bad_header_fields(small_ds, offset, value, message):
    shard = _first_shard(small_ds)
    raw = bytearray(shard.read_bytes())
    raw[offset : offset + len(value)] = value
    shard.write_bytes(bytes(raw))
    _structure_and_checksum_errors(small_ds, shard.name, message)


def _field_entry_offset(field_index: int) -> int:
    return HEADER_DTYPE.itemsize + 64 * field_index


@pytest.mark.parametrize(
    ("entry_byte", "value", "message"),
    [
        (24, (1 << 62).to_bytes(8, "little"), "offsets_offset is .* the layout puts it"),  # far out of range
        (40, (10**9).to_bytes(8, "little"), "blob_bytes 1000000000 exceed the file"),  # larger than the file
        (8, (1 << 63).to_bytes(8, "little"), "fixed_offset is .* the layout puts it"),  # huge ("negative")
        (8, (4096 + 4).to_bytes(8, "little"), "fixed_offset is 4100, the layout puts it at 4096"),  # moved by 4
        (0, (99).to_bytes(4, "little"), "kind code 99 does not match schema kind"),
        (4, (3).to_bytes(4, "little"), "fixed column size does not match"),
        (56, b"\x01", "reserved bytes are not zero"),
        (48, b"\x01", "written for another definition of this field"),
    ],
)
def test_out_of_range_section_offsets(small_ds, entry_byte, value, message):
    shard = _first_shard(small_ds)
    raw = bytearray(shard.read_bytes())
    field = 2 if entry_byte in (24, 40) else 0  # tokens (variable) / x (fixed)
    pos = _field_entry_offset(field) + entry_byte
    raw[pos : pos + len(value)] = value
    shard.write_bytes(bytes(raw))
    _structure_and_checksum_errors(small_ds, shard.name, message)


def test_corrupt_offsets_table_is_caught_on_open(small_ds):
    shard = _first_shard(small_ds)
    raw = bytearray(shard.read_bytes())
    entry = np.frombuffer(bytes(raw[_field_entry_offset(2) : _field_entry_offset(3)]), dtype="<u8")
    offsets_offset = int(entry[3])
    pos = offsets_offset + 8 * 5
    raw[pos : pos + 8] = (10**6).to_bytes(8, "little")
    shard.write_bytes(bytes(raw))
    _structure_and_checksum_errors(small_ds, shard.name, "field 'tokens'.*offsets decrease")


def test_manifest_listing_a_missing_shard(small_ds):
    _first_shard(small_ds).unlink()
    with pytest.raises(FormatError, match="shard-00000.fls.*shard file is missing"):
        _read_all(small_ds)


@pytest.mark.parametrize("bad", ["../outside.fls", "/etc/passwd", "shards/../../x.fls", "a\\b"])
def test_manifest_paths_must_stay_inside_the_root(small_ds, bad):
    body = _manifest(small_ds)
    body["shards"][0]["file"] = bad
    _rewrite_manifest(small_ds, body)
    with pytest.raises(FormatError, match="leaves the dataset root|invalid file name"):
        FastloadDataset(small_ds)


def test_symlinked_shard_outside_root_is_refused(small_ds, tmp_path):
    shard = _first_shard(small_ds)
    target = tmp_path / "elsewhere.fls"
    shutil.move(shard, target)
    shard.symlink_to(target)
    with pytest.raises(FormatError, match="outside the dataset root"):
        _read_all(small_ds)


def test_local_paths_resolve_as_realpath_does(tmp_path):
    """`LocalStorage.path` resolves links (to files, directories, chains, dangling ones, missing
    names) exactly as `os.path.realpath`, and refuses the ones that leave the root."""
    from fastload.formats.storage import LocalStorage

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "dir").mkdir(parents=True)
    outside.mkdir()
    (root / "file").write_bytes(b"x")
    (root / "dir" / "inner").write_bytes(b"y")
    (outside / "secret").write_bytes(b"z")
    (root / "to_file").symlink_to(root / "file")
    (root / "relative").symlink_to("dir/inner")
    (root / "chain").symlink_to("relative")
    (root / "to_dir").symlink_to(root / "dir")
    (root / "dangling").symlink_to(root / "missing")
    (root / "escape").symlink_to(outside / "secret")
    (root / "escape_dir").symlink_to(outside)
    storage = LocalStorage(root)
    inside = ["file", "dir/inner", "to_file", "relative", "chain", "to_dir/inner", "dangling", "missing", "dir/none"]
    for name in inside:
        assert storage.path(name) == os.path.realpath(root / name), name
    for name in ("escape", "escape_dir/secret"):
        with pytest.raises(FormatError, match="outside the dataset root"):
            storage.path(name)


def test_edited_manifest_fails_its_checksum(small_ds):
    body = _manifest(small_ds)
    body["shards"][0]["num_samples"] += 1
    (small_ds / "index.json").write_text(json.dumps(body))
    with pytest.raises(FormatError, match="manifest checksum mismatch"):
        FastloadDataset(small_ds)


def test_manifest_sample_count_mismatch(small_ds):
    body = _manifest(small_ds)
    body["shards"][0]["num_samples"] += 1
    body["num_samples"] += 1
    _rewrite_manifest(small_ds, body)
    with pytest.raises(FormatError, match="index.json: meta has no per-sample lengths for field 'tokens'"):
        _read_all(small_ds)
    # Without variable fields the shard header catches it.
    write([{"x": i} for i in range(50)], small_ds.parent / "fixed", shard_size=4096, progress=False)
    body = _manifest(small_ds.parent / "fixed")
    body["shards"][0]["num_samples"] += 1
    body["num_samples"] += 1
    _rewrite_manifest(small_ds.parent / "fixed", body)
    with pytest.raises(FormatError, match="shard-00000.fls.*samples in shard header, manifest says"):
        _read_all(small_ds.parent / "fixed")


def test_blocks_bin_holds_every_shards_block_table_in_shard_order(small_ds):
    """blocks.bin is the shards' checksum tables, back to back: each slice (where the manifest's table
    sizes put it) is byte for byte the table at the end of its shard, and hashes to `blocks_xxh3`."""
    body = _manifest(small_ds)
    data = (small_ds / "blocks.bin").read_bytes()
    assert body["blocks"] == {"file": "blocks.bin", "bytes": len(data)}
    ds = FastloadDataset(small_ds)
    offsets = ds.manifest.table_offsets()
    assert len(body["shards"]) >= 2 and offsets[-1] == len(data)
    for k, shard in enumerate(body["shards"]):
        table = data[offsets[k] : offsets[k + 1]]
        assert table == ds.shard(k).table.tobytes()
        assert xxhash.xxh3_64_hexdigest(table) == shard["blocks_xxh3"]
        assert table == (small_ds / shard["file"]).read_bytes()[-len(table) :]


@pytest.mark.parametrize(("entry", "message"), [
    ({"file": "blocks.bin", "bytes": 8}, "blocks: blocks.bin has 8 bytes, the shards' checksum tables take"),
    ({"file": "../blocks.bin", "bytes": 0}, "leaves the dataset root"),
    ({"file": "blocks.bin"}, "blocks bytes: expected an integer"),
    ("blocks.bin", "blocks: expected"),
])
def test_a_bad_blocks_entry_is_a_format_error(small_ds, entry, message):
    body = _manifest(small_ds)
    body["blocks"] = entry
    _rewrite_manifest(small_ds, body)
    with pytest.raises(FormatError, match=message):
        FastloadDataset(small_ds)


def test_a_dataset_without_blocks_bin_reads_and_verifies(small_ds):
    """Datasets written before blocks.bin existed have no `blocks` entry: they read and verify as before."""
    want = _read_all(small_ds)
    body = _manifest(small_ds)
    del body["blocks"]
    _rewrite_manifest(small_ds, body)
    (small_ds / "blocks.bin").unlink()
    got = _read_all(small_ds)
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in ("x", "label"))
    assert verify_dataset(small_ds) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_verify_names_a_blocks_bin_that_does_not_hold_the_tables(small_ds, damage):
    path = small_ds / "blocks.bin"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-8]))
    else:
        path.unlink()
    problems = verify_dataset(small_ds)
    assert len(problems) == 1 and "blocks.bin" in problems[0], problems
    expected = {"flip": r"bytes \[\d+, \d+\) are not the block checksum table of .*shard-\d+\.fls",
                "truncate": "bytes, the manifest says", "missing": "missing"}[damage]
    assert re.search(expected, problems[0]), problems[0]
    _read_all(small_ds)  # a local reader reads each table in its shard


def test_garbage_manifest(small_ds):
    (small_ds / "index.json").write_bytes(b"\x00\xff not json")
    with pytest.raises(FormatError, match="index.json: not valid JSON"):
        FastloadDataset(small_ds)


def test_sample_larger_than_shard_size(tmp_path):
    samples = [{"b": b"x" * 100}, {"b": b"y" * 10_000}]
    with pytest.raises(SchemaError, match="sample 1 is .* bytes, larger than the shard size 4096"):
        write(samples, tmp_path / "ds", shard_size=4096, progress=False)
    assert not (tmp_path / "ds" / "index.json").exists()


def test_empty_source(tmp_path):
    with pytest.raises(ValueError, match="source is empty"):
        write([], tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds" / "index.json").exists()


@pytest.mark.parametrize(
    ("bad_value", "message"),
    [
        ("a string", "sample 2, field 'label': expected scalar of int64, got str"),
        (1.5, "sample 2, field 'label': expected scalar of int64"),
        (np.zeros(3), "sample 2, field 'label': expected a scalar"),
    ],
)
def test_mismatched_field_types_name_sample_and_field(tmp_path, bad_value, message):
    samples = [{"label": 0}, {"label": 1}, {"label": bad_value}]
    with pytest.raises(SchemaError, match=message):
        write(samples, tmp_path / "ds", progress=False)


def test_mismatched_shapes_and_missing_fields(tmp_path):
    fixed = Schema((Field("x", "ndarray", np.float64, (3,)),))
    with pytest.raises(SchemaError, match=r"sample 1, field 'x': shape \(4,\) != schema shape \(3,\)"):
        write([{"x": np.zeros(3)}, {"x": np.zeros(4)}], tmp_path / "a", schema=fixed, progress=False)
    with pytest.raises(SchemaError, match=r"sample 1: fields differ from the schema \(missing \['y'\]"):
        write([{"x": 1, "y": 2}, {"x": 1}], tmp_path / "b", progress=False)
    with pytest.raises(SchemaError, match="cannot store a value of type dict"):
        write([{"x": {"nested": 1}}], tmp_path / "c", progress=False)


def test_refuses_to_overwrite_a_dataset(small_ds):
    with pytest.raises(FileExistsError, match="already holds a dataset"):
        write([{"x": 1}], small_ds, progress=False)


def test_incomplete_conversion_does_not_open(tmp_path):
    _fixed_dataset(tmp_path / "ds")
    (tmp_path / "ds" / "index.json").unlink()
    with pytest.raises(FormatError, match="no manifest .*--resume"):
        FastloadDataset(tmp_path / "ds")


def test_dataset_pickles_for_spawned_workers(small_ds):
    import pickle

    ds = FastloadDataset(small_ds)
    ds.get_batch([0, 599])
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone.get_batch([3, 500])["x"], ds.get_batch([3, 500])["x"])


def test_max_open_shards_bounds_the_mappings(small_ds):
    ds = FastloadDataset(small_ds, max_open_shards=2)
    ref = FastloadDataset(small_ds)
    for start in range(0, 600, 50):
        idx = np.arange(start, min(600, start + 50))
        np.testing.assert_array_equal(ds.get_batch(idx[::-1])["x"], ref.get_batch(idx[::-1])["x"])
        assert ds.open_shards <= 2


# -- fuzzing: any corruption gives FormatError (or, without checksums, data from inside the file) ------


@pytest.fixture(scope="module")
def fuzz_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "ds"
    samples = [
        {"x": np.full(3, i, np.int32), "t": np.arange(i % 5, dtype=np.int16), "s": "ab" * (i % 3), "b": bytes(i % 4)}
        for i in range(40)
    ]
    write(samples, path, shard_size=4096, progress=False)
    return path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from(["shard", "manifest", "meta"]),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4),
    truncate=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
    checked=st.booleans(),
)
def test_fuzzed_files_never_crash_the_reader(tmp_path_factory, fuzz_source, target, edits, truncate, checked):
    path = tmp_path_factory.mktemp("case") / "ds"
    shutil.copytree(fuzz_source, path)
    victim = {"shard": _first_shard(path), "manifest": path / "index.json", "meta": path / "meta.bin"}[target]
    raw = bytearray(victim.read_bytes())
    original = bytes(raw)
    for pos, value in edits:
        raw[int(pos * len(raw))] = value
    if truncate is not None:
        raw = raw[: int(truncate * len(raw))]
    victim.write_bytes(bytes(raw))
    changed = bytes(raw) != original
    try:
        ds = FastloadDataset(path, verify="full" if checked else "none")
        batch = ds.get_batch(np.arange(len(ds)))
        items = [ds[i] for i in range(len(ds))]
    except FormatError:
        return
    # It opened: only possible when the change left every structure intact; with checksums, not at all.
    assert not (checked and changed and target == "shard"), "a modified shard passed checksum verification"
    if target == "manifest":  # only a whitespace-only change (e.g. the trailing newline cut) may pass
        assert json.loads(bytes(raw)) == json.loads(original), "a modified manifest passed its checksum"
    else:
        assert target == "shard" or not changed, "a modified meta.bin passed its checksum"
    assert len(items) == len(batch["x"]) == 40


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["bytes", "image", "string", "varray"]),
    items=st.lists(st.text(max_size=20), max_size=30),
    lead=st.integers(0, 5),
)
def test_ragged_to_list_matches_per_sample_access(kind, items, lead):
    """`to_list` (vectorised) returns exactly what indexing sample by sample does, also for a
    Ragged whose offsets do not start at 0 (a window into a larger buffer)."""
    parts = [np.frombuffer(s.encode("utf-8"), np.uint8) for s in items]
    values = np.concatenate([np.zeros(lead, np.uint8), *parts, np.zeros(3, np.uint8)])
    offsets = np.cumsum([lead, *[len(p) for p in parts]]).astype(np.int64)
    if kind == "varray":
        values = values.astype(np.int32)
    ragged = Ragged(values, offsets, kind)
    got, want = ragged.to_list(), [ragged[i] for i in range(len(ragged))]
    assert len(got) == len(want) == len(items)
    for a, b in zip(got, want):
        assert _equal(a, b)
    if kind == "string":
        assert got == items


# -- absurd integers: every manifest and shard-header integer is range-checked before it sizes anything --

# each integer the manifest holds (the fuzz source's schema[0] is `x`, an ndarray of shape [3])
MANIFEST_INTS = [
    ("num_samples",),
    ("version",),
    ("block_log2",),
    ("dataset_id",),
    ("shards", 0, "num_samples"),
    ("shards", 0, "bytes"),
    ("shards", -1, "num_samples"),
    ("shards", -1, "bytes"),
    ("meta", "bytes"),
    ("meta", "columns", 0, "offset"),
    ("meta", "columns", 0, "shape", 0),
    ("meta", "columns", -1, "offset"),
    ("schema", 0, "shape", 0),
]
ABSURD = st.one_of(
    st.sampled_from([2**64 + 7, 10**30, 2**63, 2**64 - 1, -1, -(2**63), -(10**30)]),
    st.integers(min_value=2**40),  # past any file size, or past what a manifest can be trusted to size
    st.integers(max_value=-1),
    st.sampled_from([True, False, 1.5, 1e300, "12", None, [], {}]),
)
# each integer field of a shard header and of its field table, as (byte offset, width)
HEADER_INTS = [(HEADER_DTYPE.fields[n][1], HEADER_DTYPE[n].itemsize) for n in HEADER_DTYPE.names if n != "magic"]
ENTRY_INTS = [(ENTRY_DTYPE.fields[n][1], ENTRY_DTYPE[n].itemsize) for n in ENTRY_DTYPE.names if n != "reserved"]


def _set_path(body, path, value):
    node = body
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    node[path[-1]] = value
    return old


def _open_and_read_all(path, verify):
    """Open through `open_dataset` and read every sample both ways."""
    ds = open_dataset(path, verify=verify)
    ds.get_batch(np.arange(len(ds)))
    for i in range(len(ds)):
        ds[i]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(MANIFEST_INTS), value=ABSURD, verify=st.sampled_from(["auto", "none"]))
def test_absurd_manifest_integers_are_a_clean_format_error(tmp_path_factory, fuzz_source, target, value, verify):
    """A re-signed manifest with a huge, overflowing, negative or non-integer value in any integer field:
    `open_dataset` (or the first read) raises FormatError naming index.json; never MemoryError,
    OverflowError or data."""
    path = tmp_path_factory.mktemp("case") / "ds"
    shutil.copytree(fuzz_source, path)
    body = _manifest(path)
    if target == ("dataset_id",) and isinstance(value, int) and not isinstance(value, bool):
        value = f"{value:x}" if value >= 0 else f"-{-value:x}"  # stored as hex digits: an absurd number of them
    _set_path(body, target, value)
    _rewrite_manifest(path, body)
    with pytest.raises(FormatError, match=rf"{path}/(index\.json|meta\.bin|shards/)"):
        _open_and_read_all(path, verify)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from([("header", *f) for f in HEADER_INTS] + [("entry", *f) for f in ENTRY_INTS]),
    field=st.integers(0, 3),
    high=st.floats(0.5, 1.0),
    pattern=st.sampled_from(["all-ones", "top-bit", "random-high"]),
    verify=st.sampled_from(["auto", "none"]),
)
def test_absurd_shard_header_integers_are_a_clean_format_error(
    tmp_path_factory, fuzz_source, target, field, high, pattern, verify
):
    """A shard whose header or field-table integer is set to a huge value (the manifest's size and
    whole-file checksum recomputed): FormatError naming the shard, with block checksums on or off."""
    place, offset, width = target
    path = tmp_path_factory.mktemp("case") / "ds"
    shutil.copytree(fuzz_source, path)
    shard = _first_shard(path)
    raw = bytearray(shard.read_bytes())
    pos = offset + (HEADER_DTYPE.itemsize + ENTRY_DTYPE.itemsize * field if place == "entry" else 0)
    top = 8 * width
    value = {
        "all-ones": 2**top - 1,
        "top-bit": 2 ** (top - 1),
        "random-high": int(2**top * high) % 2**top | 2 ** (top - 2),
    }[pattern]
    assert int.from_bytes(raw[pos : pos + width], "little") != value  # no field of the source holds such a value
    raw[pos : pos + width] = value.to_bytes(width, "little")
    shard.write_bytes(bytes(raw))
    body = _manifest(path)
    body["shards"][0]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(raw))
    _rewrite_manifest(path, body)
    with pytest.raises(FormatError, match=rf"{shard}"):
        _open_and_read_all(path, verify)


@pytest.mark.parametrize(
    ("value", "shown"),
    [(2**64 + 7, "18446744073709551623 is out of range"), (10**30, "1" + "0" * 30 + " is out of range"),
     (-1, "-1 is out of range"), (True, "expected an integer, got True"), ("12", "expected an integer, got '12'")],
)  # fmt: skip
def test_absurd_shard_size_from_open_inspect_and_verify(small_ds, capsys, value, shown):
    from fastload.cli import main

    body = _manifest(small_ds)
    body["shards"][1]["bytes"] = value
    _rewrite_manifest(small_ds, body)
    where = f"{small_ds}/index.json shard #1 (shards/shard-00001.fls) bytes: {shown}"
    with pytest.raises(FormatError) as info:
        open_dataset(small_ds)
    assert str(info.value).startswith(where)
    assert main(["inspect", str(small_ds)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastload inspect: error: {where}") and err.count("\n") == 1
    assert main(["verify", str(small_ds)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"BAD  {where}") and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "why"),
    [(b'{"format": "fastload-dataset", "version": 2, "num_samples": 9' + b"9" * 5000 + b"}", "ValueError: Exceeds"),
     (b"[" * 100_000 + b"]" * 100_000, "RecursionError")],
)  # fmt: skip
def test_manifest_beyond_what_json_parses_is_a_format_error(small_ds, text, why):
    (small_ds / "index.json").write_bytes(text)
    with pytest.raises(FormatError, match=rf"{small_ds}/index\.json: not valid JSON \({why}"):
        open_dataset(small_ds)


def test_large_in_range_shard_size_is_checked_against_the_file_before_any_memory_is_sized(small_ds, capsys):
    from fastload.cli import main

    body = _manifest(small_ds)
    body["shards"][1]["bytes"] = 2**62  # a legal file size: the ledger must not be sized from it
    _rewrite_manifest(small_ds, body)
    # the manifest's blocks.bin no longer holds the tables of shards of those sizes: it does not open
    with pytest.raises(FormatError, match=r"index.json blocks: blocks.bin has \d+ bytes, the shards' checksum tables "
                                          rf"take {8 * -(-2**62 // (2**16 + 8)) + 8 * (len(body['shards']) - 1)}"):
        open_dataset(small_ds)
    del body["blocks"]  # as a dataset written before blocks.bin: the shard's size is checked against its file
    _rewrite_manifest(small_ds, body)
    ds = open_dataset(small_ds)
    with pytest.raises(FormatError, match=rf"shard-00001\.fls \(shard 1\): file is \d+ bytes, manifest says {2**62}"):
        ds.get_batch(np.arange(len(ds)))
    shard = rf"{small_ds}/shards/shard-00001\.fls \(shard 1\)"
    where = rf"{shard}: \d+ bytes, manifest says {2**62} \(truncated or replaced\?\)"
    assert main(["inspect", str(small_ds)]) == 2
    assert re.fullmatch(rf"fastload inspect: error: {where}\n", capsys.readouterr().err)
    assert main(["verify", str(small_ds)]) == 1
    assert re.match(rf"BAD  {where}\n", capsys.readouterr().err)


def test_sample_counts_must_fit_their_shards(small_ds):
    body = _manifest(small_ds)
    body["shards"][0]["num_samples"] += 2**50  # the total kept: shard 1 goes negative
    body["shards"][1]["num_samples"] -= 2**50
    _rewrite_manifest(small_ds, body)
    with pytest.raises(FormatError, match=r"shard #1 \(shards/shard-00001\.fls\) num_samples: -\d+ is out of range"):
        open_dataset(small_ds)
    body["shards"][1]["num_samples"] = 0
    body["num_samples"] = sum(s["num_samples"] for s in body["shards"])
    _rewrite_manifest(small_ds, body)
    n = body["shards"][0]["num_samples"]
    with pytest.raises(FormatError, match=rf"shard #0 \(shards/shard-00000\.fls\) num_samples: {n} samples need"):
        open_dataset(small_ds)


@pytest.mark.parametrize(
    ("kind", "shape", "message"),
    [("ndarray", (2**40, 2**40), "bytes per sample, more than"), ("ndarray", (1,) * 33, "33 dimensions"),
     ("vndarray", (-1, 2**33), "exceeds 4294967295")],
)  # fmt: skip
def test_schema_shapes_are_bounded(kind, shape, message):
    with pytest.raises(SchemaError, match=message):
        Field("x", kind, np.float32, shape)
