"""Loader runs: `fastload.Loader` vs `torch.utils.data.DataLoader` on the same data, as the consumer sees them.

Loader kinds:
- ``fastload``: `fastload.Loader(ds, ...)` on the dataset itself (its `get_batch` fast path), with
  torch's batch types (lists of bytes for bytes fields), as a drop-in gives them.
- ``fastload-views`` ("fastload (batch views)"): the same Loader with `collate_fn=BatchViews()`:
  variable fields come as `Ragged` views (values + offsets tensors), no per-sample Python objects.
- ``torch``: `DataLoader(PerSample(ds), collate_fn=collate_samples)`: one `__getitem__` per sample,
  the way users write a map-style dataset.
- ``torch-batched``: `DataLoader(ds, collate_fn=collate_samples)`: torch calls `ds.__getitems__`
  once per batch (torch >= 2.2), the cheapest way to use torch on a batched dataset.

The torch loaders collate to the same content: fixed arrays stacked into tensors, bytes as lists, variable
arrays as (values, offsets) tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from fastload.benchmark.measure import ResourceMonitor, payload_bytes, percentile_ms

__all__ = [
    "FASTLOAD_KINDS", "LABELS", "LOADER_KINDS", "TORCH_KINDS", "LoaderRun", "PerSample", "Step", "collate_samples",
    "run_loader",
]

FASTLOAD_KINDS = ("fastload", "fastload-views")
TORCH_KINDS = ("torch", "torch-batched")
LOADER_KINDS = (*FASTLOAD_KINDS, *TORCH_KINDS)
LABELS = {"fastload-views": "fastload (batch views)"}  # how reports name a kind (default: the kind)
STAGE_KEYS = ("read_s", "transform_s", "collate_s", "pin_s", "h2d_s")


class PerSample(Dataset):
    """A plain map-style dataset: `len` and `__getitem__` only (no batched reads)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


