"""Crop windows and flips, computed on the host so every backend applies the same ones.

Random draws come from a counter-based hash (splitmix64) of `(seed, epoch, sample index,
draw number)`, vectorised over the batch with numpy integer arithmetic. The parameters of a
sample therefore depend only on those four numbers: not on the batch it lands in, the worker
that processes it, the backend, or how many batches ran before (exact resume).

A crop window is `(y0, x0, h, w)` in integer pixels of the decoded (full-size) image; the
image is then resized from that window to the output size.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "batch_windows",
    "center_crop",
    "center_window",
    "output_hw",
    "random_flips",
    "random_resized_crop",
    "random_window",
    "uniforms",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def uniforms(*, seed: int, epoch: int, indices: np.ndarray, draws: int) -> np.ndarray:
    """`(B, draws)` float64 uniforms in [0, 1), a pure function of (seed, epoch, index, draw)."""
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64).reshape(-1, 1)
    k = np.arange(draws, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        h = _mix(np.full(1, seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64) + _GOLDEN)
        h = _mix(h ^ (np.uint64(epoch & 0xFFFFFFFFFFFFFFFF) * _GOLDEN))
        h = _mix(h ^ (idx * _M1 + _GOLDEN))
        h = _mix(h ^ (k * _M2 + _GOLDEN))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def output_hw(size: int | tuple[int, int]) -> tuple[int, int]:
    """Normalise `size` (int or (height, width)) to a (height, width) pair."""
    if isinstance(size, int):
        return size, size
    h, w = size
    return int(h), int(w)


def random_resized_crop(
    sizes: np.ndarray,
    *,
    seed: int,
    epoch: int,
    indices: np.ndarray,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> np.ndarray:
    """torchvision's RandomResizedCrop window sampling, vectorised: `(B, 4)` int64 (y0, x0, h, w).

    Up to `attempts` (area fraction, log aspect ratio) draws; the first that fits is used,
    else a centre crop with the aspect ratio clamped into `ratio`.
    """
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    n = len(sizes)
    u = uniforms(seed=seed, epoch=epoch, indices=indices, draws=4 * attempts).reshape(n, attempts, 4)
    H = sizes[:, 0:1].astype(np.float64)
    W = sizes[:, 1:2].astype(np.float64)
    area = H * W
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(lo + (hi - lo) * u[..., 1])
    w = np.rint(np.sqrt(target * aspect))
    h = np.rint(np.sqrt(target / aspect))
    ok = (w > 0) & (h > 0) & (w <= W) & (h <= H)
    first = np.argmax(ok, axis=1)
    found = ok[np.arange(n), first]
    rows = np.arange(n)
    h_sel, w_sel = h[rows, first], w[rows, first]
    y0 = np.floor(u[rows, first, 2] * (H[:, 0] - h_sel + 1))
    x0 = np.floor(u[rows, first, 3] * (W[:, 0] - w_sel + 1))
    out = np.stack([y0, x0, h_sel, w_sel], axis=1)
    if not found.all():
        fb = _fallback_crop(sizes[~found], ratio)
        out[~found] = fb
    return out.astype(np.int64)


def _fallback_crop(sizes: np.ndarray, ratio: tuple[float, float]) -> np.ndarray:
    H = sizes[:, 0].astype(np.float64)
    W = sizes[:, 1].astype(np.float64)
    in_ratio = W / H
    w = np.where(in_ratio < ratio[0], W, np.where(in_ratio > ratio[1], np.rint(H * ratio[1]), W))
    h = np.where(in_ratio < ratio[0], np.rint(W / ratio[0]), H)
    y0 = np.floor((H - h) / 2)
    x0 = np.floor((W - w) / 2)
    return np.stack([y0, x0, h, w], axis=1)


def center_crop(sizes: np.ndarray, *, size: int | tuple[int, int], crop_fraction: float = 0.875) -> np.ndarray:
    """Eval window `(B, 4)` int64 (y0, x0, h, w).

    The largest window with the output's aspect ratio that fits the image, scaled by
    `crop_fraction` and centred. For a square output this is the same as "resize the
    shorter side to size / crop_fraction, then centre-crop size" (to within rounding of
    one source pixel).
    """
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    oh, ow = output_hw(size)
    H = sizes[:, 0].astype(np.float64)
    W = sizes[:, 1].astype(np.float64)
    fit = np.minimum(H / oh, W / ow) * crop_fraction
    h = np.clip(np.rint(oh * fit), 1, H)
    w = np.clip(np.rint(ow * fit), 1, W)
    y0 = np.rint((H - h) / 2)
    x0 = np.rint((W - w) / 2)
    return np.stack([y0, x0, h, w], axis=1).astype(np.int64)


def random_flips(*, seed: int, epoch: int, indices: np.ndarray, p: float = 0.5) -> np.ndarray:
    """`(B,)` bool horizontal-flip flags with probability `p` (a draw separate from the crop's)."""
    u = uniforms(seed=seed ^ 0x5F1A5, epoch=epoch, indices=indices, draws=1)[:, 0]
    return u < p


def center_window(sizes: np.ndarray, *, size: int | tuple[int, int]) -> np.ndarray:
    """Crop-only eval window `(B, 4)` int64: `size` pixels centred (torchvision `CenterCrop`
    offsets); an image smaller than `size` in a dimension gives its whole extent there."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    out = np.asarray(output_hw(size), dtype=np.int64).reshape(1, 2)
    hw = np.minimum(sizes, out)
    y0x0 = np.rint((sizes - hw) / 2).astype(np.int64)
    return np.concatenate([y0x0, hw], axis=1)


def random_window(
    sizes: np.ndarray, *, size: int | tuple[int, int], seed: int, epoch: int, indices: np.ndarray
) -> np.ndarray:
    """Crop-only train window `(B, 4)` int64 (`RandomCrop(size)`): `size` pixels at a uniform
    position; an image smaller than `size` in a dimension gives its whole extent there."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    out = np.asarray(output_hw(size), dtype=np.int64).reshape(1, 2)
    hw = np.minimum(sizes, out)
    u = uniforms(seed=seed ^ 0xC20B, epoch=epoch, indices=indices, draws=2)
    y0x0 = np.floor(u * (sizes - hw + 1)).astype(np.int64)
    return np.concatenate([y0x0, hw], axis=1)


def batch_windows(
    sizes: np.ndarray,
    *,
    keys: np.ndarray,
    seed: int,
    epoch: int,
    train: bool,
    out_hw: tuple[int, int],
    resize: bool,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    crop_fraction: float,
    flip_p: float,
    dct_downscale: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """An image preset's (windows, flips, DCT scale nums or None) for images of `sizes` keyed by
    dataset index `keys`: RandomResizedCrop (`train`) or the centre crop, or without `resize` a
    random / centre output-sized window. With `dct_downscale`, resized windows of 2x the output
    or more are aligned to their DCT scale's pixel grid (`cpu_decode.dct_windows`), on the host,
    so every backend crops the same window."""
    from fastload.vision.cpu_decode import dct_windows

    if not resize and train:
        windows = random_window(sizes, size=out_hw, seed=seed, epoch=epoch, indices=keys)
    elif not resize:
        windows = center_window(sizes, size=out_hw)
    elif train:
        windows = random_resized_crop(sizes, seed=seed, epoch=epoch, indices=keys, scale=scale, ratio=ratio)
    else:
        windows = center_crop(sizes, size=out_hw, crop_fraction=crop_fraction)
    if flip_p > 0:
        flips = random_flips(seed=seed, epoch=epoch, indices=keys, p=flip_p)
    else:
        flips = np.zeros(len(sizes), dtype=bool)
    nums = None
    if dct_downscale and resize:
        windows, nums = dct_windows(sizes, windows, out_hw)
    return windows, flips, nums
