"""`ShardCache`: an on-disk, byte-budgeted LRU cache of whole shard files shared by processes.

Every process (loader workers, ranks, several loaders) that points at the same directory shares
one budget. Layout of `root`: `data/<key>` holds complete, verified files; `tmp/<key>.<pid>.<n>`
downloads in flight (their bytes reserved in the budget up front); the shared state and its locks
are described in `fastload.remote.cache.state`.

Parts, one concept each:
- `fastload.remote.cache.state.CacheState`: the shared state and this owner's pin ledger, the single
  place pins are counted; dead owners' pins, reservations and temp files are dropped on every update;
- `fastload.remote.cache.policy.LruPolicy`: what is evicted to make room, and when a wait for room is a deadlock;
- `fastload.remote.cache.files.Download`: a download hashed as it is written;
- this module: acquire / prefetch / release on top of them.

The bytes the cache occupies on its file system never exceed `limit`: every file counts at its
block footprint (complete files, downloads, which reserve their full size before their temp file is
created, and retired files), the state file counts too, and a file something still maps is never
evicted (`LruPolicy`). Readers sharing the directory split the budget through their claims
(`claim`, `cache_policy.split_budget`).

Downloads are renamed into `data/` only after their size and xxh3 match the manifest; a process
crash cannot leave a partial file there. A cached file is hashed against the caller's xxh3 before
its first use by each `ShardCache` object (`verify="once"`, the default), so a file damaged on disk
(even with its size and mtime restored) is evicted and fetched again; `verify="stat"` trusts a
matching size + mtime + inode stamp recorded by whoever hashed it (faster, opt-in), `"always"`
hashes on every acquire. Stamps carry the boot id, so after a reboot every file is hashed again.
Pinned entries (`acquire` .. `release`) are never evicted.
Soft pins protect prefetched files from other prefetches until they are used; a demand fetch may
still evict them. A demand fetch that cannot make room waits for other processes to release pins;
when every pin holder is itself waiting (the budget cannot hold the shards in use at once) it
raises `CacheBudgetError` instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from fastload.formats.forksafe import reset_in_child
from fastload.formats.units import format_size, parse_size
from fastload.remote.cache.arrival import Arrival, BlockSpec
from fastload.remote.cache.files import Download, check_key, disk_bytes, footprint
from fastload.remote.cache.fill import CacheFill
from fastload.remote.cache.policy import LruPolicy, split_budget
from fastload.remote.cache.state import CacheBudgetError, CacheState, CacheStateError, owner_alive, owner_id
from fastload.remote.transfer_stats import TransferStats

__all__ = [
    "Arrival",
    "BlockSpec",
    "CacheBudgetError",
    "CacheStateError",
    "Download",
    "ShardCache",
    "default_cache_dir",
    "owner_alive",
    "owner_id",
]

_VERIFY_MODES = ("stat", "once", "always")


def default_cache_dir() -> str:
    """`$FASTLOAD_CACHE_DIR`, else `~/.cache/fastload/shards`."""
    return os.environ.get("FASTLOAD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastload", "shards")


class ShardCache:
    """Whole-file cache in `root` holding at most `limit` bytes: shard data and its state file.

    `acquire(key, size=, xxh3=, fetch=)` returns the local path of a verified file and pins it
    until `release(key)`; `fetch(download)` is called to fill a missing file. Keys are file names
    chosen by the caller (they must be unique per content). Pins are reference counts per process.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        limit: int | str | None = None,
        verify: str = "once",
        fsync: bool = False,
        wait_timeout: float = 600.0,
        deadlock_grace: float = 2.0,
    ) -> None:
        if verify not in _VERIFY_MODES:
            raise ValueError(f"verify must be one of {_VERIFY_MODES}, got {verify!r}")
        self.root = os.path.abspath(os.fspath(root if root is not None else default_cache_dir()))
        self.data_dir = os.path.join(self.root, "data")
        self.tmp_dir = os.path.join(self.root, "tmp")
        os.makedirs(self.data_dir, exist_ok=True)
        os.makedirs(self.tmp_dir, exist_ok=True)
        self.verify, self.fsync = verify, fsync
        self.wait_timeout, self.deadlock_grace = float(wait_timeout), float(deadlock_grace)
        self._pid = -1
        self.on_wait: Callable[[], Callable[[], None] | None] | None = None  # (weak) called while waiting for room
        self._reset_process_state()
        with self._locked() as state:
            self._store.sweep_tmp(state)
            used = CacheState.used(state)
        self.block = self._store.block  # files occupy whole blocks: counted so
        self.limit = int(0.8 * (_free_bytes(self.root) + used)) if limit is None else parse_size(limit)
        if self.limit <= 0:
            raise CacheBudgetError(f"cache_limit must be > 0 bytes, got {limit!r}")
        self._fill = self._new_fill()

    def __repr__(self) -> str:
        return f"ShardCache({self.root!r}, limit={format_size(self.limit)})"

    def __getstate__(self) -> dict[str, Any]:
        keep = ("root", "data_dir", "tmp_dir", "verify", "fsync", "wait_timeout", "deadlock_grace", "limit", "block")
        # a copy in another process is a new owner: it holds no pins, claims or soft pins
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.on_wait = None
        self._pid = -1
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        reset_in_child(self, ShardCache._reset_process_state)  # no lock crosses a fork locked
        self._pid = os.getpid()
        self.transfer = TransferStats()  # this process's download timings (`stats()`)
        self._store = CacheState(root=self.root, data_dir=self.data_dir, tmp_dir=self.tmp_dir, stats=self.transfer)
        self._mutex = self._store.mutex  # serialises this owner's threads (taken by `_locked` too)
        if hasattr(self, "limit"):  # set in __init__ after the first call (it needs the state)
            self._fill = self._new_fill()

    def _new_fill(self) -> CacheFill:
        return CacheFill(
            store=self._store,
            policy=self._policy(),
            transfer=self.transfer,
            verify=self.verify,
            fsync=self.fsync,
            wait_timeout=self.wait_timeout,
            deadlock_grace=self.deadlock_grace,
            on_wait=self._waiting,
        )

    def _waiting(self) -> None:
        """A demand fetch waits for room: let this process's other readers of the cache shrink (`on_wait`)."""
        ref = self.on_wait
        fn = ref() if ref is not None else None
        if fn is not None:
            fn()

    def _policy(self) -> LruPolicy:
        return LruPolicy(limit=self.limit, data_dir=self.data_dir, tmp_dir=self.tmp_dir, block=self.block,
                         state_file_bytes=self._store.file_bytes)

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset_process_state()

    def _locked(self) -> contextlib.AbstractContextManager[dict[str, Any]]:
        self._check_pid()
        return self._store.locked()

    def close(self) -> None:
        """Drop this owner's pins, soft pins, claim and wait, and close its files."""
        if getattr(self, "_pid", None) == os.getpid():
            self._store.close()

    def __del__(self) -> None:
        # module globals may already be None at interpreter exit (the OS drops the flocks then)
        try:
            store = getattr(self, "_store", None)  # no lock here: see `CacheState.collected`
            if store is not None and getattr(self, "_pid", None) == os.getpid():
                store.collected()
        except Exception:  # noqa: BLE001 - nothing to report to during interpreter shutdown
            pass

    # -- public ---------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """Where the cached file of `key` lives (it may be missing)."""
        return os.path.join(self.data_dir, check_key(key))

    def state(self) -> dict[str, Any]:
        """A copy of the shared state (entries, pins, soft pins, reservations, waiters), for diagnostics."""
        with self._locked() as state:
            return json.loads(json.dumps({**state, "entries": state["entries"].copy()}))

    def usage(self) -> dict[str, int]:
        """Bytes and files held now: `bytes` (complete + reserved + retired, at their sizes), `files`,
        `pinned`, `reserved`, `retired` (files removed while still mapped, counted until unmapped),
        `occupied` (what the budget counts: every file at its block footprint plus the state file)."""
        with self._locked() as state:
            return {
                "bytes": CacheState.used(state),
                "files": len(state["entries"]),
                "pinned": sum(1 for p in state["pins"].values() if p),
                "reserved": sum(r["size"] for r in state["reserved"].values()),
                "retired": sum(state["retired"].values()),
                "occupied": self._policy().occupied(state),
                "limit": self.limit,
            }

    def footprint(self, size: int) -> int:
        """Bytes a file of `size` bytes takes from the budget (whole blocks of the cache's file system)."""
        return footprint(size, self.block)

    def state_bytes(self) -> int:
        """What the budget counts for the cache's own state file now (see `LruPolicy.state_overhead`)."""
        with self._locked():  # the state file exists from here on
            return self._policy().state_overhead()

    def discard(self, key: str) -> str:
        """The cached copy of `key` failed a check while read: take it out of the cache (retired while
        something still maps it) so that the next acquire fetches it again; returns its path."""
        check_key(key)
        self._check_pid()
        self._fill.forget(key)
        with self._locked() as state:
            self._policy().remove(state, key)
        return self.path(key)

    def disk_bytes(self) -> int:
        """Bytes of the files under `data/` and `tmp/` that exist together, measured on disk (for tests)."""
        return disk_bytes(self.root)

    def stats(self) -> dict[str, float]:
        """This process's download timings and counters (see `fastload.remote.transfer_stats`)."""
        self._check_pid()
        return self.transfer.snapshot()

    def contains(self, key: str) -> bool:
        """Whether a complete file for `key` is cached (verified or not)."""
        with self._locked() as state:
            return check_key(key) in state["entries"]

    def acquire(self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str = "") -> str:
        """Pin `key` and return its local path, calling `fetch` to download it when missing or corrupt."""
        check_key(key)
        self._check_pid()
        if self._store.repin(key):  # held and verified by this owner: one more pin, no state update
            return self.path(key)
        path = self._fill.obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, soft=False)
        assert path is not None
        return path

    def acquire_arriving(
        self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], blocks: BlockSpec, where: str = ""
    ) -> tuple[str, Arrival | None]:
        """Pin `key` like `acquire`, but when the file is missing, or downloading in this process, return
        at once: (path of the file as it arrives, its `Arrival`), the download verified by block
        (`blocks`) and running in the background; a reader waits in `Arrival.wait` for the blocks it
        reads. (path, None) when the file is cached, or downloading in another process (waited for whole)."""
        check_key(key)
        self._check_pid()
        if self._store.repin(key):
            return self.path(key), None
        return self._fill.obtain_arriving(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, blocks=blocks)

    def prefetch(
        self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str = "",
        blocks: BlockSpec | None = None,
    ) -> bool:
        """Download `key` into the cache under a soft pin if it fits without evicting pinned or soft-pinned files
        (verified by block with `blocks`, so that `acquire_arriving` can read it while it arrives).

        Returns False (nothing done) when there is no room now; never waits for room.
        """
        check_key(key)
        got = self._fill.obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, soft=True, blocks=blocks)
        return got is not None

    def release(self, key: str) -> None:
        """Drop one pin taken by `acquire` in this process (none held, e.g. taken before a fork: nothing)."""
        self._check_pid()
        with self._mutex:
            if self._store.unpin_local(key) != 1:
                return
            with self._locked() as state:
                self._store.unhold(state, key)
                state["entries"].touch(key, time.time())

    def unsoft(self, keys: list[str] | None = None) -> None:
        """Drop this process's soft pins on `keys` (all of them when None)."""
        with self._locked() as state:
            me = self._store.owner
            for k, o in list(state["soft"].items()):
                if o == me and (keys is None or k in keys):
                    del state["soft"][k]

    def soft_keys(self) -> set[str]:
        """Keys this process prefetched that nobody has acquired (nor evicted) since."""
        with self._locked() as state:
            return {k for k, o in state["soft"].items() if o == self._store.owner}

    def pinned_keys(self) -> dict[str, int]:
        """This owner's pins (key -> count), acquisitions in progress included."""
        self._check_pid()
        with self._mutex:
            return dict(self._store.held)

    def claim(self, most: int, *, least: int | None = None, record: bool = True) -> int | None:
        """Claim the right to pin between `least` (default `most`) and `most` bytes at once, as one
        of the readers sharing this cache: live claims split what the budget holds beside the state
        files (`split_budget`: each gets its least, the rest is shared evenly), so a new reader
        shrinks the others' shares instead of failing. Returns this owner's share in bytes, or None
        when the leasts of every live claim, this one included, do not fit (then nothing is
        recorded). `record=False` only computes the share; `most=0` withdraws the claim."""
        self._check_pid()
        with self._mutex:
            if most <= 0:
                self._store.claim = None
                with self._locked():
                    return 0
            want = [int(most if least is None else least), int(most)]
            me = self._store.owner
            if not record or self._store.claim == want:  # nothing to write: no update when nobody else wrote
                others = self._store.others_claims()
                if others is not None:
                    shares = self._shares({**others, me: want})
                    if shares is not None:
                        return shares[me]
            with self._locked() as state:
                claims = {o: c for o, c in state["claims"].items() if o != me}
                claims[me] = want
                shares = self._shares(claims)
                if record:
                    self._store.claim = None if shares is None else want
                    if shares is None:
                        state["claims"].pop(me, None)
                    else:
                        state["claims"][me] = want
                return None if shares is None else shares[me]

    def _shares(self, claims: dict[str, Any]) -> dict[str, int] | None:
        """Each claim's share of what the budget holds beside the state files (`split_budget`)."""
        return split_budget(self.limit - self._policy().state_overhead(), claims)

    def claimed_by_others(self) -> int:
        """The least bytes that other live owners of this cache have claimed (see `claim`)."""
        with self._locked() as state:
            return sum(
                c if isinstance(c, int) else int(c[0]) for o, c in state["claims"].items() if o != self._store.owner
            )

    def clear(self) -> None:
        """Delete every unpinned, unreserved file (one still mapped is retired: counted until unmapped)."""
        with self._locked() as state:
            policy = self._policy()
            for key in list(state["entries"]):
                if not state["pins"].get(key):
                    policy.remove(state, key)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
