"""The GPU measurements, one row each: `python -m bench.gpu [--quick] [--row NAME --json PATH]`.

Each row (`ROWS`) is a figure against a baseline measured in the same run, their ratio and the
goal it is held to; `make gpu-check` runs each in its own process (a CUDA fault in one row cannot
take the others down) and collects the JSON:
- parity: every kernel vs its torch reference on random inputs;
- h2d: the Loader's path (pack into the pinned `BufferRing`, copy on a side stream) vs
  `tensor.pin_memory().to('cuda', non_blocking=True)`, from the same pageable batches;
- overlap: data stall of a matmul "training step" (~100 ms) fed by `Loader(device='cuda')`, vs
  torch's DataLoader with `pin_memory=True`;
- normalize: fused normalize/flip/layout/cast vs a device-to-device copy of the same bytes (the
  share of usable memory bandwidth) and vs the unfused torch ops;
- pad_ragged: the kernel vs split + `pad_sequence` (and nested tensors, the vectorized reference);
- train_step: bench.train_step's small CNN, fastload.Loader vs torch DataLoader;
- images (with DALI): the presets through DALI's mixed decoder (nvJPEG ROI) vs DALI's own
  `fn.readers.file` pipeline and the CPU preset feeding the GPU, on the same JPEGs.
Without CUDA a row reports "not run: no CUDA device"; with no --row, the CPU references are timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from bench.train_step import train, write_dataset
from bench.vision import SETS, batches_of, loader_pass, make_jpegs, preset_pass, write_image_dataset
from fastload import cuda_ops
from fastload.dataset import open_dataset
from fastload.loader import Loader
from fastload.system import usable_cores
from fastload.transfer.ring import BufferRing
from fastload.transfer.side_stream import DeviceStage
from fastload.vision import IMAGENET_MEAN, IMAGENET_STD, ImagePreset, dali_available

__all__ = ["ROWS", "Row", "main", "run_row"]


def _gpu_time(fn: Callable[[], object], *, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of a stream of calls, measured with CUDA events on the current stream:
    the slower of the host's cost of issuing a call and the GPU's time for it (what a caller
    issuing them back to back gets)."""
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


_SLEEP_CYCLES_PER_S: list[float] = []


def _sleep_cycles_per_s() -> float:
    """The rate of `torch.cuda._sleep`'s cycles on this device (measured once)."""
    if not _SLEEP_CYCLES_PER_S:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)
        _SLEEP_CYCLES_PER_S.append(cycles / _gpu_time(lambda: torch.cuda._sleep(cycles), iters=1, warmup=0))
    return _SLEEP_CYCLES_PER_S[0]


