"""The Loader's torch attributes say what it delivers (`fastload.loader_views`): a torch DataLoader
rebuilt from `dataset`, `batch_sampler` and `collate_fn` (Accelerate's `skip_first_batches`)
yields the Loader's own batches, and Lightning's resume that would skip is refused."""

from __future__ import annotations

import io
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader

from fastload import Loader
from fastload.formats.ragged import Ragged
from fastload.formats.shapes import ShapedBatch
from fastload.loader_views import LoaderCollate, columns_from_samples

pytestmark = pytest.mark.timeout(120)


class Ids:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": np.int64(i)}

    def get_batch(self, idx) -> dict:
        return {"i": np.asarray(idx, dtype=np.int64)}


class Skip(BatchSampler):
    """Accelerate's `SkipBatchSampler`: a batch sampler without its first `n` batches."""

    def __init__(self, batches, n: int) -> None:
        self.batches, self.n = batches, n

    def __iter__(self):
        for k, b in enumerate(self.batches):
            if k >= self.n:
                yield b

    def __len__(self) -> int:
        return len(self.batches) - self.n


def rebuilt(loader: Loader, n: int, **kw) -> DataLoader:
    """What `accelerate.skip_first_batches(loader, n)` builds from a Loader."""
    return DataLoader(loader.dataset, batch_sampler=Skip(loader.batch_sampler, n), collate_fn=loader.collate_fn, **kw)


def ids(batches) -> list[list[int]]:
    return [b["i"].tolist() for b in batches]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 90),
    batch_size=st.integers(1, 9),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_batch_sampler_is_this_ranks_epoch_and_a_rebuilt_loader_yields_the_rest(
    n, batch_size, world, drop_last, shuffle, data
):
    if drop_last and n < world:
        return  # refused by the seeded order (every rank would get nothing)
    rank = data.draw(st.integers(0, world - 1))
    epoch = data.draw(st.integers(0, 2))

    def make() -> Loader:
        loader = Loader(Ids(n), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=3, rank=rank,
                        world_size=world)
        loader.set_epoch(epoch)
        return loader

    expected = ids(make())
    loader = make()
    assert list(loader.sampler) == [i for b in expected for i in b] and len(loader.sampler) == len(list(loader.sampler))
    assert [list(b) for b in loader.batch_sampler] == expected and len(loader.batch_sampler) == len(expected)
    assert loader.epoch == epoch + 1  # iterated to its end: the epoch counts as delivered
    skip = data.draw(st.integers(0, len(expected)))
    loader = make()
    it = iter(loader)
    head = [next(it)["i"].tolist() for _ in range(skip)]
    rest = rebuilt(loader, skip)
    assert head + ids(rest) == expected and len(rest) == len(expected) - skip


def test_iterating_the_batch_sampler_to_its_end_delivers_the_epoch():
    loader = Loader(Ids(40), batch_size=8, shuffle=True, seed=0)
    reference = Loader(Ids(40), batch_size=8, shuffle=True, seed=0)
    epochs = [ids(reference) for _ in range(3)]
    assert ids(rebuilt(loader, 2)) == epochs[0][2:]
    assert loader.epoch == 1 and ids(loader) == epochs[1]
    loader.set_epoch(2)
    it = iter(loader.batch_sampler)
    assert next(it) == epochs[2][0]
    del it
    assert loader.epoch == 2  # not iterated to its end: no advance
    assert ids(rebuilt(loader, 0, num_workers=2)) == epochs[2]  # workers of the rebuilt loader too


def test_torch_order_batch_sampler_iterates_as_torch():
    """Without a seed on one rank the Loader replays torch's samplers: the view iterates them as torch does."""
    torch.manual_seed(5)
    want = ids(DataLoader(Ids(30), batch_size=4, shuffle=True))
    torch.manual_seed(5)
    loader = Loader(Ids(30), batch_size=4, shuffle=True)
    assert ids(DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn)) == want
    assert len(loader.batch_sampler) == len(loader) == 8


