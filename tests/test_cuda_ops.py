"""fastload.cuda_ops: kernel sources compile, references match plain numpy, kernels match references.

Without a GPU the kernels still run here: `host_emulator` compiles the very same `.cu` files as
host C++ (g++ + CUDA headers) and executes every block/thread of a launch sequentially, driven
through the real launch code (grid sizing, argument packing). On a CUDA machine the GPU parity
tests run the NVRTC-compiled kernels against the references.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload import cuda_ops
from fastload.cuda_ops import _nvrtc
from fastload.cuda_ops._registry import (
    ENTRY_POINTS,
    NORMALIZE_FUNCTIONS,
    NORMALIZE_VEC8_FUNCTIONS,
    NORMALIZE_VEC_FUNCTIONS,
)

KERNELS = sorted(_nvrtc.KERNEL_DIR.glob("*.cu"))
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
              torch.uint64]
NP_INT = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.uint16: np.uint16,
          torch.int32: np.int32, torch.uint32: np.uint32, torch.int64: np.int64, torch.uint64: np.uint64}


# ----------------------------------------------------------------------------- plain-numpy definitions


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (no NaNs occur here)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bits(t: torch.Tensor) -> np.ndarray:
    """Output tensor as comparable numpy bits/values."""
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(np.uint16)
    return t.cpu().numpy()


def np_normalize(img: np.ndarray, mean, std, flip, layout: str, dtype: torch.dtype) -> np.ndarray:
    x = img.astype(np.float32)
    if flip is not None:
        x = np.where(np.asarray(flip)[:, None, None, None], x[:, :, ::-1, :], x)
    y = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    if layout == "NCHW":
        y = y.transpose(0, 3, 1, 2)
    y = np.ascontiguousarray(y)
    if dtype == torch.float16:
        return y.astype(np.float16)
    if dtype == torch.bfloat16:
        return _bf16_bits(y)
    return y


def np_pad_ragged(values: np.ndarray, offsets: np.ndarray, pad_value: int, multiple: int, max_len, labels_pad):
    rows = [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    if max_len is not None:
        rows = [r[:max_len] for r in rows]
    longest = max((len(r) for r in rows), default=0)
    length = -(-longest // multiple) * multiple
    padded = np.full((len(rows), length), pad_value, dtype=values.dtype)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    labels = np.full((len(rows), length), 0 if labels_pad is None else labels_pad, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
        mask[i, : len(r)] = 1
        labels[i, : len(r)] = r.astype(np.int64)
    return padded, mask, labels


# ----------------------------------------------------------------------------- strategies


@st.composite
def image_batches(draw):
    b = draw(st.integers(0, 4))
    h = draw(st.integers(1, 9))
    if draw(st.booleans()):  # the vectorized kernels' case: 3 channels, W % 4 == 0 (W % 8 == 0 half the time)
        w, c = 4 * draw(st.integers(1, 10)), 3
    else:
        w, c = draw(st.integers(1, 40)), draw(st.sampled_from([1, 2, 3, 4, 5]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    img = rng.integers(0, 256, size=(b, h, w, c), dtype=np.uint8)
    mean = rng.uniform(0, 255, size=c).tolist()
    std = rng.uniform(1, 100, size=c).tolist()
    flip = draw(st.one_of(st.none(), st.just(rng.integers(0, 2, size=b).astype(bool))))
    return img, mean, std, flip, draw(st.sampled_from(["NCHW", "NHWC"])), draw(st.sampled_from(DTYPES))


@st.composite
def ragged_batches(draw):
    dtype = draw(st.sampled_from(INT_DTYPES))
    lengths = draw(st.lists(st.integers(0, 20), min_size=0, max_size=12))
    lead = draw(st.integers(0, 3))  # offsets[0] > 0: a slice of a bigger buffer
    tail = draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    info = np.iinfo(NP_INT[dtype])
    values = rng.integers(info.min, info.max, size=lead + sum(lengths) + tail, dtype=NP_INT[dtype], endpoint=True)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) + lead
    multiple = draw(st.sampled_from([1, 2, 8]))
    max_len = draw(st.one_of(st.none(), st.integers(0, 3).map(lambda k: k * multiple * 4)))
    pad_value = int(draw(st.sampled_from([0, int(info.min), int(info.max)])))
    labels_pad = draw(st.sampled_from([None, -100]))
    mask_dtype = draw(st.sampled_from([torch.int64, torch.bool]))
    return values, offsets, pad_value, multiple, max_len, labels_pad, mask_dtype


def _check_pad(result, expected, mask_dtype, labels_pad):
    padded, mask, labels = result
    exp_padded, exp_mask, exp_labels = expected
    assert padded.shape == exp_padded.shape and mask.shape == exp_mask.shape
    np.testing.assert_array_equal(padded.cpu().numpy(), exp_padded)
    assert mask.dtype == mask_dtype
    np.testing.assert_array_equal(mask.cpu().to(torch.int64).numpy(), exp_mask)
    if labels_pad is None:
        assert labels is None
    else:
        assert labels.dtype == torch.int64
        np.testing.assert_array_equal(labels.cpu().numpy(), exp_labels)


# ----------------------------------------------------------------------------- sources compile


def test_every_kernel_has_registered_entry_points():
    assert {p.stem for p in KERNELS} == set(ENTRY_POINTS)
    for path in KERNELS:
        text = path.read_text()
        assert 'extern "C" __global__' in text
        assert _nvrtc.kernel_path(path.stem) == path  # NVRTC compiles exactly this file


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("kernel", [p.stem for p in KERNELS])
def test_kernel_compiles_with_nvcc(kernel, tmp_path):
    """`nvcc -cubin -arch=sm_80` and `-arch=sm_90` of the file NVRTC compiles (both archs in parallel)."""
    archs = ("sm_80", "sm_90")
    procs = {arch: subprocess.Popen(["nvcc", "-cubin", f"-arch={arch}", "-o", str(tmp_path / f"{arch}.cubin"),
                                     str(_nvrtc.kernel_path(kernel))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for arch in archs}
    for arch, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{arch}: {err}"
        image = (tmp_path / f"{arch}.cubin").read_bytes()
        assert image[:4] == b"\x7fELF"
        for name in ENTRY_POINTS[kernel]:
            assert b"\0" + name.encode() + b"\0" in image  # unmangled symbol: cuModuleGetFunction finds it


def _nvrtc_available() -> bool:
    try:
        from cuda.bindings import nvrtc

        return int(nvrtc.nvrtcVersion()[0]) == 0 and bool(_nvrtc._include_dirs())
    except (ImportError, RuntimeError, OSError):
        return False


@pytest.mark.skipif(not _nvrtc_available(), reason="cuda-bindings / NVRTC / CUDA headers not installed")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel", [p.stem for p in KERNELS])
def test_kernel_compiles_with_nvrtc_and_is_cached(kernel, arch, tmp_path, monkeypatch):
    image, kind = _nvrtc.compile_kernel(kernel, arch, cache=tmp_path)
    assert kind == "cubin" and image[:4] == b"\x7fELF"
    assert all(b"\0" + n.encode() + b"\0" in image for n in ENTRY_POINTS[kernel])
    cached = list(tmp_path.glob(f"{kernel}-sm_{arch}-*.cubin"))
    assert len(cached) == 1 and cached[0].read_bytes() == image

    def no_compile(*args, **kwargs):
        raise AssertionError("recompiled despite the disk cache")

    monkeypatch.setattr(_nvrtc, "_nvrtc_compile", no_compile)
    assert _nvrtc.compile_kernel(kernel, arch, cache=tmp_path) == (image, "cubin")


@pytest.mark.skipif(not _nvrtc_available(), reason="cuda-bindings / NVRTC / CUDA headers not installed")
def test_unknown_newer_arch_falls_back_to_ptx(tmp_path):
    image, kind = _nvrtc.compile_kernel("pad_ragged", 999, cache=tmp_path)
    assert kind == "ptx" and b".entry fl_pad_ragged_i32_m64" in image


def test_cache_dir_honours_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTLOAD_CUDA_OPS_CACHE", str(tmp_path / "x"))
    assert cuda_ops.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("FASTLOAD_CUDA_OPS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cuda_ops.cache_dir() == tmp_path / "fastload" / "cuda_ops"


# ----------------------------------------------------------------------------- host emulation of the kernels

_HARNESS = r"""
#include <cstring>
#include <type_traits>
#include <utility>
struct FlEmuDim3 { unsigned x, y, z; };
static FlEmuDim3 threadIdx, blockIdx, blockDim, gridDim;
%(includes)s
template <typename... A, std::size_t... I>
static void fl_emu_call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}
template <typename... A>
static void fl_emu_launch(void (*f)(A...), const unsigned* g, const unsigned* b, void** args) {
    gridDim = {g[0], g[1], g[2]};
    blockDim = {b[0], b[1], b[2]};
    for (unsigned bz = 0; bz < g[2]; ++bz)
    for (unsigned by = 0; by < g[1]; ++by)
    for (unsigned bx = 0; bx < g[0]; ++bx)
    for (unsigned tz = 0; tz < b[2]; ++tz)
    for (unsigned ty = 0; ty < b[1]; ++ty)
    for (unsigned tx = 0; tx < b[0]; ++tx) {
        blockIdx = {bx, by, bz};
        threadIdx = {tx, ty, tz};
        fl_emu_call(f, args, std::index_sequence_for<A...>{});
    }
}
extern "C" int fl_emu(const char* name, const unsigned* grid, const unsigned* block, void** args) {
%(entries)s
    return 1;
}
"""


def _host_include_dirs() -> list[str]:
    """CUDA include dirs usable by a host compiler (NVRTC has crt/ built in; g++ needs the toolkit's)."""
    candidates = list(_nvrtc._include_dirs())
    if shutil.which("nvcc"):
        candidates.append(str(Path(shutil.which("nvcc")).resolve().parent.parent / "include"))
    candidates.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(candidates)
            if Path(d, "cuda_bf16.h").is_file() and Path(d, "crt", "host_defines.h").is_file()]


