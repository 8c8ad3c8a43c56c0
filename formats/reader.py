"""`FastloadDataset`: a map-style dataset over a fastload directory, with one vectorized gather per batch."""

from __future__ import annotations

import bisect
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import numpy as np

from . import buffers as batch_buffers
from .blocks import BlockLedger, ColumnGuard
from .columns import Block
from .errors import ChecksumError, FormatError
from .forksafe import reset_in_child
from .manifest import MANIFEST_NAME, Manifest
from .open_columns import OpenColumns
from .ragged import Ragged
from .rows import take_rows_into
from .schema import Schema
from .shapes import ShapedBatch
from .shard import ShardIdentity, ShardReader
from .spliced import ColumnPart, OpenFiles, SplicedColumn, splice_available, splice_column
from .spliced_ragged import SplicedRagged
from .storage import Arrival, LocalStorage, Storage

try:  # the C extension copies a batch's rows from several shards in one call, GIL released
    from ._ranges import take_rows as _c_take_rows
except ImportError:  # pragma: no cover - a build without the C extension
    _c_take_rows = None

__all__ = [
    "RESIDENT_ITEM_BYTES",
    "RESIDENT_LIMIT",
    "VERIFY_MODES",
    "FastloadDataset",
    "gather_ragged",
    "sample_from_columns",
    "take_rows_into",
]

RESIDENT_ITEM_BYTES = 64  # fixed fields up to this size per sample are kept in memory (local datasets)
RESIDENT_LIMIT = 256 << 20  # at most this many bytes of them per dataset
SPAN_SHARDS = 64  # a batch over open shards within this many of each other is gathered field by field in one pass
HUGE_FRACTION = 0.5  # datasets up to this fraction of physical memory are mapped in huge-page units
VERIFY_MODES = ("auto", "full", "none")


def verify_mode(verify: str | None) -> str:
    """The `verify` mode (None: "auto"); ValueError for another value."""
    verify = "auto" if verify is None else verify
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    return verify


def _gather_rows(
    gather: Callable[[np.ndarray], Any], row_numbers: Callable[[np.ndarray], np.ndarray], indices: np.ndarray
) -> Any:
    return gather(row_numbers(indices))


