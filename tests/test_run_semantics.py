"""Run semantics: every part of a run follows the Loader (epoch, rank, resume), as a user drives it.

The matrix: {seeded order, torch's sampler, `DistributedSampler`, `ShardWindowSampler`,
`TokenBudgetBatchSampler`} x {0 workers, 2 threads, 2 processes} x {epochs driven by
`set_epoch`, by `iter()` alone} x {1 rank, 2 simulated ranks} x {no transform, `ImagePreset`
train, `TextCollate`}. Each case checks: every sample exactly once per epoch (ranks disjoint
and covering; the datasets split evenly, so no sampler pads), the order differs between epochs,
the augmentation differs between epochs, a mid-epoch resume into a fresh Loader gives the
uninterrupted epoch bit for bit (pixels included), and every worker count and kind gives the
batches of 0 workers bit for bit.

Two simulated ranks: rank 0 through the Loader's `rank=`/`world_size=` arguments, rank 1
through RANK/WORLD_SIZE (as torchrun sets them), so both ways of learning the rank meet in
each case. Pruned, and why:
* `ImagePreset` only on image data and `TextCollate` only on token data (they decode those);
* `TokenBudgetBatchSampler` only on token data (it buckets by token counts; no transform or
  `TextCollate`);
* `DistributedSampler` gets its rank only from its own arguments (it reads `torch.distributed`,
  never RANK/WORLD_SIZE), so its rank 1 is built with `num_replicas=2, rank=1` beside the
  environment.
With 2 ranks and no sampler, "torch's sampler" (`shuffle=True` without `seed=`) is the Loader's
seeded order with seed 0 (a torch sampler does not split a world): that is what a user gets.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import BatchSampler, DistributedSampler

from fastload import BatchViews, Loader, ShardWindowSampler, TextCollate, TokenBudgetBatchSampler
from fastload.formats import FastloadDataset, Field, Ragged, Schema, write
from fastload.order.sampling import RunRank
from fastload.run import (
    RunAware,
    RunContext,
    StatsReporter,
    bind_components,
    collect_component_stats,
    current_batch,
    implements,
)
from fastload.vision import ImagePreset, dali_available

N_IMAGES, N_TOKENS, BATCH = 24, 48, 4
Data = dict[str, FastloadDataset]  # "images", "tokens"
TORCH_SEED = 1234
MAX_TOKENS = 256


# ----------------------------------------------------------------------------- data
def _jpeg(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    low = (rng.random((h // 8 + 2, w // 8 + 2, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(low).resize((w, h), Image.BICUBIC).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """An image and a token dataset, written with fastload's writer (several shards each)."""
    root = tmp_path_factory.mktemp("run-semantics")
    images = [{"image": _jpeg(24 + 3 * (i % 5), 30 + 2 * (i % 7), i), "label": i} for i in range(N_IMAGES)]
    schema = Schema([Field("image", "image"), Field("label", "scalar", np.int64)])
    write(images, root / "images", schema=schema, shard_size=4096, progress=False, workers=1)
    rng = np.random.default_rng(5)
    lengths = rng.integers(4, 60, N_TOKENS)
    tokens = [{"input_ids": rng.integers(1, 1000, n, dtype=np.int32), "label": i} for i, n in enumerate(lengths)]
    schema = Schema([Field("input_ids", "varray", np.dtype(np.int32)), Field("label", "scalar", np.int64)])
    write(tokens, root / "tokens", schema=schema, shard_size=4096, progress=False, workers=1)
    return {"images": FastloadDataset(root / "images"), "tokens": FastloadDataset(root / "tokens")}


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def launcher_env(rank: int, world: int) -> Iterator[None]:
    """RANK/WORLD_SIZE as torchrun sets them, for the block."""
    old = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- the cases
class Case(NamedTuple):
    sampler: str  # seeded | torch | distributed | shard_window | token_budget
    transform: str  # none | preset | text
    workers: str  # 0 | threads | processes
    drive: str  # set_epoch | iter
    world: int  # 1 | 2


