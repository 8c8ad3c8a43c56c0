"""An interrupted conversion: what it kept, how it is described, and how a new run treats it.

`write` records its settings and the command that continues it in `PROGRESS_NAME` until the
manifest is written. A folder with that file (or finished shards) and no manifest is an
incomplete conversion: a run continues it only when asked (`resume`), replaces it only when asked
(`overwrite`), and refuses otherwise; `incomplete_conversion` says what it is (for `inspect`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import xxhash

from .errors import FormatError
from .layout import shard_name
from .manifest import MANIFEST_NAME, Manifest
from .schema import Schema
from .shard import ShardIdentity, ShardInfo, ShardReader, file_xxh3

__all__ = [
    "COMMAND_KEY",
    "PROGRESS_NAME",
    "WriteInterrupted",
    "finished_shards",
    "incomplete_conversion",
    "kept_shard",
    "prepare_out_dir",
    "resume_point",
    "stopped_hint",
]

PROGRESS_NAME = ".fastload-progress.json"


class WriteInterrupted(KeyboardInterrupt):
    """Ctrl-C during `write`: the message says what was kept and the command that continues."""


COMMAND_KEY = "resume_command"  # the progress file's record of how to continue (not a setting)


def finished_shards(out_dir: str) -> int:
    """Shard files already renamed into place in `out_dir` (finished by an earlier run)."""
    shards = os.path.join(out_dir, "shards")
    return sum(e.endswith(".fls") for e in os.listdir(shards)) if os.path.isdir(shards) else 0


def stopped_hint(out_dir: str, command: str) -> str:
    """The line saying that `out_dir` is an incomplete conversion and which command continues it."""
    n = finished_shards(out_dir)
    return (
        f"{out_dir} is an incomplete conversion ({n} finished shard{'s' if n != 1 else ''} kept, no manifest, "
        f"so it does not open); continue with: {command}"
    )


def incomplete_conversion(out_dir: str) -> str | None:
    """A one-line description of an interrupted conversion in `out_dir` (with the command that
    continues it), or None when `out_dir` is not one."""
    if os.path.exists(os.path.join(out_dir, MANIFEST_NAME)):
        return None
    try:
        with open(os.path.join(out_dir, PROGRESS_NAME)) as fh:
            recorded = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
    command = recorded.get(COMMAND_KEY) if isinstance(recorded, dict) else None
    if not isinstance(command, str):
        command = "the same conversion with --resume (or resume=True)"
    return stopped_hint(out_dir, command) + "; or start over with --overwrite"


def prepare_out_dir(out_dir: str, *, resume: bool, overwrite: bool) -> Manifest | None:
    """Check what `out_dir` holds (refusing a dataset or an interrupted run unless `resume` or
    `overwrite` says what to do with it); the manifest when a finished run is resumed, else None."""
    manifest_path = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(manifest_path):
        if resume and not overwrite:
            # A previous run finished (possibly killed just before removing its progress file).
            with open(manifest_path, "rb") as fh:
                manifest = Manifest.loads(fh.read(), where=manifest_path)
            if os.path.exists(os.path.join(out_dir, PROGRESS_NAME)):
                os.remove(os.path.join(out_dir, PROGRESS_NAME))
            return manifest
        if not overwrite:
            raise FileExistsError(f"{out_dir} already holds a dataset; pass overwrite=True (--overwrite) to replace it")
        shutil.rmtree(out_dir)
        return None
    partial = os.path.exists(os.path.join(out_dir, PROGRESS_NAME)) or finished_shards(out_dir) > 0
    if partial and not resume:
        if not overwrite:
            raise FileExistsError(
                f"{out_dir} holds an interrupted conversion ({finished_shards(out_dir)} finished shards); "
                "pass resume=True (--resume) to continue it, or overwrite=True (--overwrite) to start over"
            )
        shutil.rmtree(os.path.join(out_dir, "shards"), ignore_errors=True)
    return None


def kept_shard(path: str, schema: Schema, *, name: str, identity: ShardIdentity) -> ShardInfo | None:
    """The manifest entry of a finished shard an interrupted run can keep: a version-2 shard that
    is `identity` and whose every block checks out; None when it cannot be kept."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            header = np.frombuffer(fh.read(64), dtype=np.uint8)
        n = int(header[16:24].view("<u8")[0]) if len(header) == 64 else -1
        reader = ShardReader(
            path, schema, num_samples=n, nbytes=size, identity=identity, bits=lambda count: np.zeros(count, bool)
        )
        try:
            if reader.table is None:  # a version-1 shard: convert again
                return None
            reader.verify_blocks(np.arange(len(reader.table)))
            blocks_xxh3 = xxhash.xxh3_64_hexdigest(reader.table.tobytes())
        finally:
            reader.close()
    except (FormatError, ValueError, IndexError):
        return None
    return ShardInfo(file=name, num_samples=n, bytes=size, xxh3=file_xxh3(path), blocks_xxh3=blocks_xxh3)


def resume_point(out_dir: str, settings: dict[str, Any], schema: Schema, dataset_id: int) -> list[ShardInfo]:
    """Finished shards of an interrupted run that can be kept (a consecutive prefix), or [] to start over."""
    progress_path = os.path.join(out_dir, PROGRESS_NAME)
    try:
        with open(progress_path) as fh:
            recorded = json.load(fh)
    except (OSError, ValueError, RecursionError):  # ValueError: not JSON, or an integer of over 4300 digits
        return []
    if isinstance(recorded, dict):
        recorded.pop(COMMAND_KEY, None)
    if recorded != settings:
        raise FormatError(
            f"{out_dir}: cannot resume: the interrupted conversion used other settings "
            f"(schema/shard size/sample count); start over with overwrite=True (--overwrite) or use the same settings"
        )
    kept: list[ShardInfo] = []
    for k in range(1_000_000):
        path = os.path.join(out_dir, shard_name(k))
        if not os.path.exists(path):
            break
        identity = ShardIdentity(dataset_id, k, sum(s.num_samples for s in kept))
        info = kept_shard(path, schema, name=shard_name(k), identity=identity)
        if info is None:
            break
        kept.append(info)
    return kept
