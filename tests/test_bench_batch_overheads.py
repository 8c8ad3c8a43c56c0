"""`bench.batch_overheads` runs its four rows on a small dataset (a smoke test: figures come from the bench)."""

from __future__ import annotations


def test_batch_overheads_bench_runs_every_row(capsys):
    from bench.batch_overheads import main

    res = main(["--samples", "2400", "--shards", "3", "--rounds", "2", "--repeats", "1"])
    assert set(res) == {"block check, C (us/call)", "block check, numpy (us/call)", "sampler batches (ms/epoch)",
                        "sampler one index at a time (ms/epoch)"}
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in res.values())
    assert "block check, C" in capsys.readouterr().out
