"""fastload on Ray Data: `write_ray` converts on a cluster; `FastloadDatasource` reads one (`fastload.read_ray`).

Conversion runs in two Ray Data passes over the same source:

1. plan (`ray_plan`): tasks encode chunks of samples and return their stored sizes (with
   `on_error="skip"`, also the inputs that fail to read); the driver cuts shards over the samples
   kept with the local writer's `cut_points`, so shard boundaries equal those of the local converter;
2. write: a `FastloadDatasink` gets one row per shard; each write task encodes that shard's samples
   with the local encoder and writes it with the local `write_shard` (temporary name, then rename;
   on an fsspec URL a single PUT of the finished file), so shards are byte-identical to a local run.

The driver writes `meta.bin` and then `index.json` last, in `on_write_complete`: a failed or
cancelled job leaves no directory that opens as a dataset. A progress file holds the settings and
the shard plan, so `resume=True` keeps every finished shard (each re-checked) and writes the rest.
A Ray task that dies is retried by Ray; it rewrites the same shard, so no sample is lost or doubled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

try:
    import ray
    import ray.data
    from ray.data.block import BlockAccessor, BlockMetadata
    from ray.data.datasource import Datasink, Datasource, ReadTask
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "fastload's Ray support needs Ray Data, which is not installed: pip install 'fastload[ray]'"
    ) from exc

from .errors import FormatError
from .manifest import BLOCKS_NAME, MANIFEST_NAME, META_NAME, Manifest
from .ray_plan import PathSource, Plan, RefSource, block_rows, plan_shards
from .schema import Schema
from .shard import ShardIdentity, ShardInfo, ShardReader, write_shard
from .storage import is_url
from .units import parse_size
from .writer import (
    DEFAULT_SHARD_SIZE,
    PROGRESS_NAME,
    dataset_id_for,
    fsync_path,
    kept_shard,
    pack_meta,
    shard_meta,
    shard_name,
    shard_table,
)

__all__ = ["FastloadDatasink", "FastloadDatasource", "RayWriteResult", "convert_ray", "write_ray"]

_TMP_MARK = ".part-"  # shards/<name>.part-<id>: a shard being written by one task attempt
_INFER_SAMPLES = 64
SKIP_REPORT_NAME = "skipped-inputs.jsonl"  # the inputs `on_error="skip"` left out, as the local `convert` names it


# ---------------------------------------------------------------- output location (local directory or fsspec URL)


@dataclass
class _Output:
    """Where the dataset goes: a local directory (fsync + rename) or an fsspec URL (one PUT per file)."""

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        """True for an fsspec URL, False for a local directory."""
        return is_url(self.root)

    def fs(self) -> Any:
        """The fsspec filesystem of a URL output."""
        import fsspec

        return fsspec.core.url_to_fs(self.root, **self.storage_options)[0]

    def path(self, name: str) -> str:
        """The path or URL of `name` under the output root."""
        return f"{self.root.rstrip('/')}/{name}" if self.remote else os.path.join(self.root, name)

    def exists(self, name: str) -> bool:
        """Whether `name` exists under the output root."""
        return self.fs().exists(self.path(name)) if self.remote else os.path.exists(self.path(name))

    def read(self, name: str) -> bytes | None:
        """The bytes of `name`, or None when it does not exist."""
        try:
            if self.remote:
                return self.fs().cat_file(self.path(name))
            with open(self.path(name), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write `name` whole: a local file through a temporary name, fsync and rename; a URL in one PUT."""
        if self.remote:
            self.fs().pipe_file(self.path(name), data)
            return
        tmp = f"{self.path(name)}{_TMP_MARK}{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path(name))

    def remove(self, name: str) -> None:
        """Delete `name` if it exists."""
        with contextlib.suppress(FileNotFoundError):
            if self.remote:
                self.fs().rm_file(self.path(name))
            else:
                os.remove(self.path(name))

    def shard_files(self) -> list[str]:
        """Names under shards/ (relative to the root)."""
        if self.remote:
            fs = self.fs()
            try:
                listing = fs.ls(self.path("shards"), detail=False)
            except FileNotFoundError:
                return []
            return [f"shards/{p.rstrip('/').rsplit('/', 1)[-1]}" for p in listing]
        d = self.path("shards")
        return [f"shards/{n}" for n in os.listdir(d)] if os.path.isdir(d) else []

    def prepare(self, *, resume: bool) -> None:
        """Make shards/ and drop the files of an earlier run unless resuming (then only partial ones)."""
        if not self.remote:
            os.makedirs(self.path("shards"), exist_ok=True)
        for name in self.shard_files():
            if not resume or _TMP_MARK in name or name.endswith(".tmp"):
                self.remove(name)

    def finish(self) -> None:
        """Partial files of failed attempts go; a local directory is fsynced."""
        for name in self.shard_files():
            if _TMP_MARK in name or name.endswith(".tmp"):
                self.remove(name)
        if not self.remote:
            fsync_path(self.path("shards"))


