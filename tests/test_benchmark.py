"""`fastload bench`: end to end on the tiny default, the JSON fields, the raw limits against dd, the plot."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from fastload.benchmark import limits as lim
from fastload.benchmark.loaders import PerSample, Step, collate_samples
from fastload.benchmark.measure import payload_bytes, summarize
from fastload.cli import main

STAT = {"min", "median", "max", "values"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("bench")
    js, png = str(out / "bench.json"), str(out / "bench.png")
    rc = main(["bench", "--tiny", "--no-progress", "--step-ms", "2", "--json", js, "--plot", png,
               "--workdir", str(out)])
    assert rc == 0
    with open(js) as fh:
        return json.load(fh), png, str(out)


def test_end_to_end_json_has_documented_fields(bench_run: tuple[dict, str, str]) -> None:
    res, _, _ = bench_run
    assert res["schema_version"] == 1
    assert {"machine", "config", "dataset", "limits", "backends", "loaders", "step", "summary", "wall_s"} <= set(res)
    assert res["config"]["embedded"] and res["dataset"]["samples"] > 0
    limits = res["limits"]
    for key in ("read_cold", "read_warm", "memcpy"):
        assert set(limits[key]["bytes_per_s"]) == STAT and limits[key]["bytes_per_s"]["median"] > 0
    assert limits["jpeg_decode"]["images_per_s"] == pytest.approx(
        limits["jpeg_decode"]["images_per_s_per_core"]["median"] * limits["jpeg_decode"]["cores"])
    got = {(b["backend"], b["cache"]) for b in res["backends"]}
    assert got == {(b, c) for b in ("fastload", "lmdb", "hdf5") for c in ("cold", "warm")}
    for b in res["backends"]:
        assert b["samples_per_s"]["median"] > 0 and b["pct_of_limit"] > 0
        gather = limits[f"gather_{b['cache']}"]["samples_per_s"]["median"]  # the raw random gather, same cache
        assert gather > 0 and b["vs_gather"] == pytest.approx(b["samples_per_s"]["median"] / gather)
    kinds = {r["loader"] for r in res["loaders"]}
    assert kinds == {"fastload", "fastload-views", "torch", "torch-batched"}
    for r in res["loaders"]:
        assert {"samples_per_s", "bytes_per_s", "pct_of_limit", "vs_torch", "first_batch_ms", "p50_ms", "p99_ms",
                "cpu_percent", "peak_rss_bytes", "best", "num_workers"} <= set(r)
        assert r["samples_per_s"]["min"] <= r["samples_per_s"]["median"] <= r["samples_per_s"]["max"]
        assert len(r["samples_per_s"]["values"]) == res["config"]["repeats"]
        assert r["p50_ms"]["median"] <= r["p99_ms"]["median"] + 1e-9 and r["peak_rss_bytes"] > 0
    assert sum(r["best"] for r in res["loaders"]) == 4
    torch_rows = [r for r in res["loaders"] if r["loader"] in ("torch", "torch-batched")]
    torch_best = max(torch_rows, key=lambda r: r["samples_per_s"]["median"])
    fl = next(r for r in res["loaders"] if r["loader"] == "fastload" and r["best"])
    assert fl["vs_torch"] == pytest.approx(fl["samples_per_s"]["median"] / torch_best["samples_per_s"]["median"])
    views = next(r for r in res["loaders"] if r["loader"] == "fastload-views" and r["best"])
    assert views["stats"]["batches"] > 0
    best_fl = max((fl, views), key=lambda r: r["samples_per_s"]["median"])
    summary = res["summary"]
    assert summary["fastload_row"] == {"loader": best_fl["loader"], "num_workers": best_fl["num_workers"]}
    assert summary["torch_row"] == {"loader": torch_best["loader"], "num_workers": torch_best["num_workers"]}
    assert summary["fastload_vs_torch"] == pytest.approx(best_fl["vs_torch"])
    assert fl["stats"]["batches"] > 0  # loader.stats() is carried through
    step = res["step"]
    assert step["step_ms"] == 2 and step["kind"] == "sleep"
    for r in step["rows"]:
        assert 0.0 <= r["data_stall"]["median"] <= 1.0
        assert r["input_bound"] == (r["data_stall"]["median"] > step["threshold"])
        assert r["step_wall_ms"]["median"] >= 2.0
    assert {(r["loader"], r["num_workers"]) for r in step["rows"]} == {
        (r["loader"], r["num_workers"]) for r in res["loaders"]}
    for kind in kinds:
        mine = [r for r in step["rows"] if r["loader"] == kind]
        best = [r for r in mine if r["best"]]
        assert len(best) == 1 and best[0]["data_stall"]["median"] == min(r["data_stall"]["median"] for r in mine)
    assert res["summary"]["lines"] and "fastload_vs_torch" in res["summary"]


def test_plot_is_a_png_and_temp_data_is_removed(bench_run: tuple[dict, str, str]) -> None:
    _, png, workdir = bench_run
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [e for e in os.listdir(workdir) if e.startswith("fastload-bench-")]


def test_table_printed(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    rc = main(["bench", "--tiny", "--no-progress", "--backends", "fastload", "--loaders", "fastload,torch",
               "--workers", "0", "--repeats", "1", "--workdir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    for head in ("RAW LIMITS", "BACKENDS", "LOADERS", "SUMMARY", "vs torch", "% raw"):
        assert head in out
    assert "lmdb" not in out.split("BACKENDS")[1].split("LOADERS")[0]


def test_bench_on_a_named_dataset_and_a_url(tmp_path) -> None:
    import fsspec

    from fastload.benchmark import BenchConfig, run_benchmark
    from fastload.benchmark.synthetic import build

    syn = build(str(tmp_path / "data"), size=1 << 20, backends=())
    fs = fsspec.filesystem("memory")
    fs.put(syn.fastload, "/benchtest", recursive=True)
    common = {"loaders": ("fastload",), "workers": (0,), "seconds": 0.1, "repeats": 1, "batch_size": 16,
              "progress": False, "workdir": str(tmp_path)}
    res = run_benchmark(BenchConfig(dataset=syn.fastload, **common))
    assert res["dataset"]["kind"] == "fastload" and [b["backend"] for b in res["backends"]] == ["fastload"] * 2
    res = run_benchmark(BenchConfig(dataset="memory://benchtest", **common))
    assert res["dataset"]["kind"] == "remote" and res["dataset"]["samples"] == syn.num_samples
    assert [(b["backend"], b["cache"]) for b in res["backends"]] == [("remote", "cold"), ("remote", "warm")]
    assert res["limits"]["download"]["bytes_per_s"]["median"] > 0
    fs.rm("/benchtest", recursive=True)


def test_sequential_read_counts_every_byte_of_every_file(tmp_path) -> None:
    """Exact byte count over files shorter than, equal to and longer than the read chunk, and an empty one."""
    sizes = [0, 1, 4096, 4097, 3 * 4096 + 5]
    paths = []
    for i, size in enumerate(sizes):
        paths.append(str(tmp_path / f"f{i}"))
        with open(paths[-1], "wb") as fh:
            fh.write(os.urandom(size))
    total, seconds = lim.sequential_read(paths, chunk=4096)
    assert total == sum(sizes) and seconds > 0
    assert lim.sequential_read([], chunk=4096)[0] == 0


def test_evict_drops_pages(tmp_path) -> None:
    path = str(tmp_path / "blob")
    with open(path, "wb") as fh:
        fh.write(b"x" * (8 << 20))
        fh.flush()
        os.fsync(fh.fileno())
    lim.sequential_read([path])
    before = lim.resident_fraction([path])
    if before is None:
        pytest.skip("mincore unavailable")
    assert before > 0.9
    assert lim.evict([path])
    assert lim.resident_fraction([path]) < 0.1


def test_recycle_page_cache_writes_the_bytes_and_leaves_nothing(tmp_path) -> None:
    (tmp_path / "keep").write_bytes(b"k")
    assert lim.recycle_page_cache(str(tmp_path), (3 << 20) + 5, chunk=1 << 20) == (3 << 20) + 5
    assert sorted(os.listdir(tmp_path)) == ["keep"]


def test_collate_payload_and_helpers() -> None:
    samples = [{"x": np.full((2, 3), i, np.uint8), "t": np.arange(i + 1, dtype=np.int32), "b": b"ab" * i, "y": i}
               for i in range(4)]
    batch = collate_samples(samples)
    assert batch["x"].shape == (4, 2, 3) and batch["y"].tolist() == [0, 1, 2, 3]
    values, offsets = batch["t"]
    assert offsets.tolist() == [0, 1, 3, 6, 10] and values.dtype == torch.int32
    assert batch["b"] == [b"ab" * i for i in range(4)]
    assert payload_bytes(batch) == 24 + 40 + 40 + 12 + 32
    assert summarize([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "values": [3.0, 1.0, 2.0]}
    ds = PerSample(samples)
    assert len(ds) == 4 and not hasattr(ds, "__getitems__") and ds[2]["y"] == 2
    for kind in ("sleep", "matmul"):
        Step(1.0, kind=kind)()
    with pytest.raises(ValueError):
        Step(1.0, kind="nap")


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workers", "a,b"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["bench", "--loaders", "fastload,dali"])
    assert main(["bench", "--tiny", "--repeats", "0", "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err


def test_train_step_example_runs_both_loaders() -> None:
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "bench.train_step", "--steps", "3", "--warmup", "1", "--size", "1MiB",
         "--workers", "0", "--batch-size", "16", "--device", "cpu"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith(("torch", "fastload"))}
    assert set(rows) == {"torch", "fastload"}
    assert rows["fastload"][-1] in ("read", "transform", "collate", "pin", "h2d")
    assert 0.0 <= float(rows["torch"][4].rstrip("%")) <= 100.0


def test_random_gather_reads_each_range_once(tmp_path) -> None:
    data = np.random.default_rng(0).integers(0, 255, 5000, dtype=np.uint8)
    path = tmp_path / "raw.bin"
    path.write_bytes(data.tobytes())
    starts, lengths = np.array([0, 100, 4000, 4990]), np.array([10, 0, 1000, 10])
    samples, nbytes, secs = lim.random_gather(str(path), starts, lengths, batch_size=3, seconds=60)
    assert samples == 4 and nbytes == 1020 and secs > 0


def test_backend_rows_time_the_open_with_the_reads() -> None:
    import time

    from fastload.benchmark.backends import Backend, measure_backend

    class Tiny:
        def __len__(self) -> int:
            return 10

        def get_batch(self, idx: np.ndarray) -> np.ndarray:
            return np.zeros(len(idx), dtype=np.uint8)

    def slow_open() -> Tiny:
        time.sleep(0.05)  # e.g. LMDB listing its keys
        return Tiny()

    read, resident = measure_backend(Backend("tiny", "", slow_open), cold=False, batch_size=4, seconds=5, seed=0)
    assert resident is None and read.samples == 10 and read.batches == 3
    assert read.seconds >= 0.05


def test_remote_cpu_counts_the_samples_in_each_window_by_thread():
    """`bench.remote_cpu` counts perf's samples by the window they fall in and the thread they came from
    (thread names may hold spaces; samples outside every window are left out)."""
    from bench.remote_cpu import count_samples

    text = "\n".join([
        "          python 100.000100:",
        " fastload-prefet 100.500000:",
        "          python 101.200000:",
        "  tokio-rt-worker 102.000000:",
        "    thread name 102.100000:",
        "          python 103.000000:",
        "garbage line",
    ])
    got = count_samples(text, {"cold": [100.0, 101.0], "warm": [102.0, 102.5]})
    assert got == {"cold": {"python": 1, "fastload-prefet": 1}, "warm": {"tokio-rt-worker": 1, "thread name": 1}}


def test_remote_cpu_fills_a_cache_whose_files_the_cache_takes_in_as_entries(tmp_path):
    """`bench.remote_cpu --cache-entries N`: the N files put in the cache directory are entries of
    the cache that opens there (and count in its budget), as files cached by earlier runs are."""
    from bench.remote_cpu import fill_cache
    from fastload.remote.cache.shard_cache import ShardCache

    fill_cache(str(tmp_path), 300, size=1000)
    cache = ShardCache(tmp_path, limit="10MB")
    usage = cache.usage()
    assert usage["files"] == 300 and usage["bytes"] == 300 * 1000
    assert usage["occupied"] == 300 * cache.footprint(1000) + cache.state_bytes()


def test_remote_cpu_rows_name_their_transport_and_the_files_cached_beforehand():
    from bench.remote_cpu import _row_setup

    assert _row_setup("w2 shuffled") == ("w2 shuffled", "auto", 0)
    assert _row_setup("stream w0 sequential") == ("w0 sequential", "obstore-stream", 0)
    assert _row_setup("stream w0 sequential +2000 cached") == ("w0 sequential", "obstore-stream", 2000)
    assert _row_setup("w0 shuffled +10 cached") == ("w0 shuffled", "auto", 10)


def test_remote_cpu_against_a_tree_names_what_it_lacks(tmp_path):
    """`bench.remote_cpu --against TREE` refuses a tree a child could not run fastload from as it was
    built (a missing C extension would have the blocks hashed in Python), naming each missing piece."""
    from bench.remote_cpu import check_tree

    (tmp_path / "fastload").mkdir()
    (tmp_path / "fastload" / "__init__.py").write_text("")
    (tmp_path / "formats").mkdir()
    with pytest.raises(SystemExit, match=r"missing fastload/formats .*, formats/_ranges\*\.so"):
        check_tree(str(tmp_path))
    (tmp_path / "fastload" / "formats").symlink_to("../formats")
    (tmp_path / "formats" / "_ranges.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert check_tree(str(tmp_path)) == str(tmp_path)
    with pytest.raises(SystemExit, match="missing fastload/__init__.py"):
        check_tree(str(tmp_path / "formats"))


def test_remote_cpu_pairs_each_round_of_a_row_with_its_base():
    """A row and its base's run in the same round are compared with each other, round by round."""
    from bench.remote_cpu import _ratios

    assert _ratios([0.2, 0.1, 0.3], [0.1, 0.1, 0.6]) == "1.000 [0.500-2.000]"
    assert _ratios([0.2], [0.0]) == "-"
