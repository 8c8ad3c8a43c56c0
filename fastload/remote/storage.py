"""`RemoteStorage`: a fastload dataset at any fsspec URL, read through a local `ShardCache`.

Shards are fetched whole (one large GET each, several in parallel by prefetch threads), verified
against the manifest while they are written (whole, or block by block for shards read while they
arrive: `acquire_arriving`), renamed into the cache and mmapped from there by the reader.
Transient errors (HTTP 5xx, resets, timeouts, truncated bodies) are retried with
exponential backoff and full jitter; when retries run out the error names the URL.

Every wait is bounded (defaults in `RetryPolicy` and `network_options`): each request has a connect
timeout (`connect_timeout`, 5 s) and a read timeout (`read_timeout`, 15 s: no byte for that long
fails the attempt); the file system's own inner retries are turned off so that `RetryPolicy` alone
counts attempts, and no attempt starts once its total budget (`RetryPolicy.total`, 30 s) is spent.
A server that accepts connections and never answers, or one that is gone, therefore ends in a
`RemoteFetchError` naming the URL and the attempts within about total + connect + read timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Self

import fsspec
import numpy as np
import xxhash
from fsspec.asyn import AsyncFileSystem

from fastload.formats.blocks import table_span
from fastload.formats.errors import ChecksumError, FormatError
from fastload.formats.forksafe import reset_in_child
from fastload.formats.manifest import MANIFEST_NAME, Manifest, check_relative_path
from fastload.formats.units import format_size
from fastload.remote.block_tables import BlockTables
from fastload.remote.cache.files import file_xxh3
from fastload.remote.cache.shard_cache import Arrival, BlockSpec, CacheBudgetError, Download, ShardCache
from fastload.remote.first_batch import FirstBatchHold
from fastload.remote.get import (
    CONNECT_TIMEOUT_S,
    PART_BYTES,
    PARTS_IN_FLIGHT,
    READ_TIMEOUT_S,
    STREAM_CHUNK,
    NoRanges,
    NoStream,
    gets_in_flight,
    network_options,
    ranged_into,
    stream_into,
    takes_ranges,
)
from fastload.remote.get_window import GetWindow
from fastload.remote.plan import DemandSlot, PrefetchPlan
from fastload.remote.receive_loops import ReceiveLoops
from fastload.remote.retry import RemoteFetchError, RetryPolicy, is_transient, retry_call
from fastload.remote.transfer_stats import TransferStats
from fastload.remote.transport_obstore import ObstoreTransport, choose_transport, translate, usable_here

__all__ = [
    "ARRIVING_MIN_BYTES",
    "CONNECT_TIMEOUT_S",
    "READ_TIMEOUT_S",
    "RemoteFetchError",
    "RemoteStorage",
    "RetryPolicy",
    "is_transient",
    "network_options",
]

ARRIVING_MIN_BYTES = 8 << 20  # shards from this size on are read while they arrive (`acquire_arriving`)
# Body bytes per Python call in a shard's own download, whole or by block (a reader's GETs, which it
# waits on, come in `STREAM_CHUNK`s): the per-piece Python (receive, write, hash, verify, publish:
# about 90 calls) is paid once per 2 MiB. 1 and 4 MiB measured no cheaper, 8 MiB dearer: a buffer that
# large leaves the CPU's caches between its receipt, write and hash (bench/RESULTS.md, "Download pieces
# of 2 MiB" and "A cold epoch's cost per shard"). Each fetch thread keeps one buffer of this size.
DOWNLOAD_CHUNK = 2 << 20
FSSPEC_PART_BYTES = 8 << 20  # an arriving shard's GETs through fsspec (each comes whole)
WANT_RUN_BLOCKS = 64  # at most this many blocks of an arriving shard in one out-of-order GET for a reader
WANT_GAP_BLOCKS = 16  # wanted blocks this close share a GET (fetching the gap costs less than another GET)
SIDE_GETS = 32  # out-of-order GET calls in flight at once per process
SIDE_RANGES_PER_CALL = 8  # short runs of blocks (up to `STREAM_CHUNK`) one obstore `get_ranges` call fetches
log = logging.getLogger("fastload.remote.storage")
MIN_OPEN_SHARDS = 1  # the least a reader with max_open_shards=None keeps open (it pins one more to swap)
MAX_OPEN_SHARDS = 64  # the most it keeps open
_READERS: weakref.WeakSet[RemoteStorage] = weakref.WeakSet()  # this process's storages (`_trim_readers`)


def _no_op() -> None:
    """A task that only starts a pool's thread."""


def _exact(nbytes: int) -> str:
    """A budget to recommend: exact bytes (a rounded size could fall short), with the readable size."""
    return f"{nbytes} ({format_size(nbytes)})"


