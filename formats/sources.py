"""Source kinds that `fastload convert` reads: image folders, numpy arrays, JSON lines, LMDB, HDF5.

Each `open_source` result is something `write()` accepts: a `BlockSource` for columnar sources
(npy, HDF5 — no per-sample Python), or a map-style dataset of sample dicts (image folders, JSON
lines, LMDB) that `write()` encodes in worker processes.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from .columns import Block, image_size
from .errors import FormatError, SchemaError
from .schema import Field, Schema, infer_field
from .writer import BlockSource

__all__ = [
    "SOURCE_KINDS",
    "ImageFolder",
    "JsonLines",
    "SkipBadInputs",
    "check_image",
    "decode_images",
    "detect_kind",
    "open_source",
]

SOURCE_KINDS = ("imagefolder", "npy", "jsonl", "lmdb", "hdf5", "hf", "fastload")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
_BLOCK_ROWS = 8192


def detect_kind(src: str) -> str:
    """Guess the source kind from the path; raise naming the path when it cannot."""
    if os.path.isfile(src):
        lower = src.lower()
        if lower.endswith(".npy"):
            return "npy"
        if lower.endswith((".jsonl", ".json", ".ndjson")):
            return "jsonl"
        if lower.endswith((".h5", ".hdf5", ".hdf")):
            return "hdf5"
        if lower.endswith(".mdb"):
            return "lmdb"
        with open(src, "rb") as fh:
            magic = fh.read(8)
        if magic == b"\x89HDF\r\n\x1a\n":
            return "hdf5"
        raise FormatError(f"{src}: cannot tell the source kind; pass --kind ({', '.join(SOURCE_KINDS)})")
    if os.path.isdir(src):
        entries = os.listdir(src)
        if "index.json" in entries:
            return "fastload"
        if "data.mdb" in entries:
            return "lmdb"
        if {"state.json", "dataset_info.json"} <= set(entries) or "dataset_dict.json" in entries:
            return "hf"  # a Hugging Face `save_to_disk` directory (see hf_datasets.py)
        if entries and all(e.endswith(".npy") for e in entries if not e.startswith(".")):
            return "npy"
        if any(os.path.isdir(os.path.join(src, e)) for e in entries):
            return "imagefolder"
        raise FormatError(f"{src}: cannot tell the source kind; pass --kind ({', '.join(SOURCE_KINDS)})")
    raise FileNotFoundError(f"source {src!r} does not exist")


def check_image(data: bytes, where: str) -> None:
    """Decode an encoded image fully; raise SchemaError naming `where` when it cannot be (truncated,
    corrupt, not an image). A header alone is not enough: a truncated JPEG has an intact one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise SchemaError(f"{where}: not a decodable image ({exc})") from exc


class ImageFolder:
    """`root/<class>/<image>` → ``{"image": encoded bytes, "label": class index}``, classes and files sorted.

    With `decode_check` (default) every image is decoded fully as it is read; errors name the file.
    """

    def __init__(self, root: str, *, decode_check: bool = True) -> None:
        self.root = root
        self.decode_check = decode_check
        self.classes = sorted(e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e)))
        self.files: list[tuple[str, int]] = []
        for label, cls in enumerate(self.classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
                dirnames.sort()
                self.files += [
                    (os.path.join(dirpath, f), label) for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS)
                ]
        if not self.files:
            raise FormatError(f"{root}: no images found (expected {root}/<class>/<image>.jpg)")
        self.schema = Schema((Field("image", "image"), Field("label", "scalar", np.dtype(np.int64))))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.files[i]
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise SchemaError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        if self.decode_check:
            check_image(data, path)
        else:
            image_size(data, path)  # the header at least: its size goes into meta.bin
        return {"image": data, "label": label}

    def describe(self, i: int) -> str:
        return self.files[i][0]


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

        with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
            results = list(pool.map(probe, range(len(source))))
        self.good = [i for i, err in results if err is None]
        self.skipped = [(describe(i) if describe else f"sample {i}", err) for i, err in results if err is not None]

    def __len__(self) -> int:
        return len(self.good)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.source[self.good[i]]

    def report(self, path: str) -> None:
        with open(path, "w") as fh:
            for name, reason in self.skipped:
                fh.write(json.dumps({"input": name, "reason": reason}) + "\n")


