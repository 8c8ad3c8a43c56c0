"""Integrity by default: a seeded mutation fuzz over small datasets, and the verification mechanism.

Every mutation class of issues 20 and 34 is applied to copies of two small datasets (a fixed-size
one read through the Loader's direct path, a mixed one read by shard): bytes flipped in shards,
meta.bin and the manifest, with and without the manifest's checksums recomputed; truncations;
swapped shard entries; moved section offsets; monotone edits of an offsets table; a manifest
re-signed as version 1 over a corrupted version-2 shard; absurd integers in the manifest. With
default settings every read must return the original bytes or raise a fastload error naming the
file: never wrong data, never another exception.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import warnings

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats import (
    ChecksumError,
    FastloadDataset,
    Field,
    FormatError,
    Ragged,
    Schema,
    SchemaError,
    write,
)
from fastload.formats.layout import ENTRY_DTYPE, HEADER_DTYPE
from fastload.formats.manifest import Manifest
from fastload.formats.verify import verify_dataset
from fastload.loader import Loader

MUTATIONS_PER_DATASET = 160


def _fixed_samples(n: int = 600) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"x": rng.integers(0, 255, 1000, dtype=np.uint8), "label": int(i)} for i in range(n)]


def _mixed_samples(n: int = 120) -> list[dict]:
    rng = np.random.default_rng(2)
    return [
        {
            "text": "".join(chr(0x61 + int(c)) for c in rng.integers(0, 26, int(rng.integers(0, 40)))) + "é",
            "tokens": rng.integers(-1000, 1000, int(rng.integers(0, 300)), dtype=np.int32),
            "blob": rng.bytes(int(rng.integers(0, 900))),
            "y": float(i) / 3,
        }
        for i in range(n)
    ]


FIXED_SCHEMA = Schema(
    (Field("x", "ndarray", np.dtype(np.uint8), (1000,)), Field("label", "scalar", np.dtype(np.int64)))
)
MIXED_SCHEMA = Schema(
    (
        Field("text", "string"),
        Field("tokens", "varray", np.dtype(np.int32)),
        Field("blob", "bytes"),
        Field("y", "scalar", np.dtype(np.float64)),
    )
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    out = {}
    for name, schema, samples, shard_size in (
        ("fixed", FIXED_SCHEMA, _fixed_samples(), 200_000),  # 3 shards of a few 64 KiB blocks
        ("mixed", MIXED_SCHEMA, _mixed_samples(), 40_000),
    ):
        write(samples, root / name, schema=schema, shard_size=shard_size, workers=1, progress=False)
        out[name] = (root / name, _read_everything(root / name, name))
    return out


def _read_everything(path, kind: str) -> dict[str, list[bytes]]:
    """Every sample's fields as bytes, read with default settings (Loader for the fixed dataset)."""
    ds = FastloadDataset(path)
    n = len(ds)
    out: dict[str, list[bytes]] = {}
    if kind == "fixed":
        order = np.random.default_rng(0).permutation(n)
        got: dict[str, list] = {"x": [None] * n, "label": [None] * n}
        loader = Loader(ds, batch_size=64, sampler=order.tolist(), num_workers=0)
        pos = 0
        for _ in range(2):  # a second epoch reads through the epoch plan
            pos = 0
            for batch in loader:
                for i in range(len(batch["label"])):
                    idx = order[pos + i]
                    got["x"][idx] = (str(batch["x"].dtype), batch["x"][i].numpy().tobytes())
                    got["label"][idx] = (str(batch["label"].dtype), batch["label"][i].numpy().tobytes())
                pos += len(batch["label"])
        assert pos == n
        return got
    order = np.random.default_rng(0).permutation(n)
    for start in range(0, n, 17):
        idx = order[start : start + 17]
        batch = ds.get_batch(idx)
        for name, col in batch.items():
            values = out.setdefault(name, [None] * n)
            for j, i in enumerate(idx):
                if isinstance(col, Ragged):
                    part = col.values[col.offsets[j] : col.offsets[j + 1]]
                else:
                    part = np.asarray(col[j])
                values[i] = (part.dtype.str, col.kind if isinstance(col, Ragged) else "", part.tobytes())
    for i in (0, n - 1):  # and the per-sample path
        s = ds[i]
        assert s["text"].encode() == out["text"][i][2]
    return out


def _load_manifest(path) -> dict:
    return json.loads((path / "index.json").read_bytes())