def _device_time(fn: Callable[[], object], *, iters: int, warmup: int = 3) -> tuple[float, float]:
    """(GPU seconds per call, host seconds per call). A GPU sleep queued first keeps the device busy
    while the host issues every call, so the events time the kernels alone, not the host's launch
    cost; the sleep is lengthened until the host finished issuing before it ended."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    hold = 2e-3
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(hold * _sleep_cycles_per_s()))
        t0 = time.perf_counter()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        issued = time.perf_counter() - t0
        end.synchronize()
        if issued < 0.8 * hold:
            return start.elapsed_time(end) / 1000.0 / iters, issued / iters
        hold = 2 * issued + 1e-3
    raise RuntimeError(f"the host took {issued / iters * 1e6:.0f} us a call: too slow to queue ahead of the GPU")


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


def bench_normalize(batch: int, size: int, iters: int) -> list[dict[str, Any]]:
    """Fused normalize vs a D2D copy of the same bytes and the unfused torch ops; prints the table and
    returns one dict per dtype x layout (GB/s, share of the copy's bandwidth, speedup over unfused)."""
    img = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device="cuda")
    flip = torch.rand(batch, device="cuda") < 0.5
    mean = torch.tensor(cuda_ops.IMAGENET_MEAN, device="cuda")
    std = torch.tensor(cuda_ops.IMAGENET_STD, device="cuda")
    results: list[dict[str, Any]] = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        moved = img.numel() * (1 + torch.empty(0, dtype=dtype).element_size())  # bytes read + written
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy, _ = _device_time(lambda dst=dst, src=src: dst.copy_(src), iters=iters)

        def unfused(dtype: torch.dtype = dtype) -> torch.Tensor:
            x = img.float().permute(0, 3, 1, 2)
            x = x.sub(mean.view(1, 3, 1, 1)).div(std.view(1, 3, 1, 1))
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
            return x.to(dtype).contiguous()

        t_unfused, _ = _device_time(unfused, iters=iters)
        for layout in ("NCHW", "NHWC"):
            times = {}
            sixteen_bit = dtype in (torch.float16, torch.bfloat16)
            for kernel in ("auto", "generic", *(("vec4",) if sixteen_bit else ())):
                try:
                    times[kernel] = _device_time(
                        lambda layout=layout, dtype=dtype, kernel=kernel: cuda_ops.normalize_batch(
                            img, mean=cuda_ops.IMAGENET_MEAN, std=cuda_ops.IMAGENET_STD, flip=flip, layout=layout,
                            dtype=dtype, kernel=kernel,
                        ),
                        iters=iters,
                    )
                except ValueError:  # vec4 cannot run where auto fell back to the generic kernel
                    if kernel != "vec4":
                        raise
            t_fused, t_host = times["auto"]
            results.append({"dtype": str(dtype).removeprefix("torch."), "layout": layout, "fused_ms": 1e3 * t_fused,
                            "gbs": moved / t_fused / 1e9, "copy_ms": 1e3 * t_copy, "copy_gbs": moved / t_copy / 1e9,
                            "of_copy": t_copy / t_fused, "unfused_ms": 1e3 * t_unfused,
                            "vs_unfused": t_unfused / t_fused, "k_img_s": batch * 1e-3 / t_fused,
                            "generic_ms": 1e3 * times["generic"][0], "host_us": 1e6 * t_host,
                            "vec4_ms": 1e3 * times["vec4"][0] if "vec4" in times else None,
                            "vec4_of_copy": t_copy / times["vec4"][0] if "vec4" in times else None})
    _table(
        f"normalize_batch: {batch} x {size}x{size}x3 uint8, random flips (copy = D2D copy of the same bytes)",
        ["dtype", "layout", "fused ms", "GB/s", "copy ms", "% of copy", "generic ms", "vec4 ms", "vec4 % of copy",
         "unfused ms", "speedup", "k img/s", "host us"],
        [[r["dtype"], r["layout"], f"{r['fused_ms']:.3f}", f"{r['gbs']:.0f}", f"{r['copy_ms']:.3f}",
          f"{100 * r['of_copy']:.0f}%", f"{r['generic_ms']:.3f}",
          "" if r["vec4_ms"] is None else f"{r['vec4_ms']:.3f}",
          "" if r["vec4_of_copy"] is None else f"{100 * r['vec4_of_copy']:.0f}%",
          f"{r['unfused_ms']:.3f}", f"{r['vs_unfused']:.1f}x", f"{r['k_img_s']:.0f}", f"{r['host_us']:.0f}"]
         for r in results],
    )
    return results


def bench_pad_ragged(batch: int, max_tokens: int, iters: int) -> dict[str, float]:
    """pad_ragged vs the torch ways of padding the same batch; prints the table, returns seconds per method."""
    values, offsets = _ragged(batch, max_tokens, 1, "cuda")
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    total = int(offsets[-1])

    def loop() -> tuple[torch.Tensor, torch.Tensor]:
        rows = list(torch.split(values, lengths))
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r, dtype=torch.int64) for r in rows], batch_first=True)
        return padded, mask

    def nested() -> torch.Tensor:
        nt = torch.nested.nested_tensor(list(torch.split(values, lengths)))
        return nt.to_padded_tensor(0)

    cases = [
        ("pad_ragged kernel", lambda: cuda_ops.pad_ragged(values, offsets, pad_to_multiple_of=8)),
        ("pad_ragged + labels",
         lambda: cuda_ops.pad_ragged(values, offsets, pad_to_multiple_of=8, labels_pad_value=-100)),
        ("torch reference (vectorized)", lambda: cuda_ops.pad_ragged_reference(values, offsets, pad_to_multiple_of=8)),
        ("split + pad_sequence loop", loop),
        ("nested_tensor.to_padded_tensor", nested),
    ]
    timings: dict[str, float] = {}
    for name, fn in cases:
        try:
            timings[name] = _gpu_time(fn, iters=iters)
        except (RuntimeError, NotImplementedError) as exc:
            print(f"  ({name} skipped: {exc})")
    base = timings["pad_ragged kernel"]
    _table(
        f"pad_ragged: B={batch}, lengths uniform 0..{max_tokens}, {total} int32 tokens (CPU offsets)",
        ["method", "ms", "G tokens/s", "time vs kernel"],
        [[name, f"{t * 1e3:.3f}", f"{total / t / 1e9:.2f}", f"{t / base:.1f}x"] for name, t in timings.items()],
    )
    return timings


# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One measurement of `make gpu-check`: a figure, its same-run baseline, their ratio and the goal."""

    row: str
    status: str = "ok"  # "ok", "FAILED: <why>" or "not run: <why>"
    value: float | None = None
    unit: str = ""
    baseline: str = ""
    baseline_value: float | None = None
    ratio: float | None = None
    goal: str = ""
    met: bool | None = None
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def row_parity(quick: bool) -> Row:
    """Every kernel against its torch reference on random inputs."""
    failures = parity()
    return Row("parity", value=len(failures), unit="mismatches", goal="0 (normalize within 1 ulp, pad_ragged exact)",
               met=not failures, status="ok" if not failures else f"FAILED: {len(failures)} mismatches",
               details=failures[:20])


def row_h2d(quick: bool) -> Row:
    """Host-to-device bandwidth of the Loader's path (pack into the pinned ring, copy on a side stream)
    against torch's `pin_memory().to(device, non_blocking=True)`, both from the same pageable batches."""
    device = torch.device("cuda", torch.cuda.current_device())
    mib = 16 if quick else 64
    gen = torch.Generator().manual_seed(0)
    batches = [{"image": torch.randint(0, 256, (mib, 1 << 20), dtype=torch.uint8, generator=gen),
                "label": torch.arange(256, dtype=torch.int64)} for _ in range(4)]
    nbytes = sum(t.numel() * t.element_size() for t in batches[0].values())
    ring, stage = BufferRing(3, pin=True, device_index=device.index), DeviceStage(device)
    passes = 2 if quick else 4

    def ring_rate() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(passes):
            for batch in batches:
                views, slot = ring.write(batch)
                out, event = stage.start(views)
                del views
                if slot is not None:
                    ring.release(slot, event)
                stage.finish(out, event)
        torch.cuda.synchronize()
        return passes * len(batches) * nbytes / (time.perf_counter() - t0)

    def torch_rate() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(passes):
            for batch in batches:
                {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
        torch.cuda.synchronize()
        return passes * len(batches) * nbytes / (time.perf_counter() - t0)

    pinned = batches[0]["image"].pin_memory()
    copy_gbs = nbytes / _gpu_time(lambda: pinned.to(device, non_blocking=True), iters=10) / 1e9
    ring_rate(), torch_rate()  # warm-up: ring slots and torch's pinned cache allocated
    rounds = 5 if quick else 15
    # the two paths alternate (ABBA) round by round: the host's memory bandwidth drifts between
    # seconds, and a block of one path's rounds after the other's would measure the drift
    ring_rounds, torch_rounds = [], []
    for k in range(rounds):
        pair = (ring_rate, torch_rate) if k % 2 == 0 else (torch_rate, ring_rate)
        for fn in pair:
            (ring_rounds if fn is ring_rate else torch_rounds).append(fn() / 1e9)
    ring_gbs, torch_gbs = float(np.median(ring_rounds)), float(np.median(torch_rounds))
    paired = [a / b for a, b in zip(ring_rounds, torch_rounds)]
    # each half of either path alone, host time per batch: where a gap between the two paths comes from
    try:
        parts_line = "per batch alone (ms, synchronized): " + ", ".join(
            f"{k} {v:.2f}" for k, v in _h2d_parts(batches, ring, stage, device).items())
    except Exception as exc:  # noqa: BLE001 - a diagnostic line; the row's figure stands without it
        parts_line = f"per batch alone: FAILED: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    try:
        loop_line = "per batch inside each loop (ms, host time, unsynchronized): " + ", ".join(
            f"{k} {v:.2f}" for k, v in _h2d_in_loop(batches, ring, stage, device).items())
    except Exception as exc:  # noqa: BLE001 - a diagnostic line, as above
        loop_line = f"per batch inside each loop: FAILED: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    return Row("h2d", value=ring_gbs, unit="GB/s", baseline="tensor.pin_memory().to('cuda', non_blocking=True)",
               baseline_value=torch_gbs, ratio=ring_gbs / torch_gbs, goal=">= 0.9x", met=ring_gbs / torch_gbs >= 0.9,
               details=[f"{nbytes / 2**20:.0f} MiB batches from pageable memory, median of {rounds} rounds, the "
                        f"two paths alternating; ring {min(ring_rounds):.1f}-{max(ring_rounds):.1f} GB/s, torch "
                        f"{min(torch_rounds):.1f}-{max(torch_rounds):.1f} GB/s; round by round ring / torch "
                        f"{min(paired):.2f}-{max(paired):.2f} (median {np.median(paired):.2f})",
                        f"copy ceiling (already pinned, one tensor): {copy_gbs:.1f} GB/s",
                        f"ring: {ring.allocations} pinned buffers allocated, {ring.retired} retired",
                        parts_line,
                        loop_line,
                        f"torch intra-op threads: {torch.get_num_threads()}"])