@pytest.fixture(scope="module")
def host_emulator(tmp_path_factory):
    """A Launcher that runs the kernels' own source on the CPU, thread by thread."""
    gxx = shutil.which("g++")
    includes = _host_include_dirs()
    if gxx is None or not includes:
        pytest.skip("g++ or CUDA headers (cuda_bf16.h) not available")
    build = tmp_path_factory.mktemp("emu")
    names = [n for k in sorted(ENTRY_POINTS) for n in ENTRY_POINTS[k]]
    source = _HARNESS % {
        "includes": "\n".join(f'#include "{_nvrtc.kernel_path(k)}"' for k in sorted(ENTRY_POINTS)),
        "entries": "\n".join(
            f'    if (!std::strcmp(name, "{n}")) {{ fl_emu_launch(&{n}, grid, block, args); return 0; }}'
            for n in names),
    }
    (build / "emu.cpp").write_text(source)
    lib = build / "libemu.so"
    proc = subprocess.run([gxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{includes[0]}", "-o", str(lib),
                           str(build / "emu.cpp")], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    dll = ctypes.CDLL(str(lib))
    dll.fl_emu.restype = ctypes.c_int
    dll.fl_emu.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                           ctypes.c_void_p]

    def make(shrink: tuple[int, int, int] | None = None, block: tuple[int, int, int] | None = None):
        calls = []

        def launch(kernel, function, grid, blk, args, device):
            assert function in ENTRY_POINTS[kernel]
            assert all(1 <= g <= 2**31 - 1 for g in grid) and grid[1] <= 65535 and grid[2] <= 65535
            assert all(b >= 1 for b in blk) and blk[0] * blk[1] * blk[2] <= 1024
            if shrink is not None:  # fewer blocks than the data: exercises the grid-stride loops
                grid = tuple(min(g, s) for g, s in zip(grid, shrink))
            if block is not None:
                blk = block
            calls.append((function, grid, blk))
            _keep, address = _nvrtc.pack_args(args)
            rc = dll.fl_emu(function.encode(), (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*blk), address)
            assert rc == 0, f"no emulated entry point {function}"

        launch.calls = calls
        return launch

    return make