def _save_manifest(path, body: dict, *, recompute: bool) -> None:
    body = dict(body)
    body.pop("checksum", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = xxhash.xxh3_64_hexdigest(canonical) if recompute else "0" * 16
    (path / "index.json").write_bytes(json.dumps(body, indent=1, sort_keys=True).encode())


def _resign_shard(path, k: int) -> None:
    """Recompute the manifest's size and whole-file xxh3 of shard k (an attacker's or a buggy tool's edit)."""
    body = _load_manifest(path)
    entry = body["shards"][k]
    data = (path / entry["file"]).read_bytes()
    entry["bytes"], entry["xxh3"] = len(data), xxhash.xxh3_64_hexdigest(data)
    _save_manifest(path, body, recompute=True)


def _mutate(path, rng: random.Random) -> str:
    """Apply one random mutation; returns its description."""
    body = _load_manifest(path)
    shards = body["shards"]
    k = rng.randrange(len(shards))
    shard = path / shards[k]["file"]
    kind = rng.choice(
        ["flip", "flip", "flip-resigned", "flip-header", "meta", "manifest-byte", "manifest-value", "truncate",
         "truncate-resigned", "swap", "move-offset", "offsets-monotone", "zero-block", "downgrade", "absurd-int"]
    )  # fmt: skip
    if kind == "downgrade":  # issue 34: a payload byte flipped, the manifest re-signed as version 1
        raw = bytearray(shard.read_bytes())
        raw[rng.randrange(64, len(raw))] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(raw))
        body["version"] = 1
        if rng.random() < 0.5:
            body.pop("dataset_id"), body.pop("block_log2")
            for entry in shards:
                entry.pop("blocks_xxh3")
        _save_manifest(path, body, recompute=True)
    elif kind == "absurd-int":  # issue 34: a huge, overflowing, negative or non-integer value, re-signed
        value = rng.choice([2**64 + 7, 10**30, 2**63, 2**62, -1, -(2**63), True, 1.5, "12", None])
        target = rng.choice([body, shards[k], shards[k], body["meta"], *body["meta"]["columns"]])
        key = rng.choice([key for key, v in target.items() if type(v) is int] or ["num_samples"])
        target[key] = value
        _save_manifest(path, body, recompute=True)
        kind = f"{kind}:{key}={value!r}"
    elif kind.startswith("flip"):
        raw = bytearray(shard.read_bytes())
        end = 64 + ENTRY_DTYPE.itemsize * len(body["schema"]) if kind == "flip-header" else len(raw)
        for _ in range(rng.choice([1, 1, 2, 8])):
            raw[rng.randrange(end)] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(raw))
        if kind == "flip-resigned":
            _resign_shard(path, k)
    elif kind == "zero-block":
        raw = bytearray(shard.read_bytes())
        a = rng.randrange(len(raw))
        raw[a : a + 4096] = bytes(len(raw[a : a + 4096]))
        shard.write_bytes(bytes(raw))
    elif kind == "meta":
        raw = bytearray((path / "meta.bin").read_bytes())
        if raw:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        (path / "meta.bin").write_bytes(bytes(raw))
    elif kind == "manifest-byte":
        raw = bytearray((path / "index.json").read_bytes())
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(7)
        (path / "index.json").write_bytes(bytes(raw))
    elif kind == "manifest-value":
        target = rng.choice(["num_samples", "bytes", "file", "dataset_id", "meta_offset", "dtype", "kind"])
        if target == "num_samples" and len(shards) > 1:
            j = (k + 1) % len(shards)
            shards[k]["num_samples"] += 1
            shards[j]["num_samples"] -= 1
        elif target == "bytes":
            shards[k]["bytes"] += rng.choice([-8, 8])
        elif target == "file" and len(shards) > 1:
            shards[k]["file"] = shards[(k + 1) % len(shards)]["file"]
        elif target == "dataset_id":
            body["dataset_id"] = f"{int(body['dataset_id'], 16) ^ 1:016x}"
        elif target == "meta_offset" and body["meta"]["columns"]:
            body["meta"]["columns"][0]["offset"] += 8
        elif target == "dtype":
            f = rng.choice(body["schema"])
            f["dtype"] = {"|u1": "<i1", "<i4": "<u4", "<i8": "<u8", "<f8": "<i8"}.get(f["dtype"], f["dtype"])
        else:
            f = rng.choice(body["schema"])
            f["kind"] = {"bytes": "string", "string": "bytes", "varray": "bytes"}.get(f["kind"], f["kind"])
        _save_manifest(path, body, recompute=rng.random() < 0.8)
        kind = f"{kind}:{target}"
    elif kind.startswith("truncate"):
        raw = shard.read_bytes()
        shard.write_bytes(raw[: rng.randrange(len(raw))])
        if kind == "truncate-resigned":
            _resign_shard(path, k)
    elif kind == "swap":
        if len(shards) > 1:
            j = (k + 1) % len(shards)
            shards[k], shards[j] = shards[j], shards[k]
        _save_manifest(path, body, recompute=True)
    elif kind == "move-offset":
        raw = bytearray(shard.read_bytes())
        field = rng.randrange(len(body["schema"]))
        key = rng.choice(["fixed_offset", "offsets_offset", "blob_offset"])
        pos = 64 + ENTRY_DTYPE.itemsize * field + ENTRY_DTYPE.fields[key][1]
        old = int.from_bytes(raw[pos : pos + 8], "little")
        if old:
            raw[pos : pos + 8] = max(0, old + rng.choice([-64, -4, 4, 64])).to_bytes(8, "little")
        shard.write_bytes(bytes(raw))
        if rng.random() < 0.7:
            _resign_shard(path, k)
    elif kind == "offsets-monotone":
        raw = bytearray(shard.read_bytes())
        n = int(np.frombuffer(raw[16:24], "<u8")[0])
        variable = [i for i, f in enumerate(body["schema"]) if f["kind"] in ("bytes", "string", "varray")]
        if variable and n > 2:
            field = rng.choice(variable)
            entry = np.frombuffer(bytes(raw[64 + 64 * field : 128 + 64 * field]), dtype=ENTRY_DTYPE)[0]
            offs = np.frombuffer(raw, "<u8", count=n + 1, offset=int(entry["offsets_offset"])).copy()
            r = rng.randrange(1, n)
            if offs[r + 1] > offs[r - 1]:  # move one boundary within its neighbours: still monotone
                offs[r] = rng.randrange(int(offs[r - 1]), int(offs[r + 1]) + 1)
                if offs[r] == np.frombuffer(raw, "<u8", count=1, offset=int(entry["offsets_offset"]) + 8 * r)[0]:
                    offs[r] = offs[r - 1] if offs[r] != offs[r - 1] else offs[r + 1]
            a = int(entry["offsets_offset"])
            raw[a : a + 8 * (n + 1)] = offs.tobytes()
        shard.write_bytes(bytes(raw))
        if rng.random() < 0.7:
            _resign_shard(path, k)
    return kind


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _run_fuzz(pristine, name: str, seed: int, tmp_path) -> dict[str, int]:
    src, expected = pristine[name]
    rng = random.Random(seed)
    counts = {"tried": 0, "clean_error": 0, "intact": 0, "silent": 0}
    silent = []
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for m in range(MUTATIONS_PER_DATASET):
            path = tmp_path / f"{name}-{m}"
            shutil.copytree(src, path)
            what = _mutate(path, rng)
            counts["tried"] += 1
            signal.alarm(20)  # no hang
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = _read_everything(path, name)
            except (FormatError, SchemaError) as exc:
                text = str(exc) + " ".join(getattr(exc, "__notes__", []))
                assert str(path) in text, f"{what}: error does not name the file: {exc}"
                counts["clean_error"] += 1
            else:
                if got == expected:
                    counts["intact"] += 1
                else:
                    counts["silent"] += 1
                    silent.append(what)
            finally:
                signal.alarm(0)
            shutil.rmtree(path)
    finally:
        signal.signal(signal.SIGALRM, old)
    print(f"\nfuzz {name}: {counts}")
    assert not silent, f"wrong data delivered without an error after: {silent}"
    return counts


