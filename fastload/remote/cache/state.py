"""`CacheState`: the shared state of one cache directory and this owner's pin ledger.

The single place pins are counted. State of `root`, shared by every process using the cache:

- `state.0.json`, `state.1.json`: the state, JSON, in the slot `.lock` names (see `_load`): entries
  (size, last use, verification stamp), pins, soft pins, reservations, waiters, budget claims and
  retired files (`tmp/` names of files removed from the cache while still mapped, with their size),
  each keyed by an owner id `"<pid>-<start time>-<n>"` (one per `CacheState` object in a process).
  Owners that no longer run are dropped on every update, so a crashed process leaves no pins,
  reservations or temp files behind.
- `.lock`: `fcntl.flock` lock taken around every read-modify-write of the state; its first 64 bytes
  name the current slot, its length and xxh3.
- `.users`: every open cache holds a shared `flock` on it, so a damaged state is rebuilt from the
  directory only when no other user (who could hold pins) is alive; else `CacheStateError`.

Pins have one ledger per owner: the in-memory count per key (`held`), changed only under the state
lock by `hold` / `unhold` (or, for a key already held, under `mutex` by `repin` / `unpin_local`); the
shared state carries a copy of it (`pins[key][owner]`), rewritten from the ledger on every update
(`_publish`), so the two cannot drift (threads of one process acquiring the same missing shard, a
failed download, a damaged state file).

Thread safety: `mutex` (re-entrant) serialises this owner's threads; `locked()` takes it, then the
cross-process flock. One object per process: the owning cache builds a new one after a fork.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import xxhash

__all__ = ["CacheBudgetError", "CacheState", "CacheStateError", "owner_alive", "owner_id", "unlink"]

_SLOTS = ("state.0.json", "state.1.json")
_LOCK = ".lock"
_USERS = ".users"
_PARTS = ("entries", "pins", "soft", "reserved", "waiting", "claims", "retired")
_HEADER_BYTES = 64


class CacheBudgetError(ValueError):
    """The cache budget cannot hold the shards that must be on disk at the same time."""


class CacheStateError(OSError):
    """The cache's shared state is damaged while other processes use the cache."""


