"""(x - mean) / std into the output dtype and layout.

On the host: a per-channel 256-entry lookup table of the output dtype's bit patterns, applied
to a run of images in one GIL-free pass (the `_lut` extension; numpy `take` per channel where it
is not built): no float temporaries, and bf16 costs the same as fp16. On a CUDA device:
`fastload.cuda_ops.normalize_batch` (the fused kernel) when it is available, else torch ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

try:
    from fastload.vision._lut import apply as _lut_apply
except ImportError:  # not built: numpy's take, per channel
    _lut_apply = None

__all__ = ["BITS_DTYPE", "ChannelLUT", "normalize_on_device"]

BITS_DTYPE = {
    torch.float16: np.uint16,
    torch.bfloat16: np.uint16,
    torch.float32: np.uint32,
    torch.float64: np.uint64,
}


class ChannelLUT:
    """Maps uint8 RGB pixels to normalised values of `dtype`, bit-exact to
    `((x - mean) / std).to(dtype)` computed in float32."""

    def __init__(self, *, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype) -> None:
        if dtype not in BITS_DTYPE:
            raise ValueError(f"unsupported output dtype {dtype}; use one of {list(BITS_DTYPE)}")
        m = torch.tensor(mean, dtype=torch.float32).reshape(3, 1)
        s = torch.tensor(std, dtype=torch.float32).reshape(3, 1)
        values = ((torch.arange(256, dtype=torch.float32).reshape(1, 256) - m) / s).to(dtype)
        self.dtype = dtype
        self.bits = BITS_DTYPE[dtype]
        self.table = np.ascontiguousarray(values.view(_int_view(dtype)).numpy().view(self.bits))

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised `shape` array of the output's bit-pattern dtype (`bits`), for the `out` of
        `apply`/`apply_batch`; `to_tensor` turns it into a tensor of `dtype`."""
        return np.empty(shape, dtype=self.bits)

    def apply(self, img: np.ndarray, out: np.ndarray, *, layout: str) -> None:
        """Write normalised `img` (H, W, 3 uint8, any strides) into `out` (CHW or HWC bits)."""
        for c in range(3):
            dst = out[c] if layout == "NCHW" else out[..., c]
            np.take(self.table[c], img[..., c], out=dst, mode="clip")

    def apply_batch(self, images: np.ndarray, out: np.ndarray, *, layout: str) -> None:
        """Write normalised `images` ((n, H, W, 3) uint8, C-contiguous) into `out` ((n, 3, H, W)
        or (n, H, W, 3) bits, C-contiguous) in one pass."""
        n, h, w, _ = images.shape
        if _lut_apply is not None:
            _lut_apply(images, self.table, out, n, h * w, layout == "NCHW")
            return
        for c in range(3):
            dst = out[:, c] if layout == "NCHW" else out[..., c]
            np.take(self.table[c], images[..., c], out=dst, mode="clip")

    def to_tensor(self, bits: np.ndarray) -> torch.Tensor:
        """Reinterpret a bit-pattern array as a torch tensor of the output dtype (no copy)."""
        signed = {np.uint16: np.int16, np.uint32: np.int32, np.uint64: np.int64}[self.bits]
        return torch.from_numpy(bits.view(signed)).view(self.dtype)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]


def normalize_on_device(
    images_u8: torch.Tensor,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    layout: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Normalise an NHWC uint8 batch where it lives (flips already applied)."""
    try:
        from fastload.cuda_ops import normalize_batch
    except ImportError:
        normalize_batch = None
    if normalize_batch is not None:
        return normalize_batch(
            images_u8,
            mean=list(mean),
            std=list(std),
            flip=None,
            layout=layout,
            dtype=dtype,
        )
    m = torch.tensor(mean, dtype=torch.float32, device=images_u8.device)
    s = torch.tensor(std, dtype=torch.float32, device=images_u8.device)
    out = ((images_u8.float() - m) / s).to(dtype)
    if layout == "NCHW":
        out = out.permute(0, 3, 1, 2).contiguous()
    return out
