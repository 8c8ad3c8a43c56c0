"""Host-side image decode: header probing, JPEG via simplejpeg, everything else via Pillow.

All heavy calls (simplejpeg decode, Pillow decode, torch resize) release the GIL, so a
thread pool scales across cores. Images come out as RGB uint8 HWC: grayscale is expanded,
CMYK converted, an alpha channel dropped (not composited). EXIF orientation is not applied
(the DALI backend is configured the same way).
"""

from __future__ import annotations

import io
import struct

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

__all__ = ["CorruptImageError", "crop_resize", "decode_rgb", "is_jpeg", "probe_size", "resize_into"]

_PNG_SIG = b"\x89PNG\r\n\x1a\n"


class CorruptImageError(ValueError):
    """A sample whose bytes are not a decodable image; `index` names the dataset sample."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def is_jpeg(buf: np.ndarray | bytes) -> bool:
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


def _dct_factor(hw: tuple[int, int], window: np.ndarray, out_hw: tuple[int, int]) -> int:
    """Largest power-of-two JPEG DCT downscale (<= 8) that keeps the crop >= the output size."""
    _, _, ch, cw = (int(v) for v in window)
    f = 1
    while f < 8 and ch >= 2 * f * out_hw[0] and cw >= 2 * f * out_hw[1]:
        f *= 2
    return f


def decode_rgb(
    buf: np.ndarray | bytes,
    *,
    hw: tuple[int, int] | None = None,
    window: np.ndarray | None = None,
    out_hw: tuple[int, int] | None = None,
) -> tuple[np.ndarray, float]:
    """Decode to RGB uint8 (H, W, 3); returns (image, scale) where scale = decoded/original size.

    With `hw`, `window` and `out_hw`, a JPEG whose crop window is at least twice the output
    size is decoded at 1/2, 1/4 or 1/8 scale in the DCT (libjpeg-turbo scaling): much less
    work, and itself an anti-aliasing downscale.
    """
    if is_jpeg(buf) and simplejpeg is not None:
        kw = {}
        if hw is not None and window is not None and out_hw is not None:
            f = _dct_factor(hw, window, out_hw)
            if f > 1:
                kw = {
                    "min_height": -(-hw[0] // f),
                    "min_width": -(-hw[1] // f),
                    "min_factor": float(f),
                }
        try:
            img = simplejpeg.decode_jpeg(memoryview(buf), colorspace="RGB", **kw)
            scale = img.shape[0] / hw[0] if hw is not None else 1.0
            return img, scale
        except ValueError:
            pass  # CMYK / YCCK / odd JPEGs: Pillow below (and a real error if it fails too)
    with _pil_open(buf) as im:
        im.load()
        if im.mode != "RGB":
            im = im.convert("RGB")
        img = np.asarray(im)
    return img, 1.0


def _crop(img: np.ndarray, window: np.ndarray, scale: float) -> np.ndarray:
    """The `window` (y0, x0, h, w in original pixels) of `img`; `scale` maps to decoded pixels."""
    y0, x0, h, w = (int(v) for v in window)
    if scale != 1.0:
        y1, x1 = round((y0 + h) * scale), round((x0 + w) * scale)
        y0, x0 = round(y0 * scale), round(x0 * scale)
        y1 = min(max(y1, y0 + 1), img.shape[0])
        x1 = min(max(x1, x0 + 1), img.shape[1])
    else:
        y1, x1 = y0 + h, x0 + w
    return img[y0:y1, x0:x1]


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


def resize_into(img: np.ndarray, window: np.ndarray, out: torch.Tensor, *, scale: float = 1.0) -> None:
    """Crop `window` of `img` (H, W, 3 uint8) and resize it with antialiased bilinear (torch's
    uint8 kernel) into `out`, a (h, w, 3) uint8 CPU tensor (any strides; a contiguous one,
    i.e. channels-last, is the fast case). No per-image temporaries beyond the crop copy."""
    crop = _crop(img, window, scale)
    if crop.shape[:2] == tuple(out.shape[:2]):
        np.copyto(out.numpy(), crop)
        return
    if not crop.flags.writeable or not crop.flags.c_contiguous:
        crop = np.array(crop)  # contiguous: torch reads 3-channel pixels without unpacking
    x = torch.from_numpy(crop).permute(2, 0, 1).unsqueeze(0)
    _resize_aa_out(x, out.permute(2, 0, 1).unsqueeze(0))


def crop_resize(img: np.ndarray, window: np.ndarray, out_hw: tuple[int, int], *, scale: float = 1.0) -> np.ndarray:
    """Crop `window` (y0, x0, h, w in original pixels; `scale` maps to decoded pixels) and
    resize to `out_hw` with antialiased bilinear (torch's uint8 channels-last kernel).
    Returns a (H, W, 3) uint8 array (possibly a view of `img` or of a torch tensor)."""
    crop = _crop(img, window, scale)
    if crop.shape[:2] == tuple(out_hw):
        return crop
    out = torch.empty((*out_hw, 3), dtype=torch.uint8)
    resize_into(img, window, out, scale=scale)
    return out.numpy()
