"""The `_ranges` extension's gathers (ranges read ahead, rows from several sources, rows by dataset index
from their shards) and offsets check, and what a dataset's first batch after an open relies on: guards
that know what this process verified, and mappings that go when the dataset is closed."""

from __future__ import annotations

import gc
import shutil
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.formats import FastloadDataset, Field, Schema, write
from fastload.formats.ragged import gather_ranges

_ranges = pytest.importorskip("fastload.formats._ranges", reason="the C extension is built by `make install`")

DTYPES = [np.uint8, np.int32, np.float64]


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    size=st.integers(0, 300),
    count=st.integers(0, 9),  # around the read-ahead distance: fewer ranges than it, as many, more
)
def test_gather_copies_every_range_in_order(data, dtype, size, count):
    source = np.arange(size, dtype=dtype)
    starts = data.draw(st.lists(st.integers(0, size), min_size=count, max_size=count))
    lengths = [data.draw(st.integers(0, size - s)) for s in starts]
    values, offsets = gather_ranges(source, np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64))
    want = [source[s : s + n] for s, n in zip(starts, lengths)]
    assert values.dtype == source.dtype
    assert values.tobytes() == b"".join(w.tobytes() for w in want)
    assert offsets.tolist() == np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()


def _offsets_sound(offsets: np.ndarray, lengths: np.ndarray | None, total: int) -> bool:
    """The checks `ShardReader` makes of an offsets table, in numpy."""
    unsigned = offsets.view(np.uint64)
    if unsigned[0] != 0 or unsigned[-1] != total or np.any(unsigned[1:] < unsigned[:-1]):
        return False
    if lengths is None:
        return True
    diff = np.diff(offsets)
    return lengths.shape == diff.shape and bool(np.array_equal(diff, lengths))


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 50), max_size=12),
    edits=st.lists(st.tuples(st.integers(0, 12), st.integers(-(2**63), 2**63 - 1)), max_size=2),
    meta_edit=st.none() | st.tuples(st.integers(0, 11), st.integers(-5, 60)),
    total_shift=st.sampled_from([0, 0, 0, 1, -1]),
    with_lengths=st.booleans(),
)
def test_offsets_match_agrees_with_the_numpy_checks(lengths, edits, meta_edit, total_shift, with_lengths):
    """Sound tables, tables with entries overwritten (huge, negative as int64), meta lengths that
    disagree (negative ones too), a wrong total: the one-pass check says what the numpy checks say."""
    meta = np.array(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(meta)]).astype(np.int64)
    for pos, value in edits:
        if pos < len(offsets):
            offsets[pos] = value
    if meta_edit is not None and meta_edit[0] < len(meta):
        meta[meta_edit[0]] = meta_edit[1]
    total = int(sum(lengths)) + total_shift
    if total < 0:
        return
    expected = meta if with_lengths else None
    assert _ranges.offsets_match(offsets, expected, total) == _offsets_sound(offsets, expected, total)


def test_offsets_match_refuses_a_table_of_another_size():
    offsets = np.array([0, 1, 3], dtype=np.int64)
    assert _ranges.offsets_match(offsets, np.array([1, 2], dtype=np.int64), 3)
    assert not _ranges.offsets_match(offsets, np.array([1, 2, 0], dtype=np.int64), 3)
    assert not _ranges.offsets_match(offsets, np.array([1], dtype=np.int64), 3)


SCHEMA = Schema(
    (
        Field("record", "ndarray", np.dtype(np.uint8), (2, 40, 40)),
        Field("label", "scalar", np.dtype(np.int64)),
        Field("jpeg", "bytes"),
        Field("tokens", "varray", np.dtype(np.int32)),
    )
)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("first") / "ds"
    rng = np.random.default_rng(3)
    samples = [
        {
            "record": rng.integers(0, 256, (2, 40, 40), dtype=np.uint8),
            "label": i,
            "jpeg": rng.bytes(int(rng.integers(0, 5000))),
            "tokens": rng.integers(0, 2**31, int(rng.integers(0, 300)), dtype=np.int32),
        }
        for i in range(400)
    ]
    write(samples, str(path), schema=SCHEMA, shard_size=256 << 10, progress=False, workers=1)
    return path, samples