def _h2d_in_loop(batches: list[dict[str, torch.Tensor]], ring: BufferRing, stage: DeviceStage,
                 device: torch.device) -> dict[str, float]:
    """Milliseconds per batch of each step of the two timed loops, as they run there: the ring's wait
    for a slot and its pack, the side stream's copy issue, and torch's `pin_memory()` and `.to()`
    (host time; the copies themselves run behind)."""
    passes, spent = 4, {"ring wait": 0.0, "ring pack": 0.0, "ring issue": 0.0, "ring loop": 0.0,
                        "pin_memory()": 0.0, "to() issue": 0.0, "torch loop": 0.0}
    timings: dict[str, float] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(passes):
        for batch in batches:
            views, slot = ring.write(batch, timings)
            t1 = time.perf_counter()
            out, event = stage.start(views)
            spent["ring issue"] += time.perf_counter() - t1
            del views
            if slot is not None:
                ring.release(slot, event)
            stage.finish(out, event)
    torch.cuda.synchronize()
    spent["ring loop"] = time.perf_counter() - t0
    spent["ring wait"], spent["ring pack"] = timings.get("ring_wait", 0.0), timings.get("pin", 0.0)
    t0 = time.perf_counter()
    for _ in range(passes):
        for batch in batches:
            t1 = time.perf_counter()
            pinned = {k: v.pin_memory() for k, v in batch.items()}
            t2 = time.perf_counter()
            {k: v.to(device, non_blocking=True) for k, v in pinned.items()}
            spent["pin_memory()"] += t2 - t1
            spent["to() issue"] += time.perf_counter() - t2
    torch.cuda.synchronize()
    spent["torch loop"] = time.perf_counter() - t0
    return {k: 1e3 * v / (passes * len(batches)) for k, v in spent.items()}