LAUNCH_VARIANTS = [None, ((2, 3, 1), None), ((1, 1, 1), (7, 3, 1))]


@pytest.mark.parametrize("variant", LAUNCH_VARIANTS)
@HYP
@given(batch=image_batches())
def test_normalize_kernel_source_matches_reference(host_emulator, variant, batch):
    img, mean, std, flip, layout, dtype = batch
    launch = host_emulator() if variant is None else host_emulator(*variant)
    images = torch.from_numpy(img)
    flip_t = None if flip is None else torch.from_numpy(flip)
    # numpy buffers are aligned: the shape and dtype alone say which kernels can run
    vec4 = img.shape[3] == 3 and img.shape[2] % 4 == 0
    vec8 = vec4 and img.shape[2] % 8 == 0 and dtype != torch.float32
    name = str(dtype).removeprefix("torch.")
    runnable = {"generic": NORMALIZE_FUNCTIONS[name]}
    if vec4:
        runnable["vec4"] = NORMALIZE_VEC_FUNCTIONS[name]
    if vec8:
        runnable["vec8"] = NORMALIZE_VEC8_FUNCTIONS[name]
    runnable["auto"] = runnable["vec8" if vec8 else "vec4" if vec4 else "generic"]  # the widest that runs
    ref = cuda_ops.normalize_batch_reference(images, mean=mean, std=std, flip=flip_t, layout=layout, dtype=dtype)
    for kernel, function in runnable.items():
        launch.calls.clear()
        out = cuda_ops.normalize_batch(images, mean=mean, std=std, flip=flip_t, layout=layout, dtype=dtype,
                                       launcher=launch, kernel=kernel)
        assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
        np.testing.assert_array_equal(_bits(out), _bits(ref))  # bit-exact: IEEE division, RNE rounding
        assert [c[0] for c in launch.calls] == ([function] if out.numel() else [])


@pytest.mark.parametrize("variant", LAUNCH_VARIANTS)
@HYP
@given(batch=ragged_batches())
def test_pad_ragged_kernel_source_matches_reference(host_emulator, variant, batch):
    values, offsets, pad_value, multiple, max_len, labels_pad, mask_dtype = batch
    launch = host_emulator() if variant is None else host_emulator(*variant)
    out = cuda_ops.pad_ragged(torch.from_numpy(values), torch.from_numpy(offsets), pad_value=pad_value,
                              pad_to_multiple_of=multiple, max_len=max_len, labels_pad_value=labels_pad,
                              mask_dtype=mask_dtype, launcher=launch)
    _check_pad(out, np_pad_ragged(values, offsets, pad_value, multiple, max_len, labels_pad), mask_dtype, labels_pad)