@pytest.mark.parametrize("name", ["fixed", "mixed"])
def test_mutations_never_deliver_wrong_data(pristine, name, tmp_path):
    counts = _run_fuzz(pristine, name, seed=20 + len(name), tmp_path=tmp_path)
    assert counts["tried"] == MUTATIONS_PER_DATASET and counts["silent"] == 0
    assert counts["clean_error"] > MUTATIONS_PER_DATASET // 2  # most mutations are detected, not benign


@pytest.mark.parametrize(
    "mutation",
    ["swap", "move-fixed-offset", "offsets-monotone", "flip-resigned"],
)
def test_verify_catches_resigned_layout_corruption(pristine, tmp_path, mutation):
    """`fastload verify` catches the issue's classes even when the manifest's checksums are recomputed."""
    name = "fixed" if mutation == "move-fixed-offset" else "mixed"
    path = tmp_path / "ds"
    shutil.copytree(pristine[name][0], path)
    body = _load_manifest(path)
    shard = path / body["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    if mutation == "swap":
        body["shards"][0], body["shards"][1] = body["shards"][1], body["shards"][0]
        _save_manifest(path, body, recompute=True)
    elif mutation == "move-fixed-offset":
        pos = 64 + ENTRY_DTYPE.fields["fixed_offset"][1]
        old = int.from_bytes(raw[pos : pos + 8], "little")
        raw[pos : pos + 8] = (old + 4).to_bytes(8, "little")
        shard.write_bytes(bytes(raw))
        _resign_shard(path, 0)
    elif mutation == "offsets-monotone":
        entry = np.frombuffer(bytes(raw[128:192]), dtype=ENTRY_DTYPE)[0]  # field 1: tokens
        a = int(entry["offsets_offset"]) + 8 * 3
        offs = np.frombuffer(bytes(raw[a - 8 : a + 16]), "<u8")
        raw[a : a + 8] = int((offs[0] + offs[2]) // 2 + (offs[1] == (offs[0] + offs[2]) // 2)).to_bytes(8, "little")
        shard.write_bytes(bytes(raw))
        _resign_shard(path, 0)
    else:
        raw[len(raw) // 3] ^= 0x10
        shard.write_bytes(bytes(raw))
        _resign_shard(path, 0)
    problems = verify_dataset(path)
    assert problems and "shard" in " ".join(problems), problems


def test_checksum_error_names_file_shard_and_bytes(pristine, tmp_path):
    path = tmp_path / "ds"
    shutil.copytree(pristine["fixed"][0], path)
    shard = path / "shards" / "shard-00001.fls"
    raw = bytearray(shard.read_bytes())
    raw[100_000] ^= 1  # inside block 1 of the x column
    shard.write_bytes(bytes(raw))
    ds = FastloadDataset(path)
    first = int(ds.shard_boundaries[1])
    ds.get_batch(np.arange(first, first + 10))  # block 0 of shard 1 is intact and readable
    with pytest.raises(FormatError, match=r"shard-00001\.fls \(shard 1\): bytes \[65536, 131072\) \(block 1\)"):
        ds.get_batch(np.arange(len(ds)))
    # knob: verify="none" reads structure only (the flipped byte comes through)
    got = FastloadDataset(path, verify="none").get_batch(np.arange(len(ds)))["x"]
    assert got.shape == (len(ds), 1000)


def test_warm_reads_skip_verification(pristine, tmp_path):
    """Once every block under a column is verified, the spliced column's check is dropped."""
    shutil.copytree(pristine["fixed"][0], tmp_path / "ds")  # files this process has not verified yet
    ds = FastloadDataset(tmp_path / "ds")
    ds.get_batch(np.arange(10))
    column = ds.spliced_columns()["x"]
    assert column.check is not None
    assert ds.direct_plan(np.arange(len(ds))) is None  # no epoch plan while blocks are unverified
    ds.get_batch(np.random.default_rng(0).permutation(len(ds)))
    assert column.check is None
    assert ds.direct_plan(np.arange(len(ds))) is not None


def test_views_handed_out_outlive_their_dataset_and_still_check_every_block(pristine, tmp_path):
    """A spliced column from `spliced_columns()` keeps its dataset alive (`owner`): its unverified
    blocks are still checked through it after the caller dropped the dataset. A shard reader taken
    from a dataset that is gone still raises the checksum error for a corrupt block."""
    import gc

    path = tmp_path / "ds"
    shutil.copytree(pristine["fixed"][0], path)
    want = FastloadDataset(pristine["fixed"][0]).get_batch(np.arange(len(FastloadDataset(path))))["x"]
    ds = FastloadDataset(path)
    ds.get_batch(np.arange(10))
    for k in range(ds.num_shards):
        ds.shard(k)
    column = ds.spliced_columns()["x"]
    assert column.check is not None  # blocks left to verify
    del ds
    gc.collect()
    rows = np.arange(len(want))
    np.testing.assert_array_equal(column.take(rows), want)

    shard = path / "shards" / "shard-00001.fls"
    raw = bytearray(shard.read_bytes())
    raw[100_000] ^= 1  # inside block 1 of the x column
    shard.write_bytes(bytes(raw))
    reader = FastloadDataset(path).shard(1)  # the dataset is dropped at once
    gc.collect()
    with pytest.raises(ChecksumError, match=r"shard-00001\.fls \(shard 1\): bytes \[65536, 131072\) \(block 1\)"):
        reader.verify_blocks(np.array([1]))


def test_process_workers_verify_on_their_own(pristine):
    ds = FastloadDataset(pristine["fixed"][0])
    ds.get_batch(np.arange(len(ds)))
    assert ds.verified_blocks > 0
    import pickle

    clone = pickle.loads(pickle.dumps(ds))
    assert clone.verified_blocks == 0  # a fresh ledger per process
    assert FastloadDataset(pristine["fixed"][0], verify="none").verified_blocks == 0


def _downgrade_to_v1(src, dst) -> None:
    """What a version-1 writer produced: no checksum table, zero identity, manifest version 1."""
    shutil.copytree(src, dst)
    body = _load_manifest(dst)
    for entry in body["shards"]:
        p = dst / entry["file"]
        raw = bytearray(p.read_bytes())
        header = np.frombuffer(bytes(raw[:64]), dtype=HEADER_DTYPE)[0]
        end = int(header["checksums_offset"])
        raw = raw[:end]
        raw[8:12] = (1).to_bytes(4, "little")
        raw[24:32] = end.to_bytes(8, "little")
        raw[32:64] = bytes(32)
        for k in range(len(body["schema"])):  # the field table's field_xxh3 was reserved (zero)
            pos = 64 + ENTRY_DTYPE.itemsize * k + ENTRY_DTYPE.fields["field_xxh3"][1]
            raw[pos : pos + 8] = bytes(8)
        p.write_bytes(bytes(raw))
        entry.pop("blocks_xxh3")
        entry["bytes"], entry["xxh3"] = len(raw), xxhash.xxh3_64_hexdigest(bytes(raw))
    body.pop("dataset_id")
    body.pop("block_log2")
    body["version"] = 1
    _save_manifest(dst, body, recompute=True)


def test_version_1_opens_with_a_warning_verified_whole_and_upgrades(pristine, tmp_path):
    from fastload.cli import main

    src, expected = pristine["mixed"]
    v1 = tmp_path / "v1"
    _downgrade_to_v1(src, v1)
    with pytest.warns(UserWarning, match="version-1.*fastload convert --upgrade"):
        assert _read_everything(v1, "mixed") == expected
    with pytest.warns(UserWarning, match="NOT verified"):
        FastloadDataset(v1, verify="none")
    assert any("version 1" in p for p in verify_dataset(v1))
    out = tmp_path / "v2"
    with pytest.warns(UserWarning):
        assert main(["convert", "--upgrade", str(v1), str(out), "--quiet"]) == 0
    assert Manifest.loads((out / "index.json").read_bytes()).version == 2
    assert _read_everything(out, "mixed") == expected and verify_dataset(out) == []
    # a corrupt version-1 shard is caught by default (whole-shard hash on open)
    shard = v1 / "shards" / "shard-00000.fls"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) - 10] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.warns(UserWarning), pytest.raises(FormatError, match=r"shard-00000\.fls.*checksum mismatch"):
        FastloadDataset(v1).get_batch(np.arange(3))


def _read_by_every_path(path, kind: str) -> None:
    """Open with default settings and read: `ds[i]`, a batch, and the Loader (the fixed dataset's direct path)."""
    ds = FastloadDataset(path)
    ds[len(ds) - 1]
    ds.get_batch(np.arange(len(ds)))
    if kind == "fixed":
        list(Loader(FastloadDataset(path), batch_size=64, num_workers=0))


@pytest.mark.parametrize("name", ["fixed", "mixed"])
@pytest.mark.parametrize("strip_v2_keys", [False, True])
def test_a_version_2_shard_under_a_version_1_manifest_is_refused(pristine, tmp_path, name, strip_v2_keys):
    """The issue's downgrade: a payload byte flipped, `version` set to 1 and the manifest re-signed. The
    shards still say version 2 (and carry a checksum table): every read path refuses them, before any data."""
    src, _ = pristine[name]
    path = tmp_path / "ds"
    shutil.copytree(src, path)
    body = _load_manifest(path)
    shard = path / body["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[9000] ^= 0x40  # in the first shard's sections (payload)
    shard.write_bytes(bytes(raw))
    body["version"] = 1
    if strip_v2_keys:  # what a version-1 manifest looks like
        body.pop("dataset_id"), body.pop("block_log2")
        for entry in body["shards"]:
            entry.pop("blocks_xxh3")
    _save_manifest(path, body, recompute=True)
    message = r"shard-0000(\d)\.fls \(shard \1\): the shard is format version 2, the manifest says version 1"
    for verify in ("auto", "full", "none"):  # structure: even with content checks off
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(FormatError, match=message):
                FastloadDataset(path, verify=verify)[0]
            with pytest.raises(FormatError, match=message):
                _read_by_every_path(path, name)
    assert any(re.search(message, p) for p in verify_dataset(path))


def test_a_version_1_shard_under_a_version_2_manifest_is_refused(pristine, tmp_path):
    src, _ = pristine["mixed"]
    _downgrade_to_v1(src, tmp_path / "v1")
    path = tmp_path / "ds"
    shutil.copytree(src, path)
    shutil.copy(tmp_path / "v1" / "shards" / "shard-00001.fls", path / "shards" / "shard-00001.fls")
    _resign_shard(path, 1)
    message = r"shard-00001\.fls \(shard 1\): the shard is format version 1, the manifest says version 2"
    for verify in ("auto", "none"):
        ds = FastloadDataset(path, verify=verify)
        with pytest.raises(FormatError, match=message):
            ds.get_batch(np.arange(len(ds)))


@pytest.mark.parametrize("name", ["fixed", "mixed"])
def test_a_true_version_1_shard_is_hashed_whole_before_its_first_read(pristine, tmp_path, name):
    """A genuine version-1 dataset (no checksum tables) with a payload byte flipped: each read path
    raises ChecksumError naming the shard before returning data; the intact shards read correctly."""
    src, expected = pristine[name]
    v1 = tmp_path / "v1"
    _downgrade_to_v1(src, v1)
    with pytest.warns(UserWarning, match="each shard is hashed whole when first opened"):
        assert _read_everything(v1, name) == expected
    shard = v1 / "shards" / "shard-00001.fls"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x08
    shard.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = FastloadDataset(v1)
        first = int(ds.shard_boundaries[1])
        with pytest.raises(ChecksumError, match=r"shard-00001\.fls \(shard 1\): checksum mismatch"):
            ds[first]
        assert ds[0] is not None  # shard 0 is intact
        with pytest.raises(ChecksumError, match=r"shard-00001\.fls \(shard 1\): checksum mismatch"):
            _read_by_every_path(v1, name)


def test_verify_keyword():
    with pytest.raises(ValueError, match="verify must be one of"):
        FastloadDataset("/nonexistent", verify="sometimes")
    with pytest.raises(TypeError, match="verify_checksums"):
        FastloadDataset("/nonexistent", verify_checksums=True)  # the 0.1.0 spelling is gone


def test_manifest_entry_that_is_a_directory(pristine, tmp_path):
    path = tmp_path / "ds"
    shutil.copytree(pristine["mixed"][0], path)
    body = _load_manifest(path)
    os.makedirs(path / "shards" / "dir.fls")
    body["shards"][0]["file"] = "shards/dir.fls"
    _save_manifest(path, body, recompute=True)
    for verify in ("auto", "full"):
        with pytest.raises(FormatError, match=r"dir\.fls \(shard 0\).*(directory|not a regular file)"):
            FastloadDataset(path, verify=verify).get_batch([0])
    os.rmdir(path / "shards" / "dir.fls")
    with pytest.raises(FormatError, match=r"dir\.fls \(shard 0\).*missing"):
        FastloadDataset(path, verify="full").get_batch([0])


# -- errors that name what and where ---------------------------------------------------------------


def test_corrupt_utf8_names_shard_sample_and_field(pristine, tmp_path):
    path = tmp_path / "ds"
    shutil.copytree(pristine["mixed"][0], path)
    ds = FastloadDataset(path, verify="none")
    reader = ds.shard(1)
    offs, _ = reader.ragged["text"]
    local = int(np.flatnonzero(np.diff(offs) > 0)[0])
    pos = reader.blob_offset["text"] + int(offs[local])
    ds.close()
    shard = path / "shards" / "shard-00001.fls"
    raw = bytearray(shard.read_bytes())
    raw[pos] = 0xFF  # never valid in UTF-8
    shard.write_bytes(bytes(raw))
    ds = FastloadDataset(path, verify="none")  # checksums off: the decoder is the last line
    index = int(ds.shard_boundaries[1]) + local
    where = rf"shard-00001\.fls \(shard 1\): sample {index}, field 'text': invalid UTF-8"
    with pytest.raises(FormatError, match=where):
        ds[index]
    with pytest.raises(FormatError, match=where):
        ds.get_batch([0, index])["text"].to_list()
    with pytest.raises(FormatError, match=where):
        list(Loader(ds, batch_size=8, num_workers=0))
    with pytest.raises(FormatError, match="shard-00001.fls.*checksum"):  # and by default, the checksum
        FastloadDataset(path)[index]


def test_inspect_and_open_refuse_a_rekinded_field(pristine, tmp_path, capsys):
    from fastload.cli import main

    path = tmp_path / "ds"
    shutil.copytree(pristine["mixed"][0], path)
    body = _load_manifest(path)
    body["schema"][2]["kind"] = "image"  # blob: bytes -> image (no image sizes in meta.bin)
    _save_manifest(path, body, recompute=True)
    assert main(["inspect", str(path)]) == 2
    assert "no image sizes for field 'blob'" in capsys.readouterr().err


def _jpeg(seed: int) -> bytes:
    import io

    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (32, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture
def image_folder(tmp_path):
    src = tmp_path / "images"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        for i in range(4):
            (src / cls / f"{i}.jpg").write_bytes(_jpeg(i + 10 * (cls == "b")))
    good = _jpeg(99)
    (src / "b" / "2.jpg").write_bytes(good[: len(good) * 2 // 3])  # truncated: the header is intact
    (src / "a" / "3.jpg").write_bytes(b"not an image at all")
    return src


def test_convert_stops_at_the_first_bad_input_naming_the_file(image_folder, tmp_path, capsys):
    from fastload.cli import main

    assert main(["convert", str(image_folder), str(tmp_path / "out"), "--quiet", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{image_folder}/a/3.jpg" in err and "sample" not in err.split("3.jpg")[0]
    assert not (tmp_path / "out" / "index.json").exists()


def test_convert_skip_writes_a_report(image_folder, tmp_path, capsys):
    from fastload.cli import main

    out = tmp_path / "out"
    assert main(["convert", str(image_folder), str(out), "--quiet", "--on-error", "skip"]) == 0
    lines = [json.loads(line) for line in (out / "skipped-inputs.jsonl").read_text().splitlines()]
    assert sorted(x["input"] for x in lines) == [f"{image_folder}/a/3.jpg", f"{image_folder}/b/2.jpg"]
    assert all("not a decodable image" in x["reason"] or "not a readable image" in x["reason"] for x in lines)
    assert len(FastloadDataset(out)) == 6 and verify_dataset(out, decode=True) == []


def test_no_decode_check_converts_a_truncated_jpeg_and_verify_decode_finds_it(image_folder, tmp_path, capsys):
    from fastload.cli import main

    (image_folder / "a" / "3.jpg").unlink()
    out = tmp_path / "out"
    assert main(["convert", str(image_folder), str(out), "--quiet", "--no-decode-check"]) == 0
    assert main(["verify", str(out)]) == 0
    assert main(["verify", str(out), "--decode"]) == 1
    err = capsys.readouterr().err
    ds = FastloadDataset(out)
    assert f"{ds.where(5, 'image')}: not a decodable image" in err  # b/2.jpg is sample 3 + 2


def test_reader_threads_share_the_ledger_and_all_see_a_bad_block(pristine, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    src, expected = pristine["fixed"]
    shutil.copytree(src, tmp_path / "fresh")  # files this process has not verified yet
    ds = FastloadDataset(tmp_path / "fresh")
    n = len(ds)
    orders = [np.random.default_rng(s).permutation(n) for s in range(4)]

    def read(order):
        out = {}
        for a in range(0, n, 50):
            idx = order[a : a + 50]
            x = ds.get_batch(idx)["x"]
            out.update({int(i): x[j].tobytes() for j, i in enumerate(idx)})
        return out

    with ThreadPoolExecutor(4) as pool:
        for got in pool.map(read, orders):
            assert all(got[i] == expected["x"][i][1] for i in range(n))
    assert ds.spliced_columns()["x"].check is None  # every block verified once, shared by the threads

    path = tmp_path / "ds"
    shutil.copytree(src, path)
    shard = path / "shards" / "shard-00002.fls"
    raw = bytearray(shard.read_bytes())
    raw[70_000] ^= 4
    shard.write_bytes(bytes(raw))
    bad = FastloadDataset(path)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(lambda: bad.get_batch(np.arange(n))) for _ in range(4)]
        for f in futures:
            with pytest.raises(FormatError, match=r"shard-00002\.fls \(shard 2\): bytes \[65536, 131072\)"):
                f.result()


def test_process_workers_raise_the_checksum_error(pristine, tmp_path):
    path = tmp_path / "ds"
    shutil.copytree(pristine["fixed"][0], path)
    shard = path / "shards" / "shard-00000.fls"
    raw = bytearray(shard.read_bytes())
    raw[150_000] ^= 1
    shard.write_bytes(bytes(raw))
    loader = Loader(FastloadDataset(path), batch_size=100, num_workers=1, worker_type="process")
    with pytest.raises(FormatError, match=r"shard-00000\.fls \(shard 0\): bytes \[131072, 196608\)"):
        list(loader)


def test_a_second_dataset_on_the_same_files_reuses_verification_until_a_file_changes(pristine, tmp_path):
    path = tmp_path / "ds"
    shutil.copytree(pristine["fixed"][0], path)
    first = FastloadDataset(path)
    first.get_batch(np.arange(len(first)))
    second = FastloadDataset(path)
    second.get_batch(np.arange(3))
    assert second.spliced_columns()["x"].check is None  # nothing left to verify in this process
    shard = path / "shards" / "shard-00000.fls"
    raw = bytearray(shard.read_bytes())
    raw[100_000] ^= 1
    os.replace(shard, tmp_path / "old.fls")  # a rewritten file is another file: verified again
    shard.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"shard-00000\.fls \(shard 0\): bytes \[65536, 131072\)"):
        FastloadDataset(path).get_batch(np.arange(len(first)))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=5000), shift=st.integers(6, 10), picks=st.lists(st.integers(0, 10**6)),
       c_ext=st.booleans())
def test_block_digests_are_xxh3_of_each_block(data, shift, picks, c_ext):
    """`block_digests` (the C extension's one call, or the Python loop without it) equals xxh3-64 of each
    block, the last one short; a block outside the bytes is refused."""
    from fastload.formats import blocks

    with pytest.MonkeyPatch.context() as mp:
        if not c_ext:
            mp.setattr(blocks, "_c_xxh3_blocks", None)
        count = -(-len(data) // (1 << shift))
        ids = np.array([p % count for p in picks], dtype=np.int64)
        got = blocks.block_digests(data, ids, shift, len(data))
        want = [xxhash.xxh3_64_intdigest(data[j << shift : (j + 1) << shift]) for j in ids.tolist()]
        assert got.dtype == np.uint64 and got.tolist() == want
        with pytest.raises(ValueError, match="outside"):
            blocks.block_digests(data, np.array([count], dtype=np.int64), shift, len(data))


@settings(max_examples=80, deadline=None)
@given(data=st.binary(min_size=1, max_size=5000), shift=st.integers(6, 9), cut=st.tuples(st.integers(0, 10**6),
       st.integers(0, 10**6)), published=st.lists(st.booleans(), max_size=80), flip=st.integers(-1, 10**6),
       c_ext=st.booleans())
def test_write_blocks_writes_unpublished_bytes_and_checks_whole_blocks(tmp_path_factory, data, shift, cut, published,
                                                                      flip, c_ext):
    """`write_blocks` (one C call, or the Python loop without the extension) writes a piece's bytes of
    unpublished blocks at their offsets and nothing of published ones, and checks every unpublished
    block wholly inside the piece against the table in order, stopping at the first that differs."""
    from fastload.formats import blocks

    size = 1 << shift
    count = -(-len(data) // size)
    table = np.array([xxhash.xxh3_64_intdigest(data[j << shift : (j + 1) << shift]) for j in range(count)],
                     dtype="<u8")
    pub = np.array([published[j % len(published)] if published else False for j in range(count)], dtype=bool)
    lo, hi = sorted((cut[0] % (len(data) + 1), cut[1] % (len(data) + 1)))
    piece = bytearray(data[lo:hi])
    if flip >= 0 and piece:
        piece[flip % len(piece)] ^= 0x5A
    path = tmp_path_factory.mktemp("wb") / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, len(data))
        with pytest.MonkeyPatch.context() as mp:
            if not c_ext:
                mp.setattr(blocks, "_c_write_blocks", None)
            done, bad, write_s, hash_s = blocks.write_blocks(fd, lo, bytes(piece), shift, len(data), table, pub)
            with pytest.raises(ValueError, match="outside"):
                blocks.write_blocks(fd, len(data), b"x", shift, len(data), table, pub)
        written = os.pread(fd, len(data), 0)
    finally:
        os.close(fd)
    assert write_s >= 0 and hash_s >= 0
    for j in range(count):  # bytes of published blocks untouched (zeros), the others written
        a, b = max(lo, j << shift), min(hi, (j + 1) << shift)
        if a < b:
            assert written[a:b] == (bytes(b - a) if pub[j] else bytes(piece[a - lo : b - lo])), j
    whole = [j for j in range(count) if lo <= j << shift and min(len(data), (j + 1) << shift) <= hi and not pub[j]]
    matches = [xxhash.xxh3_64_intdigest(bytes(piece[(j << shift) - lo : min(len(data), (j + 1) << shift) - lo]))
               == int(table[j]) for j in whole]
    want_bad = whole[matches.index(False)] if False in matches else -1
    assert bad == want_bad
    assert done == (whole[: matches.index(False)] if want_bad >= 0 else whole)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=2, max_size=3000), shift=st.integers(6, 8), at=st.integers(0, 10**6),
       extra=st.integers(0, 10**6), flip=st.sampled_from(["none", "carry", "piece"]), c_ext=st.booleans())
def test_write_blocks_finishes_a_carried_block(tmp_path_factory, data, shift, at, extra, flip, c_ext):
    """With `carry` (a block's first bytes, from the previous piece of a stream), `write_blocks` checks that
    block from the carried bytes and the piece's first ones, before the blocks wholly inside the piece;
    a flipped byte on either side fails that block; a carry the piece does not complete is refused."""
    from fastload.formats import blocks

    size, end = 1 << shift, len(data)
    count = -(-end // size)
    table = np.array([xxhash.xxh3_64_intdigest(data[j * size : (j + 1) * size]) for j in range(count)], dtype="<u8")
    offset = at % end
    c = offset >> shift
    if offset % size == 0:
        offset = min(end - 1, offset + 1)
        c = offset >> shift
    carry = bytearray(data[c * size : offset])
    block_end = min((c + 1) * size, end)
    stop = min(end, block_end + extra % (end - block_end + 1))
    piece = bytearray(data[offset:stop])
    if flip == "carry" and carry:
        carry[0] ^= 1
    elif flip == "piece":
        piece[0] ^= 1
    path = tmp_path_factory.mktemp("wc") / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, end)
        with pytest.MonkeyPatch.context() as mp:
            if not c_ext:
                mp.setattr(blocks, "_c_write_blocks", None)
            pub = np.zeros(count, dtype=bool)
            done, bad, _, _ = blocks.write_blocks(fd, offset, bytes(piece), shift, end, table, pub, bytes(carry))
            if block_end > offset + 1:  # a piece that stops short of the carried block's end is refused
                with pytest.raises(ValueError, match="carry"):
                    blocks.write_blocks(fd, offset, bytes(piece[:1]), shift, end, table, pub, bytes(carry))
    finally:
        os.close(fd)
    if flip != "none" and carry:
        assert (done, bad) == ([], c)
        return
    whole = [j for j in range(c + 1, count) if min((j + 1) * size, end) <= stop]
    assert bad == -1 and done == [c, *whole]


@settings(max_examples=150, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 900)), max_size=60), shift=st.integers(4, 10),
       have=st.lists(st.booleans(), min_size=1, max_size=400), c_ext=st.booleans())