def _check_batch(ds: FastloadDataset, samples: list[dict], idx: np.ndarray) -> None:
    batch = ds.get_batch(idx)
    for pos, i in enumerate(idx.tolist()):
        want = samples[i]
        assert batch["record"][pos].tobytes() == want["record"].tobytes()
        assert int(batch["label"][pos]) == want["label"]
        assert batch["jpeg"][pos] == want["jpeg"]
        assert batch["tokens"][pos].tobytes() == want["tokens"].tobytes()


def test_a_reopened_dataset_reads_what_this_process_verified_without_checks(mixed, tmp_path):
    """After one full read, a fresh open's spliced columns have nothing left to verify (their checks
    are unset from the start) and read the same bytes; a copy of the files (other inodes) is
    verified anew."""
    path, samples = mixed
    ds = FastloadDataset(path)
    assert ds.num_shards >= 3
    for start in range(0, len(samples), 64):
        ds.get_batch(np.arange(start, min(len(samples), start + 64)))
    ds.close()
    again = FastloadDataset(path)
    idx = np.random.default_rng(0).permutation(len(samples))[:100]
    _check_batch(again, samples, idx)
    assert again.spliced_columns()["record"].check is None
    again.close()
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    fresh = FastloadDataset(copy)
    fresh.get_batch([0])
    assert fresh.spliced_columns()["record"].check is not None  # blocks of the copy not verified yet
    _check_batch(fresh, samples, idx)
    fresh.close()


def test_close_unmaps_the_spliced_columns_without_a_garbage_collection(mixed, tmp_path):
    """A spliced column's check must not hold the column in a reference cycle: its mapping goes
    when the dataset is closed, not at a later collection in the middle of another read."""
    path, _ = mixed
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # files this process has not verified: the checks are set
    was = gc.isenabled()
    gc.disable()
    try:
        ds = FastloadDataset(copy)
        ds.get_batch(np.arange(3))
        spliced = ds.spliced_columns()
        assert spliced and all(column.check is not None for column in spliced.values())
        columns = [weakref.ref(column) for column in spliced.values()]
        del spliced
        ds.close()
        assert all(ref() is None for ref in columns)
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("verify", ["auto", "none"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_first_batch_after_an_open_is_exact(mixed, verify, seed):
    path, samples = mixed
    ds = FastloadDataset(path, verify=verify)
    idx = np.random.default_rng(seed).integers(-len(samples), len(samples), 64)
    batch = ds.get_batch(idx)
    for pos, i in enumerate(idx.tolist()):
        assert batch["jpeg"][pos] == samples[i]["jpeg"]
        assert batch["record"][pos].tobytes() == samples[i]["record"].tobytes()
    ds.close()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), shape=st.sampled_from([(), (3,), (2, 5)]),
       picks=st.lists(st.integers(0, 10**6), max_size=30), c_ext=st.booleans())
def test_take_rows_into_puts_each_row_in_its_place(n, shape, picks, c_ext):
    """`take_rows_into` (the C extension's one call, or numpy without it) writes src[rows[i]] at out[places[i]]
    and nothing else; a row or place out of range raises IndexError before anything is copied."""
    from fastload.formats import reader
    from fastload.formats import rows as rows_module

    src = np.arange(n * int(np.prod(shape, dtype=int)), dtype=np.float32).reshape(n, *shape)
    rows = np.array([p % n for p in picks], dtype=np.int64)
    places = np.random.default_rng(len(picks)).permutation(len(rows)).astype(np.int64)
    out = np.full((len(rows), *shape), -1, dtype=np.float32)
    with pytest.MonkeyPatch.context() as mp:
        if not c_ext:
            mp.setattr(rows_module, "_c_take_rows", None)
        reader.take_rows_into(src, rows, out, places)
        assert np.array_equal(out[places], src[rows])
        before = out.copy()
        with pytest.raises(IndexError):
            reader.take_rows_into(src, np.array([n], dtype=np.int64), out, np.array([0], dtype=np.int64))
        with pytest.raises(IndexError):
            reader.take_rows_into(src, np.array([0], dtype=np.int64), out, np.array([len(out)], dtype=np.int64))
        with pytest.raises(ValueError, match="cannot go into"):
            reader.take_rows_into(src, rows, out.astype(np.float64), places)
        assert np.array_equal(out, before)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=5), shape=st.sampled_from([(), (3,), (2, 5)]),
       picks=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=40), one=st.booleans())