SAMPLER_TRANSFORMS = [
    (sampler, transform)
    for sampler in ("seeded", "torch", "distributed", "shard_window")
    for transform in ("none", "preset", "text")
] + [("token_budget", "none"), ("token_budget", "text")]
WORKERS = {"0": {}, "threads": {"num_workers": 2, "worker_type": "thread"},
           "processes": {"num_workers": 2, "worker_type": "process"}}
CASES = [
    Case(s, t, w, d, world)
    for s, t in SAMPLER_TRANSFORMS
    for w in WORKERS
    for d in ("set_epoch", "iter")
    for world in (1, 2)
]


def make_loader(case: Case, rank: int, data: Data) -> Loader:
    """The case's Loader for `rank` (rank 1 of 2 learns its rank from RANK/WORLD_SIZE)."""
    ds = data["tokens" if case.transform == "text" or case.sampler == "token_budget" else "images"]
    kw: dict[str, Any] = dict(WORKERS[case.workers])
    if case.world == 2 and rank == 0:
        kw.update(rank=0, world_size=2)
    if case.transform == "preset":
        kw["transform"] = ImagePreset(kind="train", size=8, backend="cpu")
    elif case.transform == "text":
        kw["collate_fn"] = TextCollate()
    if case.sampler == "seeded":
        return Loader(ds, batch_size=BATCH, shuffle=True, seed=7, **kw)
    if case.sampler == "torch":
        return Loader(ds, batch_size=BATCH, shuffle=True, **kw)
    if case.sampler == "distributed":
        sampler = DistributedSampler(ds, num_replicas=case.world, rank=rank, shuffle=True, seed=11)
        return Loader(ds, batch_size=BATCH, sampler=sampler, **kw)
    if case.sampler == "shard_window":
        return Loader(ds, batch_size=BATCH, sampler=ShardWindowSampler.from_dataset(ds, window=2, seed=5), **kw)
    sampler = TokenBudgetBatchSampler.from_dataset(ds, MAX_TOKENS, seed=5)
    return Loader(ds, batch_sampler=sampler, **kw)


def rank_context(case: Case, rank: int) -> contextlib.AbstractContextManager[None]:
    return launcher_env(rank, case.world) if case.world == 2 and rank == 1 else contextlib.nullcontext()


def epoch_of(loader: Loader, case: Case, epoch: int) -> list[dict[str, Any]]:
    if case.drive == "set_epoch":
        loader.set_epoch(epoch)
    return list(loader)


class RankRun(NamedTuple):
    epochs: list[list[dict[str, Any]]]  # epochs 0 and 1, uninterrupted
    resumed: list[dict[str, Any]]  # epoch 1: half in one Loader, the rest in a fresh one after load_state_dict


