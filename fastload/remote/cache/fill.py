"""`CacheFill`: how a file gets into the shard cache for one owner: wait for it, reserve room
(evicting by `LruPolicy`), download into a temp file, verify, rename in; or verify a cached file
before this owner's first use of it.

Thread safety: every state change runs under `CacheState.locked()`; `_inflight` (downloads running
in this process, so a second thread waits for the first instead of downloading again) and
`_verified` change under `CacheState.mutex`. One object per owner and process (rebuilt after a fork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from fastload.formats.blocks import vouch_file
from fastload.formats.units import format_size
from fastload.remote.cache.arrival import Arrival, BlockSpec
from fastload.remote.cache.files import Download, file_xxh3, in_use, stamp
from fastload.remote.cache.policy import LruPolicy, Room
from fastload.remote.cache.state import CacheBudgetError, CacheState, unlink
from fastload.remote.transfer_stats import TransferStats

__all__ = ["CacheFill"]

log = logging.getLogger("fastload.remote.storage")

_POLL_S = 0.02


class _Flight:
    """A download running in this process: `done` is set when it ends, `error` says how it failed;
    `arrival` (a download verified by block) is what readers of the arriving shard wait on."""

    def __init__(self, arrival: Arrival | None = None) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None
        self.arrival = arrival
        self.recorded = False  # its end is in the shared state (entry, or reservation dropped): under the mutex

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
        self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str, soft: bool,
        blocks: BlockSpec | None = None,
    ) -> str | None:
        """Pin `key` (a soft pin when `soft`) and return its verified path, downloading it with `fetch`
        when missing or corrupt; a prefetch (`soft`) returns None when there is no room now. With
        `blocks`, a download it starts is verified by block (its `Arrival` lets readers in while it runs)."""
        got = self._obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where, soft=soft, blocks=blocks)
        return None if got is None else got[0]

    def obtain_arriving(
        self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str, blocks: BlockSpec
    ) -> tuple[str, Arrival | None]:
        """Pin `key` and return its path at once when a download verified by block is (or is now) under
        way in this process: (temp path, its `Arrival`), the download running in the background;
        otherwise as `obtain`: (verified path, None)."""
        got = self._obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where, soft=False, blocks=blocks,
                           arriving=True)
        assert got is not None
        return got

    def _obtain(
        self,
        key: str,
        *,
        size: int,
        xxh3: str,
        fetch: Callable[[Download], None],
        where: str,
        soft: bool,
        blocks: BlockSpec | None,
        arriving: bool = False,
    ) -> tuple[str, Arrival | None] | None:
        if self._policy.state_overhead() + size > self.limit:
            raise CacheBudgetError(
                f"{where}: a {format_size(size)} shard does not fit in cache_limit={format_size(self.limit)} "
                f"({self.root}); raise cache_limit to at least a few shards"
            )
        while True:
            flight = self._wait_inflight(key)
            if flight is not None and not (arriving and flight.arrival is not None):
                flight.wait()
                continue
            if flight is not None and self._attach_before_recorded(key, flight):
                return flight.arrival.path, flight.arrival  # type: ignore[union-attr]  (checked just above)
            kind, value = self._find_or_reserve(
                key, size=size, where=where, soft=soft, blocks=blocks, arriving=arriving
            )
            if kind == "none":
                return None
            if kind == "soft":
                return value, None
            if kind == "attach":  # this process downloads it, by block: pinned now, read while it arrives
                return value.arrival.path, value.arrival
            if kind == "download":
                tmp, flight = value
                run = partial(self._download, key, tmp, flight, size=size, xxh3=xxh3, fetch=fetch, where=where,
                              soft=soft)
                if not (arriving and flight.arrival is not None):
                    return run(), None
                run.keywords["detached"] = True
                threading.Thread(target=_quietly, args=(run,), name="fastload-download", daemon=True).start()
                return flight.arrival.path, flight.arrival  # the pin taken with the reservation is the reader's
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
                return path, None
            self._drop_corrupt(key)

    def _find_or_reserve(
        self, key: str, *, size: int, where: str, soft: bool, blocks: BlockSpec | None = None, arriving: bool = False
    ) -> tuple[str, Any]:
        """Wait until one `_step` decides; raises `CacheBudgetError` on a deadlock or past `wait_timeout`."""
        wait_since: float | None = None
        stuck_since: float | None = None
        while True:
            with self._store.locked() as state:
                kind, value = self._step(state, key, size=size, soft=soft, blocks=blocks, arriving=arriving,
                                         where=where)
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

    def _step(
        self, state: dict[str, Any], key: str, *, size: int, soft: bool, blocks: BlockSpec | None = None,
        arriving: bool = False, where: str = "",
    ) -> tuple[str, Any]:
        """One look at the state (under its lock): ("entry", stamp) cached and pinned now; ("soft", path)
        cached, for a prefetch; ("download", (tmp, flight)) reserved for a download by this thread;
        ("attach", flight) pinned now, this process's download by block is under way (`arriving`);
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
            state["entries"].touch(key, time.time())
            return "entry", entry["stamp"]
        res = state["reserved"].get(key)
        if res is not None:
            if soft:
                return "none", None
            flight = self._wait_inflight(key) if res["owner"] == me else None
            if flight is not None and arriving and flight.arrival is not None:
                self._store.hold(state, key)  # the reader's pin, before the download can end
                return "attach", flight
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
            arrival = None
            if blocks is not None:
                arrival = Arrival(os.path.join(self._store.tmp_dir, tmp), self._path(key), size=size, spec=blocks,
                                  where=where or key, stall_s=self.wait_timeout)
            flight = _Flight(arrival)
            self._inflight[key] = flight  # under the mutex, with the reservation
            return "download", (tmp, flight)
        if soft:
            return "none", None
        state["waiting"][me] = {"key": key, "size": size}
        # room held by mapped files frees when their readers let go, whoever waits
        return "wait", (room, not room.mapped and self._policy.deadlocked(state, me))

    def _attach_before_recorded(self, key: str, flight: _Flight) -> bool:
        """Pin `key` for a reader of this process's download of it by block without a state update,
        while that download has not recorded its end: the shared state holds the file as this owner's
        reservation until then, and the pin is published by this owner's next update, that one at the
        latest (`CacheState.hold_unpublished`), so the state never holds the file without the pin.
        False once the download recorded its end (an update decides then: `_step`)."""
        with self._mutex:
            if flight.recorded or self._inflight.get(key) is not flight:
                return False
            self._store.hold_unpublished(key)
            return True

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
        detached: bool = False,
    ) -> str:
        """Download into `tmp`, verify, rename in. `detached`: run in a thread of its own for a reader
        that was handed the arriving file (that reader owns the pin taken with the reservation)."""
        tmp_path = os.path.join(self._store.tmp_dir, tmp)
        final = self._path(key)
        arrival = flight.arrival
        ok = False
        try:
            sink = Download(tmp_path, size=size, xxh3=xxh3, where=where, stats=self._transfer, arrival=arrival)
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
            if arrival is not None:  # readers of the arriving file see the new path with the rename
                arrival.move(partial(os.replace, tmp_path, final), final)
            else:
                os.replace(tmp_path, final)
            info = os.stat(final)
            vouch_file(info)  # every byte was hashed against the manifest above: readers here skip their block hashes
            st = stamp(info)
            with self._store.locked() as state:
                flight.recorded = True
                state["reserved"].pop(key, None)
                state["entries"].put(key, size=size, used=time.time(), stamp=st)
                held = key in self._store.held  # a reader of the arriving file pins it
                if soft and not held:
                    state["soft"][key] = self._store.owner
                self._verified[key] = st
                if held:
                    self._store.usable.add(key)
            if arrival is not None:
                arrival.finish(final)
            self._transfer.add("commit_s", time.perf_counter() - t0)
            ok = True
            return final
        except BaseException as exc:
            flight.error = exc if isinstance(exc, Exception) else OSError(f"{where}: download interrupted ({exc!r})")
            if arrival is not None:
                arrival.fail(flight.error)
            raise
        finally:
            if not ok:
                with self._store.locked() as state:
                    flight.recorded = True
                    state["reserved"].pop(key, None)
                    if arrival is not None and in_use(tmp_path):  # a reader maps it: counted until it lets go
                        state["retired"][tmp] = size
                    else:
                        unlink(tmp_path)
                    if not soft and not detached:
                        self._store.unhold(state, key)
            with self._mutex:
                if self._inflight.get(key) is flight:
                    del self._inflight[key]
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
            state["entries"].set_stamp(key, now)
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


def _quietly(run: Callable[[], object]) -> None:
    """Run a background download: its error reaches the readers through its `Arrival`."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported to the readers, logged here
        log.debug("background download failed: %r", exc)
