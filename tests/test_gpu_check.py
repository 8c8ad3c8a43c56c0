"""`make gpu-check` (bench.gpu_check): the no-CUDA branch, and the report it writes from its steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.gpu_check import render_markdown, run_step


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA branch needs a machine without CUDA")
def test_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "gpu-check: no CUDA device (" in res.stdout and "nothing to check" in res.stdout
    assert not out.exists()


def test_report_rows_from_steps(tmp_path):
    tests = tmp_path / "test_fake.py"
    tests.write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 0\n"
        "@pytest.mark.skip(reason='needs a thing')\n"
        "def test_skip(): pass\n"
    )
    junit = tmp_path / "j.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
           f"--rootdir={tmp_path}", f"--junitxml={junit}"]
    row = run_step("cuda-tests", cmd, out_dir=str(tmp_path), junit=str(junit))
    assert row["rc"] == 1 and not row["ok"]
    counts = {k: row["pytest"][k] for k in ("passed", "failures", "skipped")}
    assert counts == {"passed": 1, "failures": 1, "skipped": 1}
    assert row["pytest"]["failed_tests"] == ["test_fake::test_bad"]
    assert row["pytest"]["skip_reasons"] == ["needs a thing"]
    bench = run_step("bench.fake", [sys.executable, "-c", "print('speed 3.5x | ok')"], out_dir=str(tmp_path))
    assert bench["ok"] and bench["tail"] == ["speed 3.5x | ok"]
    report = {"created": "now", "device": "GPU X", "commit": "abc", "machine": "m", "ok": False, "steps": [row, bench]}
    md = render_markdown(report)
    assert "| `cuda-tests` | FAILED (exit 1) |" in md
    assert "1 passed, 1 failed, 1 skipped; failed: test_fake::test_bad" in md
    assert "| `bench.fake` | ok |" in md and "speed 3.5x \\| ok" in md
    assert "needs a thing" in md
    json.dumps(report)  # the JSON report holds plain values only
    assert (tmp_path / "cuda-tests.log").read_text()
