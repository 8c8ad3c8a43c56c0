"""Compile `kernels/*.cu` with NVRTC at first use, cache the binaries, launch on torch's stream.

Why NVRTC: torch's CPU wheels cannot build extensions and a GPU box should not need a C++
toolchain. `cuda-bindings` (the `[cuda]` extra) gives NVRTC and the driver API; it is imported
only when a CUDA tensor reaches a kernel. Binaries are cached in memory per (kernel, device) and
on disk per (kernel, target arch, source hash, NVRTC version) under `cache_dir()`.

The launch contract is the `Launcher` callable: `(kernel, function, grid, block, args, device)`,
where `args` are ctypes scalars in the kernel's parameter order (`ptr`, `i64`, `i32`, `f32`).
Tests plug a host emulator in through the same contract.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "KERNEL_DIR",
    "Launcher",
    "cache_dir",
    "compile_kernel",
    "f32",
    "i32",
    "i64",
    "kernel_launcher",
    "kernel_path",
    "mode",
    "pack_args",
    "ptr",
]

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

Dim3 = tuple[int, int, int]
Launcher = Callable[[str, str, Dim3, Dim3, Sequence[Any], torch.device], None]

_MODE_ENV = "FASTLOAD_CUDA_OPS"
_MODES = ("auto", "reference", "strict")


def mode() -> str:
    """`FASTLOAD_CUDA_OPS`: auto (kernel, else reference + warning), reference (never kernels), strict (raise)."""
    value = os.environ.get(_MODE_ENV, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{_MODE_ENV}={value!r}: expected one of {', '.join(_MODES)}")
    return value


def kernel_path(kernel: str) -> Path:
    """Path of `kernels/<kernel>.cu`: the one source both NVRTC and the nvcc test compile."""
    path = KERNEL_DIR / f"{kernel}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no CUDA kernel source {path}")
    return path


def cache_dir() -> Path:
    """Disk cache for compiled kernels: $FASTLOAD_CUDA_OPS_CACHE, else $XDG_CACHE_HOME/fastload/cuda_ops."""
    explicit = os.environ.get("FASTLOAD_CUDA_OPS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastload" / "cuda_ops"


# --------------------------------------------------------------------------- kernel arguments


def ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    """Device pointer argument (NULL for None)."""
    return ctypes.c_void_p(0 if tensor is None else tensor.data_ptr())


def i64(value: int) -> ctypes.c_int64:
    """`long long` argument."""
    return ctypes.c_int64(int(value))


def i32(value: int) -> ctypes.c_int32:
    """`int` argument."""
    return ctypes.c_int32(int(value))


def f32(value: float) -> ctypes.c_float:
    """`float` argument."""
    return ctypes.c_float(float(value))


def pack_args(args: Sequence[Any]) -> tuple[Any, int]:
    """Build the `void**` array cuLaunchKernel wants; returns (keep-alive holder, its address)."""
    values = list(args)
    array = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return (values, array), ctypes.addressof(array)


# --------------------------------------------------------------------------- NVRTC compilation


def _check(result: Any, what: str) -> Any:
    """Unwrap a cuda-bindings `(status, *values)` tuple, raising RuntimeError on failure."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise RuntimeError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda_bf16.h (wheels first, then CUDA_HOME, /usr/local/cuda)."""
    found: list[str] = []
    try:
        from cuda import pathfinder

        located = pathfinder.find_nvidia_header_directory("cudart")
        if located:
            found.append(str(located))
    except (ImportError, RuntimeError, AttributeError):
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found.append(os.path.join(os.environ[env], "include"))
    found.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(found) if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]


def _nvrtc_target(nvrtc: Any, arch: int) -> tuple[str, str]:
    """('sm_XY', 'cubin') when NVRTC knows the arch, else PTX for the newest arch it knows below it."""
    supported = list(_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))
    if arch in supported:
        return f"sm_{arch}", "cubin"
    older = [a for a in supported if a <= arch]
    if not older:
        raise RuntimeError(f"NVRTC supports archs {supported}, none usable for sm_{arch}")
    return f"compute_{max(older)}", "ptx"


