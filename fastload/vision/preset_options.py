"""The image preset's options: their checks, and the backend a request resolves to.

`check_options` raises a ValueError naming the option and the value given; `resolve_backend`
turns 'auto' / 'cpu' / 'dali' and the device into the backend that runs ('cpu', 'dali-cpu' or
'dali-mixed'), warning when DALI was asked for (or a CUDA device given) but is not installed.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from fastload.cuda_ops.normalize import IMAGENET_MEAN, IMAGENET_STD  # the kernels' defaults, the presets' too
from fastload.vision.dali_pipeline import DALI_MISSING, dali_available

__all__ = [
    "BACKENDS",
    "EPOCH_KEY",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INDICES_KEY",
    "RESIZE",
    "check_options",
    "resolve_backend",
]

INDICES_KEY = "__indices__"
EPOCH_KEY = "__epoch__"

BACKENDS = ("auto", "cpu", "dali")
RESIZE = ("bilinear", None)


def check_options(
    *,
    kind: str,
    backend: str,
    layout: str | None,
    resize: str | None,
    threads: int | None,
    on_error: str,
    mean: Sequence[float],
    std: Sequence[float],
) -> None:
    """Raise ValueError for an option outside its documented values (see `ImagePreset`)."""
    if kind not in ("train", "eval"):
        raise ValueError(f"kind must be 'train' or 'eval', got {kind!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if layout not in ("NCHW", "NHWC", None):
        raise ValueError(f"layout must be 'NCHW', 'NHWC' or None, got {layout!r}")
    if resize not in RESIZE:
        raise ValueError(f"resize must be one of {RESIZE}, got {resize!r}")
    if threads is not None and int(threads) < 1:
        raise ValueError(f"threads must be >= 1 or None, got {threads!r}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if len(mean) != 3 or len(std) != 3:
        raise ValueError("mean and std need 3 values (RGB, 0..255 units)")


def resolve_backend(requested: str, device: torch.device) -> str:
    """'cpu', 'dali-cpu' or 'dali-mixed' for a requested backend on `device`: 'auto' is DALI's
    mixed decoder on a CUDA device when DALI is installed, else 'cpu'; DALI missing -> 'cpu' with
    a warning where DALI was asked for or a CUDA device given."""
    on_gpu = device.type == "cuda"
    if requested == "cpu":
        return "cpu"
    if not dali_available():
        if requested == "dali" or on_gpu:
            warnings.warn(DALI_MISSING, RuntimeWarning, stacklevel=4)
        return "cpu"
    if requested == "dali":
        return "dali-mixed" if on_gpu else "dali-cpu"
    return "dali-mixed" if on_gpu else "cpu"
