"""fastload.vision: crop/flip parameters, CPU and DALI presets, parity, bad input."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats.ragged import Ragged
from fastload.run import RunContext
from fastload.vision import (
    CorruptImageError,
    ImagePreset,
    center_crop,
    center_window,
    dali_available,
    eval_preset,
    random_flips,
    random_resized_crop,
    random_window,
    train_preset,
)
from fastload.vision.cpu_decode import decode_windows

Image = pytest.importorskip("PIL.Image")

needs_dali = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Parity tolerance, DALI vs the CPU decoder (0..255 units): both decode with libjpeg-turbo
# and resize with an antialiased linear filter; rounding differs.
MEAN_ABS_TOL = 1.5
MIXED_MEAN_ABS_TOL = 3.0  # nvJPEG's IDCT/upsampling differs a little more from libjpeg-turbo


def encode(h: int, w: int, *, mode: str = "RGB", fmt: str = "JPEG", seed: int = 0) -> bytes:
    """A smooth random image (JPEG q90 / PNG) in `mode`."""
    rng = np.random.default_rng(seed)
    low = (rng.random((h // 16 + 2, w // 16 + 2, 3)) * 255).astype(np.uint8)
    im = Image.fromarray(low).resize((w, h), Image.BICUBIC).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def solid(h: int, w: int, rgb: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    shapes = [
        (120, 90),
        (64, 64),
        (200, 150),
        (75, 130),
        (96, 128),
        (150, 100),
        (90, 160),
        (130, 120),
    ]
    out = [encode(h, w, seed=i) for i, (h, w) in enumerate(shapes)]
    out += [
        encode(80, 60, mode="L", seed=20),  # grayscale JPEG
        encode(70, 90, mode="CMYK", seed=21),  # CMYK JPEG
        encode(66, 88, mode="RGBA", fmt="PNG", seed=22),  # PNG with alpha
        encode(40, 30, seed=23),  # smaller than the crop
    ]
    return out


def make_batch(items: list[bytes], indices: list[int] | None = None) -> dict:
    batch = {
        "image": Ragged.from_list(items, kind="image"),
        "label": np.arange(len(items), dtype=np.int64) * 10,
    }
    if indices is not None:
        batch["__indices__"] = np.asarray(indices, dtype=np.int64)
    return batch


# -- parameters ------------------------------------------------------------------------------


def test_random_crop_params_depend_only_on_seed_epoch_index() -> None:
    sizes = np.array([[375, 500]] * 6 + [[100, 30]] * 2)
    idx = np.arange(100, 108)
    a = random_resized_crop(sizes, seed=3, epoch=1, indices=idx)
    b = random_resized_crop(sizes[::-1], seed=3, epoch=1, indices=idx[::-1])[::-1]
    np.testing.assert_array_equal(a, b)  # batch order / composition does not matter
    assert not np.array_equal(a, random_resized_crop(sizes, seed=3, epoch=2, indices=idx))
    assert not np.array_equal(a, random_resized_crop(sizes, seed=4, epoch=1, indices=idx))
    y0, x0, h, w = a.T
    assert (y0 >= 0).all() and (x0 >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (y0 + h <= sizes[:, 0]).all() and (x0 + w <= sizes[:, 1]).all()


def test_random_crop_scale_and_ratio_ranges() -> None:
    sizes = np.array([[375, 500]] * 2000)
    win = random_resized_crop(sizes, seed=0, epoch=0, indices=np.arange(2000), scale=(0.2, 0.9))
    frac = win[:, 2] * win[:, 3] / (375 * 500)
    assert frac.min() > 0.18 and frac.max() < 0.92
    assert 0.45 < np.median(frac) < 0.65
    aspect = win[:, 3] / win[:, 2]
    assert aspect.min() > 0.7 and aspect.max() < 1.4
    flips = random_flips(seed=0, epoch=0, indices=np.arange(2000))
    assert 0.45 < flips.mean() < 0.55


def test_eval_window_is_resize_then_center_crop() -> None:
    # Shorter side 375 -> 256 (224 / 0.875): the 224 centre crop covers 328 source pixels.
    win = center_crop(np.array([[375, 500], [500, 375], [224, 224]]), size=224)
    np.testing.assert_array_equal(win[0], [24, 86, 328, 328])
    np.testing.assert_array_equal(win[1], [86, 24, 328, 328])
    np.testing.assert_array_equal(win[2], [14, 14, 196, 196])


# -- CPU preset --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_preset_shapes_dtypes(images: list[bytes], layout: str, dtype: torch.dtype) -> None:
    preset = ImagePreset(
        kind="train",
        size=(48, 40),
        backend="cpu",
        layout=layout,
        dtype=dtype,
        threads=2,
    )
    out = preset(make_batch(images, list(range(len(images)))))
    shape = (len(images), 3, 48, 40) if layout == "NCHW" else (len(images), 48, 40, 3)
    assert out["image"].shape == shape and out["image"].dtype == dtype
    assert torch.isfinite(out["image"].float()).all()
    assert out["label"].tolist() == [10 * i for i in range(len(images))]  # untouched


def test_normalisation_values() -> None:
    mean, std = (100.0, 110.0, 120.0), (50.0, 55.0, 60.0)
    preset = eval_preset(size=16, backend="cpu", mean=mean, std=std, dtype=torch.float32)
    out = preset(make_batch([solid(40, 30, (200, 10, 120))]))["image"][0]
    expected = (torch.tensor([200.0, 10.0, 120.0]) - torch.tensor(mean)) / torch.tensor(std)
    torch.testing.assert_close(out, expected.view(3, 1, 1).expand(3, 16, 16))


def test_uint8_output_and_deferred_normalize(images: list[bytes]) -> None:
    raw = eval_preset(size=32, backend="cpu", normalize=False)
    full = eval_preset(size=32, backend="cpu", dtype=torch.float32)
    batch = make_batch(images)
    u8 = raw(batch)["image"]
    assert u8.shape == (len(images), 32, 32, 3) and u8.dtype == torch.uint8
    torch.testing.assert_close(raw.normalize(u8).float(), full(batch)["image"], atol=1e-2, rtol=0)


def test_flip_mirrors_the_same_crop(images: list[bytes]) -> None:
    batch = make_batch(images, list(range(len(images))))
    plain = train_preset(size=32, backend="cpu", normalize=False, flip_p=0.0, seed=7)(batch)["image"]
    flipped = train_preset(size=32, backend="cpu", normalize=False, flip_p=1.0, seed=7)(batch)["image"]
    torch.testing.assert_close(flipped, plain.flip(2))


def test_odd_images_come_out_rgb(images: list[bytes]) -> None:
    preset = eval_preset(size=32, backend="cpu", normalize=False)
    out = preset(make_batch(images[-4:]))["image"]
    assert out.shape == (4, 32, 32, 3)
    gray = out[0].int()
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
    assert out[3].float().std() > 1  # a 40x30 image upscaled to 32x32 is not blank


def test_resume_is_exact_whatever_the_batch(images: list[bytes]) -> None:
    preset = train_preset(size=32, backend="cpu", seed=5)
    preset.set_epoch(3)
    whole = preset(make_batch(images, list(range(len(images)))))["image"]
    fresh = pickle.loads(pickle.dumps(preset))  # e.g. a restarted worker
    part = fresh(make_batch(images[4:7], [4, 5, 6]))["image"]
    torch.testing.assert_close(part, whole[4:7], atol=0, rtol=0)
    moved = fresh(dict(make_batch(images[4:7], [4, 5, 6]), __epoch__=4))["image"]
    assert not torch.equal(moved, part)


def test_dct_downscale_decodes_at_num_over_8() -> None:
    """dct_downscale: the pixels of a num/8-scale decode (simplejpeg), window rounded to the scaled
    grid, resized; and close to the full-size pipeline on a smooth photo-like image."""
    import simplejpeg

    from fastload.vision.cpu_decode import dct_nums, scaled_windows

    big = [encode(480, 640, seed=30), encode(400, 300, seed=31), encode(333, 517, seed=32)]
    sizes = np.array([[480, 640], [400, 300], [333, 517]])
    kw = {"kind": "train", "size": 64, "backend": "cpu", "normalize": False, "seed": 3}
    fast = ImagePreset(dct_downscale=True, **kw)(make_batch(big, [0, 1, 2]))["image"]
    windows = random_resized_crop(sizes, seed=3, epoch=0, indices=np.arange(3))
    flips = random_flips(seed=3, epoch=0, indices=np.arange(3))
    nums = dct_nums(windows, (64, 64))
    assert (nums < 8).any()
    for i, (num, (y0, x0, h, w)) in enumerate(zip(nums, scaled_windows(sizes, windows, nums), strict=True)):
        H, W = sizes[i]
        img = simplejpeg.decode_jpeg(big[i], min_height=-(-H * num // 8), min_width=-(-W * num // 8), min_factor=1)
        assert img.shape[:2] == (-(-H * num // 8), -(-W * num // 8))
        crop = torch.from_numpy(np.ascontiguousarray(img[y0 : y0 + h, x0 : x0 + w])).permute(2, 0, 1)[None]
        ref = torch.nn.functional.interpolate(crop, size=(64, 64), mode="bilinear", antialias=True)[0]
        ref = ref.permute(1, 2, 0)
        torch.testing.assert_close(fast[i], ref.flip(1) if flips[i] else ref, atol=0, rtol=0)
    yy, xx = np.mgrid[0:480, 0:640]
    smooth = np.stack([128 + 100 * np.sin(yy / 40 + c) * np.cos(xx / 55) for c in range(3)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(smooth).save(buf, format="JPEG", quality=90)
    one = make_batch([buf.getvalue()], [0])
    a = ImagePreset(dct_downscale=True, **kw)(one)["image"].float()
    b = ImagePreset(**kw)(one)["image"].float()
    assert (a - b).abs().mean() < 2.0  # sub-pixel window rounding + the DCT's filter


def _reference_resize(buf: bytes, window: np.ndarray, out_hw: tuple[int, int]) -> torch.Tensor:
    """Full decode, crop, `F.interpolate(antialias=True)`: (H, W, 3) uint8."""
    import simplejpeg

    y0, x0, h, w = (int(v) for v in window)
    crop = simplejpeg.decode_jpeg(buf, colorspace="RGB")[y0 : y0 + h, x0 : x0 + w]
    x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).unsqueeze(0)
    y = torch.nn.functional.interpolate(x, size=out_hw, mode="bilinear", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0)


# The DCT-scaled train path's bound against the reference: full-size decode + crop of the same
# (grid-aligned) window + antialiased bilinear resize + flip; per image, 0..255 units.
DCT_MAX_MEAN_ABS = 1.5
DCT_MIN_PSNR_DB = 40.0


def test_dct_windows_align_without_losing_the_output_size() -> None:
    """On 20,000 random RandomResizedCrop windows of random image sizes: aligned windows lie in
    the image, decode at num/8 to exactly the scaled window of the sampled one (alignment changes
    nothing the decoder sees), that scaled window is never below the output, and num is the
    smallest power-of-two scale whose exact window (w * num / 8) is still at least the output."""
    from fastload.vision.cpu_decode import dct_nums, dct_windows, scaled_windows

    rng = np.random.default_rng(11)
    sizes = rng.integers(16, 3000, (20000, 2))
    out = (96, 64)
    sampled = random_resized_crop(sizes, seed=1, epoch=0, indices=np.arange(len(sizes)))
    aligned, nums = dct_windows(sizes, sampled, out)
    assert (aligned[:, :2] >= 0).all() and (aligned[:, 2:] >= 1).all()
    assert (aligned[:, :2] + aligned[:, 2:] <= sizes).all()
    np.testing.assert_array_equal(scaled_windows(sizes, aligned, nums), scaled_windows(sizes, sampled, nums))
    scaled = scaled_windows(sizes, sampled, nums)[nums < 8]
    assert (scaled[:, 2] >= out[0]).all() and (scaled[:, 3] >= out[1]).all()
    coarser = nums // 2  # the window at the next coarser scale is below the output (or there is none)
    assert ((sampled[:, 2] * coarser < 8 * out[0]) | (sampled[:, 3] * coarser < 8 * out[1]) | (nums == 1)).all()
    assert set(np.unique(dct_nums(sampled, out)).tolist()) == {1, 2, 4, 8}


def test_dct_downscale_tolerance() -> None:
    """Train default: windows >= 2x the output decode at 1/2, 1/4 (1/8) scale, aligned to that grid
    (each edge within 4/num pixels of the sampled one) and within the documented bound of the
    full-size reference; smaller windows are pixel-identical to it; stats count each mode."""
    from fastload.vision.cpu_decode import dct_windows

    rng = np.random.default_rng(7)
    items = [encode(480, 640, seed=90 + i) for i in range(6)]
    for i in range(2):  # photo grain on top of a smooth image
        base = np.asarray(Image.open(io.BytesIO(encode(480, 640, seed=96 + i))), dtype=np.int16)
        buf = io.BytesIO()
        Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)).save(
            buf, format="JPEG", quality=90
        )
        items.append(buf.getvalue())
    n, idx = len(items), list(range(500, 500 + len(items)))
    sizes = np.tile([480, 640], (n, 1))
    preset = train_preset(size=96, backend="cpu", normalize=False, seed=5, threads=2)
    got = preset(make_batch(items, idx))["image"]
    sampled = random_resized_crop(sizes, seed=5, epoch=0, indices=np.array(idx))
    flips = random_flips(seed=5, epoch=0, indices=np.array(idx))
    windows, nums = dct_windows(sizes, sampled, (96, 96))
    assert {2, 4, 8} <= set(nums.tolist())
    edges = np.concatenate(
        [windows[:, :2] - sampled[:, :2], windows[:, :2] + windows[:, 2:] - sampled[:, :2] - sampled[:, 2:]], 1
    )
    assert (np.abs(edges) <= (4 // nums)[:, None]).all() and (windows[nums == 8] == sampled[nums == 8]).all()
    for i in range(n):
        ref = _reference_resize(items[i], windows[i], (96, 96))
        ref = ref.flip(1) if flips[i] else ref
        if nums[i] == 8:
            torch.testing.assert_close(got[i], ref, atol=0, rtol=0)
            continue
        d = got[i].float() - ref.float()
        mae, psnr = d.abs().mean().item(), 10 * np.log10(255**2 / (d**2).mean().item())
        assert mae <= DCT_MAX_MEAN_ABS and psnr >= DCT_MIN_PSNR_DB, (i, int(nums[i]), mae, psnr)
    modes = preset.stats()["vision_decode_modes"]
    assert modes == {
        m: int((nums == k).sum()) for k, m in ((8, "window"), (4, "window 1/2"), (2, "window 1/4")) if (nums == k).any()
    }
    assert preset.describe()["decode_modes"] == ["window", "window 1/2", "window 1/4", "window 1/8"]
    assert eval_preset(backend="cpu").describe()["decode_modes"] == ["window"]  # eval: pixel-identical


def test_resize_into_matches_interpolate_for_any_target_strides() -> None:
    from fastload.vision.cpu_decode import crop_resize, decode_rgb, resize_into

    buf = encode(150, 200, seed=40)
    img = decode_rgb(buf)
    window = np.array([10, 25, 120, 130])
    ref = _reference_resize(buf, window, (48, 40))
    hwc = torch.empty((48, 40, 3), dtype=torch.uint8)  # contiguous = channels-last
    resize_into(img, window, hwc)
    torch.testing.assert_close(hwc, ref, atol=0, rtol=0)
    planar = torch.empty((3, 48, 40), dtype=torch.uint8)  # a strided (CHW-backed) target
    resize_into(img, window, planar.permute(1, 2, 0))
    torch.testing.assert_close(planar.permute(1, 2, 0), ref, atol=0, rtol=0)
    batch = torch.zeros((3, 48, 40, 3), dtype=torch.uint8)  # one slot of a batch, others untouched
    resize_into(img, window, batch[1])
    torch.testing.assert_close(batch[1], ref, atol=0, rtol=0)
    assert not batch[0].any() and not batch[2].any()
    np.testing.assert_array_equal(crop_resize(img, window, (48, 40)), ref.numpy())
    same = torch.empty((20, 30, 3), dtype=torch.uint8)  # window already the output size: a copy
    resize_into(img, np.array([5, 6, 20, 30]), same)
    np.testing.assert_array_equal(same.numpy(), img[5:25, 6:36])


@pytest.mark.parametrize("kind", ["eval", "train"])
def test_cpu_preset_pixels_match_reference(kind: str) -> None:
    """uint8 output (resized straight into the batch, or via the scratch when flipped) and
    fp16 output (LUT) against decode -> crop -> F.interpolate -> flip -> (x - mean) / std, at full
    decode scale (the DCT-scaled train default has its own bound: test_dct_downscale_tolerance)."""
    items = [encode(120 + 10 * i, 160 - 7 * i, seed=50 + i) for i in range(8)]
    idx = list(range(200, 208))
    kw = {"kind": kind, "size": (40, 48), "backend": "cpu", "threads": 2, "seed": 11, "flip_p": 0.5}
    kw["dct_downscale"] = False
    u8 = ImagePreset(normalize=False, **kw)(make_batch(items, idx))["image"]
    fp16 = ImagePreset(layout="NCHW", **kw)(make_batch(items, idx))["image"]
    nhwc = ImagePreset(layout="NHWC", **kw)(make_batch(items, idx))["image"]
    sizes = np.array([[120 + 10 * i, 160 - 7 * i] for i in range(8)])
    if kind == "train":
        windows = random_resized_crop(sizes, seed=11, epoch=0, indices=np.array(idx))
    else:
        windows = center_crop(sizes, size=(40, 48))
    flips = random_flips(seed=11, epoch=0, indices=np.array(idx), p=0.5)
    assert 0 < flips.sum() < 8  # both paths are exercised
    mean = torch.tensor([0.485, 0.456, 0.406]) * 255
    std = torch.tensor([0.229, 0.224, 0.225]) * 255
    for i in range(8):
        ref = _reference_resize(items[i], windows[i], (40, 48))
        if flips[i]:
            ref = ref.flip(1)
        torch.testing.assert_close(u8[i], ref, atol=0, rtol=0)
        norm = ((ref.float() - mean) / std).to(torch.float16)
        torch.testing.assert_close(nhwc[i], norm, atol=0, rtol=0)
        torch.testing.assert_close(fp16[i], norm.permute(2, 0, 1), atol=0, rtol=0)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", pytest.param("dali", marks=needs_dali)])
@pytest.mark.parametrize("bad", [b"not an image at all", b"", "truncated"])
def test_corrupt_sample_is_named(images: list[bytes], backend: str, bad: bytes | str) -> None:
    if bad == "truncated":
        bad = images[0][: len(images[0]) // 3]
    items = [images[0], bad, images[1]]
    preset = eval_preset(size=32, backend=backend)
    with pytest.raises(CorruptImageError, match=r"sample 17\b") as err:
        preset(make_batch(items, [16, 17, 18]))
    assert err.value.index == 17
    with pytest.raises(CorruptImageError, match="position 1 in the batch"):
        preset(make_batch(items))
    assert preset(make_batch(images[:2], [0, 1]))["image"].shape[0] == 2  # recovers


@pytest.mark.parametrize("backend", ["cpu", pytest.param("dali", marks=needs_dali)])
def test_skip_drops_and_counts(images: list[bytes], backend: str) -> None:
    preset = eval_preset(size=32, backend=backend, on_error="skip")
    items = [images[0], b"garbage", images[1], images[2][:200]]
    out = preset(make_batch(items, [5, 6, 7, 8]))
    assert out["image"].shape[0] == 2
    assert out["label"].tolist() == [0, 20]
    assert out["__indices__"].tolist() == [5, 7]
    stats = preset.stats()
    assert stats["vision_skipped"] == 2 and stats["vision_images"] == 2
    assert stats["vision_backend"] == ("cpu" if backend == "cpu" else "dali-cpu")


def test_dali_missing_falls_back_with_a_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fastload.vision.preset_options as options_mod

    monkeypatch.setattr(options_mod, "dali_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="DALI is not installed"):
        preset = ImagePreset(backend="dali")
    assert preset.backend == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ImagePreset(backend="auto").backend == "cpu"  # CPU-only: no warning needed


def test_import_does_not_import_dali() -> None:
    code = "import sys, fastload, fastload.vision; print('nvidia.dali' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


# -- DALI parity -------------------------------------------------------------------------------


def _mean_abs_255(a: torch.Tensor, b: torch.Tensor, std: float = 58.0) -> torch.Tensor:
    return (a.float() - b.float()).abs().mul(std).mean(dim=(1, 2, 3))


@needs_dali
@pytest.mark.parametrize("kind", ["eval", "train"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_dali_cpu_matches_cpu_decoder(images: list[bytes], kind: str, layout: str) -> None:
    batch = make_batch(images, list(range(100, 100 + len(images))))
    kw = {"kind": kind, "size": 48, "layout": layout, "std": (58.0,) * 3, "seed": 1}
    cpu = ImagePreset(backend="cpu", **kw)(batch)["image"]
    dali_preset = ImagePreset(backend="dali", threads=2, **kw)
    assert dali_preset.backend == "dali-cpu"
    dali = dali_preset(batch)["image"]
    assert dali.shape == cpu.shape and dali.dtype == cpu.dtype == torch.float16
    diff = _mean_abs_255(cpu, dali)
    assert diff.max() <= MEAN_ABS_TOL, diff


@needs_dali
def test_dali_cpu_fp16_is_its_fp32_rounded(images: list[bytes]) -> None:
    # On the CPU the pipeline normalises to float32 and torch rounds to fp16.
    batch = make_batch(images, list(range(len(images))))
    kw = {"kind": "train", "size": 40, "backend": "dali", "threads": 2, "seed": 4}
    half = ImagePreset(**kw)(batch)["image"]
    full = ImagePreset(dtype=torch.float32, **kw)(batch)["image"]
    assert half.dtype == torch.float16 and full.dtype == torch.float32
    torch.testing.assert_close(half, full.to(torch.float16), atol=0, rtol=0)


@needs_dali
def test_dali_cpu_roi_decode_matches_full_decode_crop() -> None:
    # decoders.image_slice decodes only the window: the same pixels as decoding the whole
    # image and cropping (the resize to the window's own size is the identity).
    import simplejpeg

    from fastload.vision.dali_pipeline import DaliRunner

    items = [np.frombuffer(encode(150, 200, seed=60 + i), dtype=np.uint8) for i in range(2)]
    windows = np.array([[17, 33, 96, 80], [40, 8, 96, 80]])
    runner = DaliRunner(
        mode="cpu",
        out_hw=(96, 80),
        mean=(0.0,) * 3,
        std=(1.0,) * 3,
        layout="NHWC",
        dtype=torch.float16,
        normalize=False,
        threads=2,
        device_id=None,
    )
    out = runner.run(items, windows, np.array([False, True]))
    for i, (y0, x0, h, w) in enumerate(windows):
        ref = simplejpeg.decode_jpeg(items[i].tobytes(), colorspace="RGB")[y0 : y0 + h, x0 : x0 + w]
        ref = torch.from_numpy(np.ascontiguousarray(ref))
        torch.testing.assert_close(out[i], ref.flip(1) if i == 1 else ref, atol=0, rtol=0)


@needs_dali
def test_dali_uint8_and_bf16(images: list[bytes]) -> None:
    batch = make_batch(images[:4], [0, 1, 2, 3])
    u8 = eval_preset(size=24, backend="dali", normalize=False)(batch)["image"]
    assert u8.shape == (4, 24, 24, 3) and u8.dtype == torch.uint8
    bf = eval_preset(size=24, backend="dali", dtype=torch.bfloat16)(batch)["image"]
    assert bf.shape == (4, 3, 24, 24) and bf.dtype == torch.bfloat16


@needs_dali
@pytest.mark.parametrize("normalize", [True, False])
def test_mixed_pipeline_graph_validates_without_cuda(normalize: bool) -> None:
    """The nvJPEG pipeline a CUDA preset runs, defined and serialized without a device: DALI's
    front end checks its operators and arguments (it cannot be built here)."""
    preset = train_preset(size=48, backend="dali", device="cuda", normalize=normalize)
    assert preset.backend == "dali-mixed" and "nvJPEG" in preset.describe()["decoder"]
    graph = preset.dali_graph()
    assert b"decoders__ImageSlice" in graph and b"mixed" in graph
    assert (b"CropMirrorNormalize" if normalize else b"horizontal") in graph
    with pytest.raises(ValueError, match="not DALI"):
        train_preset(backend="cpu").dali_graph()


@needs_dali
@needs_cuda
@pytest.mark.parametrize("kind", ["eval", "train"])
def test_mixed_decode_matches_cpu(images: list[bytes], kind: str) -> None:
    batch = make_batch(images, list(range(len(images))))
    kw = {"kind": kind, "size": 48, "std": (58.0,) * 3}
    gpu = ImagePreset(backend="dali", device="cuda", **kw)
    assert gpu.backend == "dali-mixed"
    out = gpu(batch)["image"]
    assert out.is_cuda and out.dtype == torch.float16
    cpu = ImagePreset(backend="cpu", **kw)(batch)["image"]
    assert _mean_abs_255(out.cpu(), cpu).max() <= MIXED_MEAN_ABS_TOL


# -- collate path, and the real format + Loader -----------------------------------------------------


def test_collate_fn_path_with_sample_dicts(images: list[bytes]) -> None:
    samples = [{"image": img, "label": i, "__index__": 40 + i} for i, img in enumerate(images[:5])]
    preset = train_preset(size=32, backend="cpu", seed=2)
    out = preset(samples)
    assert out["image"].shape == (5, 3, 32, 32)
    assert out["label"].tolist() == [0, 1, 2, 3, 4] and out["__index__"].tolist() == [
        40,
        41,
        42,
        43,
        44,
    ]
    columnar = preset(make_batch(images[:5], [40, 41, 42, 43, 44]))["image"]
    torch.testing.assert_close(out["image"], columnar, atol=0, rtol=0)
    # the Loader's batch-view protocol: as a collate_fn it gets the images as one Ragged, here a
    # view into a larger values buffer (offsets not starting at 0)
    assert ImagePreset.accepts_batch_views is True
    packed = Ragged.from_list([b"junk", *images[:5], b"more"], kind="image")
    view = Ragged(values=packed.values, offsets=packed.offsets[1:-1], kind="image")
    batch = {"image": view, "label": np.arange(5), "__indices__": np.arange(40, 45)}
    torch.testing.assert_close(preset(batch)["image"], columnar, atol=0, rtol=0)


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory: pytest.TempPathFactory, images: list[bytes]):
    from fastload.formats import FastloadDataset, Field, Schema, write

    root = tmp_path_factory.mktemp("imgds")
    schema = Schema([Field("image", "image"), Field("label", "scalar", np.int64)])
    samples = [{"image": images[i % len(images)], "label": i} for i in range(24)]
    write(samples, root, schema=schema, progress=False, workers=1)
    return FastloadDataset(root)


def test_loader_order_resume_and_stats(image_dataset) -> None:
    Loader = pytest.importorskip("fastload.loader").Loader
    from fastload.vision import with_indices

    ds = with_indices(image_dataset)

    def loader() -> Loader:
        preset = train_preset(size=32, backend="cpu", seed=9)
        return Loader(ds, batch_size=5, shuffle=True, seed=3, transform=preset, num_workers=2)

    ref = loader()
    batches = list(ref)
    assert [b["image"].shape for b in batches] == [(5, 3, 32, 32)] * 4 + [(4, 3, 32, 32)]
    assert sorted(torch.cat([b["label"] for b in batches]).tolist()) == list(range(24))
    torch.testing.assert_close(batches[0]["label"], batches[0]["__indices__"])
    preset_stats = ref.stats()["components"]["transform"]
    assert preset_stats["vision_images"] == 24
    modes = preset_stats["vision_decode_modes"]  # the images, JPEG or not, by how each was decoded
    assert sum(modes.values()) == 24 and modes.get("window", 0) > 0 and "whole image" in modes

    first = loader()
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    again = loader()
    again.load_state_dict(state)
    rest = list(again)
    for a, b in zip(rest, batches[2:], strict=True):
        torch.testing.assert_close(a["image"], b["image"], atol=0, rtol=0)
        torch.testing.assert_close(a["label"], b["label"])
    assert ref.stats()["components"]["transform"]["vision_threads"] == 1  # the Loader's 2 workers: the parallelism


def test_loader_describe_shows_the_preset(image_dataset) -> None:
    """`loader.describe()["components"]` holds the preset's settings, as `transform=` or as a
    views `collate_fn=`, with the Loader's run bound (threads, seed rule)."""
    Loader = pytest.importorskip("fastload.loader").Loader
    from fastload.vision import with_indices

    preset = train_preset(size=32, backend="cpu")
    loader = Loader(with_indices(image_dataset), batch_size=5, transform=preset, num_workers=2)
    next(iter(loader))
    desc = loader.describe()["components"]["transform"]
    assert desc == preset.describe()
    assert (desc["stage"], desc["kind"], desc["size"], desc["backend"]) == ("ImagePreset", "train", (32, 32), "cpu")
    assert desc["threads"] == 1 and "num_workers=2" in desc["threads_rule"]
    assert desc["seed"] == "the Loader's run seed"
    assert desc["crop"] == {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), "flip_p": 0.5}
    assert (desc["restart_path"] is not None) == (decode_windows is not None)
    as_collate = eval_preset(size=32, backend="cpu", resize=None, seed=4)
    loader = Loader(with_indices(image_dataset), batch_size=5, collate_fn=as_collate)
    desc = loader.describe()["components"]["collate_fn"]
    assert (desc["kind"], desc["resize"], desc["seed"]) == ("eval", None, "seed=4")
    assert desc["crop"] == {"crop_fraction": None, "flip_p": 0.0}
    assert "transform" not in loader.describe()["components"]


