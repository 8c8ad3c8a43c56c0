"""LMDB batches out of learnt value spans: byte-for-byte equal to `txn.get`, on the fast path once
learnt, and right after another process commits between batches (the spans are dropped)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from open_files import LISTS_OPEN_FILES, open_under

from fastload.formats import FormatError, LMDBDataset, lmdb_spans

N = 80


def _records(seed: int) -> dict[bytes, bytes]:
    """Values from empty to several pages: inline in leaf pages and on overflow pages."""
    rng = np.random.default_rng(seed)
    return {f"k{i:04d}".encode(): rng.bytes(int(rng.choice([0, 7, 900, 3000, 9000]))) for i in range(N)}


@pytest.fixture
def db_path(tmp_path):
    path = str(tmp_path / "db")
    env = lmdb.open(path, map_size=64 << 20)
    with env.begin(write=True) as txn:
        for k, v in _records(0).items():
            txn.put(k, v)
    env.close()
    return path


def _expected(db: LMDBDataset, idx) -> list[bytes]:
    """What `txn.get` returns now for the records `idx` (`db[i]` is one `txn.get`, never the spans)."""
    return [db[int(i)]["value"] for i in idx]


def test_batches_match_txn_get_and_take_the_fast_path_once_learnt(db_path):
    db = LMDBDataset(db_path)
    idx = [5, -1, 0, 79, 5, 17, -80]
    first = db.get_batch(idx)  # learns the spans through txn.get
    assert first["value"].to_list() == _expected(db, idx)
    assert db.learnt_values == len({i % N for i in idx})  # every value of the batch now known
    again = db.get_batch(idx)
    assert again["value"].to_list() == _expected(db, idx)
    assert again["key"].to_list() == [db.keys()[i] for i in idx]
    everything = np.arange(N)
    db.get_batch(everything)
    assert db.get_batch(everything[::-1])["value"].to_list() == _expected(db, everything[::-1])


@pytest.mark.parametrize("how", ["no extension", "no mapping"])
def test_without_the_extension_or_a_located_mapping_batches_stay_exact(db_path, monkeypatch, how):
    if how == "no extension":
        monkeypatch.setattr(lmdb_spans, "_c_spans", None)
    else:
        monkeypatch.setattr(lmdb_spans, "mapping_base", lambda address, path: None)
    db = LMDBDataset(db_path)
    idx = [3, 3, -2, 40]
    for _ in range(2):
        assert db.get_batch(idx)["value"].to_list() == _expected(db, idx)
    assert db.learnt_values == (len({i % N for i in idx}) if how == "no extension" else 0)


def _write_in_another_process(path: str, script: str) -> None:
    code = f"import lmdb, numpy as np\nenv = lmdb.open({path!r}, map_size=64 << 20)\n" + textwrap.dedent(script)
    code += "env.close()\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_commit_by_another_process_between_batches_is_seen(db_path):
    db = LMDBDataset(db_path)
    everything = np.arange(N)
    db.get_batch(everything)
    db.get_batch(everything)  # fast path: all spans known
    for round_ in range(4):  # several commits, so that freed pages are reused for new values
        _write_in_another_process(db_path, f"""
            rng = np.random.default_rng({round_})
            with env.begin(write=True) as txn:
                for i in range(0, {N}, 3):
                    txn.put(b"k%04d" % i, rng.bytes(int(rng.choice([5, 2000, 7000]))))
            """)
        for _ in range(2):  # the first batch re-learns, the second reads the new spans
            assert db.get_batch(everything)["value"].to_list() == _expected(db, everything)
    _write_in_another_process(db_path, """
        with env.begin(write=True) as txn:
            txn.delete(b"k0007")
        """)
    with pytest.raises(FormatError, match=r"k0007.*sample 7\) disappeared"):
        db.get_batch([6, 7])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.integers(-N, N - 1), max_size=40), min_size=1, max_size=6))
def test_fuzz_any_batches_equal_txn_get(db_path, batches):
    db = LMDBDataset(db_path)
    for idx in batches + batches:  # each batch twice: once learning (maybe), once from the spans
        batch = db.get_batch(idx)
        assert batch["value"].to_list() == _expected(db, idx)
        assert batch["key"].to_list() == [db.keys()[i] for i in idx]


@pytest.mark.skipif(not LISTS_OPEN_FILES, reason="lists open files through /proc")
def test_the_environment_closes_when_its_last_reader_goes(db_path):
    """Readers of one path share its environment; closing or dropping one leaves the others reading,
    and the files close once no reader holds them (a process that reads many LMDB paths does not keep
    them all open); a closed reader reads again, byte for byte."""
    import gc

    idx = [3, 0, 79, 41, 3]
    one, two = LMDBDataset(db_path), LMDBDataset(db_path)
    want = [_records(0)[f"k{i:04d}".encode()] for i in idx]
    for _ in range(2):  # learns the spans, then reads through them
        assert one.get_batch(idx)["value"].to_list() == want
    one.close()
    assert two.get_batch(idx)["value"].to_list() == want  # the shared environment stayed open for it
    del two
    gc.collect()
    assert not open_under(db_path)  # nothing holds the path now
    for _ in range(2):  # the closed reader opens it again
        assert one.get_batch(idx)["value"].to_list() == want
    assert open_under(db_path)
    one.close()
    gc.collect()
    assert not open_under(db_path)
