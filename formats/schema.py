"""Typed schema of a fastload dataset: one `Field` per column, no pickle anywhere.

Kinds:
- ``scalar``: one int/float/bool per sample (stored as a fixed-size column).
- ``ndarray``: a fixed-shape array of any numeric numpy dtype (fixed-size column).
- ``bytes``: variable-length bytes (offsets table + blob).
- ``string``: variable-length UTF-8 text (offsets table + blob).
- ``image``: encoded image bytes (JPEG/PNG/...) plus a stored (height, width) column.
- ``varray``: a variable-length 1-D numeric array, e.g. token ids (offsets table + blob).
- ``vndarray``: a numeric array whose shape varies per sample (e.g. feature maps of varying
  length); `shape` gives its dimensions with ``-1`` where they vary; each sample's shape is stored
  beside its elements (a fixed column of ``<u4[ndim]`` + offsets table + blob).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import SchemaError

__all__ = ["FIXED_KINDS", "KIND_CODES", "VARIABLE_KINDS", "VARIES", "Field", "Schema", "infer_field"]

FIXED_KINDS = ("scalar", "ndarray")
VARIABLE_KINDS = ("bytes", "string", "image", "varray", "vndarray")
KIND_CODES = {"scalar": 1, "ndarray": 2, "bytes": 3, "string": 4, "image": 5, "varray": 6, "vndarray": 7}
VARIES = -1  # a `vndarray` dimension that differs between samples
MAX_DIMS = 32  # dimensions of an ndarray / vndarray field
MAX_ITEM_BYTES = 2**32 - 1  # a fixed column's bytes per sample (a shard's field table stores them as u32)


def _check_dtype(dtype: np.dtype, where: str) -> np.dtype:
    if dtype.kind not in "biuf" or dtype.hasobject or dtype.fields is not None:
        raise SchemaError(f"{where}: dtype {dtype} is not supported (numeric bool/int/uint/float only)")
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


@dataclass(frozen=True)
class Field:
    """One column. `dtype` is the element dtype (uint8 for bytes/string/image)."""

    name: str
    kind: str
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.uint8))
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise SchemaError(f"field name must be a non-empty string without '/', got {self.name!r}")
        if self.kind not in KIND_CODES:
            raise SchemaError(f"field {self.name!r}: unknown kind {self.kind!r}; expected one of {list(KIND_CODES)}")
        dtype = _check_dtype(np.dtype(self.dtype), f"field {self.name!r}")
        if self.kind in ("bytes", "string", "image"):
            dtype = np.dtype(np.uint8)
        object.__setattr__(self, "dtype", dtype)
        shape = tuple(int(s) for s in self.shape)
        if self.kind not in ("ndarray", "vndarray") and shape:
            raise SchemaError(f"field {self.name!r}: only ndarray and vndarray fields have a shape")
        lowest = VARIES if self.kind == "vndarray" else 0
        if any(s < lowest for s in shape):
            raise SchemaError(f"field {self.name!r}: negative dimension in shape {shape}")
        if self.kind == "vndarray" and not shape:
            raise SchemaError(
                f"field {self.name!r}: a vndarray needs a shape with -1 where it varies, e.g. (-1, 80)"
            )
        if len(shape) > MAX_DIMS:
            raise SchemaError(f"field {self.name!r}: {len(shape)} dimensions, at most {MAX_DIMS} are supported")
        object.__setattr__(self, "shape", shape)
        # vndarray samples store their shape as u4 each; a fixed column's row size is a u4 in the shard
        if self.kind == "vndarray" and any(s > MAX_ITEM_BYTES for s in shape):
            raise SchemaError(f"field {self.name!r}: a dimension of shape {shape} exceeds {MAX_ITEM_BYTES}")
        if self.item_bytes > MAX_ITEM_BYTES:
            raise SchemaError(
                f"field {self.name!r}: shape {shape} of {dtype} is {self.item_bytes} bytes per sample, "
                f"more than a shard's field table can record ({MAX_ITEM_BYTES})"
            )

    @property
    def is_fixed(self) -> bool:
        """True for fields stored as one fixed-size column (scalar, ndarray)."""
        return self.kind in FIXED_KINDS

    @property
    def has_fixed_column(self) -> bool:
        """True when the shard holds a fixed-size column for this field: its values (scalar,
        ndarray), an image's (height, width) or a vndarray's per-sample shape."""
        return self.kind in FIXED_KINDS or self.kind in ("image", "vndarray")

    @property
    def item_bytes(self) -> int:
        """Bytes per sample in the fixed-size column (image: the stored height/width pair;
        vndarray: the sample's shape as ``<u4[ndim]``)."""
        if self.kind == "image":
            return 8
        if self.kind == "vndarray":
            return 4 * len(self.shape)
        return self.dtype.itemsize * math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        """The field as the manifest stores it."""
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype.str, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: Any) -> Field:
        """A field from its manifest entry (untrusted: every part checked)."""
        if not isinstance(obj, dict) or not {"name", "kind", "dtype"} <= set(obj):
            raise SchemaError(f"malformed field entry {obj!r}")
        shape = obj.get("shape", [])
        if not isinstance(shape, list) or not all(type(s) is int for s in shape):
            raise SchemaError(f"field {obj.get('name')!r}: malformed shape {shape!r}")
        try:
            dtype = np.dtype(str(obj["dtype"]))
        except TypeError as exc:
            raise SchemaError(f"field {obj.get('name')!r}: bad dtype {obj['dtype']!r}") from exc
        return cls(name=obj["name"], kind=obj["kind"], dtype=dtype, shape=tuple(shape))


