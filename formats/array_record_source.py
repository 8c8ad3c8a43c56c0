"""Grain's ArrayRecord files as a convert source: one ``.array_record`` file, or a folder of them.

Record i is counted across the files in name order. Each record becomes ``{"record": bytes}``
unless a decode plug-in is named (``--decode MODULE:FUNC``, `decode="MODULE:FUNC"`): a function
the user writes, taking the record's bytes and returning a dict of fields (numbers, strings,
bytes, numpy arrays; the schema is inferred from the first records, as for JSON lines). The
records are read with the `array_record` package (extra ``migrate``), whose reader checks each
chunk's hash. A file that cannot be opened is one bad input (named, and left out with
``--on-error=skip``); a record that fails to read or decode is named by file and record.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import FormatError, SchemaError
from .schema import Field, Schema

__all__ = ["ArrayRecordFiles", "is_array_record", "load_decoder"]

EXTENSION = ".array_record"
_INFER = 64  # decoded records the schema is inferred from


def is_array_record(path: str) -> bool:
    """A ``.array_record`` file, or a folder of only such files (``x.array_record-00000-of-00008`` names count)."""
    if os.path.isfile(path):
        return EXTENSION in os.path.basename(path)
    entries = [e for e in os.listdir(path) if not e.startswith(".")] if os.path.isdir(path) else []
    return bool(entries) and all(EXTENSION in e for e in entries)


def load_decoder(spec: str) -> Callable[[bytes], dict[str, Any]]:
    """The function `spec` names as ``MODULE:FUNC``: the module imported as usual, from `sys.path`, and
    from the current directory, as `python -m` and `python script.py` find one (the `fastload`
    command's own `sys.path` lacks it)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--decode {spec!r}: expected MODULE:FUNC, e.g. mypkg.records:decode")
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)  # after the installed packages: a local file does not shadow one of them
    try:
        func = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--decode {spec!r}: cannot load it ({exc})") from exc
    if not callable(func):
        raise ValueError(f"--decode {spec!r}: {module}.{name} is not callable")
    return func  # type: ignore[no-any-return]


class ArrayRecordFiles:
    """ArrayRecord files as a map-style source of sample dicts (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, decode: str | None = None) -> None:
        from array_record.python import array_record_module

        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            self.files = sorted(os.path.join(self.path, e) for e in os.listdir(self.path)
                                if EXTENSION in e and not e.startswith("."))
        else:
            self.files = [self.path]
        if not self.files:
            raise FormatError(f"{self.path}: no {EXTENSION} files")
        self.decode_spec = decode
        self._decode = load_decoder(decode) if decode else None
        self.unreadable: dict[int, str] = {}  # file -> why it cannot be opened (one bad input each)
        counts = []
        for k, name in enumerate(self.files):
            try:
                reader = array_record_module.ArrayRecordReader(name)
                if not reader.ok():  # e.g. no ArrayRecord footer: the reader opens but reports a bad status
                    raise ValueError("not an ArrayRecord file (the reader's status is not OK)")
                counts.append(reader.num_records())
                reader.close()
            except (OSError, RuntimeError, ValueError) as exc:
                self.unreadable[k] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                counts.append(1)
        self._first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._n = int(self._first[-1])
        self._readers: dict[int, Any] = {}
        self._lock = threading.Lock()  # one read at a time per process: readers are shared by threads
        self._pid = os.getpid()
        self.schema = self._infer_schema()

    def _infer_schema(self) -> Schema:
        if self._decode is None:
            return Schema((Field("record", "bytes"),))
        samples = []
        for i in range(self._n):
            if len(samples) == _INFER:
                break
            try:
                samples.append(self[i])
            except FormatError:
                continue  # a bad record: named when it is read for the conversion
        if not samples:
            raise FormatError(f"{self.path}: no record could be read and decoded to infer the fields from")
        try:
            return Schema.infer(samples)
        except SchemaError as exc:
            raise SchemaError(f"{self.path}: the records decoded by {self.decode_spec}: {exc}") from exc

    def __len__(self) -> int:
        return self._n

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_readers": {}, "_pid": -1}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._n:
            raise IndexError(f"sample index {i} out of range for {self._n} records in {self.path}")
        k = int(np.searchsorted(self._first, i, side="right") - 1)
        return k, i - int(self._first[k])

    def describe(self, i: int) -> str:
        """Where sample `i` comes from (file and record), for error reports."""
        k, j = self._locate(int(i))
        return self.files[k] if k in self.unreadable else f"{self.files[k]}: record {j} (sample {i})"

    def _reader(self, k: int) -> Any:
        """File k's reader in this process (the caller holds `_lock`)."""
        from array_record.python import array_record_module

        reader = self._readers.get(k)
        if reader is None:
            reader = self._readers[k] = array_record_module.ArrayRecordReader(
                self.files[k], "readahead_buffer_size:0"
            )
        return reader

    def record(self, i: int) -> bytes:
        """The raw bytes of record `i`."""
        k, j = self._locate(int(i))
        if k in self.unreadable:
            raise FormatError(f"{self.files[k]}: cannot open as ArrayRecord ({self.unreadable[k]})")
        if self._pid != os.getpid():  # a forked child: its own readers and lock, never the parent's
            self._readers, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        try:
            with self._lock:
                return bytes(self._reader(k).read([j])[0])
        except (OSError, RuntimeError, ValueError, IndexError) as exc:
            raise FormatError(f"{self.describe(i)}: cannot read ({exc})") from exc

    def __getitem__(self, i: int) -> dict[str, Any]:
        data = self.record(i)
        if self._decode is None:
            return {"record": data}
        try:
            sample = self._decode(data)
        except Exception as exc:  # the user's plug-in: whatever it raises names the record
            raise FormatError(f"{self.describe(i)}: {self.decode_spec} failed ({type(exc).__name__}: {exc})") from exc
        if not isinstance(sample, dict) or not sample:
            raise FormatError(f"{self.describe(i)}: {self.decode_spec} returned {type(sample).__name__}, "
                              "not a non-empty dict of fields")
        return sample