@pytest.mark.parametrize("generator", [False, True])
def test_torch_order_epoch_under_way_is_replayed_for_a_rebuilt_loader(generator):
    """Mid-epoch, the view replays the epoch's own draws: a rebuilt loader yields its rest."""

    def make() -> Loader:
        gen = torch.Generator().manual_seed(9) if generator else None
        return Loader(Ids(30), batch_size=4, shuffle=True, generator=gen)

    torch.manual_seed(11)
    epochs = [ids(loader) for loader in [make()] for _ in range(2)]
    torch.manual_seed(11)
    loader = make()
    it = iter(loader)
    head = [next(it)["i"].tolist() for _ in range(3)]
    assert head + ids(rebuilt(loader, 3)) == epochs[0]
    following = ids(loader)  # the next epoch: a new draw (torch's DataLoader drew its own base seed meanwhile)
    assert following != epochs[0] and sorted(i for b in following for i in b) == list(range(30))


def test_user_samplers_stay_as_given():
    sampler = torch.utils.data.SequentialSampler(range(10))
    batches = BatchSampler(sampler, 3, False)
    assert Loader(Ids(10), batch_sampler=batches).batch_sampler is batches
    loader = Loader(Ids(10), sampler=sampler, batch_size=2)
    assert loader.sampler is sampler
    assert loader.collate_fn.columns  # samples to get_batch columns, converted as the Loader does


def test_a_position_re_dealt_from_another_world_size_cannot_be_skipped_into():
    saving = Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=2)
    it = iter(saving)
    next(it)
    next(it)
    state = saving.state_dict()
    loader = Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=1)
    loader.load_state_dict(state)
    refused = r"another world or batch size .*saved at world size 2, batch size 4.*Iterate the Loader itself"
    with pytest.raises(ValueError, match=refused):
        list(loader.batch_sampler)
    assert len(list(loader)) == len(loader.batch_sampler) - 4  # the Loader itself continues: 16 seen, 24 left


def test_collate_fn_gives_the_loaders_batch_from_samples(tmp_path):
    """Every field kind of a fastload dataset, with a transform on the columns: a list of samples
    (`__getitems__`, as torch's DataLoader reads them) through `loader.collate_fn` is the Loader's batch."""
    formats = pytest.importorskip("fastload.formats")
    rng = np.random.default_rng(0)
    samples = [
        {
            "label": i,
            "score": i / 4,
            "emb": rng.standard_normal(3).astype(np.float32),
            "word": "w" * (i % 4) + str(i),
            "raw": bytes([i % 256]) * (i % 3),
            "tok": np.arange(i % 5, dtype=np.int32),
            "grid": np.full((i % 3 + 1, 2), i, dtype=np.int16),
        }
        for i in range(30)
    ]
    formats.write(samples, tmp_path / "ds", progress=False)
    ds = formats.FastloadDataset(tmp_path / "ds")

    def transform(cols: dict) -> dict:
        assert isinstance(cols["tok"], Ragged) and isinstance(cols["grid"], ShapedBatch)
        cols["tok_len"] = np.diff(np.asarray(cols["tok"].offsets))
        cols["grid"] = [np.asarray(g).sum() for g in cols["grid"].to_list()]
        return cols

    for kw in ({}, {"transform": transform}):
        loader = Loader(ds, batch_size=7, shuffle=True, seed=1, **kw)
        for batch, idx in zip(loader, loader.batch_sampler):
            assert _same(loader.collate_fn(ds.__getitems__(idx)), batch)
            assert _same(loader.collate_fn([ds[i] for i in idx]), batch)


def test_collate_fn_with_a_transform_on_collated_samples():
    class DS:
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> tuple:
            return torch.tensor([i, -i]), i

    def transform(batch):
        x, y = batch
        return {"x": x * 2, "y": y}

    loader = Loader(DS(), batch_size=5, transform=transform)
    assert isinstance(loader.collate_fn, LoaderCollate)
    assert _same(list(rebuilt(loader, 1)), list(loader)[1:])