# -- window decode (the _jpegwin extension) ----------------------------------------------------

needs_window_decoder = pytest.mark.skipif(
    decode_windows is None, reason="fastload.vision._jpegwin not built (libjpeg-turbo headers missing)"
)


def test_window_decoder_is_built_in_ci() -> None:
    """CI installs libjpeg62-turbo-dev (.ci/run): there the extensions must exist, not be skipped
    (setup.py installs without them where they cannot build)."""
    if os.environ.get("CI"):
        from fastload.vision import normalize

        assert decode_windows is not None and normalize._lut_apply is not None


def _jpeg_variants() -> list[bytes]:
    """4:2:0, 4:4:4, 4:2:2, progressive, grayscale, odd sizes (partial iMCUs at the edges)."""
    rng = np.random.default_rng(60)
    yy, xx = np.mgrid[0:77, 0:113]
    base = np.stack([(yy * 3 + xx * c) % 256 for c in (1, 2, 5)], -1).astype(np.int16)
    rgb = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    out = []
    for kw, mode in [
        ({"subsampling": 2}, "RGB"),
        ({"subsampling": 0}, "RGB"),
        ({"subsampling": 1}, "RGB"),
        ({"subsampling": 2, "progressive": True}, "RGB"),
        ({}, "L"),
    ]:
        buf = io.BytesIO()
        Image.fromarray(rgb).convert(mode).save(buf, format="JPEG", quality=90, **kw)
        out.append(buf.getvalue())
    return out


