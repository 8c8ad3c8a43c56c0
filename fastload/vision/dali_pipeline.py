"""The DALI side: one pipeline per preset, fed a batch at a time through `external_source`.

Inputs per sample: the encoded bytes (uint8 1-D), the crop window as `roi_start`/`roi_end`
(float32 (y, x), absolute pixels) and the flip flag (int32 scalar): all computed on the host
by `fastload.vision.params`, so DALI applies the same crop and flip as the CPU backend and
nothing depends on DALI's per-pipeline RNG. Graph: `decoders.image_slice` (decodes only the
window: nvJPEG on a GPU, 'mixed'; libjpeg-turbo on the CPU, `device_id=None`) -> `resize` of the
whole slice to the output size (antialiased linear). Then `crop_mirror_normalize` (mean/std,
mirror, layout; fp16 on the GPU, float32 on the CPU, where torch rounds it to fp16/bf16 while
copying out of DALI's buffer) or, for uint8 output, `flip`.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["DALI_MISSING", "DaliRunner", "dali_available"]

DALI_MISSING = (
    "NVIDIA DALI is not installed (pip install 'fastload[dali]', i.e. nvidia-dali-cuda130); "
    "the image preset runs with the CPU decoder instead (backend='cpu')."
)


def dali_available() -> bool:
    """True when `nvidia.dali` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        return False


class DaliRunner:
    """Builds the pipeline lazily (and again after an error, or for a larger batch)."""

    def __init__(
        self,
        *,
        mode: str,
        out_hw: tuple[int, int],
        mean: Sequence[float],
        std: Sequence[float],
        layout: str,
        dtype: torch.dtype,
        normalize: bool,
        threads: int,
        device_id: int | None,
    ) -> None:
        if mode not in ("cpu", "mixed"):
            raise ValueError(f"DALI decode mode must be 'cpu' or 'mixed', got {mode!r}")
        if mode == "mixed" and device_id is None:
            raise ValueError("the mixed (nvJPEG) DALI pipeline needs a CUDA device")
        self.mode = mode
        self.out_hw = out_hw
        self.mean = [float(v) for v in mean]
        self.std = [float(v) for v in std]
        self.layout = layout
        self.dtype = dtype
        self.normalize = normalize
        self.threads = threads
        self.device_id = device_id
        self._pipe = None
        self._capacity = 0
        # one DALI pipeline: its feed_input, run and output buffer (reused by the next run) are
        # one batch's at a time, so worker threads sharing this runner take turns (two threads
        # feeding and running it at once deadlocked DALI, or could swap their batches)
        self._lock = threading.Lock()

    def _build(self, capacity: int) -> None:
        pipe = self._define(capacity, device_id=self.device_id if self.mode == "mixed" else None)
        pipe.build()
        self._pipe = pipe
        self._capacity = capacity

    def graph(self, capacity: int = 1) -> bytes:
        """This pipeline defined without a device and serialized (DALI's protobuf): DALI's front
        end checks every operator and argument while defining it, so this validates the graph of
        the mixed (nvJPEG) pipeline too on a machine without CUDA, where it cannot be built."""
        return self._define(capacity, device_id=None).serialize()

    def _define(self, capacity: int, *, device_id: int | None):
        """The pipeline (not built) for batches of up to `capacity` images."""
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        pipe = Pipeline(
            batch_size=capacity,
            num_threads=self.threads,
            device_id=device_id,
            prefetch_queue_depth=1,
            exec_async=False,
            exec_pipelined=False,
        )
        with pipe:
            enc = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            roi_start = fn.external_source(name="roi_start", dtype=types.FLOAT, ndim=1)
            roi_end = fn.external_source(name="roi_end", dtype=types.FLOAT, ndim=1)
            flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
            # ROI decode: nvJPEG ('mixed', via nvImageCodec) or libjpeg-turbo (CPU) decodes only
            # the window (the same pixels as a full decode + crop), which is then resized whole.
            img = fn.decoders.image_slice(
                enc,
                roi_start,
                roi_end - roi_start,
                device=self.mode,
                output_type=types.RGB,
                adjust_orientation=False,
                normalized_anchor=False,
                normalized_shape=False,
                axis_names="HW",
                jpeg_fancy_upsampling=True,  # nvJPEG upsamples chroma as libjpeg-turbo does
            )
            img = fn.resize(img, size=list(self.out_hw), antialias=True)
            if self.normalize:
                out = fn.crop_mirror_normalize(
                    img,
                    mirror=flip,
                    mean=self.mean,
                    std=self.std,
                    dtype=types.FLOAT16 if self._dali_float16() else types.FLOAT,
                    output_layout="CHW" if self.layout == "NCHW" else "HWC",
                )
            else:
                out = fn.flip(img, horizontal=flip)
            pipe.set_outputs(out)
        return pipe

    def _dali_float16(self) -> bool:
        """fp16 straight from DALI on the GPU; on the CPU, DALI's float16 stores are scalar
        (crop_mirror_normalize ~8x slower than to float32), so it writes float32 and torch
        rounds to fp16 (the same round-to-nearest-even of the same float32 values)."""
        return self.dtype == torch.float16 and self.mode == "mixed"

    def run(self, encoded: list[np.ndarray], windows: np.ndarray, flips: np.ndarray) -> torch.Tensor:
        """Decode + crop/resize (+ normalise) one batch; returns a torch tensor (CPU or CUDA)."""
        n = len(encoded)
        w = windows.astype(np.float32)
        with self._lock:
            if self._pipe is None or n > self._capacity:
                self._build(max(n, self._capacity))
            try:
                self._pipe.feed_input("encoded", encoded)
                self._pipe.feed_input("roi_start", [np.ascontiguousarray(r) for r in w[:, 0:2]])
                self._pipe.feed_input("roi_end", [np.ascontiguousarray(r) for r in w[:, 0:2] + w[:, 2:4]])
                self._pipe.feed_input("flip", [np.array(int(f), dtype=np.int32) for f in flips])
                (out,) = self._pipe.run()
            except RuntimeError:
                self._pipe = None  # a failed DALI pipeline is no longer valid
                raise
            return self._to_torch(out, n)

    def _to_torch(self, out, n: int) -> torch.Tensor:
        oh, ow = self.out_hw
        shape = (n, 3, oh, ow) if self.normalize and self.layout == "NCHW" else (n, oh, ow, 3)
        target = self.dtype if self.normalize else torch.uint8
        if self.mode == "cpu":
            # A zero-copy view of DALI's output buffer (reused by the next run): one pass makes
            # the returned tensor, rounding float32 to fp16/bf16 on the way when needed.
            view = torch.from_numpy(np.asarray(out.as_tensor()))
            return view.reshape(shape).to(target, copy=True)
        from nvidia.dali.plugin.pytorch import feed_ndarray

        if not self.normalize:
            dali_dtype = torch.uint8
        elif self._dali_float16():
            dali_dtype = torch.float16
        else:
            dali_dtype = torch.float32
        t = torch.empty(shape, dtype=dali_dtype, device=torch.device("cuda", self.device_id))
        feed_ndarray(out.as_tensor(), t, cuda_stream=torch.cuda.current_stream(self.device_id))
        return t if t.dtype == target else t.to(target)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pipe"] = None
        state["_capacity"] = 0
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
