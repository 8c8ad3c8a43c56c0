"""`ValueSpans`: where each LMDB record's value lies in the environment's data file, for one snapshot.

A read transaction with `buffers=True` hands out views into LMDB's own mapping of the data file;
a view's address minus the mapping's base is the value's byte offset in the file. Those spans are
learnt as values are first read, and are valid only for the committed transaction they were read
in: while the environment's last transaction id is unchanged before and after a copy, the pages
of that snapshot were not rewritten (LMDB reuses a page only after a later commit has freed it),
so a batch of known values is one bounds-checked ranged copy out of a read-only mapping of the
file (`gather_ranges`), with no B-tree lookup per key. Any change of the id drops every span.

The mapping's base comes from /proc/self/maps (Linux); elsewhere nothing is learnt and every
batch goes through `txn.get`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from .forksafe import reset_in_child
from .ragged import gather_ranges

try:  # optional C extension (setup.py): buffer addresses in one call
    from ._ranges import spans as _c_spans
except ImportError:  # pragma: no cover - built everywhere CI runs
    _c_spans = None

__all__ = ["ValueSpans", "mapping_base", "view_spans"]


def mapping_base(address: int, path: str) -> int | None:
    """The address where byte 0 of file `path` would lie in the mapping of it that holds `address`
    (that mapping's start minus its file offset), or None when no mapping of `path` holds it."""
    try:
        with open("/proc/self/maps", "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split(b"-"))
        if lo <= address < hi:
            dev_major, dev_minor = (int(x, 16) for x in parts[3].split(b":"))
            same = int(parts[4]) == st.st_ino and os.makedev(dev_major, dev_minor) == st.st_dev
            return lo - int(parts[2], 16) if same else None
    return None


def view_spans(views: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, lengths) of buffer objects, int64."""
    addresses = np.empty(len(views), dtype=np.int64)
    lengths = np.empty(len(views), dtype=np.int64)
    if _c_spans is not None:
        _c_spans(views, addresses, lengths)
    else:
        for i, v in enumerate(views):
            arr = np.frombuffer(v, dtype=np.uint8)
            addresses[i], lengths[i] = arr.ctypes.data, arr.size
    return addresses, lengths


class ValueSpans:
    """Byte ranges of `count` records' values in the data file at `path`, learnt per record and valid
    for transaction `txnid` only (-1: none learnt yet). The spans and the id they belong to change
    together under one lock, so a reader never pairs spans with another snapshot's id."""

    def __init__(self, path: str, count: int) -> None:
        self.path = path
        self.starts = np.full(count, -1, dtype=np.int64)  # -1: not known for this snapshot
        self.lengths = np.zeros(count, dtype=np.int64)
        self.txnid = -1
        self._file: np.ndarray | None = None
        self._env: Any = None  # the environment whose mapping `_base` belongs to
        self._base: int | None = None
        self._new_lock()

    def _new_lock(self) -> None:
        self._lock = threading.Lock()
        reset_in_child(self, ValueSpans._new_lock)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = state["_env"] = state["_base"] = None  # each process maps and locates its own
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_lock()

    def close(self) -> None:
        """Drop this object's mapping of the data file (unmapped once no batch refers to it) and its
        hold on the environment (closed once no reader holds it); a later read maps the file again,
        and the next `learn` locates the mapping of the environment it reads through."""
        with self._lock:
            self._file = None
            self._env = self._base = None

    def reset(self, txnid: int) -> None:
        """Forget every span: they now describe snapshot `txnid`, of which nothing is known yet."""
        with self._lock:
            self._reset(txnid)

    def _reset(self, txnid: int) -> None:
        self.starts.fill(-1)
        self.txnid = txnid

    def known(self) -> int:
        """How many records' spans are known for snapshot `txnid`."""
        with self._lock:
            return int(np.count_nonzero(self.starts >= 0))

    def learn(self, env: Any, txnid: int, indices: np.ndarray, addresses: np.ndarray, lengths: np.ndarray) -> None:
        """Record where the values of records `indices` lie in the file, from `view_spans` of their
        views (read in transaction `txnid` with buffers=True, still open); nothing is recorded where
        that cannot be told."""
        if len(addresses) == 0:
            return
        with self._lock:
            if env is not self._env:
                self._env, self._base = env, mapping_base(int(addresses[0]), self.path)
            if self._base is None:
                return
            starts = addresses - self._base
            if txnid != self.txnid:
                self._reset(txnid)
            self.starts[indices] = starts
            self.lengths[indices] = lengths

    def read(self, env: Any, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The values of records `indices` joined -> (values, offsets), when every one is known for
        the environment's current snapshot and no commit happened during the copy; else None (and
        the spans are dropped if the snapshot changed)."""
        txnid = env.info()["last_txnid"]
        with self._lock:
            if txnid != self.txnid:
                self._reset(txnid)
                return None
            starts = self.starts.take(indices)
            lengths = self.lengths.take(indices)
            file = self._file
        if len(starts) == 0 or int(starts.min()) < 0:
            return None
        if file is None or int((starts + lengths).max()) > len(file):  # not mapped yet, or the file grew
            file = self._file = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            values, offsets = gather_ranges(file, starts, lengths)
        except IndexError:  # past the end of the file: not a span of this snapshot; learn again
            self.reset(-1)
            return None
        if env.info()["last_txnid"] != txnid:  # a commit during the copy: its pages may have been reused
            self.reset(-1)
            return None
        return values, offsets
