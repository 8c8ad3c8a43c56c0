"""The CPU image stage's returned batches: in `formats.buffers`, reused only once the caller let go of them."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats import buffers
from fastload.formats.ragged import Ragged
from fastload.vision import ImagePreset

Image = pytest.importorskip("PIL.Image")

# How a caller can hold a returned block: the tensor, torch views, numpy views of it.
HOLDS = {
    "tensor": lambda t: t,
    "row view": lambda t: t[1],
    "permuted": lambda t: t.permute(1, 0),
    "numpy": lambda t: t.numpy(),
    "numpy slice": lambda t: t.numpy()[2:],
    "storage": lambda t: t.untyped_storage(),
}


def held_bytes(held) -> np.ndarray:
    """The bytes a holder sees (all of the block for the tensor, numpy and storage forms)."""
    if isinstance(held, torch.UntypedStorage):
        return torch.tensor([], dtype=torch.uint8).set_(held).numpy()
    return np.asarray(held).reshape(-1)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([1, 1, 1, 2]), st.sampled_from(list(HOLDS)), st.booleans()),
        min_size=1,
        max_size=30,
    ),
)
def test_a_buffer_is_never_handed_out_while_anything_refers_to_it(steps) -> None:
    """Every buffer taken is filled with its own number; whatever still holds one (the tensor, a
    view, a numpy array, its storage) sees that number after every later take."""
    held: list[tuple[int, object]] = []
    for number, (size, how, drop_oldest) in enumerate(steps):
        block = torch.from_numpy(buffers.empty((8, size * buffers.MIN_BYTES // 8), np.uint8))
        block.fill_(number % 256)
        held.append((number % 256, HOLDS[how](block)))
        del block
        if drop_oldest and len(held) > 1:
            held.pop(0)
        for value, h in held:
            assert (held_bytes(h) == value).all()


def jpegs(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_batches_the_caller_holds_are_never_overwritten(dtype: torch.dtype) -> None:
    """A preset's returned batch keeps its pixels while held, however many batches follow; once
    dropped, its memory serves a later batch."""
    images = jpegs(12)
    batches = [
        {"image": Ragged.from_list(images[s : s + 4], kind="image"), "__indices__": np.arange(s, s + 4)}
        for s in (0, 4, 8)
    ]
    preset = ImagePreset(kind="train", size=256, backend="cpu", threads=1, dtype=dtype, seed=3)
    first = preset(batches[0])["image"]
    want = first.clone()
    addresses = {first.data_ptr()}
    for b in batches[1:] * 3:
        out = preset(b)["image"]
        assert out.data_ptr() != first.data_ptr()
        assert torch.equal(first, want)
        addresses.add(out.data_ptr())
        del out
    del first
    again = preset(batches[0])["image"]
    assert again.data_ptr() in addresses  # a retired block, not a fresh one
    assert torch.equal(again, want)  # the same keys: the same pixels


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_loaders_batches_kept_together_are_distinct(tmp_path, worker_type: str) -> None:
    """Batches kept over two epochs: each has its own memory and its own pixels."""
    from fastload import Loader, open_dataset
    from fastload.formats import Field, Schema, write
    from fastload.vision import with_indices

    images = jpegs(16)
    schema = Schema((Field("image", "image"), Field("label", "scalar", np.int64)))
    write(({"image": j, "label": i} for i, j in enumerate(images)), str(tmp_path / "ds"), schema=schema, progress=False)
    preset = ImagePreset(kind="eval", size=32, resize=None, backend="cpu", normalize=False)
    dataset = with_indices(open_dataset(str(tmp_path / "ds")))
    loader = Loader(dataset, batch_size=4, transform=preset, num_workers=2, worker_type=worker_type)
    kept = [b["image"] for b in loader] + [b["image"] for b in loader]
    assert len({t.data_ptr() for t in kept}) == len(kept) == 8
    alone = ImagePreset(kind="eval", size=32, resize=None, backend="cpu", normalize=False)
    want = alone({"image": Ragged.from_list(images, kind="image"), "__indices__": np.arange(16)})["image"]
    assert torch.equal(torch.cat(kept[:4]), want) and torch.equal(torch.cat(kept[4:]), want)