def test_emulated_kernels_cover_wide_rows_and_many_rows(host_emulator):
    """Rows wider than a block and more rows than the grid: every stride loop takes several trips."""
    launch = host_emulator(shrink=(2, 2, 1))
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(5, 7, 600, 3), dtype=np.uint8)
    flip = torch.tensor([True, True, False, False, True, False, True, True, False, True])[::2]  # non-contiguous
    for layout in ("NCHW", "NHWC"):
        for kernel in ("auto", "generic"):
            out = cuda_ops.normalize_batch(torch.from_numpy(img), mean=(1.0, 2.0, 3.0), std=(4.0, 5.0, 6.0),
                                           flip=flip, layout=layout, launcher=launch, kernel=kernel)
            np.testing.assert_array_equal(out.numpy(), np_normalize(img, (1, 2, 3), (4, 5, 6), flip.numpy(), layout,
                                                                    torch.float32))
    assert [c[0] for c in launch.calls] == ["fl_normalize_vec_f32", "fl_normalize_f32"] * 2
    lengths = [700, 0, 3, 513, 1]
    values = rng.integers(-5, 5, size=sum(lengths), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = cuda_ops.pad_ragged(torch.from_numpy(values), torch.from_numpy(offsets), pad_value=-1, pad_to_multiple_of=8,
                              labels_pad_value=-100, mask_dtype=torch.bool, launcher=launch)
    assert out[0].shape == (5, 704)
    _check_pad(out, np_pad_ragged(values, offsets, -1, 8, None, -100), torch.bool, -100)


def _images(shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """A random contiguous uint8 batch starting `offset` bytes into an (aligned) numpy buffer."""
    buf = np.random.default_rng(3).integers(0, 256, size=offset + int(np.prod(shape)), dtype=np.uint8)
    return torch.from_numpy(buf)[offset:].view(shape)


@pytest.mark.parametrize("shape, offset, dtype, kernel, call", [
    ((2, 224, 224, 3), 0, torch.float32, "auto", ("fl_normalize_vec_f32", (56, 2, 1), (64, 4, 1))),  # 4 pixels/thread
    ((2, 224, 224, 3), 0, torch.float32, "generic", ("fl_normalize_f32", (224, 2, 1), (224, 1, 1))),
    ((2, 224, 224, 3), 1, torch.float32, "auto", ("fl_normalize_f32", (224, 2, 1), (224, 1, 1))),  # odd data_ptr
    ((2, 5, 7, 3), 0, torch.float32, "auto", ("fl_normalize_f32", (1, 2, 1), (32, 5, 1))),  # W % 4 != 0
    ((2, 5, 8, 4), 0, torch.float32, "auto", ("fl_normalize_f32", (1, 2, 1), (32, 5, 1))),  # 4 channels
    ((2, 224, 224, 3), 0, torch.float16, "auto", ("fl_normalize_vec8_f16", (28, 2, 1), (32, 8, 1))),  # 16-bit: vec8
    ((2, 224, 224, 3), 0, torch.bfloat16, "auto", ("fl_normalize_vec8_bf16", (28, 2, 1), (32, 8, 1))),
    ((2, 224, 228, 3), 0, torch.float16, "auto", ("fl_normalize_vec_f16", (56, 2, 1), (64, 4, 1))),  # W % 8 != 0
    ((2, 224, 224, 3), 4, torch.bfloat16, "auto", ("fl_normalize_vec_bf16", (56, 2, 1), (64, 4, 1))),  # 4-byte aligned
    ((2, 224, 224, 3), 4, torch.float16, "vec4", ("fl_normalize_vec_f16", (56, 2, 1), (64, 4, 1))),
    ((2, 224, 224, 3), 0, torch.float16, "vec8", ("fl_normalize_vec8_f16", (28, 2, 1), (32, 8, 1))),  # 8 pixels/thread
    ((2, 224, 224, 3), 0, torch.bfloat16, "vec8", ("fl_normalize_vec8_bf16", (28, 2, 1), (32, 8, 1))),
])
def test_normalize_kernel_choice(host_emulator, shape, offset, dtype, kernel, call):
    launch = host_emulator()
    images = _images(shape, offset)
    assert images.is_contiguous() and images.data_ptr() % 8 == offset
    flip = torch.tensor([True, False])
    mean, std = [120.5 + c for c in range(shape[3])], [55.25 + c for c in range(shape[3])]
    out = cuda_ops.normalize_batch(images, mean=mean, std=std, flip=flip, dtype=dtype, launcher=launch, kernel=kernel)
    assert launch.calls == [call]
    np.testing.assert_array_equal(_bits(out), np_normalize(images.numpy(), mean, std, flip.numpy(), "NCHW", dtype))


@pytest.mark.parametrize("shape, offset, dtype, kernel, needs", [
    ((1, 2, 7, 3), 0, torch.float32, "vec4", "width % 4 == 0 (got width 7)"),
    ((1, 2, 8, 4), 0, torch.float16, "vec4", "3 channels (got 4)"),
    ((1, 2, 224, 3), 1, torch.float16, "vec4", "the images 4-byte aligned (data_ptr() % 4 == 1)"),
    ((1, 2, 224, 3), 0, torch.float32, "vec8", "a float16 or bfloat16 output (got torch.float32)"),
    ((1, 2, 228, 3), 0, torch.float16, "vec8", "width % 8 == 0 (got width 228)"),
    ((1, 2, 224, 3), 2, torch.bfloat16, "vec8", "the images 8-byte aligned (data_ptr() % 8 == 2)"),
    ((1, 2, 224, 3), 4, torch.float16, "vec8", "the images 8-byte aligned (data_ptr() % 8 == 4)"),  # vec4 runs
])
def test_a_vectorized_kernel_cannot_be_forced_where_it_cannot_run(host_emulator, shape, offset, dtype, kernel, needs):
    images = _images(shape, offset)
    assert images.data_ptr() % 8 == offset
    with pytest.raises(ValueError, match=f"the {kernel} normalize kernel cannot run here: it needs ") as info:
        cuda_ops.normalize_batch(images, mean=(0.0,) * shape[3], std=(1.0,) * shape[3], dtype=dtype,
                                 launcher=host_emulator(), kernel=kernel)
    assert needs in str(info.value)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype, kernel", [(d, "vec4") for d in DTYPES] + [(torch.float16, "vec8"),
                                                                           (torch.bfloat16, "vec8")])
