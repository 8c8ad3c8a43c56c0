"""`ImagePreset`: encoded images in a fastload batch -> normalised image tensors.

A preset is a batch-level collate stage: `Loader(ds, batch_size=64, collate_fn=preset)`. The
Loader picks the indices (order, sharding and resume stay the Loader's) and calls
`ds.get_batch(indices)`; the preset turns the `Ragged` of encoded images into one tensor and
the fixed-size fields (labels) into tensors. It also works directly: `preset(batch)`.

Reproducibility: crop windows and flips are computed on the host from (seed, epoch, dataset
index) — see `fastload.vision.params` — and handed to whichever backend runs, so a sample's
augmentation parameters are identical across backends, batch compositions, workers and
resumes. Pixels are bit-identical for a given backend and machine; across backends they
differ only by decoder/resampler rounding (eval parity is tested).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from fastload.system import usable_cores
from fastload.vision import cpu_decode, params
from fastload.vision.cpu_batch import BatchJob, run_batch
from fastload.vision.cpu_decode import CorruptImageError, batch_view, decode_rgb, probe_sizes
from fastload.vision.dali_pipeline import DALI_MISSING, DaliRunner, dali_available
from fastload.vision.indexed import INDEX_KEY
from fastload.vision.normalize import ChannelLUT, normalize_on_device

__all__ = ["EPOCH_KEY", "IMAGENET_MEAN", "IMAGENET_STD", "INDICES_KEY", "ImagePreset"]

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
INDICES_KEY = "__indices__"
EPOCH_KEY = "__epoch__"

_BACKENDS = ("auto", "cpu", "dali")
_RESIZE = ("bilinear", None)


class ImagePreset:
    """Decode, crop/resize, flip and normalise the `image_field` of a batch.

    Use: `Loader(with_indices(ds), batch_size=64, transform=preset)` (columnar fast path),
    `Loader(with_indices(ds), batch_size=64, collate_fn=preset)`, or `preset(ds.get_batch(idx))`.

    Options (defaults in brackets):
    - kind ['train']: 'train' = RandomResizedCrop(size, scale, ratio) + horizontal flip with
      `flip_p` [0.5]; 'eval' = centre crop of `crop_fraction` [0.875] of the largest
      output-shaped window (for a square output: resize the shorter side to size / 0.875,
      centre-crop size), resized to size, no flip.
    - resize ['bilinear']: antialiased bilinear resize of the crop window to `size`. None: crop
      only, no resampling: 'eval' takes the centre `size` pixels (`CenterCrop`), 'train' `size`
      pixels at a random position (`RandomCrop`) + flip; an image smaller than `size` in a
      dimension is resized up to it there (the batch keeps one shape).
    - dtype [torch.float16] and layout [None = 'NCHW' for normalised output, 'NHWC' for uint8]:
      normalised output is (x - mean) / std (mean/std in 0..255 units) in float16, bfloat16,
      float32 or float64. dtype=torch.uint8 (same as normalize=False) returns the uint8 pixels
      (flip applied); `preset.normalize(x)` finishes them later, e.g. on the GPU after the copy.
    - backend ['auto']: 'cpu' (the fused CPU stage below), 'dali' (DALI: nvJPEG 'mixed' decode
      with ROI on a CUDA `device`, DALI CPU operators otherwise) or 'auto' (DALI on a CUDA device
      when DALI is installed, else 'cpu'). DALI missing -> a warning and 'cpu'.
    - threads [None]: threads that decode one batch (the calling thread is one of them). None
      follows the Loader: a Loader given this preset (`transform=` or `collate_fn=`) calls
      `bind_workers(num_workers)`, and then each batch decodes on the thread that asks for it
      (num_workers=N: N batches decode at once, in N thread or process workers; num_workers=0:
      one thread, the training loop's, as in torch). A preset used on its own uses every
      usable core. `stats()['vision_threads']` says which applies.
    - dct_downscale [None = on for 'train', off for 'eval']: (CPU backend) decode a JPEG whose
      crop window is at least 2x (4x, 8x) the output in both dimensions at 1/2 (1/4, 1/8) scale
      in libjpeg-turbo's IDCT: the smallest decoded window still >= the output, then resized.
      Not pixel-identical to a full-size decode + crop + resize: the window edges round to the
      scaled pixel grid and the DCT's filter differs (bounds: docs/vision.md, tested). Windows
      below 2x the output, crop-only windows and the eval preset decode at full size
      (pixel-identical).
    - on_error ['raise']: 'raise' names the dataset sample that is not a decodable image;
      'skip' drops it from the batch (all fields) and counts it in `stats()['vision_skipped']`.

    The CPU backend decodes only each JPEG's crop window (libjpeg-turbo partial decompression
    through the `_jpegwin` extension): the same pixels as a full decode then crop. A crop-only
    window is decoded straight into the batch; see `fastload.vision.cpu_batch`.
    """

    # As a Loader's `collate_fn`: take the batch's columns, the encoded images as a `Ragged` batch
    # view (values + offsets), not one bytes object per sample; `__call__` accepts both.
    accepts_batch_views = True

    def __init__(
        self,
        *,
        kind: str = "train",
        size: int | tuple[int, int] = 224,
        backend: str = "auto",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        layout: str | None = None,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device | None = None,
        seed: int = 0,
        image_field: str = "image",
        threads: int | None = None,
        normalize: bool = True,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float | None = None,
        crop_fraction: float = 0.875,
        on_error: str = "raise",
        dct_downscale: bool | None = None,
        resize: str | None = "bilinear",
    ) -> None:
        if kind not in ("train", "eval"):
            raise ValueError(f"kind must be 'train' or 'eval', got {kind!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if layout not in ("NCHW", "NHWC", None):
            raise ValueError(f"layout must be 'NCHW', 'NHWC' or None, got {layout!r}")
        if resize not in _RESIZE:
            raise ValueError(f"resize must be one of {_RESIZE}, got {resize!r}")
        if threads is not None and int(threads) < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads!r}")
        if dtype == torch.uint8:
            normalize = False
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError("mean and std need 3 values (RGB, 0..255 units)")
        self.kind = kind
        self.out_hw = params.output_hw(size)
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)
        self.layout = layout or ("NCHW" if normalize else "NHWC")
        self.dtype = dtype if normalize else torch.uint8
        # What `normalize()` produces for a uint8 preset: the dtype / layout given, else fp16 NCHW.
        self._finish = (layout or "NCHW", dtype if dtype != torch.uint8 else torch.float16)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seed = int(seed)
        self.epoch = 0
        self.image_field = image_field
        self.threads_requested = int(threads) if threads is not None else None
        self.loader_workers: int | None = None  # set by `bind_workers`
        self.normalize_output = normalize
        self.scale = scale
        self.ratio = ratio
        self.flip_p = (0.5 if kind == "train" else 0.0) if flip_p is None else float(flip_p)
        self.crop_fraction = crop_fraction
        self.on_error = on_error
        self.dct_downscale = kind == "train" if dct_downscale is None else bool(dct_downscale)
        self.resize = resize
        self.backend = self._resolve_backend(backend)
        self._lut = ChannelLUT(mean=self.mean, std=self.std, dtype=dtype) if normalize else None
        self._dali: DaliRunner | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._lock = threading.Lock()
        self._calls = 0
        self._stats = {"images": 0, "skipped": 0, "batches": 0, "seconds": 0.0}
        self._modes: dict[str, int] = {}  # CPU backend: images per decode mode (cpu_batch.MODES)

    # -- configuration -------------------------------------------------------------------

    def _resolve_backend(self, requested: str) -> str:
        on_gpu = self.device.type == "cuda"
        if requested == "cpu":
            return "cpu"
        if not dali_available():
            if requested == "dali" or on_gpu:
                warnings.warn(DALI_MISSING, RuntimeWarning, stacklevel=3)
            return "cpu"
        if requested == "dali":
            return "dali-mixed" if on_gpu else "dali-cpu"
        return "dali-mixed" if on_gpu else "cpu"

    @property
    def threads(self) -> int:
        """Threads that decode one batch: `threads` if given, 1 on a Loader (`bind_workers`),
        else every usable core."""
        if self.threads_requested is not None:
            return self.threads_requested
        return 1 if self.loader_workers is not None else usable_cores()

    def bind_workers(self, num_workers: int) -> None:
        """Called by `fastload.Loader`: the Loader's `num_workers` are the parallelism (each
        batch decodes on the thread or process that fetched it; `threads=` overrides)."""
        self.loader_workers = int(num_workers)
        if self.threads_requested is None and self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch that keys random crops/flips (a batch's `__epoch__` entry overrides it)."""
        self.epoch = int(epoch)

    def __repr__(self) -> str:
        return (
            f"ImagePreset(kind={self.kind!r}, size={self.out_hw}, backend={self.backend!r}, "
            f"resize={self.resize!r}, layout={self.layout!r}, dtype={self.dtype}, threads={self.threads}, "
            f"device={str(self.device)!r})"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- the collate stage ---------------------------------------------------------------

    def __call__(self, batch: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        """A `ds.get_batch` dict (the Loader's `transform=` stage) or a list of sample dicts
        (its `collate_fn=` stage) -> a dict whose image field is one tensor.

        Dict input: the other fields are returned as they came (the Loader converts them);
        list input: they are collated with torch's `default_collate`. Dataset indices come from
        an `__indices__` column / `__index__` entries (see `with_indices`), the epoch from
        `__epoch__` or `set_epoch`.
        """
        if isinstance(batch, list):
            return self._collate_samples(batch)
        if self.image_field not in batch:
            raise KeyError(f"batch has no image field {self.image_field!r} (fields: {sorted(batch)})")
        encoded = batch[self.image_field]
        indices = batch.get(INDICES_KEY)
        epoch = int(batch.get(EPOCH_KEY, self.epoch))
        images, keep = self.transform(encoded, indices=indices, epoch=epoch)
        out: dict[str, Any] = {}
        for key, value in batch.items():
            if key == self.image_field:
                out[key] = images
            elif keep is not None and key != EPOCH_KEY:
                out[key] = _select(value, keep)
            else:
                out[key] = value
        return out

    def _collate_samples(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise ValueError("empty batch")
        if self.image_field not in samples[0]:
            raise KeyError(f"samples have no image field {self.image_field!r} (fields: {sorted(samples[0])})")
        encoded = [s[self.image_field] for s in samples]
        has_idx = all(INDEX_KEY in s for s in samples)
        indices = [s[INDEX_KEY] for s in samples] if has_idx else None
        epoch = int(samples[0].get(EPOCH_KEY, self.epoch))
        images, keep = self.transform(encoded, indices=indices, epoch=epoch)
        if keep is not None:
            samples = [samples[int(i)] for i in keep]
        rest = [{k: v for k, v in s.items() if k != self.image_field} for s in samples]
        out = default_collate(rest) if rest and rest[0] else {}
        out[self.image_field] = images
        return out

    def transform(
        self,
        encoded: Any,
        *,
        indices: Sequence[int] | np.ndarray | None = None,
        epoch: int | None = None,
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """Encoded images (a `Ragged` batch view, or a sequence of bytes / uint8 arrays) -> (image
        tensor, kept-positions array or None when none dropped).

        `indices` are the dataset indices (they key the random parameters and name bad
        samples); without them, positions in the batch are named and random draws are keyed
        by a per-preset call counter (random, but not reproducible across resumes).
        """
        t0 = time.perf_counter()
        values, offsets = batch_view(encoded)
        n = len(offsets) - 1
        if indices is None:
            with self._lock:
                call = self._calls
                self._calls += 1
            keys = np.arange(n, dtype=np.int64) + (call << 32)
        else:
            keys = np.asarray(indices, dtype=np.int64).reshape(-1)
            if len(keys) != n:
                raise ValueError(f"{INDICES_KEY} has {len(keys)} entries for a batch of {n} images")
        epoch = self.epoch if epoch is None else int(epoch)
        named = keys if indices is not None else None

        sizes, jpeg, errors = probe_sizes(values, offsets)
        windows, flips, nums = self._parameters(sizes, keys, epoch)
        self._check_errors(errors, named)

        if self.backend == "cpu":
            job = (values, offsets, jpeg, sizes)
            images, failed = self._run_cpu(job, windows, flips, nums=nums, skip=set(errors))
        else:
            arrays = [values[offsets[i] : offsets[i + 1]] for i in range(n)]
            images, failed = self._run_dali(arrays, windows, flips, skip=set(errors))
            if not self.normalize_output and self.layout == "NCHW":
                images = images.permute(0, 3, 1, 2).contiguous()
        errors.update(failed)
        self._check_errors(errors, named)
        keep = None
        if errors:
            keep = np.array([i for i in range(n) if i not in errors], dtype=np.int64)
            if self.backend == "cpu":
                images = images[torch.from_numpy(keep).to(images.device)]
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats["images"] += n - len(errors)
            self._stats["skipped"] += len(errors)
            self._stats["batches"] += 1
            self._stats["seconds"] += dt
        return images, keep

    def _parameters(
        self, sizes: np.ndarray, keys: np.ndarray, epoch: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(windows, flips, DCT scale nums or None). With `dct_downscale`, resized windows of
        2x the output or more are aligned to their DCT scale's pixel grid (`dct_windows`), on the
        host, so every backend crops the same window."""
        if self.resize is None and self.kind == "train":
            windows = params.random_window(sizes, size=self.out_hw, seed=self.seed, epoch=epoch, indices=keys)
        elif self.resize is None:
            windows = params.center_window(sizes, size=self.out_hw)
        elif self.kind == "train":
            windows = params.random_resized_crop(
                sizes,
                seed=self.seed,
                epoch=epoch,
                indices=keys,
                scale=self.scale,
                ratio=self.ratio,
            )
        else:
            windows = params.center_crop(sizes, size=self.out_hw, crop_fraction=self.crop_fraction)
        if self.flip_p > 0:
            flips = params.random_flips(seed=self.seed, epoch=epoch, indices=keys, p=self.flip_p)
        else:
            flips = np.zeros(len(sizes), dtype=bool)
        nums = None
        if self.dct_downscale and self.resize is not None:
            windows, nums = cpu_decode.dct_windows(sizes, windows, self.out_hw)
        return windows, flips, nums

    def _check_errors(self, errors: dict[int, str], keys: np.ndarray | None) -> None:
        """Raise for the first failed image (on_error='raise'), named by its dataset index (`keys`)
        or, without indices, by its position in the batch."""
        if errors and self.on_error == "raise":
            i = min(errors)
            name = f"sample {int(keys[i])}" if keys is not None else (
                f"position {i} in the batch (the loader passed no {INDICES_KEY})"
            )
            more = f" (and {len(errors) - 1} more in this batch)" if len(errors) > 1 else ""
            raise CorruptImageError(
                f"{name} (field {self.image_field!r}) is not a decodable image: {errors[i]}{more}; "
                "pass on_error='skip' to drop and count such samples",
                index=int(keys[i]) if keys is not None else None,
            )

    # -- CPU backend ---------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor | None:
        """Helpers for the calling thread: `threads - 1` of them (none for one thread)."""
        helpers = self.threads - 1
        if helpers < 1:
            return None
        if self._pool is None or self._pool_size != helpers:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="fastload-vision")
            self._pool_size = helpers
        return self._pool

    def _run_cpu(
        self,
        batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        windows: np.ndarray,
        flips: np.ndarray,
        *,
        nums: np.ndarray | None,
        skip: set[int],
    ) -> tuple[torch.Tensor, dict[int, str]]:
        values, offsets, jpeg, sizes = batch  # the batch view, JPEG flags and (H, W) sizes
        n = len(sizes)
        oh, ow = self.out_hw
        on_host = self.device.type == "cpu"
        lut = self._lut if on_host else None
        pin = not on_host and torch.cuda.is_available()
        if lut is not None:  # internal: this thread's reused pixel block (only the output is returned)
            staging = _staging(n, oh, ow)
        else:  # returned (or copied to the device without waiting): a fresh one every batch
            staging = torch.empty((n, oh, ow, 3), dtype=torch.uint8, pin_memory=pin)
        shape = (n, 3, oh, ow) if self.layout == "NCHW" else (n, oh, ow, 3)
        job = BatchJob(
            values=values,
            offsets=offsets,
            jpeg=jpeg,
            sizes=sizes,
            windows=windows,
            flips=flips,
            skip=skip,
            out_hw=self.out_hw,
            nums=nums,
            images=staging.numpy(),
            lut=lut,
            normalized=lut.empty(shape) if lut is not None else None,
            layout=self.layout,
        )
        with self._lock:
            executor = self._executor()
        failed = run_batch(job, threads=self.threads, executor=executor)
        with self._lock:
            for mode, count in job.modes.items():
                self._modes[mode] = self._modes.get(mode, 0) + count
        if lut is not None and job.normalized is not None:
            return lut.to_tensor(job.normalized), failed
        images = staging if on_host else staging.to(self.device, non_blocking=True)
        if self.normalize_output:
            return self.normalize(images), failed
        if self.layout == "NCHW":
            images = images.permute(0, 3, 1, 2).contiguous()
        return images, failed

    # -- DALI backend --------------------------------------------------------------------

    def _runner(self) -> DaliRunner:
        if self._dali is None:
            mixed = self.backend == "dali-mixed"
            self._dali = DaliRunner(
                mode="mixed" if mixed else "cpu",
                out_hw=self.out_hw,
                mean=self.mean,
                std=self.std,
                layout=self.layout,
                dtype=self.dtype,
                normalize=self.normalize_output,
                threads=self.threads,
                device_id=(self.device.index or 0) if mixed else None,
            )
        return self._dali

    def dali_graph(self) -> bytes:
        """The DALI pipeline this preset runs (backend 'dali'), defined without a device and
        serialized: validates the mixed (nvJPEG) graph where it cannot be built (no CUDA)."""
        if self.backend not in ("dali-mixed", "dali-cpu"):
            raise ValueError(f"this preset runs the {self.backend!r} backend, not DALI")
        return self._runner().graph()

    def _run_dali(
        self,
        arrays: list[np.ndarray],
        windows: np.ndarray,
        flips: np.ndarray,
        *,
        skip: set[int],
    ) -> tuple[torch.Tensor, dict[int, str]]:
        good = [i for i in range(len(arrays)) if i not in skip]
        failed: dict[int, str] = {}
        if not good:
            return self._empty(), failed
        try:
            return self._runner().run([arrays[i] for i in good], windows[good], flips[good]), failed
        except RuntimeError as e:
            dali_error = e
        # Find the culprit(s) with the CPU decoder, then retry without them.
        for i in good:
            try:
                decode_rgb(arrays[i])
            except (ValueError, OSError) as e:
                failed[i] = f"{type(e).__name__}: {e}"
        if not failed:
            raise RuntimeError(
                f"DALI failed on a batch whose images all decode on the CPU: {dali_error}"
            ) from dali_error
        if self.on_error == "raise":
            return self._empty(), failed
        good = [i for i in good if i not in failed]
        if not good:
            return self._empty(), failed
        return self._runner().run([arrays[i] for i in good], windows[good], flips[good]), failed

    def _empty(self) -> torch.Tensor:
        oh, ow = self.out_hw
        shape = (0, 3, oh, ow) if self.layout == "NCHW" else (0, oh, ow, 3)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    # -- after the H2D copy, and stats -----------------------------------------------------

    def normalize(self, images_u8: torch.Tensor) -> torch.Tensor:
        """Normalise a uint8 batch (NHWC, or NCHW as a uint8 preset with layout='NCHW' returns it)
        on `self.device`: into the layout and dtype this preset was given (fp16 NCHW if none)."""
        layout, dtype = (self.layout, self.dtype) if self.normalize_output else self._finish
        x = images_u8.to(self.device, non_blocking=True)
        if x.ndim == 4 and x.shape[1] == 3 and x.shape[-1] != 3:  # NCHW uint8
            x = x.permute(0, 2, 3, 1)
        return normalize_on_device(x, mean=self.mean, std=self.std, layout=layout, dtype=dtype)

    def _threads_rule(self) -> str:
        if self.threads_requested is not None:
            return "threads="
        if self.loader_workers is not None:
            return f"Loader num_workers={self.loader_workers}: each batch on the worker that fetches it"
        return "usable cores"

    def _decoder(self) -> str:
        if self.backend == "dali-mixed":
            return "DALI decoders.image_slice, mixed (nvJPEG ROI decode)"
        if self.backend == "dali-cpu":
            return "DALI decoders.image_slice, cpu (libjpeg-turbo ROI decode)"
        if cpu_decode.decode_windows is not None:
            return "libjpeg-turbo window decode (fastload.vision._jpegwin)"
        return "simplejpeg / Pillow whole-image decode"

    def _decode_modes(self) -> list[str]:
        """The decode modes this configuration can take for a JPEG (CPU backend)."""
        win = "window" if cpu_decode.decode_windows is not None else "whole image"
        if self.backend != "cpu":
            return ["window (ROI)"]
        if self.dct_downscale and self.resize is not None:
            return [win] + [f"{win} {f}" for f in ("1/2", "1/4", "1/8")]
        return [win]

    def describe(self) -> dict[str, Any]:
        """The image stage's configuration, for `loader.describe()`: what runs, where, with how
        many threads, and which decode modes (window / DCT scale) it picks."""
        return {
            "stage": "ImagePreset",
            "kind": self.kind,
            "size": self.out_hw,
            "resize": self.resize,
            "backend": self.backend,
            "decoder": self._decoder(),
            "decode_modes": self._decode_modes(),
            "dct_downscale": self.dct_downscale,
            "threads": self.threads,
            "threads_rule": self._threads_rule(),
            "output": {
                "dtype": str(self.dtype).replace("torch.", ""),
                "layout": self.layout,
                "normalized": self.normalize_output,
                "device": str(self.device),
            },
        }

    def stats(self) -> dict[str, Any]:
        """Counters for `loader.stats()` (this process's: with process workers they stay in the
        workers): images, skipped, batches, seconds, images/s, backend, threads, and the images
        per decode mode (`vision_decode_modes`, CPU backend)."""
        with self._lock:
            s = dict(self._stats)
            modes = dict(self._modes)
        return {
            "vision_backend": self.backend,
            "vision_threads": self.threads,
            "vision_threads_rule": self._threads_rule(),
            "vision_window_decode": cpu_decode.decode_windows is not None,
            "vision_decode_modes": modes,
            "vision_images": s["images"],
            "vision_skipped": s["skipped"],
            "vision_batches": s["batches"],
            "vision_seconds": s["seconds"],
            "vision_images_per_s": s["images"] / s["seconds"] if s["seconds"] > 0 else 0.0,
        }


_STAGING = threading.local()


def _staging(n: int, oh: int, ow: int) -> torch.Tensor:
    """This thread's (n, oh, ow, 3) uint8 block for pixels that are normalised before returning."""
    t = getattr(_STAGING, "t", None)
    if t is None or t.shape != (n, oh, ow, 3):
        t = _STAGING.t = torch.empty((n, oh, ow, 3), dtype=torch.uint8)
    return t


def _select(value: Any, keep: np.ndarray) -> Any:
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return value[keep]
    if isinstance(value, torch.Tensor) and value.ndim >= 1:
        return value[torch.from_numpy(keep)]
    if hasattr(value, "offsets") and hasattr(value, "values"):
        items = [value[int(i)] for i in keep]
        return type(value).from_list(items, kind=value.kind, dtype=value.values.dtype)
    if isinstance(value, list):
        return [value[int(i)] for i in keep]
    return value