# ---------------------------------------------------------------- the sink


@dataclass(frozen=True)
class _ShardDone:
    k: int
    info: ShardInfo
    meta: dict[str, np.ndarray]
    table: bytes  # its block checksum table (`shard_table`), for blocks.bin
    node: str
    kept: bool  # a finished shard of an interrupted run, checked and kept


class FastloadDatasink(Datasink):
    """Writes the shards of a planned conversion, one input row per shard: `k`, its samples
    [`start`, `stop`) among those kept, and the source indices [`lo`, `hi`) they come from."""

    def __init__(
        self,
        *,
        source: Any,
        output: _Output,
        schema: Schema,
        plan: Plan,
        settings: dict[str, Any],
        resume: bool,
        attrs: dict[str, Any],
        dataset_id: int,
    ) -> None:
        self.source, self.output, self.schema = source, output, schema
        self.counts, self.skipped, self.bad = plan.counts, plan.skipped, plan.bad
        self.settings, self.resume, self.attrs = settings, resume, attrs
        self.dataset_id = dataset_id  # what the local converter records for the same settings
        self.manifest: Manifest | None = None
        self.done: list[_ShardDone] = []

    def get_name(self) -> str:
        """The name Ray Data shows for this sink."""
        return "Fastload"

    def on_write_start(self, schema: Any = None) -> None:
        """On the driver, before any task: clear (or, resuming, tidy) shards/ and record the plan."""
        self.output.prepare(resume=self.resume)
        self.output.put_bytes(PROGRESS_NAME, json.dumps(self.settings).encode())

    def write(self, blocks: Iterable[Any], ctx: Any) -> list[_ShardDone]:
        """In a Ray task: write (or, resuming, keep) the shard of each input row; one entry per shard."""
        node = ray.get_runtime_context().get_node_id()
        out = []
        for block in blocks:
            cols = BlockAccessor.for_block(block).to_numpy()
            for k, start, stop, lo, hi in zip(*(cols[c].tolist() for c in ("k", "start", "stop", "lo", "hi"))):
                out.append(self._shard(int(k), int(start), int(stop), int(lo), int(hi), node))
        return out

    def _shard(self, k: int, start: int, stop: int, lo: int, hi: int, node: str) -> _ShardDone:
        name = shard_name(k)
        identity = ShardIdentity(self.dataset_id, k, start)
        if self.resume:
            kept = self._kept(name, stop - start, identity)
            if kept is not None:
                return _ShardDone(k, *kept, node, True)
        if self.source.skipping:
            bad = self.bad[np.searchsorted(self.bad, lo) : np.searchsorted(self.bad, hi)]
            block = self.source.block_of(np.setdiff1d(np.arange(lo, hi), bad), first_index=start)
        else:
            block = self.source.block(start, stop)
        if block.num_samples != stop - start:
            raise FormatError(f"shard {k}: source gave {block.num_samples} samples for [{start}, {stop})")
        part = f"{_TMP_MARK}{uuid.uuid4().hex}"
        if not self.output.remote:
            final = self.output.path(name)
            info = write_shard(final + part, [block], self.schema, name=name, identity=identity)
            meta, table = self._sidecars(final + part, info, identity)
            os.replace(final + part, final)
            return _ShardDone(k, info, meta, table, node, False)
        with tempfile.TemporaryDirectory(prefix="fastload-ray-") as tmp:
            local = os.path.join(tmp, "shard.fls")
            info = write_shard(local, [block], self.schema, name=name, identity=identity)
            meta, table = self._sidecars(local, info, identity)
            self.output.fs().put_file(local, self.output.path(name))  # one PUT: the object appears whole
        return _ShardDone(k, info, meta, table, node, False)

    def _sidecars(
        self, path: str, info: ShardInfo, identity: ShardIdentity
    ) -> tuple[dict[str, np.ndarray], bytes]:
        """The shard's parts of meta.bin and blocks.bin (copies: the reader's views end with it)."""
        reader = ShardReader(path, self.schema, num_samples=info.num_samples, nbytes=info.bytes, identity=identity)
        try:
            return {key: np.array(v) for key, v in shard_meta(reader, self.schema).items()}, shard_table(reader)
        finally:
            reader.close()

    def _kept(
        self, name: str, n: int, identity: ShardIdentity
    ) -> tuple[ShardInfo, dict[str, np.ndarray], bytes] | None:
        """A finished shard of the interrupted run: kept when it is `identity` with `n` samples and
        every block checks out (`writer.kept_shard`, as the local converter's resume)."""
        if not self.output.exists(name):
            return None
        with tempfile.TemporaryDirectory(prefix="fastload-ray-") as tmp:
            path = self.output.path(name)
            if self.output.remote:
                path = os.path.join(tmp, "shard.fls")
                self.output.fs().get_file(self.output.path(name), path)
            info = kept_shard(path, self.schema, name=name, identity=identity)
            if info is None or info.num_samples != n:
                return None
            return (info, *self._sidecars(path, info, identity))

    def on_write_complete(self, write_result: Any) -> None:
        """On the driver, after every task: check one shard per plan entry, then write the skip
        report, `meta.bin`, `blocks.bin` and the manifest (last: only now does the directory open as a dataset)."""
        done = sorted((d for ret in write_result.write_returns for d in ret), key=lambda d: d.k)
        if [d.k for d in done] != list(range(len(self.counts))):
            ks = [d.k for d in done]
            missing = sorted(set(range(len(self.counts))) - set(ks))
            doubled = sorted({k for k in ks if ks.count(k) > 1})
            raise FormatError(f"{self.output.root}: write tasks returned shards missing {missing}, doubled {doubled}")
        for d in done:
            if d.info.num_samples != self.counts[d.k]:
                raise FormatError(f"{d.info.file}: {d.info.num_samples} samples, the plan says {self.counts[d.k]}")
        self.done = done
        infos = [d.info for d in done]
        meta, columns = pack_meta(self.schema, [d.meta for d in done])
        if self.skipped:
            lines = [json.dumps({"input": name, "reason": reason}) + "\n" for _, name, reason in self.skipped]
            self.output.put_bytes(SKIP_REPORT_NAME, "".join(lines).encode())
        else:
            self.output.remove(SKIP_REPORT_NAME)
        self.output.put_bytes(META_NAME, meta)
        self.output.put_bytes(BLOCKS_NAME, b"".join(d.table for d in done))
        self.output.finish()
        manifest = Manifest(
            schema=self.schema,
            shards=infos,
            meta_bytes=len(meta),
            meta_xxh3=xxhash.xxh3_64_hexdigest(meta),
            meta_columns=columns,
            attrs=dict(self.attrs),
            dataset_id=self.dataset_id,
            blocks_file=BLOCKS_NAME,
        )
        self.output.put_bytes(MANIFEST_NAME, manifest.dumps())
        self.output.remove(PROGRESS_NAME)
        if not self.output.remote:
            fsync_path(self.output.root)
        self.manifest = manifest

    def on_write_failed(self, error: Exception) -> None:
        """On the driver when a task failed for good: drop partial files; no manifest is written."""
        # Finished shards and the progress file stay for resume=True; no manifest is written.
        with contextlib.suppress(OSError):
            self.output.finish()