def test_take_rows_copies_each_row_from_its_source_in_order(sizes, shape, picks, one):
    """`take_rows` writes sources[which[i]][rows[i]] at dst[i] (which None: every row from sources[0]); a
    source that is None, a source number or row out of range, or a dst of another size raises before
    anything is copied."""
    per = int(np.prod(shape, dtype=int))
    sources = [np.arange(n * per, dtype=np.float32).reshape(n, *shape) + 1000 * s for s, n in enumerate(sizes)]
    usable = [s for s, n in enumerate(sizes) if n and (not one or s == 0)]
    if not usable:
        return
    which = np.array([usable[a % len(usable)] for a, _ in picks], dtype=np.int64)
    rows = np.array([b % sizes[s] for s, (_, b) in zip(which.tolist(), picks)], dtype=np.int64)
    if one:
        which_arg = None
    else:
        which_arg = which
        sources = [src if s in set(which.tolist()) else None for s, src in enumerate(sources)]  # unused: None
    dst = np.full((len(rows), *shape), -1, dtype=np.float32)
    _ranges.take_rows(sources, which_arg, rows, 4 * per, dst)
    want = [sources[s][r] for s, r in zip(which.tolist(), rows.tolist())]
    assert np.array_equal(dst, np.array(want, dtype=np.float32).reshape(dst.shape))
    before = dst.copy()
    if len(rows):
        bad_row = rows.copy()
        bad_row[-1] = sizes[int(which[-1])]
        with pytest.raises(IndexError, match="no such row"):
            _ranges.take_rows(sources, which_arg, bad_row, 4 * per, dst)
        if not one:
            bad_source = which.copy()
            bad_source[0] = len(sources)
            with pytest.raises(IndexError, match="no such row"):
                _ranges.take_rows(sources, bad_source, rows, 4 * per, dst)
            for s in [s for s, src in enumerate(sources) if src is None][:1]:  # a row from a source left out
                bad_source[0] = s
                with pytest.raises(IndexError, match="no such row"):
                    _ranges.take_rows(sources, bad_source, rows, 4 * per, dst)
        with pytest.raises(ValueError, match="not"):
            _ranges.take_rows(sources, which_arg, rows, 4 * per, dst[:-1])
    assert np.array_equal(dst, before)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=6), shape=st.sampled_from([(), (3,), (2, 5)]),
       absent=st.lists(st.booleans(), min_size=6, max_size=6), short=st.lists(st.booleans(), min_size=6, max_size=6),
       picks=st.lists(st.integers(-3, 130), max_size=40), checked=st.booleans(), shift=st.integers(2, 6),
       data=st.data())
