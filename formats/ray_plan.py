"""The plan pass of `write_ray`: the sources Ray tasks read, and shard cuts equal to the local writer's.

Plan tasks read chunks of samples and return their stored sizes (and, with ``on_error="skip"``, the
inputs that fail to read, as `sources.SkipBadInputs` finds them); the driver cuts shards over the
samples kept with the local writer's `cut_points`. A chunk that fails is read again on the driver,
in the local writer's own chunks, so the error raised is the one `fastload convert` raises.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import ray
import ray.data
from ray.data.block import BlockAccessor

from .columns import Block, encode_samples
from .errors import FormatError, SchemaError
from .schema import Schema
from .writer import BlockSource, cut_points, kept_describer, source_describer

__all__ = ["Plan", "plan_shards"]

_PLAN_CHUNK_MIN, _PLAN_CHUNK_MAX = 512, 8192  # samples per plan-pass chunk (8192: a columnar source's block)
_LOCAL_CHUNK = 512  # samples per encode chunk of the local writer (writer._ENCODE_CHUNK)
ERRORS = (FormatError, SchemaError, ValueError, FileNotFoundError, FileExistsError)  # a bad input stops the job
_SKIP_ERRORS = (SchemaError, FormatError, OSError, ValueError)  # what `SkipBadInputs` leaves out


class PathSource:
    """A source the local converter opens (`open_source`), reopened once per job in each Ray worker.

    Workers outlive jobs, so the open copy is keyed by this object's token: a later job over the same
    path (perhaps changed since) opens it afresh. `on_error="skip"` leaves out the inputs that fail
    to read, as `--on-error=skip` does locally (per-input sources only); `labels` is an image
    folder's labels file (`--labels`), read again by each worker as the local converter reads it;
    `fields` the fields to keep (`--fields`: WebDataset, TFRecord, MDS); `decode` an ArrayRecord
    source's ``MODULE:FUNC`` plug-in (`--decode`), resolved in each worker that opens the source.
    `jpeg_restart`: an image folder's JPEGs get restart markers (`--jpeg-restart`, the default).
    """

    _opened: ClassVar[dict[str, Any]] = {}  # token -> the open source; one entry per process

    def __init__(
        self, src: str, kind: str | None, *, decode_check: bool = True, on_error: str = "stop",
        labels: str | None = None, fields: list[str] | None = None, decode: str | None = None,
        jpeg_restart: bool = True,
    ) -> None:
        if on_error not in ("stop", "skip"):
            raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
        self.src, self.kind, self.decode_check, self.labels = src, kind, decode_check, labels
        self.fields, self.decode = fields, decode
        self.jpeg_restart = jpeg_restart
        self.token = uuid.uuid4().hex
        source, schema, attrs = self._open()
        if schema is None:  # pragma: no cover - every source kind names its schema
            raise SchemaError(f"{src}: the source has no schema")
        if on_error == "skip" and isinstance(source, BlockSource):
            from .sources import skip_refusal

            raise ValueError(skip_refusal(src, dict(attrs)))
        self.skipping = on_error == "skip"
        self.schema, self.attrs = schema, dict(attrs)
        self.num_samples = _length(source)
        self._opened.clear()
        self._opened[self.token] = source

    def forget(self) -> None:
        """Drop this process's open copy of the source (the driver's, once the job is done)."""
        self._opened.pop(self.token, None)

    def _source(self) -> Any:
        if self.token not in self._opened:
            source = self._open()[0]
            if _length(source) != self.num_samples:
                raise FormatError(
                    f"{self.src}: {_length(source)} samples on this node, {self.num_samples} when the job was planned "
                    "(the source changed, or differs between nodes)"
                )
            self._opened.clear()
            self._opened[self.token] = source
        return self._opened[self.token]

    def _open(self) -> tuple[Any, Schema | None, dict[str, Any]]:
        from .sources import open_source

        return open_source(self.src, self.kind, decode_check=self.decode_check, labels=self.labels,
                           decode=self.decode, fields=self.fields, jpeg_restart=self.jpeg_restart)

    def sample(self, i: int) -> dict[str, Any]:
        """Sample `i` as a dict (per-input sources)."""
        return self._source()[i]

    def probe(self, start: int, stop: int) -> tuple[list[dict[str, Any]], list[tuple[int, str, str]]]:
        """Samples [start, stop) that read, and `(index, input, reason)` for each that does not."""
        source = self._source()
        describe = getattr(source, "describe", None)
        rows, bad = [], []
        for i in range(start, stop):
            try:
                rows.append(source[i])
            except _SKIP_ERRORS as exc:
                bad.append((i, describe(i) if describe else f"sample {i}", str(exc)))
        return rows, bad

    def block(self, start: int, stop: int) -> Block:
        """Samples [start, stop) encoded as a Block."""
        source = self._source()
        if not isinstance(source, BlockSource):
            rows = [source[i] for i in range(start, stop)]
            return encode_samples(rows, self.schema, first_index=start, describe=source_describer(source))
        if source.block is not None:
            return source.block(start, stop)
        parts, pos = [], start
        for b in source.blocks(start):
            take = min(b.num_samples, stop - pos)
            parts.append(b if take == b.num_samples else b.slice(0, take))
            pos += take
            if pos >= stop:
                break
        if pos != stop:
            raise FormatError(f"{self.src}: source ended at sample {pos}, expected {stop} samples")
        return _concat(parts, self.schema)

    def block_of(self, indices: np.ndarray, *, first_index: int) -> Block:
        """The samples at `indices` (a shard with inputs left out), numbered from `first_index` in errors."""
        source = self._source()
        describe = kept_describer(source_describer(source), indices, first_index)
        return encode_samples(
            [source[int(i)] for i in indices], self.schema, first_index=first_index, describe=describe
        )

    def describer(self, kept: np.ndarray | None = None) -> Callable[[int], str] | None:
        """What names sample i in errors, as the local writer names it: the source's `describe`, of
        source sample `kept[i]` when inputs were left out."""
        describe = source_describer(self._source())
        return describe if kept is None else kept_describer(describe, kept)


def _length(source: Any) -> int:
    return source.num_samples if isinstance(source, BlockSource) else len(source)


def _concat(parts: list[Block], schema: Schema) -> Block:
    if len(parts) == 1:
        return parts[0]
    from .ragged import Ragged

    cols: dict[str, Any] = {}
    for f in schema:
        cs = [p.columns[f.name] for p in parts]
        if isinstance(cs[0], Ragged):
            offsets, base = [np.zeros(1, np.int64)], 0
            for c in cs:
                offsets.append(np.asarray(c.offsets[1:], np.int64) - int(c.offsets[0]) + base)
                base += int(c.offsets[-1] - c.offsets[0])
            values = np.concatenate([c.values[int(c.offsets[0]) : int(c.offsets[-1])] for c in cs])
            cols[f.name] = Ragged(values, np.concatenate(offsets), cs[0].kind)
        else:
            cols[f.name] = np.concatenate(cs)
    hw = {name: np.concatenate([p.image_hw[name] for p in parts]) for name in parts[0].image_hw}
    return Block(sum(p.num_samples for p in parts), cols, hw)


class RefSource:
    """A materialized `ray.data.Dataset`: its blocks in order, read in tasks as sample dicts and encoded."""

    skipping = False

    def __init__(self, refs: list[Any], counts: list[int], schema: Schema, attrs: dict[str, Any]) -> None:
        self.refs, self.schema, self.attrs = refs, schema, attrs
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_samples = int(self.starts[-1])

    def rows(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Samples [start, stop) as dicts of numpy values."""
        out: list[dict[str, Any]] = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for k in range(first, len(self.refs)):
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            if lo >= stop:
                break
            a, b = max(start, lo) - lo, min(stop, hi) - lo
            if a >= b:
                continue
            block = ray.get(self.refs[k])
            out += block_rows(BlockAccessor.for_block(block).slice(a, b, copy=False))
        return out

    def sample(self, i: int) -> dict[str, Any]:
        """Sample `i` as a dict."""
        return self.rows(i, i + 1)[0]

    def block(self, start: int, stop: int) -> Block:
        """Samples [start, stop) encoded as a Block."""
        return encode_samples(self.rows(start, stop), self.schema, first_index=start)


