"""Hugging Face `datasets` in: `formats.write(ds)` and `fastload convert <save_to_disk dir>` keep
fixed-shape columns as fixed fields with their dtypes, and every value round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastload import Loader
from fastload.cli import main
from fastload.formats import FastloadDataset, FormatError, write

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.frameworks


def _dataset(n: int = 300):
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict(
        {
            "x": rng.random((n, 16), dtype=np.float32),  # declared List(float32), every row 16 long
            "label": np.arange(n, dtype=np.int32),
            "grid": rng.integers(0, 9, (n, 2, 3)).astype(np.uint8),
            "text": [f"sample {i}" * (i % 4) for i in range(n)],
            "tokens": [list(range(i % 7)) for i in range(n)],
            "blob": [bytes([i % 256]) * (i % 5) for i in range(n)],
        }
    )


def _check(out, ds) -> None:
    got = FastloadDataset(str(out))
    fields = {f.name: f for f in got.schema}
    assert (fields["x"].kind, fields["x"].dtype, fields["x"].shape) == ("ndarray", np.float32, (16,))
    assert (fields["label"].kind, fields["label"].dtype) == ("scalar", np.int32)
    assert (fields["grid"].kind, fields["grid"].dtype, fields["grid"].shape) == ("ndarray", np.uint8, (2, 3))
    assert [fields[k].kind for k in ("text", "tokens", "blob")] == ["string", "varray", "bytes"]
    ref = ds.with_format("numpy")
    for i in (0, 1, 7, len(ds) - 1):
        a, b = got[i], ds[i]
        assert np.array_equal(a["x"], ref[i]["x"]) and a["x"].dtype == np.float32
        assert a["label"] == b["label"] and a["text"] == b["text"] and a["blob"] == b["blob"]
        assert np.array_equal(a["grid"], np.asarray(b["grid"], np.uint8))
        assert np.asarray(a["tokens"]).tolist() == b["tokens"]
    batch = next(iter(Loader(got, batch_size=32)))
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.float32 and batch["x"].shape == (32, 16)
    assert batch["label"].tolist() == ref[:32]["label"].tolist()
    assert torch.equal(batch["x"], torch.from_numpy(np.asarray(ref[:32]["x"])))


def test_write_a_datasets_dataset(tmp_path):
    ds = _dataset()
    write(ds, tmp_path / "out", progress=False, shard_size="16KiB")
    _check(tmp_path / "out", ds)


def test_convert_a_save_to_disk_directory(tmp_path):
    ds = _dataset().shuffle(seed=1).select(range(200))  # an indices mapping: rows in the dataset's order
    ds.save_to_disk(str(tmp_path / "hf"))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--quiet"]) == 0
    _check(tmp_path / "out", ds)


def test_dataset_dict_directory_names_the_splits(tmp_path, capsys):
    datasets.DatasetDict({"train": _dataset(10), "test": _dataset(5)}).save_to_disk(str(tmp_path / "dd"))
    assert main(["convert", str(tmp_path / "dd"), str(tmp_path / "out"), "--quiet"]) != 0
    assert "splits ['train', 'test']" in capsys.readouterr().err


def test_nested_lists_of_varying_length_are_vndarray_fields(tmp_path):
    rng = np.random.default_rng(3)
    rows = [rng.random((i % 4, 3), dtype=np.float32) for i in range(40)]  # (-1, 3); empty rows included
    grids = [rng.integers(-9, 9, (1 + i % 3, i % 5, 2)).astype(np.int16) for i in range(40)]  # (-1, -1, 2)
    features = datasets.Features({
        "rows": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
        "grids": datasets.Sequence(datasets.Sequence(datasets.Sequence(datasets.Value("int16")))),
    })
    ds = datasets.Dataset.from_dict({"rows": [r.tolist() for r in rows], "grids": [g.tolist() for g in grids]},
                                    features=features)
    write(ds, tmp_path / "out", progress=False, shard_size="4KiB")
    got = FastloadDataset(str(tmp_path / "out"))
    fields = {f.name: f for f in got.schema}
    assert (fields["rows"].kind, fields["rows"].dtype, fields["rows"].shape) == ("vndarray", np.float32, (-1, 3))
    assert (fields["grids"].kind, fields["grids"].dtype, fields["grids"].shape) == ("vndarray", np.int16, (-1, -1, 2))
    for i in range(len(ds)):
        for name, want in (("rows", rows[i]), ("grids", grids[i])):
            a = got[i][name]
            assert (a.dtype, a.shape, a.tobytes()) == (want.dtype, want.shape, want.tobytes()), (i, name)


def test_nested_lists_not_rectangular_in_a_row_name_sample_and_column(tmp_path):
    ds = datasets.Dataset.from_dict({"nested": [[[4.0]], [[1.0], [2.0, 3.0]]]})
    with pytest.raises(FormatError, match=r"sample 1, column 'nested'.*not rectangular"):
        write(ds, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "index.json").exists()


def test_missing_values_inside_lists_are_refused(tmp_path):
    ds = datasets.Dataset.from_dict({"v": [[1.0, None], [2.0]]})
    with pytest.raises(FormatError, match=r"column 'v' has 1 missing values \(nulls\) inside its lists"):
        write(ds, tmp_path / "out", progress=False)


def test_image_and_class_label_columns(tmp_path):
    from io import BytesIO

    from PIL import Image

    def png(i: int) -> bytes:
        out = BytesIO()
        Image.fromarray(np.full((4, 6, 3), i, np.uint8)).save(out, format="PNG")
        return out.getvalue()

    features = datasets.Features({"img": datasets.Image(), "c": datasets.ClassLabel(names=["a", "b"])})
    images = [{"bytes": png(i), "path": None} for i in range(5)]
    ds = datasets.Dataset.from_dict({"img": images, "c": [0, 1, 0, 1, 1]}, features=features)
    write(ds, tmp_path / "out", progress=False)
    got = FastloadDataset(str(tmp_path / "out"))
    assert [(f.name, f.kind) for f in got.schema] == [("img", "image"), ("c", "scalar")]
    assert [got[i]["img"] for i in range(5)] == [png(i) for i in range(5)]  # the stored bytes, unchanged
    assert [got[i]["c"] for i in range(5)] == [0, 1, 0, 1, 1]
