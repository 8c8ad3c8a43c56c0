"""Source kinds that `fastload convert` reads: image folders, numpy arrays, JSON lines, LMDB, HDF5,
and other loaders' formats (WebDataset tar shards, TFRecord, MosaicML Streaming MDS).

Each `open_source` result is something `write()` accepts: a `BlockSource` for columnar sources
(npy, HDF5 — no per-sample Python), or a map-style dataset of sample dicts (image folders, JSON
lines, LMDB) that `write()` encodes in worker processes.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .columns import Block, sample_label
from .errors import FormatError, SchemaError
from .image_folder import ImageFolder, check_image, is_image
from .megatron import megatron_paths
from .migrate_sources import MIGRATE_KINDS, detect_migrate_kind, open_migrate_source
from .npy_files import is_column_folder
from .schema import Field, Schema, infer_field
from .writer import BlockSource, kept_describer, source_describer

__all__ = [
    "SOURCE_KINDS",
    "ImageFolder",
    "JsonLines",
    "SkipBadInputs",
    "check_image",
    "decode_images",
    "detect_kind",
    "open_source",
    "skip_refusal",
]

SOURCE_KINDS = (
    "imagefolder", "npy", "npyfiles", "tokens", "megatron", "jsonl", "lmdb", "hdf5", "hf", "parquet", "fastload",
    "webdataset", "tfrecord", "mds",
    *MIGRATE_KINDS,
)
FIELD_KINDS = ("webdataset", "tfrecord", "mds")  # the kinds whose fields `--fields` can pick
_BLOCK_ROWS = 8192
_FILE_KINDS = (
    ("npy", (".npy",)),
    ("jsonl", (".jsonl", ".json", ".ndjson")),
    ("hdf5", (".h5", ".hdf5", ".hdf")),
    ("lmdb", (".mdb",)),
    ("parquet", (".parquet",)),
    ("megatron", (".bin", ".idx")),
    ("tfrecord", (".tfrecord", ".tfrecords", ".tfrec")),
)


def detect_kind(src: str) -> str:
    """Guess the source kind from the path; raise naming the path when it cannot."""
    migrated = detect_migrate_kind(src)
    if migrated is not None:
        return migrated
    from .webdataset import is_webdataset

    if is_webdataset(src):
        return "webdataset"  # .tar shards: a file, a directory, a brace pattern or a URL
    if os.path.isfile(src):
        return _file_kind(src)
    if os.path.isdir(src):
        return _folder_kind(src)
    if megatron_paths(src) is not None:
        return "megatron"  # a Megatron prefix: PREFIX.bin + PREFIX.idx
    raise FileNotFoundError(f"source {src!r} does not exist")


def _file_kind(src: str) -> str:
    lower = src.lower()
    for kind, extensions in _FILE_KINDS:
        if lower.endswith(extensions) and (kind != "megatron" or megatron_paths(src) is not None):
            return kind
    with open(src, "rb") as fh:
        magic = fh.read(8)
    if magic == b"\x89HDF\r\n\x1a\n":
        return "hdf5"
    raise FormatError(f"{src}: cannot tell the source kind; pass --kind ({', '.join(SOURCE_KINDS)})")


def _folder_kind(src: str) -> str:
    entries = [e for e in os.listdir(src) if not e.startswith(".")]
    names = set(entries)
    if "index.json" in names:
        from .mds import is_mds_index

        return "mds" if is_mds_index(os.path.join(src, "index.json")) else "fastload"
    if "data.mdb" in names:
        return "lmdb"
    if {"state.json", "dataset_info.json"} <= names or "dataset_dict.json" in names:
        return "hf"  # a Hugging Face `save_to_disk` directory (see hf_datasets.py)
    if {"tokens.npy", "offsets.npy"} <= names:
        return "tokens"
    data = [e for e in entries if e != "meta.json"]
    if data and all(e.endswith(".npy") for e in data):
        return "npy" if is_column_folder(src) else "npyfiles"
    if data and all(e.endswith(".parquet") for e in data):
        return "parquet"
    if data and all(e.lower().endswith((".tfrecord", ".tfrecords", ".tfrec")) for e in data):
        return "tfrecord"
    if any(os.path.isdir(os.path.join(src, e)) or is_image(e) for e in entries):
        return "imagefolder"
    shown = ", ".join(sorted(entries)[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise FormatError(
        f"{src}: cannot tell the source kind from its files ({shown or 'none'}); "
        f"pass --kind ({', '.join(SOURCE_KINDS)})"
    )


class SkipBadInputs:
    """A map-style source without the inputs that fail to read (`on_error="skip"`).

    Every input is read once up front (on threads: decoding releases the GIL); `skipped` lists
    `(input, reason)` for each one left out, and `report(path)` writes them as JSON lines.
    """

    def __init__(self, source: Any, *, threads: int | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.source = source
        self.schema = getattr(source, "schema", None)
        describe = getattr(source, "describe", None)

        def probe(i: int) -> tuple[int, str | None]:
            try:
                source[i]
            except (SchemaError, FormatError, OSError, ValueError) as exc:
                return i, str(exc)
            return i, None

        pool = ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1))
        try:
            results = list(pool.map(probe, range(len(source))))
        finally:  # Ctrl-C: drop the inputs not probed yet instead of probing them all first
            pool.shutdown(wait=True, cancel_futures=True)
        self.good = [i for i, err in results if err is None]
        self.skipped = [(describe(i) if describe else f"sample {i}", err) for i, err in results if err is not None]
        # kept sample i's input, as the source describes it (None: the source names no inputs)
        self.describe: Callable[[int], str] | None = kept_describer(source_describer(source), self.good)

    def __len__(self) -> int:
        return len(self.good)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.source[self.good[i]]

    def report(self, path: str) -> None:
        """Write the skipped inputs to `path` as JSON lines ``{"input", "reason"}``."""
        with open(path, "w") as fh:
            for name, reason in self.skipped:
                fh.write(json.dumps({"input": name, "reason": reason}) + "\n")


class JsonLines:
    """One JSON object per line; lists of numbers become `varray` fields (e.g. pre-tokenized `input_ids`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._spans: list[tuple[int, int]] = []  # (offset, length) of each non-blank line
        self._blanks: list[tuple[int, int]] = []  # (next sample, blank lines so far) at each blank line
        with open(path, "rb") as fh:
            pos = 0
            for line in fh:
                if line.strip():
                    self._spans.append((pos, len(line)))
                else:
                    self._blanks.append((len(self._spans), len(self._blanks) + 1))
                pos += len(line)
        if not self._spans:
            raise FormatError(f"{path}: no JSON lines")
        self._fd, self._pid = -1, -1
        first = self[0]
        self.schema = Schema(tuple(_json_field(k, v, path) for k, v in first.items()))

    def __len__(self) -> int:
        return len(self._spans)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": -1, "_pid": -1}

    def __del__(self) -> None:
        # module globals may already be None at interpreter exit (the OS closes the file then)
        try:
            if getattr(self, "_fd", -1) >= 0 and self._pid == os.getpid():
                os.close(self._fd)
        except Exception:  # noqa: BLE001 - nothing to report to during interpreter shutdown
            pass

    def __getitem__(self, i: int) -> dict[str, Any]:
        # os.pread: no shared file offset, so forked encoder processes can read concurrently.
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        offset, length = self._spans[i]
        line = os.pread(self._fd, length, offset)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{sample_label(i, self.describe)} is not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise SchemaError(f"{sample_label(i, self.describe)} is not a JSON object")
        return obj

    def describe(self, i: int) -> str:
        """Where sample `i` comes from, ``FILE:LINE`` (blank lines hold no sample), for error reports."""
        k = bisect.bisect_right(self._blanks, (i, math.inf))
        return f"{self.path}:{i + 1 + (self._blanks[k - 1][1] if k else 0)}"


def _json_field(name: str, value: Any, path: str) -> Field:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        top = max((abs(v) for v in value), default=0)
        return Field(name, "varray", np.dtype(np.int32 if top < 2**31 else np.int64))
    if isinstance(value, list):
        return Field(name, "varray", np.dtype(np.float32))
    if isinstance(value, (dict, type(None))):
        raise SchemaError(
            f"{path}: field {name!r} of sample 0 is {type(value).__name__}; only numbers, strings and lists"
        )
    return infer_field(name, value)


def _hdf5_source(src: str) -> BlockSource | Any:
    from .hdf5_dataset import HDF5Dataset

    ds = HDF5Dataset(src)
    n = len(ds)

    def block(s: int, e: int) -> Block:
        return Block(e - s, ds.get_batch(np.arange(s, e)))

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    return BlockSource(schema=ds.schema, num_samples=n, blocks=blocks, block=block, describe=lambda i: src)


def decode_images(ds: Any, *, batch: int = 256) -> list[str]:
    """Decode every image of a fastload dataset fully; one message per image that fails (naming
    file, shard, sample and field)."""
    problems = []
    for f in ds.schema:
        if f.kind != "image":
            continue
        for a in range(0, len(ds), batch):
            idx = np.arange(a, min(a + batch, len(ds)))
            col = ds.get_batch(idx, fields=[f.name])[f.name]
            for j, data in enumerate(col.to_list()):
                try:
                    check_image(data, ds.where(int(idx[j]), f.name))
                except SchemaError as exc:
                    problems.append(str(exc))
    return problems


def _fastload_source(src: str) -> BlockSource:
    """A fastload dataset of any readable version, read verified (e.g. to upgrade it: `convert --upgrade`)."""
    from .reader import FastloadDataset

    ds = FastloadDataset(src)

    def blocks(start: int) -> Iterator[Block]:
        for a in range(start, len(ds), _BLOCK_ROWS):
            yield ds.read_block(a, min(a + _BLOCK_ROWS, len(ds)))

    return BlockSource(
        schema=ds.schema, num_samples=len(ds), blocks=blocks, attrs=ds.attrs, describe=lambda i: ds.root
    )


def skip_refusal(src: str, attrs: dict[str, Any]) -> str:
    """Why `--on-error=skip` is refused for `src`, a columnar source (`attrs`: what `open_source` returns)."""
    if attrs.get("source") == "lance":
        return (f"--on-error=skip cannot apply to the Lance dataset {src}: pylance reads it in blocks of rows "
                "and its read errors name a data file or page, not a row, so no single bad row can be told "
                "apart and left out; convert without --on-error=skip (a read error stops the conversion)")
    return f"--on-error=skip applies to per-input sources, not {src}"


def open_source(
    src: str, kind: str | None = None, *, decode_check: bool = True, labels: str | None = None,
    decode: str | None = None,
    fields: Sequence[str] | None = None,
    jpeg_restart: bool = True,
) -> tuple[Any, Schema | None, dict[str, Any]]:
    """(source for `write`, schema or None, attrs to store in the manifest); `decode_check`: decode
    every image of an image folder (or of WebDataset, TFRecord, MDS) fully while converting;
    `labels`: an image folder's labels file; `decode`: an ArrayRecord source's ``MODULE:FUNC``
    plug-in (record bytes -> dict of fields); `fields`: the fields to keep (WebDataset, TFRecord, MDS);
    `jpeg_restart`: store an image folder's JPEGs with restart markers and a restart index
    (`ImageFolder`)."""
    kind = kind or detect_kind(src)
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown source kind {kind!r}; expected one of {SOURCE_KINDS}")
    if labels is not None and kind != "imagefolder":
        raise ValueError(f"a labels file applies to image folders, not to a {kind} source ({src})")
    if fields is not None and kind not in FIELD_KINDS:
        raise ValueError(f"--fields applies to {', '.join(FIELD_KINDS)} sources, not to a {kind} source ({src})")
    if kind in FIELD_KINDS:
        return _foreign(src, kind, fields, decode_check)
    if not os.path.exists(src) and kind != "megatron":
        raise FileNotFoundError(f"source {src!r} does not exist")
    if kind in MIGRATE_KINDS:
        return open_migrate_source(src, kind, decode=decode)
    if decode is not None:
        raise ValueError(f"--decode applies to ArrayRecord sources, not to a {kind} source ({src})")
    if kind == "imagefolder":
        folder = ImageFolder(src, decode_check=decode_check, labels=labels, jpeg_restart=jpeg_restart)
        attrs = {"classes": folder.classes} if folder.classes is not None else {}
        return folder, folder.schema, {**attrs, "source": "imagefolder"}
    if kind == "jsonl":
        lines = JsonLines(src)
        return lines, lines.schema, {"source": "jsonl"}
    if kind == "lmdb":
        from .lmdb_dataset import LMDBDataset

        db = LMDBDataset(src)
        if len(db) == 0:
            raise ValueError(f"{src}: the LMDB database is empty: nothing to convert")
        return db, db.schema, {"source": "lmdb"}
    if kind in ("npy", "npyfiles", "tokens"):
        return _npy_kind(src, kind)
    source = _columnar(src, kind)
    stored: dict[str, Any] = dict(source.attrs or {}) if kind == "fastload" else {"source": kind}
    return source, source.schema, stored


def _foreign(
    src: str, kind: str, fields: Sequence[str] | None, decode_check: bool
) -> tuple[Any, Schema, dict[str, Any]]:
    """Another loader's format: WebDataset tar shards, TFRecord files, MosaicML Streaming MDS."""
    source: Any
    if kind == "webdataset":
        from .webdataset import WebDataset

        source = WebDataset(src, fields=fields, decode_check=decode_check)
    elif kind == "tfrecord":
        from .tfrecord import TFRecords

        source = TFRecords(src, fields=fields, decode_check=decode_check)
    else:
        from .mds import MDSDataset

        source = MDSDataset(src, fields=fields, decode_check=decode_check)
    return source, source.schema, {"source": kind}


def _npy_kind(src: str, kind: str) -> tuple[Any, Schema, dict[str, Any]]:
    from .npy_files import NpyFiles, npy_columns, read_meta_json, token_source

    opener: dict[str, Callable[[str], Any]] = {"npy": npy_columns, "npyfiles": NpyFiles, "tokens": token_source}
    source = opener[kind](src)
    meta = read_meta_json(src) if os.path.isdir(src) else None
    return source, source.schema, {"source": kind, **({"meta": meta} if meta is not None else {})}


def _columnar(src: str, kind: str) -> BlockSource:
    """The sources read as columns: fastload, HF (save_to_disk or Parquet), Megatron, HDF5."""
    if kind == "fastload":
        return _fastload_source(src)
    if kind == "hf":
        from .hf_datasets import open_hf_dir

        return open_hf_dir(src)
    if kind == "parquet":
        from .hf_datasets import open_parquet

        return open_parquet(src)
    if kind == "megatron":
        from .megatron import megatron_source

        return megatron_source(src)
    return _hdf5_source(src)