# ---------------------------------------------------------------- driver


@dataclass
class RayWriteResult:
    """What `write_ray` did: the manifest, shards per Ray node, how many shards a resume kept, the
    inputs left out (`(input, reason)`, with `on_error="skip"`) and where they are listed."""

    manifest: Manifest
    shards_per_node: dict[str, int]
    kept: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    report: str | None = None


@contextlib.contextmanager
def _data_context(*, progress: bool) -> Iterator[Any]:
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = progress
    try:
        yield ctx
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved


def _settings(schema: Schema, shard_size: int, source: Any, plan: Plan | None) -> dict[str, Any]:
    """What the progress file records: the settings a resume must match, and the plan it reuses."""
    return {"engine": "ray", "schema": schema.to_json(), "shard_size": shard_size, "num_samples": source.num_samples,
            "on_error": "skip" if source.skipping else "stop", "counts": plan.counts if plan else None,
            "skipped": [list(s) for s in plan.skipped] if plan else None}


def _recorded_plan(previous: dict[str, Any], num_samples: int) -> Plan | None:
    """The plan an interrupted run recorded, when it is well-formed for `num_samples` samples."""
    counts, skipped = previous.get("counts"), previous.get("skipped")
    if not isinstance(counts, list) or not all(isinstance(c, int) and c > 0 for c in counts):
        return None
    if not isinstance(skipped, list) or not all(
        isinstance(s, list) and len(s) == 3 and isinstance(s[0], int) and all(isinstance(t, str) for t in s[1:])
        for s in skipped
    ):
        return None
    bad = [s[0] for s in skipped]
    if bad != sorted(set(bad)) or (bad and not 0 <= bad[0] <= bad[-1] < num_samples):
        return None
    if sum(counts) != num_samples - len(bad):
        return None
    return Plan(list(counts), [(int(i), name, reason) for i, name, reason in skipped])