def gather_ragged(
    sources: list[np.ndarray], source_of: np.ndarray, starts: np.ndarray, lengths: np.ndarray, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate `sources[source_of[i]][starts[i] : starts[i] + lengths[i]]` for every i -> (values, offsets).

    The slices are joined by `bytearray.join` over memoryviews: one C-level copy per sample with no
    numpy call per sample. Measured here for 256 slices: 446 vs 679 us (100-20,000 B each) and
    90 vs 830 us (10-200 B) against per-slice assignment / a vectorized index gather.
    """
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if len(lengths) == 0 or offsets[-1] == 0:
        return np.empty(int(offsets[-1]), dtype=dtype), offsets
    size = dtype.itemsize
    views = [src.view(np.uint8).data for src in sources]
    byte_starts = (starts * size).tolist()
    byte_ends = ((starts + lengths) * size).tolist()
    if len(views) == 1:
        view = views[0]
        parts = [view[a:b] for a, b in zip(byte_starts, byte_ends)]
    else:
        parts = [views[k][a:b] for k, a, b in zip(source_of.tolist(), byte_starts, byte_ends)]
    return np.frombuffer(bytearray().join(parts), dtype=dtype), offsets


def _physical_memory() -> int:
    """Bytes of physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _raise(err: BaseException, *args: Any) -> None:
    raise err


def _weakly(method: Callable[..., Any], gone: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The bound `method`, called through a weak reference to its object; once that object is gone,
    `gone` with the same arguments (None: `ReferenceError`). For callbacks a dataset hands to what it
    owns (its shard readers, its block ledger): a callback that held the dataset would make a cycle,
    and a dropped dataset's mappings and file descriptors would stay until a garbage collection
    instead of going with it."""
    ref, name = weakref.WeakMethod(method), method.__qualname__

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is not None:
            return bound(*args, **kwargs)
        if gone is not None:
            return gone(*args, **kwargs)
        raise ReferenceError(f"{name}: the dataset is gone; keep a reference to it while using what it handed "
                             "out (`direct_takes`, shard readers): their unverified blocks are checked through it")

    return call


def _where_without(root: str, index: int, name: str) -> str:
    """`FastloadDataset.where` once the dataset is gone (no shard table at hand): root, sample and field."""
    return f"{root}: sample {int(index)}, field {name!r}"


def _the_error(k: int, exc: BaseException, **_: Any) -> BaseException:
    """A shard reader's error hook once its dataset is gone: the error itself."""
    return exc


def _guarded(column: weakref.ref, guard: ColumnGuard, *rows: np.ndarray) -> None:
    """A spliced column's check: verify the blocks under `rows` (and counts, for a variable field's
    item runs); drop the check once all are verified. The column is held weakly: a check the column
    holds must not keep it alive (a cycle would leave its mapping in place until a garbage
    collection, which then unmaps it in the middle of whatever runs)."""
    guard(*rows)
    if guard.done:
        owner = column()
        if owner is not None:
            owner.check = None


def sample_from_columns(schema: Schema, batch: dict[str, Any], i: int, *, where: str = "") -> dict[str, Any]:
    """Sample i of a columnar batch as the values `ds[i]` returns."""
    out: dict[str, Any] = {}
    for f in schema:
        col = batch[f.name]
        if f.kind == "scalar":
            out[f.name] = col[i].item()
        elif f.kind == "string" and col.origin is None:
            out[f.name] = _utf8(col.values[col.offsets[i] : col.offsets[i + 1]], f"{where}, field {f.name!r}")
        else:
            out[f.name] = col[i]
    return out


def _utf8(part: np.ndarray, where: str) -> str:
    """Decode a stored string; invalid UTF-8 means the shard is corrupt (checksums catch it too)."""
    try:
        return part.tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{where}: invalid UTF-8 in a string field (corrupt shard? run `fastload verify`)") from exc


class _Runs:
    """One variable field of a batch gathered shard by shard: per sample, the source array (by
    number in `sources`), start and length of its items, and its shape (vndarray)."""

    def __init__(self, m: int, ndim: int) -> None:
        self.sources: list[np.ndarray] = []
        self.source_of = np.empty(m, dtype=np.int64)
        self.starts = np.empty(m, dtype=np.int64)
        self.lengths = np.empty(m, dtype=np.int64)
        self.shapes = np.empty((m, ndim), dtype=np.uint32) if ndim else None


def _gather_group(
    reader: ShardReader, wanted: list[Any], fixed: list[Any], variable: list[Any], g: int, a: int, b: int,
    rows: np.ndarray, cols: dict[str, np.ndarray], runs: dict[str, _Runs], *, copy: bool,
    places: np.ndarray | None = None, ahead: bool = False,
) -> None:
    """Sorted batch positions [a, b) (group `g`) from `reader`: the `fixed` fields of `wanted` into
    `cols` (at rows [a, b), or at `places`, the caller's positions of these rows in a batch that was
    not in shard order), the `variable` fields' runs into `runs` (their items copied out when `copy`:
    nothing here keeps the mapping then). `ahead`: an arriving shard's blocks are fetched ahead of
    its download (`ShardReader.verify_blocks`)."""
    # every field's blocks at once (an arriving shard: asked for together)
    reader.ensure_fields(wanted, rows, ahead=ahead)
    columns = reader.fixed
    for f in fixed:
        if places is None:
            columns[f.name].take(rows, axis=0, out=cols[f.name][a:b], mode="clip")
        else:
            take_rows_into(columns[f.name], rows, cols[f.name], places)
    for f in variable:
        run = runs[f.name]
        offs, values = reader.ragged[f.name]
        lo = offs[rows]
        length = offs[rows + 1] - lo
        if copy:
            values, piece_offsets = gather_ragged([values], run.source_of[a:b], lo, length, f.dtype)
            lo = piece_offsets[:-1]
        run.sources.append(values)
        run.source_of[a:b], run.starts[a:b], run.lengths[a:b] = g, lo, length
        if run.shapes is not None:
            run.shapes[a:b] = reader.shapes[f.name][rows]


class FastloadDataset:
    """Map-style dataset over a fastload directory (see FORMAT.md).

    `ds[i]` returns a dict (numpy arrays, Python scalars, bytes, str); `get_batch(indices)` returns
    columns (arrays for fixed fields, `Ragged` for variable ones). Shards are mapped lazily; at most
    `max_open_shards` shard readers stay open (and pinned in the storage's cache) at once. Large
    fixed fields of a local dataset (or a cached one whose shards are all open) are read through
    one spliced mapping of that column across every shard (`spliced.py`), small ones from a copy
    kept in memory: one gather per field for any batch.

    `verify` (FORMAT.md, "Reading and verification"): "auto" (default) checks every byte it returns: each
    64 KiB block of a version-2 shard against its checksum when a read first touches it (once per
    process), a version-1 shard whole when it is opened; "full" also hashes every shard whole when
    opened; "none" checks structure only. A mismatch raises `ChecksumError` naming the file and
    byte range; no data is returned. With "auto", a storage that offers `acquire_arriving` (a
    remote cache) may hand over a shard that is still arriving: reads wait for the verified blocks
    they touch (`Arrival`); the other modes wait for whole shards.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        storage: Storage | None = None,
        verify: str | None = None,
        max_open_shards: int = 64,
    ) -> None:
        self.verify = verify_mode(verify)
        if storage is None:
            if root is None:
                raise TypeError("FastloadDataset needs a root directory or a storage object")
            storage = LocalStorage(root)
        self.storage = storage
        self.root = str(getattr(storage, "root", root))
        self.max_open_shards = max(1, int(max_open_shards))
        where = f"{self.root}/{MANIFEST_NAME}"
        try:
            raw = storage.read_small(MANIFEST_NAME)
        except FormatError as exc:
            raise FormatError(
                f"{where}: no manifest (not a fastload dataset, or an incomplete conversion: "
                f"re-run `fastload convert --resume`)"
            ) from exc
        self.manifest = Manifest.loads(raw, where=where)
        self.schema: Schema = self.manifest.schema
        counts = np.array([s.num_samples for s in self.manifest.shards], dtype=np.int64)
        self._starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._starts[1:])
        self._meta = self.manifest.meta_arrays(
            storage.read_small(self.manifest.meta_file), where=f"{self.root}/{self.manifest.meta_file}"
        )
        for f in self.schema:
            if not f.is_fixed and self._meta.get(f"{f.name}.length", np.zeros(0)).shape != (len(self),):
                raise FormatError(f"{where}: meta has no per-sample lengths for field {f.name!r}")
            if f.kind == "image" and self._meta.get(f"{f.name}.hw", np.zeros(0)).shape != (len(self), 2):
                raise FormatError(f"{where}: meta has no image sizes for field {f.name!r}")
        if self.manifest.version < 2:
            warnings.warn(
                f"{self.root}: a version-1 fastload dataset has no block checksums: "
                + (
                    "its reads are NOT verified"
                    if self.verify == "none"
                    else "each shard is hashed whole when first opened (slow for random access)"
                )
                + f"; upgrade it with `fastload convert --upgrade {self.root} NEW_DIR`",
                UserWarning,
                stacklevel=2,
            )
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._fields = list(self.schema)
        self._variable = any(not f.is_fixed for f in self._fields)
        # fixed and variable fields: a shard-by-shard read returns the fixed ones first (`get_batch` reorders)
        self._mixed = self._variable and any(f.is_fixed for f in self._fields)
        self._starts_list = self._starts.tolist()
        self._resident: dict[str, np.ndarray] | None = None
        self._spliced: dict[str, SplicedColumn] | None = None
        self._direct: list[tuple[str, Any]] | None = None  # (field, take) when every field is resident/spliced
        self._ragged: dict[str, SplicedRagged] | None = None  # variable fields spliced over all shards
        self._takes: list[tuple[str, Any]] | None = None  # (field, take) for every field, variable ones too
        self._open_columns = self._new_open_columns()  # all fields fixed: a batch over open shards in one pass
        # the epoch's first batch (the first read after `bind_run` started an epoch) fetches the blocks it
        # waits for ahead of the shards' downloads; later ones follow the downloads (`_read`)
        self._fetch_ahead = True
        self._epoch: int | None = None
        self._new_locks()
        self._ledger = self._new_ledger()
        self._attach()
        # A dataset that fits in memory is read whole over an epoch: read it in 2 MiB units
        # (`spliced.advise_huge`), for fewer, larger reads when cold and fewer faults when warm.
        self._huge = sum(s.bytes for s in self.manifest.shards) <= HUGE_FRACTION * _physical_memory()

    def _new_locks(self) -> None:
        """This process's locks; a forked child gets new ones (a parent's thread may hold these)."""
        self._lock = threading.Lock()
        self._direct_lock = threading.Lock()
        self._first_lock = threading.Lock()  # `_fetch_ahead`, taken by one read (not `_lock`: held while a shard opens)
        reset_in_child(self, FastloadDataset._new_locks)

    def _new_open_columns(self) -> OpenColumns | None:
        """The columns of the open shards, read by index (`OpenColumns`), when every field is fixed."""
        if self._variable or not OpenColumns.available():
            return None
        return OpenColumns(self._fields, self._starts, self.manifest.block_log2 if self.manifest.version >= 2 else 0)

    def _new_ledger(self) -> BlockLedger | None:
        """This process's record of verified blocks (None when nothing is verified per block)."""
        if self.verify == "none" or self.manifest.version < 2:
            return None
        return BlockLedger(self.num_shards, self.manifest.block_log2, _weakly(self._verify_blocks))

    def _verify_blocks(self, k: int, ids: np.ndarray) -> None:
        self.shard(k).verify_blocks(ids)

    # -- pickling: workers re-open their own mappings ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"], state["_resident"], state["_spliced"], state["_direct"] = OrderedDict(), None, None, None
        state["_ragged"] = state["_takes"] = state["_open_columns"] = None
        del state["_lock"], state["_direct_lock"], state["_first_lock"], state["_ledger"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_locks()
        self._ledger = self._new_ledger()  # each process verifies what it reads itself
        self._open_columns = self._new_open_columns()
        self._attach()

    def _attach(self) -> None:
        """Let a storage that shares a cache budget with other readers (`attach`) have this reader
        close shards when its share shrinks (see `trim`)."""
        attach = getattr(self.storage, "attach", None)
        if attach is not None:
            attach(self.trim)

    def __repr__(self) -> str:
        return (
            f"FastloadDataset({self.root!r}, samples={len(self)}, shards={self.num_shards}, fields={self.schema.names})"
        )

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_shards(self) -> int:
        """Number of shard files in the manifest."""
        return len(self.manifest.shards)

    @property
    def shard_boundaries(self) -> np.ndarray:
        """Global index where each shard starts, plus the total (length num_shards + 1)."""
        return self._starts.copy()

    @property
    def attrs(self) -> dict[str, Any]:
        """The manifest's free-form `attrs` (e.g. an image folder's `classes`); the manifest's own dict,
        not a copy."""
        return self.manifest.attrs

    def lengths(self, field: str) -> np.ndarray:
        """Per-sample lengths of a variable field (items for varray, bytes otherwise), from the index."""
        f = self.schema[field]
        if f.is_fixed:
            raise ValueError(f"field {field!r} is fixed-size ({f.kind}); lengths exist for variable fields")
        return self._meta[f"{field}.length"]

    def image_sizes(self, field: str) -> np.ndarray:
        """(N, 2) uint32 (height, width) of an image field, from the index."""
        if self.schema[field].kind != "image":
            raise ValueError(f"field {field!r} is not an image field")
        return self._meta[f"{field}.hw"]

    # -- shards ---------------------------------------------------------------------------------
    def shard(self, k: int) -> ShardReader:
        """The mapped shard k (opened on first use; past `max_open_shards`, the longest-open one is closed)."""
        reader = self._open.get(k)
        if reader is not None:
            return reader
        with self._lock:
            reader = self._open.get(k)
            if reader is not None:
                return reader
            info = self.manifest.shards[k]
            where = f"{self.root}/{info.file} (shard {k})"
            cap = self._open_cap()  # asked once per open: a shared cache answers it under its cross-process lock
            self._close_beyond(cap)  # a share that shrank: pin no more than it holds, + 1
            # checked per block: a storage may hand over a shard that is still arriving
            arriving = getattr(self.storage, "acquire_arriving", None) if self.verify == "auto" else None
            try:
                if arriving is not None and self._ledger is not None:
                    path, arrival = arriving(info.file, size=info.bytes, xxh3=info.xxh3)
                else:
                    path, arrival = self.storage.acquire(info.file, size=info.bytes, xxh3=info.xxh3), None
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
                raise FormatError(f"{where}: cannot open the shard file ({exc.strerror or exc})") from exc
            try:
                reader = self._open_shard(k, path, where, arrival)
            except BaseException:
                self.storage.release(info.file)
                raise
            self._open[k] = reader
            if self._open_columns is not None:
                self._open_columns.add(k, reader)
            self._close_beyond(cap)
            return reader

    @property
    def verified_blocks(self) -> int:
        """How many blocks this process has checked against the manifest's checksums so far (each
        is checked once per process, on its first read; 0 with `verify="none"` or a version-1
        dataset): once every block under a column is, its reads skip the check."""
        return 0 if self._ledger is None else self._ledger.verified_blocks()

    @property
    def open_shards(self) -> int:
        """How many shards are mapped now (at most `max_open_shards`)."""
        return len(self._open)

    def _open_cap(self) -> int:
        """How many shards to keep open now: `max_open_shards`, or less while the storage's share of
        a cache shared with other readers is smaller (`storage.max_open_shards`, which may change)."""
        share = getattr(self.storage, "max_open_shards", None)
        return max(1, min(self.max_open_shards, share)) if isinstance(share, int) else self.max_open_shards

    def _close_beyond(self, cap: int) -> None:
        """Close the longest-open shards beyond `cap` (caller holds `_lock`), releasing them to the storage."""
        while len(self._open) > cap:
            old_k, old = self._open.popitem(last=False)
            if self._open_columns is not None:
                self._open_columns.remove(old_k)
            old.close()
            self.storage.release(self.manifest.shards[old_k].file)

    def trim(self) -> None:
        """Close open shards beyond the storage's current share now (a reader sharing a cache with
        others calls this when they need room); skipped while another thread opens a shard."""
        if self._lock.acquire(blocking=False):
            try:
                self._close_beyond(self._open_cap())
            finally:
                self._lock.release()

    def _open_shard(self, k: int, path: str, where: str, arrival: Arrival | None = None) -> ShardReader:
        try:
            reader = self._map_shard(k, path, where, arrival)
        except ChecksumError as exc:
            raise self._local_damage(k, exc, opened=False) from exc
        reader.on_corrupt = partial(_weakly(self._local_damage, _the_error), k)
        if arrival is not None:
            reader.on_lost = partial(_weakly(self._lost_arrival, _the_error), k)
        return reader

    def bind_run(self, run: Any) -> None:
        """The Loader's run context (`fastload.run`): a new epoch's first batch may again fetch the blocks it
        waits for ahead of the shards' downloads, in GETs of its own (it comes sooner). Batches after it
        (and those read beside it, by other workers) wait for the downloads' GETs: by then those stream the
        shards, and out-of-order GETs cost a request each (see `ShardReader.verify_blocks`). While some
        shard is not at hand, a storage that can (`hold_for_first_batch`) holds its other GETs back until
        that first batch is served."""
        if run.epoch != self._epoch:
            with self._first_lock:
                self._epoch, self._fetch_ahead = run.epoch, True
            hold = getattr(self.storage, "hold_for_first_batch", None)
            if hold is not None and not self._all_shards_at_hand():
                hold()

    def _begin_read(self) -> bool:
        """Start one read of samples: whether it is the epoch's first (it fetches ahead of the
        downloads): True for one read after each `bind_run` that started an epoch (and for a new
        dataset's first read). A read that gets True calls `_end_first_read` when it ends (served
        or failed). Read without the lock first: a stale False only means another read took the
        first one."""
        if not self._fetch_ahead:
            return False
        with self._first_lock:
            first, self._fetch_ahead = self._fetch_ahead, False
        return first

    def _end_first_read(self) -> None:
        """The epoch's first read ended: GETs a storage held back for it start (`first_batch_served`)."""
        served = getattr(self.storage, "first_batch_served", None)
        if served is not None:
            served()

    def _lost_arrival(self, k: int, exc: BaseException) -> BaseException:
        """Shard k's download failed while it was read as it arrived: its reader goes (the next read
        acquires it again, which fetches it anew); `exc`, the download's error, is raised."""
        self._forget_shard(k, exc)
        return exc

    def _local_damage(self, k: int, exc: ChecksumError, *, opened: bool = True) -> ChecksumError:
        """The error to raise for a checksum mismatch in shard k: a storage that keeps local copies
        (`damaged(name, size=, xxh3=)`, a shard cache) checks whether its copy still matches the
        manifest; when not, the copy was damaged where it is kept: the storage drops it, the open
        reader (and any column spliced over it) goes, and the message says the next read fetches
        it again. Otherwise `exc` itself."""
        damaged = getattr(self.storage, "damaged", None)
        info = self.manifest.shards[k]
        local = damaged(info.file, size=info.bytes, xxh3=info.xxh3) if damaged is not None else None
        if local is None:
            return exc
        err = ChecksumError(
            f"{self.root}/{info.file} (shard {k}): the local cached copy {local} is damaged (it no longer "
            f"matches the manifest's checksum; the remote object is not at fault): it was removed from the "
            f"cache and the next read fetches it again"
        )
        if opened:
            self._forget_shard(k, err)
        return err

    def _forget_shard(self, k: int, err: BaseException) -> None:
        """Close shard k's reader and drop the columns spliced over its old copy (a take still holding
        one raises `err` from now on, rather than read the damaged bytes unchecked)."""
        columns: list[SplicedColumn | SplicedRagged] = [*(self._spliced or {}).values(), *(self._ragged or {}).values()]
        for column in columns:
            column.check = partial(_raise, err)
        self._spliced = self._direct = self._ragged = self._takes = None
        with self._lock:
            reader = self._open.pop(k, None)
            if reader is not None:
                if self._open_columns is not None:
                    self._open_columns.remove(k)
                reader.close()
                self.storage.release(self.manifest.shards[k].file)

    def _map_shard(self, k: int, path: str, where: str, arrival: Arrival | None = None) -> ShardReader:
        info, m = self.manifest.shards[k], self.manifest
        start, stop = self._starts_list[k], self._starts_list[k + 1]
        lengths = {f.name: self._meta[f"{f.name}.length"][start:stop] for f in self.schema if not f.is_fixed}
        reader = ShardReader(
            path,
            self.schema,
            num_samples=info.num_samples,
            nbytes=info.bytes,
            where=where,
            identity=ShardIdentity(m.dataset_id, k, start) if m.version >= 2 else None,
            blocks_xxh3=info.blocks_xxh3 if m.version >= 2 else None,
            block_log2=m.block_log2 if m.version >= 2 else None,
            lengths=lengths,
            bits=None if self._ledger is None else partial(self._ledger.shard_bits, k),
            huge=self._huge,
            version=m.version,
            arrival=arrival,
        )
        # a version-1 shard (the manifest's version, which the reader checked the shard repeats) has
        # no block checksums: by default it is hashed whole here, before any of its bytes is returned
        whole = self.verify == "full" or (self.verify == "auto" and m.version < 2)
        if whole and reader.content_xxh3() != info.xxh3:
            reader.close()
            raise ChecksumError(f"{where}: checksum mismatch (corrupt shard; run `fastload verify`)")
        return reader

    def close(self) -> None:
        """Drop the spliced views and close every open shard, releasing it to the storage (its mapping
        goes once no array refers to it; a cache may then evict it); a later read reopens what it needs."""
        self._spliced = self._direct = self._ragged = self._takes = None  # unmapped once no reader holds it
        with self._lock:
            while self._open:
                k, reader = self._open.popitem()
                if self._open_columns is not None:
                    self._open_columns.remove(k)
                reader.close()
                self.storage.release(self.manifest.shards[k].file)

    # -- reads ----------------------------------------------------------------------------------
    def _plan(self, indices: Any) -> tuple[np.ndarray, np.ndarray | None, list[tuple[int, int, int, np.ndarray]]]:
        """(indices, order, groups) for a batch: `groups` lists (shard, start, stop, local rows) over the
        indices in ascending order; `order` is None when the caller's indices already ascend, else the
        permutation that sorted them. Ascending rows within each mapping gather fastest (see
        `get_batch` for how an unsorted batch gets back to the caller's order).
        """
        idx = self._checked_indices(indices)
        m = len(idx)
        if m == 0:
            return idx, None, []
        order = None
        sidx = idx
        if m > 1 and (idx[1:] < idx[:-1]).any():
            order = idx.argsort(kind="stable")
            sidx = idx[order]
        lo, hi = int(sidx[0]), int(sidx[-1])
        starts = self._starts
        k0 = bisect.bisect_right(self._starts_list, lo) - 1
        k1 = bisect.bisect_right(self._starts_list, hi) - 1
        if k0 == k1:
            return idx, order, [(k0, 0, m, sidx - starts[k0] if k0 else sidx)]
        if k1 - k0 <= 2 * m:  # shard starts inside the batch's range, found in the sorted indices
            edges = [0, *sidx.searchsorted(starts[k0 + 1 : k1 + 1]).tolist(), m]
            ks = range(k0, k1 + 1)
        else:  # far more shards than rows: find each row's shard instead
            shard_ids = starts.searchsorted(sidx, side="right") - 1
            cuts = ((shard_ids[1:] != shard_ids[:-1]).nonzero()[0] + 1).tolist()
            edges = [0, *cuts, m]
            ks = shard_ids[edges[:-1]].tolist()
        groups = []
        for k, a, b in zip(ks, edges[:-1], edges[1:]):
            if b > a:
                groups.append((k, a, b, sidx[a:b] - self._starts_list[k]))
        return idx, order, groups

    def _resident_columns(self) -> dict[str, np.ndarray]:
        """Small fixed fields (labels, ids), gathered once into memory when all shards are at hand.

        A batch then reads them with one `take` instead of one per shard. Built on first use,
        within `RESIDENT_LIMIT` bytes in total.
        """
        if self._resident is not None:
            return self._resident
        if not self._all_shards_at_hand():
            return {}
        with self._direct_lock:
            if self._resident is None:
                resident, budget = {}, RESIDENT_LIMIT
                for f in self.schema:
                    size = len(self) * f.item_bytes
                    if f.is_fixed and f.item_bytes <= RESIDENT_ITEM_BYTES and size <= budget:
                        parts = [self._verified_column(k, f.name) for k in range(self.num_shards)]
                        resident[f.name] = np.concatenate(parts) if parts else np.zeros((0, *f.shape), f.dtype)
                        budget -= size
                self._resident = resident
        return self._resident

    def _verified_column(self, k: int, name: str) -> np.ndarray:
        """Shard k's whole column of fixed field `name`, its blocks verified."""
        reader = self.shard(k)
        column = reader.fixed[name]
        reader.ensure_column(name)
        return column

    def spliced_columns(self) -> Mapping[str, SplicedColumn]:
        """The fixed fields read as one array over all shards (`SplicedColumn`, see spliced.py), by
        name, read-only; empty until every shard is at hand (a remote dataset: after its first epoch).
        A column handed out here keeps this dataset alive (`owner`): its blocks are verified through it."""
        columns = self._spliced_columns()
        for column in columns.values():
            column.owner = self
        return MappingProxyType(columns)

    def _spliced_columns(self) -> dict[str, SplicedColumn]:
        """The other fixed fields, once all shards are at hand, each mapped as one array over all shards
        (see spliced.py): a shuffled batch is then one `take` per field, in the caller's order."""
        spliced = self._spliced
        if spliced is not None:
            return spliced
        resident = self._resident_columns()
        if not self._all_shards_at_hand():
            return {}
        with self._direct_lock:
            if self._spliced is None:
                spliced, ragged = {}, {}
                if splice_available() and len(self):
                    with OpenFiles() as files:  # each shard file opened once for all its columns
                        for f in self.schema:
                            if f.is_fixed and f.name not in resident:
                                column = self._splice(f, files)
                                if column is not None:
                                    spliced[f.name] = column
                        ragged = self._splice_ragged(files)
                takes: dict[str, Callable[[np.ndarray], Any]] = {
                    name: partial(col.take, axis=0) for name, col in resident.items()
                }
                takes.update({name: col.take for name, col in spliced.items()})
                takes.update({name: col.take for name, col in ragged.items()})
                self._ragged = ragged
                self._spliced = spliced
                if all(f.name in takes for f in self._fields):
                    self._takes = [(f.name, takes[f.name]) for f in self._fields]
                    if not ragged:
                        self._direct = self._takes
            return self._spliced

    def _all_shards_at_hand(self) -> bool:
        """Local shards always are; cached remote ones once every shard is open (so pinned in the
        cache: a budget that holds the dataset, from the end of the first epoch on) and none is still
        arriving (its file moves into the cache when it completes)."""
        if isinstance(self.storage, LocalStorage):
            return True
        # newest first: the shards still arriving are the last opened, so one is usually found at once
        return len(self._open) == self.num_shards and not any(r.arriving for r in reversed(list(self._open.values())))

    def _splice(self, f: Any, files: OpenFiles) -> SplicedColumn | None:
        parts = []
        for k, info in enumerate(self.manifest.shards):
            reader = self.shard(k)
            parts.append(ColumnPart(reader.path, reader.fixed_offset[f.name], info.num_samples))
        try:
            column = splice_column(parts, f.dtype, f.shape, huge=self._huge, files=files)
        except OSError as exc:  # e.g. the kernel's limit on mappings: gather shard by shard instead
            warnings.warn(f"{self.root}: field {f.name!r} read shard by shard ({exc})", RuntimeWarning, stacklevel=3)
            return None
        if column is not None and self._ledger is not None:
            vstarts = column.virtual_starts().tolist()
            guard = ColumnGuard(
                self._ledger,
                [(k, p.offset, v, p.num_rows) for k, (p, v) in enumerate(zip(parts, vstarts))],
                f.item_bytes,
            )
            if not guard.done:
                column.check = partial(_guarded, weakref.ref(column), guard)
        return column

    def _splice_ragged(self, files: OpenFiles) -> dict[str, SplicedRagged]:
        """Each variable field whose blobs splice into one array, as a `SplicedRagged` (verified
        through the ledger like the fixed columns)."""
        out = {}
        readers = [self.shard(k) for k in range(self.num_shards)]  # their views outlive a close
        for f in self.schema:
            if f.is_fixed or f.kind == "vndarray":  # vndarray batches carry shapes: read by shard
                continue
            parts = [ColumnPart(r.path, r.blob_offset[f.name], len(r.ragged[f.name][1])) for r in readers]
            try:
                items = splice_column(parts, f.dtype, (), table=False, huge=self._huge, files=files)
            except OSError as exc:
                warnings.warn(f"{self.root}: field {f.name!r} read by shard ({exc})", RuntimeWarning, stacklevel=4)
                items = None
            if items is None:
                continue
            column = SplicedRagged(
                name=f.name, kind=f.kind, items=items, lengths=self._meta[f"{f.name}.length"],
                shard_starts=self._starts,
                where=_weakly(self.where, partial(_where_without, self.root)),
            )
            if self._ledger is not None:
                vstarts = items.virtual_starts().tolist()
                guard = ColumnGuard(
                    self._ledger, [(k, p.offset, v, p.num_rows) for k, (p, v) in enumerate(zip(parts, vstarts))],
                    f.dtype.itemsize,
                )
                if not guard.done:
                    column.check = partial(_guarded, weakref.ref(column), guard)
            out[f.name] = column
        return out

    def _checked_indices(self, indices: Any) -> np.ndarray:
        """`indices` as int64, bounds-checked, negative ones counted from the end."""
        return self._bounded(indices)[0]

    def _bounded(self, indices: Any) -> tuple[np.ndarray, int, int]:
        """`_checked_indices(indices)` and its smallest and largest index (0, -1 when empty)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(idx):
            return idx, 0, -1
        n = len(self)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -n or hi >= n:
            bad = lo if lo < -n else hi
            raise IndexError(f"sample index {bad} out of range for a dataset of {n} samples ({self.root})")
        if lo < 0:
            idx = np.where(idx < 0, idx + n, idx)
            lo, hi = int(idx.min()), int(idx.max())
        return idx, lo, hi

    def direct_takes(
        self, gather: Callable[[np.ndarray], Callable[[np.ndarray], Any] | None] | None = None
    ) -> list[tuple[str, Callable[[np.ndarray], np.ndarray]]] | None:
        """`(field, take)` for every field when each is one `take` over all shards (a local dataset
        whose fields are all fixed-size), else None; what `get_batch` runs in that case, for callers
        that convert the columns themselves (the Loader's fast path). `take` wants an int64 index
        array and raises IndexError for an index out of range; `get_batch` names the dataset in
        that error.

        With `gather`, each spliced (large) field is read by `gather(rows)(row_numbers)` instead of
        `rows.take(row_numbers, axis=0)`, and its take returns what that returns: `gather(rows)` is
        called here, once per field, and gets the field's rows array (it may return None: that
        field keeps its own take); `row_numbers` are int64 and in bounds (another gather engine,
        such as a multi-threaded one, without this package depending on it). The other fields'
        takes are the same objects as without `gather`.
        """
        if self._spliced is None:
            self._spliced_columns()
        direct, spliced = self._direct, self._spliced
        if gather is None or direct is None or spliced is None:
            return direct
        takes = []
        for name, take in direct:
            column = spliced.get(name)
            engine = gather(column.rows) if column is not None else None
            if engine is not None and column is not None:
                take = partial(_gather_rows, engine, column.row_numbers)
            takes.append((name, take))
        return takes

    def direct_plan(
        self, indices: Any, *, max_bytes: int | None = None
    ) -> list[tuple[str, np.ndarray, np.ndarray | None]] | None:
        """The small reads of `direct_takes()` done ahead for many samples at once (e.g. a whole
        epoch's order), one vectorized `take` per field; None when `direct_takes()` is None or the
        result would take more than `max_bytes`.

        Per field `(name, data, rows)`: with `rows` None, `data` holds the field's values at
        `indices` (a batch of them is a slice); otherwise `data` holds the row numbers of
        `indices` in `rows` (in bounds; a batch is `rows.take(data[a:b], axis=0)`). Raises
        IndexError naming the dataset for an index out of range.
        """
        if self._spliced is None:
            self._spliced_columns()
        direct, spliced, resident = self._direct, self._spliced, self._resident
        if direct is None or spliced is None or resident is None:
            return None
        if any(column.check is not None for column in spliced.values()):
            return None  # blocks still to verify: batches are read (and verified) by the takes
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        per_sample = sum(8 if name in spliced else resident[name][:1].nbytes for name, _ in direct)
        if max_bytes is not None and len(idx) * per_sample > max_bytes:
            return None
        try:
            return [
                (name, spliced[name].row_numbers(idx), spliced[name].rows)
                if name in spliced
                else (name, resident[name].take(idx, axis=0), None)
                for name, _ in direct
            ]
        except IndexError:
            self._checked_indices(idx)  # raises the error that names the dataset
            raise

    def direct_read(self, indices: Any) -> dict[str, np.ndarray] | None:
        """Every field at `indices`, as `get_batch` reads them while some shard is not at hand (a cold
        epoch), for a dataset whose fields are all fixed (see `_read_cold`). None, having read nothing,
        once every shard is at hand or with a variable field: `get_batch` reads the batch then."""
        if self._open_columns is None or self._spliced is not None or self._all_shards_at_hand():
            return None
        return self._read_cold(indices, self._fields)

    def _read_cold(self, indices: Any, wanted: list[Any]) -> dict[str, Any]:
        """The fields `wanted` at `indices` while some shard is not at hand: every field in one C call
        (`OpenColumns`) for a batch whose rows all lie in open shards over verified blocks (not an epoch's
        first read: it fetches ahead), else shard by shard (which opens, waits, verifies and raises)."""
        opened = self._open_columns if wanted is self._fields else None
        read = None if opened is None or self._fetch_ahead else opened.read(indices)
        return read if read is not None else self._gather_by_shard(indices, wanted)

    def get_batch(self, indices: Any, *, fields: list[str] | None = None) -> dict[str, Any]:
        """Columns of the samples at `indices`: (B, *shape) arrays for fixed fields, `Ragged` for variable
        ones, `ShapedBatch` for vndarray fields.

        Fixed fields of a local dataset are one `take` each over a resident copy or a spliced mapping
        of all shards. Before every shard is at hand (a remote dataset's cold epoch), a batch of fixed
        fields over open shards whose blocks under it are verified is one C call per field
        (`OpenColumns`). Other fields are gathered shard by shard with one `np.take` each; when
        `indices` are not grouped by shard (a shuffled batch), a fixed field's rows are copied
        straight into their places (`take_rows_into`) and a variable field's items are put back in
        the caller's order in one more pass.
        """
        direct = self._takes if fields is None else None
        if direct is not None:  # every field is one take over all shards: the common local case
            idx = np.asarray(indices, dtype=np.int64).reshape(-1)
            try:
                return {name: take(idx) for name, take in direct}
            except IndexError:
                self._checked_indices(idx)  # raises the error that names the dataset
                raise
        wanted = self._fields if fields is None else [self.schema[name] for name in fields]
        if self._spliced is None and not self._all_shards_at_hand():  # shards still to open or arriving
            read = self._read_cold(indices, wanted)
            return read if len(read) == 1 or not self._mixed else {f.name: read[f.name] for f in wanted}
        resident, spliced = self._resident_columns(), self._spliced_columns()
        ragged = self._ragged or {}
        rest = [f for f in wanted if f.name not in resident and f.name not in spliced and f.name not in ragged]
        out: dict[str, Any] = {}
        if len(rest) < len(wanted):
            idx = np.asarray(indices, dtype=np.int64).reshape(-1)
            try:
                for f in wanted:
                    if f.name in resident:
                        out[f.name] = resident[f.name].take(idx, axis=0)
                    elif f.name in spliced:
                        out[f.name] = spliced[f.name].take(idx)
                    elif f.name in ragged:
                        out[f.name] = ragged[f.name].take(idx)
            except IndexError:
                self._checked_indices(idx)  # raises the error that names the dataset
                raise
        if rest:
            out.update(self._gather_by_shard(indices, rest))
        return out if len(out) == 1 else {f.name: out[f.name] for f in wanted}

    def _gather_by_shard(self, indices: Any, wanted: list[Any]) -> dict[str, Any]:
        """Gather `wanted` fields shard by shard, one shard at a time: each shard's reader is let go
        before the next is opened, so a batch over more shards than `max_open_shards` never keeps
        more of them mapped than that (a shard cache counts every mapped shard against its budget,
        until its last mapping goes). Variable fields are copied out of each cached shard as it is
        visited; a local dataset's files stay, so they are joined straight from its mappings.
        Returns the fixed fields (in `wanted`'s order), then the variable ones."""
        fixed = wanted if wanted is self._fields and not self._variable else [f for f in wanted if f.is_fixed]
        variable = [] if fixed is wanted or len(fixed) == len(wanted) else [f for f in wanted if not f.is_fixed]
        if not variable:
            read = self._gather_open(indices, fixed)
            if read is not None:
                return read
        idx, order, groups = self._plan(indices)
        m = len(idx)
        cols = {f.name: batch_buffers.empty((m, *f.shape), f.dtype) for f in fixed}
        runs = {f.name: _Runs(m, len(f.shape) if f.kind == "vndarray" else 0) for f in variable}
        # variable fields are put back in the caller's order afterwards (fixed ones went straight to their places)
        inverse = None if order is None or not runs else order.argsort()
        copy = not isinstance(self.storage, LocalStorage)
        first = self._begin_read()
        try:
            if first and len(groups) > 1:
                # an epoch's first batch over several arriving shards: ask for every shard's blocks (as
                # many shards as may stay open) before waiting for any, so their GETs run at once
                for k, _, _, rows in groups[: self._open_cap()]:
                    (self._open.get(k) or self.shard(k)).request_fields(wanted, rows, ahead=True)
            opened = self._open
            for g, (k, a, b, rows) in enumerate(groups):
                _gather_group(opened.get(k) or self.shard(k), wanted, fixed, variable, g, a, b, rows, cols, runs,
                              copy=copy, places=None if order is None else order[a:b], ahead=first)
        finally:
            if first:
                self._end_first_read()
        out: dict[str, Any] = cols
        for f in variable:
            run = runs[f.name]
            src_of, starts, lengths = run.source_of, run.starts, run.lengths
            if inverse is not None:
                src_of, starts, lengths = src_of[inverse], starts[inverse], lengths[inverse]
            values, offsets = gather_ragged(run.sources, src_of, starts, lengths, f.dtype)
            if run.shapes is not None:  # vndarray
                out[f.name] = ShapedBatch(values, offsets, run.shapes if inverse is None else run.shapes[inverse])
                continue
            origin = partial(self._batch_where, f.name, idx) if f.kind == "string" else None
            out[f.name] = Ragged(values, offsets, f.kind, origin=origin)
        return out

    def _gather_open(self, indices: Any, fixed: list[Any]) -> dict[str, np.ndarray] | None:
        """Fixed fields `fixed` of a batch whose shards are all open: their blocks under the batch's rows
        verified shard by shard, then each field copied in one pass in the caller's order
        (`_ranges.take_rows`: no sort, no copy per shard). None (read shard by shard instead) when a
        shard of the batch is not open yet (that read opens one at a time), the shards lie more than
        `SPAN_SHARDS` apart, or the C extension is missing."""
        if _c_take_rows is None:
            return None
        idx, lo, hi = self._bounded(indices)
        starts_list, opened = self._starts_list, self._open
        k0 = bisect.bisect_right(starts_list, lo) - 1
        k1 = bisect.bisect_right(starts_list, hi) - 1
        if not len(idx) or k1 - k0 >= SPAN_SHARDS:
            return None
        readers = [opened.get(k) for k in range(k0, k1 + 1)]
        if k0 == k1:
            if readers[0] is None:
                return None
            which, rows = None, idx - starts_list[k0]
        else:
            starts = self._starts
            which = starts[k0 + 1 : k1 + 1].searchsorted(idx, side="right")
            rows = idx - starts[k0 : k1 + 1].take(which)
            if any(r is None for r in readers):
                counts = np.bincount(which, minlength=len(readers)).tolist()
                if any(r is None and n for r, n in zip(readers, counts)):
                    return None
        parts = [(r, rows if which is None else rows[which == j])
                 for j, r in enumerate(readers) if r is not None and not r.all_verified]
        first = self._begin_read()  # also for a batch with nothing to verify: its end frees held GETs
        try:
            if first and len(parts) > 1:  # their GETs at once (see `_gather_by_shard`)
                for reader, part in parts:
                    reader.request_fields(fixed, part, ahead=True)
            for reader, part in parts:
                if len(part):
                    reader.ensure_fields(fixed, part, ahead=first)
        finally:
            if first:
                self._end_first_read()
        out = {}
        for f in fixed:
            col = batch_buffers.empty((len(idx), *f.shape), f.dtype)
            if col.nbytes:
                _c_take_rows([None if r is None else r.fixed[f.name] for r in readers], which, rows, f.item_bytes, col)
            out[f.name] = col
        return out

    def where(self, index: int, name: str) -> str:
        """Where field `name` of sample `index` is stored (file, shard, sample, field), for messages."""
        k = bisect.bisect_right(self._starts_list, int(index)) - 1
        return f"{self.root}/{self.manifest.shards[k].file} (shard {k}): sample {int(index)}, field {name!r}"

    def _batch_where(self, name: str, indices: np.ndarray, i: int) -> str:
        return self.where(int(indices[i]), name)

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        batch = self.get_batch(indices)
        return [
            sample_from_columns(self.schema, batch, i, where=f"{self.root}: sample {indices[i]}")
            for i in range(len(indices))
        ]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"dataset indices must be integers, got {type(index).__name__}")
        _, _, groups = self._plan([index])
        k, _, _, rows = groups[0]
        reader, i = self.shard(k), int(rows[0])
        first = self._begin_read()
        try:
            reader.ensure_fields(list(self.schema), rows, ahead=first)
        finally:
            if first:
                self._end_first_read()
        out: dict[str, Any] = {}
        for f in self.schema:
            if f.kind == "scalar":
                out[f.name] = reader.fixed[f.name][i].item()
            elif f.kind == "ndarray":
                out[f.name] = reader.fixed[f.name][i].copy()
            else:
                offs, values = reader.ragged[f.name]
                part = values[offs[i] : offs[i + 1]]
                if f.kind in ("bytes", "image"):
                    out[f.name] = part.tobytes()
                elif f.kind == "string":
                    out[f.name] = _utf8(part, self.where(index, f.name))
                elif f.kind == "vndarray":
                    out[f.name] = part.reshape(tuple(int(d) for d in reader.shapes[f.name][i])).copy()
                else:
                    out[f.name] = part.copy()
        return out

    def read_block(self, start: int, stop: int) -> Block:
        """Samples [start, stop) as a writer `Block` (used by conversion and verification)."""
        batch = self.get_batch(np.arange(start, stop))
        hw = {f.name: self.image_sizes(f.name)[start:stop] for f in self.schema if f.kind == "image"}
        shaped = {name: col for name, col in batch.items() if isinstance(col, ShapedBatch)}
        for name, col in shaped.items():
            batch[name] = Ragged(col.values, col.offsets, "varray")
        return Block(stop - start, batch, hw, {name: col.shapes for name, col in shaped.items()})
