"""JPEG restart index: size change and window-decode CPU cost, `python -m bench.jpeg_restart`.

For each set of generated photo-like JPEGs (`bench.vision.make_jpegs`, q90): the bytes before and
after `add_restart_index` (what `fastload convert` stores: a lossless re-encode with restart
intervals that cut each MCU row into column groups, optimised Huffman tables and the APP9 index),
the CPU time of the re-encode,
and the CPU time per image of the window decoder (`decode_windows`, one thread, one call per
set; the median of `--rounds` interleaved rounds of `--min-cpu / --rounds` seconds each) on the
original and the re-encoded bytes (and, for train windows, the re-encoded bytes without the
index: decoded from the top) for:
- train windows: the image preset's RandomResizedCrop windows (seed 0, epoch 0) at the DCT scale
  the train preset picks for a 224 output, mirrored where it flips;
- eval windows: the centre crop (0.875 of the largest square), full scale;
- the whole image.
Also the share of MCUs each path entropy-decodes for the train and eval windows at full scale
(original: every MCU from the top to the window's last MCU row; restart index: the restart
intervals the window covers, with a row or column group of context where subsampled chroma needs
it).
CPU time is `time.process_time`, which load from other processes on the machine does not change
much (cache sharing aside). libjpeg-turbo decodes an image with restart markers on its per-symbol
Huffman path, which runs more instructions per bit than its fast path; time, not instruction
counts, is what is compared here.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from bench.vision import SETS, make_jpegs
from fastload.formats.jpeg_restart import add_restart_index, restart_index
from fastload.vision import center_crop, random_flips, random_resized_crop
from fastload.vision.cpu_decode import batch_view, dct_nums, decode_windows, probe_sizes, scaled_windows

__all__ = ["main"]

# set name -> (bench.vision set, PIL save options, MCU (height, width))
VARIANTS = {
    "400x300 4:2:0": ("400x300", {}, (16, 16)),
    "400x300 4:2:2": ("400x300", {"subsampling": 1}, (8, 16)),
    "400x300 4:4:4": ("400x300", {"subsampling": 0}, (8, 8)),
    "400x300 gray": ("400x300", {"mode": "L"}, (8, 8)),
    "400x300 progressive 4:2:0": ("400x300", {"progressive": True}, (16, 16)),
    "500x375 4:2:0": ("500x375", {}, (16, 16)),
    "1024x768 4:2:0": ("1024x768", {}, (16, 16)),
}


def _decode_pass(jpegs: list[bytes], params: np.ndarray) -> Callable[[], None]:
    """One `decode_windows` call over `jpegs` with rows `params` (checked to decode every window)."""
    values, offsets = batch_view(jpegs)
    out = np.empty(int((params[:, 3] * params[:, 4]).sum() * 3), dtype=np.uint8)
    assert decode_windows(values, offsets, params, out) == []
    return lambda: decode_windows(values, offsets, params, out)


def _cpu_per_image(passes: dict[str, Callable[[], None]], n: int, min_cpu: float, rounds: int) -> dict[str, float]:
    """CPU milliseconds per image of each pass: the median over `rounds` rounds in which every pass
    runs for `min_cpu / rounds` CPU seconds in turn (load changes hit them alike)."""
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(rounds):
        for key, fn in passes.items():
            calls, c0 = 0, time.process_time()
            while time.process_time() - c0 < min_cpu / rounds or calls < 1:
                fn()
                calls += 1
            times[key].append(1e3 * (time.process_time() - c0) / (calls * n))
    return {k: float(np.median(v)) for k, v in times.items()}


def _without_index(coded: bytes) -> bytes:
    """`coded` with its APP9 restart index segment removed (the window decoder then reads it from the top)."""
    at = coded.index(b"FLRST\x00") - 4
    while coded[at : at + 2] != b"\xff\xe9":
        at = coded.index(b"FLRST\x00", at + 5) - 4
    return coded[:at] + coded[at + 2 + int.from_bytes(coded[at + 2 : at + 4], "big") :]


def _rows(sizes: np.ndarray, windows: np.ndarray, nums: np.ndarray, flips: np.ndarray) -> np.ndarray:
    """`decode_windows` rows for `windows` (original pixels) decoded at nums/8."""
    scaled = scaled_windows(sizes, windows, nums)
    params = np.zeros((len(windows), 8), dtype=np.int64)
    params[:, 0], params[:, 1:5], params[:, 5], params[:, 6] = np.arange(len(windows)), scaled, nums, flips
    need = scaled[:, 2] * scaled[:, 3] * 3
    params[:, 7] = np.cumsum(need) - need
    return params


def _interval(coded: bytes) -> int:
    """MCUs per restart interval of a re-encoded JPEG (its version 2 restart index's field)."""
    at = coded.index(b"FLRST\x00\x02")
    return int.from_bytes(coded[at + 8 : at + 10], "big")


def _cells(a: np.ndarray, n: np.ndarray, step: np.ndarray, sub: bool, cells: np.ndarray) -> tuple[np.ndarray, ...]:
    """(first, end) of the cells of `step` pixels holding pixels [a, a + n), with a cell of
    context where subsampled chroma (`sub`) needs it (as the window decoder takes them)."""
    first = np.maximum(a // step - (sub & (a % step == 0)), 0)
    end = np.minimum((a + n - 1) // step + 1 + (sub & ((a + n) % step == 0)), cells)
    return first, end


def _mcus_decoded(
    sizes: np.ndarray, windows: np.ndarray, mcu: tuple[int, int], intervals: np.ndarray
) -> tuple[float, float]:
    """Mean share of the MCUs entropy-decoded per window: (from the top, through the restart index)."""
    mcu_h, mcu_w = mcu
    rows, per_row = -(-sizes[:, 0] // mcu_h), -(-sizes[:, 1] // mcu_w)
    first, end = _cells(windows[:, 0], windows[:, 2], np.full(len(sizes), mcu_h), mcu_h == 16, rows)
    g0, g1 = _cells(windows[:, 1], windows[:, 3], intervals * mcu_w, mcu_w == 16, per_row // intervals)
    top = end / rows
    return float(np.mean(top)), float(np.mean((end - first) * (g1 - g0) * intervals / (rows * per_row)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=64, help="JPEGs per set (default 64)")
    ap.add_argument("--min-cpu", type=float, default=1.0, help="CPU seconds per measurement (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per measurement (default 5)")
    ap.add_argument("--size", type=int, default=224, help="the presets' output size (default 224)")
    args = ap.parse_args(argv)
    print(f"{'set':<27} {'KB':>6} {'size':>7} {'index':>6} {'re-encode':>10} "
          f"{'train orig':>11} {'train noidx':>12} {'train rst':>10} {'speed-up':>9} {'MCUs orig':>10} {'MCUs rst':>9} "
          f"{'eval orig':>10} {'eval rst':>9} {'speed-up':>9} {'MCUs orig':>10} {'MCUs rst':>9} "
          f"{'whole orig':>11} {'whole rst':>10}")
    for name, (base, save, mcu) in VARIANTS.items():
        jpegs = make_jpegs(args.images, **SETS[base], **save)
        c0 = time.process_time()
        coded = [add_restart_index(j) for j in jpegs]
        encode_ms = 1e3 * (time.process_time() - c0) / len(jpegs)
        assert all(restart_index(c) is not None for c in coded)
        index_bytes = sum(len(restart_index(c)) * 4 + 14 for c in coded)
        intervals = np.array([_interval(c) for c in coded], dtype=np.int64)
        sizes = probe_sizes(*batch_view(jpegs))[0]
        idx = np.arange(len(jpegs))
        train = random_resized_crop(sizes, seed=0, epoch=0, indices=idx)
        flips = random_flips(seed=0, epoch=0, indices=idx)
        train_params = _rows(sizes, train, dct_nums(train, (args.size, args.size)), flips)
        centre = center_crop(sizes, size=args.size)
        eval_params = _rows(sizes, centre, np.full(len(jpegs), 8), np.zeros(len(jpegs)))
        whole = np.concatenate([np.zeros_like(sizes), sizes], axis=1)
        whole_params = _rows(sizes, whole, np.full(len(jpegs), 8), np.zeros(len(jpegs)))
        unindexed = [_without_index(c) for c in coded]
        assert all(restart_index(c) is None for c in unindexed)
        passes = {
            (what, form): _decode_pass(data, params)
            for what, params in (("train", train_params), ("eval", eval_params), ("whole", whole_params))
            for form, data in (("orig", jpegs), ("rst", coded), ("noidx", unindexed))
            if what == "train" or form != "noidx"
        }
        cpu = _cpu_per_image(passes, len(jpegs), args.min_cpu, args.rounds)
        before, after = sum(map(len, jpegs)), sum(map(len, coded))
        share_orig, share_rst = _mcus_decoded(sizes, train, mcu, intervals)
        eval_orig, eval_rst = _mcus_decoded(sizes, centre, mcu, intervals)
        print(
            f"{name:<27} {before / len(jpegs) / 1e3:>6.1f} {100 * (after - before) / before:>+6.2f}% "
            f"{100 * index_bytes / before:>5.2f}% {encode_ms:>8.2f}ms "
            f"{cpu['train', 'orig']:>9.3f}ms {cpu['train', 'noidx']:>10.3f}ms {cpu['train', 'rst']:>8.3f}ms "
            f"{cpu['train', 'orig'] / cpu['train', 'rst']:>8.2f}x {100 * share_orig:>9.0f}% {100 * share_rst:>8.0f}% "
            f"{cpu['eval', 'orig']:>8.3f}ms {cpu['eval', 'rst']:>7.3f}ms "
            f"{cpu['eval', 'orig'] / cpu['eval', 'rst']:>8.2f}x "
            f"{100 * eval_orig:>9.0f}% {100 * eval_rst:>8.0f}% "
            f"{cpu['whole', 'orig']:>9.3f}ms {cpu['whole', 'rst']:>8.3f}ms"
        )
    print("KB: mean original size; size: total bytes after re-encoding vs before; index: the APP9 index's share "
          "of the original bytes; re-encode: CPU per image; train/eval/whole: window-decoder CPU per image "
          "(1 thread, time.process_time, median of interleaved rounds), original (orig) vs re-encoded (rst; "
          "noidx: re-encoded with the index removed, so decoded from the top: what the re-encode alone gains); "
          "speed-up: orig / rst; MCUs: mean share of the image's MCUs entropy-decoded per window")


if __name__ == "__main__":
    main()
