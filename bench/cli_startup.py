"""Start-up time of the `fastload` command. `python -m bench.cli_startup [--rounds N]`.

Times `fastload --version`, `fastload --help` and `fastload inspect DATASET` (a small dataset
written first) as fresh processes, interleaved round by round with the baseline `python -c pass`
of the same interpreter, and prints each command's median, its quartiles and its median excess
over the bare interpreter. `torch loaded` says whether the command imported torch (it should not).
"""

from __future__ import annotations

import argparse
import os
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


def _time(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def _loads_torch(args: list[str]) -> bool:
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, check=False)
    return "TORCH True" in out.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    from fastload.formats import write

    exe = os.path.join(os.path.dirname(sys.executable), "fastload")
    with tempfile.TemporaryDirectory() as tmp:
        ds = os.path.join(tmp, "ds")
        write(({"x": np.full(8, i, np.float32), "tokens": np.arange(i % 7 + 1)} for i in range(1000)),
              ds, progress=False)
        commands = {"python -c pass": [sys.executable, "-c", "pass"],
                    "fastload --version": [exe, "--version"],
                    "fastload --help": [exe, "--help"],
                    "fastload inspect DATASET": [exe, "inspect", ds]}
        times: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(args.rounds):
            for name, cmd in commands.items():
                times[name].append(_time(cmd))
        base = np.median(times["python -c pass"])
        print(f"{'command':<26} {'median s':>9} {'quartiles':>14} {'over python':>12}  torch loaded")
        for name, ts in times.items():
            q1, med, q3 = np.percentile(ts, [25, 50, 75])
            loads = "-" if name.startswith("python") else str(_loads_torch(commands[name][1:]))
            print(f"{name:<26} {med:>9.3f} {q1:>6.3f}-{q3:<7.3f} {med - base:>11.3f}s  {loads}")
    print(f"({args.rounds} interleaved rounds, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
