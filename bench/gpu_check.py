"""`make gpu-check`: every CUDA test and the GPU benchmarks in one command, one report.

    python -m bench.gpu_check [--out build/gpu-check] [--quick]

On a CUDA machine it runs, in order: the test files that exercise CUDA (`CUDA_TEST_FILES`, every
test in them, so CPU/GPU parity tests run beside the GPU-only ones), `python -m bench.gpu` (kernel
parity + throughput) and `python -m bench.train_step` (torch DataLoader vs fastload.Loader under
a real training step on the GPU). It writes `report.json` and `report.md` (one table row per step:
status, seconds, the pytest counts or the benchmark's last lines) under `--out` and prints that
path. Exit status 1 if any step failed.

Without CUDA it says what was found and exits 0 without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

__all__ = ["CUDA_TEST_FILES", "main", "render_markdown", "run_step"]

CUDA_TEST_FILES = (
    "tests/test_cuda_ops.py",
    "tests/test_loader_robust.py",
    "tests/test_bucketing.py",
    "tests/test_vision.py",
    "tests/test_thread_source.py",
    "tests/test_first_contact.py",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _junit_counts(path: str) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = sorted({(c.find("skipped").get("message") or "") for s in suites for c in s
                      if c.find("skipped") is not None})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed_tests": failed, "skip_reasons": skipped}


def run_step(name: str, cmd: list[str], *, out_dir: str, junit: str | None = None,
             timeout: float = 3600) -> dict[str, Any]:
    """Run one step, its output teed to `<out_dir>/<name>.log`; returns its report row."""
    log_path = os.path.join(out_dir, f"{name}.log")
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = 124, f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    with open(log_path, "w") as fh:
        fh.write(output)
    print(output[-4000:], flush=True)
    row: dict[str, Any] = {"step": name, "command": " ".join(cmd), "rc": rc, "ok": rc == 0,
                           "seconds": round(seconds, 1), "log": log_path,
                           "tail": [line for line in output.strip().splitlines()[-15:]]}
    if junit and os.path.exists(junit):
        row["pytest"] = _junit_counts(junit)
    return row


def _summary(row: dict[str, Any]) -> str:
    if "pytest" in row:
        p = row["pytest"]
        text = f"{p['passed']} passed, {p['failures'] + p['errors']} failed, {p['skipped']} skipped"
        if p["failed_tests"]:
            text += "; failed: " + ", ".join(p["failed_tests"][:5])
        return text
    lines = [ln for ln in row["tail"] if ln.strip()]
    return re.sub(r"\s+", " ", " / ".join(lines[-3:]))[:300].replace("|", "\\|")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table (one row per step)."""
    lines = [f"# fastload GPU check ({report['created']})", "",
             f"- device: {report['device']}", f"- commit: {report['commit']}", f"- machine: {report['machine']}", "",
             "| step | status | seconds | summary |", "|---|---|---|---|"]
    for row in report["steps"]:
        status = "ok" if row["ok"] else f"FAILED (exit {row['rc']})"
        lines.append(f"| `{row['step']}` | {status} | {row['seconds']} | {_summary(row)} |")
    for row in report["steps"]:
        reasons = row.get("pytest", {}).get("skip_reasons")
        if reasons:
            lines += ["", f"Skipped in `{row['step']}` (reasons): " + "; ".join(reasons)]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "gpu-check"), help="report directory")
    ap.add_argument("--quick", action="store_true", help="shorter benchmarks (bench.gpu --quick, 30 train steps)")
    args = ap.parse_args(argv)
    from fastload.validate import cuda_status

    usable, device = cuda_status()
    if not usable:
        print(f"gpu-check: no CUDA device ({device}); nothing to check on this machine.")
        return 0
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    junit = os.path.join(out, "pytest.xml")
    steps = [
        run_step("cuda-tests", [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TEST_FILES,
                                f"--junitxml={junit}"], out_dir=out, junit=junit),
        run_step("bench.gpu", [py, "-m", "bench.gpu", *(["--quick"] if args.quick else [])], out_dir=out),
        run_step("bench.train_step", [py, "-m", "bench.train_step", "--device", "cuda",
                                      *(["--steps", "30", "--size", "16MiB"] if args.quick else [])], out_dir=out),
    ]
    report = {"created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device, "commit": _commit(),
              "machine": f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "ok": all(s["ok"] for s in steps), "steps": steps}
    with open(os.path.join(out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(render_markdown(report))
    print(f"\ngpu-check: {'all steps passed' if report['ok'] else 'FAILURES'}; report: {out}/report.md "
          f"and {out}/report.json")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
