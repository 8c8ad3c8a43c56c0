"""`ShardWindowSampler`: a random order that reads a few shards at a time.

Each epoch the shards are permuted, cut into windows of `window` consecutive shards, and the
samples of each window are shuffled together. A batch therefore touches at most `window` shards
(2 x `window` where it straddles two windows), so a shuffled epoch over remote data fetches every
shard once instead of every shard for every batch. Ranks get equal contiguous slices of the epoch
order (padded by wrapping like `DistributedSampler`, or trimmed with `drop_last`), so each rank
reads its own windows. The order depends only on (seed, epoch): resume is exact.

Rank and world size (`fastload.order.sampling.RunRank`): arguments given win; else, held by a
`fastload.Loader`, the Loader's run (`bind_run`, which also sets the epoch at every epoch start);
else, used alone, resolved from `torch.distributed` or RANK/WORLD_SIZE at the first `__iter__`.

Both shuffles are `fastload.order.index_shuffle.IndexShuffle`s (the shards', and one per window over
its samples), so a position of the epoch maps to its sample in O(1): a rank maps its own slice
chunk by chunk, holding per-shard and per-window arrays only, never one entry per sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from fastload.order.index_shuffle import IndexShuffle
from fastload.order.position import EpochPosition
from fastload.order.sampling import RankedSampler, RunRank

__all__ = ["ShardWindowSampler", "randomness_report", "shards_in_order"]

_CHUNK = 1 << 16  # positions mapped at a time


def shards_in_order(indices: np.ndarray | Sequence[int], shard_starts: np.ndarray | Sequence[int]) -> list[int]:
    """Shard ids in the order `indices` first touch them (`shard_starts`: N_shards + 1 boundaries)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return []
    shard = np.searchsorted(np.asarray(shard_starts, dtype=np.int64), idx, side="right") - 1
    uniq, first = np.unique(shard, return_index=True)
    return [int(s) for s in uniq[np.argsort(first)]]


