"""The machine's raw limits: sequential file reads (cold and warm page cache), the random gather of
a dataset's sample byte ranges (cold and warm), memcpy, JPEG decode."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import time
from collections.abc import Iterable

import numpy as np

__all__ = [
    "dataset_files",
    "evict",
    "jpeg_decode_rate",
    "memcpy_bandwidth",
    "random_gather",
    "recycle_page_cache",
    "resident_fraction",
    "sequential_read",
]

_READ_CHUNK = 8 << 20
_libc: ctypes.CDLL | None = None


def dataset_files(path: str) -> list[str]:
    """Every regular file under `path` (or `path` itself), sorted."""
    if os.path.isfile(path):
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(filenames)]
    return [p for p in out if os.path.isfile(p) and not os.path.islink(p)]


def evict(paths: Iterable[str]) -> bool:
    """Drop the files' clean pages from the page cache (``posix_fadvise(DONTNEED)``); False if unsupported.

    Pages mapped by a live process stay resident: close datasets (their mmaps) first.
    """
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:  # pragma: no cover - macOS / Windows
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def recycle_page_cache(directory: str, nbytes: int, *, chunk: int = _READ_CHUNK) -> int:
    """Write `nbytes` to a scratch file in `directory` and delete it, so that a pass writing that
    much right after writes into page-cache pages the machine has just used.

    On a VM whose balloon driver reports free pages to the host (virtio free page reporting), a
    page left free for a few seconds is handed back, and the first write into it costs a host
    fault: on this project's VMs a new 1 GB file is written at ~0.4 GB/s into such pages and at
    ~3 GB/s into pages freed a moment before. Passes that write (a download into a cache, the raw
    GET + write pipeline) are otherwise ranked by which of them got recycled pages. Called before
    each such pass, baseline and measured row alike; on a machine whose memory stays backed it only
    costs the write. Returns the bytes written.
    """
    path = os.path.join(directory, f".recycle-{os.getpid()}")
    block = memoryview(b"\0" * chunk)
    written = 0
    try:
        with open(path, "wb") as f:
            while written < nbytes:
                written += f.write(block[: min(chunk, nbytes - written)])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return written


def resident_fraction(paths: Iterable[str]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``), or None where unavailable."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:  # pragma: no cover
            return None
        _libc = ctypes.CDLL(name, use_errno=True)
    page = mmap.PAGESIZE
    resident = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, dtype=np.uint8)
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            rc = _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
            del view
            if rc != 0:
                return None
            resident += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
            total += pages
    return resident / total if total else None


def sequential_read(paths: list[str], *, chunk: int = _READ_CHUNK) -> tuple[int, float]:
    """Read every file front to back with `readinto` of `chunk` bytes -> (bytes, seconds)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    return total, time.perf_counter() - t0


def random_gather(
    path: str, starts: np.ndarray, lengths: np.ndarray, *, batch_size: int, seconds: float, seed: int = 0
) -> tuple[int, int, float]:
    """Shuffled batches of the byte ranges [starts[i], starts[i] + lengths[i]) of the file at `path`,
    each batch copied (in the shuffled order) into one new buffer by the fastest ranged copy this
    package has (`gather_ranges`: C, GIL released), until the epoch ends or `seconds` pass
    -> (samples, bytes, seconds). No format, no lookups, no checks: what the hardware allows for
    reading these samples in random order, one thread."""
    from fastload.formats.ragged import gather_ranges

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    order = np.random.default_rng(seed).permutation(len(starts))
    samples = nbytes = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        values, _ = gather_ranges(raw, starts.take(idx), lengths.take(idx))
        samples += len(idx)
        nbytes += values.nbytes
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    del raw
    return samples, nbytes, elapsed


def memcpy_bandwidth(*, nbytes: int = 64 << 20, seconds: float = 0.3) -> float:
    """Bytes copied per second by `np.copyto` between two buffers larger than the CPU caches."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    copied, t0 = 0, time.perf_counter()
    while True:
        np.copyto(dst, src)
        copied += nbytes
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return copied / elapsed


def jpeg_decode_rate(jpegs: list[bytes], *, seconds: float = 0.3) -> tuple[float, str]:
    """Single-thread JPEG decodes per second over `jpegs` (cycled) -> (images/s, decoder name)."""
    try:
        import simplejpeg

        def decode(b: bytes) -> object:
            return simplejpeg.decode_jpeg(b, colorspace="RGB")

        name = "simplejpeg"
    except ImportError:
        import io

        from PIL import Image

        def decode(b: bytes) -> object:
            with Image.open(io.BytesIO(b)) as im:
                return np.asarray(im.convert("RGB"))

        name = "pillow"
    decode(jpegs[0])
    count, t0 = 0, time.perf_counter()
    while True:
        for b in jpegs:
            decode(b)
        count += len(jpegs)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return count / elapsed, name
