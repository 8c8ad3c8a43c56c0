"""The `fastload bench` options (`add_arguments`) and entry point (`run_cli`)."""

from __future__ import annotations

import argparse
import sys

from fastload.benchmark.loaders import LOADER_KINDS
from fastload.benchmark.runner import BACKENDS, BenchConfig, run_benchmark

__all__ = ["TINY", "add_arguments", "config_from_args", "run_cli"]

# --tiny: a few MiB, short measurements (the test suite's end-to-end run)
TINY = {"size": 3 << 20, "seconds": 0.25, "repeats": 2, "workers": (0, 1), "batch_size": 32}


def _csv(choices: tuple[str, ...]) -> object:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}; got {text!r}")
        return items

    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        items = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a comma list of worker counts, got {text!r}") from exc
    if not items or min(items) < 0:
        raise argparse.ArgumentTypeError(f"expected worker counts >= 0, got {text!r}")
    return items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `fastload bench` options on `parser`."""
    from fastload.formats.units import parse_size

    parser.add_argument("dataset", nargs="?", default=None, metavar="DATASET_OR_URL",
                        help="fastload dataset dir, LMDB dir, HDF5 file, Parquet file/dir, Lance dataset (these two "
                             "read in place and compared with a converted copy) or fsspec URL "
                             "(default: build the embedded synthetic default in a temp dir)")
    parser.add_argument("--backends", type=_csv(BACKENDS), default=None,
                        help=f"backends to read (default: all available of {','.join(BACKENDS)})")
    parser.add_argument("--loaders", type=_csv(LOADER_KINDS), default=None,
                        help=f"loaders to compare (default: {','.join(LOADER_KINDS)})")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per batch (default 256)")
    parser.add_argument("--workers", type=_ints, default=None,
                        help="worker counts to sweep per loader; the best is reported (default 0,1,2)")
    parser.add_argument("--seconds", type=float, default=None, help="time per measurement (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement: min/median/max (default 3)")
    parser.add_argument("--json", dest="json_out", metavar="OUT", help="write the full results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG bar chart (needs matplotlib)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="simulate a training step of this many ms per batch and report the data stall")
    parser.add_argument("--step-kind", choices=("auto", "sleep", "matmul"), default="auto",
                        help="how to simulate the step (auto: matmul on CUDA, sleep on CPU)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (batches are moved there)")
    parser.add_argument("--size", type=parse_size, default=None,
                        help="embedded default size, e.g. 192MiB (default)")
    parser.add_argument("--tiny", action="store_true", help="a few MiB and short runs: finishes in seconds")
    parser.add_argument("--workdir", default=None, help="where to write temporary data (default: system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data")
    parser.add_argument("--seed", type=int, default=0, help="data and order seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--remote", metavar="URL", default=None,
                        help="instead: a fastload dataset at this fsspec URL, the Loader's cold and warm epochs vs "
                             "a raw GET + xxh3 + write + rename pipeline (--repeats rounds, default 3; --workers, "
                             "default 0,2; see fastload.benchmark.remote)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A `BenchConfig` from parsed options (`--tiny` fills in whatever was not given)."""
    base = BenchConfig()
    tiny = TINY if args.tiny else {}

    def pick(name: str) -> object:
        value = getattr(args, name)
        return value if value is not None else tiny.get(name, getattr(base, name))

    cfg = BenchConfig(
        dataset=args.dataset,
        backends=args.backends or base.backends,
        loaders=args.loaders or base.loaders,
        batch_size=int(pick("batch_size")),
        workers=tuple(pick("workers")),
        seconds=float(pick("seconds")),
        repeats=int(pick("repeats")),
        step_ms=args.step_ms,
        step_kind=args.step_kind,
        device=args.device,
        size=int(pick("size")),
        seed=args.seed,
        workdir=args.workdir,
        keep=args.keep,
        progress=not args.no_progress,
    )
    if cfg.batch_size < 1 or cfg.repeats < 1 or cfg.seconds <= 0:
        raise ValueError("--batch-size and --repeats must be >= 1 and --seconds > 0")
    if cfg.step_ms is not None and cfg.step_ms < 0:
        raise ValueError("--step-ms must be >= 0")
    return cfg


def run_cli(args: argparse.Namespace) -> int:
    """Run `fastload bench`: print the table, write --json / --plot; 0 on success."""
    from fastload.benchmark.report import format_table, write_json, write_plot

    if getattr(args, "remote", None):
        return _run_remote(args)
    res = run_benchmark(config_from_args(args))
    print(format_table(res))
    if args.json_out:
        write_json(res, args.json_out)
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plot:
        write_plot(res, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _run_remote(args: argparse.Namespace) -> int:
    import json

    from fastload.benchmark.remote import format_remote, run_remote

    res = run_remote(args.remote, rounds=args.repeats or 3, batch_size=args.batch_size or 256,
                     workers=tuple(args.workers or (0, 2)), workdir=args.workdir)
    print(format_remote(res))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0
