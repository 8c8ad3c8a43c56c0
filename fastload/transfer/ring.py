"""`BufferRing`: a bounded set of reused (pinned) byte buffers that batches are packed into.

torch's pin thread allocates a fresh pinned buffer per batch; here a batch's tensors are
copied into one slot of a ring that is reused, so pinned memory is allocated once and is
bounded by `slots` x the largest batch. A slot is reused only when (a) its fence (a CUDA
event for an H2D copy reading it) has completed and (b) nothing outside the ring still
references its storage — a batch the user kept is never overwritten: its slot is retired
from the ring (freed when the user drops it) and a new slot takes its place.

Whether anything still references a slot is read from torch's storage use count
(`torch._C._storage_Use_Count`, a private API). Where it is missing or fails, nothing can
tell a kept batch from a dropped one, so every slot is treated as still referenced: it is
retired, never rewritten (each batch then gets a fresh buffer).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from fastload.fetch.collate import flatten, leaf_nbytes, pack_into, unflatten

__all__ = ["BufferRing", "Slot", "fence_done", "referenced_beyond", "storage_refs"]

_NEW = object()  # `BufferRing._take_free`: allocate a new slot


def fence_done(fence: Any) -> bool:
    """Whether `fence` has completed, asked without waiting (a CUDA event's `query()`); False for a
    fence that cannot be asked (e.g. `DeviceWideFence`): it is waited for only when no other
    slot will do."""
    query = getattr(fence, "query", None)
    return bool(query()) if callable(query) else False


def storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors/arrays share `t`'s storage (+1 for the temporary handle); None when this
    torch cannot say (no `torch._C._storage_Use_Count`, or it fails)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    try:
        return int(fn(t.untyped_storage()._cdata))
    except Exception:  # noqa: BLE001 - a private API: any failure means "unknown"
        return None


def referenced_beyond(t: torch.Tensor, baseline: int | None) -> bool:
    """Whether something besides its owner (whose own count is `baseline`) may still reference
    `t`'s storage. True whenever the count is unknown: a buffer is reused only when provably free."""
    refs = storage_refs(t)
    return baseline is None or refs is None or refs > baseline


class Slot:
    """One ring buffer: a flat uint8 tensor plus its reuse fence."""

    __slots__ = ("baseline", "buf", "fence")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.baseline = storage_refs(buf)
        self.fence: Any = None

    def in_use(self) -> bool:
        """Whether a tensor outside the ring still references this slot's buffer."""
        return referenced_beyond(self.buf, self.baseline)


class BufferRing:
    """At most `slots` live buffers; `write(batch)` packs a batch's tensors into a free one."""

    def __init__(self, slots: int, *, pin: bool, device_index: int | None = None, headroom: float = 1.125) -> None:
        if slots < 1:
            raise ValueError("a BufferRing needs at least one slot")
        self.capacity, self.pin, self.device_index, self.headroom = slots, pin, device_index, headroom
        self._free: deque[Slot] = deque()
        self._live = 0
        self._closed = False
        self._cond = threading.Condition()
        self.allocations = 0
        self.retired = 0

    @property
    def live(self) -> int:
        """Buffers the ring holds now: free ones and those out with a batch (0 once closed and
        every slot given back)."""
        with self._cond:
            return self._live

    def _alloc(self, nbytes: int) -> Slot:
        size = max(64, int(nbytes * self.headroom))
        if self.pin and self.device_index is not None:
            with torch.cuda.device(self.device_index):
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.allocations += 1
        return Slot(buf)

    def acquire(self, nbytes: int) -> Slot:
        """A free slot of at least `nbytes` (blocks while all `slots` are in flight).

        A free slot whose fence has completed is taken first; while fewer than `slots` buffers
        exist, a new one is allocated rather than waiting for a copy still reading a free slot, so
        packing the next batch overlaps the copies in flight (a ring that refilled its one slot
        would wait for each copy before packing the next batch). Only with every slot allocated
        and fenced is the oldest waited for. A fence is waited on outside the ring's lock: other
        threads keep releasing and taking slots meanwhile (the slot taken is off the free list, so
        nobody else can take it).
        """
        while True:
            with self._cond:
                slot = self._take_free()
                while slot is None:
                    self._cond.wait(1.0)
                    slot = self._take_free()
                if slot is _NEW:
                    self._live += 1
                    break  # allocate a new slot, outside the lock
            assert isinstance(slot, Slot)
            if slot.fence is not None:
                slot.fence.synchronize()
                slot.fence = None
            if slot.in_use():  # the user kept that batch: leave it to them
                self._drop(retired=True)
                continue
            if slot.buf.numel() < nbytes:  # too small: replace
                self._drop(retired=False)
                continue
            return slot
        try:
            return self._alloc(nbytes)
        except BaseException:
            self._drop(retired=False)
            raise

    def _take_free(self) -> Slot | object | None:
        """Under the lock: the most recently released free slot whose fence has completed (its
        memory is the likeliest to be in the CPU's caches still: a batch packed alone reuses one
        buffer, not each in turn), else `_NEW` while a buffer may still be allocated, else the
        oldest free slot (its fence to be waited for), else None."""
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            slot = free[i]
            if slot.fence is None or fence_done(slot.fence):
                del free[i]
                slot.fence = None
                return slot
        if self._live < self.capacity:
            return _NEW
        return free.popleft() if free else None

    def _drop(self, *, retired: bool) -> None:
        """A slot leaves the ring (kept by the user, too small, or never allocated)."""
        with self._cond:
            self._live -= 1
            self.retired += retired
            self._cond.notify()

    def release(self, slot: Slot, fence: Any = None) -> None:
        """Give a slot back; `fence` (e.g. a CUDA event) must complete before it is rewritten.
        After `close`, the slot is dropped instead."""
        with self._cond:
            if self._closed:
                self._live -= 1
                return
            slot.fence = fence
            self._free.append(slot)
            self._cond.notify()

    def close(self) -> None:
        """Drop the free slots now (an epoch's end), so the next epoch's ring gets their pinned
        memory back from torch's host allocator instead of page-locking new memory; slots given
        back later are dropped too. Safe while a copy still reads a dropped slot: torch's host
        allocator reuses a freed pinned block only after the copies recorded on it have run."""
        with self._cond:
            self._closed = True
            self._live -= len(self._free)
            self._free.clear()
            self._cond.notify_all()

    def write(self, batch: Any, timings: dict[str, float] | None = None) -> tuple[Any, Slot | None]:
        """Copy the batch's CPU tensors into a slot: `(batch of views, slot)`. With `timings`, the
        wait for a slot is added under "ring_wait" and the copy under "pin"."""
        leaves, spec = flatten(batch)
        if not leaves:
            return batch, None
        t0 = time.perf_counter()
        slot = self.acquire(leaf_nbytes(leaves))
        t1 = time.perf_counter()
        views, _ = pack_into(slot.buf, leaves)
        if timings is not None:
            timings["ring_wait"] = timings.get("ring_wait", 0.0) + t1 - t0
            timings["pin"] = timings.get("pin", 0.0) + time.perf_counter() - t1
        return unflatten(spec, views), slot
