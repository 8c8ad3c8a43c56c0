"""`CacheState`: the shared state of one cache directory and this owner's pin ledger.

The single place pins are counted. State of `root`, shared by every process using the cache:

- `state.db` (SQLite, see `_StateDb`): entries (size, last use, verification stamp), one row each,
  and one document with pins, soft pins, reservations, waiters, budget claims and retired files
  (`tmp/` names of files removed from the cache while still mapped, with their size), each keyed
  by an owner id `"<pid>-<start time>-<n>"` (start time in seconds from boot, which a step of the
  wall clock leaves alone; one per `CacheState` object in a process). Owners
  that no longer run are dropped on every update, so a crashed process leaves no pins,
  reservations or temp files behind.
- `.lock`: `fcntl.flock` lock taken around every update.
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
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import psutil

from fastload.system import process_start

if TYPE_CHECKING:
    from fastload.remote.transfer_stats import TransferStats

__all__ = ["STATE_SLACK", "CacheBudgetError", "CacheState", "CacheStateError", "EntryTable", "owner_alive", "owner_id",
           "unlink"]

log = logging.getLogger(__name__)

_DB = "state.db"
_LOCK = ".lock"
_USERS = ".users"
_OLD_FILES = ("state.0.json", "state.1.json")
_PARTS = ("pins", "soft", "reserved", "waiting", "claims", "retired")  # the document's parts
_VERSION = 2  # `PRAGMA user_version` of the schema below
_PAGE = 1024  # small pages: a few KB of state for a small cache, one page rewritten per entry changed
_BUSY_S = 60.0  # SQLite's own lock is taken under `.lock`; a wait this long means a foreign writer
STATE_SLACK = 16 * _PAGE  # bytes `state.db` and its journal may grow by between two looks for room


class CacheBudgetError(ValueError):
    """The cache budget cannot hold the shards that must be on disk at the same time."""


class CacheStateError(OSError):
    """The cache's shared state is damaged while other processes use the cache."""


def _start_time(pid: int) -> float | None:
    try:
        return process_start(pid)
    except psutil.AccessDenied:
        return None


_OWNER: tuple[int, str] | None = None


def owner_id() -> str:
    """This process as a cache owner: pid plus start time (`process_start`: from boot, so a step of
    the wall clock leaves it as it is), so a reused pid is not mistaken for it."""
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


# an owner id's start time above this (seconds) is a wall clock time (an earlier version's), not one from boot
_WALL_CLOCK_STARTS = 1e8
RECHECK_S = 1.0  # how long a process's identity (start time, not a zombie) stays verified
_VERIFIED: dict[str, float] = {}  # owner -> when its process was last found to be that owner


def owner_alive(owner: str) -> bool:
    """Whether the process named by an owner id still runs: `os.kill(pid, 0)` on every call, and
    the process's start time (a reused pid) and state (a zombie) once per `RECHECK_S` per owner,
    since reading them costs 40 us and every update asks for every other owner of the cache."""
    try:
        pid_s, start_s = owner.split("-")[:2]
        pid = int(pid_s)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        _VERIFIED.pop(owner, None)
        return False
    except PermissionError:
        return True
    now = time.monotonic()
    if now - _VERIFIED.get(owner, -RECHECK_S) < RECHECK_S:
        return True
    if float(start_s) > _WALL_CLOCK_STARTS:  # written by a version that took start times from the wall
        return True  # clock, which cannot be compared with one from boot: the pid runs, so it may be that owner
    start = _start_time(pid)
    if start is None or abs(start - float(start_s)) >= 0.05:
        _VERIFIED.pop(owner, None)
        return False
    _VERIFIED[owner] = now
    return True


# SQLite is not fork-safe: a child forked while a thread of its parent is inside a SQLite call can
# inherit SQLite's own mutexes locked, and a child closing an inherited connection can undo the
# parent's transaction. So every SQLite call runs holding `_GATE`, which a fork waits for (the
# forking thread may hold it already), and connections are closed only by the process that opened
# them: `_OPENED` keeps each one referenced until then, so a child never frees an inherited one.
_GATE = threading.RLock()
_OPENED: dict[int, tuple[int, sqlite3.Connection]] = {}  # id(connection) -> (opening pid, connection)


def _gate() -> threading.RLock:
    return _GATE


def _new_gate_in_child() -> None:
    global _GATE
    _GATE = threading.RLock()


os.register_at_fork(before=lambda: _gate().acquire(), after_in_parent=lambda: _gate().release(),
                    after_in_child=_new_gate_in_child)


