"""Peer pipelines for `bench.vision`, on the same JPEGs as its fastload rows (uint8 NHWC batches).

- DALI on the CPU, as a DALI user writes it (not fastload's DALI backend): `external_source` of
  the encoded bytes -> eval: `decoders.image` + `resize(resize_shorter=size / 0.875)` + centre
  `crop`; train: `decoders.image_random_crop` (RandomResizedCrop's area 0.08-1 and aspect 3/4-4/3,
  decoding only the crop) + `resize` to size + `flip` by `random.coin_flip`. `device_id=None`:
  CPU operators only, `threads` workers.
- torchvision's classic pipeline on PIL images, written with the same PIL calls its transforms
  make (`Image.open(...).convert("RGB")`; eval `Resize(size / 0.875)` + `CenterCrop(size)`,
  train `RandomResizedCrop(size)` (here the fastload preset's windows, so the crops are the same)
  + `RandomHorizontalFlip`, both with PIL's bilinear resample) + `PILToTensor` + a stacked batch:
  torchvision itself is not used, because PyPI's torchvision builds for torch 2.13 link the CUDA
  torch libraries (libtorch_cuda.so) and do not load beside a CPU-only torch.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["dali_cpu_pass", "pil_torch_pass"]


def dali_cpu_pass(jpegs: list[bytes], *, kind: str, size: int, threads: int, batch_size: int) -> Callable[[], int]:
    """One pass of a standalone DALI CPU pipeline over `jpegs` in batches of `batch_size` (the
    last partial batch dropped); returns the images produced."""
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(batch_size=batch_size, num_threads=threads, device_id=None, prefetch_queue_depth=1,
                    exec_async=False, exec_pipelined=False, seed=0)
    with pipe:
        enc = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        if kind == "train":
            img = fn.decoders.image_random_crop(
                enc, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
            )
            img = fn.resize(img, size=[size, size], antialias=True)
            img = fn.flip(img, horizontal=fn.random.coin_flip())
        else:
            img = fn.decoders.image(enc, device="cpu", output_type=types.RGB)
            img = fn.resize(img, resize_shorter=round(size / 0.875), antialias=True)
            img = fn.crop(img, crop=(size, size))
        pipe.set_outputs(img)
    pipe.build()
    arrays = [np.frombuffer(j, dtype=np.uint8) for j in jpegs]
    batches = [arrays[s : s + batch_size] for s in range(0, len(arrays) - batch_size + 1, batch_size)]

    def one_pass() -> int:
        n = 0
        for b in batches:
            pipe.feed_input("encoded", b)
            (out,) = pipe.run()
            n += torch.from_numpy(out.as_array()).shape[0]
        return n

    return one_pass


def pil_torch_pass(
    jpegs: list[bytes], *, kind: str, size: int, windows: np.ndarray, flips: np.ndarray, pool: ThreadPoolExecutor,
    batch_size: int,
) -> Callable[[], int]:
    """One pass of torchvision's PIL pipeline (see the module docstring) over `jpegs`, each batch's
    images on `pool`'s threads, then stacked as torch's default collate does."""
    from PIL import Image

    short = round(size / 0.875)

    def one(i: int) -> torch.Tensor:
        with Image.open(io.BytesIO(jpegs[i])) as im:
            img = im.convert("RGB")
        if kind == "train":
            y0, x0, h, w = (int(v) for v in windows[i])
            img = img.resize((size, size), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
            if flips[i]:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            w, h = img.size
            scaled = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
            img = img.resize(scaled, Image.BILINEAR)
            left, top = round((scaled[0] - size) / 2), round((scaled[1] - size) / 2)
            img = img.crop((left, top, left + size, top + size))
        return torch.from_numpy(np.array(img))  # PILToTensor (a copy), kept HWC like the uint8 NHWC rows

    spans = [range(s, s + batch_size) for s in range(0, len(jpegs) - batch_size + 1, batch_size)]

    def one_pass() -> int:
        return sum(torch.stack(list(pool.map(one, span))).shape[0] for span in spans)

    return one_pass
