"""`make gpu-check`: every CUDA test and every GPU measurement in one command, one report.

    python -m bench.gpu_check [--out build/gpu-check] [--budget 480] [--only ROW,...] [--quick] [--rehearse]

Runs, each in its own process with its own time cap, inside one overall time budget: the test files
that exercise CUDA (`CUDA_TEST_FILES`, every test in them, so CPU/GPU parity tests run beside the
GPU-only ones) and each row of `bench.gpu` (parity, H2D, overlap, normalize, pad_ragged,
train_step, DALI images). A row that fails, crashes or runs out of time is reported as such and the
others still run; a row the budget no longer fits is reported as not run. It writes `report.md`
(one table row per measurement: figure, same-run baseline, ratio, goal; then every CUDA test's
result), `report.json` and `logs.tar.gz` (every row's log) under `--out`, rewritten after each
row. Exit status 1 if a row or test failed.

Without CUDA every row is reported as not run ("no CUDA device"); `--rehearse` still starts each
row's process (which imports all that the row needs) and collects the tests, so a missing package
shows up before a GPU machine is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

__all__ = ["CUDA_TEST_FILES", "ROW_CAPS", "main", "render_markdown", "run_step"]

CUDA_TEST_FILES = (
    "tests/test_cuda_ops.py",
    "tests/test_gpu_paths.py",
    "tests/test_loader_robust.py",
    "tests/test_bucketing.py",
    "tests/test_vision.py",
    "tests/test_thread_source.py",
    "tests/test_first_contact.py",
)
# Seconds each row may take at most (the budget left caps it further), in the order they run: the
# measurements first (short), then the tests, then the rows that need the most time or DALI.
ROW_CAPS = {
    "parity": 90,
    "h2d": 60,
    "overlap": 120,
    "normalize": 60,
    "pad_ragged": 45,
    "cuda-tests": 240,
    "train_step": 90,
    "images": 150,
}
MIN_ROW_SECONDS = 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _junit(path: str) -> dict[str, Any]:
    """Counts, failures, skip reasons and every test's outcome from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = []
    for suite in suites:
        for case in suite:
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome, reason = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome, reason = tag, (el.get("message") or "").splitlines()[0] if el.get("message") else ""
                    break
            cases.append({"test": name, "outcome": outcome, "reason": reason})
    failed = [c["test"] for c in cases if c["outcome"] in ("failure", "error")]
    skipped = sorted({c["reason"] for c in cases if c["outcome"] == "skipped"})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed_tests": failed, "skip_reasons": skipped, "cases": cases}


_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b(?: \((.*)\))?", re.M)
_OUTCOMES = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped",
             "XFAIL": "skipped"}


def _verbose_outcomes(output: str) -> dict[str, Any]:
    """The `_junit` summary from `pytest -v` output lines (`path::test PASSED`), for a run that never
    finished; the tests it did not reach are not listed."""
    cases = [{"test": m[1], "outcome": _OUTCOMES[m[2]], "reason": m[3] or ""} for m in _VERBOSE_LINE.finditer(output)]
    count = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    failed = [c["test"] for c in cases if c["outcome"] in ("failure", "error")]
    return {"tests": len(cases), "passed": count["passed"], "failures": count["failure"], "errors": count["error"],
            "skipped": count["skipped"], "failed_tests": failed,
            "skip_reasons": sorted({c["reason"] for c in cases if c["outcome"] == "skipped" and c["reason"]}),
            "cases": cases}