def test_columns_from_samples_without_a_schema():
    cols = columns_from_samples([{"a": 1, "s": "x", "t": np.arange(2)}, {"a": 2, "s": "yz", "t": np.arange(3)}])
    assert cols["a"].tolist() == [1, 2] and cols["s"].to_list() == ["x", "yz"]
    assert [t.tolist() for t in cols["t"].to_list()] == [[0, 1], [0, 1, 2]]
    with pytest.raises(TypeError, match="each sample must be a dict"):
        columns_from_samples([1, 2])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Ragged):
        return isinstance(b, Ragged) and a.kind == b.kind and _same(a.values, b.values) and _same(a.offsets, b.offsets)
    if isinstance(a, ShapedBatch):
        return isinstance(b, ShapedBatch) and all(
            np.array_equal(x, y) for x, y in zip((a.values, a.offsets, a.shapes), (b.values, b.offsets, b.shapes))
        )
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.generic | np.ndarray):
        return type(a) is type(b) and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def _lightning_load(loader: Loader, state: dict) -> None:
    """What Lightning's fit loop does with a checkpoint's loader state (`CombinedLoader`)."""
    combined = pytest.importorskip("lightning.pytorch.utilities.combined_loader")
    combined.CombinedLoader(loader, "max_size_cycle")._load_state_dicts([state])


def _after(world: int, batches: int, state: dict | None = None) -> dict:
    """The state of a Loader at `world` (loaded from `state` as Lightning does) after `batches` batches."""
    loader = Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=world)
    if state is not None:
        _lightning_load(loader, state)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


@pytest.mark.frameworks
def test_lightning_resume_is_refused_where_it_would_skip():
    """Lightning stops a resumed epoch after len(loader) - (batches it restored): fewer ranks leave
    fewer batches (allowed, exact), more ranks leave more (refused), counted over every resume."""
    two = _after(2, 2)
    assert two["batches_yielded"] == 2
    with pytest.raises(ValueError, match=r"saved in epoch 0 after 2 batches per process at world size 2; at world "
                       r"size 4 an epoch has 3 batches per process and this Loader has 2 left.*would stop after 1"):
        _lightning_load(Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=4), two)
    one_state = _after(1, 3, two)  # 2 -> 1: 6 batches left of 10, Lightning takes up to 8: exact
    assert one_state["batches_yielded"] == 5  # what Lightning counted: 2 at world size 2, then 3
    with pytest.raises(ValueError, match="after 5 batches per process at world size 1.*Resume on 1 device"):
        _lightning_load(Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=2), one_state)
    same = Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=1)
    _lightning_load(same, one_state)  # the same world size: 3 left, Lightning would take up to 10 - 5
    assert len(same) == 3 and len(list(same)) == 3
    plain = Loader(Ids(40), batch_size=4, shuffle=True, seed=0, rank=0, world_size=2)
    plain.load_state_dict(one_state)  # not a step-counting caller: the rest is re-dealt, as in a torchrun loop
    assert len(plain) == 2


# ----------------------------------------------------------------------------- augmentation in a rebuilt loader
def _jpeg(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory):
    """A fastload dataset of 36 small JPEGs of varying sizes with a label = the sample's index."""
    formats = pytest.importorskip("fastload.formats")
    root = tmp_path_factory.mktemp("views-images") / "ds"
    samples = [{"image": _jpeg(20 + 3 * (i % 5), 26 + 2 * (i % 7), i), "label": i} for i in range(36)]
    schema = formats.Schema([formats.Field("image", "image"), formats.Field("label", "scalar", np.int64)])
    formats.write(samples, root, schema=schema, progress=False, workers=1)
    return formats.FastloadDataset(root)


def _preset_loader(ds, how: str, **kw) -> Loader:
    from fastload.vision import ImagePreset

    preset = ImagePreset(kind="train", size=16, backend="cpu", dtype=torch.float32)
    return Loader(ds, batch_size=5, shuffle=True, seed=7, **{how: preset}, **kw)


