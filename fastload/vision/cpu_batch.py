"""The CPU backend's batch stage: decode, crop, resize, flip, normalise and lay out one batch.

A batch arrives as a batch view (`cpu_decode.batch_view`: the encoded images' bytes in one
values buffer + offsets, as a `Ragged` holds them) and is cut into one contiguous chunk per
thread (the calling thread takes the first). Per chunk, one call of the window decoder
(`cpu_decode.decode_windows`, GIL released) decodes every JPEG's crop window (DCT-downscaled
when asked; from the window's restart interval where the JPEG has a restart index), mirrored in
the decoder when flipped, straight from the values buffer: into the uint8 batch buffer when the
window is the output size (crop only), otherwise into the thread's scratch block (reused batch
after batch) that torch's antialiased resize then reads (a second call, when a chunk has both). The normalising lookup
table then writes the chunk's output in one call. Python runs per chunk, except one resize call
per resized image and the fallbacks: non-JPEG images (Pillow), CMYK/YCCK JPEGs and builds
without the extension decode whole images (`decode_rgb`) and are cropped after, with the same
pixels; so does a JPEG the window decoder rejects as corrupt (it treats every corrupt-data
warning as an error), which then fails unless simplejpeg or Pillow decode it.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np
import torch

from fastload.vision import cpu_decode
from fastload.vision.normalize import ChannelLUT

__all__ = ["MODES", "BatchJob", "run_batch"]


@dataclass
class BatchJob:
    """One batch: the encoded images as a batch view (`values`, `offsets`), which of them are
    JPEGs, their (H, W) sizes, crop windows (original pixels), flips."""

    values: np.ndarray  # uint8: image i is values[offsets[i]:offsets[i + 1]]
    offsets: np.ndarray  # int64, n + 1
    jpeg: np.ndarray  # (n,) bool: the JPEG signature
    sizes: np.ndarray
    windows: np.ndarray
    flips: np.ndarray
    skip: set[int]
    out_hw: tuple[int, int]
    nums: np.ndarray | None  # per image, decode at nums/8 scale (`cpu_decode.dct_windows`); None: 8
    images: np.ndarray  # (n, oh, ow, 3) uint8: the final pixels (flipped), normalised or returned
    lut: ChannelLUT | None = None  # normalise `images` into `normalized` when set
    normalized: np.ndarray | None = None  # (n, 3, oh, ow) or (n, oh, ow, 3) bit patterns
    layout: str = "NCHW"
    modes: dict[str, int] = field(default_factory=dict)  # filled by `run_batch`: images per decode mode

    def encoded(self, i: int) -> np.ndarray:
        """Image i's encoded bytes (a view)."""
        return self.values[self.offsets[i] : self.offsets[i + 1]]


def run_batch(job: BatchJob, *, threads: int, executor: Executor | None) -> dict[int, str]:
    """Fill `job.images` (and `job.normalized`); returns {position: error} for images that failed."""
    n = len(job.offsets) - 1
    nums = np.full(n, 8, dtype=np.int64)
    resized = (job.windows[:, 2] != job.out_hw[0]) | (job.windows[:, 3] != job.out_hw[1])
    if job.nums is not None:
        scale = resized & job.jpeg  # a crop-only window, or a PNG, is decoded at full size
        nums[scale] = job.nums[scale]
    scaled = cpu_decode.scaled_windows(job.sizes, job.windows, nums)
    todo = np.ones(n, dtype=bool)
    todo[list(job.skip)] = False
    started = np.zeros(n, dtype=np.uint8)  # 1: decoded from a restart interval (the image's restart index)
    bounds = np.linspace(0, n, min(max(threads, 1), max(n, 1)) + 1).astype(np.int64)
    chunks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    failed: dict[int, str] = {}
    futures = []
    plan = (todo, nums, scaled, resized, started)
    if executor is not None:
        futures = [executor.submit(_chunk, job, lo, hi, plan, failed) for lo, hi in chunks[1:]]
        chunks = chunks[:1]
    modes: Counter[str] = Counter()
    for lo, hi in chunks:
        modes.update(_chunk(job, lo, hi, plan, failed))
    for f in futures:
        modes.update(f.result())
    job.modes = dict(modes)
    return failed


# Decode modes (`BatchJob.modes`, the preset's stats) by the scale num of num/8; a window decoded
# from its restart interval (a JPEG with a restart index, see formats/jpeg_restart.py) adds RESTART.
MODES = {8: "window", 4: "window 1/2", 2: "window 1/4", 1: "window 1/8"}
RESTART = ", from its restart interval"


def _mode(num: int, *, whole: bool = False, restart: bool = False) -> str:
    if whole:
        return MODES[num].replace("window", "whole image")
    return MODES[num] + RESTART if restart else MODES[num]


