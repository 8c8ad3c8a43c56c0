"""Batch views (`fastload.fetch.views`): a collate that declares `accepts_batch_views` gets the columns.

Every field kind is checked byte for byte against `ds[i]`, in shuffled order, with 0/1/2 thread
and process workers and with the reused-buffer ring, while every batch of the epoch is held (a
reused slot must never be rewritten under a view); resume continues exactly; TextCollate gives
the same output from views as from a list of samples; views copy memory the dataset keeps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastload
from fastload.benchmark.synthetic import make_jpegs
from fastload.fetch.text_collate import TextCollate
from fastload.fetch.views import BatchViews, columns_to_views
from fastload.formats import FastloadDataset, Field, Ragged, Schema, write
from fastload.loader import Loader

SCHEMA = Schema(
    (
        Field("index", "scalar", np.dtype(np.int64)),
        Field("weight", "scalar", np.dtype(np.float32)),
        Field("vec", "ndarray", np.dtype(np.float32), (3,)),
        Field("blob", "bytes"),
        Field("text", "string"),
        Field("jpeg", "image"),
        Field("tokens", "varray", np.dtype(np.int32)),
    )
)
N = 96


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    rng = np.random.default_rng(3)
    jpegs, _ = make_jpegs(6, seed=1, min_side=8, max_side=16)
    samples = [
        {
            "index": i,
            "weight": np.float32(i / 7),
            "vec": rng.normal(size=3).astype(np.float32),
            "blob": rng.bytes(int(rng.integers(0, 700))),
            "text": "é" * int(rng.integers(0, 5)) + str(i),
            "jpeg": jpegs[i % len(jpegs)],
            "tokens": rng.integers(-5, 50000, int(rng.integers(0, 40)), dtype=np.int32),
        }
        for i in range(N)
    ]
    root = tmp_path_factory.mktemp("views") / "ds"
    write(samples, root, schema=SCHEMA, shard_size=20_000, workers=1, progress=False)
    return root


def _check_views(batch: dict, ds: FastloadDataset) -> list[int]:
    """`batch` (views) equals `ds[i]` for each of its samples, field by field; returns its indices."""
    assert isinstance(batch["index"], torch.Tensor) and batch["index"].dtype == torch.int64
    assert batch["weight"].dtype == torch.float64  # scalars widened, as default_collate does
    idx = batch["index"].tolist()
    for name in ("blob", "text", "jpeg", "tokens"):
        col = batch[name]
        assert isinstance(col, Ragged) and isinstance(col.values, torch.Tensor) and len(col) == len(idx)
        assert col.offsets.dtype == torch.int64
    for j, i in enumerate(idx):
        want = ds[i]
        assert batch["weight"][j].item() == float(want["weight"])
        assert torch.equal(batch["vec"][j], torch.from_numpy(want["vec"]))
        for name in ("blob", "text", "jpeg"):
            got = batch[name][j]
            assert type(got) is type(want[name]) and got == want[name], (i, name)
        assert np.array_equal(batch["tokens"][j].numpy(), want["tokens"]), i
    return idx


@pytest.mark.parametrize(
    ("workers", "worker_type", "ring"),
    [(0, "auto", False), (1, "thread", True), (2, "thread", False), (2, "process", False), (2, "process", True)],
)
def test_views_are_exact_while_every_batch_is_held(mixed, workers, worker_type, ring):
    ds = FastloadDataset(mixed)
    loader = Loader(ds, batch_size=8, num_workers=workers, worker_type=worker_type, seed=4, shuffle=True,
                    collate_fn=BatchViews(), buffer_ring=ring, ring_slots=4 if ring else None)
    assert loader.describe()["batch"] == "views"
    held = list(loader)  # every batch kept: reused slots must be retired, not rewritten
    torch.manual_seed(0)
    for _ in range(3):  # churn the allocator and the ring a little more before checking
        list(loader)
    seen = [i for batch in held for i in _check_views(batch, ds)]
    assert sorted(seen) == list(range(N)) and seen != sorted(seen)  # the whole epoch, shuffled


@pytest.mark.parametrize(("workers", "worker_type"), [(0, "auto"), (1, "thread"), (2, "process")])
def test_resume_continues_exactly_with_views(mixed, workers, worker_type):
    ds = FastloadDataset(mixed)

    def make() -> Loader:
        return Loader(ds, batch_size=8, num_workers=workers, worker_type=worker_type, seed=9, shuffle=True,
                      collate_fn=BatchViews())

    full = [b["index"].tolist() for b in make()]
    first = make()
    it = iter(first)
    head = [next(it)["index"].tolist() for _ in range(5)]
    state = first.state_dict()
    del it
    second = make()
    second.load_state_dict(state)
    tail = [_check_views(b, ds) for b in second]
    assert head + tail == full


def test_text_collate_gives_the_same_output_from_views_and_from_samples(mixed):
    ds = FastloadDataset(mixed)

    class Samples(torch.utils.data.Dataset):  # no get_batch: TextCollate gets a list of samples
        def __len__(self) -> int:
            return len(ds)

        def __getitem__(self, i: int) -> dict:
            return ds[i]

    for mode in ("padded", "packed"):
        collate = TextCollate(field="tokens", mode=mode, labels=True, pad_to_multiple_of=8)
        views = Loader(ds, batch_size=16, seed=2, shuffle=True, collate_fn=collate)
        plain = Loader(Samples(), batch_size=16, seed=2, shuffle=True, collate_fn=collate)
        assert views.describe()["batch"] == "views" and plain.describe()["batch"] == "samples"
        for a, b in zip(views, plain, strict=True):
            for key in ("input_ids", "attention_mask", "position_ids", "cu_seqlens", "labels", "index", "vec"):
                if key in b:
                    assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (mode, key)
            assert a.get("max_seqlen") == b.get("max_seqlen")
            for key in ("blob", "text", "jpeg"):  # passed through: one Ragged instead of a list
                assert a[key].to_list() == b[key]


def test_describe_names_the_batch_form_and_default_collate_keeps_torch_types(mixed):
    ds = FastloadDataset(mixed)
    loader = Loader(ds, batch_size=8)
    assert loader.describe()["batch"] == "torch" and loader.describe()["worker_kind"] == "inline"
    batch = next(iter(loader))
    assert type(batch["blob"]) is list and type(batch["text"][0]) is str
    assert Loader(ds, batch_size=8, collate_fn=lambda b: b).describe()["batch"] == "samples"
    assert Loader(ds, batch_size=8, num_workers=1, collate_fn=BatchViews()).describe()["worker_kind"] == "thread"
    assert fastload.BatchViews is BatchViews and "BatchViews" in fastload.__all__


def test_batch_views_columnises_a_list_of_samples(mixed):
    ds = FastloadDataset(mixed)
    idx = [5, 1, 77, 30]
    from_samples = BatchViews()([ds[i] for i in idx])
    from_columns = columns_to_views(ds.get_batch(np.array(idx)), scalar_fields=frozenset({"index", "weight"}))
    assert list(from_samples) == list(from_columns)
    for name, col in from_columns.items():
        other = from_samples[name]
        if isinstance(col, Ragged):
            assert col.kind == other.kind or (col.kind, other.kind) == ("image", "bytes")  # a sample has no kind
            assert torch.equal(col.values, other.values) and torch.equal(col.offsets, other.offsets)
        else:
            assert col.dtype == other.dtype and torch.equal(col, other), name
    with pytest.raises(TypeError, match="BatchViews takes"):
        BatchViews()(42)


def test_views_copy_memory_the_dataset_keeps_and_alias_fresh_gathers():
    resident = np.arange(20, dtype=np.uint8)
    kept = Ragged(resident[4:12], np.array([0, 3, 8]), "bytes")  # a slice of memory the dataset keeps
    fresh = Ragged(np.arange(6, dtype=np.uint8), np.array([0, 2, 6]), "bytes")  # a new gather buffer
    mapped = Ragged(np.frombuffer(b"abcdef", np.uint8), np.array([0, 2, 6], dtype=np.uint32), "bytes")
    views = columns_to_views({"kept": kept, "fresh": fresh, "mapped": mapped})
    views["kept"].values[:] = 0
    assert resident[4:12].tolist() == list(range(4, 12))  # the dataset's memory is untouched
    assert np.shares_memory(views["fresh"].values.numpy(), fresh.values)
    assert views["mapped"].offsets.dtype == torch.int64 and views["mapped"].to_list() == [b"ab", b"cdef"]
    assert views["kept"][1] == bytes(5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_views_move_to_the_device_like_other_fields(mixed):
    ds = FastloadDataset(mixed)
    loader = Loader(ds, batch_size=8, num_workers=1, seed=1, shuffle=True, collate_fn=BatchViews(), device="cuda")
    held = list(loader)
    for batch in held:
        col = batch["jpeg"]
        assert col.values.is_cuda and col.offsets.is_cuda
        cpu = {k: (Ragged(v.values.cpu(), v.offsets.cpu(), v.kind) if isinstance(v, Ragged) else v.cpu())
               for k, v in batch.items()}
        _check_views(cpu, ds)


def test_image_preset_as_collate_takes_views_and_matches_its_transform_path(mixed):
    from fastload.vision import ImagePreset
    from fastload.vision.indexed import with_indices

    ds = with_indices(FastloadDataset(mixed))

    def run(**stage) -> list[dict]:
        return list(Loader(ds, batch_size=16, seed=5, shuffle=True, num_workers=1, **stage))

    def preset() -> ImagePreset:
        return ImagePreset(kind="train", size=8, image_field="jpeg", backend="cpu", seed=3)

    as_collate = Loader(ds, batch_size=16, collate_fn=preset())
    assert as_collate.describe()["batch"] == "views"
    for a, b in zip(run(collate_fn=preset()), run(transform=preset()), strict=True):
        assert torch.equal(a["jpeg"], b["jpeg"]) and torch.equal(a["__indices__"], b["__indices__"])
        assert a["blob"].to_list() == b["blob"]  # the other fields: views, not lists
