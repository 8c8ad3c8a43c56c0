"""`CpuStage`: the image preset's CPU backend, one batch at a time (`cpu_batch` does the work).

Owns the helper threads that decode a batch beside the calling thread (`threads - 1` of them,
made on first use, rebuilt when the count changes), the uint8 pixel block each calling thread
reuses when the output is normalised on the host (only the normalised tensor leaves the stage),
while the batches it returns go into `fastload.formats.buffers` (recycled once the caller let go of
them, so a held batch is never written again).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fastload.formats import buffers
from fastload.vision.cpu_batch import BatchJob, run_batch
from fastload.vision.normalize import ChannelLUT

__all__ = ["CpuStage"]


class CpuStage:
    """Decode a batch view into (n, oh, ow, 3) uint8 pixels, normalised by `lut` when given."""

    def __init__(self, *, out_hw: tuple[int, int], layout: str, lut: ChannelLUT | None) -> None:
        self.out_hw, self.layout, self.lut = out_hw, layout, lut
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"], state["_pool_size"], state["_lock"] = None, 0, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

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
            normalized = buffers.empty(shape, bits)
        elif pin:  # copied to the device without waiting: page-locked, a fresh one every batch
            staging = torch.empty((n, oh, ow, 3), dtype=torch.uint8, pin_memory=True)
        else:  # returned: a retired block of an earlier batch, or a fresh one
            staging = torch.from_numpy(buffers.empty((n, oh, ow, 3), np.uint8))
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
