"""Batch buffers (`fastload.formats.buffers`): recycled only once nothing refers to them, never
shared by two live arrays, bounded, and recognised by batch views as the consumer's own memory."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.fetch.views import ragged_to_torch
from fastload.formats import Ragged, buffers

SIZES = st.sampled_from([buffers.MIN_BYTES // 2, buffers.MIN_BYTES, buffers.MIN_BYTES + 1, 300_000, 1 << 20, 3_000_001])


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), SIZES, st.sampled_from([np.uint8, np.int32, np.float64]),
                              st.integers(0, 10**6)), max_size=40))
def test_live_arrays_never_share_memory(ops):
    """Allocations and releases in any order: every live array keeps the bytes written into it."""
    live: list[tuple[np.ndarray, int]] = []
    for allocate, nbytes, dtype, pick in ops:
        if allocate or not live:
            array = buffers.empty(nbytes // np.dtype(dtype).itemsize, dtype)
            array.view(np.uint8)[:] = len(live) % 251
            live.append((array, len(live) % 251))
        else:
            live.pop(pick % len(live))
        for array, mark in live:
            assert array.flags.writeable and array.flags.c_contiguous
            view = array.view(np.uint8)
            assert view[0] == mark and view[-1] == mark and view[len(view) // 2] == mark


def test_a_buffer_is_handed_out_again_once_its_last_view_is_gone():
    first = buffers.empty((256, 3, 64, 64), np.uint8)
    address = first.ctypes.data
    row = first[7]  # a view keeps the buffer in use
    del first
    second = buffers.empty((256, 3, 64, 64), np.uint8)
    assert second.ctypes.data != address
    del row
    gc.collect()
    third = buffers.empty((250, 3, 64, 64), np.uint8)  # same size class
    assert third.ctypes.data == address
    assert third.shape == (250, 3, 64, 64) and third.dtype == np.uint8


def test_small_requests_are_plain_arrays():
    small = buffers.empty(buffers.MIN_BYTES - 1, np.uint8)
    assert small.flags.owndata and not buffers.is_batch_buffer(small)
    big = buffers.empty(buffers.MIN_BYTES, np.uint8)
    assert buffers.is_batch_buffer(big) and buffers.is_batch_buffer(big[5:10])
    assert not buffers.is_batch_buffer(np.empty(1 << 20)[5:])


def test_the_pool_keeps_at_most_its_limit(monkeypatch):
    monkeypatch.setattr(buffers, "MAX_KEPT_BYTES", buffers.kept_bytes() + (3 << 20))
    arrays = [buffers.empty(1 << 20, np.uint8) for _ in range(8)]
    del arrays
    gc.collect()
    assert buffers.kept_bytes() <= buffers.MAX_KEPT_BYTES


def test_batch_views_share_a_batch_buffer_and_keep_it_in_use():
    values = buffers.empty(1 << 20, np.uint8)
    values[:] = 9
    offsets = np.array([0, 1 << 19, 1 << 20], dtype=np.int64)
    view = ragged_to_torch(Ragged(values, offsets, "bytes"))
    assert isinstance(view.values, torch.Tensor)
    assert view.values.data_ptr() == values.ctypes.data  # zero copy: the consumer's own memory
    address = values.ctypes.data
    del values
    gc.collect()
    other = buffers.empty(1 << 20, np.uint8)
    assert other.ctypes.data != address  # the tensor still uses it
    other[:] = 1
    assert int(view.values.sum()) == 9 << 20


def test_a_mapped_column_is_not_a_batch_buffer(tmp_path):
    from fastload.formats import FastloadDataset, Field, Schema, write

    schema = Schema((Field("x", "ndarray", np.dtype(np.uint8), (1024,)),))
    write([{"x": np.full(1024, i % 256, np.uint8)} for i in range(600)], str(tmp_path / "ds"), schema=schema,
          shard_size=200 << 10, progress=False)
    ds = FastloadDataset(tmp_path / "ds")
    ds.get_batch([0])
    columns = ds.spliced_columns()
    if not columns:
        pytest.skip("columns are not spliced on this platform")
    assert not buffers.is_batch_buffer(columns["x"].rows)
    batch = ds.get_batch(np.arange(300))
    assert buffers.is_batch_buffer(batch["x"])
    assert [int(r[0]) for r in batch["x"]] == [i % 256 for i in range(300)]
    ds.close()


class _ShardByShard:
    """Local files behind a storage that is not `LocalStorage`: the dataset reads them shard by shard, as it
    reads a remote cache's, until every shard is open."""

    def __init__(self, root) -> None:
        from fastload.formats.storage import LocalStorage

        self.local, self.root = LocalStorage(root), str(root)

    def read_small(self, name: str) -> bytes:
        return self.local.read_small(name)

    def acquire(self, name: str, *, size: int, xxh3: str) -> str:
        return self.local.acquire(name, size=size, xxh3=xxh3)

    def release(self, name: str) -> None:
        self.local.release(name)

    def prefetch(self, names: list[str]) -> None:
        pass


