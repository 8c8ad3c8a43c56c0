"""`make gpu-check` (bench.gpu_check): the no-CUDA branch, and the report it writes from its steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch

from bench.gpu_check import ROW_CAPS, not_run, render_markdown, run_step


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA branch needs a machine without CUDA")
def test_without_cuda_every_row_is_reported_not_run(tmp_path):
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "gpu-check: no CUDA device (" in res.stdout and "every row reported as not run" in res.stdout
    report = json.loads((out / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == list(ROW_CAPS)
    assert all(s["status"].startswith("not run: no CUDA device") for s in report["steps"])
    md = (out / "report.md").read_text()
    assert all(f"| `{name}` | not run: no CUDA device" in md for name in ROW_CAPS)
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "report.json", "report.md"]  # $OUT brings back 8 files




@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA branch needs a machine without CUDA")
def test_rehearsal_starts_each_row_and_collects_the_tests(tmp_path):
    """--rehearse without CUDA: each row's process imports what it needs; the CUDA tests are collected."""
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out), "--rehearse",
                          "--only", "parity,cuda-tests"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = {s["step"]: s for s in json.loads((out / "report.json").read_text())["steps"]}
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"gpu-check-logs/parity.log", "gpu-check-logs/parity.json", "gpu-check-logs/cuda-tests.log"} <= set(
            tar.getnames())
    assert steps["parity"]["rc"] == 0 and steps["parity"]["status"] == "not run: no CUDA device"
    assert steps["parity"]["result"]["row"] == "parity"
    assert re.fullmatch(r"not run: no CUDA device \(\d+ tests collected\)", steps["cuda-tests"]["status"])


def test_a_budget_too_small_for_a_row_reports_it_not_run(tmp_path):
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out), "--rehearse", "--budget", "5",
                          "--only", "h2d"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    (step,) = json.loads((out / "report.json").read_text())["steps"]
    assert step["status"] == "not run: time budget spent (5 s)"


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
    result = tmp_path / "h2d.json"
    measured = run_step("h2d", [sys.executable, "-c", "import json, sys; json.dump({'row': 'h2d', 'status': 'ok', "
                                "'value': 40.5, 'unit': 'GB/s', 'baseline': 'torch', 'baseline_value': 45.0, "
                                "'ratio': 0.9, 'goal': '>= 0.9x', 'met': True, 'details': ['64 MiB']}, "
                                f"open({str(result)!r}, 'w'))"], out_dir=str(tmp_path), result_json=str(result))
    failed = run_step("overlap", [sys.executable, "-c", "raise SystemExit('boom')"], out_dir=str(tmp_path),
                      result_json=str(tmp_path / "never-written.json"))
    assert measured["ok"] and not failed["ok"] and failed["status"] == "FAILED (exit 1)"
    report = {"created": "now", "device": "GPU X", "commit": "abc", "machine": "m", "ok": False,
              "steps": [row, bench, measured, failed, not_run("images", "NVIDIA DALI is not installed")]}
    md = render_markdown(report)
    assert "| `cuda-tests` | FAILED (exit 1) | 1 passed, 1 failed, 1 skipped; failed: test_fake::test_bad |" in md
    assert "| `bench.fake` | ok |" in md
    assert "| `h2d` | ok | 40.5 GB/s | torch: 45 | 0.90x | >= 0.9x | yes |" in md and "- 64 MiB" in md
    assert "| `overlap` | FAILED (exit 1) | boom |" in md
    assert "| `images` | not run: NVIDIA DALI is not installed |" in md
    assert "needs a thing" in md
    assert "| `test_fake::test_bad` | failure" in md and "| `test_fake::test_skip` | skipped: needs a thing |" in md
    json.dumps(report)  # the JSON report holds plain values only
    assert (tmp_path / "cuda-tests.log").read_text()


def test_tests_cut_short_keep_the_outcomes_printed_so_far(tmp_path):
    tests = tmp_path / "test_slow.py"
    tests.write_text(
        "import time, pytest\n"
        "def test_ok(): pass\n"
        "@pytest.mark.skip(reason='needs a thing')\n"
        "def test_skip(): pass\n"
        "def test_bad(): assert 0\n"
        "def test_hangs(): time.sleep(120)\n"
    )
    junit = tmp_path / "never.xml"
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(tests), f"--rootdir={tmp_path}",
           f"--junitxml={junit}"]
    row = run_step("cuda-tests", cmd, out_dir=str(tmp_path), junit=str(junit), timeout=10)
    assert row["rc"] == 124 and row["status"] == "FAILED: timed out" and not junit.exists()
    p = row["pytest"]  # -v prints no skip reason per test (the -rs summary never came)
    assert [(c["test"].split("::")[-1], c["outcome"]) for c in p["cases"]] == [
        ("test_ok", "passed"), ("test_skip", "skipped"), ("test_bad", "failure")]
    assert (p["passed"], p["failures"], p["skipped"], p["failed_tests"][0].split("::")[-1]) == (1, 1, 1, "test_bad")