def test_vectorized_kernels_are_bit_exact_with_flips(host_emulator, layout, dtype, kernel):
    """Mixed flips; a shrunk grid and rows of 258 groups of 4 pixels (129 of 8): every stride loop takes
    several trips."""
    launch = host_emulator(shrink=(2, 2, 1))
    rng = np.random.default_rng(4)
    img = rng.integers(0, 256, size=(5, 6, 1032, 3), dtype=np.uint8)
    flip = np.array([True, False, True, True, False])
    stats = [(cuda_ops.IMAGENET_MEAN, cuda_ops.IMAGENET_STD),
             (rng.uniform(0, 255, 3).tolist(), rng.uniform(1, 100, 3).tolist())]
    for mean, std in stats:
        out = cuda_ops.normalize_batch(torch.from_numpy(img), mean=mean, std=std, flip=torch.from_numpy(flip),
                                       layout=layout, dtype=dtype, launcher=launch, kernel=kernel)
        np.testing.assert_array_equal(_bits(out), np_normalize(img, mean, std, flip, layout, dtype))
    functions = NORMALIZE_VEC_FUNCTIONS if kernel == "vec4" else NORMALIZE_VEC8_FUNCTIONS
    block = (256, 1, 1) if kernel == "vec4" else (160, 1, 1)  # 258 or 129 groups: rounded up to a warp, <= 256
    assert launch.calls == [(functions[str(dtype).removeprefix("torch.")], (2, 2, 1), block)] * 2


# ----------------------------------------------------------------------------- references vs numpy


@HYP
@given(batch=image_batches())
def test_normalize_reference_matches_numpy(batch):
    img, mean, std, flip, layout, dtype = batch
    flip_t = None if flip is None else torch.from_numpy(flip)
    out = cuda_ops.normalize_batch(torch.from_numpy(img), mean=mean, std=std, flip=flip_t, layout=layout, dtype=dtype)
    b, h, w, c = img.shape
    assert out.shape == ((b, c, h, w) if layout == "NCHW" else (b, h, w, c))
    assert out.dtype == dtype and out.is_contiguous()
    np.testing.assert_array_equal(_bits(out), np_normalize(img, mean, std, flip, layout, dtype))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flip", [None, "all", "mixed"])
def test_normalize_all_combinations(layout, dtype, flip):
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, size=(3, 5, 6, 3), dtype=np.uint8)
    f = {None: None, "all": np.ones(3, bool), "mixed": np.array([True, False, True])}[flip]
    out = cuda_ops.normalize_batch(torch.from_numpy(img), mean=cuda_ops.IMAGENET_MEAN, std=cuda_ops.IMAGENET_STD,
                                   flip=None if f is None else torch.from_numpy(f), layout=layout, dtype=dtype)
    expected = np_normalize(img, cuda_ops.IMAGENET_MEAN, cuda_ops.IMAGENET_STD, f, layout, dtype)
    np.testing.assert_array_equal(_bits(out), expected)


def test_normalize_semantics_by_hand():
    img = torch.tensor([[[[0, 10], [255, 20]]]], dtype=torch.uint8)  # B=1, H=1, W=2, C=2
    out = cuda_ops.normalize_batch(img, mean=[0.0, 10.0], std=[255.0, 5.0], flip=torch.tensor([True]))
    # flipped: pixel 0 <- (255, 20), pixel 1 <- (0, 10); NCHW
    assert out.tolist() == [[[[1.0, 0.0]], [[2.0, 0.0]]]]
    nhwc = cuda_ops.normalize_batch(img, mean=0.0, std=1.0, layout="NHWC", dtype=torch.float16)
    assert nhwc.shape == (1, 1, 2, 2) and nhwc.tolist() == [[[[0.0, 10.0], [255.0, 20.0]]]]


def test_normalize_empty_batch():
    out = cuda_ops.normalize_batch(torch.zeros((0, 4, 4, 3), dtype=torch.uint8), mean=0, std=1,
                                   flip=torch.zeros(0, dtype=torch.bool))
    assert out.shape == (0, 3, 4, 4)


def test_normalize_accepts_non_contiguous_input():
    img = torch.randint(0, 256, (2, 3, 8, 3), dtype=torch.uint8)[:, :, ::2]
    out = cuda_ops.normalize_batch(img, mean=1, std=2, layout="NHWC")
    np.testing.assert_array_equal(out.numpy(), np_normalize(img.numpy(), [1] * 3, [2] * 3, None, "NHWC",
                                                            torch.float32))


