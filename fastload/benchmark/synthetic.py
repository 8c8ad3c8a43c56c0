"""The embedded default dataset: synthetic records written as fastload, LMDB and HDF5 from the same samples.

Each sample has a fixed-size record (``record``: uint8 (3, 64, 64), like a small raw image), a
label (``label``: int64), a JPEG (``jpeg``: 80..160 px, a pool of distinct images reused
cyclically) and variable-length token ids (``tokens``: int32, log-normal lengths, median 96).
The fastload copy is written by the project's writer (`fastload.formats.write`, the engine of
`fastload convert`); HDF5 stores the JPEG and tokens as vlen datasets; LMDB stores one value per
sample (a small header, then the record, label, JPEG and tokens bytes) under a 10-digit key.
`raw.bin` holds each sample's payload (record, label, JPEG, tokens bytes) contiguously, with no
format at all: the raw random gather of those byte ranges is the limit the backends are read against.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fastload.formats import Block, BlockSource, Field, Ragged, Schema, write
from fastload.formats.writer import fsync_path

__all__ = ["SCHEMA", "RawRanges", "Synthetic", "build", "make_jpegs"]

RECORD_SHAPE = (3, 64, 64)
SCHEMA = Schema(
    (
        Field("record", "ndarray", np.dtype(np.uint8), RECORD_SHAPE),
        Field("label", "scalar", np.dtype(np.int64)),
        Field("jpeg", "image"),
        Field("tokens", "varray", np.dtype(np.int32)),
    )
)
_JPEG_POOL = 64
_LMDB_HEADER = struct.Struct("<IIIq")  # record bytes, jpeg bytes, tokens bytes, label


@dataclass
class RawRanges:
    """`path` (a flat file) holds sample i's payload at bytes [starts[i], starts[i] + lengths[i])."""

    path: str
    starts: np.ndarray
    lengths: np.ndarray


@dataclass
class Synthetic:
    """Paths of the embedded default, one per backend, and what it holds."""

    root: str
    fastload: str
    lmdb: str | None
    hdf5: str | None
    raw: RawRanges
    num_samples: int
    nbytes: int  # payload bytes (record + label + jpeg + tokens) over all samples


def _encode_jpeg(img: np.ndarray, quality: int = 90) -> bytes:
    try:
        import simplejpeg
    except ImportError:
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        return buf.getvalue()
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality, colorspace="RGB")


def make_jpegs(
    count: int, *, seed: int = 0, min_side: int = 80, max_side: int = 160
) -> tuple[list[bytes], np.ndarray]:
    """`count` distinct photo-like JPEGs (smooth gradients + texture) and their (height, width)."""
    rng = np.random.default_rng(seed)
    out, hw = [], []
    for _ in range(count):
        h, w = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([np.sin(xx / rng.uniform(5, 30) + c) * np.cos(yy / rng.uniform(5, 30)) for c in range(3)], -1)
        img = (base * 80 + 128 + rng.normal(0, 12, (h, w, 3))).clip(0, 255).astype(np.uint8)
        out.append(_encode_jpeg(img))
        hw.append((h, w))
    return out, np.array(hw, dtype=np.uint32).reshape(-1, 2)


def _columns(num_samples: int, jpegs: list[bytes], seed: int) -> dict[str, np.ndarray | Ragged]:
    rng = np.random.default_rng(seed + 1)
    record = rng.integers(0, 256, (num_samples, *RECORD_SHAPE), dtype=np.uint8)
    label = rng.integers(0, 1000, num_samples).astype(np.int64)
    lens = np.clip(rng.lognormal(np.log(96), 0.8, num_samples), 8, 1024).astype(np.int64)
    offsets = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = Ragged(rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32), offsets, "varray")
    images = Ragged.from_list([jpegs[i % len(jpegs)] for i in range(num_samples)], kind="bytes")
    return {"record": record, "label": label, "jpeg": Ragged(images.values, images.offsets, "image"), "tokens": tokens}


def _sample_bytes(jpegs: list[bytes]) -> float:
    mean_tokens = 96 * np.exp(0.8**2 / 2) * 4
    return float(np.prod(RECORD_SHAPE) + 8 + np.mean([len(j) for j in jpegs]) + mean_tokens)


