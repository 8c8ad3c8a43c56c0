"""What the sources in other loaders' formats share (WebDataset tar shards, TFRecord, MosaicML MDS).

* `ForeignSource`: a map-style source whose sample i is checked against the schema as it is read,
  so every error names the file and record it comes from (and `--on-error=skip` can leave that one
  input out) instead of surfacing later as a bare sample number in the encoder.
* `FileRanges`: byte ranges of local files or fsspec URLs, one open handle per file per thread and
  process (safe after fork, and under `SkipBadInputs`' probing threads).
* `JsonFields`: a JSON object per sample spread into one field per key, with kinds inferred from
  the first samples (numbers, strings, lists of numbers; anything else kept as its JSON text).
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .columns import encode_samples
from .errors import FormatError, SchemaError
from .schema import Field, Schema

__all__ = ["INFER_SAMPLES", "FileRanges", "ForeignSource", "JsonFields", "is_url"]

INFER_SAMPLES = 64  # samples a foreign source looks at to infer the kinds of its fields
_OPEN_PER_THREAD = 16  # open files kept per thread (a dataset may have thousands of shards)


def is_url(path: str) -> bool:
    """Whether `path` is an fsspec URL (``file://`` counts as a URL)."""
    return "://" in path


class FileRanges:
    """Reads byte ranges of local paths (``os.pread``) or fsspec URLs (seek + read).

    Open handles live per thread and per process (a forked encoder opens its own), at most
    `_OPEN_PER_THREAD` per thread; a short read raises `FormatError` naming the file. A handle is a
    file object: it closes when evicted, and when its thread ends or this object is collected (the
    per-thread handles go with them), so no descriptor outlives the reads.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage_options = state["storage_options"]
        self._local = threading.local()

    def open(self, path: str) -> Any:
        """A binary file object for `path` (the caller closes it)."""
        if is_url(path):
            import fsspec

            return fsspec.open(path, "rb", **self.storage_options).open()
        return open(path, "rb")

    def _fs(self, url: str) -> tuple[Any, str]:
        import fsspec

        return fsspec.core.url_to_fs(url, **self.storage_options)  # type: ignore[no-any-return]

    def size(self, path: str) -> int:
        """The size of `path` in bytes."""
        if is_url(path):
            fs, inner = self._fs(path)
            return int(fs.size(inner))
        return os.path.getsize(path)

    def isfile(self, path: str) -> bool:
        """Whether `path` is a file."""
        if is_url(path):
            fs, inner = self._fs(path)
            return bool(fs.isfile(inner))
        return os.path.isfile(path)

    def isdir(self, path: str) -> bool:
        """Whether `path` is a directory (for an object store: a prefix with objects under it)."""
        if is_url(path):
            fs, inner = self._fs(path)
            return bool(fs.isdir(inner))
        return os.path.isdir(path)

    def files(self, folder: str) -> list[str]:
        """The names of the files directly in `folder` (not hidden ones), sorted."""
        if is_url(folder):
            fs, inner = self._fs(folder)
            entries = fs.ls(inner, detail=True)
            names = [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file"]
        else:
            names = [e for e in os.listdir(folder) if os.path.isfile(os.path.join(folder, e))]
        return sorted(n for n in names if not n.startswith("."))

    @staticmethod
    def join(folder: str, name: str) -> str:
        """`name` inside `folder` (a local path or a URL)."""
        return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)

    def read_all(self, path: str) -> bytes:
        """The whole of `path`."""
        with self.open(path) as fh:
            return fh.read()  # type: ignore[no-any-return]

    def _handles(self) -> OrderedDict[str, Any]:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():  # a forked child: the parent's handles are not ours
            local.pid, local.handles = os.getpid(), OrderedDict()
        return local.handles

    def read(self, path: str, offset: int, length: int) -> bytes:
        """`length` bytes of `path` from `offset`; FormatError when the file ends before them."""
        handles = self._handles()
        handle = handles.get(path)
        if handle is None:
            handle = io.FileIO(path, "r") if not is_url(path) else self.open(path)
            handles[path] = handle
            if len(handles) > _OPEN_PER_THREAD:
                handles.popitem(last=False)[1].close()
        else:
            handles.move_to_end(path)
        if isinstance(handle, io.FileIO):
            data = os.pread(handle.fileno(), length, offset)
        else:
            handle.seek(offset)
            data = handle.read(length)
        if len(data) != length:
            raise FormatError(f"{path}: the file ends at byte {offset + len(data)}, inside bytes "
                              f"[{offset}, {offset + length}) (truncated?)")
        return data


class ForeignSource:
    """A map-style source in another loader's format: `read(i)` gives sample i as a dict; indexing
    checks it against `schema` (errors prefixed with `describe(i)`, the file and record)."""

    schema: Schema

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, i: int) -> dict[str, Any]:
        """Sample `i` as a dict of the schema's fields (not yet checked)."""
        raise NotImplementedError

    def describe(self, i: int) -> str:
        """Where sample `i` comes from (file and record), for error reports."""
        raise NotImplementedError

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a source of {len(self)} samples")
        try:
            sample = self.read(i)
            encode_samples([sample], self.schema, first_index=i)  # the writer's own checks, here
        except (SchemaError, FormatError) as exc:
            where = self.describe(i)
            text = str(exc)
            raise type(exc)(text if text.startswith(where) else f"{where}: {text}") from None
        return sample


_JSON_TEXT = "json-text"  # a key whose values are not one storable kind: each value kept as its JSON text


class JsonFields:
    """JSON values, one per sample, as fields: objects spread into ``PREFIX.KEY`` fields (``/`` in a
    key becomes ``.``) when the first samples' values are all objects, else one field ``PREFIX``.

    Kinds come from the values of the first samples: all bools -> bool scalar, all ints -> int64
    scalar, numbers -> float64 scalar, strings -> string, lists of numbers -> varray (int64 when all
    ints, else float64); anything else (null, objects, mixed kinds, lists of other things) -> a
    string holding each value's JSON text. A later value of another kind raises naming the key.
    """

    def __init__(self, prefix: str, values: list[Any]) -> None:
        self.prefix = prefix
        self.spread = bool(values) and all(isinstance(o, dict) for o in values)
        self.keys: list[Any] = list(values[0]) if self.spread else [None]
        self.names = {k: f"{prefix}.{k.replace('/', '.')}" if self.spread else prefix for k in self.keys}
        if self.spread:
            self.kinds = {k: _json_kind([o[k] for o in values if k in o]) for k in self.keys}
        else:
            self.kinds = {None: _json_kind(values)}

    def fields(self) -> list[Field]:
        """The fields, in the key order of the first sample's object."""
        out = []
        for k in self.keys:
            kind, name = self.kinds[k], self.names[k]
            if kind in ("bool", "int64", "float64"):
                out.append(Field(name, "scalar", np.dtype(kind)))
            elif kind in ("ints", "floats"):
                out.append(Field(name, "varray", np.dtype(np.int64 if kind == "ints" else np.float64)))
            else:
                out.append(Field(name, "string"))
        return out

    def values(self, obj: Any, keep: set[str] | None) -> dict[str, Any]:
        """The fields of one decoded value (only those in `keep` when given); missing or extra keys,
        and values not of the key's kind, raise naming the key."""
        if not self.spread:
            return {self.prefix: _json_value(obj, self.kinds[None], self.prefix)}
        if not isinstance(obj, dict):
            raise SchemaError(f"{self.prefix!r} is a JSON {type(obj).__name__}, not an object")
        wanted = [k for k in self.keys if keep is None or self.names[k] in keep]
        missing = [k for k in wanted if k not in obj]
        extra = [k for k in obj if k not in self.names] if keep is None else []
        if missing or extra:
            raise SchemaError(f"{self.prefix!r}: the JSON object lacks keys {missing} / has keys {extra} that the "
                              "first samples' objects do not (keep the fields every sample has with --fields)")
        return {self.names[k]: _json_value(obj[k], self.kinds[k], f"{self.prefix}[{k!r}]") for k in wanted}


def _json_kind(values: list[Any]) -> str:
    if values and all(isinstance(v, bool) for v in values):
        return "bool"
    if values and all(isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63 for v in values):
        return "int64"
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return "float64"
    if values and all(isinstance(v, str) for v in values):
        return "string"
    if values and all(isinstance(v, list) and all(_number(x) for x in v) for v in values):
        ints = all(isinstance(x, int) and -(2**63) <= x < 2**63 for v in values for x in v)
        return "ints" if ints else "floats"
    return _JSON_TEXT


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _json_value(value: Any, kind: str, where: str) -> Any:
    if kind == _JSON_TEXT:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    ok = {
        "bool": isinstance(value, bool),
        "int64": isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63,
        "float64": _number(value),
        "string": isinstance(value, str),
        "ints": isinstance(value, list)
        and all(isinstance(x, int) and not isinstance(x, bool) and -(2**63) <= x < 2**63 for x in value),
        "floats": isinstance(value, list) and all(_number(x) for x in value),
    }[kind]
    if not ok:
        raise SchemaError(f"{where} is {json.dumps(value)[:60]}, but the first samples make it {kind}")
    if kind == "float64":
        return float(value)
    if kind in ("ints", "floats"):
        return np.array(value, dtype=np.int64 if kind == "ints" else np.float64)
    return value


def utf8_text(raw: bytes, what: str) -> str:
    """`raw` decoded as UTF-8; a SchemaError naming `what` (a column or member) when it is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{what} is not UTF-8 text ({exc})") from None