def _h2d_parts(batches: list[dict[str, torch.Tensor]], ring: BufferRing, stage: DeviceStage,
               device: torch.device) -> dict[str, float]:
    """Milliseconds per batch of each half of the two H2D paths run alone: the ring's pack
    (`ring.write`), torch's `pin_memory()`, and the copy of an already pinned batch through the
    Loader's side stream (`DeviceStage`) and through torch's `.to(non_blocking=True)`."""

    def per_batch(fn: Callable[[dict[str, torch.Tensor]], object]) -> float:
        fn(batches[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for batch in batches * 2:
            fn(batch)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / (2 * len(batches))

    def pack(batch: dict[str, torch.Tensor]) -> None:
        views, slot = ring.write(batch)
        del views
        if slot is not None:
            ring.release(slot)

    pinned = {k: v.pin_memory() for k, v in batches[0].items()}
    held = ring.write(batches[0])  # (views of a ring slot, the slot)

    def side_stream_copy(_batch: dict[str, torch.Tensor]) -> None:
        out, event = stage.start(held[0])
        stage.finish(out, event)

    out = {"ring pack": per_batch(pack),
           "pin_memory()": per_batch(lambda b: {k: v.pin_memory() for k, v in b.items()}),
           "side-stream copy of a ring slot": per_batch(side_stream_copy),
           "to(non_blocking) of a pinned batch": per_batch(
               lambda _b: {k: v.to(device, non_blocking=True) for k, v in pinned.items()})}
    if held[1] is not None:
        ring.release(held[1])
    return out


def _matmul_step(target_s: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A training-step stand-in: bf16 matmuls lasting about `target_s`, consuming the batch."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    per = _gpu_time(lambda: torch.mm(a, a, out=c), iters=10)
    reps = max(1, round(target_s / per))

    def step(x: torch.Tensor) -> torch.Tensor:
        s = x.float().mean()
        for _ in range(reps):
            torch.mm(a, a, out=c)
        return s + c[0, 0].float()

    return step


def _stalled_run(loader: Any, step: Callable[[torch.Tensor], torch.Tensor], *, steps: int,
                 warmup: int) -> dict[str, Any]:
    """Steps fed by `loader` (any iterable of batches with "record" and "label"). Data stall = the
    share of the wall time the GPU spent idle: wall time minus the GPU time of every step's kernels
    (CUDA events on the step's stream around each step), over wall time. Measured on the device
    itself, it does not move with the GPU's clock, which drops as the card heats over a run. Also
    each step's wait in `next()` (median, max, steps that waited over 1 ms) and, for a fastload
    Loader, its per-stage seconds per step over the measured steps."""
    device = torch.device("cuda", torch.cuda.current_device())
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    it = iter(loader)
    waits: list[float] = []
    t_start = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            torch.cuda.synchronize()
            t_start, waits = time.perf_counter(), []
            if hasattr(loader, "reset_stats"):
                loader.reset_stats()
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        waits.append(time.perf_counter() - t0)
        m = k - warmup
        if m >= 0:
            starts[m].record()
        out = step(batch["record"].to(device, non_blocking=True))
        if m >= 0:
            ends[m].record()
        out.item()  # a step's usual sync
    wall = time.perf_counter() - t_start
    busy = sum(a.elapsed_time(b) for a, b in zip(starts, ends)) / 1e3
    result: dict[str, Any] = {
        "stall": max(0.0, wall - busy) / wall, "host_wait": sum(waits) / wall, "gpu_step_ms": 1e3 * busy / steps,
        "samples_per_s": steps * int(batch["label"].shape[0]) / wall, "step_ms": 1e3 * wall / steps,
        "wait_ms": (1e3 * float(np.median(waits)), 1e3 * max(waits), sum(w > 1e-3 for w in waits)),
    }
    if hasattr(loader, "stats"):
        st = loader.stats()
        keys = ("read_s", "pin_s", "ring_wait_s", "h2d_s", "wait_s")
        result["stages_ms"] = {k.removesuffix("_s"): 1e3 * st[k] / steps for k in keys if k in st}
    return result


def _overlap_line(name: str, r: dict[str, Any]) -> str:
    median, most, count = r["wait_ms"]
    line = (f"{name}: step {r['step_ms']:.1f} ms (GPU {r['gpu_step_ms']:.1f} ms), stall {100 * r['stall']:.2f}%, "
            f"host wait {100 * r['host_wait']:.2f}% (median {median:.2f} ms, max {most:.1f} ms, "
            f"{count} steps over 1 ms), {r['samples_per_s']:,.0f} samples/s")
    if "stages_ms" in r:
        line += "; per step " + ", ".join(f"{k} {v:.2f} ms" for k, v in r["stages_ms"].items())
    return line


def row_overlap(quick: bool) -> Row:
    """Data stall of a synthetic training step fed by `Loader(device='cuda')` vs torch's DataLoader
    with `pin_memory=True` (the batch copied with `non_blocking=True` on the compute stream); the
    Loader also with worker processes, and with `pin_memory=True` and no `device` (copied as torch's)."""
    batch_size, workers = 256, 4
    steps, warmup = (20, 3) if quick else (40, 5)
    step = _matmul_step(0.1)
    with tempfile.TemporaryDirectory(prefix="fastload-overlap-") as tmp:
        n = write_dataset(tmp, size=(192 if quick else 1024) << 20, shape=(3, 224, 224))
        ds = open_dataset(tmp)
        x = torch.randint(0, 256, (batch_size, 3, 224, 224), dtype=torch.uint8, device="cuda")
        resident = {"record": x, "label": torch.zeros(batch_size, dtype=torch.int64)}
        # the same steps on a batch already on the GPU: the GPU's idle share without any loader (the
        # host's launches and each step's sync), the floor of every row's stall
        compute = _stalled_run(itertools.repeat(resident), step, steps=steps, warmup=warmup)
        common: dict[str, Any] = {"batch_size": batch_size, "shuffle": True, "num_workers": workers,
                                  "persistent_workers": True, "drop_last": True}
        variants = [("fastload Loader(device='cuda')", lambda: Loader(ds, device="cuda", **common)),
                    ("fastload Loader(device='cuda', worker_type='process')",
                     lambda: Loader(ds, device="cuda", worker_type="process", **common)),
                    ("fastload Loader(pin_memory=True)", lambda: Loader(ds, pin_memory=True, **common)),
                    ("torch DataLoader(pin_memory=True)", lambda: DataLoader(ds, pin_memory=True, **common))]
        results: dict[str, dict[str, Any]] = {}
        failed: list[str] = []
        for k, (name, make) in enumerate(variants):
            try:
                loader = make()
                try:
                    results[name] = _stalled_run(loader, step, steps=steps, warmup=warmup)
                finally:
                    if hasattr(loader, "close"):
                        loader.close()
                    del loader
            except Exception as exc:
                if k in (0, len(variants) - 1):  # the row's own figure and its baseline
                    raise
                failed.append(f"{name}: FAILED: {type(exc).__name__}: {exc}".splitlines()[0][:300])
    ours, theirs = results[variants[0][0]], results[variants[-1][0]]
    mb = batch_size * 3 * 224 * 224 / 1e6
    return Row("overlap", value=100 * ours["stall"], unit="% data stall",
               baseline="torch DataLoader(pin_memory=True), samples/s", baseline_value=theirs["samples_per_s"],
               ratio=ours["samples_per_s"] / theirs["samples_per_s"], goal="stall < 1% of step time",
               met=ours["stall"] < 0.01,
               details=[f"{n} samples uint8 3x224x224, batch {batch_size} ({mb:.0f} MB), {workers} workers, "
                        f"{steps} steps after {warmup}; stall = the GPU's idle share of the wall time (CUDA "
                        f"events around each step)",
                        f"compute only (the batch already on the GPU): step {compute['step_ms']:.1f} ms (GPU "
                        f"{compute['gpu_step_ms']:.1f} ms of bf16 matmuls), idle {100 * compute['stall']:.2f}%",
                        *(_overlap_line(name, r) for name, r in results.items()), *failed])


def row_normalize(quick: bool, size: int = 224) -> Row:
    """Fused normalize/flip/layout/cast: its bandwidth as a share of a D2D copy of the same bytes,
    GPU time alone (see `_device_time`), on a batch several times the L2 cache so both read HBM."""
    batch = 64 if quick else 1024
    rows = bench_normalize(batch, size, 5 if quick else 20)
    worst = min(rows, key=lambda r: r["of_copy"])
    return Row("normalize", value=worst["gbs"], unit="GB/s (slowest dtype/layout)",
               baseline="device-to-device copy of the same bytes, GB/s", baseline_value=worst["copy_gbs"],
               ratio=worst["of_copy"], goal=">= 0.70x", met=worst["of_copy"] >= 0.70,
               details=[f"{batch} images {size}x{size}x3 uint8 in; times are GPU time with the host's launches "
                        "queued ahead (host us: the host's cost of one call)",
                        *(f"{r['dtype']} {r['layout']}: {r['gbs']:.0f} GB/s = {100 * r['of_copy']:.0f}% of copy, "
                          f"{r['vs_unfused']:.1f}x the unfused torch ops, generic kernel {r['generic_ms']:.3f} ms "
                          f"against {r['fused_ms']:.3f} ms"
                          + ("" if r["vec4_ms"] is None else
                             f", 4-pixel kernel {r['vec4_ms']:.3f} ms = {100 * r['vec4_of_copy']:.0f}% of copy")
                          + f", host {r['host_us']:.0f} us a call" for r in rows)])


def row_pad_ragged(quick: bool) -> Row:
    """pad_ragged kernel against split + torch.nn.utils.rnn.pad_sequence on the GPU."""
    timings = bench_pad_ragged(64 if quick else 256, 2048, 5 if quick else 20)
    kernel, loop = timings["pad_ragged kernel"], timings["split + pad_sequence loop"]
    return Row("pad_ragged", value=1e3 * kernel, unit="ms per batch", baseline="split + pad_sequence, ms",
               baseline_value=1e3 * loop, ratio=loop / kernel, goal="faster than pad_sequence (ratio > 1x)",
               met=loop > kernel, details=[f"{name}: {1e3 * t:.3f} ms" for name, t in timings.items()])


def row_train_step(quick: bool) -> Row:
    """bench.train_step's small CNN on the GPU: fastload.Loader vs torch DataLoader, both pin_memory=True."""
    device = torch.device("cuda")
    steps = 30 if quick else 100
    with tempfile.TemporaryDirectory(prefix="fastload-train-") as tmp:
        write_dataset(tmp, size=(16 if quick else 64) << 20)
        ds = open_dataset(tmp)
        fl = Loader(ds, batch_size=128, shuffle=True, num_workers=2, pin_memory=True)
        ours = train(fl, steps=steps, warmup=10, device=device)
        fl.close()
        theirs = train(DataLoader(ds, batch_size=128, shuffle=True, num_workers=2, pin_memory=True),
                       steps=steps, warmup=10, device=device)
    return Row("train_step", value=ours["samples_per_s"], unit="samples/s",
               baseline="torch DataLoader(pin_memory=True), samples/s", baseline_value=theirs["samples_per_s"],
               ratio=ours["samples_per_s"] / theirs["samples_per_s"], goal="", met=None,
               details=[f"{name}: step {r['step_ms']:.1f} ms, data stall {100 * r['data_stall']:.1f}%"
                        for name, r in (("fastload", ours), ("torch", theirs))])


def _dali_reader_pass(root: str, *, kind: str, size: int, batch: int, threads: int) -> Callable[[], int]:
    """DALI's own pipeline on the same JPEGs: fn.readers.file -> mixed decode -> resize -> normalize."""
    from nvidia.dali import fn, pipeline_def, types


    @pipeline_def(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device())
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=root, name="reader")
        if kind == "train":
            images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
            images = fn.resize(images, size=(size, size))
            mirror: Any = fn.random.coin_flip()
        else:
            images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=round(size * 256 / 224))
            mirror = 0
        out = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW", crop=(size, size),
                                       mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD), mirror=mirror)
        return out, labels

    p = pipe()
    p.build()
    per_epoch = max(1, p.epoch_size("reader") // batch)

    def one_pass() -> int:
        for _ in range(per_epoch):
            p.run()
        return per_epoch * batch

    return one_pass


def row_images(quick: bool, size: int = 224) -> Row:
    """The image presets through DALI's mixed decoder (nvJPEG ROI) against DALI's own fn.readers.file
    pipeline and the CPU preset feeding the GPU, images/s on the same JPEGs."""
    if not dali_available():
        return Row("images", status="not run: NVIDIA DALI is not installed (its bundle parts were not carried)")
    n = 64 if quick else 256
    jpegs = make_jpegs(n, **SETS["500x375"])
    batches, cores = batches_of(jpegs, 64), usable_cores()
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="fastload-dali-") as tmp:
        os.makedirs(os.path.join(tmp, "0"))
        for i, data in enumerate(jpegs):
            with open(os.path.join(tmp, "0", f"{i:05d}.jpg"), "wb") as fh:
                fh.write(data)
        passes: dict[str, Callable[[], int]] = {}
        for kind in ("eval", "train"):
            passes[f"{kind} fastload dali-mixed"] = preset_pass(
                ImagePreset(kind=kind, size=size, backend="dali", device="cuda", threads=cores), batches)
            passes[f"{kind} DALI fn.readers.file"] = _dali_reader_pass(tmp, kind=kind, size=size, batch=64,
                                                                       threads=cores)
            passes[f"{kind} fastload cpu -> cuda"] = preset_pass(
                ImagePreset(kind=kind, size=size, backend="cpu", device="cuda", threads=cores), batches)
        root = os.path.join(tmp, "fastload")
        write_image_dataset(jpegs, root)
        passes["train fastload Loader dali-mixed, 2 thread workers"] = loader_pass(
            root, ImagePreset(kind="train", size=size, backend="dali", device="cuda", threads=cores), 64, 2)
        failed: list[str] = []
        for label, fn in list(passes.items()):
            try:
                fn()  # warm-up: pipelines built, decoders initialised
            except Exception as exc:
                if "Loader" not in label:
                    raise
                failed.append(f"{label}: FAILED: {type(exc).__name__}: {exc}".splitlines()[0][:300])
                del passes[label]
        for _ in range(2 if quick else 4):
            for label, fn in passes.items():
                t0, k = time.perf_counter(), 0
                while time.perf_counter() - t0 < 0.5:
                    k += fn()
                rates.setdefault(label, []).append(k / (time.perf_counter() - t0))
    med = {label: float(np.median(r)) for label, r in rates.items()}
    ours, dali = med["train fastload dali-mixed"], med["train DALI fn.readers.file"]
    return Row("images", value=ours, unit="img/s (train preset, DALI mixed)", baseline="DALI fn.readers.file, img/s",
               baseline_value=dali, ratio=ours / dali, goal="", met=None,
               details=[f"{n} JPEGs 500x375 q90, batch 64, {size}x{size} fp16 NCHW, {cores} CPU threads"]
               + [f"{label}: {v:,.0f} img/s ({v / med[label.split()[0] + ' DALI fn.readers.file']:.2f}x DALI reader)"
                  for label, v in med.items()]
               + ["the preset rows call the preset on one batch at a time (its DALI pipeline is fed and drained "
                  "per call); the Loader row overlaps batches on its worker threads; DALI's reader pipeline "
                  "prefetches batches itself", *failed])