def _from_dataset(ds: Any, schema: Schema | None, attrs: dict[str, Any]) -> RefSource:
    # A Dataset runs with the DataContext it was made with: its blocks must come out in its order.
    options = ds.context.execution_options
    saved, options.preserve_order = options.preserve_order, True
    try:
        bundles = list(ds.materialize().iter_internal_ref_bundles())
    finally:
        options.preserve_order = saved
    refs, counts = [], []
    for bundle in bundles:
        for entry in bundle.blocks:
            ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
            if meta.num_rows:
                refs.append(ref)
                counts.append(int(meta.num_rows))
    if not refs:
        raise ValueError("the source is empty: nothing to convert")
    if schema is None:  # inferred from the first samples, as the local writer does
        head: list[dict[str, Any]] = []
        for ref, count in zip(refs, counts):
            take = min(count, _INFER_SAMPLES - len(head))
            head += block_rows(BlockAccessor.for_block(ray.get(ref)).slice(0, take))
            if len(head) >= _INFER_SAMPLES:
                break
        schema = Schema.infer(head)
    return RefSource(refs, counts, schema, attrs)


def write_ray(
    ds: Any,
    out: str | os.PathLike[str],
    *,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    schema: Schema | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    attrs: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    concurrency: int | None = None,
) -> RayWriteResult:
    """Write a `ray.data.Dataset` as a fastload dataset at `out`, in the Dataset's order.

    (`convert_ray` passes a `ray_plan.PathSource` of `fastload convert` here instead of a Dataset.)

    `out` is a local directory or an fsspec URL (`storage_options` go to fsspec). The shards equal
    those `fastload.formats.write` makes from the same samples in the same order with the same
    `shard_size`. `schema` is inferred from the first samples when omitted (pass it for images).
    `concurrency` caps the Ray tasks of each pass (default: Ray's choice).
    """
    shard_size = parse_size(shard_size)
    if shard_size < 4096:
        raise ValueError(f"shard_size must be at least 4096 bytes, got {shard_size}")
    output = _Output(os.fspath(out), dict(storage_options or {}))
    if output.exists(MANIFEST_NAME):
        if not overwrite:
            if resume:  # a finished run (possibly killed before removing its progress file)
                data = output.read(MANIFEST_NAME) or b""
                output.remove(PROGRESS_NAME)
                report = output.read(SKIP_REPORT_NAME)
                skipped = [(r["input"], r["reason"]) for r in map(json.loads, (report or b"").splitlines())]
                return RayWriteResult(Manifest.loads(data, where=output.path(MANIFEST_NAME)), {}, 0, skipped,
                                      output.path(SKIP_REPORT_NAME) if skipped else None)
            raise FileExistsError(
                f"{output.root} already holds a dataset; pass overwrite=True (--overwrite) to replace it"
            )
        output.remove(MANIFEST_NAME)
        if not output.remote and os.path.isdir(output.root):
            shutil.rmtree(output.root)
        resume = False
    with _data_context(progress=progress):
        try:
            return _write(ds, output, shard_size, schema, resume, attrs or {}, concurrency)
        finally:
            if isinstance(ds, PathSource):
                ds.forget()


