"""`write`: turn samples into a fastload dataset, atomically, deterministically, resumably.

- Shard boundaries depend only on the samples and `shard_size`, never on `workers` or timing,
  so the output is byte-identical for the same input and settings.
- Every file is written as `NAME.tmp`, fsynced and renamed; `index.json` is written last, so a
  crashed run never leaves a directory that opens as a dataset.
- `resume=True` keeps the consecutive run of finished shards from an interrupted run (checked
  against their own headers and the recorded settings) and continues after them; the result is
  identical to an uninterrupted run.
- Map-style sources are encoded in parallel worker processes; shards are written by a thread pool.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import xxhash

from .columns import Block, encode_samples, sample_label
from .errors import FormatError, SchemaError
from .layout import shard_name
from .manifest import BLOCKS_NAME, MANIFEST_NAME, META_NAME, Manifest, MetaColumn
from .resume import (
    COMMAND_KEY,
    PROGRESS_NAME,
    WriteInterrupted,
    incomplete_conversion,
    kept_shard,
    prepare_out_dir,
    resume_point,
    stopped_hint,
)
from .schema import Schema
from .shard import ShardIdentity, ShardInfo, ShardReader, write_shard
from .units import parse_size

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "PROGRESS_NAME",
    "BlockSource",
    "WriteInterrupted",
    "cut_points",
    "dataset_id_for",
    "fsync_path",
    "incomplete_conversion",
    "kept_describer",
    "kept_shard",
    "pack_meta",
    "shard_meta",
    "shard_name",
    "shard_table",
    "source_describer",
    "write",
]

DEFAULT_SHARD_SIZE = 64 << 20
_ENCODE_CHUNK = 512
_INFER_SAMPLES = 64  # samples looked at when inferring a schema


@dataclass
class BlockSource:
    """A columnar source: `schema`, `num_samples`, and `blocks(start)` yielding Blocks from sample `start` on.

    `block(start, stop)`, when given, returns samples [start, stop) as one Block (random access);
    `describe(i)`, when given, names the input sample `i` comes from (a file, a file and row), for
    error messages, as a map-style source's `describe` method does.
    """

    schema: Schema
    num_samples: int
    blocks: Any  # Callable[[int], Iterator[Block]]
    attrs: dict[str, Any] | None = None
    block: Any = None  # Callable[[int, int], Block] | None
    describe: Any = None  # Callable[[int], str] | None


_shard_name = shard_name


def source_describer(source: Any) -> Callable[[int], str] | None:
    """The source's `describe(i)` (what input sample `i` comes from: a file, a line), if it has one."""
    describe = getattr(source, "describe", None)
    return describe if callable(describe) else None


def _describe_kept(describe: Callable[[int], str], kept: Any, first: int, i: int) -> str:
    return describe(int(kept[i - first]))


def kept_describer(describe: Callable[[int], str] | None, kept: Any, first: int = 0) -> Callable[[int], str] | None:
    """`describe` for samples numbered among those kept: sample `i` is source sample `kept[i - first]`
    (inputs left out by `on_error="skip"`); picklable, None without `describe`."""
    return None if describe is None else partial(_describe_kept, describe, kept, first)


_WORKER_SOURCE: tuple[Any, Schema] | None = None


def _set_worker_source(dataset: Any, schema: Schema) -> None:
    global _WORKER_SOURCE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: no worker tracebacks
    _WORKER_SOURCE = (dataset, schema)


def _encode_range(bounds: tuple[int, int]) -> Block:
    assert _WORKER_SOURCE is not None
    dataset, schema = _WORKER_SOURCE
    start, stop = bounds
    return encode_samples(
        [dataset[i] for i in range(start, stop)], schema, first_index=start, describe=source_describer(dataset)
    )


def _iter_dict_blocks(samples: Iterable[dict[str, Any]], schema: Schema, start: int) -> Iterator[Block]:
    """Blocks from an iterable of dicts, skipping the first `start` samples (resume)."""
    it = iter(samples)
    for _ in range(start):
        if next(it, None) is None:
            return
    chunk: list[dict[str, Any]] = []
    index = start
    for sample in it:
        chunk.append(sample)
        if len(chunk) == _ENCODE_CHUNK:
            yield encode_samples(chunk, schema, first_index=index)
            index += len(chunk)
            chunk = []
    if chunk:
        yield encode_samples(chunk, schema, first_index=index)


