"""`vndarray` fields: arrays whose shape varies per sample, written and read back exactly."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.formats import FastloadDataset, Field, Schema, ShapedBatch, write
from fastload.formats.errors import FormatError, SchemaError
from fastload.formats.verify import verify_dataset

_DTYPES = ["|u1", "<i2", "<i4", "<i8", "<u4", "<f2", "<f4", "<f8", "|b1"]


@st.composite
def _samples(draw):
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    ndim = draw(st.integers(1, 3))
    n = draw(st.integers(1, 12))
    out = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        size = dtype.itemsize * int(np.prod(shape))
        raw = draw(st.binary(min_size=size, max_size=size))
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
        if dtype.kind == "b":
            arr = arr.astype(bool)  # only 0/1 are booleans
        out.append({"a": arr.view(dtype).reshape(shape) if dtype.kind != "b" else arr.reshape(shape), "i": i})
    return dtype, ndim, out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_samples())
def test_round_trip_is_byte_exact(case):
    dtype, ndim, samples = case
    schema = Schema((Field("a", "vndarray", dtype, (-1,) * ndim), Field("i", "scalar", np.int64)))
    with tempfile.TemporaryDirectory() as tmp:
        write(samples, tmp + "/ds", schema=schema, shard_size=4096, progress=False, workers=1)
        ds = FastloadDataset(tmp + "/ds")
        for i, s in enumerate(samples):
            got = ds[i]["a"]
            assert got.dtype == dtype and got.shape == s["a"].shape and got.tobytes() == s["a"].tobytes()
        order = np.random.default_rng(len(samples)).permutation(len(samples))
        batch = ds.get_batch(order)["a"]
        assert isinstance(batch, ShapedBatch)
        for j, i in enumerate(order):
            assert batch[j].shape == samples[i]["a"].shape and batch[j].tobytes() == samples[i]["a"].tobytes()
        assert verify_dataset(tmp + "/ds") == []


def test_inferred_batch_forms_and_multi_shard(tmp_path):
    rng = np.random.default_rng(0)
    samples = [{"f": rng.standard_normal((int(rng.integers(0, 40)), 3)).astype(np.float32)} for _ in range(300)]
    m = write(samples, tmp_path / "ds", shard_size=4096, progress=False)
    assert m.schema["f"] == Field("f", "vndarray", np.float32, (-1, 3)) and len(m.shards) > 3
    ds = FastloadDataset(tmp_path / "ds")
    np.testing.assert_array_equal(ds.lengths("f"), [s["f"].size for s in samples])
    idx = [299, 0, 150, 7]
    batch = ds.get_batch(idx)["f"]
    nested = batch.to_list()
    padded, shapes = batch.padded(fill=-1.0)
    top = max(samples[i]["f"].shape[0] for i in idx)
    assert padded.shape == (4, top, 3) and padded.dtype == np.float32
    for j, i in enumerate(idx):
        want = samples[i]["f"]
        assert nested[j].tobytes() == want.tobytes() and tuple(shapes[j]) == want.shape
        np.testing.assert_array_equal(padded[j, : len(want)], want)
        assert (padded[j, len(want) :] == -1).all()
    assert [s["f"].shape for s in ds.__getitems__(idx)] == [samples[i]["f"].shape for i in idx]


def test_schema_checks_shapes(tmp_path):
    schema = Schema((Field("f", "vndarray", np.float32, (-1, 3)),))
    with pytest.raises(SchemaError, match=r"sample 1, field 'f': shape \(2, 4\) does not fit \(-1, 3\)"):
        write([{"f": np.zeros((1, 3))}, {"f": np.zeros((2, 4))}], tmp_path / "a", schema=schema, progress=False)
    with pytest.raises(SchemaError, match="needs a shape with -1"):
        Field("f", "vndarray", np.float32)
    with pytest.raises(SchemaError, match="same number of dimensions"):
        write([{"f": np.zeros((1, 3))}, {"f": np.zeros(2)}], tmp_path / "b", progress=False)
    fixed = Schema((Field("f", "ndarray", np.float32, (1, 3)),))
    with pytest.raises(SchemaError, match=r"shape \(2, 3\) != schema shape \(1, 3\) \(for .*vndarray"):
        write([{"f": np.zeros((1, 3))}, {"f": np.zeros((2, 3))}], tmp_path / "c", schema=fixed, progress=False)


def test_corrupt_shape_column_names_shard_sample_field(tmp_path):
    samples = [{"f": np.ones((k, 2), np.int16)} for k in range(1, 6)]
    write(samples, tmp_path / "ds", progress=False)
    path = tmp_path / "ds" / "shards" / "shard-00000.fls"
    raw = bytearray(path.read_bytes())
    shapes = np.array([(k, 2) for k in range(1, 6)], np.uint32).tobytes()  # the shape column as stored
    assert raw.count(shapes) == 1
    offset = raw.find(shapes)
    raw[offset + 8 * 2 : offset + 8 * 2 + 4] = np.uint32(7).tobytes()  # local sample 2: (3, 2) -> (7, 2)
    path.write_bytes(bytes(raw))
    bad = r"shard-00000.fls \(shard 0\), field 'f': local sample 2 has stored shape \(7, 2\)"
    with pytest.raises(FormatError, match=bad):
        FastloadDataset(tmp_path / "ds", verify="none")[2]
    with pytest.raises(FormatError):  # the default verifies the block first
        FastloadDataset(tmp_path / "ds")[2]


@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2, "worker_type": "thread"}, {"num_workers": 2, "worker_type": "process"}]
)
def test_loader_yields_shaped_batches(tmp_path, workers):
    import torch

    from fastload import Loader
    from fastload import ShapedBatch as TopLevel

    rng = np.random.default_rng(1)
    feats = [rng.random((i % 5, 4), dtype=np.float32) for i in range(120)]
    write(({"feat": f, "y": np.int64(i)} for i, f in enumerate(feats)), tmp_path / "ds", shard_size=4096,
          progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    batches = list(Loader(ds, batch_size=16, shuffle=True, seed=3, **workers))
    seen = []
    for b in batches:
        assert type(b["feat"]) is TopLevel is ShapedBatch and isinstance(b["y"], torch.Tensor)
        for y, a in zip(b["y"].tolist(), b["feat"].to_list()):
            assert a.shape == feats[y].shape and a.tobytes() == feats[y].tobytes()
            seen.append(y)
    assert sorted(seen) == list(range(120)) and seen != list(range(120))

    def pad(batch):  # the padded form as tensors
        values, shapes = batch["feat"].padded(0.0)
        return {**batch, "feat": torch.from_numpy(values), "feat_shape": torch.from_numpy(shapes.astype(np.int64))}

    b = next(iter(Loader(ds, batch_size=16, transform=pad, **workers)))
    assert b["feat"].shape == (16, 4, 4) and b["feat_shape"][:, 0].tolist() == [i % 5 for i in range(16)]
    assert torch.equal(b["feat"][3, :3], torch.from_numpy(feats[3]))