@pytest.mark.parametrize("how", ["transform", "collate_fn"])
@pytest.mark.parametrize("epoch", [0, 2])
def test_rebuilt_loader_without_workers_augments_as_the_loader(images, how, epoch):
    """`skip_first_batches` with num_workers=0: each batch the view yields reaches `loader.collate_fn`
    as the current batch, so `ImagePreset(kind="train")` gives the Loader's pixels, mid-epoch and in
    a fresh Loader set to the epoch (as a resumed process does)."""
    reference = _preset_loader(images, how)
    reference.set_epoch(epoch)
    expected = list(reference)
    loader = _preset_loader(images, how)
    loader.set_epoch(epoch)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    rest = list(rebuilt(loader, 3))
    assert _same(head + rest, expected)
    fresh = _preset_loader(images, how)
    fresh.set_epoch(epoch)
    assert _same(list(rebuilt(fresh, 2)), expected[2:])
    fresh.set_epoch(epoch)
    dropped, gone = rebuilt(fresh, 1), weakref.ref(fresh)
    del fresh  # the DataLoader holds the views only: they run without their Loader
    assert gone() is None
    assert _same(list(dropped), expected[1:])
    if epoch:  # and the augmentation is the epoch's own, not epoch 0's
        reference.set_epoch(0)
        assert not torch.equal(list(reference)[2]["image"], expected[2]["image"])


def test_rebuilt_loader_with_worker_processes_refuses_keyed_augmentation(images):
    """With worker processes torch draws a batch's indices ahead, in the main process: the preset's
    crops cannot be keyed by them, so the rebuilt loader raises, naming the way out."""
    loader = _preset_loader(images, "transform")
    refused = (r"dataset indices of this batch cannot be known: loader\.collate_fn runs in a worker process .*"
               r"loader\.load_state_dict\(state\).*num_workers=0 for the resumed epoch")
    with pytest.raises(RuntimeError, match=refused):  # torch re-raises the worker's BatchUnknownError
        list(rebuilt(loader, 2, num_workers=1))


def test_collate_fn_outside_a_rebuilt_loaders_batch_refuses_keyed_augmentation(images):
    """Samples `loader.collate_fn` cannot match to a batch the view just yielded (called apart
    from it; a user's batch sampler, which hands nothing over): a random preset raises, an eval
    preset and a plain transform do not need the indices and give the Loader's batch."""
    from fastload.run import BatchUnknownError
    from fastload.vision import ImagePreset

    loader = _preset_loader(images, "transform")
    samples = images.__getitems__([0, 1, 2])
    with pytest.raises(BatchUnknownError, match="did not just yield in this thread"):
        loader.collate_fn(samples)
    batches = list(loader.batch_sampler)  # iterated to its end: nothing is left published
    with pytest.raises(BatchUnknownError, match="did not just yield in this thread"):
        loader.collate_fn(images.__getitems__(batches[0]))
    it = iter(loader.batch_sampler)
    first = next(it)
    with pytest.raises(BatchUnknownError, match=f"yielded {len(first)} indices but loader.collate_fn got 2"):
        loader.collate_fn(images.__getitems__(first[:2]))
    budget = BatchSampler(torch.utils.data.SequentialSampler(range(36)), 6, False)
    preset = ImagePreset(kind="train", size=16, backend="cpu")
    user = Loader(images, batch_sampler=budget, transform=preset)
    with pytest.raises(BatchUnknownError, match="batch_sampler is the user's own object"):
        list(DataLoader(user.dataset, batch_sampler=user.batch_sampler, collate_fn=user.collate_fn))
    evaluating = Loader(images, batch_sampler=budget, transform=ImagePreset(kind="eval", size=16, backend="cpu"))
    assert _same(list(DataLoader(images, batch_sampler=budget, collate_fn=evaluating.collate_fn)), list(evaluating))


def test_preset_alone_draws_from_torchs_rng(images):
    """Outside any Loader batch and without indices, a random preset keys its draws from torch's
    global RNG: new crops every call, the same under the same `torch.manual_seed`."""
    from fastload.vision import ImagePreset

    preset = ImagePreset(kind="train", size=16, backend="cpu", dtype=torch.float32)
    batch = images.get_batch(np.arange(8))
    torch.manual_seed(3)
    first, second = preset(batch)["image"], preset(batch)["image"]
    torch.manual_seed(3)
    assert torch.equal(preset(batch)["image"], first) and not torch.equal(first, second)
