"""Where a dataset's files come from. `LocalStorage` is a directory; remote storage lives in `fastload.remote.storage`.

The reader asks a storage object for small files (manifest, meta) as bytes and for shards as
local paths it can mmap; `acquire` pins a shard (a cache must not evict it) until `release`.
A storage may also offer `acquire_arriving(name, *, size, xxh3) -> (path, Arrival | None)`: the
path of a shard that may still be arriving, with an `Arrival` the reader waits on for the blocks
it reads (a remote cache: `fastload.remote.storage.RemoteStorage`), and `hold_for_first_batch()` /
`first_batch_served()`: the reader starts an epoch whose shards are not all at hand, and has served
its first batch (a remote cache holds back the GETs that batch does not wait for in between).
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import numpy as np

from .errors import FormatError
from .manifest import check_relative_path

__all__ = ["Arrival", "LocalStorage", "Storage", "is_url"]


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...); ``file://`` counts as local."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


_O_PATH = getattr(os, "O_PATH", None)


def _real_path(path: str) -> str:
    """`os.path.realpath(path)`. On Linux, an existing file's in three system calls (opened with
    O_PATH, its /proc/self/fd link read) instead of one `lstat` per component of the path."""
    if _O_PATH is not None:
        try:
            fd = os.open(path, _O_PATH | os.O_CLOEXEC)
        except OSError:
            return os.path.realpath(path)  # missing, or not reachable: realpath says what it can
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""
        finally:
            os.close(fd)
        if real.startswith("/") and not real.endswith(" (deleted)"):
            return real
    return os.path.realpath(path)


@runtime_checkable
class Storage(Protocol):
    """What `FastloadDataset` needs from a place that holds a dataset."""

    def read_small(self, name: str) -> bytes:
        """The whole content of small file `name` (manifest, meta; relative to the dataset root);
        raises FormatError when it is missing."""
        ...

    def acquire(self, name: str, *, size: int, xxh3: str) -> str:
        """A local path of shard file `name` that the reader may mmap, kept in place (not evicted)
        until the matching `release`; `size` and `xxh3` are the manifest's, for a cache to key and
        verify its copy. May raise FileNotFoundError."""
        ...

    def release(self, name: str) -> None:
        """Undo one `acquire` of `name`: the reader no longer needs its path kept."""
        ...

    def prefetch(self, names: list[str]) -> None:
        """A hint: the shards to be acquired next, in order (replacing any earlier hint); storage may
        start fetching them in the background, or ignore it. Returns without waiting for downloads."""
        ...


@runtime_checkable
class Arrival(Protocol):
    """A version-2 shard file still being written by a download that verifies each block against the
    shard's checksum table before publishing it (`acquire_arriving`). The file has its full size
    from the start; blocks not yet published hold no data to read."""

    @property
    def path(self) -> str:
        """Where the file is now (it may move once, when the download completes)."""
        ...

    @property
    def complete(self) -> bool:
        """Whether every block has arrived."""
        ...

    @property
    def published(self) -> np.ndarray:
        """One bool per block, True once the block arrived and matched its checksum (never set back:
        a published block's bytes are final)."""
        ...

    def wait(self, ids: np.ndarray, *, ahead: bool = True) -> bool:
        """Block until blocks `ids` (the shard's local block numbers) have arrived; True when the download
        verified them in this process (the reader takes them as verified), False when the reader
        must hash them itself. Raises the download's error if it failed, or `TimeoutError` (bounded).
        `ahead`: blocks the download will bring later may be fetched for this wait out of order."""
        ...


class LocalStorage:
    """A dataset directory on a local file system: zero-copy, no cache."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"dataset directory {self.root!r} does not exist")

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def path(self, name: str) -> str:
        """The local path of a relative name; refuses names (or symlinks) that leave the root."""
        rel = check_relative_path(name, self.root)
        full = _real_path(os.path.join(self.root, rel))
        if os.path.commonpath([full, self.root]) != self.root:
            raise FormatError(f"{self.root}: {name!r} resolves outside the dataset root")
        return full

    def read_small(self, name: str) -> bytes:
        """The file's bytes, read whole; FormatError when it is missing or not a regular file."""
        path = self.path(name)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError as exc:
            raise FormatError(f"{path}: file is missing") from exc
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise FormatError(f"{path}: not a regular file ({exc.strerror})") from exc

    def acquire(self, name: str, *, size: int, xxh3: str) -> str:
        """The file's own path (`path(name)`); nothing to pin or fetch, `size`/`xxh3` unused."""
        return self.path(name)

    def release(self, name: str) -> None:
        """Nothing to do: local files are never evicted."""
        return None

    def prefetch(self, names: list[str]) -> None:
        """Nothing to do: local files need no fetching."""
        return None
