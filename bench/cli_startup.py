"""Start-up time of the `fastload` command. `python -m bench.cli_startup [--rounds N]`.

Times `fastload --version`, `fastload --help` and `fastload inspect DATASET` (a small dataset
written first) as fresh processes, interleaved round by round with the baseline `python -c pass`
and `python -c "import numpy"` (the floor for `inspect`, which reads the index with numpy)
of the same interpreter, and prints each command's median wall time, its quartiles, its median
excess over the bare interpreter and its median CPU time (user + system: on a shared machine it
moves less than the wall time). Bytecode is cached (in a temporary PYTHONPYCACHEPREFIX) as it
is for an installed package. `torch loaded` says whether the command imported torch (it should not).

`--baseline DIR` also times `inspect` from another checkout of fastload (e.g. `git worktree add DIR
COMMIT`, with `formats/_ranges*.so` copied or built there) in the same rounds: a before/after in one run.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

__all__ = ["main"]

_PROBE = (
    "import atexit, sys; atexit.register(lambda: print('TORCH', 'torch' in sys.modules, file=sys.stderr)); "
    "from fastload.cli import main; sys.exit(main(sys.argv[1:]))"
)


# `fastload inspect` from the checkout in argv[1] instead of the installed (editable) package
_BASELINE = (
    "import sys; root = sys.argv.pop(1); "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; sys.path.insert(0, root); "
    "import fastload; fastload.__path__.append(root); from fastload.cli import main; rc = main(sys.argv[1:]); "
    "assert sys.modules['fastload.formats'].__file__.startswith(root), 'baseline not used'; sys.exit(rc)"
)


def _time(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child): on a shared machine the CPU time moves less."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _loads_torch(args: list[str], env: dict[str, str]) -> bool:
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, check=False, env=env)
    return "TORCH True" in out.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--baseline", metavar="DIR", help="a checkout whose `inspect` is timed in the same rounds")
    args = ap.parse_args(argv)
    from fastload.formats import write

    exe = os.path.join(os.path.dirname(sys.executable), "fastload")
    with tempfile.TemporaryDirectory() as tmp:
        ds = os.path.join(tmp, "ds")
        write(({"x": np.full(8, i, np.float32), "tokens": np.arange(i % 7 + 1)} for i in range(1000)),
              ds, progress=False)
        # `inspect` reads the index with numpy: `import numpy` is the floor it cannot go below
        commands = {"python -c pass": [sys.executable, "-c", "pass"],
                    "python -c 'import numpy'": [sys.executable, "-c", "import numpy"],
                    "fastload --version": [exe, "--version"],
                    "fastload --help": [exe, "--help"],
                    "fastload inspect DATASET": [exe, "inspect", ds]}
        if args.baseline:
            root = os.path.abspath(args.baseline)
            commands["inspect DATASET (baseline)"] = [sys.executable, "-c", _BASELINE, root, "inspect", ds]
        # Bytecode cached as in an installed package (pip compiles at install), kept out of the tree;
        # PYTHONDONTWRITEBYTECODE in the caller's environment would make every run compile the sources.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        for cmd in commands.values():  # warm-up: writes the bytecode cache
            _time(cmd, env)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in commands}
        for _ in range(args.rounds):
            for name, cmd in commands.items():
                times[name].append(_time(cmd, env))
        base = np.median([w for w, _ in times["python -c pass"]])
        print(f"{'command':<26} {'wall s':>7} {'quartiles':>14} {'over python':>12} {'CPU s':>7}  torch loaded")
        for name, ts in times.items():
            q1, med, q3 = np.percentile([w for w, _ in ts], [25, 50, 75])
            cpu = np.median([c for _, c in ts])
            loads = "-" if not name.startswith("fastload") else str(_loads_torch(commands[name][1:], env))
            print(f"{name:<26} {med:>7.3f} {q1:>6.3f}-{q3:<7.3f} {med - base:>11.3f}s {cpu:>7.3f}  {loads}")
    load = os.getloadavg()[0]
    print(f"({args.rounds} interleaved rounds, medians; {os.cpu_count()} cores, load average {load:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
