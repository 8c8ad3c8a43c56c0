"""WebDataset tar shards as a source, read with the standard library's `tarfile` (no webdataset needed).

`SRC` is a directory of ``.tar`` shards (name order), a brace pattern (``shards-{000000..000123}.tar``,
expanded in order; needs ``braceexpand`` from ``fastload[migrate]``), one ``.tar`` file, or an fsspec
URL of any of these. Samples are grouped as WebDataset groups them: consecutive regular members
whose paths agree up to the first dot of the basename (the key) form one sample, never across
shards; each member's extension (the rest of its name, lower-cased) is a field. Members named like
``__meta__`` and members without a dot are skipped, as WebDataset skips them.

Fields (by the last part of the extension): images (jpg, jpeg, png, webp, bmp, gif, tif, tiff) ->
``image``; cls, cls2, class, count, index, inx, id -> int64 ``scalar``; txt, text, transcript ->
``string``; json, jsn -> one field per key (`JsonFields`); npy -> an array (``np.load`` with
``allow_pickle=False``; its kind inferred from the first samples); anything else -> ``bytes``.
``__key__`` (a string) holds each sample's key. Pickles (pyd, pickle, pkl, pth) are never unpickled:
such a member is refused by name unless `fields` leaves it out.

Every sample must have the fields of the first one (extra members raise too, unless `fields`
picks a subset). Compressed shards (``.tar.gz``) are refused: members cannot be read by offset.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FormatError, SchemaError
from .foreign import INFER_SAMPLES, FileRanges, ForeignSource, JsonFields, is_url, utf8_text
from .image_folder import IMAGE_EXTENSIONS, check_image
from .schema import Field, Schema

__all__ = ["KEY_FIELD", "PICKLE_EXTENSIONS", "WebDataset", "is_webdataset", "shard_paths"]

KEY_FIELD = "__key__"
IMAGE_EXTS = {e.lstrip(".") for e in IMAGE_EXTENSIONS}
INT_EXTS = {"cls", "cls2", "class", "count", "index", "inx", "id"}
TEXT_EXTS = {"txt", "text", "transcript"}
JSON_EXTS = {"json", "jsn"}
PICKLE_EXTENSIONS = ("pyd", "pickle", "pkl", "pth")
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext
_META_RE = re.compile(r"__[^/]*__($|/)")  # WebDataset's skip_meta
_COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
_MAX_SPAN_WASTE = 2  # read members one by one when the whole sample is this many times the kept bytes


def is_webdataset(src: str, *, list_urls: bool = True) -> bool:
    """Whether `src` names WebDataset shards: a ``.tar`` path or URL, a brace pattern of them, or a
    directory holding ``.tar`` files (a URL folder is listed only with `list_urls`)."""
    lower = src.lower().rstrip("/")
    if lower.endswith((".tar", *_COMPRESSED)):
        return True
    if is_url(src):
        if not list_urls:
            return False
        import fsspec

        try:
            fs, inner = fsspec.core.url_to_fs(src)
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(inner, detail=False)] if fs.isdir(inner) else []
        except Exception:  # noqa: BLE001 - a guess: a URL not listable here is not recognizably shards
            return False  # (--kind webdataset still names it)
    elif os.path.isdir(src):
        names = os.listdir(src)
    else:
        return False
    names = [n.lower() for n in names if not n.startswith(".")]
    return any(n.endswith(".tar") for n in names) and all(n.endswith((".tar", ".json", ".txt", ".md", ".idx"))
                                                          for n in names)


def shard_paths(src: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The shard paths or URLs `src` names, in order (see the module docstring)."""
    if "{" in src:
        try:
            from braceexpand import braceexpand
        except ImportError as exc:
            raise ImportError("brace patterns need braceexpand: pip install 'fastload[migrate]'") from exc
        paths = list(braceexpand(src))
    elif is_url(src):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(src, **(storage_options or {}))
        if fs.isdir(inner):
            proto = src.split("://", 1)[0]
            listed = sorted(p for p in fs.ls(inner, detail=False) if p.lower().endswith(".tar"))
            paths = [p if "://" in p else f"{proto}://{p}" for p in listed]
        else:
            paths = [src]
    elif os.path.isdir(src):
        paths = sorted(os.path.join(src, e) for e in os.listdir(src)
                       if e.lower().endswith(".tar") and not e.startswith("."))
    else:
        paths = [src]
    if not paths:
        raise FormatError(f"{src}: no .tar shards")
    compressed = [p for p in paths if p.lower().endswith(_COMPRESSED)]
    if compressed:
        raise FormatError(f"{compressed[0]}: a compressed tar shard: its members cannot be read by offset; "
                          "decompress the shards first (e.g. gunzip) and convert the .tar files")
    return paths


