"""`CacheFill`: how a file gets into the shard cache for one owner: wait for it, reserve room
(evicting by `LruPolicy`), download into a temp file, verify, rename in; or verify a cached file
before this owner's first use of it.

Thread safety: every state change runs under `CacheState.locked()`; `_inflight` (downloads running
in this process, so a second thread waits for the first instead of downloading again) and
`_verified` change under `CacheState.mutex`. One object per owner and process (rebuilt after a fork).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from fastload.formats.blocks import vouch_file
from fastload.formats.units import format_size
from fastload.remote.cache.files import Download, file_xxh3, stamp
from fastload.remote.cache.policy import LruPolicy, Room
from fastload.remote.cache.state import CacheBudgetError, CacheState, unlink
from fastload.remote.transfer_stats import TransferStats

__all__ = ["CacheFill"]

_POLL_S = 0.02


class _Flight:
    """A download running in this process: `done` is set when it ends, `error` says how it failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None

    def wait(self) -> None:
        """Wait for the download; raise its error when it failed (its retries were spent: a thread
        that waited for it does not start a second round)."""
        self.done.wait()
        err = self.error
        if err is not None:
            try:
                again = type(err)(*err.args)
            except Exception:  # noqa: BLE001 - an error type that cannot be rebuilt: raise it as is
                raise err from None
            raise again from err