class RemoteStorage:
    """The storage protocol of `fastload.formats.FastloadDataset` for fsspec URLs, through a `ShardCache`.

    `max_open_shards` is how many shards the reader keeps mapped; the reader pins one more while it
    swaps, so `cache_limit` must hold `max_open_shards + 1` of the largest shard (checked here,
    `CacheBudgetError` otherwise). When None it follows this reader's share of the budget (below).
    `prefetch(names)` hands over the upcoming shard order; `prefetch_depth` shards are kept
    fetched ahead of the last acquired one by up to `fetch_threads` threads (one whole-shard GET in
    flight each). Until a plan is handed over, an acquire reads ahead in manifest order from the shard
    it asked for (sequential readers then stream too). `fetch_threads=N` keeps N GETs in flight (a
    reader's own fetch counts as one). `fetch_threads=None` (default) bounds them from the shard size
    (enough GETs for `BYTES_IN_FLIGHT` (256 MiB) at once, 2 to `MAX_GETS` (16), and no more than the
    cache budget holds next to two shards) and chooses how many to run from measured throughput
    (`GetWindow`: from half the bound, doubled while that raises the throughput by 25%; `stats()` reports
    `remote_gets_target` and the throughput at each count tried); `prefetch_depth=None` is twice
    the bound. `receive_loops` (default: `fetch_threads`, at most 4) private event loops, each in its
    own thread with its own async file system, receive the GETs (`ReceiveLoops`), so that bodies of
    different shards are received, written and hashed on different cores.
    Shards larger than `4 x part_bytes` (16 MiB by default; 0/None: never) are fetched as ranged
    GETs of `part_bytes`, `PARTS_IN_FLIGHT` (4) at a time, written at their offsets and hashed in
    file order as they become contiguous; a store that ignores `Range` (a part of the wrong length)
    turns ranged GETs off for this object's process and the shard is fetched whole.

    Every reader (this object in each process it is pickled into: loader workers too) claims a
    share of the shared cache while it holds shards (from the acquire that pins its first shard to
    the release of its last): `(max_open_shards + 1)` shards of the largest size when it is given;
    when None, from `MIN_OPEN_SHARDS + 1` to `MAX_OPEN_SHARDS + 1` shards, the live readers
    splitting what the budget holds (`ShardCache.claim`), so a new reader shrinks the others'
    `max_open_shards` instead of failing. A claim whose least does not fit next to the other live
    readers' leasts raises `CacheBudgetError` naming the budget needed.

    Network waits: `connect_timeout` and `read_timeout` (seconds, defaults `CONNECT_TIMEOUT_S` = 5
    and `READ_TIMEOUT_S` = 15) are added to `storage_options` where it sets none (see
    `network_options`); `retry` bounds the attempts and their total time (default `RetryPolicy()`:
    10 attempts, 30 s).

    `transport`: "auto" (default) reads s3://, gs://, az:// and http(s):// URLs through obstore
    (`fastload.remote.transport_obstore`: Rust `object_store`, `storage_options` mapped by
    `store_config`; streamed bodies received by `http.client` into a reused buffer from the URL obstore
    gives, signed for S3/GCS/Azure, with the GIL released in the fetch threads) and every other URL, or
    options obstore has no equivalent for, through fsspec; "obstore" or "fsspec" forces one
    ("obstore-stream": obstore, receiving its bodies itself) (ValueError when obstore cannot read the
    URL or map the options). The chosen one is `self.transport`. obstore does not survive `fork`: a
    process forked after its parent used it (a Loader's process workers) reads through fsspec.

    `verify`: see `ShardCache` ("once" by default: every cached shard is hashed
    against the manifest before its first use in each process).

    `arriving_min_bytes` (default `ARRIVING_MIN_BYTES`, 8 MiB; None: never): shards of a version-2
    dataset from this size on are read while they arrive (`acquire_arriving`): the download installs
    the shard's block checksum table first (from the dataset's `blocks.bin`, else a GET of the shard's
    own) and publishes each block once it matched, a reader waits
    only for the blocks it reads, and blocks a reader waits for ahead of the download come in ranged
    GETs of their own (`WANT_GAP_BLOCKS`, `WANT_RUN_BLOCKS`, `SIDE_GETS`). See docs/remote.md.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        max_open_shards: int | None = None,
        prefetch_depth: int | None = None,
        fetch_threads: int | None = None,
        receive_loops: int | None = None,
        part_bytes: int | None = PART_BYTES,
        retry: RetryPolicy | None = None,
        verify: str = "once",
        fsync: bool = False,
        wait_timeout: float = 600.0,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        transport: str = "auto",
        arriving_min_bytes: int | None = ARRIVING_MIN_BYTES,
    ) -> None:
        self.url = url.rstrip("/")
        self.arriving_min_bytes = None if arriving_min_bytes is None else int(arriving_min_bytes)
        self.root = self.url
        self._user_options = dict(storage_options or {})
        self.transport = choose_transport(self.url, transport, self._user_options)
        self._receive = "obstore" if transport == "obstore-stream" else "http"  # who receives streamed bodies
        self._timeouts = (float(connect_timeout), float(read_timeout))
        self.storage_options = network_options(
            self.url, dict(storage_options or {}), connect_timeout=connect_timeout, read_timeout=read_timeout
        )
        self.retry = retry or RetryPolicy()
        self.part_bytes = int(part_bytes) if part_bytes else 0
        self.cache = ShardCache(cache_dir, limit=cache_limit, verify=verify, fsync=fsync, wait_timeout=wait_timeout)
        self._id = xxhash.xxh3_64_hexdigest(self.url.encode())
        self._small: dict[str, bytes] = {}
        self._pid = -1
        self._reset_process_state()
        manifest = Manifest.loads(self.read_small(MANIFEST_NAME), where=f"{self.url}/{MANIFEST_NAME}")
        self._biggest = max((s.bytes for s in manifest.shards), default=0)
        # name -> how to verify it by block while it arrives (version-2 shards)
        self._blocks = {
            s.file: BlockSpec(s.blocks_xxh3, manifest.block_log2)
            for s in manifest.shards
            if manifest.version >= 2 and s.blocks_xxh3 and table_span(s.bytes, manifest.block_log2) is not None
        }
        self._num_shards = len(manifest.shards)
        # `blocks.bin`: every shard's block table, so that a download needs no GET of its shard's own
        self._blocks_file = manifest.blocks_file if manifest.version >= 2 else ""
        self._table_offsets = manifest.table_offsets() if self._blocks_file else None
        self._shard_index = {s.file: k for k, s in enumerate(manifest.shards)}
        self._shard_bytes = self.cache.footprint(self._biggest)  # what one shard takes from the budget
        self._auto = max_open_shards is None
        self._open = self._check_budget(max_open_shards)
        _READERS.add(self)
        gets = gets_in_flight(self._biggest, self.cache.limit) if fetch_threads is None else int(fetch_threads)
        self.fetch_threads = max(1, gets)
        self._adaptive = fetch_threads is None
        self.receive_loops = max(1, int(min(4, self.fetch_threads) if receive_loops is None else receive_loops))
        self.prefetch_depth = max(0, int(2 * self.fetch_threads if prefetch_depth is None else prefetch_depth))

    def _bounds(self) -> tuple[int, int]:
        """(least, most) bytes this reader pins at once: `(max_open_shards + 1)` shards of the largest
        size (one more while it swaps), each at its footprint in the cache; with `max_open_shards`
        None from `MIN_OPEN_SHARDS` to `MAX_OPEN_SHARDS` open (and no more than the dataset has)."""
        cap = max(1, self._num_shards)
        if self._auto:
            least, most = min(MIN_OPEN_SHARDS + 1, cap), min(MAX_OPEN_SHARDS + 1, cap + 1)
        else:
            least = most = min(self._open + 1, cap)
        return least * self._shard_bytes, most * self._shard_bytes

    def _check_budget(self, max_open_shards: int | None) -> int:
        if self._biggest == 0:
            return max_open_shards or 1
        if not self._auto:
            self._open = int(max_open_shards)  # type: ignore[arg-type]
        least, most = self._bounds()
        if not self._auto:  # alone, for a start: the readers sharing the cache are checked at the first read
            if most + self.cache.state_bytes() > self.cache.limit:
                raise CacheBudgetError(self._budget_message(least, others=0))
            return int(max_open_shards)  # type: ignore[arg-type]
        share = self.cache.claim(most, least=least, record=False)
        if share is None:
            raise CacheBudgetError(self._budget_message(least))
        return self._opens(share)

    def _opens(self, share: int) -> int:
        """Shards to keep open within a share of `share` bytes (one more is pinned while swapping)."""
        return int(max(MIN_OPEN_SHARDS, min(MAX_OPEN_SHARDS, self._num_shards, share // self._shard_bytes - 1)))

    def _budget_message(self, least: int, others: int | None = None) -> str:
        others = self.cache.claimed_by_others() if others is None else others
        need = others + least + self.cache.state_bytes()
        what = (
            f"the {MIN_OPEN_SHARDS + 1} shards it needs at least" if self._auto
            else f"max_open_shards + 1 = {least // self._shard_bytes} shards"
        )
        return (
            f"{self.url}: cache_limit={format_size(self.cache.limit)} ({self.cache.root}) cannot hold this reader's "
            f"{what} (up to {format_size(self._biggest)} each, {self._shard_bytes} bytes on its file system) next "
            f"to the {format_size(others)} that other readers sharing the cache need at least and the cache's "
            f"state file; use cache_limit >= {_exact(need)} (the sum over every reader: each dataset object in "
            f"each process, loader workers included)"
            + ("" if self._auto else " or a smaller max_open_shards")
        )

    @property
    def max_open_shards(self) -> int:
        """How many shards the reader keeps open now: the fixed number given, or (given None) what
        this reader's share of the cache holds, which shrinks while other readers share it (down
        to `MIN_OPEN_SHARDS`) and grows back when they stop (up to `MAX_OPEN_SHARDS`)."""
        if self._auto and self._biggest:
            self._check_pid()
            least, most = self._bounds()
            share = self.cache.claim(most, least=least, record=self._claimed)
            if share is not None:
                self._open = self._opens(share)
        return self._open

    def attach(self, trim: Callable[[], None]) -> None:
        """Register a reader's `trim` (close shards beyond `max_open_shards` now), called when another
        reader of the same cache in this process claims room (held weakly)."""
        self._trims.append(weakref.WeakMethod(trim) if hasattr(trim, "__self__") else (lambda: trim))

    def _trim_readers(self, *, others: bool) -> None:
        """Have this process's readers of this cache (other storages' when `others`) close the shards
        their shares no longer hold."""
        for st in list(_READERS):
            if st._pid != os.getpid() or st.cache.root != self.cache.root or (others and st is self):
                continue
            for ref in list(st._trims):
                fn = ref()
                if fn is not None:
                    fn()

    def __repr__(self) -> str:
        return f"RemoteStorage({self.url!r}, cache={self.cache!r})"

    # -- pickling / fork: file system clients, threads and plans are per process -----------------
    def __getstate__(self) -> dict[str, Any]:
        keep = (
            "url",
            "root",
            "storage_options",
            "_user_options",
            "transport",
            "_receive",
            "_timeouts",
            "retry",
            "prefetch_depth",
            "fetch_threads",
            "_adaptive",
            "receive_loops",
            "part_bytes",
            "cache",
            "_id",
            "_small",
            "_open",
            "_auto",
            "_shard_bytes",
            "_biggest",
            "_num_shards",
            "arriving_min_bytes",
            "_blocks",
            "_blocks_file",
            "_table_offsets",
            "_shard_index",
        )
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = -1
        self._reset_process_state()
        _READERS.add(self)

    def _reset_process_state(self) -> None:
        reset_in_child(self, RemoteStorage._reset_process_state)  # no lock crosses a fork locked
        self._pid = os.getpid()
        self._fs: Any = None
        self._fs_root = ""
        self._obstore: ObstoreTransport | None = None
        self._obstore_lock = threading.Lock()
        self._side: ThreadPoolExecutor | None = None  # out-of-order GETs for readers of arriving shards
        self._planner: PrefetchPlan | None = None
        self._hold = FirstBatchHold()  # on while a cold epoch's first batch is pending (`hold_for_first_batch`)
        self._receivers: ReceiveLoops | None = None
        self._receivers_final: Any = None
        self._receive_lock = threading.Lock()
        self._manifest_cache: dict[str, tuple[int, str]] | None = None
        self._stream_ok = True
        self._ranges_ok = True
        # a ranged GET came back as just its range: obstore refuses any other answer (a store ignoring
        # `Range` fails there), fsspec may hand over a whole object as the range when they coincide
        self._ranges_seen = self._via_obstore()
        self._tables: BlockTables | None = None
        self._claimed = False
        self._trims: list[Callable[[], Callable[[], None] | None]] = []  # this process's readers (`attach`)
        self.cache.on_wait = weakref.WeakMethod(self._trim_all)  # another reader waits for room: shrink
        self._explicit_plan = False  # set by `prefetch`; until then acquires read ahead in manifest order

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset_process_state()

    @property
    def planner(self) -> PrefetchPlan:
        """This process's prefetch plan and threads (built on first use)."""
        self._check_pid()
        if self._planner is None:
            window = GetWindow(ceiling=self.fetch_threads, adaptive=self._adaptive)
            self._planner = PrefetchPlan(cache=self.cache, fetch=self._fetch, key_of=self._key, url=self.url,
                                         threads=self.fetch_threads, depth=self.prefetch_depth, window=window,
                                         blocks_of=self._block_spec, hold=self._hold)
            weakref.finalize(self, self._planner.stop)  # dropped without close(): the threads end
        return self._planner

    @property
    def fs(self) -> Any:
        """This process's own fsspec file system for the URL (built on first use, inner retries off)."""
        self._check_pid()
        if self._fs is None:
            # an instance of our own: its inner retries are turned off below, which a shared one must keep
            fs, path = fsspec.core.url_to_fs(self.url, **{"skip_instance_cache": True, **self.storage_options})
            if isinstance(getattr(fs, "retries", None), int):
                fs.retries = 1  # s3fs retries some errors itself (5 times): `RetryPolicy` alone counts attempts
            self._fs, self._fs_root = fs, path.rstrip("/")
        return self._fs

    def _via_obstore(self) -> bool:
        """Whether this process reads through obstore: the transport chosen, unless this process was
        forked after obstore ran in its parent (obstore's runtime does not survive a fork: fsspec then)."""
        return self.transport == "obstore" and usable_here()

    @property
    def obstore(self) -> ObstoreTransport:
        """This process's obstore client for the URL (built on first use; `transport="obstore"` only)."""
        self._check_pid()
        with self._obstore_lock:
            if self._obstore is None:
                connect, read = self._timeouts
                self._obstore = ObstoreTransport(
                    self.url, self._user_options, connect_timeout=connect, read_timeout=read, receive=self._receive
                )
            return self._obstore

    def claim_budget(self) -> None:
        """Claim this reader's share of the cache (see `max_open_shards`): raises `CacheBudgetError`
        when even its least does not fit next to the leasts of the other live readers. Other readers
        of the cache in this process close the shards their smaller shares no longer hold."""
        least, most = self._bounds()
        share = self.cache.claim(most, least=least)  # a fixed reader's least is its most
        if share is None:
            self.cache.claim(0)
            raise CacheBudgetError(self._budget_message(least))
        self._claimed = True
        if self._auto:
            self._open = self._opens(share)
        self._trim_readers(others=True)

    def _trim_all(self) -> None:
        self._trim_readers(others=False)

    def remote_path(self, name: str) -> str:
        """The transport's path of a dataset-relative name (absolute paths and '..' are refused):
        relative to the URL for obstore, the fsspec file system's path otherwise."""
        rel = check_relative_path(name, self.url)
        if "://" in name:
            raise FormatError(f"{self.url}: file name {name!r} is not relative")
        if self._via_obstore():
            return rel
        fs = self.fs  # sets _fs_root
        del fs
        return f"{self._fs_root}/{rel}" if self._fs_root else rel

    def _key(self, name: str, size: int, xxh3: str) -> str:
        base = "".join(c if c.isalnum() or c in "-_." else "_" for c in name.rsplit("/", 1)[-1])[-80:]
        tag = xxhash.xxh3_64_hexdigest(f"{self._id}\0{name}\0{size}\0{xxh3}".encode())
        return f"{tag}-{base.lstrip('.')}"

    # -- storage protocol -------------------------------------------------------------------------
    def read_small(self, name: str) -> bytes:
        """A whole small file (manifest, meta), fetched once per storage object."""
        self._check_pid()
        if name not in self._small:
            rpath = self.remote_path(name)
            url = f"{self.url}/{name}"
            cat = self.obstore.cat if self._via_obstore() else self.fs.cat_file
            try:
                data = retry_call(lambda: cat(rpath), url=url, policy=self.retry)
            except FileNotFoundError as exc:
                raise FormatError(f"{url}: file is missing") from exc
            self._small[name] = bytes(data)
        return self._small[name]

    def acquire(self, name: str, *, size: int, xxh3: str) -> str:
        """Local path of shard `name` (fetched and verified if needed), pinned until `release`."""
        key, demand, slot = self._before_acquire(name, size, xxh3)
        t0 = time.perf_counter()
        try:
            path = self.cache.acquire(key, size=size, xxh3=xxh3, fetch=demand, where=f"{self.url}/{name}")
        finally:
            slot.done()
        self._waited(time.perf_counter() - t0)
        return path

    def acquire_arriving(self, name: str, *, size: int, xxh3: str) -> tuple[str, Arrival | None]:
        """Like `acquire`, but a shard that is missing, or downloading in this process, is returned at
        once as (path of the file as it arrives, its `Arrival`): the reader waits in `Arrival.wait`
        for the verified blocks it reads (see `arriving_min_bytes`). (path, None) when the shard is
        cached, too small or not a version-2 shard, or downloading in another process (then it
        returns once the shard is whole)."""
        spec = self._block_spec(name, size)
        if spec is None:
            return self.acquire(name, size=size, xxh3=xxh3), None
        key, demand, slot = self._before_acquire(name, size, xxh3)
        t0 = time.perf_counter()
        try:
            got = self.cache.acquire_arriving(key, size=size, xxh3=xxh3, fetch=demand, blocks=spec,
                                              where=f"{self.url}/{name}")
        finally:
            slot.done()  # a download it started in another thread holds the slot (or takes it anew)
        self._waited(time.perf_counter() - t0)
        return got

    def _block_spec(self, name: str, size: int) -> BlockSpec | None:
        """How to verify shard `name` by block while it arrives; None when it is read whole only (see
        `arriving_min_bytes`; a store that ignores ranges cannot send its block table first)."""
        least = self.arriving_min_bytes
        if least is None or size < least or not self._ranges_ok:
            return None
        return self._blocks.get(name)

    def _before_acquire(self, name: str, size: int, xxh3: str) -> tuple[str, Callable[[Download], None], DemandSlot]:
        """Claim the budget, count the acquire as a GET in flight, take `name` off the read-ahead plan: its
        cache key, its demand fetch and its slot (`slot.done()` once the acquire returns)."""
        self._check_pid()
        self.remote_path(name)
        if not self._claimed:
            self.claim_budget()
        key = self._key(name, size, xxh3)
        planner = self.planner
        slot = planner.expect_demand()  # before the read-ahead wakes the prefetch threads
        try:
            if not self._explicit_plan and self.prefetch_depth:
                self._read_ahead(name)
            planner.acquired(name, key, size, xxh3)
        except BaseException:
            slot.done()
            raise

        def demand(sink: Download) -> None:
            self.cache.transfer.add("demand_fetches", 1)
            with slot.fetching():
                self._fetch(name, sink)

        return key, demand, slot

    def _waited(self, took: float) -> None:
        if took > 1e-3:  # the shard was not ready (fetched, waited for, or hashed now)
            self.cache.transfer.add_many(wait_s=took, waits=1)

    def release(self, name: str) -> None:
        """Unpin a shard returned by `acquire`."""
        self._check_pid()
        key = self.planner.released(name)
        if key is not None:
            self.cache.release(key)
            if self._claimed and not self.cache.pinned_keys():  # idle now: its share is free for others
                self._claimed = False
                self.cache.claim(0)

    def damaged(self, name: str, *, size: int, xxh3: str) -> str | None:
        """A reader found a checksum mismatch in shard `name`: when the cached copy no longer matches
        the manifest's xxh3 (hashed now), it was damaged in the cache: it is taken out (retired while
        something maps it) so that the next acquire fetches it again, and its path is returned.
        None when the copy matches (the remote object itself disagrees with its checksums)."""
        self._check_pid()
        key = self._key(name, size, xxh3)
        path = self.cache.path(key)
        try:
            intact = os.path.getsize(path) == size and file_xxh3(path) == xxh3.lower()
        except FileNotFoundError:
            intact = False
        if intact:
            return None
        return self.cache.discard(key)

    def stats(self) -> dict[str, float]:
        """This process's transfer timings and counters, keys prefixed `remote_` (see
        `fastload.remote.transfer_stats`); `remote_MBps` is `bytes` / `get_busy_s` in MB/s."""
        self._check_pid()
        out = self.cache.stats()
        out["MBps"] = out["bytes"] / out["get_busy_s"] / 1e6 if out["get_busy_s"] > 0 else 0.0
        out.update(self.planner.window.stats())
        return {f"remote_{k}": v for k, v in out.items()}

    def prefetch(self, names: list[str], *, sizes: dict[str, tuple[int, str]] | None = None) -> None:
        """Upcoming shards in the order they will be acquired; replaces any earlier plan.

        Sizes and checksums come from the manifest read at construction (or `sizes`).
        """
        self._check_pid()
        self._explicit_plan = True
        self._set_plan(names, sizes)

    def hold_for_first_batch(self) -> None:
        """A reader starts an epoch whose shards are not all cached: until `first_batch_served` (or
        `FIRST_BATCH_HOLD_S`, or until the batch wants `FIRST_BATCH_BULK_BYTES` through GETs of its
        own), start no GET its first batch does not wait for (`FirstBatchHold`): no prefetch, and one
        GET per arriving shard rather than one per part. One side thread is started now, before any
        GET, so that the batch's own GETs (`_want`) do not wait for a thread to start while the
        downloads' receipts hold the GIL."""
        self._check_pid()
        self._hold.begin()
        if self.arriving_min_bytes is not None and self._ranges_ok:
            self._side_pool().submit(_no_op)  # an idle worker is left for the first `_want`

    def first_batch_served(self) -> None:
        """The reader served its epoch's first batch: GETs held back (`hold_for_first_batch`) start."""
        self._check_pid()
        self._hold.release()

    def _read_ahead(self, name: str) -> None:
        """No plan was handed over: plan the shards after `name` in manifest order, unless `name`
        is in the current read-ahead plan already (the reader is following it)."""
        if not self.planner.following(name):
            order = list(self._manifest_sizes())
            if name in order:
                self._set_plan(order[order.index(name) + 1 :])

    def _set_plan(self, names: list[str], sizes: dict[str, tuple[int, str]] | None = None) -> None:
        if self.prefetch_depth == 0:
            return
        known = self._manifest_sizes()
        if sizes:
            known = {**known, **sizes}
        for n in names:
            self.remote_path(n)
        self.planner.replace(names, known)

    def close(self) -> None:
        """Stop prefetch threads, let the downloads under way end (each wait bounded), close the
        clients and drop soft pins (pins taken by `acquire` stay until `release`)."""
        if self._pid != os.getpid():
            return
        if self._planner is not None:
            self._planner.close()
        if self._side is not None:
            self._side.shutdown(wait=True, cancel_futures=True)
            self._side = None
        if self._receivers_final is not None:
            self._receivers_final()  # closes the receive loops' sessions, stops and joins their threads
            self._receivers = self._receivers_final = None
        if self._obstore is not None:
            self._obstore.close()  # the receiver's idle connections
        self.cache.unsoft()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _manifest_sizes(self) -> dict[str, tuple[int, str]]:
        if self._manifest_cache is None:
            m = Manifest.loads(self.read_small(MANIFEST_NAME), where=f"{self.url}/{MANIFEST_NAME}")
            self._manifest_cache = {s.file: (s.bytes, s.xxh3) for s in m.shards}
        return self._manifest_cache

    def _receivers_now(self) -> ReceiveLoops | None:
        """This process's `ReceiveLoops` (built on first use; closed by `close` or when this object is
        collected), or None when the file system is not async (it is read with `cat_file` then)."""
        fs = self.fs
        if not (isinstance(fs, AsyncFileSystem) and getattr(fs, "async_impl", False)):
            return None
        with self._receive_lock:
            if self._receivers is None:
                loops = ReceiveLoops(url=self.url, storage_options=self.storage_options, count=self.receive_loops)
                self._receivers, self._receivers_final = loops, weakref.finalize(self, loops.close)
            return self._receivers

    def _get_into(self, rpath: str, sink: Download) -> None:
        """One whole-object GET of `rpath` into `sink`.

        On async file systems (s3fs, gcsfs, http) the GET runs on one of this process's
        `receive_loops` private event loops, and when it streams a response (s3fs, http) the body
        goes to `sink` in `STREAM_CHUNK` pieces as it arrives, written and hashed by that loop's
        thread: each byte is copied once into the cache file and hashed once, no whole-object buffer
        is built, and no HEAD request precedes the GET (`cat_file` on s3fs sends one). Shards over
        `4 x part_bytes` come in ranged GETs. Elsewhere `cat_file` returns the object, written in one piece.
        """
        stats = self.cache.transfer
        stats.add("requests", 1)
        if self._via_obstore():
            self._obstore_into(rpath, sink, stats)
            return
        loops = self._receivers_now()
        if loops is None:
            t0 = time.perf_counter()
            data = self.fs.cat_file(rpath)
            stats.add_many(request_s=time.perf_counter() - t0, bytes=len(data))
            sink.write(data)
            return
        size = getattr(sink, "size", 0)
        if self.part_bytes and size > 4 * self.part_bytes and self._ranges_ok and takes_ranges(self.fs):
            try:
                loops.run(ranged_into, rpath, sink, self.part_bytes, stats)
                return
            except NoRanges:
                self._ranges_ok = False  # whole-object GETs from now on
                sink.reset()
        if self._stream_ok:
            try:
                loops.run(stream_into, rpath, sink, STREAM_CHUNK, stats)
                return
            except (NotImplementedError, NoStream):
                self._stream_ok = False  # this file system cannot stream (nothing was written): cat_file from now on
        t0 = time.perf_counter()
        data = loops.run(lambda fs, path: fs._cat_file(path), rpath)
        stats.add_many(request_s=time.perf_counter() - t0, bytes=len(data))
        sink.write(data)

    def _obstore_into(self, rpath: str, sink: Download, stats: TransferStats) -> None:
        """`_get_into` through obstore, in this thread with the GIL released while receiving: ranged
        GETs over `4 x part_bytes` (whole-object GETs from then on when the store ignores ranges),
        else one streamed GET."""
        size = getattr(sink, "size", 0)
        if self.part_bytes and size > 4 * self.part_bytes and self._ranges_ok:
            try:
                self.obstore.ranged_into(rpath, sink, self.part_bytes, stats)
                return
            except NoRanges:
                self._ranges_ok = False
                sink.reset()
        self.obstore.stream_into(rpath, sink, stats, DOWNLOAD_CHUNK)

    def _get_range(self, rpath: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `rpath` in one ranged GET (a store that ignores `Range` may send the
        whole object; one that refuses ranges gives b"")."""
        if self._via_obstore():
            import obstore
            import obstore.exceptions as oe

            try:
                return bytes(obstore.get_range(self.obstore.store, rpath, start=start, end=end))
            except oe.NotSupportedError:
                return b""
            except Exception as exc:
                raise translate(exc, f"{self.url}/{rpath}") from exc
        loops = self._receivers_now()
        if loops is not None:
            return loops.run(lambda fs, path: fs._cat_file(path, start=start, end=end), rpath)
        return self.fs.cat_file(rpath, start=start, end=end)

    def _known_table(self, name: str) -> bytes | None:
        """Shard `name`'s block table from the dataset's `blocks.bin` (unchecked: `Download.put_table`
        checks it), once ranged GETs are known to come back as asked; None when there is none to be had."""
        if self._table_offsets is None or not (self._ranges_ok and self._ranges_seen):
            return None
        with self._receive_lock:
            if self._tables is None:
                rpath = self.remote_path(self._blocks_file)
                self._tables = BlockTables(self._table_offsets, partial(self._blocks_page, rpath))
            tables = self._tables
        return tables.table(self._shard_index[name])

    def _blocks_page(self, rpath: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `blocks.bin` (`BlockTables`' fetch), retried as any GET."""
        stats = self.cache.transfer
        stats.add_many(requests=1, table_pages=1)
        t0 = time.perf_counter()
        data = retry_call(lambda: self._get_range(rpath, start, end), url=f"{self.url}/{self._blocks_file}",
                          policy=self.retry)
        stats.add_many(request_s=time.perf_counter() - t0, bytes=len(data))
        return data

    def _table_into(self, name: str, rpath: str, sink: Download) -> bool:
        """Install the shard's block checksum table in `sink` before its body, so that its blocks are
        verified and published as they arrive, and blocks a reader waits for can be fetched out of order
        (`_want`): from `blocks.bin` (`_known_table`), else (or when that one does not match the
        manifest) in a GET of the shard's last bytes, with its first block beside it. True when that
        GET brought the whole object (a store that ignores `Range`: ranged GETs are off from then on,
        and nothing is published before the end)."""
        start, end = sink.table_range()
        arrival = sink.arrival
        assert arrival is not None
        known = self._known_table(name)
        if known is not None:
            try:
                sink.put_table(known)
            except ChecksumError as exc:
                log.warning("%s/%s: %s; the shard's own table is fetched", self.url, self._blocks_file, exc)
                self.cache.transfer.add("tables_rejected", 1)
                assert self._tables is not None
                self._tables.forget(self._shard_index[name])
            else:
                return False
        head = min(1 << arrival.spec.shift, start)  # block 0: the shard's header, the first thing a reader reads
        stats = self.cache.transfer
        if self._via_obstore() and self._ranges_ok and head:
            stats.add("requests", 2)  # both at once: the header comes with the table, not one round trip later
            try:
                data, first = (memoryview(b) for b in self.obstore.ranges(rpath, [start, 0], [end, head], stats))
            except NoRanges:
                data, first = memoryview(b""), None
        else:
            stats.add("requests", 1)
            t0 = time.perf_counter()
            data, first = memoryview(self._get_range(rpath, start, end)), None
            stats.add_many(request_s=time.perf_counter() - t0, bytes=len(data))
        if len(data) == end - start:
            self._ranges_seen = True
            sink.put_table(data)
            if first is not None and len(first) == head:
                for claim, _, _ in arrival.claim_wanted(np.zeros(1, dtype=np.int64)):
                    try:
                        sink.write_claimed(claim, 0, first)
                    finally:
                        sink.release(claim)
            return False
        self._ranges_ok = False  # the store ignores ranges: whole-object GETs, whole shards from now on
        sink.skip_table()
        if len(data) == sink.size:
            sink.write(data)
            return True
        return False

    def _range_into(self, rpath: str, sink: Download, claim: int, start: int, end: int, chunk: int) -> None:
        """Bytes [start, end) of an arriving shard for claim `claim`, handed to `sink.write_claimed` as
        they arrive (obstore streams the range in pieces of `chunk` bytes; fsspec brings it in one piece)."""
        stats = self.cache.transfer
        stats.add("requests", 1)
        write = partial(sink.write_claimed, claim)  # (offset, data) -> whether the GET goes on
        if self._via_obstore():
            self.obstore.range_into(rpath, start, end, write, stats, chunk=chunk)
            return
        t0 = time.perf_counter()
        data = self._get_range(rpath, start, end)
        stats.add_many(receive_s=time.perf_counter() - t0, bytes=len(data), ranged_parts=1)
        if len(data) != end - start:
            raise ConnectionError(f"{self.url}/{rpath}: range [{start}, {end}) came back with {len(data)} bytes")
        write(start, data)

    def _blocks_into(self, rpath: str, sink: Download) -> None:
        """An arriving shard's own download: ranged GETs of the runs of blocks nobody claimed, in file
        order, skipping what readers' GETs claimed; it ends when every block is published. Through
        obstore one GET runs to the next claimed block (a reader's GET that takes over blocks ahead
        of it ends it there), through fsspec GETs of up to `FSSPEC_PART_BYTES`; shards over
        4 x `part_bytes` come in GETs of `part_bytes`, `PARTS_IN_FLIGHT` at once.
        Readers' GETs that bring nothing for `connect_timeout + read_timeout` are taken back and
        fetched here."""
        arrival = sink.arrival
        assert arrival is not None
        shift, sections_end = arrival.spec.shift, arrival.sections_end
        lanes = PARTS_IN_FLIGHT if self.part_bytes and sink.size > 4 * self.part_bytes else 1
        if lanes > 1:
            part = max(1, self.part_bytes >> shift)
        elif self._via_obstore():
            part = len(arrival.published)  # a streamed GET stops where a reader took its blocks over
        else:  # fsspec brings a range whole: blocks a reader takes over in it arrive twice
            part = max(1, FSSPEC_PART_BYTES >> shift)
        mine: set[int] = set()  # claims of this download's own GETs in flight
        lock = threading.Lock()
        failed = threading.Event()
        patience = sum(self._timeouts)
        # readers' own GETs (`_want`) start before the first GET here claims its blocks: a reader
        # already waiting for the header (block 0, at an epoch's start) gets that block in a GET of its
        # own, one round trip, rather than with this GET's first piece, and this GET starts after it
        wants = [partial(self._want, rpath, sink)] if arrival.on_want is None else []

        def lane() -> None:
            cursor = 0
            while not failed.is_set():
                if wants:
                    with lock:
                        want = wants.pop() if wants else None
                    if want is not None:  # a first batch waiting for the downloads holds none back
                        arrival.set_want(want, gap=WANT_GAP_BLOCKS, run=WANT_RUN_BLOCKS, follow=self._hold.release)
                got = arrival.claim_next(cursor, part)
                if got is None:
                    with lock:
                        others = [c for c in arrival.outstanding() if c not in mine]
                    if not others:
                        return  # every block is published, or in another lane's GET
                    if not arrival.wait_free(patience):
                        for c in set(others) & set(arrival.outstanding()):
                            sink.release(c)  # a reader's GET that brought nothing for that long
                    continue
                claim, first, stop = got
                with lock:
                    mine.add(claim)
                try:
                    self._range_into(rpath, sink, claim, first << shift, min(stop << shift, sections_end),
                                     DOWNLOAD_CHUNK)
                except BaseException:
                    failed.set()
                    raise
                finally:
                    sink.release(claim)  # only what did not arrive is given back
                    with lock:
                        mine.discard(claim)
                cursor = stop

        if lanes == 1:
            lane()
            return
        with ThreadPoolExecutor(lanes, thread_name_prefix="fastload-part") as pool:
            futures = [pool.submit(lane)]
            # while a first batch is pending, the shard comes in one GET from its start; the other lanes'
            # threads start after it, not beside the first GET's receipt
            self._hold.wait()
            futures += [pool.submit(lane) for _ in range(lanes - 1)]
        for f in futures:
            f.result()

    def _side_pool(self) -> ThreadPoolExecutor:
        """The threads of readers' own GETs (`_want`), made on first use."""
        with self._receive_lock:
            if self._side is None:
                self._side = ThreadPoolExecutor(SIDE_GETS, thread_name_prefix="fastload-side")
            return self._side

    def _want(self, rpath: str, sink: Download, runs: list[tuple[int, int, int]]) -> None:
        """A reader waits for blocks nobody fetched yet: `runs` (claim, first block, end block) claimed for
        it (see `Arrival.set_want`), fetched on this process's side threads: through obstore, runs of up
        to `STREAM_CHUNK` bytes `SIDE_RANGES_PER_CALL` to a `get_ranges` call (its GETs run at once, the
        GIL released) and longer ones each in a streamed GET (no buffer of the whole run); through
        fsspec one GET per run."""
        arrival = sink.arrival
        assert arrival is not None
        shift, end = arrival.spec.shift, arrival.sections_end
        spans = [(claim, first << shift, min(stop << shift, end)) for claim, first, stop in runs]
        self._hold.wanted(sum(b - a for _, a, b in spans))  # a first batch that wants this much holds nothing back
        pool = self._side_pool()
        batched: list[tuple[int, int, int]] = []  # short runs, several to an obstore `get_ranges` call
        streamed: list[tuple[int, int, int]] = []
        for span in spans:
            short = self._via_obstore() and span[2] - span[1] <= STREAM_CHUNK
            (batched if short else streamed).append(span)
        for i in range(0, len(batched), SIDE_RANGES_PER_CALL):
            pool.submit(self._side_fetch, rpath, sink, batched[i : i + SIDE_RANGES_PER_CALL], streamed=False)
        for span in streamed:
            pool.submit(self._side_fetch, rpath, sink, [span], streamed=True)

    def _side_fetch(self, rpath: str, sink: Download, spans: list[tuple[int, int, int]], *, streamed: bool) -> None:
        """The GETs of `_want` for `spans` (claim, start, end): one streamed GET of one span (no buffer of the
        whole run), or one obstore `get_ranges` call; on a failure their blocks go back to the ledger (the
        download takes them)."""
        stats = self.cache.transfer
        try:
            stats.add_many(side_gets=len(spans), side_bytes=sum(b - a for _, a, b in spans))
            if streamed:
                ((claim, start, end),) = spans
                self._range_into(rpath, sink, claim, start, end, STREAM_CHUNK)
                return
            stats.add("requests", 1)
            got = self.obstore.ranges(rpath, [a for _, a, _ in spans], [b for _, _, b in spans], stats)
            for (claim, start, end), data in zip(spans, got):
                if len(data) == end - start:
                    sink.write_claimed(claim, start, data)
        except ChecksumError as exc:  # corrupt in transit: the download fetches these blocks again
            stats.add("side_rejected", 1)
            log.debug("out-of-order GETs of %s %s were corrupt: %r", rpath, [(a, b) for _, a, b in spans][:4], exc)
        except Exception as exc:  # noqa: BLE001 - the download's own GETs bring these blocks
            log.debug("out-of-order GETs of %s %s failed: %r", rpath, [(a, b) for _, a, b in spans][:4], exc)
        finally:
            for claim, _, _ in spans:
                sink.release(claim)

    def _fetch(self, name: str, sink: Download) -> None:
        """Whole-object GET of `name` into `sink`, retried on transient errors (bad checksums too)."""
        rpath = self.remote_path(name)
        url = f"{self.url}/{name}"
        attempts = [0]

        def once() -> None:
            if attempts[0]:
                self.cache.transfer.add("retries", 1)
            attempts[0] += 1
            sink.reset()
            with self.cache.transfer.get(sink.size):
                if sink.wants_table and self._table_into(name, rpath, sink):
                    pass  # the store ignored the range: that GET brought the whole object
                elif sink.by_block:
                    self._blocks_into(rpath, sink)
                else:
                    self._get_into(rpath, sink)
            sink.check()

        retry_call(once, url=url, policy=self.retry)
        self.cache.transfer.add_many(fetched=1, fetched_bytes=sink.written)
        self.planner.finished()
