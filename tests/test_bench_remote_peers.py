"""`bench.remote --peers`: fastload's format and LitData's chunks hold the same samples, and every row
of the peer table (raw pipeline, fastload and LitData cold, warm and cold again, w0 and w2) runs end to end
against a local moto S3 server over HTTPS and fills each field of the table (no timing is checked)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fastload.benchmark import format_peers
from fastload.formats import FastloadDataset

litdata = pytest.importorskip("litdata")  # the Makefile installs it (--no-deps)

SHARDS, SHARD_SIZE = 3, 64 * 1024


@pytest.mark.migrate
def test_fastload_and_litdata_hold_the_same_samples(tmp_path) -> None:
    from bench.remote import peer_data, per_shard, sample

    paths = peer_data(str(tmp_path), shards=SHARDS, shard_size=SHARD_SIZE)
    ours, theirs = FastloadDataset(paths["fastload"]), litdata.StreamingDataset(paths["litdata"])
    k = per_shard(SHARD_SIZE)
    assert len(ours) == len(theirs) == SHARDS * k
    for i in range(len(ours)):
        want, a, b = sample(i, k), ours[i], theirs[i]
        assert a["x"].dtype == np.uint8 and np.asarray(b["x"]).dtype == np.uint8
        assert a["x"].tobytes() == np.asarray(b["x"]).tobytes() == want["x"].tobytes(), i
        assert int(a["label"]) == int(b["label"]) == want["label"], i
    # kept: a second call finds the written formats and does not rewrite them
    stamp = os.stat(os.path.join(paths["litdata"], "index.json")).st_mtime_ns
    assert peer_data(str(tmp_path), shards=SHARDS, shard_size=SHARD_SIZE) == paths
    assert os.stat(os.path.join(paths["litdata"], "index.json")).st_mtime_ns == stamp


@pytest.mark.migrate
def test_peer_table_rows_run_end_to_end_on_moto(tmp_path) -> None:
    from bench.remote import run_peer_table

    res = run_peer_table(str(tmp_path), shards=SHARDS, shard_size=SHARD_SIZE, rounds=1, batch_size=16, threads=2)
    rows = ["raw obstore"] + [f"{loader} w{w} {temp}" for loader in ("fastload", "litdata") for w in (0, 2)
                              for temp in ("cold", "warm", "cold again")]
    assert sorted(res["rows"]) == sorted(rows)
    for field in ("rows", "cpu_s_per_GB", "user_cpu_s_per_GB", "server_cpu_s_per_GB", "first_batch_s"):
        want = [r for r in rows if not (field == "first_batch_s" and r.startswith("raw"))]
        assert sorted(res[field]) == sorted(want), field  # the raw pass has no batches
        assert all(len(v) == 1 for v in res[field].values()), field
    assert all(x > 0 for v in res["rows"].values() for x in v)
    assert all(0 <= u <= c for k in rows for u, c in zip(res["user_cpu_s_per_GB"][k], res["cpu_s_per_GB"][k]))
    assert all(x > 0 for k in rows[1:] for x in res["first_batch_s"][k])
    assert all(x >= 0 for v in res["server_cpu_s_per_GB"].values() for x in v)
    assert res["samples"] == SHARDS * (SHARD_SIZE // (8192 + 64)) and res["shards"] == SHARDS
    assert res["peers"]["litdata"]["url"] == "s3://bench/litdata" and res["peers"]["litdata"]["bytes"] > 0
    table = format_peers(res)
    assert res["server"].startswith("moto ") and f"server: {res['server']}" in table
    for row in rows:
        assert any(line.startswith(row + " ") for line in table.splitlines()), row
    assert "not run: mosaicml-streaming: " in table
