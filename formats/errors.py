"""Errors raised for bad datasets and bad input. Each names the file, shard, sample or field."""

from __future__ import annotations

__all__ = ["ChecksumError", "FormatError", "SchemaError"]


class FormatError(ValueError):
    """A dataset file is malformed: bad magic/version, out-of-range offset, truncation, bad manifest."""


class SchemaError(ValueError):
    """A sample does not match the dataset schema (wrong type, shape, dtype, missing field)."""


class ChecksumError(FormatError):
    """A file's content does not match the checksum recorded in the manifest."""
