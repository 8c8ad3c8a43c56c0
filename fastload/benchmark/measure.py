"""Measurement helpers: min/median/max summaries, a CPU/RSS monitor, payload byte counts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ResourceMonitor", "payload_bytes", "percentile_ms", "summarize"]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """``{"min", "median", "max", "values"}`` of repeated measurements (NaN-free; empty -> zeros)."""
    vals = [float(v) for v in values if v == v]
    if not vals:
        return {"min": 0.0, "median": 0.0, "max": 0.0, "values": []}
    return {"min": min(vals), "median": float(np.median(vals)), "max": max(vals), "values": vals}


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The q-th percentile of durations, in milliseconds (0 for none)."""
    return float(np.percentile(np.asarray(seconds) * 1e3, q)) if len(seconds) else 0.0


def payload_bytes(obj: Any) -> int:
    """Bytes of data in a batch: arrays/tensors (nbytes), bytes/str (len), Ragged (values), containers."""
    if isinstance(obj, (bytes, bytearray, memoryview, str)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    values = getattr(obj, "values", None)
    if values is not None and hasattr(obj, "offsets"):  # fastload Ragged (numpy or tensor values)
        return payload_bytes(values)
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # torch.Tensor
        return int(obj.element_size() * obj.numel())
    return 0


class ResourceMonitor:
    """Samples CPU seconds and RSS of this process and its children every `interval` seconds.

    `cpu_s` sums, per process id, the CPU time used since `start()` (children that exit between
    samples lose at most one interval); `peak_rss` is the largest sum of RSS over the process
    tree (file-backed mmap pages of a dataset count too, as the kernel reports them).
    """

    def __init__(self, *, interval: float = 0.05) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self.interval = interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = self._t1 = 0.0

    def _sample(self) -> None:
        procs = [self._proc]
        with contextlib.suppress(self._psutil.Error):
            procs += self._proc.children(recursive=True)
        rss = 0
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    rss += p.memory_info().rss
            except self._psutil.Error:
                continue
            self._first.setdefault(p.pid, 0.0)  # a child born after start() counts from 0
            self._last[p.pid] = cpu
        self.peak_rss = max(self.peak_rss, rss)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> ResourceMonitor:
        """Take a first sample (CPU time so far is not counted) and start sampling on a daemon thread;
        returns self."""
        self._sample()
        self._first = dict(self._last)  # processes alive now count from their current CPU time
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="fastload-bench-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Take a last sample (call before worker processes are shut down) and stop."""
        self._sample()
        self._t1 = time.perf_counter()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def cpu_s(self) -> float:
        """CPU seconds (user + system) of this process and its children since `start()`, as of the
        latest sample."""
        return sum(max(0.0, cpu - self._first.get(pid, 0.0)) for pid, cpu in self._last.items())

    @property
    def cpu_percent(self) -> float:
        """CPU time / wall time, in percent of one core (200 = two cores busy)."""
        wall = self._t1 - self._t0
        return 100.0 * self.cpu_s / wall if wall > 0 else 0.0
