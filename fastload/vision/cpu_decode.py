"""Host-side image decode: header probing, JPEG via simplejpeg, everything else via Pillow.

`decode_windows` (the `_jpegwin` extension, libjpeg-turbo, built when its headers are present)
decodes only a crop window of each JPEG of a batch view (`batch_view`: one values buffer +
offsets), optionally DCT-downscaled by num/8, straight into the caller's output buffer: the
same pixels as `decode_rgb(buf, num=num)` cropped to the window. `probe_sizes` reads a batch
view's headers (`read_sizes`, same extension, for JPEGs).
All heavy calls (the window decoder, simplejpeg, Pillow decode, torch resize) release the
GIL, so a thread pool scales across cores. Images come out as RGB uint8 HWC: grayscale is expanded,
CMYK converted, an alpha channel dropped (not composited). EXIF orientation is not applied
(the DALI backend is configured the same way).
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

try:
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is in the `image` extra
    simplejpeg = None

try:
    from PIL import Image
except ImportError:  # pragma: no cover - pillow is in the `image` extra
    Image = None

try:
    from fastload.vision._jpegwin import decode_windows, read_sizes
except ImportError:  # built by setup.py only where libjpeg-turbo's headers are installed
    decode_windows = read_sizes = None

__all__ = [
    "UNSUPPORTED",
    "CorruptImageError",
    "batch_view",
    "crop_resize",
    "dct_nums",
    "dct_windows",
    "decode_rgb",
    "decode_windows",
    "is_jpeg",
    "probe_size",
    "probe_sizes",
    "read_sizes",
    "resize_hwc",
    "resize_into",
    "scaled_windows",
]

UNSUPPORTED = 2  # `decode_windows` error code: a colour space it leaves to `decode_rgb` (CMYK/YCCK)

_PNG_SIG = b"\x89PNG\r\n\x1a\n"


class CorruptImageError(ValueError):
    """A sample whose bytes are not a decodable image; `index` names the dataset sample."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def is_jpeg(buf: np.ndarray | bytes) -> bool:
    """Whether `buf` starts with the JPEG SOI marker and a segment marker (FF D8 FF); checks only
    those 3 bytes, not that the rest decodes."""
    return len(buf) >= 3 and bytes(buf[:3]) == b"\xff\xd8\xff"


def _pil_open(buf: np.ndarray | bytes) -> Image.Image:
    if Image is None:
        raise ImportError("decoding non-JPEG images needs Pillow: pip install 'fastload[image]'")
    return Image.open(io.BytesIO(memoryview(buf)))


def probe_size(buf: np.ndarray | bytes) -> tuple[int, int]:
    """(height, width) from the header only. Raises ValueError/OSError on a non-image."""
    if len(buf) == 0:
        raise ValueError("empty sample")
    if is_jpeg(buf) and simplejpeg is not None:
        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(memoryview(buf), strict=False)
        except (
            KeyError,
            IndexError,
        ) as e:  # simplejpeg's lookup of an unknown colorspace
            raise ValueError(f"unreadable JPEG header ({type(e).__name__}: {e})") from e
        return int(h), int(w)
    if len(buf) >= 24 and bytes(buf[:8]) == _PNG_SIG and bytes(buf[12:16]) == b"IHDR":
        w, h = struct.unpack(">II", bytes(buf[16:24]))
        if w == 0 or h == 0:
            raise ValueError("PNG with a zero dimension")
        return int(h), int(w)
    with _pil_open(buf) as im:
        w, h = im.size
    return int(h), int(w)


def batch_view(encoded: Any) -> tuple[np.ndarray, np.ndarray]:
    """A `Ragged` (values + offsets) or a sequence of bytes / uint8 arrays -> (uint8 values, int64
    offsets): image i is `values[offsets[i]:offsets[i + 1]]`. A Ragged's values are not copied; a
    sequence is concatenated once."""
    if hasattr(encoded, "offsets") and hasattr(encoded, "values"):
        values = np.ascontiguousarray(encoded.values)
        offsets = np.ascontiguousarray(encoded.offsets, dtype=np.int64) * values.itemsize
        return values.reshape(-1).view(np.uint8), offsets
    parts = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) if isinstance(x, np.ndarray) else x for x in encoded]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([memoryview(x).nbytes for x in parts], out=offsets[1:])
    values = np.frombuffer(b"".join(parts), dtype=np.uint8)
    return values, offsets


