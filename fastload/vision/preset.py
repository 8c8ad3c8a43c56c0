"""`ImagePreset`: encoded images in a fastload batch -> normalised image tensors.

A preset is a batch-level collate stage: `Loader(ds, batch_size=64, collate_fn=preset)`. The
Loader picks the indices (order, sharding and resume stay the Loader's) and calls
`ds.get_batch(indices)`; the preset turns the `Ragged` of encoded images into one tensor and
the fixed-size fields (labels) into tensors. It also works directly: `preset(batch)`.

Reproducibility: crop windows and flips are computed on the host from (seed, epoch, dataset
index) — see `fastload.vision.params` — and handed to whichever backend runs, so a sample's
augmentation parameters are identical across backends, batch compositions, workers and
resumes. On a Loader all three come from the run (`fastload.run`): the seed is the Loader's
(unless `seed=` is given), the epoch the Loader's (new crops every epoch), the indices the
batch's own (`fastload.run.current_batch()`). Pixels are bit-identical for a given backend and
machine; across backends they differ only by decoder/resampler rounding (parity is tested).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastload.run import BatchContext, BatchUnknownError, RunContext, current_batch
from fastload.system import usable_cores
from fastload.vision import batch_forms, params, preset_report
from fastload.vision.cpu_decode import CorruptImageError, batch_view, probe_sizes
from fastload.vision.cpu_stage import CpuStage
from fastload.vision.dali_stage import DaliStage
from fastload.vision.normalize import ChannelLUT, normalize_on_device
from fastload.vision.preset_options import (
    EPOCH_KEY,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INDICES_KEY,
    check_options,
    resolve_backend,
)

__all__ = ["EPOCH_KEY", "IMAGENET_MEAN", "IMAGENET_STD", "INDICES_KEY", "ImagePreset"]


class ImagePreset:
    """Decode, crop/resize, flip and normalise the `image_field` of a batch.

    Use: `Loader(ds, batch_size=64, transform=preset)` (columnar fast path),
    `Loader(ds, batch_size=64, collate_fn=preset)`, or `preset(ds.get_batch(idx))`.

    Random crops and flips are a function of (seed, epoch, dataset index): on a Loader, the
    Loader's seed (or `seed=` when given), its epoch (different crops every epoch, whether epochs
    are driven by `set_epoch` or by `iter()`) and each batch's indices, so they are the same
    whatever the worker count or kind and after a mid-epoch resume. Used alone: `seed` (0 when
    None), `set_epoch`, and the indices of an `__indices__` column (`with_indices`); without
    indices, per-image keys drawn from torch's global RNG (see `transform`).

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
      follows the Loader: a Loader given this preset (`transform=` or `collate_fn=`) hands it
      its run (`bind_run`), and then each batch decodes on the thread that asks for it
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
        seed: int | None = None,
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
        check_options(
            kind=kind, backend=backend, layout=layout, resize=resize, threads=threads, on_error=on_error,
            mean=mean, std=std,
        )
        if dtype == torch.uint8:
            normalize = False
        self.kind = kind
        self.out_hw = params.output_hw(size)
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)
        self.layout = layout or ("NCHW" if normalize else "NHWC")
        self.dtype = dtype if normalize else torch.uint8
        # What `normalize()` produces for a uint8 preset: the dtype / layout given, else fp16 NCHW.
        self._finish = (layout or "NCHW", dtype if dtype != torch.uint8 else torch.float16)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seed = int(seed) if seed is not None else None  # None: the Loader's run seed (0 alone)
        self.epoch = 0
        self.run: RunContext | None = None  # the Loader's run (`bind_run`)
        self.image_field = image_field
        self.threads_requested = int(threads) if threads is not None else None
        self.loader_workers: int | None = None  # the Loader's num_workers (`bind_run`)
        self.normalize_output = normalize
        self.scale = scale
        self.ratio = ratio
        self.flip_p = (0.5 if kind == "train" else 0.0) if flip_p is None else float(flip_p)
        self.crop_fraction = crop_fraction
        self.on_error = on_error
        self.dct_downscale = kind == "train" if dct_downscale is None else bool(dct_downscale)
        self.resize = resize
        self.backend = resolve_backend(backend, self.device)
        on_host = self.device.type == "cpu"
        lut = ChannelLUT(mean=self.mean, std=self.std, dtype=dtype) if normalize and on_host else None
        self._cpu = CpuStage(out_hw=self.out_hw, layout=self.layout, lut=lut)
        self._dali = DaliStage(
            mixed=self.backend == "dali-mixed",
            device=self.device,
            out_hw=self.out_hw,
            mean=self.mean,
            std=self.std,
            layout=self.layout,
            dtype=self.dtype,
            normalize=self.normalize_output,
        )
        self.counters = preset_report.PresetCounters()  # this process's ledger of the preset's work

    # -- configuration -------------------------------------------------------------------

    @property
    def threads(self) -> int:
        """Threads that decode one batch: `threads` if given, 1 on a Loader (`bind_run`),
        else every usable core."""
        if self.threads_requested is not None:
            return self.threads_requested
        return 1 if self.loader_workers is not None else usable_cores()

    def bind_run(self, run: RunContext) -> None:
        """Called by `fastload.Loader` (`fastload.run.RunAware`): the run's seed (unless `seed=`
        was given) and epoch key the crops and flips; the Loader's `num_workers` are the
        parallelism (each batch decodes on the thread or process that fetched it; `threads=`
        overrides)."""
        self.run, self.epoch = run, run.epoch
        if self.loader_workers != run.num_workers:
            self.loader_workers = run.num_workers
            if self.threads_requested is None:
                self._cpu.close_pool()

    def set_epoch(self, epoch: int) -> None:
        """The epoch that keys random crops/flips outside a Loader's fetch (inside one, the batch's
        run gives it); a batch's `__epoch__` entry overrides both."""
        self.epoch = int(epoch)

    def __repr__(self) -> str:
        return (
            f"ImagePreset(kind={self.kind!r}, size={self.out_hw}, backend={self.backend!r}, "
            f"resize={self.resize!r}, layout={self.layout!r}, dtype={self.dtype}, threads={self.threads}, "
            f"device={str(self.device)!r})"
        )

    # -- the collate stage ---------------------------------------------------------------

    def __call__(self, batch: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        """A `ds.get_batch` dict (the Loader's `transform=` stage) or a list of sample dicts
        (its `collate_fn=` stage) -> a dict whose image field is one tensor.

        Dict input: the other fields are returned as they came (the Loader converts them);
        list input: they are collated with torch's `default_collate`. Dataset indices come from
        an `__indices__` column / `__index__` entries (see `with_indices`), else from the Loader's
        batch (`fastload.run.current_batch()`); the epoch from `__epoch__`, else the batch's run,
        else `set_epoch`.
        """
        if isinstance(batch, list):
            return batch_forms.collate_samples(self, batch)
        return batch_forms.transform_columns(self, batch)

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
        samples); None: the Loader's batch's (`fastload.run.current_batch()`), and outside any
        batch of a Loader's, positions in the batch are named and each image's random draws are
        keyed by a number drawn from torch's global RNG (as torchvision's transforms draw: new
        crops every call, in a torch DataLoader's workers too, reproducible under
        `torch.manual_seed`, but not a function of the sample, so not kept by a resume). Where
        the Loader's batch cannot be known (`fastload.run.BatchUnknownError`) a random preset
        raises it. `epoch` None: the batch's run's, else `self.epoch`.
        """
        t0 = time.perf_counter()
        values, offsets = batch_view(encoded)
        n = len(offsets) - 1
        batch = self._loader_batch(keyed=self.random and (indices is None or epoch is None))
        if indices is None and batch is not None:
            indices = batch.indices
            if len(indices) != n:
                raise ValueError(
                    f"the Loader's batch has {len(indices)} samples but {n} images reach the image preset: the "
                    "dataset indices that key its crops cannot be matched; give the batch an "
                    f"{INDICES_KEY} column (fastload.vision.with_indices) or run the preset on the dataset's batch"
                )
        if indices is None:
            keys = torch.randint(0, 1 << 62, (n,), dtype=torch.int64).numpy() if self.random else np.zeros(n, np.int64)
        else:
            keys = np.asarray(indices, dtype=np.int64).reshape(-1)
            if len(keys) != n:
                raise ValueError(f"{INDICES_KEY} has {len(keys)} entries for a batch of {n} images")
        run = batch.run if batch is not None else self.run
        if epoch is None:
            epoch = batch.run.epoch if batch is not None else self.epoch
        seed = self.seed if self.seed is not None else (run.seed if run is not None else 0)
        named = keys if indices is not None else None

        sizes, jpeg, errors = probe_sizes(values, offsets)
        windows, flips, nums = self._parameters(sizes, keys, int(epoch), seed)
        self._check_errors(errors, named)

        if self.backend == "cpu":
            images, failed = self._run_cpu((values, offsets, jpeg, sizes), windows, flips, nums, set(errors))
        else:
            arrays = [values[offsets[i] : offsets[i + 1]] for i in range(n)]
            raise_errors = self.on_error == "raise"
            images, failed = self._dali.run(
                arrays, windows, flips, skip=set(errors), raise_errors=raise_errors, threads=self.threads
            )
            if not self.normalize_output and self.layout == "NCHW":
                images = images.permute(0, 3, 1, 2).contiguous()
        errors.update(failed)
        self._check_errors(errors, named)
        keep = None
        if errors:
            keep = np.array([i for i in range(n) if i not in errors], dtype=np.int64)
            if self.backend == "cpu":
                images = images[torch.from_numpy(keep).to(images.device)]
        self.counters.add_batch(images=n - len(errors), skipped=len(errors), seconds=time.perf_counter() - t0)
        return images, keep

    @property
    def random(self) -> bool:
        """Whether this preset's crops or flips are random (keyed by seed, epoch and index)."""
        return self.kind == "train" or self.flip_p > 0

    @staticmethod
    def _loader_batch(*, keyed: bool) -> BatchContext | None:
        """`fastload.run.current_batch()`; where the batch's indices cannot be known, its
        `BatchUnknownError` if this call's draws are keyed by them (`keyed`), else None."""
        try:
            return current_batch()
        except BatchUnknownError:
            if keyed:
                raise
            return None

    def _parameters(
        self, sizes: np.ndarray, keys: np.ndarray, epoch: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(windows, flips, DCT scale nums or None) of this preset's crop for a batch: see
        `params.batch_windows`."""
        return params.batch_windows(
            sizes,
            keys=keys,
            seed=seed,
            epoch=epoch,
            train=self.kind == "train",
            out_hw=self.out_hw,
            resize=self.resize is not None,
            scale=self.scale,
            ratio=self.ratio,
            crop_fraction=self.crop_fraction,
            flip_p=self.flip_p,
            dct_downscale=self.dct_downscale,
        )

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

    # -- backends ------------------------------------------------------------------------

    def _run_cpu(
        self,
        batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        windows: np.ndarray,
        flips: np.ndarray,
        nums: np.ndarray | None,
        skip: set[int],
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """The CPU stage's batch, then what is left of the output's form: the copy to the device,
        normalising there, the NCHW layout of uint8 output."""
        on_host = self.device.type == "cpu"
        pin = not on_host and torch.cuda.is_available()
        images, done, failed, modes = self._cpu.run(
            batch, windows, flips, nums=nums, skip=skip, threads=self.threads, pin=pin
        )
        self.counters.add_modes(modes)
        if done:
            return images, failed
        images = images if on_host else images.to(self.device, non_blocking=True)
        if self.normalize_output:
            return self.normalize(images), failed
        if self.layout == "NCHW":
            images = images.permute(0, 3, 1, 2).contiguous()
        return images, failed

    def dali_graph(self) -> bytes:
        """The DALI pipeline this preset runs (backend 'dali'), defined without a device and
        serialized: validates the mixed (nvJPEG) graph where it cannot be built (no CUDA)."""
        if self.backend not in ("dali-mixed", "dali-cpu"):
            raise ValueError(f"this preset runs the {self.backend!r} backend, not DALI")
        return self._dali.runner(self.threads).graph()

    # -- after the H2D copy, and reports ---------------------------------------------------

    def normalize(self, images_u8: torch.Tensor) -> torch.Tensor:
        """Normalise a uint8 batch (NHWC, or NCHW as a uint8 preset with layout='NCHW' returns it)
        on `self.device`: into the layout and dtype this preset was given (fp16 NCHW if none)."""
        layout, dtype = (self.layout, self.dtype) if self.normalize_output else self._finish
        x = images_u8.to(self.device, non_blocking=True)
        if x.ndim == 4 and x.shape[1] == 3 and x.shape[-1] != 3:  # NCHW uint8
            x = x.permute(0, 2, 3, 1)
        return normalize_on_device(x, mean=self.mean, std=self.std, layout=layout, dtype=dtype)

    def describe(self) -> dict[str, Any]:
        """The image stage's configuration, shown by `loader.describe()["components"]`: what
        runs, where, with how many threads, the crop settings, which decode modes (window / DCT
        scale) it picks and whether windows start at their restart interval."""
        return preset_report.describe(self)

    component_describe = describe  # `fastload.run.SettingsReporter`

    def stats(self) -> dict[str, Any]:
        """Counters for `loader.stats()` (this process's: with process workers they stay in the
        workers): images, skipped, batches, seconds, images/s, backend, threads, and the images
        per decode mode (`vision_decode_modes`, CPU backend)."""
        return preset_report.stats(self)

    component_stats = stats  # `fastload.run.StatsReporter`: `loader.stats()["components"][role]`
