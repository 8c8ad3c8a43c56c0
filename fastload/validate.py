"""Argument checks for public entry points: one clear error naming the argument, its value and the fix.

`validate_loader_args` runs first in `fastload.Loader.__init__`; torch's own checks of the
DataLoader arguments (batch_size, sampler combinations, ...) run after it unchanged, so the
drop-in arguments keep torch's messages.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

__all__ = ["WORKER_TYPES", "check_device", "check_int", "cuda_status", "validate_loader_args"]

WORKER_TYPES = ("auto", "thread", "process")


def check_int(name: str, value: Any, *, minimum: int | None = None, optional: bool = False) -> None:
    """Raise unless `value` is an int (not a bool) of at least `minimum`; `None` passes when `optional`."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def cuda_status() -> tuple[bool, str]:
    """`(usable, description)`: the CUDA devices this process sees, or what was found instead."""
    import torch

    if torch.version.cuda is None:
        return False, f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device{where}"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return True, f"{names} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def check_device(name: str, device: Any) -> None:
    """Raise unless `device` (None, str, int or torch.device) names a device this process can use.

    A CUDA device without CUDA names what was found (a CPU-only torch, or no visible device) and
    a CUDA index past the visible devices names how many there are.
    """
    if device is None:
        return
    import torch

    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name} must be None, a str, an int or a torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{name}={device!r} is not a device: {exc}") from exc
    if dev.type != "cuda":
        return
    usable, found = cuda_status()
    if not usable:
        raise RuntimeError(f"{name}={device!r} needs CUDA, but {found}; use {name}='cpu' or None")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name}={device!r}: {count} CUDA device{'s' if count != 1 else ''} visible (0..{count - 1})")


def validate_loader_args(
    *,
    num_workers: Any,
    seed: Any,
    device: Any,
    rank: Any,
    world_size: Any,
    prefetch: Any,
    ring_slots: Any,
    worker_type: Any,
) -> None:
    """Check `fastload.Loader`'s arguments that torch's DataLoader does not check."""
    check_int("num_workers", num_workers, minimum=0)
    check_int("seed", seed, optional=True)
    check_int("world_size", world_size, minimum=1, optional=True)
    check_int("rank", rank, minimum=0, optional=True)
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"rank must be < world_size, got rank={rank}, world_size={world_size}")
    check_int("prefetch", prefetch, minimum=1)
    check_int("ring_slots", ring_slots, minimum=3, optional=True)  # one filling, two held by the consumer
    if worker_type not in WORKER_TYPES:
        raise ValueError(f"worker_type must be one of {WORKER_TYPES}, got {worker_type!r}")
    check_device("device", device)
