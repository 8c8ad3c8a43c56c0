"""Without torch's storage use count (another torch version), reused buffers are never rewritten
while a batch the user kept may still view them: kept batches keep their contents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastload import Loader
from fastload.transfer.ring import BufferRing, referenced_beyond, storage_refs

KEEP = 32


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return KEEP * 4

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((64,), i, dtype=torch.int64), "y": torch.tensor(i)}


def _remove_use_count(monkeypatch, how: str) -> None:
    if how == "missing":
        monkeypatch.delattr(torch._C, "_storage_Use_Count", raising=False)
    else:

        def broken(_cdata: int) -> int:
            raise RuntimeError("not in this torch")

        monkeypatch.setattr(torch._C, "_storage_Use_Count", broken)


@pytest.fixture(params=["missing", "raises"])
def no_use_count(request, monkeypatch):
    _remove_use_count(monkeypatch, request.param)
    return request.param


def test_unknown_count_means_referenced(no_use_count):
    t = torch.zeros(8)
    assert storage_refs(t) is None
    assert referenced_beyond(t, None) and referenced_beyond(t, 3)


def test_known_count_tells_kept_from_dropped():
    t = torch.zeros(8, dtype=torch.uint8)
    base = storage_refs(t)
    assert base is not None and not referenced_beyond(t, base)
    view = t[2:4]
    assert referenced_beyond(t, base)
    del view
    assert not referenced_beyond(t, base)


def test_ring_retires_every_slot_without_use_count(no_use_count):
    ring = BufferRing(2, pin=False)
    kept = []
    for i in range(8):
        out, slot = ring.write({"x": torch.full((16,), i)})
        kept.append(out)
        ring.release(slot)
    assert ring.allocations == 8 and ring.retired == 7
    assert [int(b["x"][0]) for b in kept] == list(range(8))


def _check_kept(loader: Loader) -> None:
    kept = []
    for b, batch in enumerate(loader):
        kept.append((b, batch))
        if len(kept) == KEEP:
            break
    for b, batch in kept:
        rows = np.arange(b * 4, b * 4 + 4)
        assert batch["y"].tolist() == rows.tolist(), f"batch {b} was overwritten"
        assert (batch["x"] == torch.as_tensor(rows)[:, None]).all(), f"batch {b} was overwritten"


@pytest.mark.parametrize(("worker_type", "how"), [("thread", "missing"), ("thread", "raises"), ("process", "missing")])
def test_kept_batches_survive_without_use_count(monkeypatch, worker_type, how):
    """The main process decides whether a slot is reused (ring and process slots alike)."""
    _remove_use_count(monkeypatch, how)
    loader = Loader(
        Rows(),
        batch_size=4,
        num_workers=2,
        worker_type=worker_type,
        buffer_ring=worker_type == "thread",
        ring_slots=4,
        persistent_workers=False,
    )
    try:
        _check_kept(loader)
    finally:
        loader.close()
