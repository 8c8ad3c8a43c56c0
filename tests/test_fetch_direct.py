"""The Fetcher's direct-take path: a local fastload dataset of fixed-size fields is read with one
`take` per field and `torch.from_numpy`, and must give exactly what `get_batch` + `columns_to_torch` give."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from probe_clock import use_step_clock
from torch.utils.data import DataLoader

from fastload import Loader
from fastload.fetch.collate import columns_to_torch
from fastload.fetch.fetcher import Fetcher, torch_gather
from fastload.formats import FastloadDataset, Field, Schema, write
from fastload.formats import spliced as spliced_mod
from fastload.formats.spliced import splice_available

pytestmark = pytest.mark.skipif(not splice_available(), reason="direct takes need spliced columns (Linux)")

N = 500


def _dataset(path, *, label_dtype=np.int64, ragged: bool = False) -> FastloadDataset:
    rng = np.random.default_rng(3)
    fields = [Field("x", "ndarray", np.float32, (40,)), Field("y", "scalar", label_dtype)]
    if ragged:
        fields.append(Field("tok", "varray", np.int32))
    samples = [
        {"x": rng.standard_normal(40).astype(np.float32), "y": i * 7, **({"tok": np.arange(i % 4)} if ragged else {})}
        for i in range(N)
    ]
    write(samples, str(path), schema=Schema(tuple(fields)), shard_size=16 << 10, progress=False)
    return FastloadDataset(path)


def _fetcher(ds, **kw) -> Fetcher:
    return Fetcher(ds, mode="columns", collate_fn=None, scalar_fields=frozenset({"y"}), **kw)


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def test_direct_path_matches_get_batch(tmp_path):
    ds = _dataset(tmp_path / "ds")
    assert ds.num_shards > 1
    fetch = _fetcher(ds)
    rng = np.random.default_rng(0)
    for idx in (np.sort(rng.permutation(N)[:64]), rng.integers(-N, N, 33), [N - 1, -N, 0, 0], np.arange(N), []):
        got, timings = fetch(idx)
        want = columns_to_torch(ds.get_batch(idx), scalar_fields=frozenset({"y"}))
        assert _same(got, want)
        assert set(timings) == {"read"}
    assert fetch.direct, "the direct path was taken"
    calls = []
    ds.get_batch = lambda *a, **k: calls.append(a)  # no get_batch call per batch on the direct path
    fetch(np.arange(10))
    assert calls == []


@pytest.mark.parametrize("case", ["int32 label", "transform", "ragged field"])
def test_direct_path_declined_when_conversion_is_needed(tmp_path, case):
    ds = _dataset(
        tmp_path / "ds", label_dtype=np.int32 if case == "int32 label" else np.int64, ragged=case == "ragged field"
    )
    fetch = _fetcher(ds, transform=(lambda cols: cols) if case == "transform" else None)
    idx = np.array([4, 1, 9])
    got, _ = fetch(idx)
    assert not fetch.direct_path()
    assert got["y"].dtype == torch.int64 and got["y"].tolist() == [28, 7, 63]  # widened as default_collate does
    assert torch.equal(got["x"], torch.from_numpy(ds.get_batch(idx)["x"]))


def test_direct_path_out_of_range_names_the_dataset(tmp_path):
    ds = _dataset(tmp_path / "ds")
    fetch = _fetcher(ds)
    fetch([0])
    with pytest.raises(IndexError, match=f"sample index {N} out of range.*{tmp_path / 'ds'}"):
        fetch([1, N])


def test_direct_path_after_close_and_in_a_pickled_copy(tmp_path):
    ds = _dataset(tmp_path / "ds")
    fetch = _fetcher(ds)
    idx = np.array([3, 400, 77])
    first, _ = fetch(idx)
    ds.close()
    fetch.refresh()  # what the Loader does as an epoch starts: the reopened dataset's mappings
    again, _ = fetch(idx)
    assert _same(first, again) and fetch.direct
    copy = pickle.loads(pickle.dumps(fetch))
    assert not copy.direct  # its takes are looked up in the process that uses it
    assert _same(first, copy(idx)[0]) and copy.direct


@pytest.mark.parametrize("workers", [(0, "thread"), (1, "thread"), (2, "thread"), (2, "process")])
def test_loader_over_fixed_fields_matches_torch(tmp_path, workers):
    nw, wt = workers
    ds = _dataset(tmp_path / "ds")
    want = list(DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5)))
    for _ in range(2):  # a second epoch re-checks the takes
        got = list(
            Loader(
                ds,
                batch_size=32,
                shuffle=True,
                generator=torch.Generator().manual_seed(5),
                num_workers=nw,
                worker_type=wt,
            )
        )
        assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    loader = Loader(ds, batch_size=32, shuffle=True, seed=1, num_workers=nw, worker_type=wt)
    seen = [b["y"] for _ in range(2) for b in loader]
    per_epoch = len(seen) // 2
    for e in range(2):
        ys = torch.cat(seen[e * per_epoch : (e + 1) * per_epoch])
        assert sorted(ys.tolist()) == [i * 7 for i in range(N)], "every sample exactly once per epoch"
    assert loader.stats()["read_s"] > 0
    if wt == "thread":
        assert loader.describe()["direct_path"], "the Loader reads through the direct takes"


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(3064,), (3001,), (7, 13), (3, 5, 5), (1,)]),
    dtype=st.sampled_from([np.uint8, np.float16, np.float32, np.int64, np.uint16, np.uint64, np.bool_]),
    rows=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_torch_gather_equals_numpy_take(shape, dtype, rows, seed):
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 200, (rows, *shape)).astype(dtype)
    table.setflags(write=False)  # like a read-only mapping
    row_numbers = rng.integers(0, rows, int(rng.integers(0, 2 * rows)))
    got, want = torch_gather(table)(row_numbers).numpy(), table.take(row_numbers, axis=0)
    assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def test_torch_gather_declines_dtypes_torch_lacks():
    assert torch_gather(np.zeros((4, 3), np.dtype(">i4"))) is None
    assert torch_gather(np.zeros((4, 3), np.dtype("V8"))) is None


@pytest.mark.parametrize("use_table", [True, False])
def test_fetch_alone_matches_fetch(tmp_path, monkeypatch, use_table):
    monkeypatch.setattr(spliced_mod, "TABLE_ROWS", 1 << 30 if use_table else 0)
    ds = _dataset(tmp_path / "ds")
    fetch = _fetcher(ds)
    fetch.refresh()
    assert fetch.direct
    rng = np.random.default_rng(1)
    for idx in (np.sort(rng.permutation(N)[:64]), rng.integers(-N, N, 33), [N - 1, -N, 0, 0], []):
        alone, timings = fetch.fetch_alone(idx)
        assert _same(alone, fetch(idx)[0]) and set(timings) == {"read"}
    with pytest.raises(IndexError, match=f"sample index {-N - 1} out of range.*{tmp_path / 'ds'}"):
        fetch.fetch_alone([3, -N - 1])


@pytest.mark.parametrize("threads_win", [True, False])
def test_direct_path_probe_starts_inline_then_keeps_the_faster_mode(tmp_path, monkeypatch, threads_win):
    """With `autotune=True`, on the direct path the probe starts inline (a run shorter than `FIRST_S` reads as with 0
    workers), then times the workers and keeps the faster mode; batches and their order are
    those of num_workers=0 through every switch."""
    from fastload.pipeline import ThreadProbe

    monkeypatch.setattr(ThreadProbe, "MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(ThreadProbe, "WINDOW", 3)
    monkeypatch.setattr(ThreadProbe, "FILL", 3)
    monkeypatch.setattr(ThreadProbe, "MARGIN", 0.0 if threads_win else 1e9)
    monkeypatch.setattr(ThreadProbe, "WATCH", 10**9)  # margin 0 would also make the watch fall back to inline
    monkeypatch.setattr(ThreadProbe, "RETRY_S", 1e9)  # the choice stays as made, however slow this machine
    monkeypatch.setattr(ThreadProbe, "FIRST_S", 0.0)  # the workers' trial as soon as inline's window is full
    use_step_clock(monkeypatch)  # the probe times batch counts: the same decisions however loaded the machine
    ds = _dataset(tmp_path / "ds")
    inline = Loader(ds, batch_size=8, shuffle=True, seed=2)
    want = [b["y"].tolist() for _ in range(2) for b in inline]  # two epochs
    loader = Loader(ds, batch_size=8, shuffle=True, seed=2, num_workers=1, worker_type="thread", autotune=True)
    it = iter(loader)
    assert loader.describe()["direct_path"] and loader.autotune_probe.phase == "inline" and it.depth == 0
    got = [b["y"].tolist() for b in it] + [b["y"].tolist() for b in loader]
    assert got == want
    probe = loader.autotune_probe
    assert probe.rate_threads > 0 and probe.rate_inline > 0
    assert probe.choice == ("threads" if threads_win else "inline")
    decision = loader.describe()["autotune"]["decisions"][0]  # the decision and the rates it was made on
    assert decision["choice"] == probe.choice and decision["inline_batches_per_s"] > 0


def test_generic_dataset_probe_starts_inline(tmp_path):
    from fastload.pipeline import ThreadProbe

    ds = _dataset(tmp_path / "ds", ragged=True)  # a ragged field: no direct path
    loader = Loader(ds, batch_size=8, shuffle=True, seed=2, num_workers=1, worker_type="thread", autotune=True)
    iter(loader)
    assert isinstance(loader.autotune_probe, ThreadProbe) and loader.autotune_probe.phase == "inline"


def test_a_view_that_adds_a_column_is_not_read_through_the_wrapped_takes(tmp_path):
    """`with_indices` adds `__indices__` to every batch: the wrapped dataset's direct path (whose
    takes lack it) is not passed through, so the Loader reads the view batch by batch."""
    from fastload.fetch.direct import DirectReader
    from fastload.vision import with_indices

    ds = _dataset(tmp_path / "ds")
    view = with_indices(ds)
    assert isinstance(ds, DirectReader) and not isinstance(view, DirectReader)
    assert not hasattr(view, "direct_takes") and view.num_shards == ds.num_shards  # other attributes forwarded
    fetch = _fetcher(view)
    assert not fetch.direct_path()
    idx = np.array([7, 3, N - 1])
    got, _ = fetch(idx)
    assert got["__indices__"].tolist() == idx.tolist() and got["y"].tolist() == (idx * 7).tolist()
    batches = list(Loader(view, batch_size=64, shuffle=True, seed=1))
    assert sorted(i for b in batches for i in b["__indices__"].tolist()) == list(range(N))
    assert all(torch.equal(b["y"], b["__indices__"] * 7) for b in batches)