def _decode_into(bufs: list[bytes], params: np.ndarray, shapes: list[tuple[int, int]]):
    """`decode_windows` over a batch view of `bufs`, rows (src, y0, x0, h, w, num, flip), each window into its own
    part of one output buffer: (failures, the per-row outputs)."""
    from fastload.vision.cpu_decode import batch_view

    values, offsets = batch_view(bufs)
    at = np.concatenate([[0], np.cumsum([h * w * 3 for h, w in shapes])])
    out = np.zeros(int(at[-1]), dtype=np.uint8)
    rows = np.concatenate([params, at[:-1, None]], axis=1).astype(np.int64)
    failures = decode_windows(values, offsets, rows, out)
    return failures, [out[a:b].reshape(h, w, 3) for a, b, (h, w) in zip(at[:-1], at[1:], shapes, strict=True)]


@needs_window_decoder
def test_window_decode_is_full_decode_then_crop() -> None:
    """Any window, mirrored or not, at any num/8 scale: pixel-identical to simplejpeg's decode at
    that scale, cropped (the documented tolerance is zero)."""
    import simplejpeg

    rng = np.random.default_rng(61)
    for buf in _jpeg_variants():
        H, W = simplejpeg.decode_jpeg_header(buf)[:2]
        for num in (8, 7, 5, 4, 2, 1):
            sh, sw = -(-H * num // 8), -(-W * num // 8)
            ref = simplejpeg.decode_jpeg(buf, colorspace="RGB", min_height=sh, min_width=sw, min_factor=1)
            assert ref.shape[:2] == (sh, sw)
            corners = [(0, 0, sh, sw), (sh - 1, sw - 1, 1, 1), (0, sw - 1, sh, 1), (sh - 1, 0, 1, sw)]
            rand = []
            for _ in range(12):
                h, w = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
                rand.append((int(rng.integers(0, sh - h + 1)), int(rng.integers(0, sw - w + 1)), h, w))
            windows = corners + rand
            flips = rng.integers(0, 2, len(windows))
            # every window reads source 1 of a 3-image view: offsets not starting at 0 are honoured
            params = np.array([[1, *win, num, f] for win, f in zip(windows, flips, strict=True)], dtype=np.int64)
            failures, outs = _decode_into([b"x", buf, b"y"], params, [(h, w) for _, _, h, w in windows])
            assert failures == []
            for (y0, x0, h, w), f, out in zip(windows, flips, outs, strict=True):
                want = ref[y0 : y0 + h, x0 : x0 + w]
                np.testing.assert_array_equal(out, want[:, ::-1] if f else want)


@needs_window_decoder
def test_window_decode_errors() -> None:
    from fastload.vision.cpu_decode import batch_view, decode_rgb

    good = encode(60, 80, seed=62)
    cmyk = encode(40, 40, mode="CMYK", seed=63)
    truncated = good[: len(good) // 2]
    params = np.array([[i, 0, 0, 20, 20, 8, 0] for i in range(4)] + [[4, 50, 70, 20, 20, 8, 0]], dtype=np.int64)
    failures, outs = _decode_into([good, truncated, b"\xff\xd8\xff" + b"\x00" * 50, cmyk, good], params, [(20, 20)] * 5)
    got = {row: (code, msg) for row, code, msg in failures}
    assert set(got) == {1, 2, 3, 4}  # row 0 decoded, the others left intact
    np.testing.assert_array_equal(outs[0], decode_rgb(good)[:20, :20])
    assert not any(o.any() for o in outs[1:])
    assert got[1][0] == 1 and "JPEG" in got[1][1]  # a premature end is an error, not grey rows
    assert got[2][0] == 1
    assert got[3][0] == 2  # CMYK: left to Pillow
    assert got[4][0] == 1 and "outside" in got[4][1]
    values, offsets = batch_view([good])
    row = np.array([[0, 0, 0, 20, 20, 8, 0, 0]], dtype=np.int64)
    with pytest.raises(ValueError, match="outside"):  # the output buffer is too small for the window
        decode_windows(values, offsets, row, np.zeros(20 * 20 * 3 - 1, dtype=np.uint8))
    with pytest.raises(ValueError, match="outside"):
        decode_windows(values, offsets, row + [[0, 0, 0, 0, 0, 0, 0, 1]], np.zeros(20 * 20 * 3, dtype=np.uint8))
    with pytest.raises(ValueError, match="num"):
        decode_windows(values, offsets, row + [[0, 0, 0, 0, 0, 1, 0, 0]], np.zeros(1200, dtype=np.uint8))
    with pytest.raises(ValueError, match="source"):
        decode_windows(values, offsets, row + [[1, 0, 0, 0, 0, 0, 0, 0]], np.zeros(1200, dtype=np.uint8))
    with pytest.raises(ValueError, match="rows"):
        decode_windows(values, offsets, row[:, :7], np.zeros(1200, dtype=np.uint8))
    with pytest.raises(ValueError, match="offsets"):  # past the values' end
        decode_windows(values, offsets + [0, 1], row, np.zeros(1200, dtype=np.uint8))
    with pytest.raises(ValueError, match="offsets"):
        decode_windows(values, np.array([0, 9, 3], dtype=np.int64), row, np.zeros(1200, dtype=np.uint8))
    with pytest.raises((BufferError, TypeError, ValueError)):  # a read-only output
        decode_windows(values, offsets, row, bytes(1200))


@needs_window_decoder
def test_header_sizes_of_a_batch_view() -> None:
    """`probe_sizes` reads JPEG headers in C, others (and headers libjpeg rejects) in Python: the same
    sizes, the JPEG signature flags, and a named error for a non-image."""
    from fastload.vision.cpu_decode import batch_view, probe_size, probe_sizes

    bufs = [encode(37, 51, seed=1), encode(20, 30, fmt="PNG", seed=2), b"", b"\xff\xd8\xff\x00", encode(9, 7, seed=3)]
    values, offsets = batch_view(Ragged.from_list(bufs, kind="image"))
    sizes, jpeg, errors = probe_sizes(values, offsets)
    assert sizes[[0, 1, 4]].tolist() == [list(probe_size(bufs[i])) for i in (0, 1, 4)] == [[37, 51], [20, 30], [9, 7]]
    assert jpeg.tolist() == [True, False, False, True, True]
    assert set(errors) == {2, 3} and "empty" in errors[2]


@needs_window_decoder
@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 4000), flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 255)), max_size=4))
def test_damaged_jpegs_fail_by_name_never_crash(cut: int, flips: list[tuple[int, int]]) -> None:
    """A truncated or bit-flipped JPEG in a batch view: the header reader and the window decoder
    return a size or an error code (no crash, no write outside the image's own output), and the
    preset raises `CorruptImageError` naming the sample or decodes it."""
    good = encode(48, 64, seed=90)
    bad = bytearray(good[: max(3, len(good) - cut)])
    for at, x in flips:
        bad[at % len(bad)] ^= x
    preset = ImagePreset(kind="eval", size=32, resize=None, backend="cpu", normalize=False)
    batch = make_batch([good, bytes(bad), good], [7, 8, 9])
    try:
        out = preset(batch)["image"]
    except CorruptImageError as e:
        assert "sample 8" in str(e)
    else:
        assert out.shape == (3, 32, 32, 3)
    np.testing.assert_array_equal(preset.transform([good], indices=[7])[0][0].numpy(),
                                  decode_rgb_center(good, 32))