class CacheFill:
    """Fills and verifies cache entries of `store`'s owner under the budget `policy` enforces."""

    def __init__(
        self,
        *,
        store: CacheState,
        policy: LruPolicy,
        transfer: TransferStats,
        verify: str,
        fsync: bool,
        wait_timeout: float,
        deadlock_grace: float,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        self._store, self._policy, self._transfer = store, policy, transfer
        self._on_wait = on_wait  # called on each look while a demand fetch waits for room
        self.verify, self.fsync = verify, fsync
        self.wait_timeout, self.deadlock_grace = wait_timeout, deadlock_grace
        self.limit, self.root = policy.limit, store.root
        self._mutex = store.mutex
        self._verified: dict[str, list[int | str]] = {}  # key -> stat stamp hashed by this owner
        self._inflight: dict[str, _Flight] = {}  # key -> download running in this process
        self._tmp_seq = 0

    def _path(self, key: str) -> str:
        return os.path.join(self._store.data_dir, key)

    def obtain(
        self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str, soft: bool
    ) -> str | None:
        """Pin `key` (a soft pin when `soft`) and return its verified path, downloading it with `fetch`
        when missing or corrupt; a prefetch (`soft`) returns None when there is no room now."""
        if self._policy.occupied({"entries": {}, "reserved": {}, "retired": {}}) + size > self.limit:
            raise CacheBudgetError(
                f"{where}: a {format_size(size)} shard does not fit in cache_limit={format_size(self.limit)} "
                f"({self.root}); raise cache_limit to at least a few shards"
            )
        while True:
            flight = self._wait_inflight(key)
            if flight is not None:
                flight.wait()
                continue
            kind, value = self._find_or_reserve(key, size=size, where=where, soft=soft)
            if kind == "none":
                return None
            if kind == "soft":
                return value
            if kind == "download":
                tmp, flight = value
                return self._download(key, tmp, flight, size=size, xxh3=xxh3, fetch=fetch, where=where, soft=soft)
            path = self._path(key)  # "entry": cached, pinned now; verify before its first use here
            try:
                ok = self._verify_cached(key, path, size=size, xxh3=xxh3, recorded=value)
            except BaseException:
                with self._store.locked() as state:
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
            with self._store.locked() as state:
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
                with self._store.locked() as state:
                    state["waiting"].pop(self._store.owner, None)
                    raise CacheBudgetError(self._policy.deadlock_message(state, size=size, where=where, root=self.root))
            if now - wait_since > self.wait_timeout:
                with self._store.locked() as state:
                    state["waiting"].pop(self._store.owner, None)
                raise CacheBudgetError(
                    f"{where}: waited {self.wait_timeout:.0f}s for room in cache {self.root} "
                    f"(limit {format_size(self.limit)}; {room.waiting_on or 'pinned by other processes'})"
                )
            if self._on_wait is not None:
                self._on_wait()
            time.sleep(_POLL_S)

    def _step(self, state: dict[str, Any], key: str, *, size: int, soft: bool) -> tuple[str, Any]:
        """One look at the state (under its lock): ("entry", stamp) cached and pinned now; ("soft", path)
        cached, for a prefetch; ("download", (tmp, flight)) reserved for a download by this thread;
        ("event", flight) wait for this process's download (its error is raised); ("wait", (room,
        deadlocked)); ("none", None) a prefetch finds no room or another download in flight."""
        me = self._store.owner
        entry = state["entries"].get(key)
        if entry is not None:
            state["waiting"].pop(me, None)
            if soft:
                if not state["pins"].get(key):  # a pinned file is in use: nothing to protect
                    state["soft"].setdefault(key, me)
                return "soft", self._path(key)
            self._store.hold(state, key)
            state["soft"].pop(key, None)
            entry["used"] = time.time()
            return "entry", entry.get("stamp")
        res = state["reserved"].get(key)
        if res is not None:
            if soft:
                return "none", None
            flight = self._wait_inflight(key) if res["owner"] == me else None
            if flight is not None:  # another thread of this owner downloads it
                return "event", flight
            return "wait", (Room(False, waiting_on=f"download of {key} by process {res['owner']}"), False)
        room = self._policy.make_room(state, size, soft=soft)
        if room.ok:
            tmp = self._tmp_name(key)
            state["reserved"][key] = {"owner": me, "size": size, "tmp": tmp, "soft": soft}
            state["waiting"].pop(me, None)
            if not soft:
                self._store.hold(state, key)
            flight = _Flight()
            self._inflight[key] = flight  # under the mutex, with the reservation
            return "download", (tmp, flight)
        if soft:
            return "none", None
        state["waiting"][me] = {"key": key, "size": size}
        # room held by mapped files frees when their readers let go, whoever waits
        return "wait", (room, not room.mapped and self._policy.deadlocked(state, me))

    def _wait_inflight(self, key: str) -> _Flight | None:
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
        flight: _Flight,
        *,
        size: int,
        xxh3: str,
        fetch: Callable[[Download], None],
        where: str,
        soft: bool,
    ) -> str:
        tmp_path = os.path.join(self._store.tmp_dir, tmp)
        final = self._path(key)
        ok = False
        try:
            sink = Download(tmp_path, size=size, xxh3=xxh3, where=where, stats=self._transfer)
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
            info = os.stat(final)
            vouch_file(info)  # every byte was hashed against the manifest above: readers here skip their block hashes
            st = stamp(info)
            with self._store.locked() as state:
                state["reserved"].pop(key, None)
                state["entries"][key] = {"size": size, "used": time.time(), "stamp": st}
                if soft:
                    state["soft"][key] = self._store.owner
                self._verified[key] = st
                if not soft:
                    self._store.usable.add(key)
            self._transfer.add("commit_s", time.perf_counter() - t0)
            ok = True
            return final
        except Exception as exc:
            flight.error = exc
            raise
        finally:
            if not ok:
                unlink(tmp_path)
                with self._store.locked() as state:
                    state["reserved"].pop(key, None)
                    if not soft:
                        self._store.unhold(state, key)
            with self._mutex:
                self._inflight.pop(key, None)
            flight.done.set()

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
        vouch_file(st)  # `st` is from before the hash: a file changed since has another identity
        with self._store.locked() as state:
            self._verified[key] = now
            if key in state["entries"]:
                state["entries"][key]["stamp"] = now
        return True

    def _drop_corrupt(self, key: str) -> None:
        """Unpin and remove a cached file that failed verification (it is fetched again); readers
        elsewhere keep their mapping of it, and it stays in the budget until they let go."""
        with self._store.locked() as state:
            self.forget(key)
            self._store.unhold(state, key)
            self._policy.remove(state, key)

    def forget(self, key: str) -> None:
        """This owner no longer trusts its copy of `key` (the next acquire checks the cache again)."""
        with self._mutex:
            self._verified.pop(key, None)
            self._store.usable.discard(key)