def run_step(name: str, cmd: list[str], *, out_dir: str, junit: str | None = None, result_json: str | None = None,
             timeout: float = 3600) -> dict[str, Any]:
    """Run one row's command, its output kept in `<out_dir>/<name>.log`; returns its report row.
    A row that writes `result_json` (bench.gpu's rows) brings its figure, baseline, ratio and goal."""
    log_path = os.path.join(out_dir, f"{name}.log")
    print(f"== {name}: {' '.join(cmd)} (at most {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # a run cut short keeps what it printed
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc, output = 124, f"{out}{err}\ntimed out after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    with open(log_path, "w") as fh:
        fh.write(output)
    print(output[-3000:], flush=True)
    row: dict[str, Any] = {"step": name, "command": " ".join(cmd), "rc": rc, "ok": rc == 0,
                           "seconds": round(seconds, 1), "log": log_path,
                           "tail": [line for line in output.strip().splitlines()[-15:]]}
    row["status"] = "ok" if rc == 0 else ("FAILED: timed out" if rc == 124 else f"FAILED (exit {rc})")
    if junit and os.path.exists(junit):
        row["pytest"] = _junit(junit)
    elif junit:  # cut short before pytest wrote its XML: the outcomes it printed so far (-v)
        row["pytest"] = _verbose_outcomes(output)
    if result_json and os.path.exists(result_json):
        with open(result_json) as fh:
            result = json.load(fh)
        row["result"] = result
        row["status"] = result.get("status", row["status"])
        row["ok"] = rc == 0 and not row["status"].startswith("FAILED")
    return row


def not_run(name: str, why: str) -> dict[str, Any]:
    """The report row of a step that did not start."""
    return {"step": name, "command": "", "rc": None, "ok": True, "seconds": 0.0, "log": "", "tail": [],
            "status": f"not run: {why}"}


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|")


def _number(x: Any, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}g}"


def _summary(row: dict[str, Any]) -> str:
    if "pytest" in row:
        p = row["pytest"]
        text = f"{p['passed']} passed, {p['failures'] + p['errors']} failed, {p['skipped']} skipped"
        if p["failed_tests"]:
            text += "; failed: " + ", ".join(p["failed_tests"][:5])
        return text
    lines = [ln for ln in row["tail"] if ln.strip()]
    return _cell(" / ".join(lines[-3:]))[:300]


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown: one table row per measurement or test step, then each row's details and
    every CUDA test's outcome."""
    lines = [f"# fastload GPU check ({report['created']})", "",
             f"- device: {report['device']}", f"- commit: {report['commit']}", f"- machine: {report['machine']}",
             f"- time: {report.get('seconds', 0):.0f} s of a {report.get('budget', 0):.0f} s budget", "",
             "| row | status | figure | baseline | ratio | goal | met | s |", "|---|---|---|---|---|---|---|---|"]
    for row in report["steps"]:
        res = row.get("result", {})
        if "pytest" in row:
            figure, baseline, ratio, goal, met = _summary(row), "", "", "0 failed", str(row["ok"]).lower()
        elif res and res.get("value") is not None:
            figure = f"{_number(res['value'])} {res.get('unit', '')}"
            baseline = (f"{res['baseline']}: {_number(res.get('baseline_value'))}" if res.get("baseline") else "")
            ratio = f"{res['ratio']:.2f}x" if res.get("ratio") is not None else ""
            goal, met = res.get("goal", ""), "" if res.get("met") is None else ("yes" if res["met"] else "NO")
        else:
            figure, baseline, ratio, goal, met = ("" if row["ok"] else _summary(row)), "", "", "", ""
        lines.append(f"| `{row['step']}` | {_cell(row['status'])} | {_cell(figure)} | {_cell(baseline)} | {ratio} | "
                     f"{_cell(goal)} | {met} | {row['seconds']} |")
    for row in report["steps"]:
        details = row.get("result", {}).get("details") or []
        if details:
            lines += ["", f"`{row['step']}`:", *(f"- {_cell(d)}" for d in details)]
    for row in report["steps"]:
        p = row.get("pytest")
        if not p:
            continue
        if p["skip_reasons"]:
            lines += ["", f"Skipped in `{row['step']}` (reasons): " + "; ".join(map(_cell, p["skip_reasons"]))]
        lines += ["", f"<details><summary>every test of `{row['step']}` ({len(p['cases'])})</summary>", "",
                  "| test | outcome |", "|---|---|"]
        lines += [f"| `{c['test']}` | {c['outcome']}{': ' + _cell(c['reason']) if c['reason'] else ''} |"
                  for c in p["cases"]]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _device() -> tuple[bool, str]:
    try:
        from fastload.validate import cuda_status
    except ImportError as exc:  # fastload not importable: the install step did not run
        return False, f"fastload does not import ({exc})"
    return cuda_status()