def probe_sizes(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """A batch view's (sizes (n, 2) (H, W) int64, is-JPEG flags (the FF D8 FF signature), {position:
    error} for images whose header is unreadable). JPEG headers are read in one `read_sizes` call
    (GIL released); other images, and those it rejects, by `probe_size`."""
    n = len(offsets) - 1
    sizes = np.ones((n, 2), dtype=np.int64)
    if read_sizes is not None:
        rows = np.empty((n, 3), dtype=np.int64)
        read_sizes(values, offsets, rows)
        read = rows[:, 2] == 0
        sizes[read] = rows[read, :2]
        jpeg = rows[:, 2] != 1
        rest = np.flatnonzero(~read).tolist()
    else:
        jpeg = np.array([is_jpeg(values[offsets[i] : offsets[i + 1]]) for i in range(n)], dtype=bool)
        rest = range(n)
    errors: dict[int, str] = {}
    for i in rest:
        try:
            sizes[i] = probe_size(values[offsets[i] : offsets[i + 1]])
        except (ValueError, OSError) as e:
            errors[i] = f"{type(e).__name__}: {e}"
    return sizes, jpeg, errors


def dct_nums(windows: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """Per window, the smallest num in (1, 2, 4, 8) such that the window decoded at num/8 scale
    (libjpeg-turbo's DCT scaling; these are its SIMD-accelerated reduced IDCTs, the other eighths
    are slower than a full-size decode) is still at least `out_hw` in both dimensions: 4 where the
    window is at least 2x the output both ways, 2 at 4x, 1 at 8x, else 8 (full size).
    `scaled_windows` keeps that size: its rounded edges lose no pixel of a window w with
    w * num / 8 >= out."""
    w = np.asarray(windows, dtype=np.int64).reshape(-1, 4)
    need = np.maximum(-(-8 * out_hw[0] // w[:, 2]), -(-8 * out_hw[1] // w[:, 3]))
    nums = np.full(len(w), 8, dtype=np.int64)
    for k in (4, 2, 1):
        nums[need <= k] = k
    return nums


def scaled_windows(sizes: np.ndarray, windows: np.ndarray, nums: np.ndarray) -> np.ndarray:
    """Windows (y0, x0, h, w) of original images of `sizes` (H, W) in pixels of the same images
    decoded at nums/8: edges rounded to the nearest scaled pixel (half up), an edge on the image's
    last row/column to the scaled image's (ceil(H * num / 8) by ceil(W * num / 8), libjpeg's
    output size), at least 1 pixel."""
    s = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    w = np.asarray(windows, dtype=np.int64).reshape(-1, 4)
    k = np.asarray(nums, dtype=np.int64).reshape(-1, 1)
    full = (s * k + 7) // 8
    lo = (2 * w[:, 0:2] * k + 8) // 16
    hi = np.where(w[:, 0:2] + w[:, 2:4] >= s, full, (2 * (w[:, 0:2] + w[:, 2:4]) * k + 8) // 16)
    lo = np.minimum(lo, full - 1)
    hi = np.clip(hi, lo + 1, full)
    return np.concatenate([lo, hi - lo], axis=1)


def dct_windows(sizes: np.ndarray, windows: np.ndarray, out_hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(aligned windows, nums): each window's DCT scale (`dct_nums`) and the window moved onto
    that scale's pixel grid in original pixels (edges to the nearest multiple of 8 / num, at most
    4 / num pixels away; clipped to the image). Decoding an aligned window at num/8 covers exactly
    it (a partial last scaled pixel on the image's edge aside), so a full-size decode + crop of
    the aligned window + resize is the reference the scaled decode is compared with."""
    s = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    nums = dct_nums(windows, out_hw)
    scaled = scaled_windows(s, windows, nums)
    step = (8 // nums).reshape(-1, 1)
    lo = scaled[:, 0:2] * step
    hi = np.minimum((scaled[:, 0:2] + scaled[:, 2:4]) * step, s)
    return np.concatenate([lo, hi - lo], axis=1), nums


def decode_rgb(buf: np.ndarray | bytes, *, hw: tuple[int, int] | None = None, num: int = 8) -> np.ndarray:
    """Decode to RGB uint8 (H, W, 3). A JPEG with `hw` (its size) and num < 8 is decoded at
    num/8 scale in the DCT (libjpeg-turbo scaling): ceil(H * num / 8) by ceil(W * num / 8)."""
    if is_jpeg(buf) and simplejpeg is not None:
        kw = {}
        if hw is not None and num < 8:
            kw = {"min_height": -(-hw[0] * num // 8), "min_width": -(-hw[1] * num // 8), "min_factor": 1.0}
        try:
            return simplejpeg.decode_jpeg(memoryview(buf), colorspace="RGB", **kw)
        except ValueError:
            if num < 8:
                raise
            # CMYK / YCCK / odd JPEGs: Pillow below (and a real error if it fails too)
    elif num < 8:
        raise ValueError("DCT-domain downscaling needs a JPEG")
    with _pil_open(buf) as im:
        im.load()
        if im.mode != "RGB":
            im = im.convert("RGB")
        return np.asarray(im)


def _crop(img: np.ndarray, window: np.ndarray) -> np.ndarray:
    """The `window` (y0, x0, h, w in pixels of `img`) of `img`: a view."""
    y0, x0, h, w = (int(v) for v in window)
    return img[y0 : y0 + h, x0 : x0 + w]


def _resize_aa_out(x: torch.Tensor, out: torch.Tensor) -> None:
    """Antialiased bilinear resize of `x` (1, C, h, w) into `out` (1, C, H, W), in place.

    Calls the `out=` overload of the op behind `F.interpolate(..., antialias=True)` (same
    kernel, same arguments, same pixels) so the result lands in the caller's memory: with a
    channels-last `out` torch's uint8 AVX2 kernel skips its planar repacking pass.
    """
    try:
        torch.ops.aten._upsample_bilinear2d_aa.out(x, list(out.shape[2:]), False, None, None, out=out)
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch without the out= overload
        out.copy_(F.interpolate(x, size=tuple(out.shape[2:]), mode="bilinear", antialias=True, align_corners=False))


def resize_hwc(src: np.ndarray, out: torch.Tensor) -> None:
    """Resize `src` (h, w, 3 uint8) with antialiased bilinear (torch's uint8 kernel) into `out`, a
    (H, W, 3) uint8 CPU tensor (any strides; a contiguous one, i.e. channels-last, is the fast
    case). A same-size `src` is copied."""
    if src.shape[:2] == tuple(out.shape[:2]):
        np.copyto(out.numpy(), src)
        return
    if not src.flags.writeable or not src.flags.c_contiguous:
        src = np.array(src)  # contiguous: torch reads 3-channel pixels without unpacking
    x = torch.from_numpy(src).permute(2, 0, 1).unsqueeze(0)
    _resize_aa_out(x, out.permute(2, 0, 1).unsqueeze(0))


def resize_into(img: np.ndarray, window: np.ndarray, out: torch.Tensor) -> None:
    """Crop `window` (y0, x0, h, w) of `img` (H, W, 3 uint8) and `resize_hwc` it into `out`."""
    resize_hwc(_crop(img, window), out)


def crop_resize(img: np.ndarray, window: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """Crop `window` (y0, x0, h, w) of `img` and resize to `out_hw` with antialiased bilinear.
    Returns a (H, W, 3) uint8 array (possibly a view of `img` or of a torch tensor)."""
    crop = _crop(img, window)
    if crop.shape[:2] == tuple(out_hw):
        return crop
    out = torch.empty((*out_hw, 3), dtype=torch.uint8)
    resize_hwc(crop, out)
    return out.numpy()