def test_take_sharded_copies_each_index_from_its_shard_or_says_which_it_cannot(sizes, shape, absent, short, picks,
                                                                               checked, shift, data):
    """`take_sharded` writes the row of dataset index i (shard k holds [starts[k], starts[k + 1])) at dst[i],
    and returns -1, having set in `record` the blocks of the rows it read from a `ready` array; given an index
    out of range, in a shard whose source is None, past its source's rows, or (with `ready`) over a block of
    its file not marked ready, it returns that index's position and copies and records nothing."""
    per = int(np.prod(shape, dtype=int))
    row_bytes = 4 * per
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    sources = [None if absent[k] else np.arange(max(n - short[k], 0) * per, dtype=np.float32).reshape(-1, *shape)
               + 1000 * k for k, n in enumerate(sizes)]
    offsets = np.array([data.draw(st.integers(0, 300)) for _ in sizes], dtype=np.int64)
    ready: list | None = None
    if checked:  # per shard: None (every block ready) or one flag per block of its file
        ready = []
        for k, n in enumerate(sizes):
            blocks = ((int(offsets[k]) + n * row_bytes) >> shift) + 1
            ready.append(None if data.draw(st.booleans()) else
                         np.array(data.draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks)), dtype=bool))
    indices = np.array(picks, dtype=np.int64)
    dst = np.full((len(indices), *shape), -1, dtype=np.float32)
    record = None if ready is None else [None if r is None else np.zeros(len(r), dtype=bool) for r in ready]
    extra = () if ready is None else (ready, offsets, shift, record)
    got = _ranges.take_sharded(sources, starts, indices, row_bytes, dst, *extra)

    def shard(i: int) -> int:
        return int(np.searchsorted(starts, i, side="right")) - 1

    def readable(i: int) -> bool:
        if not 0 <= i < starts[-1]:
            return False
        k = shard(i)
        if sources[k] is None or i - starts[k] >= len(sources[k]):
            return False
        if ready is None or ready[k] is None:
            return True
        lo = int(offsets[k]) + (i - int(starts[k])) * row_bytes
        return bool(ready[k][lo >> shift : ((lo + row_bytes - 1) >> shift) + 1].all())

    bad = [p for p, i in enumerate(picks) if not readable(i)]
    marked = [None if r is None else np.zeros(len(r), dtype=bool) for r in record or ()]
    if bad:
        assert got == bad[0]
        assert (dst == -1).all()
    else:
        assert got == -1
        want = [sources[shard(i)][i - starts[shard(i)]] for i in picks]
        assert np.array_equal(dst, np.array(want, dtype=np.float32).reshape(dst.shape))
        for i in picks if record is not None else ():
            k = shard(i)
            if marked[k] is not None:
                lo = int(offsets[k]) + (i - int(starts[k])) * row_bytes
                marked[k][lo >> shift : ((lo + row_bytes - 1) >> shift) + 1] = True
    for have, want_marked in zip(record or (), marked):
        assert (have is None) == (want_marked is None)
        assert have is None or np.array_equal(have, want_marked)
    with pytest.raises(ValueError, match="not exactly"):
        _ranges.take_sharded(sources, starts, indices, row_bytes, np.zeros(len(indices) * per + 1, np.float32))
    with pytest.raises(ValueError, match="one more than"):
        _ranges.take_sharded(sources, starts[:-1], indices, row_bytes, dst)
    with pytest.raises(ValueError, match="differ in length"):
        _ranges.take_sharded(sources, starts, indices, row_bytes, dst, [None] * (len(sizes) + 1), offsets, shift)
    with pytest.raises(TypeError, match="ready must be a sequence"):
        _ranges.take_sharded(sources, starts, indices, row_bytes, dst, 5, offsets, shift)
    as_list, as_tuple = dst.copy(), dst.copy()  # a tuple of sources is read as the list is
    assert (_ranges.take_sharded(sources, starts, indices, row_bytes, as_list)
            == _ranges.take_sharded(tuple(sources), starts, indices, row_bytes, as_tuple))
    assert np.array_equal(as_list, as_tuple)
    if len(sizes) > 1 and starts[1] > 0:
        with pytest.raises(ValueError, match="decrease"):
            _ranges.take_sharded(sources, starts[::-1].copy(), indices, row_bytes, dst)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 30), shape=st.sampled_from([(), (3,), (70,), (2, 40)]), dtype=st.sampled_from(DTYPES),
       picks=st.lists(st.integers(0, 10**6), max_size=40), c_ext=st.booleans(), strided=st.booleans(),
       into=st.booleans())
def test_gather_rows_is_take_and_refuses_rows_out_of_range(n, shape, dtype, picks, c_ext, strided, into):
    """`gather_rows` gives `src.take(rows, axis=0)` whichever way it copies (the C extension for rows of
    `C_MIN_ROW_BYTES` or more, else numpy; a strided source through numpy), into `out` when given; a row
    out of range (negative ones too: no wrapping) raises IndexError and leaves `out` as it was."""
    from fastload.formats import rows as rows_module

    per = int(np.prod(shape, dtype=int))
    base = np.arange(2 * n * per, dtype=dtype).reshape(2 * n, *shape)
    src = base[::2] if strided else base[:n]
    rows = np.array([p % n for p in picks] if n else [], dtype=np.int64)
    with pytest.MonkeyPatch.context() as mp:
        if not c_ext:
            mp.setattr(rows_module, "_c_take_rows", None)
        out = np.full((len(rows), *shape), 7, dtype=dtype) if into else None
        got = rows_module.gather_rows(src, rows, out)
        assert got.dtype == src.dtype and got.flags.c_contiguous and np.array_equal(got, src.take(rows, axis=0))
        assert out is None or got is out
        keep = got.copy()
        for bad in ([n], [-1], [0, n + 5]):
            if n == 0 and bad == [0, n + 5]:
                continue
            into_got = got[: len(bad)] if len(got) >= len(bad) else None
            with pytest.raises(IndexError):
                rows_module.gather_rows(src, np.array(bad, dtype=np.int64), into_got)
        assert np.array_equal(got, keep)