def _write(
    ds: Any, output: _Output, shard_size: int, schema: Schema | None, resume: bool, attrs: dict[str, Any],
    concurrency: int | None,
) -> RayWriteResult:
    source = ds if isinstance(ds, PathSource) else _from_dataset(ds, schema, dict(attrs))
    if isinstance(ds, PathSource):
        attrs = {**ds.attrs, **attrs}
    schema = schema or source.schema
    source.schema = schema
    if source.num_samples == 0:
        raise ValueError("the source is empty: nothing to convert")
    plan = None
    if resume:
        recorded = output.read(PROGRESS_NAME)
        try:
            previous = json.loads(recorded) if recorded is not None else None
        except (ValueError, RecursionError):  # not JSON, or an integer of over 4300 digits
            previous = None
        if not isinstance(previous, dict):
            resume = False  # nothing says what the files there belong to: start over
        elif {**previous, "counts": None, "skipped": None} != _settings(schema, shard_size, source, None):
            raise FormatError(
                f"{output.root}: cannot resume: the interrupted conversion used other settings "
                "(engine/schema/shard size/sample count/on-error); remove the directory or use the same settings"
            )
        else:
            plan = _recorded_plan(previous, source.num_samples)
    if plan is None:
        plan = plan_shards(source, shard_size, concurrency=concurrency)
    kept_samples = sum(plan.counts)  # the local converter's sample count: the inputs left out are not in it
    sink = FastloadDatasink(
        source=source, output=output, schema=schema, plan=plan,
        settings=_settings(schema, shard_size, source, plan), resume=resume, attrs=attrs,
        dataset_id=dataset_id_for(schema, shard_size, kept_samples, attrs),
    )
    starts = np.concatenate([[0], np.cumsum(plan.counts)]).astype(np.int64)
    los = plan.source_index(starts[:-1])
    his = plan.source_index(starts[1:] - 1) + 1
    rows = [{"k": k, "start": int(starts[k]), "stop": int(starts[k + 1]), "lo": int(los[k]), "hi": int(his[k])}
            for k in range(len(plan.counts))]
    shards = ray.data.from_items(rows, override_num_blocks=len(rows))
    shards.write_datasink(sink, concurrency=concurrency)
    assert sink.manifest is not None
    per_node: dict[str, int] = {}
    for d in sink.done:
        if not d.kept:
            per_node[d.node] = per_node.get(d.node, 0) + 1
    skipped = [(name, reason) for _, name, reason in plan.skipped]
    return RayWriteResult(sink.manifest, per_node, sum(d.kept for d in sink.done), skipped,
                          output.path(SKIP_REPORT_NAME) if skipped else None)


def _connect(address: str | None) -> bool:
    """Join the cluster at `address` (or start a local one); True when this call started Ray."""
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    return True


def _ray_readable(src: str) -> bool:
    from .webdataset import is_webdataset

    if is_webdataset(src, list_urls=False):
        return False  # .tar shards: read by `PathSource` in the tasks (a URL folder: --kind webdataset)
    return is_url(src) or src.lower().endswith(".parquet") or (
        os.path.isdir(src) and any(n.lower().endswith(".parquet") for n in os.listdir(src))
    )


