"""`ShardCache`: an on-disk, byte-budgeted LRU cache of whole shard files shared by processes.

Every process (loader workers, ranks, several loaders) that points at the same directory shares
one budget. Layout of `root`: `data/<key>` holds complete, verified files; `tmp/<key>.<pid>.<n>`
downloads in flight (their bytes reserved in the budget up front); the shared state and its locks
are described in `fastload.cache_state`.

Parts, one concept each:
- `fastload.cache_state.CacheState`: the shared state and this owner's pin ledger, the single
  place pins are counted; dead owners' pins, reservations and temp files are dropped on every update;
- `fastload.cache_policy.LruPolicy`: what is evicted to make room, and when a wait for room is a deadlock;
- `fastload.cache_files.Download`: a download hashed as it is written;
- this module: acquire / prefetch / release on top of them.

The bytes on disk never exceed `limit`: a download reserves its full size before its temp file is
created, and the reservation becomes the entry when the file is renamed in.

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
import threading
import time
from collections.abc import Callable
from typing import Any

from .cache_files import Download, check_key, file_xxh3, stamp
from .cache_policy import LruPolicy, Room
from .cache_state import CacheBudgetError, CacheState, CacheStateError, owner_alive, owner_id, unlink
from .formats.forksafe import reset_in_child
from .formats.units import format_size, parse_size
from .transfer_stats import TransferStats

__all__ = [
    "CacheBudgetError",
    "CacheStateError",
    "Download",
    "ShardCache",
    "default_cache_dir",
    "owner_alive",
    "owner_id",
]

_POLL_S = 0.02
_VERIFY_MODES = ("stat", "once", "always")


def default_cache_dir() -> str:
    """`$FASTLOAD_CACHE_DIR`, else `~/.cache/fastload/shards`."""
    return os.environ.get("FASTLOAD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastload", "shards")


class ShardCache:
    """Whole-file cache in `root` holding at most `limit` bytes of shard data (plus a few KB of state).

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
        self._reset_process_state()
        with self._locked() as state:
            self._store.sweep_tmp(state)
            used = CacheState.used(state)
        self.limit = int(0.8 * (_free_bytes(self.root) + used)) if limit is None else parse_size(limit)
        if self.limit <= 0:
            raise CacheBudgetError(f"cache_limit must be > 0 bytes, got {limit!r}")
        self._policy = LruPolicy(limit=self.limit, data_dir=self.data_dir)

    def __repr__(self) -> str:
        return f"ShardCache({self.root!r}, limit={format_size(self.limit)})"

    def __getstate__(self) -> dict[str, Any]:
        keep = ("root", "data_dir", "tmp_dir", "verify", "fsync", "wait_timeout", "deadlock_grace", "limit")
        # a copy in another process is a new owner: it holds no pins, claims or soft pins
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = -1
        self._reset_process_state()
        self._policy = LruPolicy(limit=self.limit, data_dir=self.data_dir)

    def _reset_process_state(self) -> None:
        reset_in_child(self, ShardCache._reset_process_state)  # no lock crosses a fork locked
        self._pid = os.getpid()
        self._store = CacheState(root=self.root, data_dir=self.data_dir, tmp_dir=self.tmp_dir)
        self._mutex = self._store.mutex  # serialises this owner's threads (taken by `_locked` too)
        self._verified: dict[str, list[int | str]] = {}  # key -> stat stamp hashed by this owner
        self._inflight: dict[str, threading.Event] = {}  # key -> download running in this process
        self._tmp_seq = 0
        self.transfer = TransferStats()  # this process's download timings (`stats()`)

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
        store = getattr(self, "_store", None)  # no lock here: see `CacheState.collected`
        if store is not None and getattr(self, "_pid", None) == os.getpid():
            store.collected()

    # -- public ---------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """Where the cached file of `key` lives (it may be missing)."""
        return os.path.join(self.data_dir, check_key(key))

    def state(self) -> dict[str, Any]:
        """A copy of the shared state (entries, pins, soft pins, reservations, waiters), for diagnostics."""
        with self._locked() as state:
            return json.loads(json.dumps(state))

    def usage(self) -> dict[str, int]:
        """Bytes and files held now: `bytes` (complete + reserved), `files`, `pinned`, `reserved`."""
        with self._locked() as state:
            return {
                "bytes": CacheState.used(state),
                "files": len(state["entries"]),
                "pinned": sum(1 for p in state["pins"].values() if p),
                "reserved": sum(r["size"] for r in state["reserved"].values()),
                "limit": self.limit,
            }

    def disk_bytes(self) -> int:
        """Bytes of the files under `data/` and `tmp/` right now, measured on disk (for tests)."""
        total = 0
        for d in (self.data_dir, self.tmp_dir):
            with os.scandir(d) as it:
                for de in it:
                    with contextlib.suppress(FileNotFoundError):
                        total += de.stat().st_size
        return total

    def stats(self) -> dict[str, float]:
        """This process's download timings and counters (see `fastload.transfer_stats`)."""
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
        path = self._obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, soft=False)
        assert path is not None
        return path

    def prefetch(self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str = "") -> bool:
        """Download `key` into the cache under a soft pin if it fits without evicting pinned or soft-pinned files.

        Returns False (nothing done) when there is no room now; never waits for room.
        """
        check_key(key)
        return self._obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, soft=True) is not None

    def release(self, key: str) -> None:
        """Drop one pin taken by `acquire` in this process (none held, e.g. taken before a fork: nothing)."""
        self._check_pid()
        with self._mutex:
            if self._store.unpin_local(key) != 1:
                return
            with self._locked() as state:
                self._store.unhold(state, key)
                if key in state["entries"]:
                    state["entries"][key]["used"] = time.time()

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

    def claim(self, nbytes: int) -> int:
        """Record that this owner may pin up to `nbytes` at once; returns the bytes other live owners
        claim. Claims only inform budget checks (`RemoteStorage` refuses a reader whose claim does
        not fit next to the others' instead of letting it deadlock later); 0 withdraws the claim."""
        self._check_pid()
        with self._mutex:
            self._store.claim = int(nbytes)
            return self.claimed_by_others()

    def claimed_by_others(self) -> int:
        """Bytes that other live owners of this cache have claimed (see `claim`)."""
        with self._locked() as state:
            return sum(c for o, c in state["claims"].items() if o != self._store.owner)

    def clear(self) -> None:
        """Delete every unpinned, unreserved file."""
        with self._locked() as state:
            for key in list(state["entries"]):
                if not state["pins"].get(key):
                    unlink(os.path.join(self.data_dir, key))
                    del state["entries"][key]
                    state["soft"].pop(key, None)

    # -- internals ------------------------------------------------------------------------------
    def _obtain(
        self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str, soft: bool
    ) -> str | None:
        if size > self.limit:
            raise CacheBudgetError(
                f"{where}: a {format_size(size)} shard does not fit in cache_limit={format_size(self.limit)} "
                f"({self.root}); raise cache_limit to at least a few shards"
            )
        while True:
            event = self._wait_inflight(key)
            if event is not None:
                event.wait()
                continue
            kind, value = self._find_or_reserve(key, size=size, where=where, soft=soft)
            if kind == "none":
                return None
            if kind == "soft":
                return value
            if kind == "download":
                tmp, event = value
                return self._download(key, tmp, event, size=size, xxh3=xxh3, fetch=fetch, where=where, soft=soft)
            path = self.path(key)  # "entry": cached, pinned now; verify before its first use here
            try:
                ok = self._verify_cached(key, path, size=size, xxh3=xxh3, recorded=value)
            except BaseException:
                with self._locked() as state:
                    self._store.unhold(state, key)
                raise
            if ok:
                with self._mutex:
                    self._store.usable.add(key)
                return path
            self._drop_corrupt(key)

    def _find_or_reserve(self, key: str, *, size: int, where: str, soft: bool) -> tuple[str, Any]:
        """Wait until one `_step` decides; raises `CacheBudgetError` on a deadlock or past `wait_timeout`."""
        wait_since: float | None = None
        stuck_since: float | None = None
        while True:
            with self._locked() as state:
                kind, value = self._step(state, key, size=size, soft=soft)
            if kind == "event":
                value.wait()
                continue
            if kind != "wait":
                return kind, value
            room, deadlocked = value
            now = time.monotonic()
            wait_since = wait_since or now
            stuck_since = (stuck_since or now) if deadlocked else None
            if stuck_since is not None and now - stuck_since >= self.deadlock_grace:
                with self._locked() as state:
                    state["waiting"].pop(self._store.owner, None)
                    raise CacheBudgetError(self._policy.deadlock_message(state, size=size, where=where, root=self.root))
            if now - wait_since > self.wait_timeout:
                with self._locked() as state:
                    state["waiting"].pop(self._store.owner, None)
                raise CacheBudgetError(
                    f"{where}: waited {self.wait_timeout:.0f}s for room in cache {self.root} "
                    f"(limit {format_size(self.limit)}; {room.waiting_on or 'pinned by other processes'})"
                )
            time.sleep(_POLL_S)

    def _step(self, state: dict[str, Any], key: str, *, size: int, soft: bool) -> tuple[str, Any]:
        """One look at the state (under its lock): ("entry", stamp) cached and pinned now; ("soft", path)
        cached, for a prefetch; ("download", (tmp, event)) reserved for a download by this thread;
        ("event", event) wait for this process's download; ("wait", (room, deadlocked)); ("none", None)
        a prefetch finds no room or another download in flight."""
        me = self._store.owner
        entry = state["entries"].get(key)
        if entry is not None:
            state["waiting"].pop(me, None)
            if soft:
                if not state["pins"].get(key):  # a pinned file is in use: nothing to protect
                    state["soft"].setdefault(key, me)
                return "soft", self.path(key)
            self._store.hold(state, key)
            state["soft"].pop(key, None)
            entry["used"] = time.time()
            return "entry", entry.get("stamp")
        res = state["reserved"].get(key)
        if res is not None:
            if soft:
                return "none", None
            event = self._wait_inflight(key) if res["owner"] == me else None
            if event is not None:  # another thread of this owner downloads it
                return "event", event
            return "wait", (Room(False, waiting_on=f"download of {key} by process {res['owner']}"), False)
        room = self._policy.make_room(state, size, soft=soft)
        if room.ok:
            tmp = self._tmp_name(key)
            state["reserved"][key] = {"owner": me, "size": size, "tmp": tmp, "soft": soft}
            state["waiting"].pop(me, None)
            if not soft:
                self._store.hold(state, key)
            event = threading.Event()
            self._inflight[key] = event  # under the mutex, with the reservation
            return "download", (tmp, event)
        if soft:
            return "none", None
        state["waiting"][me] = {"key": key, "size": size}
        return "wait", (room, self._policy.deadlocked(state, me))

    def _wait_inflight(self, key: str) -> threading.Event | None:
        with self._mutex:
            return self._inflight.get(key)

    def _tmp_name(self, key: str) -> str:
        with self._mutex:
            self._tmp_seq += 1
            return f"{key}.{os.getpid()}.{self._tmp_seq}"

    def _download(
        self,
        key: str,
        tmp: str,
        event: threading.Event,
        *,
        size: int,
        xxh3: str,
        fetch: Callable[[Download], None],
        where: str,
        soft: bool,
    ) -> str:
        tmp_path = os.path.join(self.tmp_dir, tmp)
        final = self.path(key)
        ok = False
        try:
            sink = Download(tmp_path, size=size, xxh3=xxh3, where=where, stats=self.transfer)
            try:
                fetch(sink)
                sink.check()
                # No fsync by default: the rename below happens only after every byte written was
                # hashed and matched the manifest, so a process crash leaves either no file or a
                # verified one. A power loss can leave a renamed file whose pages never reached the
                # disk; its stamp carries the boot id, so after the reboot it is hashed again before
                # any use (every verify mode) and fetched anew when it does not match.
                sink.finish(fsync=self.fsync)
            finally:
                sink.close()
            t0 = time.perf_counter()
            os.replace(tmp_path, final)
            st = stamp(os.stat(final))
            with self._locked() as state:
                state["reserved"].pop(key, None)
                state["entries"][key] = {"size": size, "used": time.time(), "stamp": st}
                if soft:
                    state["soft"][key] = self._store.owner
                self._verified[key] = st
                if not soft:
                    self._store.usable.add(key)
            self.transfer.add("commit_s", time.perf_counter() - t0)
            ok = True
            return final
        finally:
            if not ok:
                unlink(tmp_path)
                with self._locked() as state:
                    state["reserved"].pop(key, None)
                    if not soft:
                        self._store.unhold(state, key)
            with self._mutex:
                self._inflight.pop(key, None)
            event.set()

    def _verify_cached(self, key: str, path: str, *, size: int, xxh3: str, recorded: list[int | str] | None) -> bool:
        """Whether the cached file matches: its stamp was hashed by this owner, or (`verify="stat"`)
        matches the `recorded` one, or its xxh3 matches now (the stamp is recorded then)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        now = stamp(st)
        if st.st_size != size:
            return False
        with self._mutex:
            seen = None if self.verify == "always" else self._verified.get(key)
        if seen == now:
            return True
        if self.verify == "stat" and recorded == now:
            with self._mutex:
                self._verified[key] = now
            return True
        if file_xxh3(path) != xxh3.lower():
            return False
        with self._locked() as state:
            self._verified[key] = now
            if key in state["entries"]:
                state["entries"][key]["stamp"] = now
        return True

    def _drop_corrupt(self, key: str) -> None:
        """Unpin and remove a cached file that failed verification (it is fetched again)."""
        with self._locked() as state:
            self._verified.pop(key, None)
            self._store.unhold(state, key)
            # Readers elsewhere keep their mapping of the old inode; new opens get the re-fetch.
            unlink(self.path(key))
            state["entries"].pop(key, None)
            state["soft"].pop(key, None)



def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
