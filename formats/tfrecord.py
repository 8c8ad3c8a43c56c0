"""TFRecord files of `tf.train.Example` records as a source, read without TensorFlow.

`SRC` is a TFRecord file or a directory of them (``.tfrecord``, ``.tfrecords``, ``.tfrec``; name
order; with ``--kind tfrecord`` every non-hidden file of the directory), local or an fsspec URL
(read through `foreign.FileRanges`). A record is framed as
``uint64 length, uint32 masked crc32c(length), data, uint32 masked crc32c(data)``; both CRCs are
checked (the length's when the file is indexed, the data's when the record is read) with the
``crc32c`` package (``fastload[migrate]``). Each record is parsed as a `tf.train.Example` by a small
protobuf wire-format reader (Example -> Features -> map<string, Feature> -> BytesList / FloatList /
Int64List), with protobuf's merge rules.

Features map to fields named after their keys with ``/`` replaced by ``.`` (``image/encoded`` ->
``image.encoded``); kinds come from the first records: an Int64List of one value in each is an
int64 ``scalar``, of one length k > 1 an int64 ``ndarray`` (k,), of varying length an int64
``varray``; FloatLists the same in float32; a BytesList of one value is ``image`` when those values
are JPEG or PNG, else ``bytes``. A BytesList of several values has no field kind and is refused by
name (leave it out with `fields`). Compressed (GZIP/ZLIB) TFRecord files are refused: decompress first.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import FormatError, SchemaError
from .foreign import INFER_SAMPLES, FileRanges, ForeignSource
from .image_folder import check_image
from .schema import Field, Schema

__all__ = ["TFRECORD_EXTENSIONS", "TFRecords", "masked_crc32c", "parse_example", "tfrecord_paths"]

TFRECORD_EXTENSIONS = (".tfrecord", ".tfrecords", ".tfrec")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")
_BYTES, _FLOATS, _INTS = 1, 2, 3  # Feature's oneof field numbers


def _crc32c(data: bytes) -> int:
    try:
        import crc32c
    except ImportError as exc:
        raise ImportError("TFRecord CRCs are checked with the crc32c package: pip install 'fastload[migrate]'") from exc
    return int(crc32c.crc32c(data))


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data`: the CRC rotated right by 15 bits plus 0xa282ead8."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_paths(src: str, ranges: FileRanges | None = None) -> list[str]:
    """The TFRecord files `src` (a local path or an fsspec URL) names, in name order: a file, or a
    directory's files with a TFRecord extension (every non-hidden file when none has one)."""
    ranges = ranges or FileRanges()
    if not ranges.isdir(src):
        paths = [src]
    else:
        files = ranges.files(src)
        named = [e for e in files if e.lower().endswith(TFRECORD_EXTENSIONS)]
        paths = [ranges.join(src, e) for e in (named or files)]
    if not paths:
        raise FormatError(f"{src}: no TFRecord files ({', '.join(TFRECORD_EXTENSIONS)})")
    for p in paths:
        if not ranges.isfile(p):
            raise FileNotFoundError(f"source {p!r} does not exist")
        with ranges.open(p) as fh:
            if fh.read(2) in (b"\x1f\x8b",):
                raise FormatError(f"{p}: a GZIP-compressed TFRecord file; decompress it first (gunzip)")
    return paths


def _index_file(ranges: FileRanges, path: str) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(data offsets, data lengths) of every record, and why the file cannot be read past the last one."""
    offsets: list[int] = []
    lengths: list[int] = []
    size = ranges.size(path)
    pos = 0
    problem = None
    with ranges.open(path) as fh:
        while pos < size:
            head = fh.read(12)
            if len(head) < 12:
                problem = f"the file ends inside the header of record {len(offsets)} (truncated)"
                break
            length, crc = struct.unpack("<QI", head)
            if masked_crc32c(head[:8]) != crc:
                hint = " (or a ZLIB-compressed file: decompress it first)" if pos == 0 else ""
                problem = f"record {len(offsets)}: the length's CRC does not match at byte {pos} (corrupt){hint}"
                break
            if pos + 12 + length + 4 > size:
                problem = f"the file ends inside record {len(offsets)} (truncated)"
                break
            offsets.append(pos + 12)
            lengths.append(length)
            pos += 12 + length + 4
            fh.seek(pos)
    return np.array(offsets, np.int64), np.array(lengths, np.int64), problem


# ---------------------------------------------------------------- protobuf wire format


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise FormatError("a varint runs past the end of its message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if shift >= 70:
            raise FormatError("a varint longer than 10 bytes")


def _fields(buf: bytes, start: int, end: int) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message: an int for varint/fixed, (start, end) for bytes."""
    out: list[tuple[int, int, Any]] = []
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _varint(buf, pos, end)
        elif wire == 1:
            value, pos = pos, pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            value, pos = (pos, pos + n), pos + n
        elif wire == 5:
            value, pos = pos, pos + 4
        else:
            raise FormatError(f"field {number} has wire type {wire}, which an Example never holds")
        if pos > end:
            raise FormatError(f"field {number} runs past the end of its message")
        out.append((number, wire, value))
    return out


