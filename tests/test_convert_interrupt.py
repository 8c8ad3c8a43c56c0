"""A failed or interrupted conversion: one line saying what happened and how to continue, no
dataset that opens, and a re-run that asks for --resume or --overwrite instead of starting over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fastload import open_dataset
from fastload.cli import main
from fastload.formats import FastloadDataset, write
from fastload.formats.errors import FormatError, SchemaError
from fastload.formats.verify import verify_dataset

# The CLI with a slow source in place of a path (open_source patched), so a SIGINT lands mid-run.
_SLOW_CLI = """
import sys, time, numpy as np
from fastload import cli
from fastload.formats import sources
class Slow:
    def __len__(self): return 3000
    def __getitem__(self, i):
        if i % 50 == 0: time.sleep(0.02)
        return {"x": np.full(64, i % 251, np.uint8), "t": np.arange(i % 13, dtype=np.int32)}
sources.open_source = lambda src, kind=None, **kw: (Slow(), None, {"source": "slow"})
sys.exit(cli.main(sys.argv[1:]))
"""


def _files(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, fs in os.walk(root)
        for f in fs
    }


def test_ctrl_c_in_the_cli_says_how_to_continue(tmp_path, capsys):
    script = tmp_path / "cli.py"
    script.write_text(_SLOW_CLI)
    args = ["convert", "SRC", "--workers", "2", "--shard-size", "16384", "--quiet"]

    def run(out, *extra, **kw):
        argv = [sys.executable, str(script), *args[:2], str(out), *args[2:], *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)

    assert run(tmp_path / "ref").returncode == 0
    out = tmp_path / "out"
    argv = [sys.executable, str(script), *args[:2], str(out), *args[2:]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(os.listdir(out / "shards") if (out / "shards").exists() else []) < 3:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group, workers included
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fastload convert: interrupted: ")
    command = f"fastload convert SRC {out} --workers 2 --shard-size 16384 --quiet --resume"
    assert lines[0].endswith(f"continue with: {command}"), lines[0]
    assert not (out / "index.json").exists()
    with pytest.raises(FormatError, match="no manifest"):
        FastloadDataset(out)

    assert main(["inspect", str(out)]) == 2
    said = capsys.readouterr().err
    assert "incomplete conversion" in said and command in said and "--overwrite" in said

    shards = sorted(os.listdir(out / "shards"))
    again = run(out)  # no --resume: refuses, touches nothing
    assert again.returncode == 2 and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert sorted(os.listdir(out / "shards")) == shards

    assert run(out, "--resume").returncode == 0
    assert verify_dataset(out) == []
    assert _files(out) == _files(tmp_path / "ref")


class _Failing:
    """Samples 0..n-1; sample `bad` is a dict instead of an array until `bad` is set to None."""

    def __init__(self, n: int, bad: int | None) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": {"oops": 1} if i == self.bad else np.full(32, i % 7, np.int16)}


def test_failed_python_write_keeps_shards_and_asks_to_resume(tmp_path):
    kw = {"shard_size": 4096, "workers": 1, "progress": False}
    write(_Failing(2000, None), tmp_path / "ref", **kw)
    out = tmp_path / "out"
    source = _Failing(2000, 1500)
    with pytest.raises(SchemaError, match="sample 1500, field 'x'") as info:
        write(source, out, **kw)
    note = " ".join(info.value.__notes__)
    assert "incomplete conversion" in note and f"write(..., {str(out)!r}, resume=True)" in note
    assert not (out / "index.json").exists()
    with pytest.raises(FileNotFoundError, match="not a dataset yet: .*incomplete conversion .*resume=True"):
        open_dataset(out)
    with pytest.raises(FileExistsError, match="interrupted conversion .*resume=True.*overwrite=True"):
        write(source, out, **kw)
    source.bad = None  # the input fixed: the finished shards are kept, the rest written
    write(source, out, resume=True, **kw)
    assert _files(out) == _files(tmp_path / "ref")


def test_overwrite_replaces_an_interrupted_conversion(tmp_path):
    kw = {"shard_size": 4096, "workers": 1, "progress": False}
    with pytest.raises(SchemaError):
        write(_Failing(2000, 1500), tmp_path / "out", **kw)
    write(_Failing(100, None), tmp_path / "out", overwrite=True, **kw)
    write(_Failing(100, None), tmp_path / "fresh", **kw)
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")  # nothing left of the first run