def run_rank(case: Case, rank: int, data: Data) -> RankRun:
    with rank_context(case, rank):
        torch.manual_seed(TORCH_SEED)  # torch's sampler draws from the global RNG
        loader = make_loader(case, rank, data)
        epochs = [epoch_of(loader, case, e) for e in range(2)]
        loader.close()
        torch.manual_seed(TORCH_SEED)
        first = make_loader(case, rank, data)
        epoch_of(first, case, 0)
        if case.drive == "set_epoch":
            first.set_epoch(1)
        it = iter(first)
        head = [next(it) for _ in range(len(epochs[1]) // 2)]
        state = first.state_dict()
        del it
        first.close()
        torch.manual_seed(99)  # the state alone must carry what the resumed epoch depends on
        again = make_loader(case, rank, data)
        again.load_state_dict(state)
        rest = list(again)
        again.close()
    return RankRun(epochs, head + rest)


_OUTCOMES: dict[Case, tuple[RankRun, ...]] = {}


def outcome(case: Case, data: Data) -> tuple[RankRun, ...]:
    """Each rank's run of `case` (computed once: a case with workers compares with 0 workers')."""
    if case not in _OUTCOMES:
        _OUTCOMES[case] = tuple(run_rank(case, rank, data) for rank in range(case.world))
    return _OUTCOMES[case]


def ids(batches: list[dict[str, Any]]) -> list[int]:
    return [int(i) for b in batches for i in b["label"].tolist()]


def canonical(batch: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A batch as comparable values, every tensor by its bytes."""
    out: list[tuple[Any, ...]] = []
    for key in sorted(batch):
        v = batch[key]
        if isinstance(v, torch.Tensor):
            out.append((key, str(v.dtype), tuple(v.shape), v.contiguous().numpy().tobytes()))
        elif isinstance(v, Ragged):
            out.append((key, np.asarray(v.values).tobytes(), np.asarray(v.offsets).tobytes()))
        elif isinstance(v, list):
            out.append((key, tuple(bytes(x) if isinstance(x, (bytes, bytearray, memoryview)) else x for x in v)))
        else:
            out.append((key, v))
    return out


def images_by_sample(batches: list[dict[str, Any]]) -> dict[int, bytes]:
    return {
        int(i): img.numpy().tobytes() for b in batches for i, img in zip(b["label"].tolist(), b["image"], strict=True)
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_semantics_matrix(case: Case, data: Data) -> None:
    ranks = outcome(case, data)
    n = N_TOKENS if case.transform == "text" or case.sampler == "token_budget" else N_IMAGES
    for e in range(2):
        per_rank = [ids(r.epochs[e]) for r in ranks]
        everything = Counter(i for mine in per_rank for i in mine)
        assert everything == Counter(range(n)), f"epoch {e}: not every sample exactly once over the ranks"
        if case.world == 2:
            assert set(per_rank[0]).isdisjoint(per_rank[1])
    for rank, r in enumerate(ranks):
        assert ids(r.epochs[0]) != ids(r.epochs[1]), f"rank {rank}: epoch 1 repeats epoch 0's order"
        assert [canonical(b) for b in r.resumed] == [canonical(b) for b in r.epochs[1]], (
            f"rank {rank}: the resumed epoch differs from the uninterrupted one"
        )
    if case.transform == "preset":  # each sample, on whichever rank it lands, gets other crops and flips
        before, after = ({i: img for r in ranks for i, img in images_by_sample(r.epochs[e]).items()} for e in (0, 1))
        same = [i for i in before if before[i] == after[i]]
        assert len(same) <= len(before) // 10, f"samples {same} kept their augmentation"
    if case.workers != "0":  # the same batches, pixels included, whatever the workers
        reference = outcome(case._replace(workers="0"), data)
        for r, ref in zip(ranks, reference, strict=True):
            for got, want in zip(r.epochs, ref.epochs, strict=True):
                assert [canonical(b) for b in got] == [canonical(b) for b in want]


# ----------------------------------------------------------------------------- the cases
@pytest.mark.parametrize("how", ["transform", "collate_fn"])
@pytest.mark.parametrize("drive", ["set_epoch", "iter"])
@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_changes_every_epoch(how: str, drive: str, workers: int, data: Data) -> None:
    """ImagePreset(kind="train") as the transform (or collate_fn) of a sequential Loader: batch 0
    (the same samples every epoch) gets other crops and flips in epochs 0, 1 and 2."""
    ds = data["images"]
    preset = {how: ImagePreset(kind="train", size=8, backend="cpu")}
    loader = Loader(ds, batch_size=8, num_workers=workers, **preset)
    firsts = []
    for e in range(3):
        if drive == "set_epoch":
            loader.set_epoch(e)
        batches = list(loader)
        assert batches[0]["label"].tolist() == list(range(8))
        firsts.append(batches[0]["image"])
    for a in range(3):
        for b in range(a + 1, 3):
            differ = [not torch.equal(firsts[a][i], firsts[b][i]) for i in range(8)]
            assert sum(differ) >= 7, f"epochs {a} and {b}: batch 0 augmented alike"


def test_token_budget_gets_a_new_plan_every_epoch_driven_by_iter(data: Data) -> None:
    ds = data["tokens"]
    sampler = TokenBudgetBatchSampler.from_dataset(ds, MAX_TOKENS, seed=5)
    loader = Loader(ds, batch_sampler=sampler, collate_fn=TextCollate())
    plans = []
    for e in range(3):  # no set_epoch: Lightning ddp, Accelerate, a plain loop
        got = [b["label"].tolist() for b in loader]
        want = [sorted(step[0].tolist()) for step in sampler.plan(e)]
        assert [sorted(g) for g in got] == want
        plans.append(got)
    assert plans[0] != plans[1] != plans[2] != plans[0]
    assert loader.stats()["components"]["batch_sampler"]["bucket_steps"] == len(plans[2])


def test_shard_window_sampler_splits_under_launcher_env(data: Data) -> None:
    """`ShardWindowSampler.from_dataset(ds)` under RANK/WORLD_SIZE: each rank its own half, alone
    and in a Loader."""
    ds = data["images"]
    alone, in_loader = [], []
    for rank in range(2):
        with launcher_env(rank, 2):
            sampler = ShardWindowSampler.from_dataset(ds, seed=3)
            alone.append(list(sampler))
            assert (sampler.rank, sampler.world_size) == (rank, 2)
            loader = Loader(ds, batch_size=4, sampler=ShardWindowSampler.from_dataset(ds, seed=3))
            in_loader.append(ids(list(loader)))
    for got in (alone, in_loader):
        assert set(got[0]).isdisjoint(got[1]) and sorted(got[0] + got[1]) == list(range(N_IMAGES))
    assert alone == in_loader


def test_token_budget_built_before_the_rank_is_known(data: Data) -> None:
    """Built in a LightningModule's `__init__` (no rank yet), iterated once torchrun's rank exists:
    each rank gets its own share, and `len()` counts its batches."""
    ds = data["tokens"]
    got = []
    for rank in range(2):
        sampler = TokenBudgetBatchSampler.from_dataset(ds, MAX_TOKENS, seed=5)
        loader = Loader(ds, batch_sampler=sampler, collate_fn=TextCollate())
        with launcher_env(rank, 2):
            batches = list(loader)
            assert sampler.world_size == 2 and len(batches) == len(sampler.plan(0))
            got.append(ids(batches))
    assert set(got[0]).isdisjoint(got[1]) and sorted(got[0] + got[1]) == list(range(N_TOKENS))


def test_token_budget_takes_the_loaders_explicit_rank_for_len(data: Data) -> None:
    ds = data["tokens"]
    sampler = TokenBudgetBatchSampler.from_dataset(ds, MAX_TOKENS, seed=5)
    loader = Loader(ds, batch_sampler=sampler, rank=1, world_size=2)
    assert len(loader) == len(sampler.plan(0)) and sampler.rank == 1
    assert ids(list(loader)) == [int(i) for step in sampler.plan(0) for i in step[1].tolist()]


def test_a_sampler_inside_torchs_batch_sampler_is_bound(data: Data) -> None:
    ds = data["images"]
    inner = ShardWindowSampler.from_dataset(ds, seed=3)
    wrapped = Loader(ds, batch_sampler=BatchSampler(inner, 4, False), rank=1, world_size=2)
    direct = Loader(ds, batch_size=4, sampler=ShardWindowSampler.from_dataset(ds, seed=3), rank=1, world_size=2)
    for _ in range(2):  # epochs driven by iter() alone
        assert ids(list(wrapped)) == ids(list(direct))
    assert (inner.rank, inner.world_size, inner.epoch) == (1, 2, 1)


@pytest.mark.parametrize("make", [
    lambda ds: ShardWindowSampler.from_dataset(ds, rank=0, world_size=2),
    lambda ds: ShardWindowSampler.from_dataset(ds, world_size=4),
    lambda ds: TokenBudgetBatchSampler.from_dataset(ds, 4096, field="image", rank=1, world_size=2),
])
def test_a_sampler_rank_contradicting_the_loaders_raises(make: Any, data: Data) -> None:
    ds = data["images"]
    sampler = make(ds)
    key = "batch_sampler" if isinstance(sampler, TokenBudgetBatchSampler) else "sampler"
    args = {key: sampler} if key == "batch_sampler" else {"sampler": sampler, "batch_size": 4}
    loader = Loader(ds, rank=1 if isinstance(sampler, ShardWindowSampler) else 0, world_size=2, **args)
    with pytest.raises(ValueError, match=r"was built with .*world size 2") as err:
        iter(loader)
    assert type(sampler).__name__ in str(err.value) and "runs rank" in str(err.value)


def test_explicit_sampler_ranks_beside_a_single_process_loader(data: Data) -> None:
    """Simulating the ranks of a larger world in one process (a Loader of rank 0 of 1): the
    sampler's own arguments apply."""
    ds = data["images"]
    halves = [ids(list(Loader(ds, batch_size=4, sampler=ShardWindowSampler.from_dataset(ds, rank=r, world_size=2))))
              for r in range(2)]
    assert set(halves[0]).isdisjoint(halves[1]) and sorted(halves[0] + halves[1]) == list(range(N_IMAGES))


@settings(max_examples=40, deadline=None)
@given(
    rank_arg=st.none() | st.integers(0, 3),
    world_arg=st.none() | st.integers(1, 4),
    run=st.integers(1, 4).flatmap(lambda w: st.tuples(st.integers(0, w - 1), st.just(w))),
)
def test_run_rank_rule(rank_arg: int | None, world_arg: int | None, run: tuple[int, int]) -> None:
    """Given arguments win; the rest comes from the Loader's run; a given value that differs from a
    run of several processes raises, naming both; against a run of one process the arguments
    resolve as they would alone (no launcher environment here)."""
    if rank_arg is not None and world_arg is not None and rank_arg >= world_arg:
        with pytest.raises(ValueError):
            RunRank(rank_arg, world_arg, owner="S")
        return
    r, w = run
    if w > 1:
        differs = (rank_arg is not None and rank_arg != r) or (world_arg is not None and world_arg != w)
        expected: tuple[int, int] | None = None if differs else (r, w)
    elif rank_arg is None and world_arg is None:
        expected = (r, w)
    else:
        world = world_arg if world_arg is not None else 1
        rank = rank_arg if rank_arg is not None else (0 if world == 1 else world)  # no rank known: invalid
        expected = (rank, world) if rank < world else None
    ranks = RunRank(rank_arg, world_arg, owner="S")
    if expected is None:
        message = f"S was built with .*, but the Loader holding it runs rank {r} of world size {w}" if w > 1 else "rank"
        with pytest.raises(ValueError, match=message):
            ranks.bind(r, w)
    else:
        ranks.bind(r, w)
        assert ranks.get() == expected


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32), epoch=st.integers(0, 5), stop=st.integers(0, 5), world=st.sampled_from([1, 2]))
def test_resume_anywhere_reproduces_the_pixels(seed: int, epoch: int, stop: int, world: int, data: Data) -> None:
    """Seeded order + ImagePreset: a resume after any number of batches of any epoch gives the rest
    of that epoch bit for bit, for each rank."""
    ds = data["images"]

    def make(rank: int) -> Loader:
        return Loader(ds, batch_size=BATCH, shuffle=True, seed=seed, rank=rank, world_size=world,
                      transform=ImagePreset(kind="train", size=8, backend="cpu"))

    for rank in range(world):
        full = make(rank)
        full.set_epoch(epoch)
        want = list(full)
        first = make(rank)
        first.set_epoch(epoch)
        it = iter(first)
        head = [next(it) for _ in range(min(stop, len(want) - 1))]  # at the last batch the epoch is over
        again = make(rank)
        again.load_state_dict(first.state_dict())
        assert [canonical(b) for b in head + list(again)] == [canonical(b) for b in want]


def test_persistent_process_workers_follow_the_epochs(data: Data) -> None:
    """Persistent worker processes keep their copy of the transform: the run each task carries
    reaches it, so every epoch's crops equal those of 0 workers."""
    ds = data["images"]

    def epochs(**kw: Any) -> list[list[list[tuple[Any, ...]]]]:
        loader = Loader(ds, batch_size=BATCH, shuffle=True, seed=2, transform=ImagePreset(size=8, backend="cpu"), **kw)
        return [[canonical(b) for b in loader] for _ in range(3)]

    inline = epochs()
    assert inline[0] != inline[1] != inline[2]
    assert epochs(num_workers=2, worker_type="process", persistent_workers=True) == inline


def test_torch_sampler_resume_in_another_process_state_of_the_rng(data: Data) -> None:
    """Torch's sampler (no seed): the run seed the augmentation uses is derived from torch's seed
    once and saved in the state, so a fresh Loader under another global seed resumes the pixels."""
    ds = data["images"]

    def make() -> Loader:
        return Loader(ds, batch_size=BATCH, shuffle=True, transform=ImagePreset(size=8, backend="cpu"))

    torch.manual_seed(5)
    full = make()
    assert full.run.seed == 5
    want = list(full)
    torch.manual_seed(5)
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(2)]
    state = first.state_dict()
    assert state["run_seed"] == 5
    torch.manual_seed(6)
    again = make()
    again.load_state_dict(state)
    assert again.run.seed == 5
    assert [canonical(b) for b in head + list(again)] == [canonical(b) for b in want]