def _packed_varints(buf: bytes, start: int, end: int) -> np.ndarray:
    b = np.frombuffer(buf, np.uint8, end - start, start)
    last = np.flatnonzero(b < 0x80)
    if len(b) and (not len(last) or last[-1] != len(b) - 1):
        raise FormatError("a packed int64 list ends inside a varint")
    first = np.concatenate([[0], last[:-1] + 1]).astype(np.int64)
    sizes = last - first + 1
    if len(sizes) and sizes.max() > 10:
        raise FormatError("a varint longer than 10 bytes")
    shift = (np.arange(len(b)) - np.repeat(first, sizes)).astype(np.uint64) * np.uint64(7)
    parts = (b & 0x7F).astype(np.uint64) << shift
    return np.add.reduceat(parts, first).view(np.int64) if len(b) else np.zeros(0, np.int64)


def _feature(buf: bytes, start: int, end: int) -> tuple[int, list[Any]]:
    """A Feature: its kind (1 bytes, 2 floats, 3 ints; 0 none set) and values, merged as protobuf merges."""
    kind = 0
    values: list[Any] = []
    for number, wire, value in _fields(buf, start, end):
        if number not in (_BYTES, _FLOATS, _INTS) or wire != 2:
            continue
        if number != kind:
            kind, values = number, []
        for n, w, v in _fields(buf, *value):
            if n != 1:
                continue
            if kind == _BYTES and w == 2:
                values.append(buf[v[0] : v[1]])
            elif kind == _FLOATS and w == 2:
                if (v[1] - v[0]) % 4:
                    raise FormatError("a packed float list is not a whole number of floats")
                values.append(np.frombuffer(buf, "<f4", (v[1] - v[0]) // 4, v[0]))
            elif kind == _FLOATS and w == 5:
                values.append(np.frombuffer(buf, "<f4", 1, v))
            elif kind == _INTS and w == 2:
                values.append(_packed_varints(buf, *v))
            elif kind == _INTS and w == 0:
                values.append(np.array([v], np.uint64).view(np.int64))
            else:
                raise FormatError(f"a {('', 'bytes', 'float', 'int64')[kind]} list holds wire type {w}")
    if kind in (_FLOATS, _INTS):
        dtype = np.float32 if kind == _FLOATS else np.int64
        values = [np.concatenate(values).astype(dtype) if values else np.zeros(0, dtype)]
    return kind, values


def parse_example(record: bytes) -> dict[str, tuple[int, Any]]:
    """A serialized `tf.train.Example` as ``{key: (kind, value)}``: kind 1 -> list of bytes, 2 ->
    float32 array, 3 -> int64 array, 0 -> no kind set. Raises FormatError when it is not one."""
    out: dict[str, tuple[int, Any]] = {}
    for number, wire, value in _fields(record, 0, len(record)):
        if number == 2:
            raise FormatError("the record has feature lists: a tf.train.SequenceExample, not an Example")
        if number != 1 or wire != 2:
            continue
        for n, w, v in _fields(record, *value):  # Features: map entries (key = 1, value = 2)
            if n != 1 or w != 2:
                continue
            key, feature = b"", None
            for en, ew, ev in _fields(record, *v):
                if en == 1 and ew == 2:
                    key = record[ev[0] : ev[1]]
                elif en == 2 and ew == 2:
                    feature = ev
            try:
                name = key.decode("utf-8")
            except UnicodeDecodeError:
                raise FormatError(f"a feature key is not UTF-8 ({key[:40]!r})") from None
            kind, values = _feature(record, *feature) if feature is not None else (0, [])
            out[name] = (kind, values[0] if kind in (_FLOATS, _INTS) else values)
    return out


# ---------------------------------------------------------------- the source


def _field_for(name: str, key: str, values: list[tuple[int, Any]], where: str) -> Field:
    kinds = {k for k, _ in values}
    if len(kinds) != 1 or 0 in kinds:
        raise SchemaError(f"{where}: feature {key!r} has no single list kind in the first records "
                          f"({sorted(kinds)}; 1 bytes, 2 float, 3 int64)")
    kind = kinds.pop()
    lengths = {len(v) for _, v in values}
    if kind == _BYTES:
        if lengths != {1}:
            raise SchemaError(f"{where}: feature {key!r} is a list of {sorted(lengths)} byte strings per record; "
                              "fastload stores one byte string per field: leave it out with --fields")
        is_image = all(v[0].startswith(_IMAGE_MAGIC) for _, v in values)
        return Field(name, "image" if is_image else "bytes")
    dtype = np.dtype(np.float32 if kind == _FLOATS else np.int64)
    if lengths == {1}:
        return Field(name, "scalar", dtype)
    if len(lengths) == 1:
        return Field(name, "ndarray", dtype, (lengths.pop(),))
    return Field(name, "varray", dtype)


class TFRecords(ForeignSource):
    """TFRecord files of `tf.train.Example` records as a map-style source (see the module docstring).

    `fields` keeps a subset (field names, ``/`` written as ``.``); `decode_check` decodes every
    image fully as it is read.
    """

    def __init__(self, src: str, *, fields: Sequence[str] | None = None, decode_check: bool = True) -> None:
        self.src, self.decode_check = src, decode_check
        self.ranges = FileRanges()
        self.paths = tfrecord_paths(src, self.ranges)
        parts = [_index_file(self.ranges, p) for p in self.paths]
        # a file that cannot be framed past some record ends in one bad input naming it
        self._file = np.concatenate([np.full(len(o) + (e is not None), k, np.int32)
                                     for k, (o, _, e) in enumerate(parts)])
        self._record = np.concatenate([np.arange(len(o) + (e is not None), dtype=np.int64) for o, _, e in parts])
        self._spans = [(o, n) for o, n, _ in parts]
        self._problems = {k: e for k, (_, _, e) in enumerate(parts) if e is not None}
        if len(self._file) == 0:
            raise FormatError(f"{src}: no records")
        self.schema, self._keys = self._infer(fields)

    def __len__(self) -> int:
        return len(self._file)

    def describe(self, i: int) -> str:
        """The file and record number (from 0) of sample `i`."""
        return f"{self.paths[int(self._file[i])]}: record {int(self._record[i])}"

    def _example(self, i: int) -> dict[str, tuple[int, Any]]:
        k, r = int(self._file[i]), int(self._record[i])
        offsets, lengths = self._spans[k]
        if r >= len(offsets):
            raise FormatError(self._problems[k])
        data = self.ranges.read(self.paths[k], int(offsets[r]), int(lengths[r]) + 4)
        record, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
        if masked_crc32c(record) != crc:
            raise FormatError(f"the data's CRC does not match (stored {crc:#010x}, computed "
                              f"{masked_crc32c(record):#010x}): the record is corrupt")
        try:
            return parse_example(record)
        except FormatError as exc:
            raise FormatError(f"not a tf.train.Example ({exc})") from None

    def _infer(self, fields: Sequence[str] | None) -> tuple[Schema, dict[str, str]]:
        head, first_error = [], None
        for i in range(len(self)):
            try:
                head.append(self._example(i))
            except FormatError as exc:  # a bad record is that record's error when it is converted
                first_error = first_error or f"{self.describe(i)}: {exc}"
                continue
            if len(head) == INFER_SAMPLES:
                break
        if not head:
            raise FormatError(f"{self.src}: no readable record (the first: {first_error})")
        keys = {k.replace("/", "."): k for k in head[0]}
        if len(keys) != len(head[0]):
            raise SchemaError(f"{self.src}: two feature keys become one field name when '/' is written as '.'")
        if fields is not None:
            unknown = [f for f in fields if f not in keys]
            if unknown:
                raise SchemaError(f"{self.src}: no field {unknown[0]!r} to keep; the fields are {list(keys)}")
            keys = {name: key for name, key in keys.items() if name in fields}
        where = f"{self.src} (first records)"
        out = [_field_for(name, key, [ex[key] for ex in head if key in ex], where) for name, key in keys.items()]
        if not out:
            raise SchemaError(f"{self.src}: the records have no features")
        return Schema(tuple(out)), keys

    def read(self, i: int) -> dict[str, Any]:
        """Record `i` as a dict of the schema's fields."""
        example = self._example(i)
        missing = [key for key in self._keys.values() if key not in example]
        if missing:
            raise SchemaError(f"no feature {missing} (the first records have them; keep the fields every record "
                              "has with --fields)")
        sample: dict[str, Any] = {}
        for f in self.schema:
            key = self._keys[f.name]
            kind, values = example[key]
            if f.kind in ("bytes", "image"):
                if kind != _BYTES or len(values) != 1:
                    raise SchemaError(f"feature {key!r} is not one byte string here")
                sample[f.name] = values[0]
                if f.kind == "image" and self.decode_check:
                    check_image(values[0], f"feature {key!r}")
            else:
                want = _FLOATS if f.dtype.kind == "f" else _INTS
                if kind != want:
                    raise SchemaError(f"feature {key!r} is a {('no', 'bytes', 'float', 'int64')[kind]} list here, "
                                      f"a {('', '', 'float', 'int64')[want]} list in the first records")
                sample[f.name] = values[0] if f.kind == "scalar" and len(values) == 1 else values
        return sample