def test_batches_read_shard_by_shard_go_into_batch_buffers(tmp_path):
    """A shuffled batch over three of four shards: read while its shards open (one at a time), then
    again with them open (one copy per field over the open shards): both times into a batch buffer,
    byte for byte, with the mapping left as it was."""
    from fastload.formats import FastloadDataset, Field, Schema, write

    schema = Schema((Field("x", "ndarray", np.dtype(np.uint8), (1024,)), Field("i", "scalar", np.dtype(np.int64))))
    write([{"x": np.full(1024, i % 251, np.uint8), "i": i} for i in range(800)], str(tmp_path / "ds"),
          schema=schema, shard_size=200 << 10, progress=False)
    ds = FastloadDataset(storage=_ShardByShard(tmp_path / "ds"))
    assert ds.num_shards >= 4
    inside = int(ds.shard_boundaries[3])  # samples of the first three shards
    idx = np.random.default_rng(5).permutation(inside)[:300]
    for _ in range(2):
        batch = ds.get_batch(idx)
        assert buffers.is_batch_buffer(batch["x"])
        assert batch["i"].tolist() == idx.tolist()
        assert np.array_equal(batch["x"], np.repeat((idx % 251).astype(np.uint8)[:, None], 1024, axis=1))
        assert ds.open_shards == 3  # the fourth is not open: no spliced columns yet
    ds.close()


def test_loader_batches_held_across_epochs_stay_exact(tmp_path):
    """Batch views of a mixed dataset through the Loader, every batch of an epoch held (so later
    batches cannot reuse their buffers) or each dropped at once (so they do): every sample exactly
    once per epoch, byte for byte."""
    from fastload.fetch.views import BatchViews
    from fastload.formats import Field, Schema, write
    from fastload.loader import Loader

    schema = Schema((
        Field("record", "ndarray", np.dtype(np.uint8), (2, 40, 40)),
        Field("label", "scalar", np.dtype(np.int64)),
        Field("jpeg", "bytes"),
        Field("tokens", "varray", np.dtype(np.int32)),
    ))
    rng = np.random.default_rng(1)
    samples = [
        {
            "record": rng.integers(0, 256, (2, 40, 40), dtype=np.uint8),
            "label": i,
            "jpeg": rng.bytes(int(rng.integers(0, 6000))),
            "tokens": rng.integers(0, 2**31, int(rng.integers(0, 400)), dtype=np.int32),
        }
        for i in range(700)
    ]
    write(samples, str(tmp_path / "ds"), schema=schema, shard_size=512 << 10, progress=False, workers=1)
    from fastload.formats import FastloadDataset

    loader = Loader(FastloadDataset(tmp_path / "ds"), batch_size=256, shuffle=True, seed=3,
                    collate_fn=BatchViews(), num_workers=0)
    for hold_all in (True, False, True):
        held, seen = [], []
        for batch in loader:
            labels = batch["label"].tolist()
            seen.extend(labels)
            for pos, i in enumerate(labels):
                assert batch["record"][pos].numpy().tobytes() == samples[i]["record"].tobytes()
                assert batch["jpeg"][pos] == samples[i]["jpeg"]
                assert batch["tokens"][pos].numpy().tobytes() == samples[i]["tokens"].tobytes()
            if hold_all:
                held.append((batch, labels))
        assert sorted(seen) == list(range(len(samples)))
        for batch, labels in held:  # nothing written since over what a held batch views
            for pos, i in enumerate(labels):
                assert batch["record"][pos].numpy().tobytes() == samples[i]["record"].tobytes()
                assert batch["jpeg"][pos] == samples[i]["jpeg"]
