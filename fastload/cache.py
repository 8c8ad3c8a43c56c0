"""`ShardCache`: an on-disk, byte-budgeted LRU cache of whole shard files shared by processes.

Every process (loader workers, ranks, several loaders) that points at the same directory shares
one budget. Layout of `root`:

- `data/<key>`: complete, verified files (written to `tmp/` first, renamed in).
- `tmp/<key>.<pid>.<n>`: downloads in flight; their bytes are reserved in the budget up front.
- `state.0.json`, `state.1.json`: the state, JSON, in the slot `.lock` names (see `_load`): entries
  (size, last use, verification stamp), pins, soft pins, reservations, waiters and budget claims,
  each keyed by an owner id `"<pid>-<start time>-<n>"` (one per `ShardCache` object in a process).
  Owners that no longer run are dropped on every update, so a crashed process leaves no pins,
  reservations or temp files behind.
- `.lock`: `fcntl.flock` lock taken around every read-modify-write of the state; its first 64 bytes
  name the current slot, its length and xxh3.
- `.users`: every open `ShardCache` holds a shared `flock` on it, so a damaged state is rebuilt
  from the directory only when no other user (who could hold pins) is alive; else `CacheStateError`.

Pins have one ledger per owner: the owner's in-memory count per key (`_held`), changed only under
the state lock; the shared state carries a copy of it (`pins[key][owner]`), rewritten from the
ledger on every update, so the two cannot drift (threads of one process acquiring the same missing
shard, a failed download, a damaged state file).

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
import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import xxhash

from .formats.errors import ChecksumError
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

_SLOTS = ("state.0.json", "state.1.json")
_LOCK = ".lock"
_USERS = ".users"
_PARTS = ("entries", "pins", "soft", "reserved", "waiting", "claims")
_HEADER_BYTES = 64
_POLL_S = 0.02
_VERIFY_MODES = ("stat", "once", "always")


class CacheBudgetError(ValueError):
    """The cache budget cannot hold the shards that must be on disk at the same time."""


class CacheStateError(OSError):
    """The cache's shared state is damaged while other processes use the cache."""


def default_cache_dir() -> str:
    """`$FASTLOAD_CACHE_DIR`, else `~/.cache/fastload/shards`."""
    return os.environ.get("FASTLOAD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastload", "shards")


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
_COLLECTED: set[str] = set()  # owners of this process whose ShardCache was garbage collected


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