def _write_fastload(
    cols: dict[str, np.ndarray | Ragged], hw: np.ndarray, n: int, out: str, shard_size: int
) -> None:
    full = Block(n, dict(cols), {"jpeg": hw})
    block_rows = 1024

    def blocks(start: int) -> Iterator[Block]:
        for s in range(start, n, block_rows):
            yield full.slice(s, min(s + block_rows, n))

    write(BlockSource(schema=SCHEMA, num_samples=n, blocks=blocks), out, schema=SCHEMA, shard_size=shard_size,
          progress=False)


def _write_hdf5(cols: dict[str, np.ndarray | Ragged], n: int, path: str) -> None:
    import h5py

    with h5py.File(path, "w") as h5:
        h5.create_dataset("record", data=cols["record"])
        h5.create_dataset("label", data=cols["label"])
        for name, dtype in (("jpeg", np.uint8), ("tokens", np.int32)):
            col = cols[name]
            assert isinstance(col, Ragged)
            rows = np.empty(n, dtype=object)
            rows[:] = [col.values[col.offsets[i] : col.offsets[i + 1]] for i in range(n)]
            h5.create_dataset(name, (n,), dtype=h5py.vlen_dtype(dtype))[:] = rows
    fsync_path(path)


def _write_lmdb(cols: dict[str, np.ndarray | Ragged], n: int, path: str, nbytes: int) -> None:
    import lmdb

    record, label, jpeg, tokens = cols["record"], cols["label"], cols["jpeg"], cols["tokens"]
    assert isinstance(jpeg, Ragged) and isinstance(tokens, Ragged) and isinstance(record, np.ndarray)
    env = lmdb.open(path, map_size=2 * nbytes + (64 << 20), subdir=True, lock=False)
    try:
        with env.begin(write=True) as txn:
            for i in range(n):
                j = jpeg.values[jpeg.offsets[i] : jpeg.offsets[i + 1]].tobytes()
                t = tokens.values[tokens.offsets[i] : tokens.offsets[i + 1]].tobytes()
                r = record[i].tobytes()
                txn.put(b"%010d" % i, _LMDB_HEADER.pack(len(r), len(j), len(t), int(label[i])) + r + j + t)
        env.sync(True)
    finally:
        env.close()


def _write_raw(cols: dict[str, np.ndarray | Ragged], n: int, path: str) -> RawRanges:
    record, label, jpeg, tokens = cols["record"], cols["label"], cols["jpeg"], cols["tokens"]
    assert isinstance(jpeg, Ragged) and isinstance(tokens, Ragged) and isinstance(record, np.ndarray)
    lengths = np.full(n, record[0].nbytes + 8, dtype=np.int64) + jpeg.lengths + tokens.lengths * tokens.values.itemsize
    with open(path, "wb") as fh:
        for i in range(n):
            fh.write(record[i].tobytes() + label[i].tobytes())
            fh.write(jpeg.values[jpeg.offsets[i] : jpeg.offsets[i + 1]].tobytes())
            fh.write(tokens.values[tokens.offsets[i] : tokens.offsets[i + 1]].tobytes())
    fsync_path(path)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return RawRanges(path, starts, lengths)


def build(
    root: str, *, size: int, backends: tuple[str, ...] = ("lmdb", "hdf5"), seed: int = 0, min_samples: int = 64
) -> Synthetic:
    """Write about `size` payload bytes of synthetic samples under `root` (fastload always, + `backends`)."""
    os.makedirs(root, exist_ok=True)
    jpegs, pool_hw = make_jpegs(_JPEG_POOL, seed=seed)
    n = max(min_samples, int(size // _sample_bytes(jpegs)))
    cols = _columns(n, jpegs, seed)
    nbytes = sum(c.values.nbytes if isinstance(c, Ragged) else c.nbytes for c in cols.values())
    shard_size = max(1 << 20, min(64 << 20, nbytes // 8))
    fl = os.path.join(root, "fastload")
    _write_fastload(cols, pool_hw[np.arange(n) % len(jpegs)], n, fl, shard_size)
    h5 = os.path.join(root, "data.h5") if "hdf5" in backends else None
    if h5:
        _write_hdf5(cols, n, h5)
    db = os.path.join(root, "lmdb") if "lmdb" in backends else None
    if db:
        _write_lmdb(cols, n, db, nbytes)
    raw = _write_raw(cols, n, os.path.join(root, "raw.bin"))
    return Synthetic(root=root, fastload=fl, lmdb=db, hdf5=h5, raw=raw, num_samples=n, nbytes=int(nbytes))