def test_distributed_sampler_epochs_follow_iter_unless_the_loop_sets_them(data: Data) -> None:
    ds = data["images"]
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=1)
    loader = Loader(ds, batch_size=4, sampler=sampler)
    for e in range(3):  # iter() alone: the Loader hands the epoch over
        list(loader)
        assert sampler.epoch == e
    loop = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=1)
    own = Loader(ds, batch_size=4, sampler=loop)
    for e in (10, 11, 12):  # torch's recipe with its own numbering: not overruled
        loop.set_epoch(e)
        list(own)
        assert loop.epoch == e


# --8<-- [start:user-component]
class RandomNoise:
    """A transform adding noise keyed by (run seed, epoch, sample index): the same on any worker
    and after a resume, new every epoch."""

    def __init__(self) -> None:
        self.seed = 0
        self.batches = 0

    def bind_run(self, run: RunContext) -> None:  # fastload.run.RunAware
        self.seed = run.seed

    def component_stats(self) -> dict[str, int]:  # fastload.run.StatsReporter
        return {"batches": self.batches}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        ctx = current_batch()  # this batch's run and dataset indices (None outside a Loader's fetch)
        assert ctx is not None, "RandomNoise runs as a Loader's transform"
        noise = [np.random.default_rng([self.seed, ctx.run.epoch, int(i)]).random() for i in ctx.indices]
        self.batches += 1
        return {**batch, "noise": torch.tensor(noise, dtype=torch.float64)}
