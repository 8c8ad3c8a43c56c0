"""`Block`: a run of samples in columnar form, and the validation that builds it from sample dicts.

The writer moves blocks, not samples: a columnar source (npy, HDF5) produces blocks with no
per-sample Python at all; a dict source pays one validation pass per sample, here.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import SchemaError
from .ragged import Ragged
from .schema import Field, Schema

__all__ = ["Block", "encode_samples", "image_size", "sample_label"]

_Label = Callable[[int], str]  # the label of the i-th sample of a chunk, for messages


@dataclass
class Block:
    """`columns[name]` is an array of shape (n, *shape) for fixed fields, a `Ragged` for variable ones.

    `image_hw[name]` holds (n, 2) uint32 (height, width) for image fields; `shapes[name]` (n, ndim)
    uint32, each sample's shape, for vndarray fields (whose column holds the flattened elements).
    """

    num_samples: int
    columns: dict[str, np.ndarray | Ragged]
    image_hw: dict[str, np.ndarray] = field(default_factory=dict)
    shapes: dict[str, np.ndarray] = field(default_factory=dict)

    def slice(self, start: int, stop: int) -> Block:
        """Samples [start, stop) of this block (views, no copy)."""
        cols: dict[str, np.ndarray | Ragged] = {}
        for name, col in self.columns.items():
            if isinstance(col, Ragged):
                lo, hi = int(col.offsets[start]), int(col.offsets[stop])
                cols[name] = Ragged(col.values[lo:hi], col.offsets[start : stop + 1] - lo, col.kind)
            else:
                cols[name] = col[start:stop]
        hw = {name: arr[start:stop] for name, arr in self.image_hw.items()}
        shapes = {name: arr[start:stop] for name, arr in self.shapes.items()}
        return Block(stop - start, cols, hw, shapes)

    def sample_bytes(self, schema: Schema) -> np.ndarray:
        """Stored bytes per sample (fixed columns + variable payloads), used to cut shards."""
        sizes = np.zeros(self.num_samples, dtype=np.int64)
        for f in schema:
            if f.has_fixed_column:
                sizes += f.item_bytes
            col = self.columns[f.name]
            if isinstance(col, Ragged):
                sizes += col.lengths * f.dtype.itemsize + 8  # payload + one u8 offset
        return sizes


def image_size(data: bytes | memoryview, where: str) -> tuple[int, int]:
    """(height, width) read from an encoded image's header (Pillow reads only the header)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - pillow is a core dependency
        raise ImportError("image fields need Pillow to read image headers: pip install pillow") from exc
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except UnidentifiedImageError as exc:  # PIL's text names the in-memory file by its address
        raise SchemaError(f"{where}: not a readable image (not in any image format PIL reads)") from exc
    except (OSError, ValueError) as exc:
        raise SchemaError(f"{where}: not a readable image ({exc})") from exc
    return height, width


def sample_label(index: int, describe: Callable[[int], str] | None = None) -> str:
    """How messages name source sample `index`: ``sample 7``, or with `describe` (a source's
    `describe(i)`: the input file, line or key it comes from) ``data.jsonl:8: sample 7``."""
    return f"{describe(index)}: sample {index}" if describe is not None else f"sample {index}"


def _where(label: _Label, i: int, name: str) -> str:
    return f"{label(i)}, field {name!r}"