def _count_modes(nums: np.ndarray, started: np.ndarray) -> dict[str, int]:
    """Images per decode mode of windows decoded at `nums`/8, `started` (1) from their restart
    interval: counted per (num, started) pair, not per image."""
    pairs, counts = np.unique(nums.astype(np.int64) * 2 + (started != 0), return_counts=True)
    return {_mode(int(p) // 2, restart=bool(p % 2)): int(c) for p, c in zip(pairs.tolist(), counts.tolist())}


def _chunk(job: BatchJob, lo: int, hi: int, plan: tuple[np.ndarray, ...], failed: dict[int, str]) -> Counter[str]:
    """Decode images lo..hi-1 of `job`; returns how many took each decode mode."""
    todo, nums, scaled, resized, started = plan
    idx = np.arange(lo, hi)[todo[lo:hi]]
    modes: Counter[str] = Counter()
    if cpu_decode.decode_windows is not None:
        windowed = idx[job.jpeg[idx]]
        whole = idx[~job.jpeg[idx]].tolist()
    else:
        windowed, whole = idx[:0], idx.tolist()
    if len(windowed):
        direct, scaled_out = windowed[~resized[windowed]], windowed[resized[windowed]]
        whole += _decode_direct(job, direct, nums, scaled, started)
        whole += _decode_resized(job, scaled_out, nums, scaled, started)
        done = np.setdiff1d(windowed, whole)
        modes.update(_count_modes(nums[done], started[done]))
    for i in sorted(whole):
        try:
            img, window = _decode_whole(job, i, int(nums[i]), scaled[i])
            y0, x0, h, w = (int(v) for v in window)
            crop = img[y0 : y0 + h, x0 : x0 + w]
            _resize(crop[:, ::-1] if job.flips[i] else crop, job.images[i])
            full = img.shape[:2] == tuple(int(v) for v in job.sizes[i])
            modes[_mode(8 if full else int(nums[i]), whole=True)] += 1
        except (ValueError, OSError, RuntimeError) as e:
            failed[i] = f"{type(e).__name__}: {e}"
    if job.lut is not None:
        job.lut.apply_batch(job.images[lo:hi], job.normalized[lo:hi], layout=job.layout)
    return modes


def _params(job: BatchJob, sel: np.ndarray, nums: np.ndarray, scaled: np.ndarray, out_at: np.ndarray) -> np.ndarray:
    """`decode_windows` rows (src, y0, x0, h, w, num, flip, out_offset) for images `sel`."""
    params = np.empty((len(sel), 8), dtype=np.int64)
    params[:, 0] = sel
    params[:, 1:5] = scaled[sel]
    params[:, 5] = nums[sel]
    params[:, 6] = job.flips[sel]  # mirrored by the decoder (see `_resize`)
    params[:, 7] = out_at
    return params


def _decode_windows(job: BatchJob, sel: np.ndarray, params: np.ndarray, out: np.ndarray, started: np.ndarray) -> list:
    """One `decode_windows` call for images `sel`; marks in `started` those decoded from their
    restart interval. Returns the decoder's failures."""
    flags = np.zeros(len(sel), dtype=np.uint8)
    failures = cpu_decode.decode_windows(job.values, job.offsets, params, out, flags)
    started[sel] = flags
    return failures


def _decode_direct(
    job: BatchJob, sel: np.ndarray, nums: np.ndarray, scaled: np.ndarray, started: np.ndarray
) -> list[int]:
    """Crop-only windows of `sel` straight into their slots of `job.images`; returns the images
    the window decoder left to the whole-image decoders (CMYK/YCCK, corrupt data)."""
    if not len(sel):
        return []
    out = job.images.reshape(-1)
    params = _params(job, sel, nums, scaled, sel * (out.size // len(job.images)))
    return [int(sel[row]) for row, _, _ in _decode_windows(job, sel, params, out, started)]


def _decode_resized(
    job: BatchJob, sel: np.ndarray, nums: np.ndarray, scaled: np.ndarray, started: np.ndarray
) -> list[int]:
    """Windows of `sel` into one scratch block, then each resized into its slot of `job.images`;
    returns the images left to the whole-image decoders."""
    if not len(sel):
        return []
    need = scaled[sel, 2] * scaled[sel, 3] * 3
    at = np.concatenate([[0], np.cumsum(need)])
    scratch = _scratch(int(at[-1]))
    params = _params(job, sel, nums, scaled, at[:-1])
    left = {int(sel[row]) for row, _, _ in _decode_windows(job, sel, params, scratch, started)}
    for k, i in enumerate(sel.tolist()):
        if i not in left:
            h, w = int(scaled[i, 2]), int(scaled[i, 3])
            _resize(scratch[at[k] : at[k + 1]].reshape(h, w, 3), job.images[i])
    return sorted(left)


# The window pixels a thread decodes before resizing them live in one block per thread, reused
# batch after batch (a fresh block costs a page fault per 4 KiB): up to this many bytes are kept.
SCRATCH_KEEP = 64 << 20
_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """`nbytes` of this thread's scratch block (contents undefined; only this thread uses it, and
    only until its chunk's resizes are done)."""
    if nbytes > SCRATCH_KEEP:
        return np.empty(nbytes, dtype=np.uint8)
    block = getattr(_SCRATCH, "block", None)
    if block is None or block.size < nbytes:
        block = _SCRATCH.block = np.empty(min(SCRATCH_KEEP, max(nbytes, nbytes + nbytes // 4)), dtype=np.uint8)
    return block[:nbytes]


def _decode_whole(job: BatchJob, i: int, num: int, scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Image i decoded whole (at num/8 when it can be) and its window in the decoded pixels."""
    hw = (int(job.sizes[i, 0]), int(job.sizes[i, 1]))
    if num < 8:
        try:
            return cpu_decode.decode_rgb(job.encoded(i), hw=hw, num=num), scaled
        except ValueError:
            pass  # CMYK/YCCK: no scaled decode there, the full-size one below
    return cpu_decode.decode_rgb(job.encoded(i)), job.windows[i]


def _resize(src: np.ndarray, dst: np.ndarray) -> None:
    """`src` (h, w, 3) resized (or copied) into `dst` (oh, ow, 3). A flip is applied to `src`:
    torch's antialiased bilinear kernel is mirror-symmetric, so resize(mirror(x)) is bit-exactly
    mirror(resize(x)) (tests compare against resize-then-flip at zero tolerance)."""
    cpu_decode.resize_hwc(src, torch.from_numpy(dst))