def collate_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack equal-shape arrays and scalars, keep bytes/str as lists, variable arrays as (values, offsets)."""
    out: dict[str, Any] = {}
    for key, first in samples[0].items():
        col = [s[key] for s in samples]
        if isinstance(first, (bytes, str)):
            out[key] = col
        elif isinstance(first, np.ndarray):
            if all(c.shape == first.shape for c in col):
                out[key] = torch.from_numpy(np.stack(col))
            else:
                lengths = np.array([len(c) for c in col], dtype=np.int64)
                offsets = np.zeros(len(col) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                out[key] = (torch.from_numpy(np.concatenate(col)), torch.from_numpy(offsets))
        else:
            out[key] = torch.tensor(col)
    return out


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], torch.Tensor):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class Step:
    """A simulated training step of `ms` milliseconds: ``sleep`` or ``matmul`` (busy on `device`)."""

    def __init__(self, ms: float, *, kind: str = "sleep", device: torch.device | None = None) -> None:
        if kind not in ("sleep", "matmul"):
            raise ValueError(f"step kind must be 'sleep' or 'matmul', got {kind!r}")
        self.ms, self.kind = float(ms), kind
        self.device = device or torch.device("cpu")
        self._a = torch.randn(256, 256, device=self.device) if kind == "matmul" else None

    def __call__(self) -> None:
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
            return
        assert self._a is not None
        end = time.perf_counter() + self.ms / 1e3
        while time.perf_counter() < end:
            self._a = torch.tanh(self._a @ self._a)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)


@dataclass
class LoaderRun:
    """One repeat of one loader configuration."""

    samples: int = 0
    nbytes: int = 0
    batches: int = 0
    wall_s: float = 0.0
    steady_s: float = 0.0  # first batch received -> last batch received
    steady_samples: int = 0
    steady_bytes: int = 0
    first_batch_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    cpu_percent: float = 0.0
    peak_rss: int = 0
    stats: dict[str, Any] | None = None

    @property
    def samples_per_s(self) -> float:
        """Steady-state samples per second: batches after the first, over first -> last batch received
        (so start-up and the first batch's latency do not count; 0 with fewer than two batches)."""
        return self.steady_samples / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Steady-state payload bytes per second, measured like `samples_per_s`."""
        return self.steady_bytes / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def data_stall(self) -> float:
        """Fraction (0..1) of the run's wall time spent waiting for batches (`next()`, plus the
        copy to CUDA for torch loaders), first batch included (0 for a run with no wall time)."""
        return min(1.0, sum(self.waits) / self.wall_s) if self.wall_s > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        """The q-th percentile of the per-batch waits (as in `data_stall`), in ms; the first batch
        (start-up) is left out unless it is the only one."""
        return percentile_ms(self.waits[1:] or self.waits, q)


def make_loader(
    kind: str, dataset: Any, *, batch_size: int, num_workers: int, device: torch.device, seed: int
) -> Any:
    """The loader of `kind` (see the module docstring) with shuffling and matching pinning."""
    pin = device.type == "cuda"
    persistent = num_workers > 0
    if kind in FASTLOAD_KINDS:
        from fastload.fetch.views import BatchViews
        from fastload.loader import Loader

        return Loader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=num_workers,
            pin_memory=pin,
            persistent_workers=persistent,
            device=device if pin else None,
            seed=seed,
            collate_fn=BatchViews() if kind == "fastload-views" else None,
        )
    if kind not in LOADER_KINDS:
        raise ValueError(f"unknown loader {kind!r}; expected one of {LOADER_KINDS}")
    data = PerSample(dataset) if kind == "torch" else dataset
    return DataLoader(
        data,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=pin,
        persistent_workers=persistent,
        collate_fn=collate_samples,
        generator=torch.Generator().manual_seed(seed),
        # a dataset that cannot be read in a forked process (Lance) gets spawned workers
        multiprocessing_context="spawn" if num_workers and not getattr(dataset, "fork_safe", True) else None,
    )


def run_loader(
    kind: str,
    dataset: Any,
    *,
    batch_size: int,
    num_workers: int,
    seconds: float,
    device: torch.device,
    seed: int = 0,
    step: Step | None = None,
) -> LoaderRun:
    """Iterate (epoch after epoch) for `seconds`, timing every `next()` as the training loop sees it."""
    run = LoaderRun()
    monitor = ResourceMonitor().start()
    t0 = time.perf_counter()
    loader = make_loader(kind, dataset, batch_size=batch_size, num_workers=num_workers, device=device, seed=seed)
    move = kind not in FASTLOAD_KINDS and device.type == "cuda"
    t_first = t_last = 0.0
    it = iter(loader)
    try:
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                if time.perf_counter() - t0 >= seconds:
                    break
                it = iter(loader)
                continue
            if move:
                batch = _to_device(batch, device)
            now = time.perf_counter()
            run.waits.append(now - t)
            n = _batch_len(batch)
            nbytes = payload_bytes(batch)
            run.samples += n
            run.nbytes += nbytes
            run.batches += 1
            if run.batches == 1:
                t_first = now
                run.first_batch_s = now - t0
            else:
                run.steady_samples += n
                run.steady_bytes += nbytes
            t_last = now
            if step is not None:
                step()
            if time.perf_counter() - t0 >= seconds and run.batches >= 2:
                break
        run.wall_s = time.perf_counter() - t0
        run.steady_s = t_last - t_first
        if kind in FASTLOAD_KINDS:
            run.stats = {k: v for k, v in loader.stats().items() if isinstance(v, (int, float, str))}
        monitor.stop()
    finally:
        del it
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        del loader
    run.cpu_percent, run.peak_rss = monitor.cpu_percent, monitor.peak_rss
    return run


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        return len(batch[1]) - 1  # (values, offsets)
    offsets = getattr(batch, "offsets", None)
    if offsets is not None:
        return len(offsets) - 1
    return len(batch)


def bottleneck(stats: dict[str, Any] | None) -> str | None:
    """The loader stage with the most time in `loader.stats()` (None without stats)."""
    if not stats:
        return None
    times = {k[:-2]: float(stats.get(k, 0.0)) for k in STAGE_KEYS}
    name, value = max(times.items(), key=lambda kv: kv[1])
    return name if value > 0 else None
