"""`CpuStage`: the image preset's CPU backend, one batch at a time (`cpu_batch` does the work).

Owns the helper threads that decode a batch beside the calling thread (`threads - 1` of them,
made on first use, rebuilt when the count changes), the uint8 pixel block each calling thread
reuses when the output is normalised on the host (only the normalised tensor leaves the stage),
and the blocks of the batches it returns (`ReturnedBlocks`: reused once the caller let go of them).
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fastload.vision.cpu_batch import BatchJob, run_batch
from fastload.vision.normalize import ChannelLUT

__all__ = ["CpuStage", "ReturnedBlocks"]


class ReturnedBlocks:
    """Memory blocks for the batches a stage returns, each reused once nothing outside this pool
    refers to it any more, so a batch the caller holds is never written again.

    The tensor made from a block, every view of it (torch or numpy) and its storage keep a
    reference to the block's array, so the block's reference count falls back to the pool's own
    only when the caller has dropped them all; `take` hands out such a retired block, else a fresh
    one (kept for reuse while the pool holds fewer than `keep` blocks and `keep_bytes`). A fresh
    block costs a page fault per 4 KiB written; a retired one is already mapped. Thread-safe.
    """

    def __init__(self, *, keep: int = 8, keep_bytes: int = 256 << 20) -> None:
        self.keep, self.keep_bytes = keep, keep_bytes
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()
        # The count of a block only the pool refers to, measured through the same code as the check.
        self._retired = _refcounts([np.empty(0, dtype=np.uint8)])[0]
        self.reused = 0  # blocks handed out again

    def take(self, nbytes: int) -> np.ndarray:
        """A 1-D uint8 block of `nbytes` (contents undefined) that nothing else refers to."""
        with self._lock:
            counts = _refcounts(self._blocks)
            for block, count in zip(self._blocks, counts, strict=True):
                if block.size == nbytes and count == self._retired:
                    self.reused += 1
                    return block[:]  # a view: the block counts as taken while it (or a view of it) lives
            block = np.empty(nbytes, dtype=np.uint8)
            retired = [k for k, count in enumerate(counts) if count == self._retired]
            while retired and (
                len(self._blocks) >= self.keep or sum(b.size for b in self._blocks) + nbytes > self.keep_bytes
            ):
                del self._blocks[retired.pop()]  # a retired block of another size makes room
            if len(self._blocks) < self.keep and sum(b.size for b in self._blocks) + nbytes <= self.keep_bytes:
                self._blocks.append(block)
            return block[:]

    def clear(self) -> None:
        """Forget every block (those in use stay valid: their holders keep them alive)."""
        with self._lock:
            self._blocks = []


def _refcounts(blocks: list[np.ndarray]) -> list[int]:
    """The reference count of each block of `blocks` (the list's own reference included)."""
    return [sys.getrefcount(b) for b in blocks]


class CpuStage:
    """Decode a batch view into (n, oh, ow, 3) uint8 pixels, normalised by `lut` when given."""

    def __init__(self, *, out_hw: tuple[int, int], layout: str, lut: ChannelLUT | None) -> None:
        self.out_hw, self.layout, self.lut = out_hw, layout, lut
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.returned = ReturnedBlocks()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"], state["_pool_size"], state["_lock"], state["returned"] = None, 0, None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.returned = ReturnedBlocks()

    def close_pool(self) -> None:
        """Let the helper threads go (the next batch makes new ones if it needs them)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = None, 0

    def _executor(self, threads: int) -> ThreadPoolExecutor | None:
        """Helpers for the calling thread: `threads - 1` of them (none for one thread)."""
        helpers = threads - 1
        if helpers < 1:
            return None
        with self._lock:
            if self._pool is None or self._pool_size != helpers:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="fastload-vision")
                self._pool_size = helpers
            return self._pool

    def run(
        self,
        batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        windows: np.ndarray,
        flips: np.ndarray,
        *,
        nums: np.ndarray | None,
        skip: set[int],
        threads: int,
        pin: bool,
    ) -> tuple[torch.Tensor, bool, dict[int, str], dict[str, int]]:
        """`batch` = (values, offsets, JPEG flags, (H, W) sizes) -> (images, whether `lut` normalised
        them (else uint8 NHWC; pinned with `pin`), {position: error}, images per decode mode)."""
        values, offsets, jpeg, sizes = batch
        n = len(sizes)
        oh, ow = self.out_hw
        lut = self.lut
        shape = (n, 3, oh, ow) if self.layout == "NCHW" else (n, oh, ow, 3)
        normalized = None
        if lut is not None:  # internal: this thread's reused pixel block (only the output is returned)
            staging = _staging(n, oh, ow)
            bits = np.dtype(lut.bits)
            normalized = self.returned.take(n * 3 * oh * ow * bits.itemsize).view(bits).reshape(shape)
        elif pin:  # copied to the device without waiting: page-locked, a fresh one every batch
            staging = torch.empty((n, oh, ow, 3), dtype=torch.uint8, pin_memory=True)
        else:  # returned: a retired block of an earlier batch, or a fresh one
            staging = torch.from_numpy(self.returned.take(n * oh * ow * 3).reshape(n, oh, ow, 3))
        job = BatchJob(
            values=values,
            offsets=offsets,
            jpeg=jpeg,
            sizes=sizes,
            windows=windows,
            flips=flips,
            skip=skip,
            out_hw=self.out_hw,
            nums=nums,
            images=staging.numpy(),
            lut=lut,
            normalized=normalized,
            layout=self.layout,
        )
        failed = run_batch(job, threads=threads, executor=self._executor(threads))
        if lut is not None and job.normalized is not None:
            return lut.to_tensor(job.normalized), True, failed, job.modes
        return staging, False, failed, job.modes


_STAGING = threading.local()


def _staging(n: int, oh: int, ow: int) -> torch.Tensor:
    """This thread's (n, oh, ow, 3) uint8 block for pixels that are normalised before returning."""
    t = getattr(_STAGING, "t", None)
    if t is None or t.shape != (n, oh, ow, 3):
        t = _STAGING.t = torch.empty((n, oh, ow, 3), dtype=torch.uint8)
    return t
