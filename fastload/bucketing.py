"""`TokenBudgetBatchSampler`: length-bucketed batches under a token budget, balanced over ranks.

The epoch plan is a pure function of (seed, epoch, lengths, world_size, settings):

1. Shuffle all indices (seeded by `(seed, epoch)`), cut them into megabatches of
   `megabatch_size` samples, sort each megabatch by length (longest first) and cut it greedily
   into batches with `batch_size * padded_max_len <= max_tokens`. The unfinished batch at the
   end of a megabatch is carried into the next one, so only the very last batch of the epoch can
   be short.
2. Make the batch count a multiple of `world_size`: the short last batch and the `k % world_size`
   batches of shortest sequences are pooled and dealt (snake order, longest first) into
   `world_size` (or a multiple) batches of near-equal padded cost. If the pool has fewer samples
   than batches it needs, samples of the pool are repeated (the only duplicates; they happen only
   when fewer than `world_size` samples are left over). With `drop_last=True` those batches are
   dropped instead (their samples are skipped this epoch).
3. Sort the remaining batches by padded token cost and group `world_size` neighbours into one
   step, so the ranks receive batches of nearly equal cost at every step. Shuffle the steps,
   and the rank assignment inside each step.

Rank `r` yields `plan[step][r]` for every step: every rank yields the same number of batches.
Resume is exact: the state is `(epoch, seed, batches yielded by this rank)`.

Usage (`transform=` runs the collate on the columnar `get_batch` dict: the Loader's fast path;
`collate_fn=` works too, on lists of sample dicts)::

    sampler = TokenBudgetBatchSampler.from_dataset(ds, 16384, pad_to_multiple_of=8)
    loader = fastload.Loader(ds, batch_sampler=sampler, transform=TextCollate(pad_to_multiple_of=8))
    for epoch in range(epochs):
        loader.set_epoch(epoch)  # a new order each epoch (as torch's DistributedSampler)
        for batch in loader: ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from fastload.sampling import resolve_rank_world

__all__ = ["TokenBudgetBatchSampler", "padding_stats", "step_imbalance"]

_DEFAULT_MEGABATCH = 32768


def _pad_up(x: np.ndarray | int, m: int) -> Any:
    return (x + m - 1) // m * m


class TokenBudgetBatchSampler:
    """Batches of similar-length samples with `len(batch) * padded_max_len <= max_tokens`.

    `lengths[i]` is the token count of sample i (take it from `ds.lengths(field)`: no data
    reads). `padded_max_len` is the batch's longest sample rounded up to `pad_to_multiple_of`.
    A sample longer than `max_tokens` raises `ValueError` naming it; with `truncate=True` it is
    budgeted at `self.max_len` tokens instead, and the collate must cut it (pass
    `max_len=sampler.max_len` to `TextCollate`).

    Yields lists of sample indices. Call `set_epoch(e)` every epoch; `state_dict()` /
    `load_state_dict()` resume mid-epoch exactly (same world size, seed and lengths).
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
    ) -> None:
        lens = np.asarray(lengths)
        if lens.ndim != 1 or len(lens) == 0:
            raise ValueError("lengths must be a non-empty 1-D sequence of token counts")
        if not np.issubdtype(lens.dtype, np.integer) or (lens < 0).any():
            raise ValueError("lengths must be non-negative integers")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if max_tokens < pad_to_multiple_of:
            raise ValueError(f"max_tokens={max_tokens} is smaller than pad_to_multiple_of={pad_to_multiple_of}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.lengths = lens.astype(np.int64)
        self._total_tokens = int(self.lengths.sum())
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.drop_last = drop_last
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        self.megabatch_size = int(megabatch_size or _DEFAULT_MEGABATCH)
        if self.megabatch_size < 1:
            raise ValueError(f"megabatch_size must be >= 1, got {megabatch_size}")
        self.truncate = truncate
        self.max_len = self.max_tokens // self.pad_to_multiple_of * self.pad_to_multiple_of
        eff = _pad_up(np.maximum(self.lengths, 1), self.pad_to_multiple_of)
        too_long = np.flatnonzero(eff > self.max_tokens)
        if len(too_long) and not truncate:
            i = int(too_long[0])
            raise ValueError(
                f"sample {i} has {int(self.lengths[i])} tokens (padded {int(eff[i])}), more than "
                f"max_tokens={self.max_tokens} ({len(too_long)} such samples); raise max_tokens, "
                "filter them out, or pass truncate=True (and max_len=sampler.max_len to the collate)"
            )
        self._eff = np.minimum(eff, self.max_len)  # budgeted (padded, truncated) length per sample
        self.epoch = 0
        self._resume = 0  # one-shot start offset for the next __iter__ (set by load_state_dict)
        self._yielded = 0  # batches yielded by this rank in the current epoch
        self._cache: tuple[int, list[list[np.ndarray]]] | None = None

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

    def _form_batches(self, order: np.ndarray) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Greedy batches per megabatch, longest first; returns (full batches, short last batch)."""
        batches: list[np.ndarray] = []
        carry = np.zeros(0, dtype=np.int64)
        n = len(order)
        for start in range(0, n, self.megabatch_size):
            last = start + self.megabatch_size >= n
            chunk = np.concatenate([carry, order[start : start + self.megabatch_size]])
            chunk = chunk[np.argsort(-self._eff[chunk], kind="stable")]
            eff = self._eff[chunk]
            carry = chunk[:0]
            i = 0
            while i < len(chunk):
                cap = self._cap(eff[i])
                if i + cap > len(chunk):
                    carry = chunk[i:]
                    break
                batches.append(chunk[i : i + cap])
                i += cap
            if last and len(carry):
                return batches, carry
        return batches, None

    def _deal(self, pool: np.ndarray) -> list[np.ndarray]:
        """Deal `pool` into a multiple of world_size batches of near-equal cost (snake order)."""
        w = self.world_size
        pool = pool[np.argsort(-self._eff[pool], kind="stable")]
        n_out = w
        while True:
            if len(pool) < n_out:  # fewer samples than batches: repeat samples (documented padding)
                pool = np.resize(pool, n_out)
            pos = np.arange(len(pool))
            rnd, k = pos // n_out, pos % n_out
            which = np.where(rnd % 2 == 0, k, n_out - 1 - k)
            out = [pool[which == b] for b in range(n_out)]
            if all(len(b) <= self._cap(self._eff[b].max()) for b in out):
                return out
            n_out += w

    def plan(self, epoch: int | None = None) -> list[list[np.ndarray]]:
        """All ranks' batches for an epoch: `plan[step][rank]` is an int64 index array."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        w = self.world_size
        rng = np.random.default_rng([self.seed, epoch])
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n, dtype=np.int64)
        full, short = self._form_batches(order)
        extra = len(full) % w
        tail: list[np.ndarray] = []
        if self.drop_last:
            full = full[: len(full) - extra]
        elif extra or short is not None:
            # pool the short batch with the `extra` batches of shortest sequences (most samples)
            by_len = np.argsort([self._eff[b[0]] for b in full], kind="stable")
            picked = set(by_len[:extra].tolist())
            pool = [full[j] for j in sorted(picked)] + ([short] if short is not None else [])
            full = [b for j, b in enumerate(full) if j not in picked]
            tail = self._deal(np.concatenate(pool))
        costs = np.array([len(b) * self._eff[b[0]] for b in full], dtype=np.int64)
        by_cost = [full[j] for j in np.argsort(costs, kind="stable")]
        tail_costs = np.array([len(b) * self._eff[b].max() for b in tail], dtype=np.int64)
        tail = [tail[j] for j in np.argsort(tail_costs, kind="stable")]
        batches = by_cost + tail
        steps = [batches[s : s + w] for s in range(0, len(batches), w)]
        if self.shuffle:
            steps = [steps[j] for j in rng.permutation(len(steps))]
            ranks = rng.permuted(np.tile(np.arange(w), (len(steps), 1)), axis=1)
            steps = [[step[j] for j in perm] for step, perm in zip(steps, ranks)]
        self._cache = (epoch, steps)
        return steps

    def step_costs(self, epoch: int | None = None) -> np.ndarray:
        """Padded tokens per `[step, rank]` for an epoch (the cost every rank pays at that step)."""
        return np.array([[len(b) * self._eff[b].max() for b in step] for step in self.plan(epoch)], dtype=np.int64)

    def stats(self) -> dict[str, float]:
        """The current epoch's plan: padding waste, rank imbalance (mean/max of max/min - 1), steps.

        `fastload.Loader.stats()` merges this in when the sampler is its `batch_sampler`.
        """
        plan = self.plan()
        costs = self.step_costs()
        real = sum(int(self.lengths[b].sum()) for step in plan for b in step)
        imbalance = step_imbalance(costs)
        return {
            "bucket_steps": len(plan),
            "bucket_planned_padding_waste": 1.0 - real / max(int(costs.sum()), 1),
            "bucket_rank_imbalance_mean": float(imbalance.mean()) if len(plan) else 0.0,
            "bucket_rank_imbalance_max": float(imbalance.max()) if len(plan) else 0.0,
        }

    # ----------------------------------------------------------------------------- sampler protocol
    def __len__(self) -> int:
        return len(self.plan())

    def __iter__(self) -> Iterator[list[int]]:
        steps = self.plan()
        start, self._resume = self._resume, 0
        self._yielded = start
        for step in steps[start:]:
            self._yielded += 1
            yield step[self.rank].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's plan; a changed epoch also drops any pending resume offset."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._resume = 0
            self._yielded = 0

    def _fingerprint(self) -> dict[str, Any]:
        # cheap: the Loader snapshots `state_dict()` after every batch it pulls
        return {
            "seed": self.seed,
            "world_size": self.world_size,
            "num_samples": len(self.lengths),
            "total_tokens": self._total_tokens,
            "max_tokens": self.max_tokens,
            "max_batch_size": self.max_batch_size,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "megabatch_size": self.megabatch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """`{epoch, batches_yielded, rank, ...settings}`: enough to continue after the last yielded batch."""
        return {"epoch": self.epoch, "batches_yielded": self._yielded, "rank": self.rank, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next `__iter__` starts after its last yielded batch."""
        mine = self._fingerprint()
        diff = {k: (state.get(k), v) for k, v in mine.items() if k in state and state[k] != v}
        if diff:
            raise ValueError(f"cannot resume: sampler settings differ from the saved state {diff} (saved, current)")
        self.epoch = int(state["epoch"])
        self._resume = self._yielded = int(state["batches_yielded"])


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
