"""JPEG restart index: the lossless re-encode at conversion and the window decoder's restart path."""

from __future__ import annotations

import functools
import io
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats.jpeg_restart import add_restart_index, restart_index, restart_supported
from fastload.vision.cpu_decode import decode_rgb, decode_windows

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.skipif(
    decode_windows is None or not restart_supported(),
    reason="fastload.vision._jpegwin not built (libjpeg-turbo headers missing)",
)

# name -> (PIL save options, MCU row height, MCU width in image pixels)
KINDS = {
    "4:2:0": ({"subsampling": 2}, 16, 16),
    "4:2:2": ({"subsampling": 1}, 8, 16),
    "4:4:4": ({"subsampling": 0}, 8, 8),
    "gray": ({"mode": "L"}, 8, 8),
    "progressive": ({"subsampling": 2, "progressive": True}, 16, 16),
}
H0, W0 = 203, 157  # the test images' size: partial MCUs on both edges


def photo(
    h: int, w: int, *, subsampling: int = 2, mode: str = "RGB", progressive: bool = False, seed: int = 0
) -> bytes:
    """A photo-like JPEG (low-frequency noise + grain, q90)."""
    rng = np.random.default_rng(seed)
    low = (rng.random((h // 16 + 2, w // 16 + 2, 3)) * 255).astype(np.uint8)
    img = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.int16)
    img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).convert(mode).save(
        buf, format="JPEG", quality=90, subsampling=subsampling, progressive=progressive
    )
    return buf.getvalue()


def make(kind: str, h: int = H0, w: int = W0, seed: int = 0) -> bytes:
    opts = dict(KINDS[kind][0])
    return photo(h, w, seed=seed, **opts)


@functools.cache
def pair(kind: str) -> tuple[bytes, bytes]:
    """(original, re-encoded) of `kind` at an odd size (partial MCUs on both edges)."""
    return make(kind), add_restart_index(make(kind))


def index_head(buf: bytes) -> tuple[int, bytes]:
    """(position of the APP9 restart-index segment, its head: `FLRST\\0`, version, rows, [interval])."""
    (at,) = [p for p, m in markers(buf) if m == 0xE9]
    return at, buf[at + 4 : at + 4 + (10 if buf[at + 10] == 2 else 8)]


def group_width(buf: bytes, kind: str) -> int:
    """Image columns per restart interval (column group) of a re-encoded JPEG."""
    _, head = index_head(buf)
    return KINDS[kind][2] * struct.unpack(">H", head[8:10])[0]


@functools.cache
def version_1(kind: str) -> bytes:
    """The re-encoded JPEG with one restart interval per MCU row and a version 1 index (what
    conversions wrote before column groups): the head's version 1 and no interval field."""
    per_row = -(-W0 // KINDS[kind][2])
    coded = add_restart_index(make(kind), interval=per_row)
    at, head = index_head(coded)
    seg = struct.unpack(">H", coded[at + 2 : at + 4])[0]
    offsets = coded[at + 4 + len(head) : at + 2 + seg]
    index = b"FLRST\x00\x01\x01" + offsets
    return coded[:at] + b"\xff\xe9" + struct.pack(">H", 2 + len(index)) + index + coded[at + 2 + seg :]


def window(buf: bytes, y0: int, x0: int, h: int, w: int, num: int = 8, flip: bool = False) -> np.ndarray:
    """One window through `decode_windows` (asserting it decoded)."""
    out = np.zeros(h * w * 3, dtype=np.uint8)
    values = np.frombuffer(buf, dtype=np.uint8)
    offsets = np.array([0, len(buf)], dtype=np.int64)
    failures = decode_windows(values, offsets, np.array([[0, y0, x0, h, w, num, int(flip), 0]], dtype=np.int64), out)
    assert failures == []
    return out.reshape(h, w, 3)


def reference(buf: bytes, y0: int, x0: int, h: int, w: int, num: int = 8, flip: bool = False) -> np.ndarray:
    """The full decode (simplejpeg, at num/8) cropped (and mirrored)."""
    full = Image.open(io.BytesIO(buf)).size[::-1]
    crop = decode_rgb(buf, hw=full, num=num)[y0 : y0 + h, x0 : x0 + w]
    return crop[:, ::-1] if flip else crop


def markers(buf: bytes) -> list[tuple[int, int]]:
    """(position, marker byte) of every marker segment before SOS, and SOS itself."""
    found, p = [], 2
    while buf[p + 1] != 0xDA:
        found.append((p, buf[p + 1]))
        p += 2 + struct.unpack(">H", buf[p + 2 : p + 4])[0]
    return [*found, (p, 0xDA)]


def entropy_start(buf: bytes) -> int:
    p = markers(buf)[-1][0]
    return p + 2 + struct.unpack(">H", buf[p + 2 : p + 4])[0]


@pytest.mark.parametrize("kind", KINDS)
def test_reencode_is_lossless_baseline_with_restart_intervals_in_column_groups(kind: str) -> None:
    original, coded = pair(kind)
    for decode in (lambda b: np.asarray(Image.open(io.BytesIO(b)).convert("RGB")), decode_rgb):
        assert np.array_equal(decode(original), decode(coded))
    seen = dict((m, p) for p, m in reversed(markers(coded)))
    assert 0xC0 in seen and 0xC2 not in seen  # baseline, progressive input included
    found = markers(coded)
    assert found[0] == (2, 0xE0) and coded[6:11] == b"JFIF\x00"  # JFIF's APP0 stays first
    at, head = index_head(coded)
    assert found[1] == (at, 0xE9) and head[:8] == b"FLRST\x00\x02\x01"
    _, mcu_h, mcu_w = KINDS[kind]
    per_row, interval = -(-W0 // mcu_w), struct.unpack(">H", head[8:10])[0]
    assert per_row % interval == 0 and per_row // interval > 1  # equal column groups, more than one
    offsets = restart_index(coded)
    assert offsets is not None and len(offsets) == -(-H0 // mcu_h) * (per_row // interval) - 1
    start = entropy_start(coded)
    for j, off in enumerate(offsets, start=1):
        assert coded[start + off - 2 : start + off] == bytes([0xFF, 0xD0 + (j - 1) % 8])
    # every restart marker of the data is listed, none twice
    data = coded[start:]
    assert sum(data.count(bytes([0xFF, 0xD0 + k])) for k in range(8)) == len(offsets)
    assert restart_index(original) is None


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(list(KINDS)),
    num=st.sampled_from([8, 8, 4, 2, 1]),
    flip=st.booleans(),
    box=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
)
def test_window_pixels_equal_the_full_decode_cropped(kind: str, num: int, flip: bool, box) -> None:
    """Windows anywhere (any row, both image edges, every DCT scale) decode, through the restart
    path, to the full decode of the original cropped."""
    original, coded = pair(kind)
    H, W = -(-H0 * num // 8), -(-W0 * num // 8)
    y0, x0 = int(box[0] * (H - 1)), int(box[1] * (W - 1))
    h, w = 1 + int(box[2] * (H - y0 - 1)), 1 + int(box[3] * (W - x0 - 1))
    want = reference(original, y0, x0, h, w, num, flip)
    assert np.array_equal(window(coded, y0, x0, h, w, num, flip), want)
    assert np.array_equal(window(version_1(kind), y0, x0, h, w, num, flip), want)  # one interval per row
    assert np.array_equal(window(original, y0, x0, h, w, num, flip), want)  # no index: the whole stream


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num", [8, 2])
def test_windows_starting_and_ending_on_every_row(kind: str, num: int) -> None:
    """Every first row, with heights that end just before, on and just after MCU row boundaries
    (where the restart path adds a row of chroma context) and at the image's bottom."""
    original, coded = pair(kind)
    H, W = -(-H0 * num // 8), -(-W0 * num // 8)
    step = KINDS[kind][1] * num // 8
    full = reference(original, 0, 0, H, W, num)
    for y0 in range(H):
        for h in {1, step - 1, step, step + 1, H - y0} - {0}:
            if y0 + h <= H:
                assert np.array_equal(window(coded, y0, 1, h, W - 2, num), full[y0 : y0 + h, 1 : W - 1]), (y0, h)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num", [8, 2])
def test_windows_starting_and_ending_on_every_column(kind: str, num: int) -> None:
    """Every first column, with widths that end just before, on and just after column-group
    boundaries (where the restart path adds a group of chroma context) and at the image's right."""
    original, coded = pair(kind)
    H, W = -(-H0 * num // 8), -(-W0 * num // 8)
    step = group_width(coded, kind) * num // 8
    full = reference(original, 0, 0, H, W, num)
    for x0 in range(W):
        for w in {1, 2, step - 1, step, step + 1, W - x0} - {0}:
            if x0 + w <= W:
                assert np.array_equal(window(coded, 1, x0, H - 2, w, num), full[1 : H - 1, x0 : x0 + w]), (x0, w)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_above_the_window_are_never_decoded(kind: str) -> None:
    """Damage the entropy-coded data of the first three MCU rows: a window below them still decodes
    to the clean pixels (the decoder started at its restart interval), while the whole image fails
    or differs."""
    original, coded = pair(kind)
    mcu_h = KINDS[kind][1]
    start, offsets = entropy_start(coded), restart_index(coded)
    groups = (len(offsets) + 1) // -(-H0 // mcu_h)
    damaged = bytearray(coded)
    keep = {start + off - k for off in offsets for k in (1, 2)}  # the restart markers
    for p in range(start + 4, start + offsets[3 * groups - 1] - 8):
        if p not in keep:
            damaged[p] = 0x55
    damaged = bytes(damaged)
    assert restart_index(damaged) == offsets
    y0 = 5 * mcu_h
    assert np.array_equal(window(damaged, y0, 3, H0 - y0, 150), reference(original, y0, 3, H0 - y0, 150))
    try:
        whole = decode_rgb(damaged)
    except ValueError:
        return
    assert not np.array_equal(whole, decode_rgb(original))


@pytest.mark.parametrize("kind", KINDS)
def test_column_groups_beside_the_window_are_never_decoded(kind: str) -> None:
    """Damage the entropy-coded data of every column group but the first, in every MCU row: a
    window inside the first group (and its chroma context) still decodes to the clean pixels."""
    original, coded = pair(kind)
    start, offsets = entropy_start(coded), restart_index(coded)
    groups = (len(offsets) + 1) // -(-H0 // KINDS[kind][1])
    bounds = [0, *offsets, len(coded) - 2 - start]  # interval k: data from bounds[k] to its marker
    damaged = bytearray(coded)
    for k in range(len(bounds) - 1):
        if k % groups != 0:
            for p in range(start + bounds[k] + 2, start + bounds[k + 1] - 4):
                damaged[p] = 0x55
    damaged = bytes(damaged)
    assert restart_index(damaged) == offsets
    w = group_width(coded, kind) - 4
    assert np.array_equal(window(damaged, 0, 1, H0, w), reference(original, 0, 1, H0, w))
    assert np.array_equal(window(damaged, 40, 2, 100, w), reference(original, 40, 2, 100, w))
    try:
        whole = decode_rgb(damaged)
    except ValueError:
        return
    assert not np.array_equal(whole, decode_rgb(original))


def test_an_interval_that_does_not_divide_the_mcu_row_is_refused() -> None:
    per_row = -(-W0 // 16)  # 4:2:0: 10 MCUs per row
    with pytest.raises(ValueError, match="no restart interval of 3 MCUs"):
        add_restart_index(make("4:2:0"), interval=3)
    assert restart_index(add_restart_index(make("4:2:0"), interval=per_row)) is not None


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(list(KINDS)), data=st.data())
def test_a_tampered_index_is_never_trusted(kind: str, data) -> None:
    """Random offsets (or a wrong count) in the index: the decoder checks every one and, when any
    fails, decodes the whole stream; pixels stay the full decode's."""
    original, coded = pair(kind)
    at, head = index_head(coded)
    seg = struct.unpack(">H", coded[at + 2 : at + 4])[0]
    listed = list(restart_index(coded))
    rows = data.draw(st.integers(0, len(listed) + 2))
    offsets = data.draw(st.lists(st.integers(0, 2**32 - 1) | st.sampled_from(listed), min_size=rows, max_size=rows))
    head = data.draw(st.sampled_from([head, head[:8] + struct.pack(">H", data.draw(st.integers(0, 65535)))]))
    index = head + b"".join(struct.pack(">I", v) for v in offsets)
    tampered = coded[:at] + b"\xff\xe9" + struct.pack(">H", 2 + len(index)) + index + coded[at + 2 + seg :]
    assert restart_index(tampered) in (None, tuple(listed))
    y0, x0 = data.draw(st.integers(0, H0 - 3)), data.draw(st.integers(0, W0 - 3))
    h, w = H0 - y0 - data.draw(st.integers(0, 2)), W0 - x0 - data.draw(st.integers(0, 2))
    assert np.array_equal(window(tampered, y0, x0, h, w), reference(original, y0, x0, h, w))


def test_markers_kept_index_replaced_and_non_jpegs_untouched() -> None:
    """APPn/COM segments survive the re-encode; re-encoding a re-encoded JPEG keeps one index;
    PNGs and JPEGs libjpeg cannot read are stored as they came."""
    exif = Image.Exif()
    exif[0x010E] = "a description"
    buf = io.BytesIO()
    Image.open(io.BytesIO(make("4:2:0"))).save(buf, format="JPEG", quality=90, exif=exif.tobytes(), comment=b"hello")
    coded = add_restart_index(buf.getvalue())
    with Image.open(io.BytesIO(coded)) as im:
        assert im.getexif()[0x010E] == "a description" and im.info["comment"] == b"hello"
    again = add_restart_index(coded)
    assert [m for _, m in markers(again)].count(0xE9) == 1
    assert np.array_equal(decode_rgb(again), decode_rgb(buf.getvalue()))
    png = io.BytesIO()
    Image.new("RGB", (9, 9)).save(png, format="PNG")
    assert add_restart_index(png.getvalue()) == png.getvalue()
    truncated = buf.getvalue()[: len(buf.getvalue()) // 2]
    assert add_restart_index(truncated) == truncated


@pytest.mark.parametrize("flag", [[], ["--no-jpeg-restart"]])
def test_convert_stores_reencoded_jpegs_by_default(tmp_path, flag: list[str]) -> None:
    from fastload.cli import main
    from fastload.formats import FastloadDataset

    files = {f"c{i}/im{i}.jpg": make(kind, 64, 48, seed=i) for i, kind in enumerate(KINDS)}
    for name, data in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--quiet", *flag]) == 0
    stored = FastloadDataset(str(tmp_path / "out")).get_batch(np.arange(len(files)))["image"].to_list()
    for data, got in zip(files.values(), stored, strict=True):
        got = bytes(got)
        if flag:
            assert got == data
        else:
            assert got == add_restart_index(data) and restart_index(got) is not None
            assert np.array_equal(decode_rgb(got), decode_rgb(data))
    if not flag:  # the Loader's image path decodes the stored JPEGs from their restart intervals
        from fastload import Loader, open_dataset
        from fastload.vision import ImagePreset, with_indices

        preset = ImagePreset(kind="eval", size=24, resize=None, backend="cpu", normalize=False)
        loader = Loader(with_indices(open_dataset(str(tmp_path / "out"))), batch_size=5, transform=preset)
        assert sum(len(b["image"]) for b in loader) == len(files)
        modes = loader.stats()["components"]["transform"]["vision_decode_modes"]
        assert modes.get("window, from its restart interval", 0) > 0 and sum(modes.values()) == len(files)


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(list(KINDS)), data=st.data())
def test_damaged_headers_fail_cleanly(kind: str, data) -> None:
    """Bytes changed anywhere in the header, the index or the first restart intervals: the decoder
    returns pixels or names a decode error for the image (the preset then tries the whole-image
    decoders); it never reads outside the data."""
    _, coded = pair(kind)
    start = entropy_start(coded)
    damaged = bytearray(coded)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(2, start + 64))] = data.draw(st.integers(0, 255))
    buf = bytes(damaged)
    y0 = data.draw(st.integers(0, 150))
    out = np.zeros(40 * 50 * 3, dtype=np.uint8)
    values, offsets = np.frombuffer(buf, dtype=np.uint8), np.array([0, len(buf)], dtype=np.int64)
    failures = decode_windows(values, offsets, np.array([[0, y0, 7, 40, 50, 8, 0, 0]], dtype=np.int64), out)
    assert all(row == 0 and code in (1, 2) and message for row, code, message in failures)
    restart_index(buf)  # the index reader checks the same way


@pytest.mark.parametrize("kind", ["train", "eval"])
def test_preset_output_is_bit_identical_and_counts_restart_starts(kind: str) -> None:
    """The image preset (crop, resize, flip, normalise) gives the same tensor for the original and
    the re-encoded JPEGs; its stats count the windows decoded from their restart interval."""
    import torch

    from fastload.formats.ragged import Ragged
    from fastload.vision import ImagePreset

    originals = [make(k, 240, 320, seed=s) for s in range(3) for k in KINDS]
    coded = [add_restart_index(b) for b in originals]
    outs, presets = [], []
    for images in (originals, coded):
        preset = ImagePreset(kind=kind, size=64, backend="cpu", threads=2, dtype=torch.float32)
        batch = {"image": Ragged.from_list(images, kind="image"), "__indices__": np.arange(len(images))}
        outs.append(preset(batch)["image"])
        presets.append(preset)
    assert torch.equal(outs[0], outs[1])
    plain, indexed = (p.stats()["vision_decode_modes"] for p in presets)
    assert not any(m.endswith(", from its restart interval") for m in plain)
    restarted = sum(c for m, c in indexed.items() if m.endswith(", from its restart interval"))
    assert sum(indexed.values()) == len(coded) and restarted > 0