class EntryTable(MutableMapping[str, Mapping[str, Any]]):
    """The cache's complete files, one row each in `state.db`, read and changed inside an update.

    A lookup, insert, touch or removal costs the same whatever the number of entries; the totals
    (`len`, `bytes`) are kept by triggers. An entry reads as a read-only mapping (`size`, `used`,
    `stamp`): change it with `touch` or `set_stamp`, so that no change is lost on a copy."""

    def __init__(self, conn: sqlite3.Connection, block: int) -> None:
        self._conn, self.block = conn, block

    def __getitem__(self, key: str) -> Mapping[str, Any]:
        row = self._conn.execute("SELECT size, used, stamp FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise KeyError(key)
        return MappingProxyType({"size": row[0], "used": row[1], "stamp": _loads_stamp(row[2])})

    def __setitem__(self, key: str, entry: Mapping[str, Any]) -> None:
        self.put(key, size=int(entry["size"]), used=float(entry["used"]), stamp=entry.get("stamp"))

    def __delitem__(self, key: str) -> None:
        if self._conn.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount == 0:
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return self._conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None

    def __iter__(self) -> Iterator[str]:
        return iter([row[0] for row in self._conn.execute("SELECT key FROM entries")])

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT files FROM totals").fetchone()[0])

    def put(self, key: str, *, size: int, used: float, stamp: Any) -> None:
        """Record the complete file of `key` (replacing any entry)."""
        self._conn.execute(
            "INSERT INTO entries (key, size, used, stamp) VALUES (?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
            "size = excluded.size, used = excluded.used, stamp = excluded.stamp",
            (key, int(size), float(used), json.dumps(stamp)),
        )

    def touch(self, key: str, used: float) -> None:
        """`key` was used at `used` (its place in the LRU order); nothing when it is not cached."""
        self._conn.execute("UPDATE entries SET used = ? WHERE key = ?", (float(used), key))

    def set_stamp(self, key: str, stamp: Any) -> None:
        """`key`'s file was hashed and matched with this identity; nothing when it is not cached."""
        self._conn.execute("UPDATE entries SET stamp = ? WHERE key = ?", (json.dumps(stamp), key))

    def least_recently_used(self) -> Iterator[tuple[str, int]]:
        """(key, size) of every entry, least recently used first, read as the caller goes."""
        for key, size in self._conn.execute("SELECT key, size FROM entries ORDER BY used, key"):
            yield key, int(size)

    def bytes(self, block: int = 1) -> int:
        """Bytes of every entry, each rounded up to `block` (kept as a total for 1 and the cache's block)."""
        if block <= 1:
            return int(self._conn.execute("SELECT bytes FROM totals").fetchone()[0])
        if block == self.block:
            return int(self._conn.execute("SELECT footprint FROM totals").fetchone()[0])
        row = self._conn.execute("SELECT COALESCE(SUM((size + ? - 1) / ? * ?), 0) FROM entries", (block,) * 3)
        return int(row.fetchone()[0])

    def copy(self) -> dict[str, dict[str, Any]]:
        """Every entry as a plain dict (diagnostics)."""
        rows = self._conn.execute("SELECT key, size, used, stamp FROM entries ORDER BY key")
        return {k: {"size": s, "used": u, "stamp": _loads_stamp(st)} for k, s, u, st in rows}


# SQLite's primary result codes that mean the file is not the state this module wrote: SQLITE_ERROR
# (a table or column missing), SQLITE_CORRUPT, SQLITE_NOTADB. Others (busy, locked, read-only, I/O,
# disk full) say the state could not be reached now, not that it is wrong: never rebuilt for them.
_DAMAGE_CODES = (1, 11, 26)


def _damaged(exc: BaseException) -> bool:
    """Whether `exc`, raised reading or writing `state.db`, means the state is damaged."""
    if isinstance(exc, (ValueError, TypeError)):
        return True
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    return code is None or code & 0xFF in _DAMAGE_CODES  # None: raised here (a failed quick_check)


def _loads_stamp(text: str | None) -> Any:
    return None if text is None else json.loads(text)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER NOT NULL, used REAL NOT NULL,
                                    stamp TEXT) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (used, key);
CREATE TABLE IF NOT EXISTS totals (files INTEGER NOT NULL, bytes INTEGER NOT NULL, footprint INTEGER NOT NULL,
                     block INTEGER NOT NULL CHECK (block > 0));