@dataclass
class _Shard:
    """One shard's samples: keys, and members (extension, data offset, size) kept as arrays (a
    dataset of millions of members stays compact, and forked encoders share it without copying);
    `errors` says why a sample cannot be read."""

    keys: list[str] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # local sample -> why it cannot be read
    lost_from: int | None = None  # the byte from which the shard cannot be read (its last "sample" stands for it)
    exts: list[str] = field(default_factory=list)  # the distinct extensions, in order of appearance
    ext_ids: Any = None  # per member: index into `exts`
    offsets: Any = None  # per member: where its data starts
    sizes: Any = None  # per member: its data's size
    first: Any = None  # per sample + 1: its first member

    def members(self, j: int) -> list[tuple[str, int, int]]:
        """Sample `j`'s members as (extension, data offset, size), in tar order."""
        lo, hi = int(self.first[j]), int(self.first[j + 1])
        return [(self.exts[e], int(o), int(n))
                for e, o, n in zip(self.ext_ids[lo:hi], self.offsets[lo:hi], self.sizes[lo:hi])]


def _index_shard(ranges: FileRanges, path: str) -> _Shard:
    """Group the members of one shard into samples as WebDataset does (see the module docstring)."""
    shard = _Shard()
    members: list[list[tuple[str, int, int]]] = []
    next_header = 0  # where the header after the last member read starts
    problem = None
    try:
        with ranges.open(path) as fh:
            try:
                with tarfile.open(fileobj=fh, mode="r:") as tf:
                    for m in tf:
                        next_header = m.offset_data + -(-m.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                        _add_member(shard, members, m)
            except tarfile.TarError as exc:
                problem = f"not a readable tar file after byte {next_header} ({exc})"
            if problem is None:
                fh.seek(next_header)
                block = fh.read(tarfile.BLOCKSIZE)
                if block.strip(b"\0"):
                    problem = f"a corrupt tar header at byte {next_header}"
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc})") from exc
    if problem is not None:  # everything from here on is lost: one bad input, so --on-error=skip can name it
        shard.errors[len(shard.keys)] = f"{problem}: the members from there to the end cannot be read"
        shard.keys.append("")
        members.append([])
        shard.lost_from = next_header
    flat = [m for sample in members for m in sample]
    ids = {e: i for i, e in enumerate(dict.fromkeys(e for e, _, _ in flat))}
    shard.exts = list(ids)
    shard.ext_ids = np.array([ids[e] for e, _, _ in flat], dtype=np.int32)
    shard.offsets = np.array([o for _, o, _ in flat], dtype=np.int64)
    shard.sizes = np.array([n for _, _, n in flat], dtype=np.int64)
    shard.first = np.concatenate([[0], np.cumsum([len(sample) for sample in members], dtype=np.int64)])
    return shard


def _add_member(shard: _Shard, members: list[list[tuple[str, int, int]]], m: tarfile.TarInfo) -> None:
    name = m.name
    if not m.isreg() or ("/" not in name and name.startswith("__") and name.endswith("__")) or _META_RE.match(name):
        return
    match = _KEY_RE.match(name)
    if not match:
        return
    key, ext = match.group(1), match.group(2).lower()
    if not shard.keys or shard.keys[-1] != key:
        shard.keys.append(key)
        members.append([])
    k = len(shard.keys) - 1
    if any(e == ext for e, _, _ in members[k]):
        shard.errors[k] = f"a second member {name!r} with extension {ext!r} in one sample"
    members[k].append((ext, m.offset_data, m.size))


