"""`normalize_batch`: uint8 NHWC images -> flipped, normalized float batch in one pass.

The GPU-side finishing step after decode + H2D: instead of torch's five-kernel sequence (cast,
permute, sub, div, flip) that reads and writes the batch five times, one kernel reads each uint8
byte once and writes each output element once. `normalize_batch_reference` defines the semantics;
`normalize_batch` runs the CUDA kernel for CUDA tensors and the reference otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import _nvrtc
from ._registry import NORMALIZE_FUNCTIONS, NORMALIZE_VEC8_FUNCTIONS, NORMALIZE_VEC_FUNCTIONS

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "LAYOUTS", "normalize_batch", "normalize_batch_reference"]

#: ImageNet statistics in 0..255 pixel units (the units `mean`/`std` take).
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

LAYOUTS = ("NCHW", "NHWC")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNELS = ("auto", "generic", "vec4", "vec8")  # normalize_batch(kernel=...)

Stats = float | Sequence[float] | torch.Tensor


def _channel_stats(name: str, value: Stats, channels: int) -> tuple[float, ...]:
    """`mean`/`std` as `channels` floats (a scalar broadcasts), rounded to float32 like the kernel sees them."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64).detach().flatten().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{name} must be a float, a sequence of floats or a tensor, got {type(value).__name__}") \
            from exc
    if t.numel() == 1:
        t = t.expand(channels)
    if t.numel() != channels:
        raise ValueError(f"{name} has {t.numel()} values but the images have {channels} channels")
    return tuple(t.to(torch.float32).tolist())