class JsonLines:
    """One JSON object per line; lists of numbers become `varray` fields (e.g. pre-tokenized `input_ids`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._spans: list[tuple[int, int]] = []  # (offset, length) of each non-blank line
        with open(path, "rb") as fh:
            pos = 0
            for line in fh:
                if line.strip():
                    self._spans.append((pos, len(line)))
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
        if getattr(self, "_fd", -1) >= 0 and self._pid == os.getpid():
            os.close(self._fd)

    def __getitem__(self, i: int) -> dict[str, Any]:
        # os.pread: no shared file offset, so forked encoder processes can read concurrently.
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        offset, length = self._spans[i]
        line = os.pread(self._fd, length, offset)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{self.path}: sample {i} is not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise SchemaError(f"{self.path}: sample {i} is not a JSON object")
        return obj

    def describe(self, i: int) -> str:
        return f"{self.path}:{i + 1} (line of sample {i})"


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


def _npy_source(src: str) -> BlockSource:
    paths = (
        [src] if os.path.isfile(src) else sorted(os.path.join(src, e) for e in os.listdir(src) if e.endswith(".npy"))
    )
    arrays = {}
    for p in paths:
        try:
            arrays[os.path.splitext(os.path.basename(p))[0] if len(paths) > 1 else "data"] = np.load(
                p, mmap_mode="r", allow_pickle=False
            )
        except ValueError as exc:
            raise FormatError(f"{p}: cannot read as a numeric .npy array ({exc})") from exc
    lengths = {k: len(a) if a.ndim else 0 for k, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise FormatError(f"{src}: arrays differ in length (first dimension): {lengths}")
    n = next(iter(lengths.values()))
    schema = Schema(
        tuple(
            Field(k, "scalar", a.dtype) if a.ndim == 1 else Field(k, "ndarray", a.dtype, a.shape[1:])
            for k, a in arrays.items()
        )
    )

    def block(s: int, e: int) -> Block:
        return Block(e - s, {k: np.ascontiguousarray(a[s:e]) for k, a in arrays.items()})

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    return BlockSource(schema=schema, num_samples=n, blocks=blocks, block=block)


def _hdf5_source(src: str) -> BlockSource | Any:
    from .hdf5_dataset import HDF5Dataset

    ds = HDF5Dataset(src)
    n = len(ds)

    def block(s: int, e: int) -> Block:
        return Block(e - s, ds.get_batch(np.arange(s, e)))

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, _BLOCK_ROWS):
            yield block(s, min(s + _BLOCK_ROWS, n))

    return BlockSource(schema=ds.schema, num_samples=n, blocks=blocks, block=block)


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

    return BlockSource(schema=ds.schema, num_samples=len(ds), blocks=blocks, attrs=ds.attrs)


def open_source(
    src: str, kind: str | None = None, *, decode_check: bool = True
) -> tuple[Any, Schema | None, dict[str, Any]]:
    """(source for `write`, schema or None, attrs to store in the manifest); `decode_check`: decode
    every image of an image folder fully while converting."""
    kind = kind or detect_kind(src)
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown source kind {kind!r}; expected one of {SOURCE_KINDS}")
    if not os.path.exists(src):
        raise FileNotFoundError(f"source {src!r} does not exist")
    if kind == "imagefolder":
        folder = ImageFolder(src, decode_check=decode_check)
        return folder, folder.schema, {"classes": folder.classes, "source": "imagefolder"}
    if kind == "jsonl":
        lines = JsonLines(src)
        return lines, lines.schema, {"source": "jsonl"}
    if kind == "lmdb":
        from .lmdb_dataset import LMDBDataset

        db = LMDBDataset(src)
        if len(db) == 0:
            raise ValueError(f"{src}: the LMDB database is empty: nothing to convert")
        return db, db.schema, {"source": "lmdb"}
    if kind == "fastload":
        source = _fastload_source(src)
        return source, source.schema, dict(source.attrs or {})
    if kind == "hf":
        from .hf_datasets import open_hf_dir

        source = open_hf_dir(src)
        return source, source.schema, {"source": "hf"}
    if kind == "npy":
        source = _npy_source(src)
        return source, source.schema, {"source": "npy"}
    source = _hdf5_source(src)
    return source, source.schema, {"source": "hdf5"}