def _spec(ext: str) -> str:
    """How a member with this extension is read: image, int, text, json, npy, pickle or bytes."""
    last = ext.rsplit(".", 1)[-1]
    for kind, exts in (("image", IMAGE_EXTS), ("int", INT_EXTS), ("text", TEXT_EXTS), ("json", JSON_EXTS),
                       ("npy", {"npy"}), ("pickle", set(PICKLE_EXTENSIONS))):
        if last in exts:
            return kind
    return "bytes"


class WebDataset(ForeignSource):
    """WebDataset shards as a map-style source of sample dicts (see the module docstring).

    `fields` keeps a subset (field names; a JSON member's extension keeps all its keys);
    `decode_check` decodes every image fully as it is read.
    """

    def __init__(
        self, src: str, *, fields: Sequence[str] | None = None, decode_check: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.src, self.decode_check, self.fields = src, decode_check, fields
        self.ranges = FileRanges(storage_options)
        self.paths = shard_paths(src, storage_options)
        with ThreadPoolExecutor(max_workers=min(8, len(self.paths))) as pool:
            shards = list(pool.map(lambda p: _index_shard(self.ranges, p), self.paths))
        self._shard_of = np.concatenate([np.full(len(s.keys), k, np.int32) for k, s in enumerate(shards)])
        self._local = np.concatenate([np.arange(len(s.keys), dtype=np.int64) for s in shards])
        self._shards = shards
        if len(self._shard_of) == 0:
            raise FormatError(f"{src}: no samples in {len(self.paths)} shard(s)")
        self._exts: list[str] = []
        self._json: dict[str, JsonFields] = {}
        self.schema = self._infer(fields)

    def __len__(self) -> int:
        return len(self._shard_of)

    def _entry(self, i: int) -> tuple[str, _Shard, int]:
        k = int(self._shard_of[i])
        return self.paths[k], self._shards[k], int(self._local[i])

    def describe(self, i: int) -> str:
        """The shard and key of sample `i` (for error reports)."""
        path, shard, j = self._entry(i)
        if shard.lost_from is not None and j == len(shard.keys) - 1:
            return f"{path}: sample {j} (members from byte {shard.lost_from} on)"
        return f"{path}: sample {j} (key {shard.keys[j]!r})"

    def _infer(self, fields: Sequence[str] | None) -> Schema:
        first = next((i for i in range(len(self)) if self._entry(i)[2] not in self._entry(i)[1].errors), None)
        if first is None:
            raise FormatError(f"{self.src}: no readable sample (the first: {self._entry(0)[1].errors[0]})")
        _, shard, j = self._entry(first)
        exts = [e for e, _, _ in shard.members(j)]
        keep = set(fields) if fields is not None else None
        self._exts = [e for e in exts if keep is None or e in keep or _spec(e) == "json"]
        refused = [e for e in self._exts if _spec(e) == "pickle"]
        if refused:
            raise FormatError(
                f"{self.describe(first)}: member extension {refused[0]!r} is a pickle; fastload never unpickles "
                f"dataset files: leave it out with --fields (fields of this sample: {[KEY_FIELD, *exts]})"
            )
        head = self._head(first)
        out: list[Field] = [Field(KEY_FIELD, "string")]
        json_keys: dict[str, list[str]] = {}  # every JSON member's fields, kept or not (for the error below)
        for ext in self._exts:
            spec = _spec(ext)
            if spec == "json":
                jf = JsonFields(ext, [h[ext] for h in head if ext in h])
                every_key = jf.fields()
                json_keys[ext] = [f.name for f in every_key]
                chosen = [f for f in every_key if keep is None or ext in keep or f.name in keep]
                if chosen:
                    self._json[ext] = jf
                    out += chosen
            elif spec == "npy":
                out.append(Schema.infer([{ext: h[ext]} for h in head if ext in h]).fields[0])
            else:
                kinds = {"image": "image", "int": "scalar", "text": "string", "bytes": "bytes"}
                out.append(Field(ext, kinds[spec], np.dtype(np.int64)) if spec == "int" else Field(ext, kinds[spec]))
        self._exts = [e for e in self._exts if _spec(e) != "json" or e in self._json]
        names = [f.name for f in out]
        if fields is not None:
            unknown = [f for f in fields if f not in names and f not in self._json]
            if unknown:
                every = [KEY_FIELD, *(k for e in exts for k in [e, *json_keys.get(e, [])])]  # a JSON member, its keys
                raise SchemaError(f"{self.src}: no field {unknown[0]!r} to keep; the fields are {every}")
            if KEY_FIELD not in fields:
                out = out[1:]
        if not out:
            raise SchemaError(f"{self.src}: no field left to convert")
        return Schema(tuple(out))

    def _head(self, first: int) -> list[dict[str, Any]]:
        """The JSON and npy members of the first readable samples, decoded (a bad one is left to
        fail when it is converted)."""
        decoders = {"json": _json, "npy": _npy}
        wanted = [e for e in self._exts if _spec(e) in decoders]
        head: list[dict[str, Any]] = []
        for i in range(first, len(self)) if wanted else ():
            try:
                raw = self._members(i, wanted)
                head.append({e: decoders[_spec(e)](v, e) for e, v in raw.items()})
            except (FormatError, SchemaError):
                continue
            if len(head) == INFER_SAMPLES:
                break
        return head

    def _members(self, i: int, wanted: list[str]) -> dict[str, bytes]:
        """The data of sample `i`'s members, by extension: all of them, with only `wanted` read."""
        path, shard, j = self._entry(i)
        if j in shard.errors:
            raise FormatError(shard.errors[j])
        members = shard.members(j)
        kept = [m for m in members if m[0] in wanted]
        if not kept:
            return {}
        lo, hi = kept[0][1], kept[-1][1] + kept[-1][2]
        if hi - lo <= _MAX_SPAN_WASTE * sum(m[2] for m in kept):  # one read of the sample's span
            blob = self.ranges.read(path, lo, hi - lo)
            return {e: blob[o - lo : o - lo + n] for e, o, n in kept}
        return {e: self.ranges.read(path, o, n) for e, o, n in kept}

    def read(self, i: int) -> dict[str, Any]:
        """Sample `i` as a dict of the schema's fields."""
        _, shard, j = self._entry(i)
        if j in shard.errors:
            raise FormatError(shard.errors[j])
        present = {e for e, _, _ in shard.members(j)}
        missing = [e for e in self._exts if e not in present]
        if missing:
            raise SchemaError(f"no member for {missing} (the first sample has them; keep the fields every "
                              "sample has with --fields)")
        names = set(self.schema.names)
        extra = sorted(present - set(self._exts)) if self.fields is None else []
        if extra:
            raise SchemaError(f"members {extra} that the first sample does not have (keep a subset with --fields)")
        data = self._members(i, self._exts)
        sample: dict[str, Any] = {KEY_FIELD: shard.keys[j]} if KEY_FIELD in names else {}
        for ext in self._exts:
            raw, spec = data[ext], _spec(ext)
            if spec == "json":
                sample.update(self._json[ext].values(_json(raw, ext), names))
            elif spec == "image":
                if self.decode_check:
                    check_image(raw, f"member {ext!r}")
                sample[ext] = raw
            elif spec == "int":
                sample[ext] = _int(raw, ext)
            elif spec == "text":
                sample[ext] = utf8_text(raw, f"member {ext!r}")
            elif spec == "npy":
                sample[ext] = _npy(raw, ext)
            else:
                sample[ext] = raw
        return sample



def _int(raw: bytes, ext: str) -> int:
    try:
        return int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SchemaError(f"member {ext!r} is {raw[:40]!r}, not an integer") from None


def _json(raw: bytes, ext: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SchemaError(f"member {ext!r} is not valid JSON ({exc})") from None


def _npy(raw: bytes, ext: str) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise SchemaError(f"member {ext!r} is not a readable numeric .npy array ({exc})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise SchemaError(f"member {ext!r} holds {getattr(arr, 'dtype', type(arr).__name__)}, not numbers")
    return arr