def _validate(images: torch.Tensor, mean: Stats, std: Stats, flip: torch.Tensor | None, layout: str,
              dtype: torch.dtype) -> tuple[tuple[float, ...], tuple[float, ...], torch.Tensor | None]:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise TypeError(f"images must be uint8, got {images.dtype}")
    if images.dim() != 4:
        raise ValueError(f"images must be (B, H, W, C), got shape {tuple(images.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype not in _DTYPES:
        raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    batch, _, _, channels = images.shape
    if channels < 1:
        raise ValueError("images must have at least one channel")
    mean_t = _channel_stats("mean", mean, channels)
    std_t = _channel_stats("std", std, channels)
    if any(s == 0.0 for s in std_t):
        raise ValueError(f"std must be non-zero, got {std_t}")
    if flip is not None:
        if not isinstance(flip, torch.Tensor):
            raise TypeError(f"flip must be a bool tensor of shape (B,) or None, got {type(flip).__name__}")
        if flip.dtype != torch.bool:
            raise TypeError(f"flip must be a bool tensor, got {flip.dtype}")
        if tuple(flip.shape) != (batch,):
            raise ValueError(f"flip must have shape ({batch},), got {tuple(flip.shape)}")
        flip = flip.to(images.device).contiguous()  # the kernel indexes flip[b] directly
    return mean_t, std_t, flip


def normalize_batch_reference(images: torch.Tensor, *, mean: Stats, std: Stats, flip: torch.Tensor | None = None,
                              layout: str = "NCHW", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch definition of `normalize_batch` (runs on any device)."""
    mean_t, std_t, flip = _validate(images, mean, std, flip, layout, dtype)
    x = images
    if flip is not None:
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(2), x)
    m = torch.tensor(mean_t, dtype=torch.float32, device=images.device)
    s = torch.tensor(std_t, dtype=torch.float32, device=images.device)
    y = ((x.to(torch.float32) - m) / s).to(dtype)
    if layout == "NCHW":
        y = y.permute(0, 3, 1, 2)
    return y.contiguous()


@functools.lru_cache(maxsize=64)
def _device_stats(device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """(2, C) float32 [mean; std] on `device`, cached so steady-state calls do no host-to-device copy."""
    return torch.tensor([mean, std], dtype=torch.float32, device=device)


def _vec_obstacles(src: torch.Tensor, out: torch.Tensor, group: int) -> list[str]:
    """What keeps the vectorized kernel of `group` (4 or 8) pixels per thread from running on these
    tensors (empty: it can run). It needs 3 channels, W % group == 0, the source `group`-byte aligned
    (three loads of `group` bytes per thread), the output `group`-element aligned (vector stores) and
    fewer than 2**31 elements per sample (32-bit offsets within a sample); 8 pixels also need a
    float16/bfloat16 output (8 outputs make one 16-byte store)."""
    _, height, width, channels = src.shape
    needs = []
    if group == 8 and out.element_size() != 2:
        needs.append(f"a float16 or bfloat16 output (got {out.dtype})")
    if channels != 3:
        needs.append(f"3 channels (got {channels})")
    if width % group:
        needs.append(f"width % {group} == 0 (got width {width})")
    if src.data_ptr() % group:
        needs.append(f"the images {group}-byte aligned (data_ptr() % {group} == {src.data_ptr() % group})")
    if out.data_ptr() % (group * out.element_size()):
        needs.append(f"the output {group}-element aligned")
    if channels * height * width >= 2**31:
        needs.append(f"fewer than 2**31 elements per sample (got {channels * height * width})")
    return needs


def _launch_normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...],
                      flip: torch.Tensor | None, layout: str, dtype: torch.dtype,
                      launch: _nvrtc.Launcher, *, kernel: str = "auto") -> torch.Tensor:
    """Run the fused kernel through `launch` on validated inputs.

    kernel: "auto" runs the widest vectorized kernel (8 pixels per thread, then 4) where
    `_vec_obstacles` finds none, else the generic one (one pixel per thread); "generic", "vec4" and
    "vec8" force one (a vectorized kernel that cannot run on these tensors raises ValueError saying
    what it needs).
    """
    batch, height, width, channels = images.shape
    nchw = layout == "NCHW"
    shape = (batch, channels, height, width) if nchw else (batch, height, width, channels)
    out = torch.empty(shape, dtype=dtype, device=images.device)
    if out.numel() == 0:
        return out
    src = images.contiguous()
    stats = _device_stats(images.device, mean, std)
    if kernel == "auto":  # 16-byte stores of 16-bit outputs run closer to copy speed than 8-byte ones
        group = next((g for g in (8, 4) if not _vec_obstacles(src, out, g)), 1)
    elif kernel == "generic":
        group = 1
    else:
        group = int(kernel.removeprefix("vec"))
        needs = _vec_obstacles(src, out, group)
        if needs:
            raise ValueError(f"the {kernel} normalize kernel cannot run here: it needs {'; '.join(needs)} "
                             f"(images {tuple(images.shape)} -> {dtype})")
    name = str(dtype).removeprefix("torch.")
    args = [_nvrtc.ptr(src), _nvrtc.ptr(out), _nvrtc.ptr(flip), _nvrtc.ptr(stats[0]), _nvrtc.ptr(stats[1]),
            _nvrtc.i64(batch)]
    if group > 1:  # x threads walk groups of 4 or 8 pixels; 32-bit offsets within a sample
        function = (NORMALIZE_VEC_FUNCTIONS if group == 4 else NORMALIZE_VEC8_FUNCTIONS)[name]
        args += [_nvrtc.i32(height), _nvrtc.i32(width), _nvrtc.i32(int(nchw))]
    else:
        function = NORMALIZE_FUNCTIONS[name]
        args += [_nvrtc.i64(height), _nvrtc.i64(width), _nvrtc.i64(channels), _nvrtc.i32(int(nchw))]
    columns = width // group
    # x covers a row (rounded up to a warp, at most 256 threads), y fills the block to 256 threads with rows.
    block_x = min(256, -(-columns // 32) * 32)
    block_y = max(1, min(256 // block_x, height))
    grid = (min(-(-height // block_y), 2**31 - 1), min(batch, 65535), 1)
    launch("normalize", function, grid, (block_x, block_y, 1), args, images.device)
    return out


def normalize_batch(images: torch.Tensor, *, mean: Stats, std: Stats, flip: torch.Tensor | None = None,
                    layout: str = "NCHW", dtype: torch.dtype = torch.float32,
                    launcher: _nvrtc.Launcher | None = None, kernel: str = "auto") -> torch.Tensor:
    """Flip, normalize and lay out a uint8 image batch in one pass.

    images: (B, H, W, C) uint8 (decoder output, HWC per image).
    mean, std: per-channel, in 0..255 pixel units like DALI's crop_mirror_normalize (e.g.
        `IMAGENET_MEAN`/`IMAGENET_STD`); a scalar applies to every channel. out = (x - mean[c]) / std[c],
        computed in float32 then rounded (round-to-nearest-even) to `dtype`.
    flip: optional (B,) bool tensor; sample b is mirrored horizontally (along W) where flip[b].
    layout: "NCHW" returns shape (B, C, H, W); "NHWC" returns shape (B, H, W, C), both contiguous.
        `out.permute(0, 3, 1, 2)` of an NHWC result is a free channels_last NCHW view.
    dtype: torch.float32, torch.float16 or torch.bfloat16.

    launcher: runs the kernel instead of NVRTC on the images' device, wherever they are (the
        `Launcher` contract: `(kernel, function, grid, block, args, device)`), e.g. a host
        emulator of the kernel source or a profiling wrapper; the output is allocated as usual.
    kernel: "auto" runs a vectorized kernel for 3-channel images with W % 4 == 0 and aligned tensors
        (8 pixels per thread for float16/bfloat16 outputs with W % 8 == 0 and the images 8-byte
        aligned, else 4), else the generic one; "generic" (one pixel per thread), "vec4" and "vec8"
        force a kernel, for comparisons; a forced vectorized kernel that cannot run on the inputs
        raises ValueError saying why. All give the same bits; the reference path ignores it.

    CUDA tensors run the fused kernel on the current stream; CPU tensors (or CUDA without the
    `[cuda]` extra, with a one-time warning) run `normalize_batch_reference`.
    """
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")
    mean_t, std_t, flip_t = _validate(images, mean, std, flip, layout, dtype)
    launch = launcher if launcher is not None else _nvrtc.kernel_launcher("normalize", images)
    if launch is None:
        return normalize_batch_reference(images, mean=mean_t, std=std_t, flip=flip_t, layout=layout, dtype=dtype)
    return _launch_normalize(images, mean_t, std_t, flip_t, layout, dtype, launch, kernel=kernel)