def block_rows(block: Any) -> list[dict[str, Any]]:
    """Rows of a Ray block as dicts of numpy values (binary -> bytes, lists -> 1-D arrays)."""
    columns = BlockAccessor.for_block(block).to_numpy()
    if not isinstance(columns, dict):
        columns = {"item": columns}
    n = len(next(iter(columns.values()))) if columns else 0
    return [{name: _plain(col[i]) for name, col in columns.items()} for i in range(n)]


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray) and v.dtype == object:
        return np.asarray(list(v))
    return v


# ---------------------------------------------------------------- the plan pass


@dataclass(frozen=True)
class Plan:
    """Samples per shard (over the kept samples) and the inputs left out, `(index, input, reason)`."""

    counts: list[int]
    skipped: list[tuple[int, str, str]]

    @property
    def bad(self) -> np.ndarray:
        """Source indices of the inputs left out, ascending."""
        return np.array([i for i, _, _ in self.skipped], dtype=np.int64)

    def source_index(self, kept: np.ndarray) -> np.ndarray:
        """Source indices of positions `kept` among the kept samples."""
        bad = self.bad
        return kept + np.searchsorted(bad - np.arange(len(bad)), kept, side="right")


def _chunk_task(source: Any, schema: Schema) -> Callable[[dict[str, np.ndarray]], dict[str, Any]]:
    def sizes(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        # An error is returned, not raised (Ray would keep only its text): the driver reads the first
        # failing chunk again and raises the error the local converter stops at.
        n = len(batch["start"])
        out, bad, errors = np.empty(n, dtype=object), np.full(n, "[]", dtype=object), np.full(n, "", dtype=object)
        for j, (s, e) in enumerate(zip(batch["start"].tolist(), batch["stop"].tolist())):
            out[j] = np.zeros(0, np.int64)
            try:
                if source.skipping:
                    rows, skipped = source.probe(s, e)
                    bad[j] = json.dumps(skipped)
                    block = encode_samples(rows, schema, first_index=s) if rows else None
                else:
                    block = source.block(s, e)
                if block is not None:
                    out[j] = block.sample_bytes(schema)
            except ERRORS as exc:
                errors[j] = f"{type(exc).__name__}: {exc}"
        return {"start": batch["start"], "sizes": out, "bad": bad, "error": errors}

    return sizes


def plan_shards(source: Any, shard_size: int, *, concurrency: int | None) -> Plan:
    """Shard sample counts cut as the local `write` cuts them (a Ray pass computing stored sizes)."""
    n = source.num_samples
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    step = min(_PLAN_CHUNK_MAX, max(_PLAN_CHUNK_MIN, -(-n // (4 * cpus))))  # ~4 chunks per CPU
    chunks = [(s, min(s + step, n)) for s in range(0, n, step)]
    items = [{"start": s, "stop": e} for s, e in chunks]
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 256)))
    rows = ds.map_batches(
        _chunk_task(source, source.schema), batch_size=None, batch_format="numpy", concurrency=concurrency
    ).take_all()
    rows.sort(key=lambda r: int(r["start"]))
    if [int(r["start"]) for r in rows] != [s for s, _ in chunks]:
        raise FormatError("the plan pass lost or repeated chunks of samples")
    skipped: list[tuple[int, str, str]] = []
    sizes: list[np.ndarray] = []
    for (s, e), r in zip(chunks, rows):
        skipped += [(int(i), str(name), str(reason)) for i, name, reason in json.loads(str(r["bad"]))]
        if r["error"]:
            _raise_first_error(source, Plan([], skipped), np.concatenate([np.zeros(0, np.int64), *sizes]),
                               (s, e), shard_size, str(r["error"]))
        sizes.append(np.asarray(r["sizes"], dtype=np.int64))
    all_sizes = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    if len(all_sizes) == 0:
        raise ValueError("the source is empty: nothing to convert")
    kept = np.setdiff1d(np.arange(n, dtype=np.int64), Plan([], skipped).bad) if skipped else None
    cuts, _ = cut_points(all_sizes, shard_size, describe=_describer(source, kept))
    bounds = [0, *cuts, len(all_sizes)]
    return Plan([b - a for a, b in zip(bounds, bounds[1:]) if b > a], skipped)


def _describer(source: Any, kept: np.ndarray | None) -> Callable[[int], str] | None:
    """What names sample i in the local writer's errors (`PathSource.describer`; None for Ray datasets)."""
    return source.describer(kept) if isinstance(source, PathSource) else None


def _raise_first_error(
    source: Any, plan: Plan, sizes: np.ndarray, chunk: tuple[int, int], shard_size: int, text: str
) -> None:
    """Raise the error the local writer meets first, given that chunk `chunk` failed on a worker.

    `sizes` are the stored sizes of the kept samples before the chunk, `plan.skipped` the inputs
    left out up to the chunk's end. The local writer encodes in chunks of 512 kept samples and cuts
    shards in order, so the samples are read again here in those chunks."""
    start, stop = chunk
    bad = plan.bad
    kept = np.setdiff1d(np.arange(stop, dtype=np.int64), bad)
    describe = _describer(source, kept if len(bad) else None)
    cut_points(sizes, shard_size, describe=describe)  # a sample too big before the chunk: local stops there first
    if isinstance(source, PathSource) and isinstance(source._source(), BlockSource):
        source.block(start, stop)  # a columnar source: the same read fails here
    else:
        first = len(sizes) - len(sizes) % _LOCAL_CHUNK
        for a in range(first, len(kept), _LOCAL_CHUNK):
            b = min(a + _LOCAL_CHUNK, len(kept))
            block = source.block_of(kept[a:b], first_index=a) if len(bad) else source.block(a, b)
            cut_points(block.sample_bytes(source.schema), shard_size, first_index=a, describe=describe)
    raise FormatError(f"samples [{start}, {stop}) failed on a Ray worker and read correctly here: {text}")