CREATE TABLE IF NOT EXISTS live (doc TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN
  UPDATE totals SET files = files + 1, bytes = bytes + new.size,
                    footprint = footprint + (new.size + block - 1) / block * block;
END;
CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN
  UPDATE totals SET files = files - 1, bytes = bytes - old.size,
                    footprint = footprint - (old.size + block - 1) / block * block;
END;
CREATE TRIGGER IF NOT EXISTS entries_resized AFTER UPDATE OF size ON entries BEGIN
  UPDATE totals SET bytes = bytes - old.size + new.size,
                    footprint = footprint - (old.size + block - 1) / block * block
                                          + (new.size + block - 1) / block * block;
END;
"""


class _StateDb:
    """The state's files: `.users` (shared flock while open), `.lock` (flock), `state.db` (SQLite).

    `.lock` serialises every update across processes (a flock wakes its waiter at once; SQLite's
    own lock, taken inside it, is never contended). `state.db` keeps entries one row each, so an
    update costs the same at 10 cached files or 100,000, and the small parts (pins, soft pins,
    reservations, waiters, claims, retired files) as one JSON document. It runs with a rollback
    journal (`TRUNCATE`) and no fsync: a process killed mid-update leaves a hot journal that the
    next update rolls back, so the previous state stands. A power loss may leave a damaged file;
    it is found on open (`PRAGMA quick_check`) or on read, and rebuilt from the directory when
    nobody else has the cache open (see `begin`).
    """

    def __init__(self, *, root: str, data_dir: str) -> None:
        self.root, self.data_dir = root, data_dir
        self.path = os.path.join(root, _DB)
        self._lock_fd: int | None = None
        self._users_fd: int | None = None
        self._conn: sqlite3.Connection | None = None
        self._connections = 0  # connections opened so far (part of `version`'s token)
        self._checked = False  # `PRAGMA quick_check` passed on this connection
        self._block = 0

    @property
    def block(self) -> int:
        """The file system's block size (asked on first use: a copy made in a forked child touches nothing)."""
        if not self._block:
            self._block = os.statvfs(self.root).f_frsize or 4096
        return self._block

    @property
    def opened(self) -> bool:
        """Whether the descriptors are open."""
        return self._lock_fd is not None

    def open(self) -> None:
        """Open the lock files (once) and take the shared `.users` lock."""
        if self._users_fd is None:
            self._users_fd = os.open(os.path.join(self.root, _USERS), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
        if self._lock_fd is None:
            self._lock_fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def close(self) -> None:
        """Close the database and every descriptor (drops the `.users` lock)."""
        self._disconnect()
        for fd in (self._lock_fd, self._users_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._users_fd = None

    def _disconnect(self) -> None:
        self._checked = False
        conn, self._conn = self._conn, None
        if conn is not None and _OPENED.get(id(conn), (-1, None))[0] == os.getpid():
            del _OPENED[id(conn)]
            with _gate(), contextlib.suppress(sqlite3.Error):
                conn.close()

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

    def version(self) -> tuple[int, int] | None:
        """A token that changes once another connection (another owner: process or cache object)
        commits to the database, SQLite's `data_version` of this connection; None when this owner
        has no connection. This connection's own commits leave it as it is."""
        conn = self._conn
        if conn is None:
            return None
        return self._connections, conn.execute("PRAGMA data_version").fetchone()[0]

    def file_bytes(self) -> int:
        """Bytes of `state.db` now (its journal is empty between updates)."""
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def begin(self) -> tuple[str, dict[str, Any], EntryTable]:
        """Start an update (caller holds `exclusive`): (the small parts as read, parsed, the entries).

        A damaged database (not SQLite, a bad page, another schema, a bad document) is rebuilt from
        the directory only when no other user has the cache open: their pins live in it, and a
        rebuild would let their mapped shards be evicted. Otherwise `CacheStateError` names the
        damage. The caller's own pins are never lost: `CacheState` writes them back from its ledger.
        """
        try:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            try:
                if not self._checked:  # on open, and after an update hit a damaged page
                    check = conn.execute("PRAGMA quick_check").fetchone()[0]
                    if check != "ok":
                        raise sqlite3.DatabaseError(f"quick_check: {check}")
                    self._checked = True
                raw = conn.execute("SELECT doc FROM live").fetchone()[0]
                live = json.loads(raw)
                if not isinstance(live, dict) or any(not isinstance(live.get(p), dict) for p in _PARTS):
                    raise ValueError("the live document is not a mapping of the state's parts")
                return raw, live, EntryTable(conn, self.block)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except (sqlite3.Error, ValueError, TypeError) as exc:
            if not _damaged(exc):
                raise CacheStateError(f"cache {self.root}: {_DB} cannot be updated ({exc})") from exc
            why = f"{type(exc).__name__}: {exc}"
        if not self._sole_user():
            raise CacheStateError(
                f"cache {self.root}: the shared state is damaged ({why}) while other users (processes, or other "
                f"cache objects in this one) have it open; it holds their pins, so it is not rebuilt under them. "
                f"Stop every process using this cache (the next one rebuilds the state from the directory), "
                f"or point cache_dir elsewhere."
            )
        log.warning("cache %s: the shared state is damaged (%s); rebuilt from the directory", self.root, why)
        self._disconnect()
        for name in (_DB, _DB + "-journal"):
            unlink(os.path.join(self.root, name))
        conn = self._connect()
        conn.execute("BEGIN IMMEDIATE")
        raw = conn.execute("SELECT doc FROM live").fetchone()[0]
        return raw, json.loads(raw), EntryTable(conn, self.block)

    def commit(self, raw: str, live: dict[str, Any]) -> None:
        """End the update: write the small parts when they changed, then commit."""
        assert self._conn is not None
        doc = json.dumps({p: live[p] for p in _PARTS}, separators=(",", ":"))
        if doc != raw:
            self._conn.execute("UPDATE live SET doc = ?", (doc,))
        self._conn.execute("COMMIT")

    def rollback(self, exc: BaseException) -> None:
        """End the update leaving the state as it was; an update that hit damage has the database
        checked again by the next one (which rebuilds it, or says why it cannot)."""
        if isinstance(exc, sqlite3.Error) and _damaged(exc):
            self._checked = False
        if self._conn is not None and self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _connect(self) -> sqlite3.Connection:
        """The open database (opened and checked once per owner; created and filled from the
        directory when missing)."""
        if self._conn is not None:
            return self._conn
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=_BUSY_S)
        _OPENED[id(conn)] = (os.getpid(), conn)
        try:
            conn.execute("PRAGMA journal_mode = TRUNCATE")
            conn.execute("PRAGMA synchronous = OFF")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                self._create(conn)
            elif version != _VERSION:
                raise ValueError(f"{_DB} has schema version {version}, not {_VERSION}")
            if conn.execute("SELECT block FROM totals").fetchone()[0] != self.block:  # moved to another file system
                conn.execute(
                    "UPDATE totals SET block = ?1, footprint = (SELECT COALESCE(SUM((size + ?1 - 1) / ?1 * ?1), 0) "
                    "FROM entries)", (self.block,)
                )
        except BaseException:
            _OPENED.pop(id(conn), None)
            conn.close()
            raise
        self._conn = conn
        self._connections += 1
        return conn

    def _create(self, conn: sqlite3.Connection) -> None:
        """A new state: the schema, no pins, an entry per complete file in the directory."""
        conn.execute(f"PRAGMA page_size = {_PAGE}")
        conn.executescript(_SCHEMA)  # IF NOT EXISTS: a creation cut short is finished here
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("DELETE FROM entries")
            conn.execute("DELETE FROM totals")
            conn.execute("DELETE FROM live")
            conn.execute("INSERT INTO totals VALUES (0, 0, 0, ?)", (self.block,))
            conn.execute("INSERT INTO live VALUES (?)", (json.dumps({p: {} for p in _PARTS}),))
            entries = EntryTable(conn, self.block)
            with os.scandir(self.data_dir) as it:
                for de in it:
                    if de.is_file():
                        st = de.stat()
                        entries.put(de.name, size=st.st_size, used=st.st_mtime, stamp=None)
            conn.execute(f"PRAGMA user_version = {_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        for name in _OLD_FILES:  # the state of an earlier layout: nothing reads it
            unlink(os.path.join(self.root, name))

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


class CacheState:
    """Shared state of the cache in `root` (`data_dir`, `tmp_dir` inside it) plus this owner's pins."""

    def __init__(self, *, root: str, data_dir: str, tmp_dir: str, stats: TransferStats | None = None) -> None:
        self.root, self.data_dir, self.tmp_dir = root, data_dir, tmp_dir
        self.stats = stats  # counts each update (`state_updates`) and its time, lock waits included (`state_s`)
        self.pid = os.getpid()
        _INSTANCES[0] += 1
        self.owner = f"{owner_id()}-{_INSTANCES[0]}"
        self.mutex = threading.RLock()
        self.held: dict[str, int] = {}  # THE pin ledger of this owner: key -> pins (claims in progress too)
        self.usable: set[str] = set()  # held keys whose file is in place and verified (acquire's fast path)
        self.claim: list[int] | None = None  # [least, most] bytes this owner pins at once (published with its pins)
        self._file = _StateDb(root=root, data_dir=data_dir)
        # the other owners' claims as this owner's last update left them, with `_file.version()` then
        self._claims_seen: tuple[tuple[int, int] | None, dict[str, Any]] | None = None

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
            with contextlib.suppress(OSError, sqlite3.Error, CacheStateError), self.locked() as state:
                state["soft"] = {k: o for k, o in state["soft"].items() if o != self.owner}
                state["waiting"].pop(self.owner, None)
            self._file.close()

    def collected(self) -> None:
        """This owner is gone (garbage collection): mark it and close its files, taking no flock.

        The collector may run this inside another cache's update in this thread, whose flock it
        would wait for forever (the SQLite gate it takes is re-entrant, and no update holds it for
        long). The next update by any cache of this process drops the marked owner's pins, soft
        pins and claim."""
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
        """Hold `mutex` and the cross-process lock; yield the state (its parts, and `entries`, an
        `EntryTable`), committed on normal exit and rolled back on an exception. Each update is counted
        in `stats` with its time from asking for the locks to the commit (the caller's work inside included)."""
        t0 = time.perf_counter()
        try:
            with self.mutex, self._file.exclusive(), _gate():
                raw, state, entries = self._file.begin()
                try:
                    self._prune(state)
                    self._publish(state)
                    state["entries"] = entries
                    yield state
                    seen = self._file.version()  # under the flock: no other owner commits until it is let go
                    self._file.commit(raw, state)
                    self._claims_seen = (seen, {o: c for o, c in state["claims"].items() if o != self.owner})
                except BaseException as exc:
                    self._claims_seen = None
                    self._file.rollback(exc)
                    if isinstance(exc, sqlite3.Error):
                        what = "the shared state is damaged" if _damaged(exc) else f"{_DB} cannot be updated"
                        raise CacheStateError(f"cache {self.root}: {what} ({exc})") from exc
                    raise
        finally:
            if self.stats is not None:
                self.stats.add_many(state_updates=1, state_s=time.perf_counter() - t0)

    def file_bytes(self) -> int:
        """Bytes of the state's files now."""
        return self._file.file_bytes()

    def others_claims(self) -> dict[str, Any] | None:
        """The other owners' budget claims, without an update: those this owner's last update found,
        when no other owner has committed to the state since (SQLite's `data_version`), so they are
        still the state's; None when only an update can tell (`locked`)."""
        with self.mutex:
            seen = self._claims_seen
            if seen is None or seen[0] is None or not self.opened:
                return None
            with _gate():
                now = self._file.version()
            return dict(seen[1]) if now == seen[0] else None

    @property
    def block(self) -> int:
        """The file system's block, at which the budget counts every file."""
        return self._file.block

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

    def hold_unpublished(self, key: str) -> None:
        """One more pin of `key` in this owner's ledger only: every update publishes the ledger, so
        the shared state shows it from this owner's next update on. For a file the state protects
        until then by other means (this owner's reservation of it: `CacheFill._attach_before_recorded`)."""
        with self.mutex:
            self.held[key] = self.held.get(key, 0) + 1

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
        """At start-up: remove temp files no live reservation accounts for (left by a crash); add stray
        data files; drop entries whose file is gone."""
        live_tmp = {r["tmp"] for r in state["reserved"].values()} | set(state["retired"])
        with os.scandir(self.tmp_dir) as it:
            for de in it:
                if de.name not in live_tmp:
                    pid = de.name.rsplit(".", 2)[-2] if de.name.count(".") >= 2 else ""
                    if not (pid.isdigit() and int(pid) == os.getpid()):
                        unlink(de.path)
        with os.scandir(self.data_dir) as it:
            names = {de.name for de in it if de.is_file()}
        entries: EntryTable = state["entries"]
        known = set(entries)
        for key in known - names:
            del entries[key]
        for key in names - known:
            st = os.stat(os.path.join(self.data_dir, key))
            entries.put(key, size=st.st_size, used=st.st_mtime, stamp=None)

    @staticmethod
    def used(state: dict[str, Any], block: int = 1) -> int:
        """Bytes of complete entries, reservations and retired files (removed from the cache while
        something still mapped them), each rounded up to the file system's `block`."""
        sizes = [r["size"] for r in state["reserved"].values()] + list(state["retired"].values())
        return state["entries"].bytes(block) + sum(-(-int(n) // block) * block for n in sizes)


def unlink(path: str) -> None:
    """Remove a file; a missing one is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.EISDIR):
            raise
