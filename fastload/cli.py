"""The `fastload` command: convert, inspect, verify, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["build_parser", "main"]

# Every import of numpy, torch and fastload's modules is inside the command that needs it, so
# `fastload --help`, `--version` and `inspect` start without loading torch.


def _count(text: str) -> int:
    """argparse type: an int >= 0 (worker counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _convert(args: argparse.Namespace) -> int:
    if args.engine == "ray":
        return _convert_ray(args)
    if args.address is not None:
        raise ValueError("--address needs --engine ray")
    from fastload.formats import write
    from fastload.formats.sources import open_source
    from fastload.formats.units import format_size, plural

    source, schema, attrs = open_source(
        args.src, "fastload" if args.upgrade else args.kind, decode_check=not args.no_decode_check,
        labels=args.labels, decode=args.decode, fields=_field_list(args.fields), jpeg_restart=args.jpeg_restart,
    )
    skipping = None
    if args.on_error == "skip":
        from fastload.formats.sources import SkipBadInputs, skip_refusal
        from fastload.formats.writer import BlockSource

        if isinstance(source, BlockSource):
            raise SystemExit(f"fastload convert: {skip_refusal(args.src, attrs)}")
        source = skipping = SkipBadInputs(source)
    manifest = write(
        source,
        args.out,
        schema=schema,
        shard_size=args.shard_size,
        workers=args.workers,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        attrs=attrs,
        resume_command=_resume_command(args.argv),
    )
    if skipping is not None and skipping.skipped:
        report = os.path.join(args.out, "skipped-inputs.jsonl")
        skipping.report(report)
        print(f"skipped {len(skipping.skipped)} input(s) that failed to read; reasons in {report}", file=sys.stderr)
    total = sum(s.bytes for s in manifest.shards)
    print(f"wrote {plural(manifest.num_samples, 'sample')} in {plural(len(manifest.shards), 'shard')} "
          f"({format_size(total)}) to {args.out}")
    return 0


def _field_list(text: str | None) -> list[str] | None:
    """`--fields a,b,c` as a list of names (None when not given)."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise SystemExit("fastload convert: --fields needs at least one field name")
    return names


def _resume_command(argv: Sequence[str]) -> str:
    """The exact command that continues this conversion: the same arguments with --resume."""
    import shlex

    kept = [a for a in argv if a not in ("--resume", "--overwrite")]
    return shlex.join(["fastload", *kept, "--resume"])


def _convert_ray(args: argparse.Namespace) -> int:
    try:
        from fastload.formats.ray_io import convert_ray
    except ImportError as exc:
        print(f"fastload convert: error: {exc}", file=sys.stderr)
        return 2
    from fastload.formats.units import format_size, plural

    result = convert_ray(
        args.src, args.out, kind="fastload" if args.upgrade else args.kind, address=args.address,
        shard_size=args.shard_size, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet,
        concurrency=args.workers, on_error=args.on_error, decode_check=not args.no_decode_check, labels=args.labels,
        fields=_field_list(args.fields), decode=args.decode,
        jpeg_restart=args.jpeg_restart,
    )
    if result.skipped:
        print(f"skipped {len(result.skipped)} input(s) that failed to read; reasons in {result.report}",
              file=sys.stderr)
    manifest = result.manifest
    total = sum(s.bytes for s in manifest.shards)
    print(
        f"wrote {plural(manifest.num_samples, 'sample')} in {plural(len(manifest.shards), 'shard')} "
        f"({format_size(total)}) to {args.out} on Ray: {plural(len(manifest.shards) - result.kept, 'shard')} "
        f"written by tasks on {plural(len(result.shards_per_node), 'node')}, "
        f"{result.kept} kept from the interrupted run"
    )
    return 0


def _quantile(values: np.ndarray, q: float) -> int:
    """`int(np.percentile(values, 100 * q))` (linear interpolation), without np.percentile's
    import of numpy.ma, a tenth of `fastload inspect`'s start-up."""
    import numpy as np

    s = np.sort(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return int(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def _histogram(lengths: np.ndarray, width: int = 40) -> list[str]:
    import numpy as np

    if len(lengths) == 0:
        return ["    (no samples)"]
    top = int(lengths.max())
    edges = [0] + [2**k for k in range(0, max(1, top).bit_length() + 1)]
    counts, _ = np.histogram(lengths, bins=np.array(edges + [edges[-1] * 2]))
    peak = max(1, counts.max())
    lines = []
    for lo, hi, c in zip(edges, edges[1:] + [edges[-1] * 2], counts):
        if c:
            lines.append(f"    [{lo:>8}, {hi:>8})  {c:>9}  {'#' * max(1, int(width * c / peak))}")
    return lines


def _inspect(args: argparse.Namespace) -> int:

    from fastload.dataset import open_dataset
    from fastload.formats import FastloadDataset
    from fastload.formats.errors import FormatError
    from fastload.formats.storage import LocalStorage
    from fastload.formats.units import format_size, plural
    from fastload.formats.verify import shard_file_problem

    ds = open_dataset(args.dataset)
    if isinstance(ds, FastloadDataset):
        m = ds.manifest
        if isinstance(ds.storage, LocalStorage):  # sizes are printed from the manifest: check them against the files
            problems = [p for k, s in enumerate(m.shards) if (p := shard_file_problem(ds.storage, k, s)) is not None]
            if problems:
                more = f" (and {plural(len(problems) - 1, 'more shard')})" if len(problems) > 1 else ""
                raise FormatError(problems[0] + more)
        sizes = [s.bytes for s in m.shards]
        print(f"dataset   {ds.root}")
        print(f"samples   {len(ds)}")
        print(
            f"shards    {len(m.shards)}  (total {format_size(sum(sizes))}, "
            f"min {format_size(min(sizes))}, max {format_size(max(sizes))})"
        )
        if m.attrs:
            print(f"attrs     {', '.join(f'{k}={v!r:.60}' for k, v in m.attrs.items())}")
    else:  # Parquet or Lance, read in place
        print(f"dataset   {ds.path}  ({type(ds).__name__}: read in place, no fastload checksums)")
        print(f"samples   {len(ds)}")
    print("fields")
    for f in ds.schema:
        shape = f" shape={list(f.shape)}" if f.shape else ""
        print(f"  {f.name:<20} {f.kind:<8} dtype={f.dtype.str}{shape}")
        if not f.is_fixed:
            lengths = ds.lengths(f.name)
            if len(lengths):
                print(
                    f"    length: min {lengths.min()}, mean {lengths.mean():.1f}, "
                    f"p50 {_quantile(lengths, 0.5)}, p99 {_quantile(lengths, 0.99)}, max {lengths.max()}"
                )
            print("\n".join(_histogram(lengths)))
        if f.kind == "image" and isinstance(ds, FastloadDataset):
            hw = ds.image_sizes(f.name)
            if len(hw):
                print(f"    height {hw[:, 0].min()}..{hw[:, 0].max()}, width {hw[:, 1].min()}..{hw[:, 1].max()}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from fastload.formats.units import plural
    from fastload.formats.verify import verify_dataset

    problems = verify_dataset(args.dataset, decode=args.decode)
    if problems:
        for p in problems:
            print(f"BAD  {p}", file=sys.stderr)
        print(f"{plural(len(problems), 'problem')} found in {args.dataset}", file=sys.stderr)
        return 1
    print(f"OK   {args.dataset}: every checksum and offsets table is intact")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from fastload.benchmark import run_cli

    return run_cli(args)


def _version() -> str:
    from fastload import __version__

    return f"fastload {__version__}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `fastload` argument parser; `bench`'s own options (which import torch) only when `command` is 'bench'."""
    parser = argparse.ArgumentParser(prog="fastload", description="fastload: keep GPUs fed.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a source into fastload's sharded format")
    p.add_argument("src", help="source path (image folder, .npy file/dir, tokens.npy+offsets.npy dir, Megatron "
                   "PREFIX(.bin/.idx), .jsonl, LMDB dir, HDF5 file, HF save_to_disk dir, Parquet, Lance dataset, "
                   "LitData optimized dir, ArrayRecord file/dir, WebDataset .tar shards (dir, {000..999} pattern "
                   "or URL), TFRecord file/dir, MosaicML MDS dir; with "
                   "--engine ray also Parquet files or any fsspec URL of Parquet / JSON lines)")
    p.add_argument("out", help="output dataset directory (with --engine ray also an fsspec URL, e.g. s3://b/ds)")
    if command == "convert":  # the source kinds live in fastload.formats, which imports numpy
        from fastload.formats.sources import SOURCE_KINDS

        p.add_argument("--kind", choices=SOURCE_KINDS, help="source kind (detected when omitted)")
    p.add_argument("--shard-size", default="64MiB", help="target shard size, e.g. 64MiB (default)")
    p.add_argument("--workers", type=_count, default=None,
                   help="encoder processes / writer threads (--engine ray: Ray tasks at a time)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--upgrade",
        action="store_true",
        help="SRC is a fastload dataset (e.g. version 1): rewrite it in the current version",
    )
    p.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="an input that fails to read or decode: stop naming it (default), or leave it out and list it "
        "in OUT/skipped-inputs.jsonl",
    )
    p.add_argument("--labels", default=None, metavar="FILE",
                   help="image folder: labels file (CSV rows file,label or a JSON object file -> label); "
                   "SRC/labels.csv or labels.json are used when present")
    p.add_argument("--no-decode-check", action="store_true", help="do not decode every image fully while converting")
    p.add_argument("--decode", default=None, metavar="MODULE:FUNC",
                   help="ArrayRecord: a function of yours that turns a record's bytes into a dict of fields "
                   "(default: each record as the bytes field 'record')")
    p.add_argument("--fields", default=None, metavar="A,B,...",
                   help="WebDataset, TFRecord, MDS: the fields to keep, comma-separated (default: all)")
    p.add_argument("--jpeg-restart", action=argparse.BooleanOptionalAction, default=True,
                   help="image folder: store each JPEG re-encoded losslessly (same pixels) with restart markers (about "
                   "64-pixel column groups in every MCU row) and a restart index, so the image preset decodes only "
                   "the restart intervals a crop window covers "
                   "(default: on; --no-jpeg-restart stores the files' bytes as they are)")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local processes (default) or Ray Data tasks on a cluster (needs fastload[ray])")
    p.add_argument("--address", default=None, help="Ray cluster address for --engine ray (default: start Ray here)")
    p.set_defaults(func=_convert)

    p = sub.add_parser("inspect", help="print schema, counts, sizes and length histograms")
    p.add_argument("dataset")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad shard")
    p.add_argument("dataset")
    p.add_argument("--decode", action="store_true", help="also decode every image fully")
    p.set_defaults(func=_verify)

    p = sub.add_parser("bench", help="I/O throughput benchmark vs the PyTorch DataLoader and the raw limits")
    if command == "bench":
        from fastload.benchmark import add_arguments

        add_arguments(p)
    p.set_defaults(func=_bench)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in `argv` (the first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `fastload` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_command(argv)).parse_args(argv)
    args.argv = argv
    from fastload.formats.errors import FormatError, SchemaError

    try:
        return int(args.func(args) or 0)
    except (FormatError, SchemaError, OSError, ValueError, ImportError) as exc:
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
        print(f"fastload {args.command}: error: {exc}{notes}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"fastload {args.command}: {exc or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
