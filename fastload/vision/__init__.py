"""Image presets: encoded images from any fastload source -> augmented, normalised tensors.

`ImagePreset` runs as the Loader's `transform` or `collate_fn` (or directly on a `ds.get_batch`
dict) with a DALI backend (nvJPEG 'mixed' decode on a GPU, DALI CPU operators otherwise) or the
CPU backend (libjpeg-turbo decoding only each crop window, straight into the batch, in GIL-free
threads; Pillow for other formats); both produce the same shapes and dtypes and apply the same
host-computed crops and flips. Importing this package never imports DALI. See docs/vision.md.
"""

from fastload.vision.cpu_decode import CorruptImageError
from fastload.vision.dali_pipeline import DALI_MISSING, dali_available
from fastload.vision.indexed import IndexedDataset, with_indices
from fastload.vision.params import center_crop, center_window, random_flips, random_resized_crop, random_window
from fastload.vision.preset import (
    EPOCH_KEY,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INDICES_KEY,
    ImagePreset,
)

__all__ = [
    "DALI_MISSING",
    "EPOCH_KEY",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INDICES_KEY",
    "CorruptImageError",
    "ImagePreset",
    "IndexedDataset",
    "center_crop",
    "center_window",
    "dali_available",
    "eval_preset",
    "random_flips",
    "random_resized_crop",
    "random_window",
    "train_preset",
    "with_indices",
]


def train_preset(*, size: int | tuple[int, int] = 224, **kwargs) -> ImagePreset:
    """RandomResizedCrop(size) + flip(0.5) + ImageNet normalisation; kwargs as `ImagePreset`."""
    return ImagePreset(kind="train", size=size, **kwargs)


def eval_preset(*, size: int | tuple[int, int] = 224, **kwargs) -> ImagePreset:
    """Resize shorter side to size/0.875, centre-crop size, normalise; kwargs as `ImagePreset`."""
    return ImagePreset(kind="eval", size=size, **kwargs)
