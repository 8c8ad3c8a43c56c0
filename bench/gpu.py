"""fastload.cuda_ops on a GPU: parity checks, then throughput tables. `python -m bench.gpu [--quick]`.

On a CUDA machine, in one run:
- parity: every kernel vs its torch reference on random inputs (exit 1 on any mismatch);
- normalize_batch (uint8 NHWC -> fp16/bf16/fp32 NCHW, random flips): fused kernel vs a plain
  device-to-device copy moving the same bytes (its % is the share of usable memory bandwidth) and
  vs the unfused torch sequence (float cast, permute, sub, div, flip, cast);
- pad_ragged: kernel vs a torch loop (split + pad_sequence), nested tensors and the vectorized
  torch reference;
- images (with DALI): the eval / train presets through DALI's mixed decoder (nvJPEG ROI decode,
  fp16 NCHW on the GPU) vs the CPU backend feeding the same device (CPU decode, pinned copy,
  normalise on the GPU), on bench.vision's 500x375 JPEGs, in paired rounds; and their mean
  absolute difference (0..255 units).
Without CUDA it says so, times the CPU references on a tiny batch and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from fastload import cuda_ops
from fastload.vision import IMAGENET_STD

__all__ = ["main"]


def _gpu_time(fn: Callable[[], object], *, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call, measured with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def _cpu_time(fn: Callable[[], object], *, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def _ragged(batch: int, max_tokens: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_tokens + 1, size=batch)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    values = torch.from_numpy(rng.integers(0, 50000, size=int(offsets[-1]), dtype=np.int32)).to(device)
    return values, offsets


# ----------------------------------------------------------------------------- parity


def parity() -> list[str]:
    """Kernel vs reference on random inputs of many shapes; returns failure descriptions."""
    failures = []
    gen = torch.Generator().manual_seed(0)
    ulp = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
    for shape in [
        (1, 1, 1, 3),
        (5, 7, 33, 3),
        (64, 224, 224, 3),
        (3, 19, 1031, 1),
        (2, 8, 8, 4),
        (70000, 1, 2, 3),
    ]:
        img = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        flip = torch.rand(shape[0], generator=gen) < 0.5
        for dtype, tol in ulp.items():
            for layout in ("NCHW", "NHWC"):
                kwargs = {
                    "mean": cuda_ops.IMAGENET_MEAN[: shape[3]] if shape[3] <= 3 else 127.5,
                    "std": cuda_ops.IMAGENET_STD[: shape[3]] if shape[3] <= 3 else 60.0,
                    "layout": layout,
                    "dtype": dtype,
                }
                out = cuda_ops.normalize_batch(img.cuda(), flip=flip.cuda(), **kwargs).cpu()
                ref = cuda_ops.normalize_batch_reference(img, flip=flip, **kwargs)
                try:
                    torch.testing.assert_close(out, ref, atol=0, rtol=tol)
                except AssertionError as exc:
                    failures.append(f"normalize {shape} {dtype} {layout}: {str(exc).splitlines()[0]}")
    for batch, max_tokens in [(1, 0), (7, 5), (256, 2048), (70000, 4), (2, 100000)]:
        values, offsets = _ragged(batch, max_tokens, batch, "cpu")
        for dtype in (torch.int32, torch.int64, torch.uint8, torch.int16):
            v = values.to(dtype)
            for kwargs in (
                {},
                {"pad_to_multiple_of": 64, "labels_pad_value": -100},
                {"max_len": 128, "mask_dtype": torch.bool},
            ):
                got = cuda_ops.pad_ragged(v.cuda(), offsets, **kwargs)
                ref = cuda_ops.pad_ragged_reference(v, offsets, **kwargs)
                for name, a, b in zip(("padded", "mask", "labels"), got, ref):
                    if (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b)):
                        failures.append(f"pad_ragged B={batch} {dtype} {kwargs}: {name} differs")
    return failures


# ----------------------------------------------------------------------------- benchmarks


def bench_normalize(batch: int, size: int, iters: int) -> None:
    img = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device="cuda")
    flip = torch.rand(batch, device="cuda") < 0.5
    mean = torch.tensor(cuda_ops.IMAGENET_MEAN, device="cuda")
    std = torch.tensor(cuda_ops.IMAGENET_STD, device="cuda")
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        moved = img.numel() * (1 + torch.empty(0, dtype=dtype).element_size())  # bytes read + written
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = _gpu_time(lambda dst=dst, src=src: dst.copy_(src), iters=iters)

        def unfused(dtype: torch.dtype = dtype) -> torch.Tensor:
            x = img.float().permute(0, 3, 1, 2)
            x = x.sub(mean.view(1, 3, 1, 1)).div(std.view(1, 3, 1, 1))
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
            return x.to(dtype).contiguous()

        t_unfused = _gpu_time(unfused, iters=iters)
        for layout in ("NCHW", "NHWC"):
            t_fused = _gpu_time(
                lambda layout=layout, dtype=dtype: cuda_ops.normalize_batch(
                    img,
                    mean=cuda_ops.IMAGENET_MEAN,
                    std=cuda_ops.IMAGENET_STD,
                    flip=flip,
                    layout=layout,
                    dtype=dtype,
                ),
                iters=iters,
            )
            rows.append(
                [
                    str(dtype).removeprefix("torch."),
                    layout,
                    f"{t_fused * 1e3:.3f}",
                    f"{moved / t_fused / 1e9:.0f}",
                    f"{t_copy * 1e3:.3f}",
                    f"{100 * t_copy / t_fused:.0f}%",
                    f"{t_unfused * 1e3:.3f}",
                    f"{t_unfused / t_fused:.1f}x",
                    f"{batch * 1e-3 / t_fused:.0f}",
                ]
            )
    _table(
        f"normalize_batch: {batch} x {size}x{size}x3 uint8, random flips (copy = D2D copy of the same bytes)",
        [
            "dtype",
            "layout",
            "fused ms",
            "GB/s",
            "copy ms",
            "% of copy",
            "unfused ms",
            "speedup",
            "k img/s",
        ],
        rows,
    )


def bench_pad_ragged(batch: int, max_tokens: int, iters: int) -> None:
    values, offsets = _ragged(batch, max_tokens, 1, "cuda")
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    total = int(offsets[-1])

    def loop() -> torch.Tensor:
        rows = list(torch.split(values, lengths))
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r, dtype=torch.int64) for r in rows], batch_first=True)
        return padded, mask

    def nested() -> torch.Tensor:
        nt = torch.nested.nested_tensor(list(torch.split(values, lengths)))
        return nt.to_padded_tensor(0)

    cases = [
        (
            "pad_ragged kernel",
            lambda: cuda_ops.pad_ragged(values, offsets, pad_to_multiple_of=8),
        ),
        (
            "pad_ragged + labels",
            lambda: cuda_ops.pad_ragged(values, offsets, pad_to_multiple_of=8, labels_pad_value=-100),
        ),
        (
            "torch reference (vectorized)",
            lambda: cuda_ops.pad_ragged_reference(values, offsets, pad_to_multiple_of=8),
        ),
        ("split + pad_sequence loop", loop),
        ("nested_tensor.to_padded_tensor", nested),
    ]
    timings = []
    for name, fn in cases:
        try:
            timings.append((name, _gpu_time(fn, iters=iters)))
        except (RuntimeError, NotImplementedError) as exc:
            print(f"  ({name} skipped: {exc})")
    base = timings[0][1]
    rows = [[name, f"{t * 1e3:.3f}", f"{total / t / 1e9:.2f}", f"{t / base:.1f}x"] for name, t in timings]
    _table(
        f"pad_ragged: B={batch}, lengths uniform 0..{max_tokens}, {total} int32 tokens (CPU offsets)",
        ["method", "ms", "G tokens/s", "time vs kernel"],
        rows,
    )


def bench_images(size: int, quick: bool) -> None:
    """Image presets on the GPU: DALI mixed (nvJPEG ROI decode) vs the CPU backend + GPU
    normalise, images/s in paired rounds (median, min-max), and their pixel agreement."""
    from bench.vision import SETS, batches_of, make_jpegs, preset_pass
    from fastload.system import usable_cores
    from fastload.vision import ImagePreset, dali_available

    if not dali_available():
        print("\nimages: NVIDIA DALI not installed (pip install 'fastload[dali]'): image rows skipped")
        return
    n = 64 if quick else 256
    batches = batches_of(make_jpegs(n, **SETS["500x375"]), 64)
    cores = usable_cores()
    rows, passes = [], {}
    for kind in ("eval", "train"):
        mixed = ImagePreset(kind=kind, size=size, backend="dali", device="cuda", threads=cores)
        cpu = ImagePreset(kind=kind, size=size, backend="cpu", device="cuda", threads=cores)
        a, b = mixed(batches[0])["image"].float(), cpu(batches[0])["image"].float()
        std = torch.tensor(IMAGENET_STD, device=a.device).reshape(1, 3, 1, 1)
        diff = ((a - b) * std).abs().mean().item()
        passes[f"{kind}: dali-mixed (nvJPEG ROI)"] = preset_pass(mixed, batches)
        passes[f"{kind}: cpu backend -> cuda"] = preset_pass(cpu, batches)
        rows.append([f"{kind} mean |mixed - cpu| (0..255)", f"{diff:.2f}", ""])
    rates: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(2 if quick else 4):
        for label, fn in passes.items():
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.5:
                k += fn()
            rates[label].append(k / (time.perf_counter() - t0))
    for label, r in rates.items():
        x = np.array(r)
        rows.append([label, f"{np.median(x):.0f}", f"{x.min():.0f}-{x.max():.0f}"])
    _table(
        f"image presets, {n} JPEGs 500x375 q90, batch 64, {size}x{size} fp16 NCHW on the GPU, {cores} CPU threads",
        ["row", "img/s median (or value)", "min-max"],
        rows,
    )


def cpu_only(iters: int) -> None:
    img = torch.randint(0, 256, (8, 64, 64, 3), dtype=torch.uint8)
    t_norm = _cpu_time(
        lambda: cuda_ops.normalize_batch(
            img,
            mean=cuda_ops.IMAGENET_MEAN,
            std=cuda_ops.IMAGENET_STD,
            flip=torch.ones(8, dtype=torch.bool),
            dtype=torch.float16,
        ),
        iters=iters,
    )
    values, offsets = _ragged(64, 512, 0, "cpu")
    t_pad = _cpu_time(lambda: cuda_ops.pad_ragged(values, offsets, pad_to_multiple_of=8), iters=iters)
    _table(
        "CPU references (no CUDA: timings of the torch definitions, not the kernels)",
        ["op", "ms"],
        [
            ["normalize_batch 8x64x64x3 -> fp16 NCHW", f"{t_norm * 1e3:.3f}"],
            ["pad_ragged B=64, lengths 0..512", f"{t_pad * 1e3:.3f}"],
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer iterations")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="images per normalize batch (default 256)",
    )
    parser.add_argument("--size", type=int, default=224, help="image height = width")
    args = parser.parse_args(argv)
    iters = 5 if args.quick else 20
    if not torch.cuda.is_available():
        print(
            "bench.gpu: no CUDA device visible; the fused kernels and the image rows need one. "
            "Timing the CPU references instead."
        )
        cpu_only(iters)
        return 0
    os.environ["FASTLOAD_CUDA_OPS"] = "strict"  # a missing backend is an error here, not a silent fallback
    print(
        f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
        f"torch {torch.__version__}, kernel cache {cuda_ops.cache_dir()}"
    )
    t0 = time.perf_counter()
    print(f"warmup (compile or load from cache): {cuda_ops.warmup()} in {time.perf_counter() - t0:.2f}s")
    failures = parity()
    print(
        f"parity: {'PASS' if not failures else 'FAIL'} (normalize within 1 ulp of the output dtype; pad_ragged exact)"
    )
    for line in failures[:20]:
        print(f"  {line}")
    batch = args.batch or (64 if args.quick else 256)
    bench_normalize(batch, args.size, iters)
    bench_pad_ragged(64 if args.quick else 256, 2048, iters)
    bench_images(args.size, args.quick)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
