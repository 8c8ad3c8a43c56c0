"""`TokenBudgetBatchSampler`: length-bucketed batches under a token budget, balanced over ranks.

The epoch plan is a pure function of (seed, epoch, lengths, world_size, settings). The epoch's
order (`fastload.order.index_shuffle`, seeded by `(seed, epoch)`) is cut into windows of about
`window` samples (one window up to `window` samples, the default 2**20; bigger datasets get
`n // window` windows of equal size), and each window is planned alone, in turn, as the
iteration reaches it, so memory is O(window) whatever the dataset size:

1. Take the window's samples in the shuffled order, cut them into megabatches of
   `megabatch_size` samples, sort each megabatch by length (longest first) and cut it greedily
   into batches with `batch_size * padded_max_len <= max_tokens`. The unfinished batch at the
   end of a megabatch is carried into the next one, so only the very last batch of the epoch can
   be short.
2. Make the batch count a multiple of `world_size`: the short last batch and the `k % world_size`
   batches of shortest sequences are pooled and dealt into `world_size` (or a multiple) batches
   of near-equal padded cost (the longest samples head one batch each, sizes in inverse
   proportion to their lengths). If the pool has fewer samples
   than batches it needs, samples of the pool are repeated (the only duplicates; they happen only
   when fewer than `world_size` samples are left over). With `drop_last=True` those batches are
   dropped instead (their samples are skipped this epoch).
3. Sort the remaining batches by padded token cost and group `world_size` neighbours into one
   step, so the ranks receive batches of nearly equal cost at every step. Shuffle the steps,
   and the rank assignment inside each step.

Rank `r` yields `plan[step][r]` for every step: every rank yields the same number of batches.
Resume is exact: the state is `(epoch, seed, batches yielded by this rank)`.

Rank and world size (`fastload.order.sampling.RunRank`): arguments given win; else, held by a
`fastload.Loader`, the Loader's run (`bind_run`, which also sets the epoch at every epoch start,
so epochs driven by `iter()` alone get a new plan each); else, used alone, resolved from
`torch.distributed` or RANK/WORLD_SIZE, afresh until the first `__iter__`.

Usage (`transform=` runs the collate on the columnar `get_batch` dict: the Loader's fast path;
`collate_fn=` works too, on lists of sample dicts)::

    sampler = TokenBudgetBatchSampler.from_dataset(ds, 16384, pad_to_multiple_of=8)
    loader = fastload.Loader(ds, batch_sampler=sampler, transform=TextCollate(pad_to_multiple_of=8))
    for epoch in range(epochs):
        for batch in loader: ...  # a new plan each epoch (the Loader hands the sampler its epoch)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from fastload.order.index_shuffle import IndexShuffle
from fastload.order.position import EpochPosition
from fastload.order.sampling import RankedSampler, RunRank

__all__ = ["DEFAULT_WINDOW", "TokenBudgetBatchSampler", "padding_stats", "step_imbalance"]

_DEFAULT_MEGABATCH = 32768
DEFAULT_WINDOW = 1 << 20  # samples planned together (~0.8 s and ~40 MB a window here)
_SCAN = 1 << 20  # lengths validated per pass at construction


def _pad_up(x: np.ndarray | int, m: int) -> Any:
    return (x + m - 1) // m * m


class TokenBudgetBatchSampler(RankedSampler):
    """Batches of similar-length samples with `len(batch) * padded_max_len <= max_tokens`.

    `lengths[i]` is the token count of sample i (take it from `ds.lengths(field)`: no data
    reads; kept as given, e.g. int32, and read a window at a time). `padded_max_len` is the
    batch's longest sample rounded up to `pad_to_multiple_of`.
    A sample longer than `max_tokens` raises `ValueError` naming it; with `truncate=True` it is
    budgeted at `self.max_len` tokens instead, and the collate must cut it (pass
    `max_len=sampler.max_len` to `TextCollate`). `window`: samples planned together (see the
    module docstring).

    Yields lists of sample indices. A Loader holding it hands it the epoch (`bind_run`); used
    alone, call `set_epoch(e)` every epoch. `rank` / `world_size`: None takes the Loader's (see
    the module docstring). `get_state()` / `set_state()` (and torch's names for them, `state_dict()` /
    `load_state_dict()`) resume mid-epoch exactly (same world size, seed and lengths).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        max_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        pad_to_multiple_of: int = 1,
        megabatch_size: int | None = None,
        truncate: bool = False,
        window: int | None = None,
    ) -> None:
        lens = np.asarray(lengths)
        if lens.ndim != 1 or len(lens) == 0:
            raise ValueError("lengths must be a non-empty 1-D sequence of token counts")
        if not np.issubdtype(lens.dtype, np.integer):
            raise ValueError("lengths must be non-negative integers")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if max_tokens < pad_to_multiple_of:
            raise ValueError(f"max_tokens={max_tokens} is smaller than pad_to_multiple_of={pad_to_multiple_of}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.lengths = lens
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self._ranks = RunRank(rank, world_size, owner="TokenBudgetBatchSampler")
        self.drop_last = drop_last
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.megabatch_size = int(megabatch_size or _DEFAULT_MEGABATCH)
        if self.megabatch_size < 1:
            raise ValueError(f"megabatch_size must be >= 1, got {megabatch_size}")
        self.window = int(window or DEFAULT_WINDOW)
        if self.window < 1:
            raise ValueError(f"window must be >= 1 sample, got {window}")
        self.truncate = truncate
        self.max_len = self.max_tokens // self.pad_to_multiple_of * self.pad_to_multiple_of
        self._total_tokens = self._validate()
        n = len(lens)
        self.num_windows = max(1, n // self.window)
        self.epoch = 0
        self._resume: tuple[int, int, int] | None = None  # (batches, window, step) for the next __iter__
        self._yielded = 0  # batches yielded by this rank in the current epoch
        self._at = (0, 0)  # (window, step) of the next batch to yield
        self._cache: tuple[int, int, int, list[list[np.ndarray]]] | None = None  # (epoch, window, world, steps)
        self._counts: tuple[int, int, np.ndarray] | None = None  # (epoch, world, steps per window)

    def _validate(self) -> int:
        """Check every length (a pass of `_SCAN` at a time, no per-sample temporaries); the total."""
        lens, total, too_long, first = self.lengths, 0, 0, -1
        for a in range(0, len(lens), _SCAN):
            part = lens[a : a + _SCAN].astype(np.int64)
            if (part < 0).any():
                raise ValueError("lengths must be non-negative integers")
            total += int(part.sum())
            over = np.flatnonzero(_pad_up(np.maximum(part, 1), self.pad_to_multiple_of) > self.max_tokens)
            if len(over) and first < 0:
                first = a + int(over[0])
            too_long += len(over)
        if too_long and not self.truncate:
            eff = _pad_up(max(int(lens[first]), 1), self.pad_to_multiple_of)
            raise ValueError(
                f"sample {first} has {int(lens[first])} tokens (padded {eff}), more than "
                f"max_tokens={self.max_tokens} ({too_long} such samples); raise max_tokens, "
                "filter them out, or pass truncate=True (and max_len=sampler.max_len to the collate)"
            )
        return total

    def _eff(self, ids: np.ndarray) -> np.ndarray:
        """Budgeted (padded, truncated) lengths of samples `ids`."""
        eff = _pad_up(np.maximum(self.lengths[ids].astype(np.int64), 1), self.pad_to_multiple_of)
        return np.minimum(eff, self.max_len)

    @classmethod
    def from_dataset(
        cls, ds: Any, max_tokens: int, *, field: str = "input_ids", **kwargs: Any
    ) -> TokenBudgetBatchSampler:
        """Build from a fastload dataset's index: `ds.lengths(field)` (no data reads)."""
        return cls(ds.lengths(field), max_tokens, **kwargs)

    # ----------------------------------------------------------------------------- the plan
    def _cap(self, eff_first: int) -> int:
        cap = self.max_tokens // int(eff_first)
        return min(cap, self.max_batch_size) if self.max_batch_size else cap

    def _form_batches(self, eff: np.ndarray) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Greedy batches per megabatch of positions `0..len(eff)`, longest first; returns (full
        batches, short last batch)."""
        batches: list[np.ndarray] = []
        carry = np.zeros(0, dtype=np.int64)
        n = len(eff)
        for start in range(0, n, self.megabatch_size):
            last = start + self.megabatch_size >= n
            chunk = np.concatenate([carry, np.arange(start, min(n, start + self.megabatch_size))])
            chunk = chunk[np.argsort(-eff[chunk], kind="stable")]
            ce = eff[chunk]
            carry = chunk[:0]
            i = 0
            while i < len(chunk):
                cap = self._cap(ce[i])
                if i + cap > len(chunk):
                    carry = chunk[i:]
                    break
                batches.append(chunk[i : i + cap])
                i += cap
            if last and len(carry):
                return batches, carry
        return batches, None

    def _deal(self, pool: np.ndarray, eff: np.ndarray) -> list[np.ndarray]:
        """Deal `pool` into a multiple of world_size batches of near-equal padded cost: the n_out
        longest samples head one batch each (every other sample is no longer, so a batch's cost
        is its size times its head's length), and batch sizes are shared in inverse proportion
        to those lengths (largest remainders)."""
        w = self.world_size
        pool = pool[np.argsort(-eff[pool], kind="stable")]
        n_out = w
        while True:
            if len(pool) < n_out:  # fewer samples than batches: repeat samples (documented padding)
                pool = np.resize(pool, n_out)
            heads = eff[pool[:n_out]].astype(np.float64)
            share = (1.0 / heads) / (1.0 / heads).sum() * len(pool)
            counts = np.maximum(np.floor(share).astype(np.int64), 1)
            while counts.sum() > len(pool):  # a share below 1 was raised to 1: take back elsewhere
                over = np.where(counts > 1, counts - share, -np.inf)
                counts[int(np.argmax(over))] -= 1
            for b in np.argsort(-(share - counts), kind="stable")[: len(pool) - int(counts.sum())]:
                counts[b] += 1
            caps = np.array([self._cap(h) for h in heads])
            if (counts <= caps).all():
                ends = n_out + np.cumsum(counts - 1)
                starts = ends - (counts - 1)
                return [np.concatenate([pool[b : b + 1], pool[starts[b] : ends[b]]]) for b in range(n_out)]
            n_out += w

    def _window_ids(self, epoch: int, k: int) -> np.ndarray:
        """The samples of window `k` of `epoch`, in the epoch's order."""
        n = len(self.lengths)
        lo, hi = k * n // self.num_windows, (k + 1) * n // self.num_windows
        pos = np.arange(lo, hi, dtype=np.int64)
        return IndexShuffle(n, seed=self.seed, epoch=epoch)(pos) if self.shuffle else pos

    def window_plan(self, k: int, epoch: int | None = None) -> list[list[np.ndarray]]:
        """All ranks' batches of window `k`: `[step][rank]` int64 index arrays."""
        epoch = self.epoch if epoch is None else int(epoch)
        w = self.world_size
        cached = self._cache
        if cached is not None and cached[:3] == (epoch, k, w):
            return cached[3]
        ids = self._window_ids(epoch, k)
        eff = self._eff(ids)
        full, short = self._form_batches(eff)  # positions in the window
        extra = len(full) % w
        tail: list[np.ndarray] = []
        if self.drop_last:
            full = full[: len(full) - extra]
        elif extra or short is not None:
            # pool the short batch with the `extra` batches of shortest sequences (most samples)
            by_len = np.argsort([eff[b[0]] for b in full], kind="stable")
            picked = set(by_len[:extra].tolist())
            pool = [full[j] for j in sorted(picked)] + ([short] if short is not None else [])
            full = [b for j, b in enumerate(full) if j not in picked]
            tail = self._deal(np.concatenate(pool), eff)
        costs = np.array([len(b) * eff[b[0]] for b in full], dtype=np.int64)
        by_cost = [full[j] for j in np.argsort(costs, kind="stable")]
        tail_costs = np.array([len(b) * eff[b].max() for b in tail], dtype=np.int64)
        tail = [tail[j] for j in np.argsort(tail_costs, kind="stable")]
        batches = [ids[b] for b in by_cost + tail]
        steps = [batches[s : s + w] for s in range(0, len(batches), w)]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, k])
            steps = [steps[j] for j in rng.permutation(len(steps))]
            ranks = rng.permuted(np.tile(np.arange(w), (len(steps), 1)), axis=1)
            steps = [[step[j] for j in perm] for step, perm in zip(steps, ranks)]
        self._cache = (epoch, k, w, steps)
        return steps

    def plan(self, epoch: int | None = None) -> list[list[np.ndarray]]:
        """All ranks' batches for an epoch, every window's: `plan[step][rank]` is an int64 index
        array (the whole epoch at once: for checks and datasets of a few windows)."""
        return [step for k in range(self.num_windows) for step in self.window_plan(k, epoch)]

    def steps_per_window(self, epoch: int | None = None) -> np.ndarray:
        """Steps of each window of an epoch (plans every window once; cached per epoch)."""
        epoch = self.epoch if epoch is None else int(epoch)
        w = self.world_size
        if self._counts is None or self._counts[:2] != (epoch, w):
            self._counts = (epoch, w, np.array([len(self.window_plan(k, epoch)) for k in range(self.num_windows)]))
        return self._counts[2]

    def step_costs(self, epoch: int | None = None, *, window: int | None = None) -> np.ndarray:
        """Padded tokens per `[step, rank]` for an epoch (or one window of it): what every rank pays at that step."""
        steps = self.plan(epoch) if window is None else self.window_plan(window, epoch)
        return np.array([[len(b) * self._eff(b).max() for b in step] for step in steps], dtype=np.int64)

    def stats(self) -> dict[str, float]:
        """The plan of the window being read (the whole epoch when it is one window): padding
        waste, rank imbalance (mean/max of max/min - 1), steps.

        `fastload.Loader.stats()["components"]["batch_sampler"]` reports it (`component_stats`).
        """
        k = min(self._at[0], self.num_windows - 1)
        plan = self.window_plan(k)
        costs = self.step_costs(window=k)
        real = sum(int(self.lengths[b].astype(np.int64).sum()) for step in plan for b in step)
        imbalance = step_imbalance(costs)
        return {
            "bucket_steps": len(plan),
            "bucket_planned_padding_waste": 1.0 - real / max(int(costs.sum()), 1),
            "bucket_rank_imbalance_mean": float(imbalance.mean()) if len(plan) else 0.0,
            "bucket_rank_imbalance_max": float(imbalance.max()) if len(plan) else 0.0,
        }

    component_stats = stats  # `fastload.run.StatsReporter`: `loader.stats()["components"][role]`

    # ----------------------------------------------------------------------------- sampler protocol
    def __len__(self) -> int:
        return int(self.steps_per_window().sum())

    def __iter__(self) -> Iterator[list[int]]:
        rank = self._ranks.fix()[0]
        epoch = self.epoch
        resume, self._resume = self._resume, None
        done, k0, j0 = resume if resume is not None else (0, 0, 0)
        self._yielded, self._at = done, (k0, j0)
        for k in range(k0, self.num_windows):
            steps = self.window_plan(k, epoch)
            for j in range(j0 if k == k0 else 0, len(steps)):
                self._yielded += 1
                self._at = (k, j + 1)
                yield steps[j][rank].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's plan; a changed epoch also drops any pending resume offset."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._resume = None
            self._yielded = 0
            self._at = (0, 0)

    def _settings(self) -> dict[str, Any]:
        # cheap: the Loader snapshots `state_dict()` (`get_state()`) after every batch it pulls
        return {
            "seed": self.seed,
            "num_samples": len(self.lengths),
            "total_tokens": self._total_tokens,
            "max_tokens": self.max_tokens,
            "max_batch_size": self.max_batch_size,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "megabatch_size": self.megabatch_size,
            "window": self.window,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    @property
    def position(self) -> EpochPosition:
        """Where this rank is: `consumed` = batches yielded this epoch, `cursor` = (window, step)
        of the next batch."""
        return EpochPosition(self.epoch, self._yielded, self.rank, self.world_size, self._settings(), self._at)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `get_state()`): the next `__iter__` starts after its last yielded batch."""
        pos = EpochPosition.from_state(state, owner="TokenBudgetBatchSampler", world_size=self.world_size,
                                       settings=self._settings())
        if len(pos.cursor) != 2:
            raise ValueError(f"cannot resume TokenBudgetBatchSampler: cursor={list(pos.cursor)} is not (window, step)")
        k, j = pos.cursor
        self.epoch = pos.epoch
        self._yielded = pos.consumed
        self._resume = (self._yielded, k, j)
        self._at = (k, j)


def padding_stats(
    lengths: np.ndarray, batches: Sequence[Sequence[int]], *, pad_to_multiple_of: int = 1
) -> dict[str, float]:
    """Real vs padded tokens of padded batches: `{real_tokens, padded_tokens, waste}` (waste = pad/padded)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = padded = 0
    for b in batches:
        lb = lengths[np.asarray(b, dtype=np.int64)]
        real += int(lb.sum())
        padded += len(lb) * int(_pad_up(int(lb.max()), pad_to_multiple_of)) if len(lb) else 0
    return {"real_tokens": real, "padded_tokens": padded, "waste": 1.0 - real / padded if padded else 0.0}


def step_imbalance(costs: np.ndarray) -> np.ndarray:
    """Per step `max/min - 1` of a `[step, rank]` cost matrix (0 = perfectly balanced)."""
    costs = np.asarray(costs, dtype=np.float64)
    return costs.max(axis=1) / np.maximum(costs.min(axis=1), 1.0) - 1.0
