"""`LMDBDataset`: a map-style dataset over an LMDB environment, read lock-free with one transaction per batch.

Sample i is the i-th key in key order: ``{"key": bytes, "value": bytes}``. Values are returned as raw
bytes and never unpickled. Keys are listed once at open (a cursor walk, no values read). Where each
value lies in the data file is learnt as it is first read (`lmdb_spans.py`): a batch of values read
before, in the same committed snapshot, is one ranged copy out of the file, with no per-key lookup.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

from .errors import FormatError
from .lmdb_spans import ValueSpans, view_spans
from .ragged import Ragged, gather_ranges
from .schema import Field, Schema

__all__ = ["LMDBDataset"]

# py-lmdb refuses to open one environment twice in a process: readers of the same path share it, and it
# closes once no reader (and no transaction) holds it any more.
_ENVIRONMENTS: weakref.WeakValueDictionary[tuple[str, bool, int], Any] = weakref.WeakValueDictionary()


class LMDBDataset:
    """Read-only LMDB source: `readonly=True, lock=False, readahead=False`, zero-copy buffers within a batch.

    A commit by another process between batches is seen by the next batch (keys stay those listed
    at open; a deleted one raises FormatError). As LMDB requires of lock-free readers, no process
    may write while a batch is being read.
    """

    schema = Schema((Field("key", "bytes"), Field("value", "bytes")))

    def __init__(
        self, path: str | os.PathLike[str], *, subdir: bool | None = None, map_size: int | None = None
    ) -> None:
        self.path = os.fspath(path)
        self.subdir = os.path.isdir(self.path) if subdir is None else subdir
        self._env: Any = None
        self._pid = -1
        env = self._environment()
        with env.begin(buffers=False) as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
        self._keys = keys
        joined = _joined(keys)  # every key in one buffer: a batch's keys are one ranged gather
        self._key_values, self._key_starts, self._key_lengths = joined.values, joined.offsets[:-1], joined.lengths
        data_file = os.path.join(self.path, "data.mdb") if self.subdir else self.path
        self._spans = ValueSpans(data_file, len(keys))  # learnt as values are first read

    def _environment(self) -> Any:
        import lmdb

        if self._env is None or self._pid != os.getpid():
            key = (os.path.realpath(self.path), self.subdir, os.getpid())
            env = _ENVIRONMENTS.get(key)
            if env is None:
                # A forked child inherits the parent's handle, and py-lmdb refuses a second open of the same
                # files in that child; a read-only, lock-free handle stays valid across fork: reuse it.
                inherited = [e for k, e in _ENVIRONMENTS.items() if k[:2] == key[:2]]
                env = inherited[0] if inherited else None
            if env is None:
                try:
                    env = lmdb.open(self.path, subdir=self.subdir, readonly=True, lock=False, readahead=False)
                except lmdb.Error as exc:
                    raise FormatError(f"{self.path}: cannot open as LMDB ({exc})") from exc
            _ENVIRONMENTS[key] = env
            self._env, self._pid = env, os.getpid()
        return self._env

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"], state["_pid"] = None, -1
        return state

    def __repr__(self) -> str:
        return f"LMDBDataset({self.path!r}, samples={len(self)})"

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        """Drop this dataset's own mapping of the data file and its hold on the environment (shared per
        path: it closes once no other reader of the path holds it); a later read opens them again."""
        self._spans.close()
        self._env, self._pid = None, -1

    @property
    def learnt_values(self) -> int:
        """How many records' places in the data file are known for the snapshot the last batch read
        (learnt as values are first read; a commit by another process resets them): a batch of
        only those records is one ranged copy out of the file, without per-key lookups."""
        return self._spans.known()

    def keys(self) -> list[bytes]:
        """Every key in key order (sample i's key is `keys()[i]`), as a new list."""
        return list(self._keys)

    def _key(self, i: int) -> bytes:
        n = len(self._keys)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} records in {self.path}")
        return self._keys[i]

    def describe(self, i: int) -> str:
        """Where sample `i` comes from (the database and its key), for error reports."""
        return f"{self.path}: key {self._key(i)!r}"

    def lengths(self, field: str = "value") -> np.ndarray:
        """Value sizes in bytes (reads every value once; LMDB keeps no separate index of sizes)."""
        if field != "value":
            raise ValueError("LMDBDataset has lengths for the 'value' field only")
        env = self._environment()
        with env.begin(buffers=True) as txn:
            return np.fromiter((len(txn.get(k)) for k in self._keys), dtype=np.int64, count=len(self._keys))

    def __getitem__(self, index: int) -> dict[str, Any]:
        key = self._key(int(index))
        with self._environment().begin(buffers=False) as txn:
            value = txn.get(key)
        if value is None:
            raise FormatError(f"{self.path}: key {key!r} (sample {index}) disappeared")
        return {"key": key, "value": value}

    def get_batch(self, indices: Any) -> dict[str, Ragged]:
        """Keys and values of a batch as `Ragged`s, the values joined into one buffer by C code.

        Values read before in the environment's current snapshot are one ranged copy out of the
        data file; otherwise one read transaction looks each key up (zero-copy views of the map
        until that one copy) and learns where the values lie. The keys are one ranged gather from
        all keys, held joined since open.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self._keys)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"sample index {bad} out of range for {n} records in {self.path}")
        key_values, key_offsets = gather_ranges(self._key_values, self._key_starts[idx], self._key_lengths[idx])
        env = self._environment()
        known = self._spans.read(env, idx)
        if known is not None:
            values, offsets = known
        else:
            values, offsets = self._lookup(env, idx)
        return {"key": Ragged(key_values, key_offsets, "bytes"), "value": Ragged(values, offsets, "bytes")}

    def _lookup(self, env: Any, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The values of `idx` by one `txn.get` per key in one read transaction -> (values, offsets);
        their places in the data file are learnt on the way."""
        keys = list(map(self._keys.__getitem__, idx.tolist()))
        spans = self._spans
        with env.begin(buffers=True) as txn:
            values = list(map(txn.get, keys))  # zero-copy views of the map, valid inside the transaction
            if not all(values):  # `None in values` would compare each view with None: slow
                missing = [j for j, v in enumerate(values) if v is None]
                if missing:
                    j = missing[0]
                    raise FormatError(f"{self.path}: key {keys[j]!r} (sample {int(idx[j])}) disappeared")
            addresses, lengths = view_spans(values)
            spans.learn(env, txn.id(), idx, addresses, lengths)
            joined = b"".join(values)  # the one copy of the values
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return np.frombuffer(joined, np.uint8), offsets

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        batch = self.get_batch(indices)
        return [{"key": batch["key"][i], "value": batch["value"][i]} for i in range(len(indices))]


def _joined(items: list[bytes] | list[memoryview]) -> Ragged:
    """A Ragged over byte strings, built by `bytes.join` (one C-level copy, no per-item numpy)."""
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, items), dtype=np.int64, count=len(items)), out=offsets[1:])
    return Ragged(np.frombuffer(b"".join(items), dtype=np.uint8), offsets, "bytes")