def decode_rgb_center(buf: bytes, size: int) -> np.ndarray:
    from fastload.vision.cpu_decode import decode_rgb

    img = decode_rgb(buf)
    y0, x0 = (img.shape[0] - size) // 2, (img.shape[1] - size) // 2
    return img[y0 : y0 + size, x0 : x0 + size]


def test_fallback_decoder_gives_the_same_pixels(monkeypatch: pytest.MonkeyPatch, images: list[bytes]) -> None:
    """Without the extension (or for CMYK) whole-image decode + crop: the same pixels."""
    from fastload.vision import cpu_decode

    batch = make_batch(images, list(range(len(images))))
    kw = {"kind": "train", "size": 32, "backend": "cpu", "normalize": False, "seed": 8, "dct_downscale": True}
    a = ImagePreset(**kw)(batch)["image"]
    monkeypatch.setattr(cpu_decode, "decode_windows", None)
    monkeypatch.setattr(cpu_decode, "read_sizes", None)  # headers probed in Python too
    b = ImagePreset(**kw)(batch)["image"]
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# -- crop only, layouts, threads -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eval", "train"])
def test_crop_only_is_the_window_itself(kind: str) -> None:
    import simplejpeg

    items = [encode(70 + 9 * i, 90 - 5 * i, seed=70 + i) for i in range(6)] + [encode(30, 50, seed=76)]
    idx = np.arange(300, 307)
    preset = ImagePreset(kind=kind, size=(40, 48), resize=None, backend="cpu", normalize=False, seed=4, threads=2)
    out = preset(make_batch(items, list(idx)))["image"]
    assert out.shape == (7, 40, 48, 3) and out.dtype == torch.uint8
    sizes = np.array([simplejpeg.decode_jpeg_header(b)[:2] for b in items])
    if kind == "eval":
        windows, flips = center_window(sizes, size=(40, 48)), np.zeros(7, dtype=bool)
    else:
        windows = random_window(sizes, size=(40, 48), seed=4, epoch=0, indices=idx)
        flips = random_flips(seed=4, epoch=0, indices=idx)
        assert 0 < flips.sum() < 7 and len({tuple(w[:2]) for w in windows}) > 3
    for i in range(6):
        y0, x0, h, w = windows[i]
        assert (h, w) == (40, 48)
        want = simplejpeg.decode_jpeg(items[i], colorspace="RGB")[y0 : y0 + h, x0 : x0 + w]
        np.testing.assert_array_equal(out[i].numpy(), want[:, ::-1] if flips[i] else want)
    assert windows[6][2] == 30 and out[6].float().std() > 1  # smaller than the crop: resized up to it