def _iter_dataset_blocks(dataset: Any, schema: Schema, start: int, workers: int) -> Iterator[Block]:
    """Blocks from a map-style dataset, encoded in worker processes, in order."""
    n = len(dataset)
    ranges = [(s, min(s + _ENCODE_CHUNK, n)) for s in range(start, n, _ENCODE_CHUNK)]
    if workers <= 1 or len(ranges) <= 1:
        describe = source_describer(dataset)
        for s, e in ranges:
            yield encode_samples([dataset[i] for i in range(s, e)], schema, first_index=s, describe=describe)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_set_worker_source, initargs=(dataset, schema)) as pool:
        yield from pool.imap(_encode_range, ranges, chunksize=1)


class _ShardCutter:
    """Accumulates blocks and cuts them into shards of at most `shard_size` bytes at sample boundaries."""

    def __init__(self, schema: Schema, shard_size: int, describe: Callable[[int], str] | None = None) -> None:
        self.schema, self.shard_size, self.describe = schema, shard_size, describe
        self.pending: list[Block] = []
        self.pending_bytes = 0
        self.total_bytes = 0  # bytes of every sample added so far (progress MB/s)

    def add(self, block: Block, first_index: int) -> Iterator[list[Block]]:
        sizes = block.sample_bytes(self.schema)
        self.total_bytes += int(sizes.sum())
        cuts, pending = cut_points(
            sizes, self.shard_size, pending_bytes=self.pending_bytes, first_index=first_index, describe=self.describe
        )
        pos = 0
        for cut in cuts:
            if cut > pos:
                self.pending.append(block.slice(pos, cut))
            pos = cut
            yield self.flush()
        if pos < block.num_samples:
            self.pending.append(block.slice(pos, block.num_samples) if pos else block)
        self.pending_bytes = pending

    def flush(self) -> list[Block]:
        out, self.pending, self.pending_bytes = self.pending, [], 0
        return out


def cut_points(
    sizes: np.ndarray,
    shard_size: int,
    *,
    pending_bytes: int = 0,
    first_index: int = 0,
    describe: Callable[[int], str] | None = None,
) -> tuple[list[int], int]:
    """Where `write` cuts shards in a run of samples with stored `sizes` (as `Block.sample_bytes` gives).

    `pending_bytes` are already in the open shard. Returns the positions in `sizes` at which a shard
    closes (samples before the position go in it) and the bytes left in the open shard. A sample
    larger than a shard is an error naming it (`sample_label`, with the source's `describe`).
    """
    too_big = np.flatnonzero(sizes > shard_size)
    if too_big.size:
        i = int(too_big[0])
        raise SchemaError(
            f"{sample_label(first_index + i, describe)} is {int(sizes[i])} bytes, larger than the shard size "
            f"{shard_size}: raise --shard-size"
        )
    cuts: list[int] = []
    pos, n = 0, len(sizes)
    while pos < n:
        cum = np.cumsum(sizes[pos:]) + pending_bytes
        fit = int(np.searchsorted(cum, shard_size, side="right"))
        if fit == n - pos:
            return cuts, int(cum[-1])
        pos += fit
        cuts.append(pos)
        pending_bytes = 0
    return cuts, pending_bytes


def _settings(schema: Schema, shard_size: int, num_samples: int | None) -> dict[str, Any]:
    return {"schema": schema.to_json(), "shard_size": shard_size, "num_samples": num_samples}


def _dataset_id(settings: dict[str, Any], attrs: dict[str, Any]) -> int:
    """The id every shard header records: a function of the settings, so output stays deterministic."""
    return xxhash.xxh3_64_intdigest(json.dumps([settings, attrs], sort_keys=True, default=str).encode())


def dataset_id_for(schema: Schema, shard_size: int, num_samples: int | None, attrs: dict[str, Any]) -> int:
    """The dataset id `write` records for these settings (other engines use it to write the same bytes)."""
    return _dataset_id(_settings(schema, shard_size, num_samples), dict(attrs))


def shard_meta(reader: ShardReader, schema: Schema) -> dict[str, np.ndarray]:
    """One shard's part of meta.bin: per-sample lengths of variable fields and image sizes."""
    out = {}
    for f in schema:
        if not f.is_fixed:
            out[f"{f.name}.length"] = np.diff(reader.ragged[f.name][0]).astype("<i8")
        if f.kind == "image":
            out[f"{f.name}.hw"] = np.array(reader.image_hw[f.name], dtype="<u4")
    return out


