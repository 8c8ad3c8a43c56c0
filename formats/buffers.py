"""Batch buffers: the memory a batch gather writes into, recycled once nothing refers to it.

A consumer holds a batch or two while the next ones are read (a training step, a Loader's
prefetch). Fresh large allocations then come from the kernel and every 4 KiB of a batch's columns
costs a page fault as it is first written (about a thousand per MiB), which costs as much CPU as the
copy itself. `empty` hands out arrays over pooled buffers instead: a buffer goes back to the pool
when the last array (or tensor made from one) viewing it is garbage, and is handed out again,
its pages already mapped. Small requests are left to the allocator.

An array from `empty` is owned by whoever receives it (the pool keeps no reference while it is in
use): `is_batch_buffer` lets a consumer tell such an array from a view of memory a dataset keeps.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["MAX_KEPT_BYTES", "MIN_BYTES", "empty", "is_batch_buffer", "kept_bytes"]

MIN_BYTES = 256 << 10  # smaller requests: plain np.empty
MAX_KEPT_BYTES = 256 << 20  # at most this many bytes of free buffers are kept for reuse (per process)

_lock = threading.Lock()
_free: dict[int, list[np.ndarray]] = {}  # capacity -> free storage arrays of that many bytes
_kept = 0
_owner_types: dict[int, type] = {}  # capacity -> the ctypes array type of this pool's owners
_owner_set: set[type] = set()


def _new_state_after_fork() -> None:
    """A forked child starts with an empty pool and a fresh lock (its copies of free buffers would
    be copied page by page on first write anyway)."""
    global _lock, _kept
    _lock = threading.Lock()
    _free.clear()
    _kept = 0


os.register_at_fork(after_in_child=_new_state_after_fork)


def _capacity(nbytes: int) -> int:
    """`nbytes` rounded up to a size class of 3 significant bits (at most 12.5% more)."""
    shift = max(nbytes.bit_length() - 3, 0)
    return -(-nbytes >> shift) << shift


def _owner_type(capacity: int) -> type:
    kind = _owner_types.get(capacity)
    if kind is None:  # a subclass of its own, so a mapping owned by another ctypes array is never taken for one
        with _lock:
            kind = _owner_types.get(capacity)
            if kind is None:
                kind = _owner_types[capacity] = type(f"BatchBuffer{capacity}", (ctypes.c_char * capacity,), {})
                _owner_set.add(kind)
    return kind


def _give_back(capacity: int, storage: np.ndarray) -> None:
    global _kept
    with _lock:
        if _kept + capacity <= MAX_KEPT_BYTES:
            _free.setdefault(capacity, []).append(storage)
            _kept += capacity


def empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised writable C-contiguous array of `shape` and `dtype`, over a recycled buffer
    when it takes at least `MIN_BYTES` (else `np.empty`)."""
    global _kept
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    capacity = _capacity(nbytes)
    storage = None
    with _lock:
        free = _free.get(capacity)
        if free:
            storage = free.pop()
            _kept -= capacity
    if storage is None:
        storage = np.empty(capacity, dtype=np.uint8)
    owner = _owner_type(capacity).from_buffer(storage)
    weakref.finalize(owner, _give_back, capacity, storage).atexit = False
    return np.frombuffer(owner, dtype=dtype, count=math.prod(shape)).reshape(shape)


def is_batch_buffer(array: np.ndarray) -> bool:
    """Whether `array` views a buffer from `empty` (memory only its receivers hold)."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return type(base) in _owner_set


def kept_bytes() -> int:
    """Bytes of free buffers the pool keeps now."""
    return _kept