class Download:
    """Sink for one download: writes to the temp file and hashes the same bytes.

    A fetch callback writes the whole object with `write` (possibly after `reset` on a retry);
    `check` raises `ChecksumError` on a size or checksum mismatch.
    """

    def __init__(self, path: str, *, size: int, xxh3: str, where: str, stats: TransferStats | None = None) -> None:
        self.path, self.size, self.xxh3, self.where = path, size, xxh3.lower(), where
        self._fh = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._hash = xxhash.xxh3_64()
        self.written = 0
        self.stats = stats if stats is not None else TransferStats()

    def reset(self) -> None:
        """Discard what was written (before a retry)."""
        self._fh.seek(0)
        self._fh.truncate()
        self._hash.reset()
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data` to the temp file and to the running xxh3 (`ChecksumError` past `size`)."""
        view = memoryview(data).cast("B")
        if self.written + view.nbytes > self.size:
            raise ChecksumError(f"{self.where}: more than the {self.size} bytes the manifest records")
        t0 = time.perf_counter()
        self._fh.write(view)
        t1 = time.perf_counter()
        self._hash.update(view)  # verified while received: `check` only compares the digest
        self.stats.add_many(write_s=t1 - t0, verify_s=time.perf_counter() - t1)
        self.written += view.nbytes

    def check(self) -> None:
        """Raise `ChecksumError` unless exactly `size` bytes with the manifest's xxh3 were written."""
        if self.written != self.size:
            raise ChecksumError(f"{self.where}: got {self.written} bytes, the manifest records {self.size}")
        got = self._hash.hexdigest()
        if got != self.xxh3:
            raise ChecksumError(f"{self.where}: xxh3 {got} != {self.xxh3} recorded in the manifest")

    def finish(self, *, fsync: bool) -> None:
        """Flush and close the temp file; `fsync` forces it to the device first (timed as `fsync_s`)."""
        self._fh.flush()
        if fsync:
            t0 = time.perf_counter()
            os.fsync(self._fh.fileno())
            self.stats.add("fsync_s", time.perf_counter() - t0)
        self._fh.close()

    def close(self) -> None:
        """Close the temp file (idempotent)."""
        if not self._fh.closed:
            self._fh.close()


@dataclass
class _Room:
    ok: bool
    waiting_on: str = ""


def _file_xxh3(path: str) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while buf := fh.read(8 << 20):
            h.update(buf)
    return h.hexdigest()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


_BOOT = _boot_id()


def _stamp(st: os.stat_result) -> list[int | str]:
    """What a verified file looked like. The boot id makes every file be re-hashed once after a
    reboot, so files written without fsync that a power loss damaged are caught."""
    return [st.st_size, st.st_mtime_ns, st.st_ino, _BOOT]


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
            self._sweep_tmp(state)
            used = self._used(state)
        if limit is None:
            free = _free_bytes(self.root)
            self.limit = int(0.8 * (free + used))
        else:
            self.limit = parse_size(limit)
        if self.limit <= 0:
            raise CacheBudgetError(f"cache_limit must be > 0 bytes, got {limit!r}")

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

    # -- per-process state (rebuilt after fork) -------------------------------------------------
    def _reset_process_state(self) -> None:
        reset_in_child(self, ShardCache._reset_process_state)  # no lock crosses a fork locked
        self._pid = os.getpid()
        _INSTANCES[0] += 1
        self._owner = f"{owner_id()}-{_INSTANCES[0]}"
        self._mutex = threading.RLock()
        self._lock_fd: int | None = None
        self._users_fd: int | None = None
        self._slot_fds: list[int] | None = None
        self._held: dict[str, int] = {}  # THE pin ledger of this owner: key -> pins (claims in progress too)
        self._usable: set[str] = set()  # held keys whose file is in place and verified (acquire's fast path)
        self._verified: dict[str, list[int | str]] = {}  # key -> stat stamp hashed by this owner
        self._inflight: dict[str, threading.Event] = {}  # key -> download running in this process
        self._tmp_seq = 0
        self._claim = 0
        self.transfer = TransferStats()  # this process's download timings (`stats()`)

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset_process_state()

    def close(self) -> None:
        """Drop this owner's pins, soft pins, claim and wait, and close its files."""
        if getattr(self, "_pid", None) != os.getpid() or getattr(self, "_lock_fd", None) is None:
            return  # never opened, or descriptors inherited over fork that belong to the parent's object
        with self._mutex:
            self._held.clear()
            self._usable.clear()
            self._claim = 0
            with contextlib.suppress(OSError, CacheStateError), self._locked() as state:
                state["soft"] = {k: o for k, o in state["soft"].items() if o != self._owner}
                state["waiting"].pop(self._owner, None)
            self._close_files()

    def _close_files(self) -> None:
        for fd in (self._lock_fd, self._users_fd, *(self._slot_fds or ())):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._users_fd = self._slot_fds = None

    def __del__(self) -> None:
        # The garbage collector may run this inside another cache object's update in this thread,
        # whose flock it would wait for forever: no lock here. The owner is marked collected; the
        # next update by any cache object of this process drops its pins, soft pins and claim.
        if getattr(self, "_pid", None) != os.getpid() or getattr(self, "_lock_fd", None) is None:
            return
        with contextlib.suppress(Exception):  # may run during interpreter shutdown
            _COLLECTED.add(self._owner)
            self._close_files()

    def _open_files(self) -> None:
        if self._users_fd is None:
            self._users_fd = os.open(os.path.join(self.root, _USERS), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
        if self._lock_fd is None:
            self._lock_fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if self._slot_fds is None:
            self._slot_fds = [
                os.open(os.path.join(self.root, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644) for name in _SLOTS
            ]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Hold the cross-process lock; yield the state, written back on normal exit."""
        self._check_pid()
        with self._mutex:
            self._open_files()
            assert self._lock_fd is not None
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                seq, slot, raw, state = self._load()
                self._prune(state)
                self._publish(state)
                yield state
                data = json.dumps(state, separators=(",", ":")).encode()
                if data != raw:
                    self._save(seq, slot, data)
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # The state is read and written under the lock with two preads / two pwrites on files kept open.
    # Every thread of every process sharing the cache waits while the lock is held, and each system
    # call drops the GIL and may wait a whole switch interval (5 ms) to get it back while loader
    # threads compute; a temp file + rename per update also waits on the file system journal while
    # shards are written. That way an update held the lock 10-50 ms in bench.remote's epoch 1.
    def _load(self) -> tuple[int, int, bytes, dict[str, Any]]:
        """(sequence number, slot, bytes as read, state) of the last committed state.

        `.lock` holds a header `<seq> <slot> <length> <xxh3>` naming the slot file with the current
        state; a state is written to the other slot, then the header (one write of 64 bytes) is
        switched to it, so a process killed mid-update leaves the previous state intact. A slot that
        does not match its header (power loss without fsync, a new cache) is rebuilt from the directory,
        but only when no other user has the cache open: their pins live in that state, and a rebuild
        would let their mapped shards be evicted. Otherwise `CacheStateError` names the damage.
        This owner's own pins are never lost: `_publish` writes them back from its ledger.
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
        """Whether no other `ShardCache` (in any process) has this cache open (`.users` flock probe)."""
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

    def _save(self, seq: int, slot: int, data: bytes) -> None:
        assert self._lock_fd is not None and self._slot_fds is not None
        new = 1 - slot
        _pwrite_all(self._slot_fds[new], data)
        head = f"{seq + 1} {new} {len(data)} {xxhash.xxh3_64_hexdigest(data)}".encode()
        _pwrite_all(self._lock_fd, head.ljust(_HEADER_BYTES - 1) + b"\n")

    def state(self) -> dict[str, Any]:
        """A copy of the shared state (entries, pins, soft pins, reservations, waiters), for diagnostics."""
        with self._locked() as state:
            return json.loads(json.dumps(state))

    def _prune(self, state: dict[str, Any]) -> None:
        """Drop pins, soft pins, reservations, waiters and claims of processes that are gone."""
        owners = set(state["soft"].values()) | set(state["waiting"]) | set(state["claims"])
        owners |= {o for pins in state["pins"].values() for o in pins}
        owners |= {r["owner"] for r in state["reserved"].values()}
        dead = {o for o in owners if o != self._owner and (_collected(o) or not owner_alive(o))}
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
                _unlink(os.path.join(self.tmp_dir, res["tmp"]))
                del state["reserved"][key]

    def _publish(self, state: dict[str, Any]) -> None:
        """Write this owner's pins and budget claim into the state from its ledger (the only source)."""
        me, pins = self._owner, state["pins"]
        for key in [k for k, p in pins.items() if me in p and k not in self._held]:
            del pins[key][me]
            if not pins[key]:
                del pins[key]
        for key, n in self._held.items():
            pins.setdefault(key, {})[me] = n
        if self._claim:
            state["claims"][me] = self._claim
        else:
            state["claims"].pop(me, None)

    def _hold(self, state: dict[str, Any], key: str) -> None:
        """One more pin of `key` by this owner (caller holds the state lock)."""
        self._held[key] = self._held.get(key, 0) + 1
        self._publish_key(state, key)

    def _unhold(self, state: dict[str, Any], key: str) -> None:
        """One pin of `key` fewer (caller holds the state lock)."""
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
        else:
            self._held.pop(key, None)
            self._usable.discard(key)
        self._publish_key(state, key)

    def _publish_key(self, state: dict[str, Any], key: str) -> None:
        n, pins = self._held.get(key, 0), state["pins"]
        if n:
            pins.setdefault(key, {})[self._owner] = n
        elif key in pins:
            pins[key].pop(self._owner, None)
            if not pins[key]:
                del pins[key]

    def _sweep_tmp(self, state: dict[str, Any]) -> None:
        """Remove temp files no live reservation accounts for (left by a crash); add stray data files."""
        live_tmp = {r["tmp"] for r in state["reserved"].values()}
        with os.scandir(self.tmp_dir) as it:
            for de in it:
                if de.name not in live_tmp:
                    pid = de.name.rsplit(".", 2)[-2] if de.name.count(".") >= 2 else ""
                    if not (pid.isdigit() and int(pid) == os.getpid()):
                        _unlink(de.path)
        with os.scandir(self.data_dir) as it:
            names = {de.name for de in it if de.is_file()}
        for key in list(state["entries"]):
            if key not in names:
                del state["entries"][key]
        for key in names - set(state["entries"]):
            st = os.stat(os.path.join(self.data_dir, key))
            state["entries"][key] = {"size": st.st_size, "used": st.st_mtime, "stamp": None}

    @staticmethod
    def _used(state: dict[str, Any]) -> int:
        return sum(e["size"] for e in state["entries"].values()) + sum(r["size"] for r in state["reserved"].values())

    # -- public ---------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return os.path.join(self.data_dir, _check_key(key))

    def usage(self) -> dict[str, int]:
        """Bytes and files held now: `bytes` (complete + reserved), `files`, `pinned`, `reserved`."""
        with self._locked() as state:
            return {
                "bytes": self._used(state),
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
        with self._locked() as state:
            return _check_key(key) in state["entries"]

    def acquire(self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str = "") -> str:
        """Pin `key` and return its local path, calling `fetch` to download it when missing or corrupt."""
        _check_key(key)
        self._check_pid()
        with self._mutex:
            if key in self._usable:  # held and verified by this owner: one more pin, no state update
                self._held[key] += 1
                return self.path(key)
        path = self._obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, soft=False)
        assert path is not None
        return path

    def prefetch(self, key: str, *, size: int, xxh3: str, fetch: Callable[[Download], None], where: str = "") -> bool:
        """Download `key` into the cache under a soft pin if it fits without evicting pinned or soft-pinned files.

        Returns False (nothing done) when there is no room now; never waits for room.
        """
        _check_key(key)
        return self._obtain(key, size=size, xxh3=xxh3, fetch=fetch, where=where or key, soft=True) is not None

    def release(self, key: str) -> None:
        """Drop one pin taken by `acquire` in this process."""
        self._check_pid()
        with self._mutex:
            n = self._held.get(key, 0)
            if n <= 0:
                return  # e.g. a pin taken before a fork: the parent still holds it
            if n > 1:
                self._held[key] = n - 1
                return
            with self._locked() as state:
                self._unhold(state, key)
                if key in state["entries"]:
                    state["entries"][key]["used"] = time.time()

    def unsoft(self, keys: list[str] | None = None) -> None:
        """Drop this process's soft pins on `keys` (all of them when None)."""
        me = self._owner
        with self._locked() as state:
            for k, o in list(state["soft"].items()):
                if o == me and (keys is None or k in keys):
                    del state["soft"][k]

    def soft_keys(self) -> set[str]:
        """Keys this process prefetched that nobody has acquired (nor evicted) since."""
        me = self._owner
        with self._locked() as state:
            return {k for k, o in state["soft"].items() if o == me}

    def pinned_keys(self) -> dict[str, int]:
        """This owner's pins (key -> count), acquisitions in progress included."""
        self._check_pid()
        with self._mutex:
            return dict(self._held)

    def claim(self, nbytes: int) -> int:
        """Record that this owner may pin up to `nbytes` at once; returns the bytes other live owners
        claim. Claims only inform budget checks (`RemoteStorage` refuses a reader whose claim does
        not fit next to the others' instead of letting it deadlock later); 0 withdraws the claim."""
        with self._mutex:
            self._claim = int(nbytes)
            with self._locked() as state:
                return sum(c for o, c in state["claims"].items() if o != self._owner)

    def claimed_by_others(self) -> int:
        """Bytes that other live owners of this cache have claimed (see `claim`)."""
        with self._locked() as state:
            return sum(c for o, c in state["claims"].items() if o != self._owner)

    def clear(self) -> None:
        """Delete every unpinned, unreserved file."""
        with self._locked() as state:
            for key in list(state["entries"]):
                if not state["pins"].get(key):
                    _unlink(os.path.join(self.data_dir, key))
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
            me = self._owner
            wait_since: float | None = None
            stuck_since: float | None = None
            while True:
                with self._locked() as state:
                    entry = state["entries"].get(key)
                    if entry is not None:
                        if soft:
                            if not state["pins"].get(key):  # a pinned file is in use: nothing to protect
                                state["soft"].setdefault(key, me)
                            state["waiting"].pop(me, None)
                            return self.path(key)
                        self._hold(state, key)
                        state["soft"].pop(key, None)
                        state["waiting"].pop(me, None)
                        entry["used"] = time.time()
                        stamp = entry.get("stamp")
                        break
                    res = state["reserved"].get(key)
                    if res is not None:
                        if soft:
                            return None
                        if res["owner"] == me:  # another thread of this owner downloads it: wait for that
                            event = self._wait_inflight(key)
                        room = _Room(False, waiting_on=f"download of {key} by process {res['owner']}")
                    else:
                        room = self._make_room(state, size, soft=soft)
                        if room.ok:
                            tmp = self._tmp_name(key)
                            state["reserved"][key] = {"owner": me, "size": size, "tmp": tmp, "soft": soft}
                            state["waiting"].pop(me, None)
                            if not soft:
                                self._hold(state, key)
                            event = threading.Event()
                            self._inflight[key] = event  # under the mutex, with the reservation
                            entry = None
                            break
                        if soft:
                            return None
                        state["waiting"][me] = {"key": key, "size": size}
                    deadlocked = res is None and self._deadlocked(state, me)
                if event is not None:
                    event.wait()
                    event = None
                    continue
                now = time.monotonic()
                wait_since = wait_since or now
                stuck_since = (stuck_since or now) if deadlocked else None
                if stuck_since is not None and now - stuck_since >= self.deadlock_grace:
                    self._give_up_wait(me)
                    raise CacheBudgetError(self._deadlock_message(key, size, where))
                if now - wait_since > self.wait_timeout:
                    self._give_up_wait(me)
                    raise CacheBudgetError(
                        f"{where}: waited {self.wait_timeout:.0f}s for room in cache {self.root} "
                        f"(limit {format_size(self.limit)}; {room.waiting_on or 'pinned by other processes'})"
                    )
                time.sleep(_POLL_S)
            if entry is not None:
                path = self.path(key)
                try:
                    ok = self._verify_cached(key, path, size=size, xxh3=xxh3, stamp=stamp)
                except BaseException:
                    with self._mutex, self._locked() as state:
                        self._unhold(state, key)
                    raise
                if ok:
                    with self._mutex:
                        self._usable.add(key)
                    return path
                self._drop_corrupt(key, pinned=True)
                continue
            assert event is not None
            return self._download(key, tmp, event, size=size, xxh3=xxh3, fetch=fetch, where=where, soft=soft)

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
            stamp = _stamp(os.stat(final))
            with self._mutex, self._locked() as state:
                state["reserved"].pop(key, None)
                state["entries"][key] = {"size": size, "used": time.time(), "stamp": stamp}
                if soft:
                    state["soft"][key] = self._owner
                self._verified[key] = stamp
                if not soft:
                    self._usable.add(key)
            self.transfer.add("commit_s", time.perf_counter() - t0)
            ok = True
            return final
        finally:
            if not ok:
                _unlink(tmp_path)
                with self._mutex, self._locked() as state:
                    state["reserved"].pop(key, None)
                    if not soft:
                        self._unhold(state, key)
            with self._mutex:
                self._inflight.pop(key, None)
            event.set()

    def _verify_cached(self, key: str, path: str, *, size: int, xxh3: str, stamp: list[int | str] | None) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        now = _stamp(st)
        if st.st_size != size:
            return False
        with self._mutex:
            seen = None if self.verify == "always" else self._verified.get(key)
        if seen == now:
            return True
        if self.verify == "stat" and stamp == now:
            with self._mutex:
                self._verified[key] = now
            return True
        if _file_xxh3(path) != xxh3.lower():
            return False
        with self._mutex:
            self._verified[key] = now
        with self._locked() as state:
            if key in state["entries"]:
                state["entries"][key]["stamp"] = now
        return True

    def _drop_corrupt(self, key: str, *, pinned: bool) -> None:
        """Remove a cached file that failed verification (it is fetched again)."""
        with self._mutex:
            self._verified.pop(key, None)
            with self._locked() as state:
                if pinned:
                    self._unhold(state, key)
                # Readers elsewhere keep their mapping of the old inode; new opens get the re-fetch.
                _unlink(self.path(key))
                state["entries"].pop(key, None)
                state["soft"].pop(key, None)

    def _make_room(self, state: dict[str, Any], size: int, *, soft: bool) -> _Room:
        """Evict least recently used unpinned files until `size` more bytes fit; False if they cannot."""
        free = self.limit - self._used(state)
        if free >= size:
            return _Room(True)
        unpinned = [(e["used"], k) for k, e in state["entries"].items() if not state["pins"].get(k)]
        cold = sorted((u, k) for u, k in unpinned if k not in state["soft"])
        warm = sorted((u, k) for u, k in unpinned if k in state["soft"])
        victims = cold if soft else cold + warm
        chosen = []
        for _, k in victims:
            if free >= size:
                break
            chosen.append(k)
            free += state["entries"][k]["size"]
        if free < size:
            return _Room(False, waiting_on="room held by pinned shards")
        for k in chosen:
            _unlink(os.path.join(self.data_dir, k))
            del state["entries"][k]
            state["soft"].pop(k, None)
        return _Room(True)

    def _deadlocked(self, state: dict[str, Any], me: str) -> bool:
        """Every owner that pins or demand-downloads something is itself waiting for room (a prefetch
        in flight ends on its own and leaves an evictable file, so it holds nobody up for good)."""
        holders = {o for pins in state["pins"].values() for o, n in pins.items() if n > 0}
        holders |= {r["owner"] for r in state["reserved"].values() if not r.get("soft")}
        return bool(holders) and holders <= set(state["waiting"]) and me in state["waiting"]

    def _give_up_wait(self, me: str) -> None:
        with self._locked() as state:
            state["waiting"].pop(me, None)

    def _deadlock_message(self, key: str, size: int, where: str) -> str:
        with self._locked() as state:
            pinned = sum(state["entries"].get(k, {}).get("size", 0) for k, p in state["pins"].items() if p)
            holders = sorted({o.split("-")[0] for p in state["pins"].values() for o in p})
        return (
            f"{where}: cache_limit={format_size(self.limit)} ({self.root}) cannot hold the shards in use at once: "
            f"{format_size(pinned)} are pinned by process(es) {', '.join(holders) or '-'} and every one of them "
            f"waits for room for another shard ({format_size(size)}). Raise cache_limit to at least the sum, "
            f"over every reader sharing the cache (each dataset object in each process, loader workers "
            f"included), of (max_open_shards + 1) x (largest shard), or open fewer shards at once."
        )


def _check_key(key: str) -> str:
    if not key or "/" in key or "\x00" in key or key in (".", "..") or key.startswith("."):
        raise ValueError(f"invalid cache key {key!r}")
    return key


def _pwrite_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    off = 0
    while off < len(view):
        off += os.pwrite(fd, view[off:], off)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.EISDIR):
            raise


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
