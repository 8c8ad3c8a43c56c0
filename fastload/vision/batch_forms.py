"""The batch forms an image preset is called with, around its `transform`.

A `ds.get_batch` dict (the Loader's `transform=` stage, or its `collate_fn=` stage with batch
views): the encoded images arrive as one `Ragged`, the other fields are returned as they came
(the samples a bad image drops removed from each). A list of sample dicts (a `collate_fn=`
stage): the images are gathered, the other fields collated with torch's `default_collate`.
Dataset indices come from an `__indices__` column / `__index__` entries (see `with_indices`),
the epoch from `__epoch__`; without them the preset takes the Loader's batch's (`fastload.run`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from fastload.vision.indexed import INDEX_KEY
from fastload.vision.preset_options import EPOCH_KEY, INDICES_KEY

__all__ = ["collate_samples", "transform_columns"]


def transform_columns(preset: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """A columnar batch with its image field replaced by `preset`'s image tensor."""
    field = preset.image_field
    if field not in batch:
        raise KeyError(f"batch has no image field {field!r} (fields: {sorted(batch)})")
    epoch = batch.get(EPOCH_KEY)
    images, keep = preset.transform(batch[field], indices=batch.get(INDICES_KEY), epoch=epoch)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == field:
            out[key] = images
        elif keep is not None and key != EPOCH_KEY:
            out[key] = _select(value, keep)
        else:
            out[key] = value
    return out


def collate_samples(preset: Any, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Sample dicts -> one batch dict: `preset`'s image tensor and the other fields collated."""
    field = preset.image_field
    if not samples:
        raise ValueError("empty batch")
    if field not in samples[0]:
        raise KeyError(f"samples have no image field {field!r} (fields: {sorted(samples[0])})")
    encoded = [s[field] for s in samples]
    indices = [s[INDEX_KEY] for s in samples] if all(INDEX_KEY in s for s in samples) else None
    images, keep = preset.transform(encoded, indices=indices, epoch=samples[0].get(EPOCH_KEY))
    if keep is not None:
        samples = [samples[int(i)] for i in keep]
    rest = [{k: v for k, v in s.items() if k != field} for s in samples]
    collated = default_collate(rest) if rest and rest[0] else {}
    return {key: images if key == field else collated[key] for key in samples[0]}  # the samples' field order


def _select(value: Any, keep: np.ndarray) -> Any:
    """The kept samples of one field."""
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return value[keep]
    if isinstance(value, torch.Tensor) and value.ndim >= 1:
        return value[torch.from_numpy(keep)]
    if hasattr(value, "offsets") and hasattr(value, "values"):
        items = [value[int(i)] for i in keep]
        out = type(value).from_list(items, kind=value.kind, dtype=np.asarray(value.values[:0]).dtype)
        if isinstance(value.values, torch.Tensor):  # batch views (fastload.fetch.views) stay tensors
            out = type(value)(torch.from_numpy(out.values), torch.from_numpy(out.offsets), out.kind)
        return out
    if isinstance(value, list):
        return [value[int(i)] for i in keep]
    return value