def convert_ray(
    src: str,
    out: str,
    *,
    kind: str | None = None,
    address: str | None = None,
    storage_options: dict[str, Any] | None = None,
    on_error: str = "stop",
    decode_check: bool = True,
    labels: str | None = None,
    fields: list[str] | None = None,
    decode: str | None = None,
    jpeg_restart: bool = True,
    **kwargs: Any,
) -> RayWriteResult:
    """`fastload convert --engine ray`: a local-converter source, or Parquet / JSON lines Ray Data reads.

    `on_error="skip"` leaves out the inputs that fail to read and lists them in
    `OUT/skipped-inputs.jsonl`, as `fastload convert --on-error=skip`; `decode_check=False` does not
    decode every image fully (`--no-decode-check`); `labels`: an image folder's labels file
    (`--labels`); `fields`: the fields to keep (`--fields`: WebDataset, TFRecord, MDS); `decode`: an
    ArrayRecord source's ``MODULE:FUNC`` plug-in (`--decode`), imported in each Ray task, so MODULE
    must be importable on every node (installed, or on the workers' PYTHONPATH);
    `jpeg_restart=False` stores an image folder's JPEGs as they are (`--no-jpeg-restart`). WebDataset
    shards at a URL are read by the tasks as the local converter reads them. Other keywords go to
    `write_ray`.
    """
    started = _connect(address)
    try:
        if kind is None and labels is None and fields is None and decode is None and _ray_readable(src):
            if on_error != "stop":
                raise ValueError(f"--on-error=skip applies to per-input sources, not {src} (read by Ray Data)")
            lower = src.lower().rstrip("/")
            if lower.endswith((".jsonl", ".json", ".ndjson")):
                ds = ray.data.read_json(src, lines=True, filesystem=_arrow_fs(src, storage_options))
            else:
                ds = ray.data.read_parquet(src, filesystem=_arrow_fs(src, storage_options))
            kwargs.setdefault("attrs", {"source": "ray"})
            return write_ray(ds, out, storage_options=storage_options, **kwargs)
        source = PathSource(src, kind, decode_check=decode_check, on_error=on_error, labels=labels, fields=fields,
                            decode=decode, jpeg_restart=jpeg_restart)
        return write_ray(source, out, storage_options=storage_options, **kwargs)
    finally:
        if started:
            ray.shutdown()


def _arrow_fs(src: str, storage_options: dict[str, Any] | None) -> Any:
    if not is_url(src) or not storage_options:
        return None
    import fsspec
    import pyarrow.fs

    fs = fsspec.core.url_to_fs(src, **storage_options)[0]
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


# ---------------------------------------------------------------- reading


class FastloadDatasource(Datasource):
    """A fastload dataset (directory or fsspec URL) as Ray read tasks, each reading whole shards.

    `opener(path, storage_options=...)` opens the dataset (in the driver and in each read task, so
    it must pickle by reference): `fastload.read_ray` passes `fastload.open_dataset`, which reads a
    URL through the shard cache; this layer does not know about the cache.
    """

    def __init__(self, path: str, *, opener: Callable[..., Any],
                 storage_options: dict[str, Any] | None = None) -> None:
        self.path, self.storage_options, self.opener = os.fspath(path), storage_options, opener
        ds = opener(self.path, storage_options=storage_options)
        try:
            self.bounds = [int(b) for b in ds.shard_boundaries]
            self.shard_bytes = [int(s.bytes) for s in ds.manifest.shards]
        finally:
            ds.close()

    def estimate_inmemory_data_size(self) -> int:
        """Bytes of the shards (what Ray Data plans memory with)."""
        return sum(self.shard_bytes)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """About `parallelism` read tasks, each reading a run of whole shards in order (at most one per shard)."""
        n = len(self.shard_bytes)
        groups = np.array_split(np.arange(n), max(1, min(parallelism, n)))
        tasks = []
        for group in groups:
            if not len(group):
                continue
            shards = group.tolist()
            rows = self.bounds[shards[-1] + 1] - self.bounds[shards[0]]
            meta = BlockMetadata(num_rows=rows, size_bytes=sum(self.shard_bytes[k] for k in shards),
                                 input_files=None, exec_stats=None)
            extra = {} if per_task_row_limit is None else {"per_task_row_limit": per_task_row_limit}
            tasks.append(ReadTask(self._reader(shards), meta, **extra))
        return tasks

    def _reader(self, shards: list[int]) -> Any:
        path, options, bounds, opener = self.path, self.storage_options, self.bounds, self.opener

        def read() -> Iterator[Any]:
            ds = opener(path, storage_options=options)
            try:
                for k in shards:
                    yield _to_ray_block(ds, bounds[k], bounds[k + 1], f"{path}: shard {k}")
            finally:
                ds.close()

        return read


def _to_ray_block(ds: Any, start: int, stop: int, where: str) -> Any:
    batch = ds.get_batch(np.arange(start, stop))
    columns: dict[str, Any] = {}
    for f in ds.schema:
        col = batch[f.name]
        if f.is_fixed:
            columns[f.name] = col
            continue
        try:
            items = col.to_list()
        except UnicodeDecodeError as exc:
            raise FormatError(
                f"{where}, field {f.name!r}: invalid UTF-8 (corrupt shard? run `fastload verify`)"
            ) from exc
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        columns[f.name] = arr
    return BlockAccessor.batch_to_block(columns)