def _cast(arr: np.ndarray, f: Field, label: _Label, values: list[Any]) -> np.ndarray:
    """Cast to the field dtype, refusing lossy casts (float->int, overflow)."""
    src = arr.dtype
    if (
        src.kind not in "biuf"
        or (src.kind == "f" and f.dtype.kind in "biu")
        or (src.kind in "iu" and f.dtype.kind == "b")
    ):
        for i, v in enumerate(values):
            a = np.asarray(v)
            if a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and f.dtype.kind in "biu"):
                raise SchemaError(
                    f"{_where(label, i, f.name)}: expected {f.kind} of {f.dtype}, "
                    f"got {type(v).__name__} {a.dtype}"
                )
        raise SchemaError(f"field {f.name!r}: values of dtype {src} cannot be stored as {f.dtype}")
    out = arr.astype(f.dtype, copy=False)
    if src != f.dtype and src.kind in "iu" and f.dtype.kind in "iu" and not np.array_equal(out, arr):
        bad = int(np.flatnonzero(out.reshape(len(out), -1) != arr.reshape(len(arr), -1))[0] // max(1, out[0].size))
        raise SchemaError(f"{_where(label, bad, f.name)}: value out of range for {f.dtype}")
    return out


def _fixed_column(f: Field, values: list[Any], label: _Label) -> np.ndarray:
    if f.kind == "ndarray":
        for i, v in enumerate(values):
            shape = np.shape(v)
            if shape != f.shape:
                raise SchemaError(
                    f"{_where(label, i, f.name)}: shape {shape} != schema shape {f.shape} "
                    f"(for arrays whose shape varies per sample, use Field({f.name!r}, 'vndarray', "
                    f"dtype, shape=(-1, ...)) with -1 where it varies)"
                )
    else:
        for i, v in enumerate(values):
            if not isinstance(v, (int, float, bool, np.generic)) and np.ndim(v) != 0:
                raise SchemaError(f"{_where(label, i, f.name)}: expected a scalar, got {type(v).__name__}")
    arr = np.asarray(values) if values else np.zeros((0, *f.shape), f.dtype)
    return _cast(arr, f, label, values)


def _variable_column(f: Field, values: list[Any], label: _Label) -> Ragged:
    if f.kind in ("bytes", "image"):
        for i, v in enumerate(values):
            if not isinstance(v, (bytes, bytearray, memoryview, np.ndarray)) or (
                isinstance(v, np.ndarray) and (v.dtype != np.uint8 or v.ndim != 1)
            ):
                raise SchemaError(f"{_where(label, i, f.name)}: expected bytes, got {type(v).__name__}")
        return Ragged.from_list([bytes(v) if isinstance(v, np.ndarray) else v for v in values], kind=f.kind)
    if f.kind == "string":
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise SchemaError(f"{_where(label, i, f.name)}: expected str, got {type(v).__name__}")
        return Ragged.from_list(values, kind="string")
    parts = []
    for i, v in enumerate(values):
        a = np.asarray(v)
        if a.ndim != 1:
            raise SchemaError(
                f"{_where(label, i, f.name)}: expected a 1-D array, got shape {a.shape} (for N-D arrays "
                f"whose shape varies, use Field({f.name!r}, 'vndarray', dtype, shape=(-1, ...)))"
            )
        if a.size and (a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and f.dtype.kind in "biu")):
            raise SchemaError(f"{_where(label, i, f.name)}: expected numbers of {f.dtype}, got {a.dtype}")
        cast = a.astype(f.dtype)
        if a.size and a.dtype.kind in "iu" and not np.array_equal(cast, a):
            raise SchemaError(f"{_where(label, i, f.name)}: value out of range for {f.dtype}")
        parts.append(cast)
    return Ragged.from_list(parts, kind="varray", dtype=f.dtype)


def _shape_column(f: Field, values: list[Any], label: _Label) -> tuple[list[Any], np.ndarray]:
    """A vndarray field's values as flat arrays, and their shapes as (n, ndim) uint32; every shape is
    checked against the schema's (its rank, and every dimension that is not -1)."""
    flat, shapes = [], np.zeros((len(values), len(f.shape)), dtype=np.uint32)
    for i, v in enumerate(values):
        a = np.asarray(v)
        bad = a.ndim != len(f.shape) or any(want not in (-1, got) for want, got in zip(f.shape, a.shape))
        if bad or any(d >= 2**32 for d in a.shape):
            raise SchemaError(f"{_where(label, i, f.name)}: shape {a.shape} does not fit {f.shape} (-1: any)")
        shapes[i] = a.shape
        flat.append(a.reshape(-1))
    return flat, shapes


def encode_samples(
    samples: list[dict[str, Any]],
    schema: Schema,
    *,
    first_index: int = 0,
    describe: Callable[[int], str] | None = None,
) -> Block:
    """Validate sample dicts (source samples `first_index`, ...) against the schema and build a Block.
    Errors name the sample and field, and with `describe` (the source's `describe(i)`) the input it
    comes from (`sample_label`)."""

    def label(i: int) -> str:
        return sample_label(first_index + i, describe)

    names = set(schema.names)
    for i, s in enumerate(samples):
        if not isinstance(s, dict):
            raise SchemaError(f"{label(i)}: expected a dict of fields, got {type(s).__name__}")
        if s.keys() != names:
            missing, extra = sorted(names - s.keys()), sorted(set(s) - names)
            raise SchemaError(f"{label(i)}: fields differ from the schema (missing {missing}, extra {extra})")
    cols: dict[str, np.ndarray | Ragged] = {}
    hw: dict[str, np.ndarray] = {}
    shapes: dict[str, np.ndarray] = {}
    for f in schema:
        values = [s[f.name] for s in samples]
        if f.kind == "vndarray":
            values, shapes[f.name] = _shape_column(f, values, label)
        if f.is_fixed:
            cols[f.name] = _fixed_column(f, values, label)
        else:
            cols[f.name] = _variable_column(f, values, label)
        if f.kind == "image":
            hw[f.name] = np.array(
                [image_size(v, _where(label, i, f.name)) for i, v in enumerate(values)], dtype=np.uint32
            ).reshape(-1, 2)
    return Block(len(samples), cols, hw, shapes)
