"""Image preset throughput vs the full-decode ceiling: `python -m bench.vision [--quick]`.

Two sets of generated photo-like JPEGs (q90): 400x300 (~38 KB) and 500x375 (~110 KB). Per set,
in one run, each row is measured right after its baselines, in rounds (so load from other users
of the machine hits a row and its baselines alike):
- the full-decode ceiling: single-thread full decode + centre crop 224 with the best decoder
  (simplejpeg or Pillow, whichever is faster in that round) x usable cores;
- the CPU preset called directly on ready batches (threads = usable cores): eval crop only
  (centre 224, `resize=None`) and train (RandomResizedCrop 224 + flip), uint8 NHWC and fp16
  NCHW; train also with `dct_downscale=True`; the DALI CPU pipeline when DALI is installed;
- `fastload.Loader` over a fastload dataset of the set, eval crop-only preset as `transform`,
  num_workers 0/1/2 (`adaptive=False`, so each row runs the workers it names);
- on a CUDA machine: the DALI mixed (nvJPEG) rows and the data stall of a prefetching loop.
Each row prints the median images/s over rounds and its ratios to the baselines measured just
before it (median, min-max). Then, per num_workers, a fresh process times the Loader's first batch and
reads its peak RSS.
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

from fastload.formats.ragged import Ragged
from fastload.system import usable_cores
from fastload.vision import ImagePreset, dali_available

__all__ = ["SETS", "main", "make_jpegs"]

# name -> make_jpegs arguments
SETS = {
    "400x300 q90": {"height": 300, "width": 400, "grain": 7.0},
    "500x375 q90": {"height": 375, "width": 500, "grain": 23.0},
}


def make_jpegs(
    n: int, *, height: int = 375, width: int = 500, quality: int = 90, grain: float = 6.0, seed: int = 0
) -> list[bytes]:
    """`n` photo-like JPEGs: upsampled low-frequency noise plus grain (its std sets the file size)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        low = (rng.random((height // 24 + 2, width // 24 + 2, 3)) * 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.normal(0, grain, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
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


def _batches(jpegs: list[bytes], batch_size: int) -> list[dict]:
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


def _preset_pass(preset: ImagePreset, batches: list[dict]) -> Callable[[], int]:
    def one_pass() -> int:
        n = 0
        for b in batches:
            out = preset(b)["image"]
            n += out.shape[0]
        if out.is_cuda:
            torch.cuda.synchronize()
        return n

    return one_pass


def _loader_pass(root: str, preset: ImagePreset, batch_size: int, workers: int) -> Callable[[], int]:
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
        adaptive=False,
    )

    def one_pass() -> int:
        return sum(int(b["image"].shape[0]) for b in loader)

    return one_pass


def _write_dataset(jpegs: list[bytes], root: str) -> None:
    from fastload.formats import Field, Schema, write

    schema = Schema((Field("image", "image"), Field("label", "scalar", np.int64)))
    write(({"image": j, "label": i} for i, j in enumerate(jpegs)), root, schema=schema, progress=False)


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
root, workers, size, bs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
preset = ImagePreset(kind="eval", size=size, resize=None, backend="cpu", normalize=False)
loader = Loader(with_indices(open_dataset(root)), batch_size=bs, drop_last=True, transform=preset,
                num_workers=workers, seed=0, adaptive=False)
t1 = time.perf_counter()
it = iter(loader)
next(it)
t2 = time.perf_counter()
for _ in it:
    pass
try:  # this process's own peak (ru_maxrss keeps the forking parent's peak across exec)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"import_s": t1 - t0, "first_batch_s": t2 - t1, "peak_rss": rss}))
"""


def _first_batch(root: str, workers: int, size: int, bs: int) -> dict:
    """A fresh process: Loader + eval crop-only preset; time to its first batch and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, root, str(workers), str(size), str(bs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bench_set(name: str, args: argparse.Namespace, cores: int, rounds: int, min_time: float) -> None:
    size, n_img = args.size, args.images or (64 if args.quick else 192)
    jpegs = make_jpegs(n_img, **SETS[name])
    bs = min(args.batch_size, n_img)
    batches = _batches(jpegs, bs)
    kb = np.mean([len(j) for j in jpegs]) / 1e3
    print(f"\n## {name}: {n_img} JPEGs, mean {kb:.0f} KB; {cores} cores; batch {bs}")

    pool = ThreadPoolExecutor(cores)
    base = {
        "sj1": _full_decode_crop_pass(jpegs, "simplejpeg", size),
        "sjN": _full_decode_crop_pass(jpegs, "simplejpeg", size, pool),
    }
    fns: dict[str, Callable[[], int]] = {
        "full decode + crop, Pillow, 1 thread": _full_decode_crop_pass(jpegs, "pillow", size),
        f"full decode + crop, simplejpeg, {cores} threads": base["sjN"],
    }
    rows = [
        ("eval crop-only uint8 NHWC", {"kind": "eval", "resize": None, "normalize": False}),
        ("eval crop-only fp16 NCHW", {"kind": "eval", "resize": None}),
        ("train RRC+flip uint8 NHWC", {"kind": "train", "normalize": False}),
        ("train RRC+flip uint8 NHWC dct_downscale", {"kind": "train", "normalize": False, "dct_downscale": True}),
        ("train RRC+flip fp16 NCHW", {"kind": "train"}),
    ]
    for label, kw in rows:
        fns[f"cpu preset {label}"] = _preset_pass(ImagePreset(size=size, backend="cpu", threads=cores, **kw), batches)
    for label, kw in rows[0:1] + rows[2:3]:
        preset = ImagePreset(size=size, backend="cpu", threads=1, **kw)
        fns[f"cpu preset {label}, 1 thread"] = _preset_pass(preset, batches)
    if dali_available():
        for kind in ("eval", "train"):
            preset = ImagePreset(kind=kind, size=size, backend="dali", threads=cores, normalize=False)
            fns[f"dali-cpu {kind} uint8 NHWC"] = _preset_pass(preset, batches)
    if torch.cuda.is_available() and dali_available():
        for kind in ("eval", "train"):
            preset = ImagePreset(kind=kind, size=size, backend="dali", device="cuda", threads=cores)
            fns[f"dali-mixed {kind} fp16 NCHW (GPU)"] = _preset_pass(preset, batches)
    tmp = tempfile.mkdtemp(prefix="fastload-bench-vision-")
    root = os.path.join(tmp, "ds")
    try:
        _write_dataset(jpegs, root)
        for workers in (0, 1, 2):
            preset = ImagePreset(kind="eval", size=size, resize=None, backend="cpu", normalize=False)
            fns[f"Loader eval crop-only, num_workers={workers}"] = _loader_pass(root, preset, bs, workers)
        rates = _paired_rounds(fns, base, rounds=rounds, min_time=min_time)
        first = {w: _first_batch(root, w, size, bs) for w in (0, 1, 2)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"each row measured right after its baselines, {rounds} rounds; ratios per measurement, median "
        f"(min-max): A = row / ceiling, ceiling = {cores} x 1-thread simplejpeg full decode + centre crop "
        f"(the faster 1-thread decoder: see the Pillow row); B = row / that full decode + crop on {cores} "
        "threads (the parallelism this run really had); 1-thread rows: C = row / the 1-thread full decode + "
        "crop; CPU = images per CPU-second (all threads) / the 1-thread full decode + crop's: the work per "
        "image, which load from other processes does not change (A's bound on idle cores when the row keeps "
        f"{cores} cores busy: {cores} x CPU / {cores})"
    )
    print(f"{'row':<50} {'img/s median (min-max)':>22} {'A':>17} {'B or C':>17} {'CPU':>17}")

    def cell(x: np.ndarray, digits: int) -> str:
        return f"{np.median(x):.{digits}f} ({x.min():.{digits}f}-{x.max():.{digits}f})"

    sj = np.concatenate([r[:, 1, 0] for r in rates.values()])
    print(f"{'full decode + crop, simplejpeg, 1 thread (baselines)':<50} {cell(sj, 0):>22}")
    for label, r in rates.items():
        rate, single, multi = r[:, 0, 0], r[:, 1, 0], r[:, 2, 0]
        other = rate / single if label.endswith("1 thread") else rate / multi
        cpu = r[:, 0, 1] / r[:, 1, 1]
        print(
            f"{label:<50} {cell(rate, 0):>22} {cell(rate / (cores * single), 2):>17} {cell(other, 2):>17} "
            f"{cell(cpu, 2):>17}"
        )
    pool.shutdown()
    for w, f in first.items():
        print(
            f"Loader num_workers={w}, fresh process: first batch {1e3 * f['first_batch_s']:.0f} ms after the "
            f"Loader was built (imports {f['import_s']:.1f} s); peak RSS {f['peak_rss'] / 2**20:.0f} MiB"
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
    ap.add_argument("--set", choices=sorted(SETS), action="append", help="only this set (repeatable)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 4)
    min_time = 0.3 if args.quick else 0.5
    cores = usable_cores()
    for name in args.set or list(SETS):
        _bench_set(name, args, cores, rounds, min_time)
    if not (torch.cuda.is_available() and dali_available()):
        print("mixed (nvJPEG) rows and the data-stall check need CUDA + DALI: skipped")


if __name__ == "__main__":
    main()
