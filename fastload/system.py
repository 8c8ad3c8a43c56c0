"""Facts about the machine this process runs on."""

from __future__ import annotations

import os

import psutil

__all__ = ["process_start", "usable_cores"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def process_start(pid: int) -> float | None:
    """When process `pid` started, to tell it from a later process that reuses its pid: None when
    no such process runs or it is a zombie. On Linux, seconds from boot (its start time in clock
    ticks, from /proc): nothing changes it while the process runs. psutil's `create_time()` adds
    the boot time as the wall clock gives it now, which a step of that clock (NTP, a VM's host)
    moves, so the same process would read as another. Elsewhere `create_time()`, which may raise
    `psutil.AccessDenied`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold ")"
    except (FileNotFoundError, ProcessLookupError):  # the latter: it exited while its entry was read
        if os.path.exists("/proc/self/stat"):
            return None  # Linux: no such process
    else:
        return None if fields[0] == b"Z" else int(fields[19]) / _TICKS
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
