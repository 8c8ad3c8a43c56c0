"""`pad_ragged`: a ragged token buffer (flat values + offsets) -> right-padded (B, L) batch.

This is the stable entry point the variable-length NLP path (`fastload.order.bucketing`) calls on the
columnar `Ragged(values, offsets)` a batch arrives as. `pad_ragged_reference` defines the
semantics in plain torch; `pad_ragged` runs one CUDA kernel for CUDA `values`.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _nvrtc
from ._registry import PAD_RAGGED_SUFFIXES

__all__ = ["pad_ragged", "pad_ragged_reference"]

_INT_DTYPES = {
    torch.int8: torch.int8, torch.uint8: torch.int8, torch.int16: torch.int16, torch.uint16: torch.int16,
    torch.int32: torch.int32, torch.uint32: torch.int32, torch.int64: torch.int64, torch.uint64: torch.int64,
}  # dtype -> signed dtype of the same width (bit-identical view used for indexing unsigned types)
_BITS = {torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}
_INT64 = (-(2**63), 2**63 - 1)

Array = torch.Tensor | np.ndarray


def _as_tensor(name: str, value: Array) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    return value


def _dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    bits = _BITS[_INT_DTYPES[dtype]]
    if dtype.is_signed:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _check_int(name: str, value: object, low: int, high: int, dtype_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name}={value} does not fit {dtype_name} [{low}, {high}]")
    return int(value)


def _validate(values: Array, offsets: Array, pad_value: int, pad_to_multiple_of: int, max_len: int | None,
              labels_pad_value: int | None, mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check arguments; returns (values, int64 offsets, L). Syncs once if offsets live on a GPU."""
    values = _as_tensor("values", values)
    offsets = _as_tensor("offsets", offsets)
    if values.dtype not in _INT_DTYPES:
        raise TypeError(f"values must be an integer tensor (int8..int64, uint8..uint64), got {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D (a flat token buffer), got shape {tuple(values.shape)}")
    if offsets.dtype not in _INT_DTYPES or not offsets.dtype.is_signed:
        raise TypeError(f"offsets must be an int64 tensor, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be 1-D of length B + 1 >= 1, got shape {tuple(offsets.shape)}")
    low, high = _dtype_range(values.dtype)
    _check_int("pad_value", pad_value, low, high, str(values.dtype))
    if labels_pad_value is not None:
        _check_int("labels_pad_value", labels_pad_value, *_INT64, "torch.int64")
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
            raise ValueError(f"max_len must be None or an int >= 0, got {max_len!r}")
        if max_len % pad_to_multiple_of:
            raise ValueError(f"max_len={max_len} must be a multiple of pad_to_multiple_of={pad_to_multiple_of}")
    if mask_dtype not in (torch.int64, torch.bool):
        raise TypeError(f"mask_dtype must be torch.int64 or torch.bool, got {mask_dtype}")
    offsets = offsets.to(torch.int64)
    if offsets.numel() > 1:
        lengths = offsets[1:] - offsets[:-1]
        stats = torch.stack([offsets[0], offsets[-1], lengths.min(), lengths.max()]).tolist()
    else:
        stats = [int(offsets[0]), int(offsets[0]), 0, 0]
    first, last, shortest, longest = stats
    if shortest < 0:
        raise ValueError("offsets must be non-decreasing")
    if first < 0 or last > values.numel():
        raise ValueError(f"offsets span [{first}, {last}) outside values of length {values.numel()}")
    if max_len is not None:
        longest = min(longest, max_len)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return values, offsets, length


def _wrap_signed(value: int, dtype: torch.dtype) -> int:
    """`value` reinterpreted as the signed integer of the same width (identity for signed dtypes)."""
    bits = _BITS[_INT_DTYPES[dtype]]
    return value - 2**bits if value >= 2 ** (bits - 1) else value


def _reference(values: torch.Tensor, offsets: torch.Tensor, length: int, pad_value: int,
               labels_pad_value: int | None, mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor | None]:
    device = values.device
    offsets = offsets.to(device)
    batch = offsets.numel() - 1
    signed = _INT_DTYPES[values.dtype]
    work = values.view(signed)  # unsigned types are indexed through a same-width signed view
    starts = offsets[:-1]
    lengths = (offsets[1:] - starts).clamp(max=length)
    pos = torch.arange(length, device=device, dtype=torch.int64)
    mask = pos.unsqueeze(0) < lengths.unsqueeze(1)
    tokens = work[(starts.unsqueeze(1) + pos.unsqueeze(0))[mask]]
    padded = torch.full((batch, length), _wrap_signed(pad_value, values.dtype), dtype=signed, device=device)
    padded[mask] = tokens
    labels = None
    if labels_pad_value is not None:
        labels = torch.full((batch, length), labels_pad_value, dtype=torch.int64, device=device)
        wide = tokens.to(torch.int64)
        bits = _BITS[signed]
        if not values.dtype.is_signed and bits < 64:
            wide = wide & (2**bits - 1)  # zero-extend
        labels[mask] = wide
    return padded.view(values.dtype), mask.to(mask_dtype), labels


