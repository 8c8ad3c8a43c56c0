"""`Arrival`: what a reader may read of a shard that is still being downloaded into the cache.

A download of a format-version-2 shard (`BlockSpec`: the manifest's checksum of its block table
and the block size) first receives the shard's block checksum table, authenticates it against the
manifest, then verifies each 64 KiB block against it as the block arrives (`Download`), and
publishes the block here only then. A published block is never written again (a retry rewrites
only what is not published), so a reader that maps the temp file may read it at once.

Readers wait in `wait(ids)` for the blocks a read needs; blocks the download has not reached are
handed to `on_want` (the fetcher gets them in ranged GETs of their own, ahead of the download's
order: a batch needs a few blocks of every column, spread over the shard). Every wait is bounded: a download that
fails wakes its waiters with that download's error, and a wait that sees no block arrive for
`stall_s` seconds raises `TimeoutError`.

The record lives in the process that downloads. A forked child that inherited a reader of an
arriving shard cannot be woken by its parent's download: it takes the blocks published before the
fork, and for the others polls until the file was renamed into the cache complete (same inode),
then hashes those blocks itself.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fastload.formats.blocks import table_span

__all__ = ["Arrival", "BlockSpec"]

_POLL_S = 0.02  # a forked child's poll for its parent's download


@dataclass(frozen=True)
class BlockSpec:
    """How to verify a shard while it arrives: `blocks_xxh3`, the manifest's xxh3 of the shard's block
    checksum table, and `shift`, log2 of the block size (`manifest.block_log2`)."""

    blocks_xxh3: str
    shift: int


class Arrival:
    """The blocks of one download verified so far, its temp `path` (the cached path once renamed in),
    and how it ended. Writers (`Download`, `CacheFill`) call `publish`, `progress`, `finish` and
    `fail`; readers call `wait` and `path`."""

    def __init__(self, path: str, final_path: str, *, size: int, spec: BlockSpec, where: str, stall_s: float) -> None:
        span = table_span(size, spec.shift)
        if span is None:
            raise ValueError(f"{where}: {size} bytes cannot hold blocks of 2**{spec.shift} bytes and their table")
        self.sections_end, count = span
        self.spec, self.size, self.where, self.stall_s = spec, size, where, float(stall_s)
        self.published = np.zeros(count, dtype=bool)  # False -> True only, set under `_cond`
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self._path, self._final = path, final_path
        self._ident: tuple[int, int] | None = None  # (device, inode) of the temp file, once created
        self._state = "running"  # "complete" or "failed" once it ended
        self._error: BaseException | None = None
        self._last = time.monotonic()  # the last sign of life: a block published, an attempt started
        self.requested = np.zeros(count, dtype=bool)  # blocks handed to `on_want` already
        self._wanted = np.zeros(count, dtype=bool)  # blocks readers waited for before `on_want` was set
        # set by the fetcher (`set_want`): called (outside the lock) with blocks a reader waits for and
        # nobody asked for yet, to fetch them ahead of the download's order (ranged GETs)
        self.on_want: Callable[[np.ndarray], None] | None = None

    # -- the download's side -----------------------------------------------------------------------
    def created(self, st: os.stat_result) -> None:
        """The temp file exists at its full size (`st`: its stat)."""
        with self._cond:
            self._ident = (st.st_dev, st.st_ino)

    def publish(self, ids: list[int]) -> None:
        """Blocks `ids` are in the file and matched their checksums: readers may read them."""
        with self._cond:
            self.published[ids] = True
            self._last = time.monotonic()
            self._cond.notify_all()

    def set_want(self, want: Callable[[np.ndarray], None]) -> None:
        """Install `on_want` (once the block table is known) and hand it the blocks readers already wait for."""
        with self._cond:
            if self._state != "running":
                return
            self.on_want = want
            new = np.flatnonzero(self._wanted & ~self.published & ~self.requested)
            self.requested[new] = True
        if len(new):
            want(new)

    def progress(self) -> None:
        """The download is alive (an attempt started): restarts the readers' stall clock."""
        with self._cond:
            self._last = time.monotonic()

    def move(self, rename: Callable[[], None], final_path: str) -> None:
        """Run `rename` (the temp file to `final_path`) and record it in one step: `path` is never stale."""
        with self._cond:
            rename()
            self._path = final_path

    def finish(self, final_path: str) -> None:
        """Every block was verified and the file was renamed to `final_path`."""
        with self._cond:
            self._path = final_path
            self.published[:] = True
            self._state = "complete"
            self.on_want = None  # nothing left to fetch (and the finished download is let go)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The download failed for good: waiters raise `error`."""
        with self._cond:
            if self._state == "running":
                self._state, self._error = "failed", error
            self.on_want = None
            self._cond.notify_all()

    # -- the readers' side -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Where the file is now: the temp file, or the cached file once renamed in."""
        if os.getpid() != self._pid:
            return self._final if self._landed() else self._path
        with self._cond:
            return self._path

    @property
    def complete(self) -> bool:
        """Whether every block arrived (the file is in the cache now)."""
        if os.getpid() != self._pid:
            return self._landed()
        return self._state == "complete"

    def wait(self, ids: np.ndarray) -> bool:
        """Block until the blocks `ids` (local block numbers) arrived. Returns True when this process's
        download verified them (the caller may take them as verified), False when the caller must hash
        them itself (a forked child). Raises the download's error when it failed, `TimeoutError`
        when no block arrived for `stall_s` seconds."""
        if len(ids) and bool(self.published[ids].all()):
            return True  # published blocks are final (a forked child inherited these bits too)
        if os.getpid() != self._pid:
            return self._wait_foreign()
        self._ask(ids)
        with self._cond:
            while True:
                if self._state == "failed":
                    raise _again(self._error, self.where)
                if self._state == "complete" or bool(self.published[ids].all()):
                    return True
                left = self._last + self.stall_s - time.monotonic()
                if left <= 0:
                    missing = ids[~self.published[ids]]
                    raise TimeoutError(
                        f"{self.where}: block {int(missing[0])} (bytes from {int(missing[0]) << self.spec.shift}) "
                        f"did not arrive: no block of the download arrived for {self.stall_s:g}s"
                    )
                self._cond.wait(timeout=min(left, 1.0))

    def _ask(self, ids: np.ndarray) -> None:
        """Hand the blocks of `ids` that nobody asked for yet to `on_want` (fetched out of order)."""
        with self._cond:
            want = self.on_want
            if self._state != "running":
                return
            if want is None:  # the block table has not arrived: `set_want` asks for these
                self._wanted[ids] = True
                return
            new = ids[~(self.published[ids] | self.requested[ids])]
            self.requested[new] = True
        if len(new):
            want(new)

    def wait_all(self) -> bool:
        """`wait` for every block."""
        return self.wait(np.arange(len(self.published)))

    def _landed(self) -> bool:
        """Whether the cached file is this download's file (it was renamed in complete)."""
        try:
            st = os.stat(self._final)
        except OSError:
            return False
        return self._ident is not None and (st.st_dev, st.st_ino) == self._ident

    def _wait_foreign(self) -> bool:
        """A forked child: poll until the parent's download renamed the file in (then the caller
        hashes what it reads), or its temp file is gone without that (the download failed)."""
        deadline = time.monotonic() + self.stall_s
        while True:
            if self._landed():
                return False
            if not os.path.exists(self._path) and not self._landed():
                raise OSError(f"{self.where}: the download of this shard in process {self._pid} did not complete")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.where}: the download of this shard in process {self._pid} did not complete "
                    f"within {self.stall_s:g}s"
                )
            time.sleep(_POLL_S)


def _again(err: BaseException | None, where: str) -> BaseException:
    """A fresh exception of the failed download's type and message (each waiter raises its own)."""
    if err is None:
        return OSError(f"{where}: the download failed")
    try:
        again = type(err)(*err.args)
    except Exception:  # noqa: BLE001 - an error type that cannot be rebuilt: raise it as is
        return err
    again.__cause__ = err
    return again