def test_uint8_dtype_and_layout_apply(images: list[bytes]) -> None:
    batch = make_batch(images, list(range(len(images))))
    nhwc = eval_preset(size=32, backend="cpu", normalize=False)(batch)["image"]
    as_dtype = eval_preset(size=32, backend="cpu", dtype=torch.uint8)(batch)["image"]
    nchw_preset = eval_preset(size=32, backend="cpu", dtype=torch.uint8, layout="NCHW")
    nchw = nchw_preset(batch)["image"]
    assert nhwc.shape == (len(images), 32, 32, 3) and nchw.shape == (len(images), 3, 32, 32)
    torch.testing.assert_close(as_dtype, nhwc, atol=0, rtol=0)
    torch.testing.assert_close(nchw, nhwc.permute(0, 3, 1, 2), atol=0, rtol=0)
    assert nchw.is_contiguous()
    full = eval_preset(size=32, backend="cpu", layout="NCHW")(batch)["image"]
    torch.testing.assert_close(nchw_preset.normalize(nchw), full, atol=0, rtol=0)
    with pytest.raises(ValueError, match="resize"):
        ImagePreset(resize="nearest")


def test_threads_rule_and_results_independent_of_it(images: list[bytes]) -> None:
    from fastload.system import usable_cores

    batch = make_batch(images, list(range(len(images))))
    kw = {"kind": "train", "size": 32, "backend": "cpu", "seed": 6}
    alone = ImagePreset(**kw)
    assert alone.threads == usable_cores() and alone.stats()["vision_threads_rule"] == "usable cores"
    one, three = ImagePreset(threads=1, **kw), ImagePreset(threads=3, **kw)
    assert three.threads == 3
    ref = one(batch)["image"]
    torch.testing.assert_close(three(batch)["image"], ref, atol=0, rtol=0)
    torch.testing.assert_close(alone(batch)["image"], ref, atol=0, rtol=0)
    alone.bind_run(RunContext(seed=6, epoch=0, rank=0, world_size=1, num_workers=0))  # as a Loader: one
    # thread per batch, num_workers batches at once
    assert alone.threads == 1 and "num_workers=0" in alone.stats()["vision_threads_rule"]
    desc = alone.describe()
    assert desc["threads"] == 1 and desc["threads_rule"] == alone.stats()["vision_threads_rule"]
    assert desc["backend"] == "cpu" and desc["output"] == {
        "dtype": "float16",
        "layout": "NCHW",
        "normalized": True,
        "device": "cpu",
        "memory": "blocks reused once the caller has dropped every reference to an earlier batch, else fresh ones",
    }
    torch.testing.assert_close(alone(batch)["image"], ref, atol=0, rtol=0)
    three.bind_run(RunContext(seed=6, epoch=0, rank=0, world_size=1, num_workers=4))  # an explicit threads= wins
    assert three.threads == 3
    with pytest.raises(ValueError, match="threads"):
        ImagePreset(threads=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_lut_extension_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    from fastload.vision import normalize as norm

    u8 = np.random.default_rng(80).integers(0, 256, (3, 5, 7, 3), dtype=np.uint8)
    lut = norm.ChannelLUT(mean=(10.0, 20.0, 30.0), std=(2.0, 3.0, 5.0), dtype=dtype)
    ref = ((torch.from_numpy(u8).float() - torch.tensor([10.0, 20.0, 30.0])) / torch.tensor([2.0, 3.0, 5.0])).to(dtype)
    for layout, shape in (("NCHW", (3, 3, 5, 7)), ("NHWC", (3, 5, 7, 3))):
        got = lut.empty(shape)
        lut.apply_batch(u8, got, layout=layout)
        want = ref.permute(0, 3, 1, 2) if layout == "NCHW" else ref
        torch.testing.assert_close(lut.to_tensor(got), want, atol=0, rtol=0)
        monkeypatch.setattr(norm, "_lut_apply", None)  # the numpy fallback: the same bits
        again = lut.empty(shape)
        lut.apply_batch(u8, again, layout=layout)
        np.testing.assert_array_equal(again, got)
        monkeypatch.undo()


@needs_dali
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["eval", "train"])
def test_a_dali_preset_shared_by_thread_workers_gives_the_one_thread_batches(image_dataset, kind: str) -> None:
    """Thread workers share the preset's one DALI pipeline: they take turns (running it from two
    threads at once deadlocked DALI), and every sample gets the pixels it gets with no workers."""
    Loader = pytest.importorskip("fastload.loader").Loader
    from fastload.vision import with_indices

    def epoch(workers: int) -> dict[int, torch.Tensor]:
        make = eval_preset if kind == "eval" else train_preset
        preset = make(size=32, backend="dali", seed=5)
        loader = Loader(with_indices(image_dataset), batch_size=3, transform=preset, num_workers=workers,
                        worker_type="thread", seed=1)
        return {int(i): img for b in loader for i, img in zip(b["label"], b["image"], strict=True)}

    alone = epoch(0)
    assert sorted(alone) == list(range(24))
    for _ in range(2):
        shared = epoch(2)
        assert sorted(shared) == list(range(24))
        assert all(torch.equal(shared[i], alone[i]) for i in alone)