def _nvrtc_compile(nvrtc: Any, source: bytes, name: str, options: list[bytes], kind: str) -> bytes:
    prog = _check(nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(options), options)[0]
        if int(status) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile {name}:\n{log.decode(errors='replace')}")
        if kind == "cubin":
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        else:
            size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = b" " * size
            _check(nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_kernel(kernel: str, arch: int, *, cache: Path | None = None) -> tuple[bytes, str]:
    """Compile `kernels/<kernel>.cu` for compute capability `arch` (e.g. 90); returns (image, 'cubin'|'ptx').

    Needs only NVRTC (no GPU). The result is cached on disk, keyed by the source, options and
    NVRTC version, so a later process loads the binary without compiling.
    """
    from cuda.bindings import nvrtc

    source = kernel_path(kernel).read_bytes()
    target, kind = _nvrtc_target(nvrtc, arch)
    includes = _include_dirs()
    if not includes:
        raise RuntimeError("cuda_bf16.h not found: install the [cuda] extra (cuda-toolkit[cudart]) or set CUDA_HOME")
    options = [f"--gpu-architecture={target}".encode(), b"--std=c++17", *[f"-I{d}".encode() for d in includes]]
    version = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    key = hashlib.sha256(repr((source, [o for o in options if not o.startswith(b"-I")], version)).encode())
    directory = cache if cache is not None else cache_dir()
    path = directory / f"{kernel}-{target}-{key.hexdigest()[:20]}.{kind}"
    if path.is_file():
        return path.read_bytes(), kind
    image = _nvrtc_compile(nvrtc, source, f"{kernel}.cu", options, kind)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False, suffix=".tmp") as tmp:
            tmp.write(image)
        os.replace(tmp.name, path)
    except OSError as exc:  # a read-only home must not break the kernels
        warnings.warn(f"fastload.cuda_ops: cannot write kernel cache {directory}: {exc}", stacklevel=2)
    return image, kind


# --------------------------------------------------------------------------- driver API launch


class _CudaBackend:
    """Loads compiled modules into each device's primary context and launches on torch's current stream."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self._driver = driver
        _check(driver.cuInit(0), "cuInit")
        self._lock = threading.Lock()
        self._contexts: dict[int, Any] = {}
        self._functions: dict[tuple[int, str, str], Any] = {}
        self._modules: list[Any] = []  # keep modules loaded for the life of the process

    def _context(self, index: int) -> Any:
        ctx = self._contexts.get(index)
        if ctx is None:
            dev = _check(self._driver.cuDeviceGet(index), "cuDeviceGet")
            ctx = _check(self._driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self._contexts[index] = ctx
        return ctx

    def _function(self, index: int, kernel: str, function: str) -> Any:
        key = (index, kernel, function)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        with self._lock:
            if key not in self._functions:
                major, minor = torch.cuda.get_device_capability(index)
                image, _ = compile_kernel(kernel, major * 10 + minor)
                module = _check(self._driver.cuModuleLoadData(image), f"cuModuleLoadData({kernel})")
                self._modules.append(module)
                for name in _entry_points(kernel):
                    handle = _check(self._driver.cuModuleGetFunction(module, name.encode()), f"get {name}")
                    self._functions[(index, kernel, name)] = handle
            if key not in self._functions:
                raise RuntimeError(f"kernel {kernel}.cu has no entry point {function!r}")
            return self._functions[key]

    def prepare(self, kernel: str, device: torch.device) -> None:
        """Compile and load `kernel` for `device` now (so setup errors surface before any launch)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._driver.cuCtxPushCurrent(self._context(index))
        try:
            self._function(index, kernel, _entry_points(kernel)[0])
        finally:
            self._driver.cuCtxPopCurrent()

    def __call__(self, kernel: str, function: str, grid: Dim3, block: Dim3, args: Sequence[Any],
                 device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        drv = self._driver
        _check(drv.cuCtxPushCurrent(self._context(index)), "cuCtxPushCurrent")
        try:
            fn = self._function(index, kernel, function)
            stream = drv.CUstream(torch.cuda.current_stream(index).cuda_stream)
            _keep, address = pack_args(args)
            _check(drv.cuLaunchKernel(fn, *grid, *block, 0, stream, address, 0), f"launch {function}")
        finally:
            drv.cuCtxPopCurrent()


def _entry_points(kernel: str) -> tuple[str, ...]:
    from . import _registry

    return _registry.ENTRY_POINTS[kernel]


_backend_lock = threading.Lock()
_backend: _CudaBackend | None = None
_prepared: set[tuple[str, torch.device]] = set()
_unavailable: dict[str, str] = {}


def kernel_launcher(kernel: str, tensor: torch.Tensor) -> Launcher | None:
    """The launcher for `kernel` if `tensor` is on CUDA and the kernel can run there, else None.

    In `auto` mode a setup failure (no cuda-bindings, no NVRTC, no headers) warns once per kernel and
    returns None so callers use the reference; `strict` re-raises; `reference` always returns None.
    """
    global _backend
    if not tensor.is_cuda:
        return None
    current = mode()
    if current == "reference":
        return None
    if kernel in _unavailable and current == "auto":
        return None
    try:
        key = (kernel, tensor.device)
        if _backend is not None and key in _prepared:
            return _backend
        with _backend_lock:
            if _backend is None:
                _backend = _CudaBackend()
            _backend.prepare(kernel, tensor.device)
            _prepared.add(key)
        return _backend
    except (ImportError, OSError, RuntimeError) as exc:
        if current == "strict":
            raise
        _unavailable[kernel] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"fastload.cuda_ops: CUDA kernel {kernel!r} unavailable ({_unavailable[kernel]}); using the torch "
            "reference implementation. Install fastload[cuda] for the fused kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
