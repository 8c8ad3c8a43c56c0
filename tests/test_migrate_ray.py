"""`fastload convert --engine ray` from Lance, LitData and ArrayRecord sources (each written by its own
library): the same bytes as the local converter, the same skip reports, and `--decode` in Ray tasks."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray_fixtures import local_ray  # noqa: E402
from test_arrow_in_place import _table  # noqa: E402
from test_migrate_chunks import _numbers, _optimize, _record, _write_records  # noqa: E402
from test_ray import _convert, _same_files  # noqa: E402

from fastload.formats import FastloadDataset  # noqa: E402
from fastload.formats.verify import verify_dataset  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.migrate, pytest.mark.timeout(240)]


PLUGIN = textwrap.dedent("""
    import json
    import numpy as np

    def decode(data):
        obj = json.loads(data)
        if obj["id"] % 10 == 7:
            raise ValueError("no sevens")
        return {"id": obj["id"], "caption": obj["caption"], "vec": np.asarray(obj["vec"], np.int64)}
""")


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """A folder holding the `ray_records:decode` plug-in module."""
    d = tmp_path_factory.mktemp("plug")
    (d / "ray_records.py").write_text(PLUGIN)
    return d


@pytest.fixture(scope="module")
def ray_session(plugin_dir):
    """One 2-CPU local Ray cluster for the module (`ray_fixtures.local_ray`); its workers import
    the `--decode` plug-in through PYTHONPATH, as a user's cluster would have it installed."""
    path = os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")]))
    with local_ray({"PYTHONPATH": path}) as address:
        yield address


def _local_and_ray(capsys, tmp_path, src, *flags):
    """Convert `src` locally and on Ray with `flags`; both succeed and write the same bytes."""
    code, _, err = _convert(capsys, src, tmp_path / "local", *flags)
    assert code == 0, err
    code, out, err = _convert(capsys, src, tmp_path / "ray", *flags, ray_address=_convert.address)
    assert code == 0, err
    assert "written by tasks on 1 node" in out
    extra = ["skipped-inputs.jsonl"] if os.path.exists(tmp_path / "local" / "skipped-inputs.jsonl") else []
    assert os.path.exists(tmp_path / "ray" / "skipped-inputs.jsonl") == bool(extra)
    shards = _same_files(tmp_path / "local", tmp_path / "ray", *extra)
    assert verify_dataset(tmp_path / "ray") == []
    return shards


@pytest.fixture(autouse=True)
def _address(ray_session):
    _convert.address = ray_session
    yield


def test_lance_on_ray_same_bytes_as_local(tmp_path, capsys):
    lance = pytest.importorskip("lance")
    lance.write_dataset(_table(), str(tmp_path / "data.lance"), max_rows_per_file=70)
    assert _local_and_ray(capsys, tmp_path, tmp_path / "data.lance", "--shard-size", "8KiB") >= 3
    assert FastloadDataset(tmp_path / "ray").get_batch(np.arange(300))["id"].tolist() == list(range(300))
    code, _, err = _convert(capsys, tmp_path / "data.lance", tmp_path / "skip", "--on-error=skip",
                            ray_address=_convert.address)
    assert code == 2 and "cannot apply to the Lance dataset" in err and "not a row" in err


def test_litdata_on_ray_same_bytes_and_skip_report_as_local(tmp_path, capsys):
    from test_migrate_chunks import _lit_sample

    _optimize(tmp_path / "lit", 40, _lit_sample, chunk_bytes=2000)
    assert _local_and_ray(capsys, tmp_path, tmp_path / "lit", "--shard-size", "4KiB") >= 3
    # a chunk file gone: its items are left out and listed, the same on Ray as locally
    src = tmp_path / "bad"
    _optimize(src, 30, _numbers, chunk_bytes=256)
    index = json.loads((src / "index.json").read_text())
    os.remove(src / index["chunks"][1]["filename"])
    for d in ("local", "ray"):
        os.rename(tmp_path / d, tmp_path / f"good-{d}")
    _local_and_ray(capsys, tmp_path, src, "--on-error=skip", "--shard-size", "4KiB")
    report = (tmp_path / "ray" / "skipped-inputs.jsonl").read_text().splitlines()
    assert len(report) == index["chunks"][1]["chunk_size"]


def test_array_record_with_decode_plugin_on_ray_same_bytes_and_skips_as_local(tmp_path, capsys, monkeypatch,
                                                                              plugin_dir):
    pytest.importorskip("array_record.python.array_record_module")
    src = tmp_path / "rec"
    src.mkdir()
    _write_records(src / "a.array_record", [_record(i) for i in range(25)])
    _write_records(src / "b.array_record", [_record(i) for i in range(25, 60)])
    assert _local_and_ray(capsys, tmp_path, src, "--shard-size", "4KiB") >= 2  # records as bytes
    monkeypatch.syspath_prepend(str(plugin_dir))  # the local converter imports it in this process
    for d in ("local", "ray"):
        os.rename(tmp_path / d, tmp_path / f"bytes-{d}")
    _local_and_ray(capsys, tmp_path, src, "--decode", "ray_records:decode", "--on-error=skip", "--shard-size", "4KiB")
    report = [json.loads(ln) for ln in (tmp_path / "ray" / "skipped-inputs.jsonl").read_text().splitlines()]
    assert len(report) == 6 and all("no sevens" in r["reason"] for r in report)
    ds = FastloadDataset(tmp_path / "ray")
    assert ds.attrs["decode"] == "ray_records:decode"
    assert ds.get_batch(np.arange(54))["id"].tolist() == [i for i in range(60) if i % 10 != 7]


def test_decode_plugin_missing_on_the_workers_is_named(tmp_path, capsys, monkeypatch):
    pytest.importorskip("array_record.python.array_record_module")
    src = tmp_path / "rec"
    src.mkdir()
    _write_records(src / "a.array_record", [_record(i) for i in range(20)])
    here = tmp_path / "driver-only"
    here.mkdir()
    (here / "driver_only.py").write_text("def decode(data):\n    return {'record': data}\n")
    monkeypatch.syspath_prepend(str(here))  # importable on the driver, not in the Ray workers
    code, _, err = _convert(capsys, src, tmp_path / "ray", "--decode", "driver_only:decode",
                            ray_address=_convert.address)
    assert code == 2
    assert "failed on a Ray worker" in err and "--decode 'driver_only:decode': cannot load it" in err
    assert not os.path.exists(tmp_path / "ray" / "index.json")