def _write(out: str, work: str, report: dict[str, Any]) -> None:
    """report.json, report.md and logs.tar.gz (every row's log, JSON and the tests' JUnit XML) in `out`,
    each replaced whole: three files, rewritten after every row so a run cut short keeps the rows done."""
    rendered = {"report.json": json.dumps(report, indent=2) + "\n", "report.md": render_markdown(report)}
    for name, text in rendered.items():
        with open(os.path.join(out, name + ".tmp"), "w") as fh:
            fh.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    with tarfile.open(os.path.join(out, "logs.tar.gz.tmp"), "w:gz") as tar:
        for name in sorted(os.listdir(work)):
            tar.add(os.path.join(work, name), arcname=f"gpu-check-logs/{name}")
    os.replace(os.path.join(out, "logs.tar.gz.tmp"), os.path.join(out, "logs.tar.gz"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "gpu-check"),
                    help="report directory: report.md, report.json, logs.tar.gz")
    ap.add_argument("--work", help="where each row's log and JSON are written and kept (default: a temporary "
                                   "folder, removed at the end: logs.tar.gz holds them)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for all rows together (default 480)")
    ap.add_argument("--only", help=f"comma list of rows to run (default all: {','.join(ROW_CAPS)})")
    ap.add_argument("--quick", action="store_true", help="smaller batches and fewer rounds in every row")
    ap.add_argument("--commit", help="the commit the tree is at, for the report (default: git rev-parse)")
    ap.add_argument("--rehearse", action="store_true",
                    help="without CUDA: still start every row (imports only) and collect the tests")
    args = ap.parse_args(argv)
    names = list(ROW_CAPS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROW_CAPS))
    if unknown:
        ap.error(f"unknown rows {unknown}: expected some of {','.join(ROW_CAPS)}")
    usable, device = _device()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="fastload-gpu-check-")
    os.makedirs(work, exist_ok=True)
    py = sys.executable
    t_start = time.monotonic()
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device, "commit": args.commit or _commit(),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "budget": args.budget, "seconds": 0.0, "ok": True, "steps": []}
    for name in names:
        left = args.budget - (time.monotonic() - t_start)
        if not usable and not args.rehearse:
            row = not_run(name, f"no CUDA device ({device})")
        elif left < MIN_ROW_SECONDS:
            row = not_run(name, f"time budget spent ({args.budget:.0f} s)")
        elif name == "cuda-tests":
            row = _tests_row(py, work, usable, timeout=min(ROW_CAPS[name], left))
        else:
            result_json = os.path.join(work, f"{name}.json")
            if os.path.exists(result_json):
                os.remove(result_json)
            row = run_step(name, [py, "-m", "bench.gpu", "--row", name, "--json", result_json,
                                  *(["--quick"] if args.quick else [])], out_dir=work, result_json=result_json,
                           timeout=min(ROW_CAPS[name], left))
        report["steps"].append(row)
        report["seconds"] = time.monotonic() - t_start
        report["ok"] = all(s["ok"] for s in report["steps"])
        _write(out, work, report)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    if not usable:
        print(f"gpu-check: no CUDA device ({device}); every row reported as not run")
    print(f"\ngpu-check: {'no failures' if report['ok'] else 'FAILURES'}; report: {out}/report.md "
          f"(and report.json; every row's log in logs.tar.gz)")
    return 0 if report["ok"] else 1


def _tests_row(py: str, work: str, usable: bool, *, timeout: float) -> dict[str, Any]:
    """Every test in CUDA_TEST_FILES; without CUDA, only collected (what a missing package would break)."""
    junit = os.path.join(work, "pytest.xml")
    if not usable:
        row = run_step("cuda-tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                                      *CUDA_TEST_FILES], out_dir=work, timeout=timeout)
        collected = re.findall(r"(\d+) tests? collected", "\n".join(row["tail"]))
        if row["rc"] == 0 and collected:
            row["status"] = f"not run: no CUDA device ({collected[-1]} tests collected)"
        return row
    return run_step("cuda-tests", [py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "--timeout=120",
                                   *CUDA_TEST_FILES, f"--junitxml={junit}"], out_dir=work, junit=junit,
                    timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