@HYP
@given(batch=ragged_batches())
def test_pad_ragged_reference_matches_numpy(batch):
    values, offsets, pad_value, multiple, max_len, labels_pad, mask_dtype = batch
    result = cuda_ops.pad_ragged(torch.from_numpy(values), torch.from_numpy(offsets), pad_value=pad_value,
                                 pad_to_multiple_of=multiple, max_len=max_len, labels_pad_value=labels_pad,
                                 mask_dtype=mask_dtype)
    _check_pad(result, np_pad_ragged(values, offsets, pad_value, multiple, max_len, labels_pad), mask_dtype,
               labels_pad)


def test_pad_ragged_by_hand():
    values = np.array([5, 6, 7, 8, 9, 10], dtype=np.int32)
    offsets = np.array([0, 2, 2, 6], dtype=np.int64)
    padded, mask, labels = cuda_ops.pad_ragged(values, offsets, pad_value=-1, pad_to_multiple_of=8,
                                               labels_pad_value=-100)
    assert padded.dtype == torch.int32 and padded.shape == (3, 8)
    assert padded[:, :5].tolist() == [[5, 6, -1, -1, -1], [-1] * 5, [7, 8, 9, 10, -1]]
    assert mask.dtype == torch.int64 and mask.sum(1).tolist() == [2, 0, 4]
    assert labels[0, :3].tolist() == [5, 6, -100]
    truncated, tmask, none = cuda_ops.pad_ragged(values, offsets, max_len=3, mask_dtype=torch.bool)
    assert truncated.tolist() == [[5, 6, 0], [0, 0, 0], [7, 8, 9]] and tmask.dtype == torch.bool and none is None


def test_pad_ragged_edge_cases():
    empty = torch.zeros(0, dtype=torch.int64)
    padded, mask, labels = cuda_ops.pad_ragged(empty, torch.zeros(1, dtype=torch.int64), labels_pad_value=-100)
    assert padded.shape == mask.shape == labels.shape == (0, 0)  # B = 0
    padded, mask, _ = cuda_ops.pad_ragged(empty, torch.zeros(4, dtype=torch.int64), pad_to_multiple_of=8)
    assert padded.shape == (3, 0) and mask.shape == (3, 0)  # only empty rows: L = 0
    padded, _, _ = cuda_ops.pad_ragged(torch.arange(5), torch.tensor([0, 5]), pad_to_multiple_of=5)
    assert padded.shape == (1, 5)  # already a multiple: no extra padding
    padded, _, labels = cuda_ops.pad_ragged(torch.tensor([65535], dtype=torch.int32).to(torch.uint16),
                                            torch.tensor([0, 1]), labels_pad_value=-1)
    assert labels.tolist() == [[65535]]  # unsigned tokens are zero-extended


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"images": torch.zeros(1, 2, 2, 3)}, TypeError, "uint8"),
    ({"images": torch.zeros(2, 2, 3, dtype=torch.uint8)}, ValueError, "(B, H, W, C)"),
    ({"images": np.zeros((1, 2, 2, 3), np.uint8)}, TypeError, "torch.Tensor"),
    ({"mean": [1.0, 2.0]}, ValueError, "mean has 2 values"),
    ({"std": [1.0, 0.0, 1.0]}, ValueError, "non-zero"),
    ({"std": "abc"}, TypeError, "std"),
    ({"layout": "CHW"}, ValueError, "layout"),
    ({"dtype": torch.int32}, TypeError, "dtype"),
    ({"flip": torch.zeros(1, dtype=torch.int64)}, TypeError, "bool"),
    ({"flip": torch.zeros(3, dtype=torch.bool)}, ValueError, "flip must have shape (1,)"),
    ({"flip": [True]}, TypeError, "flip"),
    ({"kernel": "vectorized"}, ValueError, "kernel must be one of ('auto', 'generic', 'vec4', 'vec8')"),
])
def test_normalize_bad_input(kwargs, exc, words):
    args = {"images": torch.zeros(1, 2, 2, 3, dtype=torch.uint8), "mean": 0.0, "std": 1.0, **kwargs}
    images = args.pop("images")
    with pytest.raises(exc, match=None) as info:
        cuda_ops.normalize_batch(images, **args)
    assert words in str(info.value)


@pytest.mark.parametrize("values, offsets, kwargs, exc, words", [
    (torch.zeros(3), torch.tensor([0, 3]), {}, TypeError, "integer"),
    (torch.zeros(3, dtype=torch.bool), torch.tensor([0, 3]), {}, TypeError, "integer"),
    (torch.zeros(1, 3, dtype=torch.int64), torch.tensor([0, 3]), {}, ValueError, "1-D"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0.0, 3.0]), {}, TypeError, "offsets"),
    (torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), {}, ValueError, "B + 1"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([2, 1]), {}, ValueError, "non-decreasing"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 4]), {}, ValueError, "outside values"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([-1, 2]), {}, ValueError, "outside values"),
    (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 3]), {"pad_value": -1}, ValueError, "pad_value"),
    (torch.zeros(3, dtype=torch.int8), torch.tensor([0, 3]), {"pad_value": 200}, ValueError, "torch.int8"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3]), {"pad_value": 1.5}, TypeError, "pad_value"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3]), {"pad_to_multiple_of": 0}, ValueError, "multiple"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3]), {"max_len": -1}, ValueError, "max_len"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3]), {"max_len": 6, "pad_to_multiple_of": 4}, ValueError,
     "multiple of pad_to_multiple_of"),
    (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3]), {"mask_dtype": torch.int32}, TypeError, "mask_dtype"),
    ([1, 2, 3], torch.tensor([0, 3]), {}, TypeError, "values must be"),
])
def test_pad_ragged_bad_input(values, offsets, kwargs, exc, words):
    with pytest.raises(exc) as info:
        cuda_ops.pad_ragged(values, offsets, **kwargs)
    assert words in str(info.value)


