"""`Arrival`: what a reader may read of a shard that is still being downloaded into the cache.

A download of a format-version-2 shard (`BlockSpec`: the manifest's checksum of its block table
and the block size) first receives the shard's block checksum table, authenticates it against the
manifest, then verifies each 64 KiB block against it as the block arrives (`Download`), and
publishes the block here only then. A published block is never written again (a retry rewrites
only what is not published), so a reader that maps the temp file may read it at once.

Every byte of the shard is received once: each block is fetched by one claim at a time, and this
record is the ledger of claims. The download claims the next runs of unclaimed blocks in file order
(`claim_next`); readers wait in `wait(ids)` for the blocks a read needs. For a read that fetches
ahead (an epoch's first), blocks nobody claimed yet are claimed for it (`claim_wanted`) and handed
to `on_want` (the fetcher gets them in ranged GETs of their own, ahead of the download's order: a
batch needs a few blocks of every column, spread over the shard); other reads follow the download's
GETs, and claim blocks only from a download that shows no progress for `STALLED_S`. The download
skips what readers' GETs claimed. A claim that fails gives its
blocks back (`unclaim`) for the download to take. Every wait is bounded: a download that fails wakes
its waiters with that download's error, and a wait that sees no block arrive for `stall_s` seconds
raises `TimeoutError`.

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
# A reader's GET may take over the download's blocks from this many blocks (4 MiB) past where the download's
# GET has got to (that GET then stops where it lost its blocks): nearer bytes arrive sooner in that GET than
# in a new one, whose first byte costs a round trip (at an object store's tens of ms and ~100 MB/s per GET,
# about 4 MiB).
# From a GET that received nothing for `STALLED_S`, a reader may take every block it has not finished; from a
# download that published nothing for as long, a following read also claims blocks no GET holds yet.
STEAL_AHEAD = 64
STALLED_S = 0.1
# A GET goes on through up to this many blocks (1 MiB) that readers' GETs took over, dropping their bytes:
# cheaper than ending it and starting a new GET after them.
SKIP_THROUGH = 16
ASK_AGAIN_S = 0.05  # a waiting reader asks again for its blocks this often (a stalled GET's become free)
# Wanted blocks whose GETs, grouped as `set_want` says, would cover this share of the shard's blocks not
# here yet are not fetched ahead of the download: its GETs bring the whole shard in file order at least
# as soon, while readers' GETs over most of a shard would only cut those GETs into pieces.
AHEAD_MOST = 0.5


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
        self.published = np.zeros(count, dtype=bool)  # False -> True only, set under `_lock`
        # guards the ledger and the state below; a plain lock (no method takes it twice), waited on through `_cond`
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pid = os.getpid()
        self._path, self._final = path, final_path
        self._ident: tuple[int, int] | None = None  # (device, inode) of the temp file, once created
        self._state = "running"  # "complete" or "failed" once it ended
        self._error: BaseException | None = None
        self._last = time.monotonic()  # the last sign of life: a block published, an attempt started
        # the claim fetching each block: 0 = none; set by `claim_*`, cleared by `unclaim` (unpublished blocks)
        self.claimed = np.zeros(count, dtype=np.int64)
        self._claims = 0  # the last claim id handed out
        self._intact: set[int] = set()  # claims that still hold every block they were given (no takeover, not ended)
        # the download's own claims (`claim_next`) -> (the first block not received yet, when it last
        # received): their blocks from there on may be claimed again for a waiting reader (`STEAL_AHEAD`)
        self._fronts: dict[int, tuple[int, float]] = {}
        self._wanted = np.zeros(count, dtype=bool)  # blocks readers waited for before `on_want` was set
        self._wanted_ahead = False  # whether a read that fetches ahead (`ask`'s `ahead`) was among them
        self._waiting: dict[int, np.ndarray] = {}  # waiting thread -> the blocks it waits for
        self._gap, self._run = 0, 1  # how `claim_wanted` groups blocks into GETs (`set_want`)
        # set by the fetcher (`set_want`): called (outside the lock) with runs (claim, first block, end
        # block) claimed for blocks readers wait for, to fetch them ahead of the download's order
        self.on_want: Callable[[list[tuple[int, int, int]]], None] | None = None
        # set with `on_want`: called (outside the lock) when a reader fetching ahead leaves its blocks to
        # the download's GETs (`AHEAD_MOST`), so that nothing the download would run is held back
        self.on_follow: Callable[[], None] | None = None

    # -- the download's side -----------------------------------------------------------------------
    def created(self, st: os.stat_result) -> None:
        """The temp file exists at its full size (`st`: its stat)."""
        with self._lock:
            self._ident = (st.st_dev, st.st_ino)

    def publish(self, ids: list[int]) -> None:
        """Blocks `ids` are in the file and matched their checksums: readers may read them (a reader
        is woken once all the blocks it waits for are here, not for each block)."""
        with self._lock:
            self.published[ids] = True
            self._last = time.monotonic()
            if self._waiting and any(bool(self.published[want].all()) for want in self._waiting.values()):
                self._cond.notify_all()

    def set_want(self, want: Callable[[list[tuple[int, int, int]]], None], *, gap: int, run: int,
                 follow: Callable[[], None] | None = None) -> None:
        """Install `on_want` (once the block table is known) and `on_follow` (`follow`), and hand
        `on_want` runs claimed for the blocks readers already wait for. Wanted blocks less than `gap`
        apart share a run (the unclaimed blocks between come along), of at most `run` blocks."""
        with self._lock:
            if self._state != "running":
                return
            self.on_want, self.on_follow, self._gap, self._run = want, follow, int(gap), max(1, int(run))
            runs, left = self._claim_wanted(np.flatnonzero(self._wanted), self._wanted_ahead)
        self._hand_over(want, runs, follow if left else None)

    def _hand_over(self, want: Callable[[list[tuple[int, int, int]]], None], runs: list[tuple[int, int, int]],
                   follow: Callable[[], None] | None) -> None:
        """Outside the lock: `runs` to `want`, and `follow()` when blocks were left to the download."""
        if runs:
            want(runs)
        if follow is not None:
            follow()

    # -- the ledger of claims ----------------------------------------------------------------------
    def _free(self) -> np.ndarray:
        return ~self.published & (self.claimed == 0)

    def _free_for_readers(self, ahead: bool) -> np.ndarray:
        """Blocks a reader's GET may claim: those the download's stalled GETs have not finished; free ones
        (no GET holds them) when fetching `ahead` or when the download shows no progress for `STALLED_S`
        (else its GETs claim them, in file order: out-of-order GETs cost a request each); and (`ahead`)
        the download's blocks well ahead of its GETs."""
        now = time.monotonic()
        free = self._free() if ahead or now - self._last > STALLED_S else np.zeros_like(self.published)
        for claim, (front, seen) in self._fronts.items():
            if now - seen > STALLED_S:
                start = front
            elif ahead:
                start = front + STEAL_AHEAD
            else:
                continue
            held = start + np.flatnonzero(self.claimed[start:] == claim)
            free[held] = ~self.published[held]
        return free

    def _stalled(self) -> bool:
        """Whether the download published nothing for `STALLED_S`, or one of its GETs received nothing for
        as long (`_free_for_readers` then frees blocks for a following read; caller holds the lock)."""
        now = time.monotonic()
        return now - self._last > STALLED_S or any(now - seen > STALLED_S for _, seen in self._fronts.values())

    def _claim(self, first: int, end: int) -> tuple[int, int, int]:
        self._claims += 1
        self.claimed[first:end] = self._claims
        self._intact.add(self._claims)
        return self._claims, first, end

    def claim_next(self, start: int, most: int) -> tuple[int, int, int] | None:
        """Claim the next run of at most `most` blocks nobody published or claimed, from block `start`
        on (then from block 0): (claim id, first block, end block), or None when there is none."""
        with self._lock:
            free = self._free()
            after = np.flatnonzero(free[start:])
            if len(after):
                first = start + int(after[0])
            else:
                before = np.flatnonzero(free[:start])
                if not len(before):
                    return None
                first = int(before[0])
            stop = np.flatnonzero(~free[first : first + most])
            got = self._claim(first, first + (int(stop[0]) if len(stop) else min(most, len(free) - first)))
            self._fronts[got[0]] = (first, time.monotonic())
            return got

    def take(self, claim: int, first: int, upto: int) -> tuple[np.ndarray | None, bool]:
        """Claim `claim` received bytes of blocks [first, upto] and its GET's next byte lies in block
        `upto` (every block before it is complete): which of blocks [first, upto] it still holds
        (bools; None when it holds every block it was given: nobody took any over and it was not
        given back), and whether its GET should go on: it holds a block among the next
        `SKIP_THROUGH` from `upto` (a few blocks a reader's GET took over are received and dropped
        rather than ending the GET and starting another). A download's claim records `upto` as where
        its GET has got to (`STEAL_AHEAD`)."""
        with self._lock:
            if claim in self._fronts:
                self._fronts[claim] = (upto, time.monotonic())
            if claim in self._intact:
                return None, True
            held = self.claimed[first : upto + SKIP_THROUGH] == claim
            return held[: upto + 1 - first], bool(held[upto - first :].any())

    def claim_wanted(self, ids: np.ndarray, *, ahead: bool = True) -> list[tuple[int, int, int]]:
        """Claim runs (claim id, first block, end block) covering the blocks of `ids` that nobody holds,
        that the download's stalled GETs hold, or (`ahead`) that its GETs hold well ahead of where they
        got to (`STEAL_AHEAD`), grouped as `set_want` says."""
        with self._lock:
            return self._claim_wanted(ids, ahead)[0]

    def _claim_wanted(self, ids: np.ndarray, ahead: bool = True) -> tuple[list[tuple[int, int, int]], bool]:
        """(`claim_wanted`'s runs, whether fetching ahead they were left to the download: `AHEAD_MOST`)."""
        if not ahead and not self._stalled():  # a following read takes blocks only from a stalled download
            return [], False
        ids = np.unique(ids)
        left = ahead and self._covers_most(ids)
        free = self._free_for_readers(ahead and not left)
        ids = ids[free[ids]]
        runs: list[tuple[int, int, int]] = []
        if not len(ids):
            return runs, left
        first = last = int(ids[0])
        for j in [*ids[1:].tolist(), None]:
            if (j is not None and j - last <= self._gap and j - first < self._run
                    and bool(free[last + 1 : j + 1].all())):
                last = j
                continue
            before = self.claimed[first : last + 1]
            self._intact.difference_update(before[before != 0].tolist())  # blocks taken over from these claims
            runs.append(self._claim(first, last + 1))
            if j is not None:
                first = last = j
        return runs, left

    def _covers_most(self, ids: np.ndarray) -> bool:
        """Whether GETs for the wanted blocks `ids` (unique) would bring `AHEAD_MOST` or more of the
        blocks not published yet: wanted blocks up to `gap` apart count with the blocks between them, as
        `claim_wanted` merges them (its cap on a run's length, which may leave such a gap out, is not
        counted)."""
        missing = ids[~self.published[ids]]
        if len(missing) < 2:
            return False
        gaps = np.diff(missing)
        covered = 1 + int(np.where(gaps <= self._gap, gaps, 1).sum())
        return covered >= AHEAD_MOST * (len(self.published) - int(np.count_nonzero(self.published)))

    def owned(self, claim: int, first: int, end: int) -> np.ndarray:
        """Which of blocks [first, end) claim `claim` holds (bools)."""
        with self._lock:
            return self.claimed[first:end] == claim

    def unclaim(self, claim: int) -> None:
        """Claim `claim` ended without bringing all its blocks: the unpublished ones are free again."""
        with self._lock:
            self._fronts.pop(claim, None)
            self._intact.discard(claim)
            lost = (self.claimed == claim) & ~self.published
            self.claimed[lost] = 0
            if lost.any():
                self._cond.notify_all()

    def outstanding(self) -> list[int]:
        """Claims that hold unpublished blocks."""
        with self._lock:
            return sorted(set(self.claimed[~self.published].tolist()) - {0})

    def wait_free(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) until every block is published (True) or some block is unclaimed
        and unpublished (True); False when neither happened in time."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not (self.published.all() or self._free().any()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
            return True

    def progress(self) -> None:
        """The download is alive (an attempt started): restarts the readers' stall clock."""
        with self._lock:
            self._last = time.monotonic()

    def move(self, rename: Callable[[], None], final_path: str) -> None:
        """Run `rename` (the temp file to `final_path`) and record it in one step: `path` is never stale."""
        with self._lock:
            rename()
            self._path = final_path

    def finish(self, final_path: str) -> None:
        """Every block was verified and the file was renamed to `final_path`."""
        with self._lock:
            self._path = final_path
            self.published[:] = True
            self._state = "complete"
            self.on_want = self.on_follow = None  # nothing left to fetch (and the finished download is let go)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The download failed for good: waiters raise `error`."""
        with self._lock:
            if self._state == "running":
                self._state, self._error = "failed", error
            self.on_want = self.on_follow = None
            self._cond.notify_all()

    # -- the readers' side -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Where the file is now: the temp file, or the cached file once renamed in."""
        if os.getpid() != self._pid:
            return self._final if self._landed() else self._path
        with self._lock:
            return self._path

    @property
    def complete(self) -> bool:
        """Whether every block arrived (the file is in the cache now)."""
        if os.getpid() != self._pid:
            return self._landed()
        return self._state == "complete"

    def wait(self, ids: np.ndarray, *, ahead: bool = True) -> bool:
        """Block until the blocks `ids` (local block numbers) arrived, asking for them (`_ask`; `ahead`:
        also those the download's GETs will bring later). Returns True when this process's
        download verified them (the caller may take them as verified), False when the caller must hash
        them itself (a forked child). Raises the download's error when it failed, `TimeoutError`
        when no block arrived for `stall_s` seconds."""
        if len(ids) and bool(self.published[ids].all()):
            return True  # published blocks are final (a forked child inherited these bits too)
        if os.getpid() != self._pid:
            return self._wait_foreign()
        ask = True
        me = threading.get_ident()
        while True:
            if ask:  # first, then after each quiet `ASK_AGAIN_S`: a stalled GET's blocks become free to claim
                self._ask(ids, ahead=ahead)
            with self._lock:
                self._waiting.pop(me, None)
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
                self._waiting[me] = ids
                ask = not self._cond.wait(timeout=min(left, ASK_AGAIN_S))

    def ask(self, ids: np.ndarray, *, ahead: bool = True) -> None:
        """Ask for the blocks `ids` without waiting for them (as `wait` does first): a reader that will
        wait for blocks of several shards asks for all of them before it waits for any, so that their
        GETs run at once rather than one shard after another."""
        if len(ids) and not bool(self.published[ids].all()):
            self._ask(ids, ahead=ahead)

    def _ask(self, ids: np.ndarray, *, ahead: bool = True) -> None:
        """Claim the blocks of `ids` that a reader's GET may take (`claim_wanted`) and hand them to
        `on_want` (fetched out of order); no wait. In a forked child (the record is its parent's) it
        does nothing."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            want = self.on_want
            if self._state != "running":
                return
            if want is None:  # the block table has not arrived: `set_want` asks for these
                self._wanted[ids] = True
                self._wanted_ahead |= ahead
                return
            runs, left = self._claim_wanted(ids, ahead)
            follow = self.on_follow if left else None
        self._hand_over(want, runs, follow)

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
