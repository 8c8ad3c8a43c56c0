"""fastload.cuda_ops: fused CUDA kernels for the GPU end of the input pipeline.

Each op has a pure-torch reference (`*_reference`, runs anywhere, defines the semantics) and a
CUDA kernel in `kernels/*.cu`, compiled with NVRTC at first use (the optional `[cuda]` extra) and
cached. The public functions dispatch: CUDA tensor + kernel available -> kernel, else reference.
Set FASTLOAD_CUDA_OPS=reference to force the references, =strict to raise instead of falling back.
"""

from __future__ import annotations

import torch

from ._nvrtc import Launcher, cache_dir, compile_kernel, kernel_launcher
from ._registry import ENTRY_POINTS
from .normalize import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    normalize_batch,
    normalize_batch_reference,
)
from .ragged import pad_ragged, pad_ragged_reference

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Launcher",
    "cache_dir",
    "compile_kernel",
    "normalize_batch",
    "normalize_batch_reference",
    "pad_ragged",
    "pad_ragged_reference",
    "warmup",
]


def warmup(device: torch.device | str | int | None = None) -> dict[str, bool]:
    """Compile (or load from the disk cache) every kernel for `device` now, off the training loop's first step.

    Returns {kernel: True if it will run as a CUDA kernel}; all False without CUDA.
    """
    if not torch.cuda.is_available():
        return {name: False for name in ENTRY_POINTS}
    if device is None:
        device = torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    probe = torch.empty(0, device=dev)
    return {name: kernel_launcher(name, probe) is not None for name in ENTRY_POINTS}