# ----------------------------------------------------------------------------- dispatch and fallback


def _fake_cuda_tensor(index: int = 0):
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


def test_cpu_tensors_never_touch_the_backend(monkeypatch):
    def boom():
        raise AssertionError("backend built for a CPU tensor")

    monkeypatch.setattr(_nvrtc, "_CudaBackend", boom)
    assert _nvrtc.kernel_launcher("normalize", torch.zeros(1)) is None


def test_missing_backend_warns_once_then_uses_reference(monkeypatch):
    def unavailable():
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(_nvrtc, "_CudaBackend", unavailable)
    monkeypatch.setattr(_nvrtc, "_backend", None)
    monkeypatch.setattr(_nvrtc, "_unavailable", {})
    monkeypatch.delenv("FASTLOAD_CUDA_OPS", raising=False)
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert _nvrtc.kernel_launcher("pad_ragged", _fake_cuda_tensor()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _nvrtc.kernel_launcher("pad_ragged", _fake_cuda_tensor()) is None  # no second warning
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "strict")
    with pytest.raises(ImportError):
        _nvrtc.kernel_launcher("pad_ragged", _fake_cuda_tensor())
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "reference")
    assert _nvrtc.kernel_launcher("normalize", _fake_cuda_tensor()) is None
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "bogus")
    with pytest.raises(ValueError, match="FASTLOAD_CUDA_OPS"):
        _nvrtc.kernel_launcher("normalize", _fake_cuda_tensor())


def test_warmup_without_cuda_reports_no_kernels():
    if CUDA:
        pytest.skip("CUDA present")
    assert cuda_ops.warmup() == {"normalize": False, "pad_ragged": False}


def test_pack_args_builds_pointer_array():
    args = [_nvrtc.i64(7), _nvrtc.f32(1.5), _nvrtc.i32(-3), _nvrtc.ptr(None)]
    _keep, address = _nvrtc.pack_args(args)
    array = (ctypes.c_void_p * 4).from_address(address)
    assert ctypes.c_int64.from_address(array[0]).value == 7
    assert ctypes.c_float.from_address(array[1]).value == 1.5
    assert ctypes.c_int32.from_address(array[2]).value == -3
    assert ctypes.c_void_p.from_address(array[3]).value is None


# ----------------------------------------------------------------------------- GPU parity (CUDA only)

# Tolerance: normalize is expected bit-exact (IEEE float32 division, round-to-nearest-even casts);
# asserted within one unit in the last place of the output dtype. pad_ragged is exact.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# (3, 224, 224, 3), (2, 17, 1032, 3), (70000, 1, 4, 3) and (1, 70000, 8, 3) run the vectorized kernel.
GPU_IMAGE_SHAPES = [(1, 1, 1, 3), (2, 3, 5, 1), (4, 31, 33, 3), (3, 224, 224, 3), (2, 17, 1031, 4), (2, 17, 1032, 3),
                    (70000, 1, 2, 3), (1, 70000, 2, 3), (70000, 1, 4, 3), (1, 70000, 8, 3)]


@needs_cuda
@pytest.mark.parametrize("shape", GPU_IMAGE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_normalize_matches_reference(shape, dtype, layout, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "strict")
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, layout)).encode()))
    img = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    flip = torch.rand(shape[0], generator=gen) < 0.5
    mean, std = torch.rand(shape[3], generator=gen) * 255, torch.rand(shape[3], generator=gen) * 80 + 1
    out = cuda_ops.normalize_batch(img.cuda(), mean=mean, std=std, flip=flip.cuda(), layout=layout, dtype=dtype)
    ref = cuda_ops.normalize_batch_reference(img, mean=mean, std=std, flip=flip, layout=layout, dtype=dtype)
    assert out.is_cuda and out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), ref, atol=0, rtol=ULP[dtype])


