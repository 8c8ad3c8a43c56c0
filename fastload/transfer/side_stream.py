"""`DeviceStage`: host-to-device copies on a side stream, synchronised with events.

`start(batch)` issues the copies of all tensor leaves on the loader's own CUDA stream and
records an event; `finish(...)` makes the consumer's current stream wait for that event only
(not for the whole side stream) and `record_stream`s every result on it, so the caching
allocator cannot hand the memory to someone else while the consumer's kernels still use it.
The source (pinned) buffers are released by the caller with the event as their fence.
The copies are issued with the Loader's device current (switched to it only when the
consumer's current device is another), so nothing lands on GPU 0 by accident.
For `device='cpu'` both calls return the batch unchanged (no copy, no stream).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fastload.fetch.collate import flatten, unflatten

__all__ = ["DeviceStage", "DeviceWideFence", "resolve_device", "use_worker_stream", "worker_stream"]


def resolve_device(device: str | int | torch.device | None) -> torch.device | None:
    """`'cuda'` -> `cuda:<current>`; ints are CUDA indices; None stays None."""
    if device is None:
        return None
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def worker_stream(device_index: int | None, *, cuda: Any = None) -> Any:
    """The stream the Loader's worker threads run CUDA work on: the current stream on the Loader's
    device of the thread that starts them (the consumer's, at `iter(loader)`), so kernels a
    transform launches are queued before the consumer's next ones and memory they allocate belongs
    to that stream. None without a CUDA device. `cuda` is injectable for tests."""
    if device_index is None:
        return None
    cuda = torch.cuda if cuda is None else cuda
    return cuda.current_stream(device_index)


def use_worker_stream(device_index: int | None, stream: Any, *, cuda: Any = None) -> None:
    """In a worker thread: make the Loader's device current (not GPU 0) and `stream` its current stream."""
    if device_index is None:
        return
    cuda = torch.cuda if cuda is None else cuda
    cuda.set_device(device_index)
    if stream is not None:
        cuda.set_stream(stream)


class DeviceWideFence:
    """The fence of a pinned host buffer whose copies the Loader did not issue (`pin_memory`
    without `device`): the user may have copied from it with `non_blocking=True` on any stream of
    the device, so an event on one stream cannot tell when it is free. `synchronize()` waits for
    all work queued on the device up to now (`torch.cuda.synchronize`), then the buffer may be
    rewritten. It runs where the buffer is reused (a worker thread), not in the consumer."""

    __slots__ = ("_cuda", "device_index")

    def __init__(self, device_index: int, *, cuda: Any = None) -> None:
        self.device_index = device_index
        self._cuda = torch.cuda if cuda is None else cuda

    def synchronize(self) -> None:
        """Wait until the work queued on the device before this fence has run."""
        self._cuda.synchronize(self.device_index)


class DeviceStage:
    """Moves batches to `device`; asynchronous on CUDA, a no-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: Any = None
        if self.cuda:
            with torch.cuda.device(device):
                self.stream = torch.cuda.Stream(device)

    def start(self, batch: Any) -> tuple[Any, Any]:
        """Issue the copy; returns `(device batch, event or None)`."""
        if self.device.type == "cpu":
            return batch, None
        leaves, spec = flatten(batch)
        if not self.cuda:
            return unflatten(spec, [t.to(self.device) for t in leaves]), None
        same = torch.cuda.current_device() == self.device.index
        with contextlib.nullcontext() if same else torch.cuda.device(self.device):
            out, event = self._copy(leaves)
        return unflatten(spec, out), event

    def _copy(self, leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """With the Loader's device current: the copies issued on the side stream and its event
        recorded after them; the consumer's stream is current again on return. (Setting the
        stream directly costs less than half of what `torch.cuda.stream(...)`'s context does.)"""
        previous = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(self.stream)
        try:
            out = [t.to(self.device, non_blocking=True) for t in leaves]
            event = self.stream.record_event()
        finally:
            torch.cuda.set_stream(previous)
        return out, event

    def finish(self, batch: Any, event: Any) -> Any:
        """Make the consumer's stream wait for `event`; protect the memory with record_stream.
        (Neither call needs the device current: both name their stream.)"""
        if event is None:
            return batch
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        leaves, _ = flatten_device(batch)
        for t in leaves:
            t.record_stream(current)
        return batch


def flatten_device(batch: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensor leaves of a batch already on a device."""
    out: list[torch.Tensor] = []
    _collect(batch, out)
    return out, None


def _collect(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, out)
    elif hasattr(x, "values") and hasattr(x, "offsets"):
        _collect(x.values, out)
        _collect(x.offsets, out)