class ShardWindowSampler(RankedSampler):
    """Sampler (iterable of global sample indices) over a sharded dataset.

    `shard_sizes` are the sample counts per shard, in dataset order. `window` is the number of
    shards whose samples are shuffled together. `rank` / `world_size`: None takes the Loader's
    (or, alone, the run's: see the module docstring). `get_state()` (torch's name: `state_dict()`)
    records the epoch and how many indices this rank's iterator has yielded; a Loader that reads
    ahead should store the number it actually delivered as `consumed` instead.
    """

    def __init__(
        self,
        shard_sizes: Sequence[int] | np.ndarray,
        *,
        window: int = 4,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64).reshape(-1)
        if sizes.size == 0 or (sizes < 0).any():
            raise ValueError("shard_sizes must be a non-empty list of non-negative sample counts")
        if window < 1:
            raise ValueError(f"window must be >= 1 shard, got {window}")
        self._ranks = RunRank(rank, world_size, owner="ShardWindowSampler")
        self.shard_sizes = sizes
        self.starts = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        self.num_samples = int(self.starts[-1])
        self.window, self.shuffle, self.seed = int(window), bool(shuffle), int(seed)
        self.drop_last = bool(drop_last)
        if world_size is not None:
            self._split(world_size)  # a world given that the samples cannot be split over fails here
        self.epoch = 0
        self._consumed = 0
        self._resume = 0
        self._prefetch: tuple[Any, list[str]] | None = None
        self._windows: tuple[int, int, IndexShuffle] | None = None  # (epoch, window, its shuffle) last used

    @classmethod
    def from_dataset(cls, dataset: Any, *, prefetch: bool = True, **kwargs: Any) -> ShardWindowSampler:
        """Build from a dataset with `shard_boundaries` (e.g. `FastloadDataset`).

        With `prefetch`, each `__iter__` hands this rank's shard order to `dataset.storage.prefetch`
        (remote datasets fetch ahead into the node's cache; local storage ignores it).
        """
        sampler = cls(np.diff(np.asarray(dataset.shard_boundaries, dtype=np.int64)), **kwargs)
        storage = getattr(dataset, "storage", None)
        manifest = getattr(dataset, "manifest", None)
        if prefetch and storage is not None and manifest is not None and callable(getattr(storage, "prefetch", None)):
            sampler.prefetch_to(storage, [s.file for s in manifest.shards])
        return sampler

    def prefetch_to(self, storage: Any, shard_names: Sequence[str]) -> None:
        """Call `storage.prefetch(names in this rank's read order)` at the start of every `__iter__`."""
        if len(shard_names) != self.shard_sizes.size:
            raise ValueError(f"{len(shard_names)} shard names for {self.shard_sizes.size} shards")
        self._prefetch = (storage, list(shard_names))

    def __repr__(self) -> str:
        return (f"ShardWindowSampler(samples={self.num_samples}, shards={self.shard_sizes.size}, window={self.window}, "
                f"rank={self.rank}/{self.world_size}, epoch={self.epoch})")

    @property
    def per_rank(self) -> int:
        """Indices each rank yields per epoch."""
        return self._split(self.world_size)

    def _split(self, world_size: int) -> int:
        """Indices per rank over `world_size` ranks; ValueError when a rank would get none."""
        per_rank = self.num_samples // world_size if self.drop_last else -(-self.num_samples // world_size)
        if self.num_samples == 0 or per_rank == 0:
            raise ValueError(f"{self.num_samples} samples cannot be split over {world_size} ranks")
        return per_rank

    def __len__(self) -> int:
        return self.per_rank

    def component_stats(self) -> dict[str, Any]:
        """Epoch, rank, world size and indices yielded this epoch (`fastload.run.StatsReporter`)."""
        return {"epoch": self.epoch, "rank": self.rank, "world_size": self.world_size, "consumed": self._consumed}

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next `__iter__` yields (a resume point of another epoch is dropped)."""
        if int(epoch) != self.epoch:
            self._resume = 0
        self.epoch = int(epoch)

    # -- orders ---------------------------------------------------------------------------------
    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard ids in epoch order, each window's first position + the total): per-shard arrays."""
        n_shards = self.shard_sizes.size
        perm = IndexShuffle(n_shards, seed=self.seed, epoch=epoch, stream=1)(np.arange(n_shards))
        sizes = self.shard_sizes[perm]
        ends = np.cumsum(sizes)[np.minimum(np.arange(self.window, n_shards + self.window, self.window), n_shards) - 1]
        return perm, np.concatenate([[0], ends]).astype(np.int64)

    def _map(self, epoch: int, lo: int, hi: int, layout: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The samples at positions `[lo, hi)` of the (unpadded) epoch order."""
        if not self.shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        perm, bounds = layout
        out = np.empty(hi - lo, dtype=np.int64)
        first = lo
        j = int(np.searchsorted(bounds, lo, side="right")) - 1
        while lo < hi:
            w_lo, w_hi = int(bounds[j]), int(bounds[j + 1])
            end = min(hi, w_hi)
            shards = perm[j * self.window : (j + 1) * self.window]
            local = self._window_shuffle(epoch, j, w_hi - w_lo)(np.arange(lo - w_lo, end - w_lo))
            within = np.zeros(shards.size + 1, dtype=np.int64)  # where each shard starts in the window
            np.cumsum(self.shard_sizes[shards], out=within[1:])
            k = np.searchsorted(within, local, side="right") - 1
            out[lo - first : end - first] = self.starts[shards[k]] + (local - within[k])
            lo, j = end, j + 1
        return out

    def _window_shuffle(self, epoch: int, j: int, size: int) -> IndexShuffle:
        cached = self._windows
        if cached is None or cached[:2] != (epoch, j):
            cached = self._windows = (epoch, j, IndexShuffle(size, seed=self.seed, epoch=epoch, stream=2 + j))
        return cached[2]

    def _ranges(self, start: int) -> list[tuple[int, int]]:
        """This rank's positions from its `start`-th on, as ranges of the unpadded order (past the
        end it wraps around to the beginning, like DistributedSampler's padding)."""
        rank, per_rank = self.rank, self.per_rank
        lo, hi = rank * per_rank + start, (rank + 1) * per_rank
        out = []
        while lo < hi:
            a = lo % self.num_samples
            b = min(a + (hi - lo), self.num_samples)
            out.append((a, b))
            lo += b - a
        return out

    def _chunks(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """This rank's indices from its `start`-th on, in chunks of at most `_CHUNK`."""
        layout = self._layout(epoch) if self.shuffle else (np.zeros(0, np.int64), np.zeros(1, np.int64))
        for a, b in self._ranges(start):
            for lo in range(a, b, _CHUNK):
                yield self._map(epoch, lo, min(b, lo + _CHUNK), layout)

    def global_order(self, epoch: int | None = None) -> np.ndarray:
        """The whole epoch's order over all ranks (before padding): one entry per sample, for checks."""
        epoch = self.epoch if epoch is None else int(epoch)
        layout = self._layout(epoch) if self.shuffle else None
        return self._map(epoch, 0, self.num_samples, layout)  # type: ignore[arg-type]

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices for an epoch, in order (length `len(self)`)."""
        epoch = self.epoch if epoch is None else int(epoch)
        parts = list(self._chunks(epoch, 0))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def shard_order(self, epoch: int | None = None, start: int = 0) -> list[int]:
        """Shard ids this rank reads in an epoch from its `start`-th index on, in first-use order
        (feed `storage.prefetch`). Reads each window's positions only until all its shards are seen."""
        epoch = self.epoch if epoch is None else int(epoch)
        order: list[int] = []
        seen: set[int] = set()
        if not self.shuffle:
            for a, b in self._ranges(start):
                first, last = np.searchsorted(self.starts, [a, b - 1], side="right") - 1
                order += [s for s in range(int(first), int(last) + 1) if self.shard_sizes[s] and s not in seen]
                seen.update(order)
            return order
        layout = self._layout(epoch)
        perm, bounds = layout
        for a, b in self._ranges(start):
            j = int(np.searchsorted(bounds, a, side="right")) - 1
            while a < b:
                end = min(b, int(bounds[j + 1]))
                shards = perm[j * self.window : (j + 1) * self.window]
                left = {int(s) for s in shards if self.shard_sizes[s]} - seen
                lo, step = a, 64
                while left and lo < end:  # growing scans: most windows show all their shards early
                    hi = min(end, lo + step)
                    for s in shards_in_order(self._map(epoch, lo, hi, layout), self.starts):
                        if s in left:
                            left.discard(s)
                            seen.add(s)
                            order.append(s)
                    lo, step = hi, min(step * 2, _CHUNK)
                a, j = end, j + 1
        return order

    def _begin(self) -> tuple[int, int]:
        """Start a pass over this rank's epoch: (epoch, its first position: the resume point, if any)."""
        self._ranks.fix()
        epoch = self.epoch
        start, self._resume = self._resume, 0
        self._consumed = start
        if self._prefetch is not None:
            storage, names = self._prefetch
            storage.prefetch([names[k] for k in self.shard_order(epoch, start)])
        return epoch, start

    def __iter__(self) -> Iterator[int]:
        epoch, start = self._begin()
        for chunk in self._chunks(epoch, start):
            for i in chunk.tolist():
                self._consumed += 1
                yield i

    def batches(self, batch_size: int, drop_last: bool) -> Iterator[np.ndarray]:
        """The indices `__iter__` yields, cut into int64 arrays of `batch_size` as torch's `BatchSampler`
        over this sampler cuts them (the last one shorter, or dropped with `drop_last`), with no Python
        step per index; `get_state()` after a batch is what it is after that batch through `__iter__`."""
        epoch, start = self._begin()
        held = np.zeros(0, dtype=np.int64)  # indices of a batch begun in the previous chunk
        for chunk in self._chunks(epoch, start):
            if held.size:
                chunk = np.concatenate([held, chunk])
            full = chunk.size - chunk.size % batch_size
            for a in range(0, full, batch_size):
                self._consumed += batch_size
                yield chunk[a : a + batch_size]
            held = chunk[full:]
        self._consumed += held.size  # pulled by torch's BatchSampler even when dropped
        if held.size and not drop_last:
            yield held

    # -- resume ---------------------------------------------------------------------------------
    @property
    def position(self) -> EpochPosition:
        """Where this rank is: `consumed` = indices its iterator has yielded this epoch."""
        settings = {k: getattr(self, k) for k in ("seed", "window", "shuffle", "num_samples", "drop_last")}
        return EpochPosition(self.epoch, self._consumed, self.rank, self.world_size, settings)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `get_state()`): the next `__iter__` continues its epoch after its
        `consumed` indices."""
        current = self.position
        pos = EpochPosition.from_state(state, owner="ShardWindowSampler", world_size=self.world_size,
                                       settings=current.settings)
        if pos.consumed > self.per_rank:
            raise ValueError(f"cannot resume ShardWindowSampler at {pos.consumed} of {self.per_rank} indices")
        self.epoch = pos.epoch
        self._resume = self._consumed = pos.consumed


def randomness_report(order: np.ndarray | Sequence[int], labels: np.ndarray | Sequence[int], *,
                      batch_size: int) -> dict[str, float]:
    """How random an order looks, to compare a windowed shuffle with a full permutation.

    - `position_index_corr`: Spearman correlation between position in the epoch and sample index
      (about 0 for any shuffled order, 1 for sequential);
    - `labels_per_batch`: mean number of distinct labels in a batch;
    - `batch_label_tv`: mean total-variation distance between a batch's label histogram and the
      whole dataset's (0 = every batch looks like the dataset, 1 = disjoint);
    - `same_label_neighbors`: fraction of consecutive pairs with the same label.
    """
    idx = np.asarray(order, dtype=np.int64)
    lab = np.asarray(labels)[idx]
    n = idx.size
    ranks = np.empty(n, dtype=np.float64)
    ranks[np.argsort(idx, kind="stable")] = np.arange(n, dtype=np.float64)
    pos = np.arange(n, dtype=np.float64)
    corr = float(np.corrcoef(pos, ranks)[0, 1]) if n > 1 else 0.0
    classes, lab_codes = np.unique(lab, return_inverse=True)
    k = classes.size
    global_p = np.bincount(lab_codes, minlength=k) / max(n, 1)
    nb = n // batch_size
    codes = lab_codes[: nb * batch_size].reshape(nb, batch_size) if nb else lab_codes[None, :]
    hist = np.zeros((codes.shape[0], k))
    np.add.at(hist, (np.repeat(np.arange(codes.shape[0]), codes.shape[1]), codes.reshape(-1)), 1.0)
    per_batch = (hist > 0).sum(axis=1)
    tv = 0.5 * np.abs(hist / codes.shape[1] - global_p).sum(axis=1)
    same = float(np.mean(lab_codes[1:] == lab_codes[:-1])) if n > 1 else 0.0
    return {
        "position_index_corr": corr,
        "labels_per_batch": float(per_batch.mean()),
        "batch_label_tv": float(tv.mean()),
        "same_label_neighbors": same,
    }