def pack_meta(schema: Schema, parts: list[dict[str, np.ndarray]]) -> tuple[bytes, list[MetaColumn]]:
    """meta.bin's bytes and column table from every shard's `shard_meta`, in shard order."""
    columns, chunks, offset = [], [], 0
    for f in schema:
        for key in ([f"{f.name}.length"] if not f.is_fixed else []) + ([f"{f.name}.hw"] if f.kind == "image" else []):
            pieces = [p[key] for p in parts if key in p] or [
                np.zeros((0, 2) if key.endswith(".hw") else 0, "<u4" if key.endswith(".hw") else "<i8")
            ]
            arr = np.ascontiguousarray(np.concatenate(pieces))
            columns.append(MetaColumn(name=key, dtype=arr.dtype.str, shape=arr.shape, offset=offset))
            chunks.append(arr.tobytes())
            offset += arr.nbytes
    return b"".join(chunks), columns


def shard_table(reader: ShardReader) -> bytes:
    """One shard's part of blocks.bin: its block checksum table as the shard holds it (b"" for version 1)."""
    return b"" if reader.table is None else reader.table.tobytes()


def _sidecars_from_shards(
    out_dir: str, schema: Schema, shards: list[ShardInfo]
) -> tuple[bytes, list[MetaColumn], bytes]:
    """meta.bin (per-sample lengths and image sizes, from the shards' offset tables) and its column
    table, and blocks.bin (the shards' block checksum tables), read back from the written shards."""
    parts, tables = [], []
    for info in shards:
        reader = ShardReader(os.path.join(out_dir, info.file), schema, num_samples=info.num_samples, nbytes=info.bytes)
        try:
            parts.append(shard_meta(reader, schema))
            tables.append(shard_table(reader))
        finally:
            reader.close()
    meta, columns = pack_meta(schema, parts)
    return meta, columns, b"".join(tables)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_path(path: str) -> None:
    """fsync a file or directory by path (a directory after renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Plan:
    """What one `write` call converts: the source in its final form and the settings it records."""

    source: Any
    schema: Schema
    num_samples: int | None
    is_map: bool
    attrs: dict[str, Any]
    shard_size: int

    @property
    def settings(self) -> dict[str, Any]:
        return _settings(self.schema, self.shard_size, self.num_samples)

    @property
    def dataset_id(self) -> int:
        return _dataset_id(self.settings, self.attrs)


def write(
    source: Any,
    out_dir: str | os.PathLike[str],
    *,
    schema: Schema | None = None,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    workers: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    attrs: dict[str, Any] | None = None,
    resume_command: str | None = None,
) -> Manifest:
    """Write `source` as a fastload dataset in `out_dir` and return its manifest.

    `source`: a `BlockSource`, a map-style dataset (``len`` + ``__getitem__`` returning dicts; encoded
    in `workers` processes) or any iterable of dicts. `schema` is inferred from the first samples when
    omitted (pass it for image fields: raw bytes infer as ``bytes``).

    An `out_dir` holding an interrupted conversion is continued with `resume=True` or replaced with
    `overwrite=True`; without either, `write` refuses (`FileExistsError`). A write that fails or is
    interrupted keeps its finished shards, writes no manifest (so `out_dir` never opens as a dataset),
    and says in its error how to continue: `resume_command` (what the CLI passes), or a `write` call.
    """
    out_dir = os.fspath(out_dir)
    shard_size = parse_size(shard_size)
    if shard_size < 4096:
        raise ValueError(f"shard_size must be at least 4096 bytes, got {shard_size}")
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    finished = prepare_out_dir(out_dir, resume=resume, overwrite=overwrite)
    if finished is not None:
        return finished
    plan = _plan(source, schema, attrs, shard_size)
    os.makedirs(os.path.join(out_dir, "shards"), exist_ok=True)
    kept = resume_point(out_dir, plan.settings, plan.schema, plan.dataset_id) if resume else []
    if not resume:
        for name in os.listdir(os.path.join(out_dir, "shards")):
            os.remove(os.path.join(out_dir, "shards", name))
    command = resume_command or f"write(..., {out_dir!r}, resume=True)"
    _write_atomic(os.path.join(out_dir, PROGRESS_NAME), json.dumps({**plan.settings, COMMAND_KEY: command}).encode())
    try:
        infos = _write_shards(plan, out_dir, kept, workers, progress)
        return _finish(out_dir, plan, infos)
    except KeyboardInterrupt:
        raise WriteInterrupted(f"interrupted: {stopped_hint(out_dir, command)}") from None
    except Exception as exc:
        exc.add_note(stopped_hint(out_dir, command))
        raise


def _plan(source: Any, schema: Schema | None, attrs: dict[str, Any] | None, shard_size: int) -> _Plan:
    """The source in the form `write` reads (HF datasets as columns), its schema (inferred from the
    first samples when not given) and sample count (None for a plain iterable)."""
    from .hf_datasets import hf_block_source, is_hf_dataset  # (imports this module)

    if is_hf_dataset(source):
        source = hf_block_source(source)  # fixed-shape columns stay fixed fields with their dtypes
    is_map = isinstance(source, BlockSource) or (hasattr(source, "__len__") and hasattr(source, "__getitem__"))
    num_samples = source.num_samples if isinstance(source, BlockSource) else (len(source) if is_map else None)
    if isinstance(source, BlockSource):
        schema = schema or source.schema
        attrs = {**(source.attrs or {}), **(attrs or {})}
    elif schema is None:
        if is_map:
            head = [source[i] for i in range(min(_INFER_SAMPLES, num_samples or 0))]
        else:
            source = iter(source)
            head = list(itertools.islice(source, _INFER_SAMPLES))
            source = itertools.chain(head, source)
        if not head:
            raise ValueError("the source is empty: nothing to convert")
        schema = Schema.infer(head)
    if num_samples == 0:
        raise ValueError("the source is empty: nothing to convert")
    return _Plan(source, schema, num_samples, is_map, dict(attrs or {}), shard_size)


def _source_blocks(plan: _Plan, start: int, workers: int) -> Iterator[Block]:
    if isinstance(plan.source, BlockSource):
        return plan.source.blocks(start)
    if plan.is_map:
        return _iter_dataset_blocks(plan.source, plan.schema, start, workers)
    return _iter_dict_blocks(plan.source, plan.schema, start)


def _write_shards(plan: _Plan, out_dir: str, kept: list[ShardInfo], workers: int, progress: bool) -> list[ShardInfo]:
    """Cut the source's blocks into shards and write them on a thread pool, after the `kept` ones."""
    start = sum(s.num_samples for s in kept)
    blocks = _source_blocks(plan, start, workers)
    bar = _progress(progress, plan.num_samples, start)
    shards: list[ShardInfo | Future[ShardInfo]] = list(kept)
    cutter = _ShardCutter(plan.schema, plan.shard_size, source_describer(plan.source))
    index, first, t0 = start, start, time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=workers)

    def submit(parts: list[Block]) -> None:
        nonlocal first
        k = len(shards)
        identity = ShardIdentity(plan.dataset_id, k, first)
        first += sum(b.num_samples for b in parts)
        path = os.path.join(out_dir, _shard_name(k))
        shards.append(pool.submit(write_shard, path, parts, plan.schema, name=_shard_name(k), identity=identity))

    try:
        for block in blocks:
            for parts in cutter.add(block, index):
                submit(parts)
            index += block.num_samples
            if bar is not None:
                bar.update(block.num_samples)
                bar.set_postfix(MBps=f"{cutter.total_bytes / 1e6 / max(time.perf_counter() - t0, 1e-9):.0f}")
        if cutter.pending:
            submit(cutter.flush())
        infos = [s.result() if isinstance(s, Future) else s for s in shards]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        getattr(blocks, "close", lambda: None)()  # ends encoder processes now, not at garbage collection
        if bar is not None:
            bar.close()
    if not infos or sum(s.num_samples for s in infos) == 0:
        raise ValueError("the source is empty: nothing to convert")
    if plan.num_samples is not None and index != plan.num_samples:
        raise FormatError(f"source yielded {index} samples but its length is {plan.num_samples}")
    return infos


def _finish(out_dir: str, plan: _Plan, infos: list[ShardInfo]) -> Manifest:
    """Write meta.bin and blocks.bin, then the manifest (last: only now does `out_dir` open), then drop
    the progress file."""
    meta, columns, tables = _sidecars_from_shards(out_dir, plan.schema, infos)
    _write_atomic(os.path.join(out_dir, META_NAME), meta)
    _write_atomic(os.path.join(out_dir, BLOCKS_NAME), tables)
    manifest = Manifest(
        schema=plan.schema,
        shards=infos,
        meta_bytes=len(meta),
        meta_xxh3=xxhash.xxh3_64_hexdigest(meta),
        meta_columns=columns,
        attrs=plan.attrs,
        dataset_id=plan.dataset_id,
        blocks_file=BLOCKS_NAME,
    )
    fsync_path(os.path.join(out_dir, "shards"))
    _write_atomic(os.path.join(out_dir, MANIFEST_NAME), manifest.dumps())
    os.remove(os.path.join(out_dir, PROGRESS_NAME))
    fsync_path(out_dir)
    return manifest


def _progress(enabled: bool, total: int | None, initial: int) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="samples", unit_scale=True, desc="convert", smoothing=0.1)