@needs_cuda
@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("lengths", [[0], [1], [0, 0, 5], [300, 7, 0, 1025], [3] * 70000, [100000, 1]])
def test_gpu_pad_ragged_matches_reference(dtype, lengths, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "strict")
    rng = np.random.default_rng(len(lengths))
    info = np.iinfo(NP_INT[dtype])
    values = rng.integers(info.min, info.max, size=sum(lengths) + 2, dtype=NP_INT[dtype], endpoint=True)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) + 1
    for mask_dtype in (torch.int64, torch.bool):
        for offsets_t in (torch.from_numpy(offsets), torch.from_numpy(offsets).cuda()):
            result = cuda_ops.pad_ragged(torch.from_numpy(values).cuda(), offsets_t, pad_value=int(info.max),
                                         pad_to_multiple_of=8, labels_pad_value=-100, mask_dtype=mask_dtype)
            assert all(t.is_cuda for t in result)
            _check_pad(result, np_pad_ragged(values, offsets, int(info.max), 8, None, -100), mask_dtype, -100)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_vectorized_and_generic_kernels_agree(dtype, layout, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "strict")
    img = torch.randint(0, 256, (6, 224, 224, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    flip = torch.tensor([True, False, True, True, False, False])
    images = img.cuda()
    real = _nvrtc.kernel_launcher("normalize", images)
    calls = []

    def recording(kernel, function, *rest):
        calls.append(function)
        real(kernel, function, *rest)

    outs = [cuda_ops.normalize_batch(images, mean=cuda_ops.IMAGENET_MEAN, std=cuda_ops.IMAGENET_STD, flip=flip,
                                     layout=layout, dtype=dtype, launcher=recording, kernel=kernel).cpu()
            for kernel in ("auto", "generic", *(("vec4",) if dtype != torch.float32 else ()))]
    ref = cuda_ops.normalize_batch_reference(img, mean=cuda_ops.IMAGENET_MEAN, std=cuda_ops.IMAGENET_STD, flip=flip,
                                             layout=layout, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    assert calls == [(NORMALIZE_VEC_FUNCTIONS if dtype == torch.float32 else NORMALIZE_VEC8_FUNCTIONS)[name],
                     NORMALIZE_FUNCTIONS[name],  # auto runs vec8 for 16-bit outputs; vec4 forced beside it
                     *([NORMALIZE_VEC_FUNCTIONS[name]] if dtype != torch.float32 else [])]
    for out in outs:
        np.testing.assert_array_equal(_bits(out), _bits(ref))


@needs_cuda
def test_gpu_kernels_run_on_the_current_stream(monkeypatch):
    monkeypatch.setenv("FASTLOAD_CUDA_OPS", "strict")
    img = torch.randint(0, 256, (8, 64, 64, 3), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = cuda_ops.normalize_batch(img, mean=1.0, std=2.0)
    side.synchronize()
    ref = cuda_ops.normalize_batch_reference(img.cpu(), mean=1.0, std=2.0)
    torch.testing.assert_close(out.cpu(), ref, atol=0, rtol=ULP[torch.float32])
    assert cuda_ops.warmup() == {"normalize": True, "pad_ragged": True}


def test_kernel_files_ship_with_the_package():
    assert os.path.isdir(_nvrtc.KERNEL_DIR) and Path(_nvrtc.KERNEL_DIR, "normalize.cu").is_file()


def test_cuda_backend_drives_the_driver_api_correctly(monkeypatch):
    """The launch path against a recording stand-in for cuda.bindings.driver (no GPU needed)."""
    calls = []

    class FakeDriver:
        CUstream = staticmethod(lambda handle: ("stream", handle))

        def __getattr__(self, name):
            def call(*args):
                calls.append((name, args))
                results = {"cuDeviceGet": ("dev",), "cuDevicePrimaryCtxRetain": ("ctx",), "cuModuleLoadData": ("mod",),
                           "cuModuleGetFunction": (("fn", args[-1] if args else None),), "cuCtxPopCurrent": ("ctx",)}
                if name == "cuLaunchKernel":  # decode the packed parameters while they are alive
                    params = (ctypes.c_void_p * 2).from_address(args[9])
                    calls.append(("params", (ctypes.c_int64.from_address(params[0]).value,
                                             ctypes.c_float.from_address(params[1]).value)))
                return (0, *results.get(name, ()))
            return call

    pytest.importorskip("cuda.bindings")
    monkeypatch.setattr("cuda.bindings.driver", FakeDriver(), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: SimpleNamespace(cuda_stream=1234))
    compiled = []
    monkeypatch.setattr(_nvrtc, "compile_kernel",
                        lambda kernel, arch: compiled.append((kernel, arch)) or (b"img", "cubin"))
    backend = _nvrtc._CudaBackend()
    device = torch.device("cuda", 1)
    backend.prepare("normalize", device)
    backend("normalize", "fl_normalize_f16", (3, 2, 1), (32, 8, 1), [_nvrtc.i64(42), _nvrtc.f32(0.5)], device)
    backend("normalize", "fl_normalize_f32", (1, 1, 1), (32, 1, 1), [_nvrtc.i64(7), _nvrtc.f32(2.0)], device)
    assert compiled == [("normalize", 90)]  # compiled and loaded once per (kernel, device)
    names = [c[0] for c in calls]
    assert names[0] == "cuInit" and names.count("cuModuleLoadData") == 1
    assert ("cuDeviceGet", (1,)) in calls
    assert names.count("cuCtxPushCurrent") == names.count("cuCtxPopCurrent") == 3
    launches = [c[1] for c in calls if c[0] == "cuLaunchKernel"]
    assert launches[0][:9] == (("fn", b"fl_normalize_f16"), 3, 2, 1, 32, 8, 1, 0, ("stream", 1234))
    assert [c[1] for c in calls if c[0] == "params"] == [(42, 0.5), (7, 2.0)]