def _start_time(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


_OWNER: tuple[int, str] | None = None


def owner_id() -> str:
    """This process as a cache owner: pid plus start time, so a reused pid is not mistaken for it."""
    global _OWNER
    pid = os.getpid()
    if _OWNER is None or _OWNER[0] != pid:
        _OWNER = (pid, f"{pid}-{_start_time(pid) or 0.0:.2f}")
    return _OWNER[1]


_INSTANCES = [0]
_COLLECTED: set[str] = set()  # owners of this process whose CacheState was garbage collected


def _collected(owner: str) -> bool:
    """An owner of this process (its ids start with this pid) whose cache object is gone."""
    return owner in _COLLECTED and owner.split("-", 1)[0] == str(os.getpid())


def owner_alive(owner: str) -> bool:
    """Whether the process named by an owner id still runs (`os.kill(pid, 0)` plus start time)."""
    try:
        pid_s, start_s = owner.split("-")[:2]
        pid = int(pid_s)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    start = _start_time(pid)
    return start is not None and abs(start - float(start_s)) < 0.05



class _StateFile:
    """The state's files: `.users` (shared flock while open), `.lock` (flock + header), two slots.

    Updates read and write the state with preads / pwrites on descriptors kept open: every thread
    of every process sharing the cache waits while the lock is held, so an update is two system
    calls each way, with no temp file + rename (that would wait on the file system journal while
    shards are written).
    """

    def __init__(self, *, root: str, data_dir: str) -> None:
        self.root, self.data_dir = root, data_dir
        self._lock_fd: int | None = None
        self._users_fd: int | None = None
        self._slot_fds: list[int] | None = None

    @property
    def opened(self) -> bool:
        """Whether the descriptors are open."""
        return self._lock_fd is not None

    def open(self) -> None:
        """Open the files (once) and take the shared `.users` lock."""
        if self._users_fd is None:
            self._users_fd = os.open(os.path.join(self.root, _USERS), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
        if self._lock_fd is None:
            self._lock_fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if self._slot_fds is None:
            self._slot_fds = [
                os.open(os.path.join(self.root, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644) for name in _SLOTS
            ]

    def close(self) -> None:
        """Close every descriptor (drops the `.users` lock)."""
        for fd in (self._lock_fd, self._users_fd, *(self._slot_fds or ())):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._users_fd = self._slot_fds = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the cross-process `.lock` flock for the block."""
        self.open()
        assert self._lock_fd is not None
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def load(self) -> tuple[int, int, bytes, dict[str, Any]]:
        """(sequence number, slot, bytes as read, state) of the last committed state.

        `.lock` holds a header `<seq> <slot> <length> <xxh3>` naming the slot file with the current
        state; a state is written to the other slot, then the header (one write of 64 bytes) is
        switched to it, so a process killed mid-update leaves the previous state intact. A slot that
        does not match its header (power loss without fsync, a new cache) is rebuilt from the directory,
        but only when no other user has the cache open: their pins live in that state, and a rebuild
        would let their mapped shards be evicted. Otherwise `CacheStateError` names the damage.
        The caller's own pins are never lost: `CacheState` writes them back from its ledger.
        """
        assert self._lock_fd is not None and self._slot_fds is not None
        seq, slot, why = 0, 1, "no state recorded"
        try:
            head = os.pread(self._lock_fd, _HEADER_BYTES, 0).split()
            if len(head) == 4:
                seq, slot, length = int(head[0]), int(head[1]), int(head[2])
                raw = os.pread(self._slot_fds[slot], length, 0) if slot in (0, 1) else b""
                if len(raw) != length or xxhash.xxh3_64_hexdigest(raw) != head[3].decode():
                    why = f"state.{slot}.json does not match the checksum in .lock"
                else:
                    state = json.loads(raw)
                    if isinstance(state, dict) and state.get("version") == 1:
                        for part in _PARTS:
                            state.setdefault(part, {})
                        return seq, slot, raw, state
                    why = f"state.{slot}.json is not a version 1 state"
            elif head:
                why = ".lock has no valid header"
        except (OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why != "no state recorded" and not self._sole_user():
            raise CacheStateError(
                f"cache {self.root}: the shared state is damaged ({why}) while other users (processes, or other "
                f"cache objects in this one) have it open; it holds their pins, so it is not rebuilt under them. "
                f"Stop every process using this cache (the next one rebuilds the state from the directory), "
                f"or point cache_dir elsewhere."
            )
        return seq, slot if slot in (0, 1) else 1, b"", self._rebuild()

    def _sole_user(self) -> bool:
        """Whether no other cache (in any process) has this cache open (`.users` flock probe)."""
        assert self._users_fd is not None
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)  # a failed conversion may have dropped the shared lock
        return True

    def _rebuild(self) -> dict[str, Any]:
        """State from the directory listing: complete files are entries, nobody holds pins."""
        state: dict[str, Any] = {"version": 1, **{part: {} for part in _PARTS}}
        with os.scandir(self.data_dir) as it:
            for de in it:
                if de.is_file():
                    st = de.stat()
                    state["entries"][de.name] = {"size": st.st_size, "used": st.st_mtime, "stamp": None}
        return state

    def save(self, seq: int, slot: int, data: bytes) -> None:
        """Write `data` to the other slot, then switch the header to it."""
        assert self._lock_fd is not None and self._slot_fds is not None
        new = 1 - slot
        _pwrite_all(self._slot_fds[new], data)
        head = f"{seq + 1} {new} {len(data)} {xxhash.xxh3_64_hexdigest(data)}".encode()
        _pwrite_all(self._lock_fd, head.ljust(_HEADER_BYTES - 1) + b"\n")


class CacheState:
    """Shared state of the cache in `root` (`data_dir`, `tmp_dir` inside it) plus this owner's pins."""

    def __init__(self, *, root: str, data_dir: str, tmp_dir: str) -> None:
        self.root, self.data_dir, self.tmp_dir = root, data_dir, tmp_dir
        self.pid = os.getpid()
        _INSTANCES[0] += 1
        self.owner = f"{owner_id()}-{_INSTANCES[0]}"
        self.mutex = threading.RLock()
        self.held: dict[str, int] = {}  # THE pin ledger of this owner: key -> pins (claims in progress too)
        self.usable: set[str] = set()  # held keys whose file is in place and verified (acquire's fast path)
        self.claim: list[int] | None = None  # [least, most] bytes this owner pins at once (published with its pins)
        self._file = _StateFile(root=root, data_dir=data_dir)

    @property
    def opened(self) -> bool:
        """Whether this process opened the state files (a copy inherited over fork has not)."""
        return self.pid == os.getpid() and self._file.opened

    def close(self) -> None:
        """Drop this owner's pins, soft pins, claim and wait, and close its files."""
        if not self.opened:
            return
        with self.mutex:
            self.held.clear()
            self.usable.clear()
            self.claim = None
            with contextlib.suppress(OSError, CacheStateError), self.locked() as state:
                state["soft"] = {k: o for k, o in state["soft"].items() if o != self.owner}
                state["waiting"].pop(self.owner, None)
            self._file.close()

    def collected(self) -> None:
        """This owner is gone (garbage collection): mark it and close its files, taking no lock.

        The collector may run this inside another cache's update in this thread, whose flock it
        would wait for forever. The next update by any cache of this process drops the marked
        owner's pins, soft pins and claim."""
        if getattr(self, "pid", None) != os.getpid() or getattr(self, "_file", None) is None:
            return
        if not self._file.opened:
            return
        with contextlib.suppress(Exception):  # may run during interpreter shutdown
            _COLLECTED.add(self.owner)
            self._file.close()

    __del__ = collected

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """Hold `mutex` and the cross-process lock; yield the state, written back on normal exit."""
        with self.mutex, self._file.exclusive():
            seq, slot, raw, state = self._file.load()
            self._prune(state)
            self._publish(state)
            yield state
            data = json.dumps(state, separators=(",", ":")).encode()
            if data != raw:
                self._file.save(seq, slot, data)

    def _prune(self, state: dict[str, Any]) -> None:
        """Drop pins, soft pins, reservations, waiters and claims of processes that are gone."""
        owners = set(state["soft"].values()) | set(state["waiting"]) | set(state["claims"])
        owners |= {o for pins in state["pins"].values() for o in pins}
        owners |= {r["owner"] for r in state["reserved"].values()}
        dead = {o for o in owners if o != self.owner and (_collected(o) or not owner_alive(o))}
        if not dead:
            return
        for key in list(state["pins"]):
            pins = {o: n for o, n in state["pins"][key].items() if o not in dead}
            if pins:
                state["pins"][key] = pins
            else:
                del state["pins"][key]
        state["soft"] = {k: o for k, o in state["soft"].items() if o not in dead}
        state["waiting"] = {o: w for o, w in state["waiting"].items() if o not in dead}
        state["claims"] = {o: c for o, c in state["claims"].items() if o not in dead}
        for key, res in list(state["reserved"].items()):
            if res["owner"] in dead:
                unlink(os.path.join(self.tmp_dir, res["tmp"]))
                del state["reserved"][key]

    def _publish(self, state: dict[str, Any]) -> None:
        """Write this owner's pins and budget claim into the state from its ledger (the only source)."""
        me, pins = self.owner, state["pins"]
        for key in [k for k, p in pins.items() if me in p and k not in self.held]:
            del pins[key][me]
            if not pins[key]:
                del pins[key]
        for key, n in self.held.items():
            pins.setdefault(key, {})[me] = n
        if self.claim is not None:
            state["claims"][me] = self.claim
        else:
            state["claims"].pop(me, None)

    def hold(self, state: dict[str, Any], key: str) -> None:
        """One more pin of `key` by this owner (caller holds `locked()`)."""
        self.held[key] = self.held.get(key, 0) + 1
        self._publish_key(state, key)

    def unhold(self, state: dict[str, Any], key: str) -> None:
        """One pin of `key` fewer (caller holds `locked()`)."""
        n = self.held.get(key, 0) - 1
        if n > 0:
            self.held[key] = n
        else:
            self.held.pop(key, None)
            self.usable.discard(key)
        self._publish_key(state, key)

    def repin(self, key: str) -> bool:
        """One more pin of a key this owner holds and verified, without a state update (the shared
        copy counts the owner as a holder already); False when it is not such a key."""
        with self.mutex:
            if key not in self.usable:
                return False
            self.held[key] += 1
            return True

    def unpin_local(self, key: str) -> int:
        """Drop one of several pins of `key` without a state update; returns the count before (the
        caller calls `unhold` under `locked()` when it was 1, and nothing when it was 0)."""
        with self.mutex:
            n = self.held.get(key, 0)
            if n > 1:
                self.held[key] = n - 1
            return n

    def _publish_key(self, state: dict[str, Any], key: str) -> None:
        n, pins = self.held.get(key, 0), state["pins"]
        if n:
            pins.setdefault(key, {})[self.owner] = n
        elif key in pins:
            pins[key].pop(self.owner, None)
            if not pins[key]:
                del pins[key]

    def sweep_tmp(self, state: dict[str, Any]) -> None:
        """At start-up: remove temp files no live reservation accounts for (left by a crash); add stray data files."""
        live_tmp = {r["tmp"] for r in state["reserved"].values()} | set(state["retired"])
        with os.scandir(self.tmp_dir) as it:
            for de in it:
                if de.name not in live_tmp:
                    pid = de.name.rsplit(".", 2)[-2] if de.name.count(".") >= 2 else ""
                    if not (pid.isdigit() and int(pid) == os.getpid()):
                        unlink(de.path)
        with os.scandir(self.data_dir) as it:
            names = {de.name for de in it if de.is_file()}
        for key in list(state["entries"]):
            if key not in names:
                del state["entries"][key]
        for key in names - set(state["entries"]):
            st = os.stat(os.path.join(self.data_dir, key))
            state["entries"][key] = {"size": st.st_size, "used": st.st_mtime, "stamp": None}

    @staticmethod
    def used(state: dict[str, Any], block: int = 1) -> int:
        """Bytes of complete entries, reservations and retired files (removed from the cache while
        something still mapped them), each rounded up to the file system's `block`."""
        sizes = [e["size"] for e in state["entries"].values()] + [r["size"] for r in state["reserved"].values()]
        sizes += list(state["retired"].values())
        return sum(-(-int(n) // block) * block for n in sizes)


def _pwrite_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    off = 0
    while off < len(view):
        off += os.pwrite(fd, view[off:], off)


def unlink(path: str) -> None:
    """Remove a file; a missing one is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.EISDIR):
            raise