def test_missing_blocks_are_the_unverified_blocks_the_ranges_touch(ranges, shift, have, c_ext):
    """`missing_blocks` (one C call, or numpy without the extension): every block a byte range touches whose
    bit is unset, once each and ascending; empty ranges touch nothing; a range past the blocks raises
    IndexError."""
    from fastload.formats import blocks

    count = len(have)
    bits = np.array(have, dtype=bool)
    spans = [(lo % (count << shift), lo % (count << shift) + n) for lo, n in ranges]
    spans = [(lo, min(hi, count << shift)) for lo, hi in spans]
    lo = np.array([a for a, _ in spans], dtype=np.int64)
    hi = np.array([b for _, b in spans], dtype=np.int64)
    want = sorted({j for a, b in spans for j in range(a >> shift, ((b - 1) >> shift) + 1) if b > a and not have[j]})
    with pytest.MonkeyPatch.context() as mp:
        if not c_ext:
            mp.setattr(blocks, "_c_missing_blocks", None)
        got = blocks.missing_blocks(lo, hi, shift, bits)
        assert got.dtype == np.int64 and got.tolist() == want
        with pytest.raises(IndexError):
            blocks.missing_blocks(np.array([0], np.int64), np.array([(count << shift) + 1], np.int64), shift, bits)
        with pytest.raises(IndexError):
            blocks.missing_blocks(np.array([-1], np.int64), np.array([1], np.int64), shift, bits)
