"""`bench.remote --peers`: fastload's format, LitData's chunks and Streaming's MDS shards hold the same
samples, and every row of the peer table (raw pipeline, fastload, LitData and MosaicML Streaming cold,
warm and cold again, w0 and w2) runs end to end against a local moto S3 server over HTTPS, checks
each epoch's sample count and label sum, fills each field of the table (no timing is
checked) and leaves no shared memory or process behind."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import numpy as np
import psutil
import pytest

from fastload.benchmark import format_peers
from fastload.benchmark.remote_peers import loader_epochs
from fastload.formats import FastloadDataset
from fastload.formats.mds import MDSDataset

litdata = pytest.importorskip("litdata")  # the Makefile installs it (--no-deps)
if importlib.util.find_spec("streaming") is None:  # the Makefile installs it (--no-deps)
    pytest.skip("mosaicml-streaming is not installed", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from s3_fixtures import moto, s3_bucket, storage_options, upload_dir  # noqa: E402, F401

SHARDS, SHARD_SIZE = 3, 64 * 1024
#: streaming's shared memory names (`streaming.base.shared.prefix._get_path`: a 6-digit prefix, a name)
STREAMING_SHM = re.compile(r"^\d{6}_(locals|barrier|next_epoch|cache_usage|shard_states|shard_access_times|resume"
                           r"|epoch_shape|epoch_data)$")


def _streaming_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if STREAMING_SHM.match(n)} if os.path.isdir("/dev/shm") else set()


@pytest.mark.migrate
def test_fastload_litdata_and_streaming_hold_the_same_samples(tmp_path) -> None:
    from bench.remote import peer_data, per_shard, sample

    imported = "streaming" in sys.modules
    paths = peer_data(str(tmp_path), shards=SHARDS, shard_size=SHARD_SIZE)
    assert ("streaming" in sys.modules) == imported  # the MDS shards are written by a process of their own
    ours, theirs = FastloadDataset(paths["fastload"]), litdata.StreamingDataset(paths["litdata"])
    mds = MDSDataset(paths["streaming"])  # fastload's reader of streaming's format; streaming reads it below
    k = per_shard(SHARD_SIZE)
    assert len(ours) == len(theirs) == len(mds) == SHARDS * k
    assert len(mds.shards) > 1  # shards of about SHARD_SIZE
    for i in range(len(ours)):
        want, a, b, c = sample(i, k), ours[i], theirs[i], mds[i]
        assert a["x"].dtype == np.uint8 and np.asarray(b["x"]).dtype == np.uint8 and c["x"].dtype == np.uint8
        assert a["x"].tobytes() == np.asarray(b["x"]).tobytes() == c["x"].tobytes() == want["x"].tobytes(), i
        assert int(a["label"]) == int(b["label"]) == int(c["label"]) == want["label"], i
    # kept: a second call finds the written formats and does not rewrite them
    stamps = {n: os.stat(os.path.join(paths[n], "index.json")).st_mtime_ns for n in ("litdata", "streaming")}
    assert peer_data(str(tmp_path), shards=SHARDS, shard_size=SHARD_SIZE) == paths
    assert {n: os.stat(os.path.join(paths[n], "index.json")).st_mtime_ns for n in stamps} == stamps


def test_an_epoch_whose_labels_do_not_add_up_is_refused(moto, s3_bucket, tmp_path) -> None:  # noqa: F811
    from bench.remote import label_sum, make_dataset, per_shard

    make_dataset(str(tmp_path / "ds"), shards=SHARDS, shard_size=SHARD_SIZE)
    upload_dir(moto.client(), str(tmp_path / "ds"), s3_bucket, "ds")
    args = {"loader": "fastload", "url": f"s3://{s3_bucket}/ds", "storage_options": storage_options(moto.endpoint),
            "cache_dir": str(tmp_path / "cache"), "workers": 0, "batch_size": 16,
            "samples": SHARDS * per_shard(SHARD_SIZE), "nbytes": 1 << 20}
    right = label_sum(shards=SHARDS, shard_size=SHARD_SIZE)
    assert set(loader_epochs(**args, label_sum=right)) == {"cold", "warm", "cold again"}
    with pytest.raises(RuntimeError, match=f"the epoch's labels sum to {right}, the dataset's to {right + 1}"):
        loader_epochs(**args, label_sum=right + 1)


@pytest.mark.migrate
def test_peer_table_rows_run_end_to_end_on_moto(tmp_path) -> None:
    from bench.remote import run_peer_table

    shm, kids = _streaming_shm(), set(psutil.Process().children(recursive=True))  # e.g. the moto fixture's
    res = run_peer_table(str(tmp_path), shards=SHARDS, shard_size=SHARD_SIZE, rounds=1, batch_size=16, threads=2)
    assert _streaming_shm() <= shm and set(psutil.Process().children(recursive=True)) <= kids
    rows = ["raw obstore"] + [f"{loader} w{w} {temp}" for loader in ("fastload", "litdata", "streaming")
                              for w in (0, 2) for temp in ("cold", "warm", "cold again")]
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
    for peer in ("litdata", "streaming"):
        assert res["peers"][peer]["url"] == f"s3://bench/{peer}" and res["peers"][peer]["bytes"] > 0
    table = format_peers(res)
    assert res["server"].startswith("moto ") and f"server: {res['server']}" in table
    for row in rows:
        assert any(line.startswith(row + " ") for line in table.splitlines()), row
    assert "\nnot run: " not in table
    assert "\nnote: streaming: mosaicml-streaming 0.13.0's StreamingDataset (streaming.base.dataset; " in table
