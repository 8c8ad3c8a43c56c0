"""Whole-dataset integrity check: every checksum, every header, every offsets table, every block."""

from __future__ import annotations

import os
import stat
import warnings

from .errors import FormatError
from .manifest import MANIFEST_NAME, Manifest
from .reader import FastloadDataset
from .shard import ShardInfo, file_xxh3
from .storage import LocalStorage

__all__ = ["shard_file_problem", "verify_dataset"]


def shard_file_problem(storage: LocalStorage, k: int, info: ShardInfo) -> str | None:
    """What is wrong with local shard `k`'s file against its manifest entry `info` (missing, not a
    regular file, another size), or None; one `stat`, no reads."""
    path = storage.path(info.file)
    name = f"{path} (shard {k})"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{name}: shard file is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{name}: not a regular file"
    if st.st_size != info.bytes:
        return f"{name}: {st.st_size} bytes, manifest says {info.bytes} (truncated or replaced?)"
    return None


def _read_blocks_file(storage: LocalStorage, manifest: Manifest, problems: list[str]) -> tuple[bytes, list[int]] | None:
    """blocks.bin's bytes and where each shard's table starts in it (the last: its size); None (and a
    problem noted when the manifest names it but it cannot be read at that size) otherwise."""
    if not manifest.blocks_file:
        return None
    offsets = [int(v) for v in manifest.table_offsets()]
    try:
        data = storage.read_small(manifest.blocks_file)
    except FormatError as exc:
        problems.append(str(exc))
        return None
    if len(data) != offsets[-1]:
        problems.append(f"{storage.path(manifest.blocks_file)}: {len(data)} bytes, the manifest says {offsets[-1]}")
        return None
    return data, offsets


def verify_dataset(root: str | os.PathLike[str], *, decode: bool = False) -> list[str]:
    """Return one message per problem found (empty when the dataset is intact).

    Checks the manifest, meta.bin, and per shard: its size and whole-file xxh3, its structure and
    identity against the manifest (as a reader opens it), every block checksum, and that blocks.bin
    holds its block checksum table (version 2).
    `decode=True` also decodes every image fully (`decode_images`).
    """
    storage = LocalStorage(root)
    where = os.path.join(storage.root, MANIFEST_NAME)
    try:
        Manifest.loads(storage.read_small(MANIFEST_NAME), where=where)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # version 1: reported below instead
            ds = FastloadDataset(storage.root, verify="none")
    except FormatError as exc:
        return [str(exc)]
    problems = []
    if ds.manifest.version < 2:
        problems.append(
            f"{storage.root}: format version 1 has no block checksums (reads are verified only whole-shard); "
            f"upgrade with `fastload convert --upgrade {storage.root} NEW_DIR`"
        )
    tables = _read_blocks_file(storage, ds.manifest, problems)
    for k, info in enumerate(ds.manifest.shards):
        try:
            problem = shard_file_problem(storage, k, info)
            if problem is not None:
                raise FormatError(problem)
            path = storage.path(info.file)
            name = f"{path} (shard {k})"
            if file_xxh3(path) != info.xxh3:
                raise FormatError(f"{name}: checksum mismatch (corrupted shard)")
            reader = ds.shard(k)
            reader.verify_all_blocks()
            if tables is not None and reader.table is not None:
                at, end = tables[1][k], tables[1][k + 1]
                if tables[0][at:end] != reader.table.tobytes():
                    raise FormatError(
                        f"{storage.path(ds.manifest.blocks_file)}: bytes [{at}, {end}) are not the block checksum "
                        f"table of {name} (stale or corrupted: remote readers fetch the shard's own table instead; "
                        f"`fastload convert --upgrade {storage.root} NEW_DIR` writes a copy with the right one)"
                    )
        except FormatError as exc:
            problems.append(str(exc))
    if decode and not problems:
        from .sources import decode_images

        problems.extend(decode_images(ds))
    ds.close()
    return problems