# --8<-- [end:user-component]


@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "worker_type": "thread"},
                                     {"num_workers": 2, "worker_type": "process"}])
def test_a_user_component_implements_the_protocol(workers: dict[str, Any], data: Data) -> None:
    ds = data["tokens"]
    noise = RandomNoise()
    assert isinstance(noise, RunAware)
    loader = Loader(ds, batch_size=BATCH, shuffle=True, seed=4, collate_fn=BatchViews(), transform=noise, **workers)
    epochs = []
    for e in range(2):
        by_sample = {int(i): float(x) for b in loader for i, x in zip(b["label"], b["noise"], strict=True)}
        want = {i: np.random.default_rng([4, e, i]).random() for i in range(N_TOKENS)}
        assert by_sample == want
        epochs.append(by_sample)
    assert epochs[0] != epochs[1]
    assert loader.stats()["components"]["transform"] == {"batches": 0 if workers.get("worker_type") == "process"
                                                         else 2 * N_TOKENS // BATCH}


class _Forwarding:
    """A wrapper that reaches its inner component's methods only through `__getattr__` (as
    `LoaderCollate` and `with_indices` do)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, batch: Any) -> Any:
        return self.inner(batch)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_component_behind_a_forwarding_wrapper_is_bound_and_reported(data: Data) -> None:
    """The Loader binds, counts and describes a component it reaches through a wrapper's
    `__getattr__`, on every Python (`isinstance` against a runtime-checkable protocol skips
    `__getattr__` from Python 3.12 on)."""
    ds = data["tokens"]
    noise = RandomNoise()
    wrapped = _Forwarding(noise)
    assert implements(wrapped, RunAware) and implements(wrapped, StatsReporter)
    assert not implements(_Forwarding(object()), RunAware)
    bind_components([wrapped], RunContext(seed=9, epoch=3, rank=0, world_size=1, num_workers=0))
    assert noise.seed == 9
    loader = Loader(ds, batch_size=BATCH, shuffle=True, seed=4, collate_fn=BatchViews(), transform=wrapped)
    by_sample = {int(i): float(x) for b in loader for i, x in zip(b["label"], b["noise"], strict=True)}
    assert by_sample == {i: np.random.default_rng([4, 0, i]).random() for i in range(N_TOKENS)}
    assert collect_component_stats({"transform": wrapped}) == {"transform": {"batches": N_TOKENS // BATCH}}
    assert loader.stats()["components"]["transform"] == {"batches": N_TOKENS // BATCH}


def test_every_fastload_component_is_run_aware(data: Data) -> None:
    ds = data["tokens"]
    components = [ImagePreset(backend="cpu"), TextCollate(), BatchViews(),
                  ShardWindowSampler.from_dataset(ds), TokenBudgetBatchSampler.from_dataset(ds, MAX_TOKENS)]
    run = RunContext(seed=3, epoch=2, rank=0, world_size=1, num_workers=0)
    for c in components:
        assert isinstance(c, RunAware)
        c.bind_run(run)
    preset, text, views, window, budget = components
    assert (preset.epoch, preset.loader_workers, preset.threads) == (2, 0, 1)
    assert text.run == run and views.run == run and window.epoch == 2 and budget.epoch == 2


@pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI not installed")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (nvJPEG)"))])
def test_dali_and_cpu_backends_apply_the_same_windows(device: str, data: Data) -> None:
    """DALI (its CPU operators, or nvJPEG on a GPU) and the CPU decoder on a Loader: the same
    crops and flips each epoch (pixels within the decoders' rounding), other ones the next epoch."""
    ds = data["images"]

    def epochs(backend: str, on: str) -> list[torch.Tensor]:
        preset = ImagePreset(kind="train", size=16, backend=backend, dct_downscale=False, dtype=torch.float32,
                             mean=(0, 0, 0), std=(1, 1, 1), threads=1, device=on)
        loader = Loader(ds, batch_size=BATCH, transform=preset)
        return [torch.cat([b["image"].cpu() for b in loader]) for _ in range(2)]

    cpu, dali = epochs("cpu", "cpu"), epochs("dali", device)
    tolerance = 1.5 if device == "cpu" else 3.0  # tests/test_vision.py's MEAN_ABS_TOL, MIXED_MEAN_ABS_TOL
    for e in range(2):
        assert float((cpu[e] - dali[e]).abs().mean()) < tolerance
    assert float((cpu[0] - cpu[1]).abs().mean()) > 10
