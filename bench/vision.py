"""Image preset throughput vs the full-decode ceiling: `python -m bench.vision [--quick]`.

Generated photo-like JPEGs (q90): 400x300 (~38 KB) and 500x375 (~110 KB) by default; 1024x768
(`--set 1024x768`), where RandomResizedCrop windows reach 2x the output and DCT scaling applies.
Per set, in one run, each row is measured right after its baselines, in rounds (so load from
other users of the machine hits a row and its baselines alike):
- the full-decode ceiling: single-thread full decode + centre crop 224 with the best decoder
  (simplejpeg or Pillow, whichever is faster in that round) x usable cores;
- the train reference: single-thread full decode + the same RandomResizedCrop windows + the same
  antialiased resize to 224 (what a full-decode train pipeline does per image);
- the CPU preset called directly on ready batches (threads = usable cores): eval crop only
  (centre 224, `resize=None`), eval resized, train (RandomResizedCrop 224 + flip, DCT downscale
  on by default; also off), uint8 NHWC and fp16 NCHW; fastload's DALI backend on the CPU when installed;
- peers on the same JPEGs (`bench.vision_peers`, uint8 NHWC batches, all cores): a standalone DALI
  CPU pipeline (eval resize + centre crop; train `decoders.image_random_crop` + resize + flip)
  when DALI is installed, and torchvision's classic PIL pipeline written with its PIL calls
  (torchvision's PyPI builds do not load beside the CPU-only torch; the train row uses the
  preset's RandomResizedCrop windows);
- the train preset rows again on the JPEGs re-encoded with restart markers (`restart index`), as
  `fastload convert` stores them;
- `fastload.Loader` over a fastload dataset of the set's JPEGs as `fastload convert` stores them
  (re-encoded with restart markers; repeated to `LOADER_IMAGES`, so
  an epoch is many batches, as in training), eval crop-only and train presets as `transform`,
  num_workers 0/1/2 (`autotune=False`, so each row runs the workers it names);
- on a CUDA machine: the DALI mixed (nvJPEG) rows and the data stall of a prefetching loop.
`--resize-kernels` times, instead, the resize kernels on the train windows (torch, Pillow, OpenCV
where it imports). Each row prints the median images/s over rounds and its ratios to the baselines measured just
before it (median, min-max), wall-time and CPU-time; the load average at the start and end of
each set. Then, per preset and num_workers, a fresh process times the Loader's first batch and
reads its peak RSS. torch runs one intra-op thread: presets and references parallelise over images.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from bench.vision_peers import dali_cpu_pass, pil_torch_pass
from fastload.formats.jpeg_restart import add_restart_index
from fastload.formats.ragged import Ragged
from fastload.system import usable_cores
from fastload.vision import ImagePreset, dali_available

__all__ = ["DEFAULT_SETS", "SETS", "batches_of", "main", "make_jpegs", "preset_pass"]

# name -> make_jpegs arguments
SETS = {
    "400x300": {"height": 300, "width": 400, "grain": 7.0},
    "500x375": {"height": 375, "width": 500, "grain": 23.0},
    "1024x768": {"height": 768, "width": 1024, "grain": 7.0},
}
DEFAULT_SETS = ("400x300", "500x375")


def make_jpegs(
    n: int, *, height: int = 375, width: int = 500, quality: int = 90, grain: float = 6.0, seed: int = 0,
    mode: str = "RGB", **save: object,
) -> list[bytes]:
    """`n` photo-like JPEGs: upsampled low-frequency noise plus grain (its std sets the file size),
    in PIL `mode` ("L": grayscale), `save` passed to PIL's JPEG writer (e.g. subsampling=0,
    progressive=True)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        low = (rng.random((height // 24 + 2, width // 24 + 2, 3)) * 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.normal(0, grain, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).convert(mode).save(buf, format="JPEG", quality=quality, **save)
        out.append(buf.getvalue())
    return out


def _rate(fn: Callable[[], int], *, min_time: float) -> tuple[float, float]:
    """Calls `fn` (returns images processed) until `min_time` has passed: (images per second,
    images per CPU-second of this process, all its threads)."""
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        n += fn()
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return n / dt, n / max(time.process_time() - c0, 1e-9)


def _paired_rounds(
    fns: dict[str, Callable[[], int]],
    base: dict[str, Callable[[], int]],
    *,
    rounds: int,
    min_time: float,
) -> dict[str, np.ndarray]:
    """Rounds in which every row is measured right after the baselines (`base`, in order): the
    ratios of a row to its own baselines, seconds apart, cancel most of the load that other users
    of the machine put on it. Returns, per row, a (rounds, 1 + len(base), 2) array of
    (images/s, images per CPU-second)."""
    for fn in [*base.values(), *fns.values()]:
        fn()  # warm-up: thread pools, pipeline build
    out: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            b = [_rate(f, min_time=min_time) for f in base.values()]
            out[name].append([_rate(fn, min_time=min_time), *b])
    return {name: np.array(v) for name, v in out.items()}


def batches_of(jpegs: list[bytes], batch_size: int) -> list[dict]:
    out = []
    for s in range(0, len(jpegs) - batch_size + 1, batch_size):
        out.append(
            {
                "image": Ragged.from_list(jpegs[s : s + batch_size], kind="image"),
                "label": np.arange(s, s + batch_size, dtype=np.int64),
                "__indices__": np.arange(s, s + batch_size, dtype=np.int64),
            }
        )
    return out


def preset_pass(preset: ImagePreset, batches: list[dict]) -> Callable[[], int]:
    def one_pass() -> int:
        n = 0
        for b in batches:
            out = preset(b)["image"]
            n += out.shape[0]
        if out.is_cuda:
            torch.cuda.synchronize()
        return n

    return one_pass


def loader_pass(root: str, preset: ImagePreset, batch_size: int, workers: int) -> Callable[[], int]:
    """One epoch of `fastload.Loader` over a fastload dataset of the JPEGs, decoded by `preset`."""
    from fastload import Loader, open_dataset
    from fastload.vision import with_indices

    loader = Loader(
        with_indices(open_dataset(root)),
        batch_size=batch_size,
        drop_last=True,
        transform=preset,
        seed=0,
        num_workers=workers,
        autotune=False,
    )

    def one_pass() -> int:
        return sum(int(b["image"].shape[0]) for b in loader)

    return one_pass


# The Loader rows' dataset repeats the set's JPEGs up to this many images: an epoch of a few
# batches would time the epoch's start and its tail (the last batches, fewer than the workers).
LOADER_IMAGES = 1536


def write_image_dataset(jpegs: list[bytes], root: str) -> None:
    """A fastload dataset of `jpegs` as `fastload convert` stores an image folder's JPEGs (re-encoded
    with restart markers: `add_restart_index`), repeated to at least `LOADER_IMAGES` images."""
    from fastload.formats import Field, Schema, write
    from fastload.formats.jpeg_restart import add_restart_index

    jpegs = [add_restart_index(j) for j in jpegs]
    reps = -(-LOADER_IMAGES // len(jpegs))
    schema = Schema((Field("image", "image"), Field("label", "scalar", np.int64)))
    write(({"image": j, "label": i} for i, j in enumerate(jpegs * reps)), root, schema=schema, progress=False)


def _full_decode_crop_pass(
    jpegs: list[bytes], decoder: str, size: int, pool: ThreadPoolExecutor | None = None
) -> Callable[[], int]:
    """Full decode + centre crop `size` (a contiguous copy), simplejpeg or Pillow; on `pool`'s
    threads, else on the calling thread."""
    import simplejpeg
    from PIL import Image

    def decode(j: bytes) -> np.ndarray:
        if decoder == "simplejpeg":
            return simplejpeg.decode_jpeg(j)
        with Image.open(io.BytesIO(j)) as im:
            return np.asarray(im.convert("RGB"))

    def one(j: bytes) -> int:
        img = decode(j)
        y0, x0 = (img.shape[0] - size) // 2, (img.shape[1] - size) // 2
        np.ascontiguousarray(img[y0 : y0 + size, x0 : x0 + size])
        return 1

    def one_pass() -> int:
        return sum(pool.map(one, jpegs)) if pool is not None else sum(map(one, jpegs))

    return one_pass


def _train_windows(jpegs: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sizes, RandomResizedCrop windows, flips) of the train preset's defaults, seed 0, epoch 0."""
    import simplejpeg

    from fastload.vision import random_flips, random_resized_crop

    sizes = np.array([simplejpeg.decode_jpeg_header(j)[:2] for j in jpegs], dtype=np.int64)
    idx = np.arange(len(jpegs))
    return sizes, random_resized_crop(sizes, seed=0, epoch=0, indices=idx), random_flips(seed=0, epoch=0, indices=idx)


def _train_reference_pass(jpegs: list[bytes], size: int, pool: ThreadPoolExecutor | None = None) -> Callable[[], int]:
    """Full decode (simplejpeg) + the train preset's RandomResizedCrop window + torch's antialiased
    bilinear resize to `size` into a reused output slot per image, then the flip (of the output,
    as torchvision's RandomHorizontalFlip after RandomResizedCrop): on `pool` or this thread."""
    import simplejpeg

    from fastload.vision.cpu_decode import resize_hwc

    _, windows, flips = _train_windows(jpegs)
    out = torch.empty((len(jpegs), size, size, 3), dtype=torch.uint8)  # reused: no page faults per image

    def one(i: int) -> int:
        y0, x0, h, w = (int(v) for v in windows[i])
        crop = simplejpeg.decode_jpeg(jpegs[i])[y0 : y0 + h, x0 : x0 + w]
        resize_hwc(crop, out[i])
        if flips[i]:
            out[i] = out[i].flip(1)
        return 1

    def one_pass() -> int:
        idx = range(len(jpegs))
        return sum(pool.map(one, idx)) if pool is not None else sum(map(one, idx))

    return one_pass


def _parts_passes(jpegs: list[bytes], size: int) -> dict[str, Callable[[], int]]:
    """1-thread parts of the train preset's work: the window decode alone (full scale, no resize),
    and a full decode at 1/8 scale (entropy decoding of every row, almost no IDCT/colour work)."""
    import simplejpeg

    from fastload.vision.cpu_decode import batch_view, decode_windows

    sizes, windows, flips = _train_windows(jpegs)
    values, offsets = batch_view(jpegs)
    need = windows[:, 2] * windows[:, 3] * 3
    params = np.zeros((len(jpegs), 8), dtype=np.int64)
    params[:, 0], params[:, 1:5], params[:, 5], params[:, 6] = np.arange(len(jpegs)), windows, 8, flips
    params[:, 7] = np.cumsum(need) - need
    out = np.empty(int(need.sum()), dtype=np.uint8)

    def windows_only() -> int:
        decode_windows(values, offsets, params, out)
        return len(jpegs)

    def eighth() -> int:
        for j, (h, w) in zip(jpegs, sizes, strict=True):
            simplejpeg.decode_jpeg(j, min_height=-(-h // 8), min_width=-(-w // 8), min_factor=1.0)
        return len(jpegs)

    rows = {"full decode at 1/8 scale (entropy decoding), 1 thread": eighth}
    if decode_windows is not None:
        rows["train window decode only (no resize), 1 thread"] = windows_only
    return rows


def _resize_kernels(jpegs: list[bytes], size: int, repeats: int = 5) -> None:
    """Print, per resize kernel, the best-of-`repeats` time per RandomResizedCrop window of `jpegs`
    to `size` (one thread), and its mean difference to torch's antialiased bilinear (the preset's):
    torch, Pillow BILINEAR, and OpenCV INTER_LINEAR / INTER_AREA where cv2 imports."""
    from PIL import Image

    from fastload.vision.cpu_decode import decode_rgb, resize_hwc

    _, windows, _ = _train_windows(jpegs)
    crops = [np.ascontiguousarray(decode_rgb(j)[y : y + h, x : x + w]) for j, (y, x, h, w) in zip(jpegs, windows)]
    out = torch.empty((size, size, 3), dtype=torch.uint8)

    def torch_aa(c: np.ndarray) -> np.ndarray:
        resize_hwc(c, out)
        return out.numpy()

    kernels = {
        "torch antialiased bilinear": torch_aa,
        "Pillow BILINEAR": lambda c: np.asarray(Image.fromarray(c).resize((size, size), Image.BILINEAR)),
    }
    try:
        import cv2

        cv2.setNumThreads(1)
        kernels["OpenCV INTER_LINEAR"] = lambda c: cv2.resize(c, (size, size), interpolation=cv2.INTER_LINEAR)
        kernels["OpenCV INTER_AREA"] = lambda c: cv2.resize(c, (size, size), interpolation=cv2.INTER_AREA)
    except ImportError:
        print("OpenCV not importable: its rows skipped")
    ref = [torch_aa(c).astype(np.int16) for c in crops]
    full = min(_timed(lambda: [decode_rgb(j) for j in jpegs]) for _ in range(repeats)) / len(jpegs)
    for name, fn in kernels.items():
        t = min(_timed(lambda fn=fn: [fn(c) for c in crops]) for _ in range(repeats)) / len(crops)
        diff = max(float(np.abs(fn(c).astype(np.int16) - r).mean()) for c, r in zip(crops, ref))
        print(
            f"resize {name}: {1e6 * t:.0f} us per window ({t / full:.2f} of a full decode, {1e6 * full:.0f} us); "
            f"mean |difference| to torch's, worst window: {diff:.2f} / 255"
        )


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stall(preset: ImagePreset, batches: list[dict], *, step_s: float, steps: int) -> float:
    """Fraction of wall time a simulated training step waits for data (prefetch depth 2)."""
    q: queue.Queue = queue.Queue(maxsize=2)

    def produce() -> None:
        for i in range(steps):
            q.put(preset(batches[i % len(batches)]))
        q.put(None)

    threading.Thread(target=produce, daemon=True).start()
    q.get()  # first batch: pipeline start-up is not a stall
    waited, t0 = 0.0, time.perf_counter()
    while True:
        w = time.perf_counter()
        item = q.get()
        waited += time.perf_counter() - w
        if item is None:
            break
        torch.cuda._sleep(int(step_s * 1.4e9))  # ~step_s of GPU work at ~1.4 GHz
        torch.cuda.synchronize()
    return waited / (time.perf_counter() - t0)


_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from fastload import Loader, open_dataset
from fastload.vision import ImagePreset, with_indices
root, workers, size, bs, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
kw = {"resize": None} if kind == "eval" else {}
preset = ImagePreset(kind=kind, size=size, backend="cpu", normalize=False, **kw)
loader = Loader(with_indices(open_dataset(root)), batch_size=bs, drop_last=True, transform=preset,
                num_workers=workers, seed=0, autotune=False)
t1 = time.perf_counter()
it = iter(loader)
next(it)
t2 = time.perf_counter()
for _ in it:
    pass
try:  # this process's own peak (ru_maxrss keeps the forking parent's peak across exec)
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("Vm", "Rss"))}
    rss, mapped = status["VmHWM"], status["RssFile"]
except (OSError, KeyError):
    rss, mapped = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0
print(json.dumps({"import_s": t1 - t0, "first_batch_s": t2 - t1, "peak_rss": rss, "file_rss": mapped}))
"""


def _first_batch(root: str, workers: int, size: int, bs: int, kind: str) -> dict:
    """A fresh process: Loader + the eval crop-only or train uint8 preset; time to its first batch,
    peak RSS and the file-backed part of RSS after the epoch (the mapped dataset counts there)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, root, str(workers), str(size), str(bs), kind],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rows(
    size: int, cores: int, jpegs: list[bytes], root: str, bs: int, pool: ThreadPoolExecutor
) -> dict[str, Callable[[], int]]:
    """The measured rows (label -> one pass), baselines excluded."""
    batches = batches_of(jpegs, bs)
    fns: dict[str, Callable[[], int]] = {}
    presets = [
        ("eval crop-only uint8 NHWC", {"kind": "eval", "resize": None, "normalize": False}),
        ("eval crop-only fp16 NCHW", {"kind": "eval", "resize": None}),
        ("eval crop 0.875 + resize uint8 NHWC", {"kind": "eval", "normalize": False}),
        ("train RRC+flip uint8 NHWC", {"kind": "train", "normalize": False}),
        (
            "train RRC+flip uint8 NHWC, dct_downscale=False",
            {"kind": "train", "normalize": False, "dct_downscale": False},
        ),
        ("train RRC+flip fp16 NCHW", {"kind": "train"}),
    ]
    for label, kw in presets:
        fns[f"cpu preset {label}"] = preset_pass(ImagePreset(size=size, backend="cpu", threads=cores, **kw), batches)
    for label, kw in (presets[0], presets[3]):
        preset = ImagePreset(size=size, backend="cpu", threads=1, **kw)
        fns[f"cpu preset {label}, 1 thread"] = preset_pass(preset, batches)
    # the same JPEGs as `fastload convert` stores them: the train window decoder starts at its rows
    restart = batches_of([add_restart_index(j) for j in jpegs], bs)
    for threads in (cores, 1):
        preset = ImagePreset(size=size, backend="cpu", threads=threads, **presets[3][1])
        suffix = ", 1 thread" if threads == 1 else ""
        fns[f"cpu preset {presets[3][0]}, restart index{suffix}"] = preset_pass(preset, restart)
    if dali_available():
        for kind in ("eval", "train"):
            preset = ImagePreset(kind=kind, size=size, backend="dali", threads=cores, normalize=False)
            fns[f"dali-cpu {kind} uint8 NHWC"] = preset_pass(preset, batches)
    _, windows, flips = _train_windows(jpegs)
    for kind in ("eval", "train"):
        if dali_available():
            fns[f"peer: DALI CPU pipeline {kind} uint8 NHWC"] = dali_cpu_pass(
                jpegs, kind=kind, size=size, threads=cores, batch_size=bs
            )
        fns[f"peer: torchvision-style PIL {kind} uint8 NHWC"] = pil_torch_pass(
            jpegs, kind=kind, size=size, windows=windows, flips=flips, pool=pool, batch_size=bs
        )
    if torch.cuda.is_available() and dali_available():
        for kind in ("eval", "train"):
            preset = ImagePreset(kind=kind, size=size, backend="dali", device="cuda", threads=cores)
            fns[f"dali-mixed {kind} fp16 NCHW (GPU)"] = preset_pass(preset, batches)
    for kind in ("eval", "train"):
        for workers in (0, 1, 2):
            kw = {"resize": None} if kind == "eval" else {}
            preset = ImagePreset(kind=kind, size=size, backend="cpu", normalize=False, **kw)
            name = "eval crop-only" if kind == "eval" else "train RRC+flip"
            fns[f"Loader {name} uint8, num_workers={workers}"] = loader_pass(root, preset, bs, workers)
    return fns


def _cell(x: np.ndarray, digits: int) -> str:
    return f"{np.median(x):.{digits}f} ({x.min():.{digits}f}-{x.max():.{digits}f})"


def _report(rates: dict[str, np.ndarray], cores: int) -> None:
    """One line per row: img/s, A (wall / ceiling), B or C, CPU (work ratio), and for train rows
    R / R-CPU against the train reference."""
    print(f"{'row':<58} {'img/s median (min-max)':>22} {'A':>17} {'B or C':>17} {'CPU':>17} {'R':>17} {'R-CPU':>17}")
    sj = np.concatenate([r[:, 1, 0] for r in rates.values()])
    ref = np.concatenate([r[:, 3, 0] for r in rates.values()])
    print(f"{'full decode + crop, simplejpeg, 1 thread (baseline)':<58} {_cell(sj, 0):>22}")
    print(f"{'train reference, 1 thread (baseline)':<58} {_cell(ref, 0):>22}")
    for label, r in rates.items():
        rate, single, multi, tref = r[:, 0, 0], r[:, 1, 0], r[:, 2, 0], r[:, 3, 0]
        other = rate / single if label.endswith("1 thread") else rate / multi
        cpu = r[:, 0, 1] / r[:, 1, 1]
        line = (
            f"{label:<58} {_cell(rate, 0):>22} {_cell(rate / (cores * single), 2):>17} {_cell(other, 2):>17} "
            f"{_cell(cpu, 2):>17}"
        )
        if "train" in label:
            k = 1 if label.endswith("1 thread") else cores
            line += f" {_cell(rate / (k * tref), 2):>17} {_cell(r[:, 0, 1] / r[:, 3, 1], 2):>17}"
        print(line)


def _bench_set(name: str, args: argparse.Namespace, cores: int, rounds: int, min_time: float) -> None:
    size, n_img = args.size, args.images or (64 if args.quick else 192)
    jpegs = make_jpegs(n_img, **SETS[name])
    bs = min(args.batch_size, n_img)
    batches = batches_of(jpegs, bs)
    kb = np.mean([len(j) for j in jpegs]) / 1e3
    load0 = os.getloadavg()
    print(f"\n## {name} q90: {n_img} JPEGs, mean {kb:.0f} KB; {cores} cores; batch {bs}; load average {load0[0]:.2f}")

    pool = ThreadPoolExecutor(cores)
    base = {
        "sj1": _full_decode_crop_pass(jpegs, "simplejpeg", size),
        "sjN": _full_decode_crop_pass(jpegs, "simplejpeg", size, pool),
        "ref1": _train_reference_pass(jpegs, size),
    }
    fns: dict[str, Callable[[], int]] = {
        "full decode + crop, Pillow, 1 thread": _full_decode_crop_pass(jpegs, "pillow", size),
        f"full decode + crop, simplejpeg, {cores} threads": base["sjN"],
        f"train reference, {cores} threads": _train_reference_pass(jpegs, size, pool),
        **_parts_passes(jpegs, size),
    }
    tmp = tempfile.mkdtemp(prefix="fastload-bench-vision-")
    root = os.path.join(tmp, "ds")
    try:
        write_image_dataset(jpegs, root)
        fns.update(_rows(size, cores, jpegs, root, bs, pool))
        if args.rows:
            fns = {k: f for k, f in fns.items() if any(r in k for r in args.rows)}
        rates = _paired_rounds(fns, base, rounds=rounds, min_time=min_time)
        load1 = os.getloadavg()
        first = {}
        if any(k.startswith("Loader") for k in fns):
            first = {(k, w): _first_batch(root, w, size, bs, k) for k in ("eval", "train") for w in (0, 1, 2)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    train = ImagePreset(kind="train", size=size, backend="cpu", normalize=False)
    for b in batches:
        train(b)

    print(
        f"each row measured right after its baselines, {rounds} rounds; load average (1 min) {load0[0]:.2f} at "
        f"the start, {load1[0]:.2f} at the end (5 min: {load1[1]:.2f}); ratios per measurement, median (min-max): "
        f"A = row / ceiling, ceiling = {cores} x 1-thread simplejpeg full decode + centre crop (the faster "
        f"1-thread decoder: see the Pillow row); B = row / that full decode + crop on {cores} threads (the "
        "parallelism this run really had); 1-thread rows: C = row / the 1-thread full decode + crop; CPU = images "
        "per CPU-second (all threads) / the 1-thread full decode + crop's: the work per image, which load from "
        "other processes does not change; train rows: R = row / (threads x the 1-thread train reference: full "
        "decode + the same RandomResizedCrop + resize), R-CPU = the same in CPU time"
    )
    print(f"train preset decode modes over the set: {train.stats()['vision_decode_modes']}")
    _report(rates, cores)
    pool.shutdown()
    for (k, w), f in first.items():
        print(
            f"Loader {k} uint8 num_workers={w}, fresh process: first batch {1e3 * f['first_batch_s']:.0f} ms after "
            f"the Loader was built (imports {f['import_s']:.1f} s); peak RSS {f['peak_rss'] / 2**20:.0f} MiB, of "
            f"which file pages (libraries, the dataset's mapped shards) {f['file_rss'] / 2**20:.0f} MiB at the end"
        )
    if torch.cuda.is_available() and dali_available():
        preset = ImagePreset(kind="train", size=size, backend="dali", device="cuda", threads=cores)
        for step_ms in (20.0, 50.0):
            stall = _stall(preset, batches, step_s=step_ms / 1e3, steps=20 if args.quick else 60)
            print(f"data stall, dali-mixed train, {step_ms:.0f} ms step, batch {bs}: {100 * stall:.2f}%")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer images, one short round per row")
    ap.add_argument("--images", type=int, default=None, help="JPEGs per set (default 192; 64 quick)")
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds (default 4; 1 quick)")
    ap.add_argument(
        "--set", choices=sorted(SETS), action="append", help=f"this set (repeatable; default {DEFAULT_SETS})"
    )
    ap.add_argument("--rows", action="append", help="only the rows whose label contains this (repeatable)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--resize-kernels", action="store_true", help="only time resize kernels on each set's windows")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 4)
    min_time = 0.3 if args.quick else 0.5
    cores = usable_cores()
    torch.set_num_threads(1)
    for name in args.set or DEFAULT_SETS:
        if args.resize_kernels:
            print(f"\n## {name}: resize kernels, {args.images or 64} windows, 1 thread, load {os.getloadavg()[0]:.2f}")
            _resize_kernels(make_jpegs(args.images or 64, **SETS[name]), args.size)
            continue
        _bench_set(name, args, cores, rounds, min_time)
    if not (torch.cuda.is_available() and dali_available()):
        print("mixed (nvJPEG) rows and the data-stall check need CUDA + DALI: skipped")


if __name__ == "__main__":
    main()
