"""`TextCollate`: token batches in padded (`input_ids` + `attention_mask`) or packed (varlen) layout.

The host side works on one flat token buffer plus offsets per batch (the dataset's `Ragged`
column, or built from a list of sample dicts), with numpy only: no per-sample Python on the
columnar path. With `device="cuda"` the flat buffer and offsets travel in one H2D copy from a
reused pinned staging slot, and `fastload.cuda_ops.pad_ragged` scatters them into the padded
batch on the GPU; results equal the CPU path exactly.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload.formats.ragged import Ragged
from fastload.run import RunContext

__all__ = ["PinnedStaging", "TextCollate"]

_MODES = ("padded", "packed")


def _pad_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _truncate(
    values: np.ndarray, offsets: np.ndarray, max_len: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rebase `offsets` to 0 and cut every sample to `max_len` tokens (vectorized)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    values = values[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    lens = np.diff(offsets)
    if max_len is None or len(lens) == 0 or lens.max() <= max_len:
        return values, offsets, lens
    keep = np.minimum(lens, max_len)
    new_off = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(keep, out=new_off[1:])
    idx = np.arange(new_off[-1], dtype=np.int64) + np.repeat(offsets[:-1] - new_off[:-1], keep)
    return values[idx], new_off, keep


def _flat_from_samples(items: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    parts = [np.asarray(a).reshape(-1) for a in items]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return values, offsets


def _as_numpy(a: Any) -> np.ndarray:
    """numpy view of a CPU tensor (a `Ragged` from `collate.columns_to_torch` holds tensors), else asarray."""
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _to_tensor(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(np.ascontiguousarray(value) if value.flags.writeable else value.copy())
    return value


class _Slot:
    __slots__ = ("buf", "event")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.event: Any = None  # the H2D copy out of `buf` (recorded on the copying stream)


class PinnedStaging:
    """A ring of `slots` pinned host buffers: `transfer(parts, device)` packs several arrays into one
    and copies them to the device in one transfer (what `TextCollate` does with a batch's tokens and
    offsets), returning a device tensor per array.

    Every CUDA call runs under `cuda.device(device)` (the pinned allocation too: no context lands
    on GPU 0), the copy and its event go on `device`'s current stream, and a slot's previous copy
    is waited for outside the ring's lock (the slot is off the free list meanwhile), so other
    threads keep transferring through the other slots. `cuda` (default `torch.cuda`: `device`,
    `current_stream`, `Event`) and `pin` can be replaced, e.g. to run it without a GPU.
    """

    def __init__(self, *, slots: int = 4, cuda: Any = None, pin: bool = True) -> None:
        self._cuda = torch.cuda if cuda is None else cuda
        self._pin = pin
        self._free: deque[_Slot] = deque(_Slot() for _ in range(slots))
        self._cond = threading.Condition()

    def transfer(self, parts: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
        """Copy `parts` to `device` in one transfer through a free slot; one device tensor per part."""
        spans, total = [], 0
        for p in parts:
            spans.append((total, p.nbytes))
            total += _pad_up(p.nbytes, 8)  # keep every part 8-byte aligned for the typed views
        with self._cond:
            while not self._free:
                self._cond.wait()
            slot = self._free.popleft()
        try:
            if slot.event is not None:
                slot.event.synchronize()  # the previous copy out of this slot has finished
                slot.event = None
            cuda = self._cuda
            with cuda.device(device):
                if slot.buf is None or slot.buf.numel() < total:
                    slot.buf = torch.empty(max(total, 1 << 20), dtype=torch.uint8, pin_memory=self._pin)
                host = slot.buf.numpy()
                for p, (start, nbytes) in zip(parts, spans):
                    host[start : start + nbytes] = np.ascontiguousarray(p).view(np.uint8).reshape(-1)
                stream = cuda.current_stream(device)  # where `.to` below enqueues the copy
                dev = slot.buf[:total].to(device, non_blocking=True)
                event = cuda.Event()
                event.record(stream)
                slot.event = event
        finally:
            with self._cond:
                self._free.append(slot)
                self._cond.notify()
        return [
            dev[start : start + nbytes].view(torch.from_numpy(np.empty(0, p.dtype)).dtype).reshape(p.shape)
            for p, (start, nbytes) in zip(parts, spans)
        ]


def _check_fits(name: str, value: int, dtype: np.dtype, what: str) -> None:
    if dtype.kind not in "iu":
        return
    info = np.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise ValueError(f"TextCollate: {name}={value} does not fit {what} {dtype} (range {info.min}..{info.max})")


class TextCollate:
    """Collate token sequences from `field` into a padded or a packed batch of torch tensors.

    Input: a columnar batch (`dict` with a `Ragged` token column, from `ds.get_batch`), a
    `Ragged`, or a list of sample dicts (torch `collate_fn` style). Other columns pass through
    (numeric numpy arrays become tensors).

    `mode="padded"` -> `input_ids [B, L]`, `attention_mask [B, L]` (1 = token), and with
    `labels=True` `labels [B, L]` (`input_ids` with padding set to `labels_pad_value`);
    `L` = longest sample rounded up to `pad_to_multiple_of`.

    `mode="packed"` -> `input_ids [1, T]`, `position_ids [1, T]` (restart at 0 per sequence),
    `cu_seqlens` int32 `[B + 1]`, `max_seqlen` (int), and with `labels=True` `labels [1, T]`
    whose first token of every sequence is `labels_pad_value` (no prediction across sequence
    boundaries, as HF's flattening collator). `T` = total tokens rounded up to
    `pad_to_multiple_of`; the padding tail lies after `cu_seqlens[-1]` (pad ids, position 0).

    `max_len` cuts longer samples. `stats()` reports real/padded tokens and padding waste.

    As a Loader's `collate_fn` on a `get_batch` dataset it takes batch views (`fastload.fetch.views`):
    the token column arrives as one `Ragged`, other columns as tensors / `Ragged`, passed through.

    Run context (`fastload.run`): the layout draws nothing at random, so no run fact changes a
    batch; `bind_run` records the run, and `component_stats()` (the `stats()` counters, with the
    epoch the Loader last gave) is what `loader.stats()["components"]` reports for it.
    """

    accepts_batch_views = True  # the Loader hands it columns, not a list of samples

    def __init__(
        self,
        *,
        field: str = "input_ids",
        mode: str = "padded",
        pad_value: int = 0,
        pad_to_multiple_of: int = 1,
        max_len: int | None = None,
        labels: bool = False,
        labels_pad_value: int = -100,
        dtype: torch.dtype = torch.int64,
        mask_dtype: torch.dtype = torch.int64,
        device: str | torch.device | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.field = field
        self.mode = mode
        self.pad_value = int(pad_value)
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.max_len = max_len
        self.labels = labels
        self.labels_pad_value = int(labels_pad_value)
        self.dtype = dtype
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self.mask_dtype = mask_dtype
        self._np_mask_dtype = torch.empty(0, dtype=mask_dtype).numpy().dtype
        self.device = torch.device(device) if device is not None else None
        _check_fits("pad_value", self.pad_value, self._np_dtype, "the output dtype")
        _check_fits("labels_pad_value", self.labels_pad_value, np.dtype(np.int64), "the labels dtype")
        self.run: RunContext | None = None  # the Loader's run (`bind_run`)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._staging: PinnedStaging | None = None
        self._counts = {"batches": 0, "real_tokens": 0, "padded_tokens": 0}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_lock", "_staging", "_counts"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ----------------------------------------------------------------------------- input
    def _split(self, batch: Any) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        """(flat values, offsets, other columns) from any accepted batch form."""
        if isinstance(batch, Ragged):
            return _as_numpy(batch.values), _as_numpy(batch.offsets), {}
        if isinstance(batch, Mapping):
            if self.field not in batch:
                raise KeyError(f"TextCollate(field={self.field!r}): no such field in the batch (fields: {list(batch)})")
            col = batch[self.field]
            extras = {k: _to_tensor(v) for k, v in batch.items() if k != self.field}
            if isinstance(col, Ragged):
                return _as_numpy(col.values), _as_numpy(col.offsets), extras
            if isinstance(col, (np.ndarray, torch.Tensor)) and col.ndim == 2:  # fixed-length token field
                offsets = np.arange(col.shape[0] + 1, dtype=np.int64) * col.shape[1]
                return _as_numpy(col).reshape(-1), offsets, extras
            values, offsets = _flat_from_samples(col)
            return values, offsets, extras
        if isinstance(batch, Sequence) and all(isinstance(s, Mapping) for s in batch):
            values, offsets = _flat_from_samples([s[self.field] for s in batch])
            extras = {}
            for key in batch[0].keys() if len(batch) else ():
                if key == self.field:
                    continue
                items = [s[key] for s in batch]
                try:
                    stacked = np.stack([np.asarray(v) for v in items])
                except ValueError:  # ragged or mixed: keep the list
                    extras[key] = items
                    continue
                extras[key] = _to_tensor(stacked) if stacked.dtype.kind in "biuf" else items
            return values, offsets, extras
        raise TypeError(
            f"TextCollate takes a dict batch with a Ragged {self.field!r} column, a Ragged, or a list of "
            f"sample dicts; got {type(batch).__name__}"
        )

    # ----------------------------------------------------------------------------- layouts (host)
    def _padded_numpy(self, values: np.ndarray, lens: np.ndarray, length: int) -> dict[str, torch.Tensor]:
        ids = np.full((len(lens), length), self.pad_value, dtype=self._np_dtype)
        mask = np.arange(length)[None, :] < lens[:, None]
        ids[mask] = values  # one scatter: a row-major boolean mask visits tokens in buffer order
        out = {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask.astype(self._np_mask_dtype)),
        }
        if self.labels:
            out["labels"] = torch.from_numpy(np.where(mask, ids, self.labels_pad_value).astype(np.int64))
        return out

    def _packed_numpy(self, values: np.ndarray, offsets: np.ndarray, lens: np.ndarray) -> dict[str, Any]:
        total = int(offsets[-1])
        padded = _pad_up(total, self.pad_to_multiple_of)
        ids = np.full(padded, self.pad_value, dtype=self._np_dtype)
        ids[:total] = values
        pos = np.zeros(padded, dtype=np.int64)
        pos[:total] = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], lens)
        out: dict[str, Any] = {
            "input_ids": torch.from_numpy(ids)[None],
            "position_ids": torch.from_numpy(pos)[None],
            "cu_seqlens": torch.from_numpy(offsets.astype(np.int32)),
            "max_seqlen": int(lens.max()) if len(lens) else 0,
        }
        if self.labels:
            lab = np.full(padded, self.labels_pad_value, dtype=np.int64)
            lab[:total] = values
            lab[offsets[:-1][lens > 0]] = self.labels_pad_value
            out["labels"] = torch.from_numpy(lab)[None]
        return out

    # ----------------------------------------------------------------------------- layouts (device)
    def _padded_device(self, values: torch.Tensor, offsets: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
        """Padded layout from device tensors via `cuda_ops.pad_ragged` (CUDA kernel; torch reference on CPU).

        `offsets` were validated and `length` computed on the host, so on CUDA the kernel is launched
        directly: the public entry point would sync the device to re-validate GPU offsets.
        """
        from fastload import cuda_ops
        from fastload.cuda_ops import _nvrtc
        from fastload.cuda_ops.ragged import _launch_pad_ragged

        lab_pad = self.labels_pad_value if self.labels else None
        mask_dtype = self.mask_dtype if self.mask_dtype in (torch.int64, torch.bool) else torch.int64
        launch = _nvrtc.kernel_launcher("pad_ragged", values)
        if launch is not None:
            ids, mask, labels = _launch_pad_ragged(values, offsets, length, self.pad_value, lab_pad, mask_dtype, launch)
        else:
            ids, mask, labels = cuda_ops.pad_ragged(
                values,
                offsets,
                pad_value=self.pad_value,
                pad_to_multiple_of=self.pad_to_multiple_of,
                labels_pad_value=lab_pad,
                mask_dtype=mask_dtype,
            )
        out = {"input_ids": ids.to(self.dtype), "attention_mask": mask.to(self.mask_dtype)}
        if labels is not None:
            out["labels"] = labels
        return out

    def _packed_device(self, values: torch.Tensor, offsets: torch.Tensor, lens: np.ndarray) -> dict[str, Any]:
        """Packed layout from device tensors; `lens` (host) sizes everything without a device sync."""
        total = int(lens.sum())
        padded = _pad_up(total, self.pad_to_multiple_of)
        dev = values.device
        ids = torch.full((padded,), self.pad_value, dtype=self.dtype, device=dev)
        ids[:total] = values.to(self.dtype)
        starts = torch.repeat_interleave(offsets[:-1], offsets.diff(), output_size=total)
        pos = torch.zeros(padded, dtype=torch.int64, device=dev)
        pos[:total] = torch.arange(total, device=dev) - starts
        out: dict[str, Any] = {
            "input_ids": ids[None],
            "position_ids": pos[None],
            "cu_seqlens": offsets.to(torch.int32),
            "max_seqlen": int(lens.max()) if len(lens) else 0,
        }
        if self.labels:
            lab = torch.full((padded,), self.labels_pad_value, dtype=torch.int64, device=dev)
            lab[:total] = values.to(torch.int64)
            # first token of each sequence (and the pad tail); torch.where: no device sync
            lab = torch.where(pos == 0, self.labels_pad_value, lab)
            out["labels"] = lab[None]
        return out

    # ----------------------------------------------------------------------------- entry
    def __call__(self, batch: Any) -> dict[str, Any]:
        values, offsets, extras = self._split(batch)
        # the device path pads in the tokens' own dtype: the same check on both paths
        _check_fits("pad_value", self.pad_value, values.dtype, f"the {self.field!r} tokens' dtype")
        values, offsets, lens = _truncate(values, offsets, self.max_len)
        length = _pad_up(int(lens.max()) if len(lens) else 0, self.pad_to_multiple_of)  # padded mode's L
        if self.mode == "padded":
            padded_tokens = len(lens) * length
        else:
            padded_tokens = _pad_up(int(offsets[-1]), self.pad_to_multiple_of)
        if self.device is None or self.device.type == "cpu":
            if self.mode == "padded":
                out = self._padded_numpy(values, lens, length)
            else:
                out = self._packed_numpy(values, offsets, lens)
        else:
            if self._staging is None:
                self._staging = PinnedStaging()
            dev_offsets, dev_values = self._staging.transfer([offsets, values], self.device)
            if self.mode == "padded":
                out = self._padded_device(dev_values, dev_offsets, length)
            else:
                out = self._packed_device(dev_values, dev_offsets, lens)
        with self._lock:
            self._counts["batches"] += 1
            self._counts["real_tokens"] += int(offsets[-1])
            self._counts["padded_tokens"] += padded_tokens
        out.update(extras)
        return out

    def stats(self) -> dict[str, float]:
        """Counters since construction: batches, real and padded tokens, padding waste (pad / padded)."""
        with self._lock:
            c = dict(self._counts)
        waste = 1.0 - c["real_tokens"] / c["padded_tokens"] if c["padded_tokens"] else 0.0
        return {
            "collate_batches": c["batches"],
            "tokens_real": c["real_tokens"],
            "tokens_padded": c["padded_tokens"],
            "padding_waste": waste,
        }

    def bind_run(self, run: RunContext) -> None:
        """Record the Loader's run (`fastload.run.RunAware`; the output does not depend on it)."""
        self.run = run

    def component_stats(self) -> dict[str, Any]:
        """`stats()` and the epoch of the run the Loader last gave (`fastload.run.StatsReporter`)."""
        return {**self.stats(), "epoch": self.run.epoch if self.run is not None else None}

    def reset_stats(self) -> None:
        """Zero the batch and token counters behind `stats()` (e.g. between epochs or benchmark runs)."""
        with self._lock:
            self._counts = {"batches": 0, "real_tokens": 0, "padded_tokens": 0}