ROWS: dict[str, Callable[[bool], Row]] = {
    "parity": row_parity,
    "h2d": row_h2d,
    "overlap": row_overlap,
    "normalize": row_normalize,
    "pad_ragged": row_pad_ragged,
    "train_step": row_train_step,
    "images": row_images,
}


def run_row(name: str, quick: bool) -> Row:
    """One row; without CUDA (after importing what the row needs) it is reported as not run."""
    if not torch.cuda.is_available():
        return Row(name, status="not run: no CUDA device")
    os.environ["FASTLOAD_CUDA_OPS"] = "strict"  # a missing kernel backend is an error here, not a fallback
    try:
        return ROWS[name](quick)
    except Exception as exc:  # noqa: BLE001 - a row's failure is its result, reported with the others
        return Row(name, status=f"FAILED: {type(exc).__name__}: {exc}".splitlines()[0][:300],
                   details=traceback.format_exc().strip().splitlines()[-12:])


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
    parser.add_argument("--row", choices=sorted(ROWS), help="run one row (default: all of them, in order)")
    parser.add_argument("--json", help="with --row: write the row's result here")
    args = parser.parse_args(argv)
    if args.row:
        row = run_row(args.row, args.quick)
        print(f"{row.row}: {row.status}" + (f"; {row.value:.4g} {row.unit}" if row.value is not None else "")
              + (f"; {row.ratio:.3g}x the baseline" if row.ratio is not None else ""))
        for line in row.details:
            print(f"  {line}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(row.to_json(), fh, indent=1)
        return 1 if row.status.startswith("FAILED") else 0
    if not torch.cuda.is_available():
        print(
            "bench.gpu: no CUDA device visible; the fused kernels and the image rows need one. "
            "Timing the CPU references instead."
        )
        cpu_only(5 if args.quick else 20)
        return 0
    os.environ["FASTLOAD_CUDA_OPS"] = "strict"  # a missing backend is an error here, not a silent fallback
    print(
        f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
        f"torch {torch.__version__}, kernel cache {cuda_ops.cache_dir()}"
    )
    t0 = time.perf_counter()
    print(f"warmup (compile or load from cache): {cuda_ops.warmup()} in {time.perf_counter() - t0:.2f}s")
    failed = False
    for name in ROWS:
        row = run_row(name, args.quick)
        failed |= row.status.startswith("FAILED")
        print(f"\n{name}: {row.status}; {row.value} {row.unit}; ratio {row.ratio} vs {row.baseline}; goal {row.goal}")
        for line in row.details:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