@dataclass(frozen=True)
class Schema:
    """An ordered list of fields with unique names."""

    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        if not self.fields:
            raise SchemaError("a schema needs at least one field")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise SchemaError(f"duplicate field names in schema: {names}")

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r} in schema (fields: {self.names})")

    @property
    def names(self) -> list[str]:
        """Field names in schema order."""
        return [f.name for f in self.fields]

    def to_json(self) -> list[dict[str, Any]]:
        """The schema as the manifest stores it."""
        return [f.to_json() for f in self.fields]

    @classmethod
    def from_json(cls, obj: Any) -> Schema:
        """A schema from the manifest's list of fields (untrusted: every field checked)."""
        if not isinstance(obj, list):
            raise SchemaError(f"schema must be a list of fields, got {type(obj).__name__}")
        return cls(tuple(Field.from_json(f) for f in obj))

    @classmethod
    def infer(cls, samples: list[dict[str, Any]]) -> Schema:
        """Infer a schema from the first samples of a source.

        A 1-D array whose length differs between these samples becomes a ``varray`` (variable-length)
        field, an N-D array whose shape differs a ``vndarray`` (``-1`` in the dimensions that
        differ), otherwise a fixed ``ndarray``. Pass an explicit schema for images (bytes infer as
        ``bytes``) and for arrays whose shape varies only later in the source.
        """
        if not samples or not isinstance(samples[0], dict) or not samples[0]:
            got = type(samples[0]).__name__ if samples else "nothing"
            raise SchemaError(f"a sample must be a non-empty dict of fields, got {got}")
        fields = []
        for name, value in samples[0].items():
            f = infer_field(name, value)
            if f.kind == "ndarray":
                f = _varying(f, [np.shape(s.get(name)) for s in samples if isinstance(s, dict)])  # type: ignore[arg-type]
            fields.append(f)
        return cls(tuple(fields))


def _varying(f: Field, shapes: list[tuple[int, ...]]) -> Field:
    """`f` (an ndarray field) as the shapes seen in the first samples need: fixed when they agree,
    ``varray`` when 1-D lengths differ, ``vndarray`` when N-D shapes differ."""
    if len(set(shapes)) == 1:
        return f
    ranks = {len(s) for s in shapes}
    if len(ranks) > 1:
        first = next(i for i, s in enumerate(shapes) if len(s) != len(shapes[0]))
        raise SchemaError(
            f"field {f.name!r}: sample 0 has shape {shapes[0]} but sample {first} has {shapes[first]}: "
            "every sample's array needs the same number of dimensions"
        )
    if len(f.shape) == 1:
        return Field(f.name, "varray", f.dtype)
    dims = tuple(VARIES if len({s[d] for s in shapes}) > 1 else shapes[0][d] for d in range(len(f.shape)))
    return Field(f.name, "vndarray", f.dtype, dims)


def infer_field(name: str, value: Any) -> Field:
    """The field kind a Python value maps to."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Field(name, "bytes")
    if isinstance(value, str):
        return Field(name, "string")
    if isinstance(value, (bool, np.bool_)):
        return Field(name, "scalar", np.dtype(np.bool_))
    if isinstance(value, (int, np.integer)):
        return Field(name, "scalar", np.dtype(np.int64) if isinstance(value, int) else value.dtype)
    if isinstance(value, (float, np.floating)):
        return Field(name, "scalar", np.dtype(np.float64) if isinstance(value, float) else value.dtype)
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            return Field(name, "scalar", value.dtype)
        return Field(name, "ndarray", value.dtype, value.shape)
    if isinstance(value, (list, tuple)):
        arr = np.asarray(value)
        if arr.ndim != 1 or arr.dtype.kind not in "biuf":
            raise SchemaError(
                f"field {name!r}: a list must be a flat list of numbers, got {value!r:.80} (pass N-D data as a "
                "numpy array: arrays whose shape varies per sample are stored as a vndarray field)"
            )
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.int64)
        return Field(name, "varray", arr.dtype)
    raise SchemaError(f"field {name!r}: cannot store a value of type {type(value).__name__} (no pickle)")