def pad_ragged_reference(values: Array, offsets: Array, *, pad_value: int = 0, pad_to_multiple_of: int = 1,
                         max_len: int | None = None, labels_pad_value: int | None = None,
                         mask_dtype: torch.dtype = torch.int64
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure-torch definition of `pad_ragged` (runs on any device)."""
    values, offsets, length = _validate(values, offsets, pad_value, pad_to_multiple_of, max_len, labels_pad_value,
                                        mask_dtype)
    return _reference(values, offsets, length, pad_value, labels_pad_value, mask_dtype)


def _launch_pad_ragged(values: torch.Tensor, offsets: torch.Tensor, length: int, pad_value: int,
                       labels_pad_value: int | None, mask_dtype: torch.dtype, launch: _nvrtc.Launcher
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the kernel through `launch` on validated inputs."""
    device = values.device
    batch = offsets.numel() - 1
    out = torch.empty((batch, length), dtype=values.dtype, device=device)
    mask = torch.empty((batch, length), dtype=mask_dtype, device=device)
    labels = None if labels_pad_value is None else torch.empty((batch, length), dtype=torch.int64, device=device)
    if batch * length == 0:
        return out, mask, labels
    src = values.contiguous()
    offs = offsets.to(device).contiguous()
    block = min(256, -(-length // 32) * 32)
    grid = (min(-(-length // block), 2**31 - 1), min(batch, 65535), 1)
    suffix = PAD_RAGGED_SUFFIXES[str(values.dtype).removeprefix("torch.")]
    function = f"fl_pad_ragged_{suffix}_{'m64' if mask_dtype == torch.int64 else 'mb'}"
    args = [
        _nvrtc.ptr(src), _nvrtc.ptr(offs), _nvrtc.ptr(out), _nvrtc.ptr(mask), _nvrtc.ptr(labels),
        _nvrtc.i64(batch), _nvrtc.i64(length), _nvrtc.i64(_wrap_signed(pad_value, values.dtype)),
        _nvrtc.i64(0 if labels_pad_value is None else labels_pad_value),
    ]
    launch("pad_ragged", function, grid, (block, 1, 1), args, device)
    return out, mask, labels


def pad_ragged(values: Array, offsets: Array, *, pad_value: int = 0, pad_to_multiple_of: int = 1,
               max_len: int | None = None, labels_pad_value: int | None = None,
               mask_dtype: torch.dtype = torch.int64,
               launcher: _nvrtc.Launcher | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Right-pad a ragged token buffer into a (B, L) batch. Stable API used by `fastload.order.bucketing`.

    values: flat 1-D integer tensor (any int dtype, signed or unsigned) or numpy array.
    offsets: int64, length B + 1, non-decreasing; row b is values[offsets[b]:offsets[b + 1]]
        (offsets[0] need not be 0). May live on the CPU while values are on the GPU: then L is
        computed without a device sync (GPU offsets cost one sync for validation and L).
    pad_value: fills padded positions of `padded`; must fit values' dtype.
    pad_to_multiple_of: L = longest row (after truncation) rounded up to a multiple of this.
    max_len: rows longer than this are truncated (keeping their first max_len tokens); must be a
        multiple of pad_to_multiple_of, so L <= max_len.
    labels_pad_value: if given, also return int64 labels = tokens widened to int64 (unsigned types
        zero-extended) with padding set to this value (e.g. -100 for cross-entropy's ignore_index).
    mask_dtype: attention mask dtype, torch.int64 (default, Hugging Face convention) or torch.bool.
    launcher: runs the kernel instead of NVRTC on values' device, wherever they are (the `Launcher`
        contract: `(kernel, function, grid, block, args, device)`), e.g. a host emulator of the
        kernel source or a profiling wrapper.

    Returns (padded [B, L] values.dtype, attention_mask [B, L] mask_dtype with 1/True on tokens,
    labels [B, L] int64 or None), all on values' device. B = 0 gives (0, 0) tensors.
    """
    values, offsets, length = _validate(values, offsets, pad_value, pad_to_multiple_of, max_len, labels_pad_value,
                                        mask_dtype)
    launch = launcher if launcher is not None else _nvrtc.kernel_launcher("pad_ragged", values)
    if launch is None:
        return _reference(values, offsets, length, pad_value, labels_pad_value, mask_dtype)
    return _launch_pad_ragged(values, offsets, length, pad_value, labels_pad_value, mask_dtype, launch)
