"""`EpochPosition`: the one state shape the shipped samplers save, read back exactly or refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.order.bucketing import TokenBudgetBatchSampler
from fastload.order.position import ORDER_VERSION, EpochPosition
from fastload.order.shard_shuffle import ShardWindowSampler

_settings = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k != "world_size"),
    st.one_of(st.integers(), st.booleans(), st.text(max_size=8), st.none()),
    max_size=5,
)


@st.composite
def _positions(draw: st.DrawFn) -> EpochPosition:
    world = draw(st.integers(1, 4096))
    return EpochPosition(
        epoch=draw(st.integers(0, 10**6)),
        consumed=draw(st.integers(0, 10**12)),
        rank=draw(st.integers(0, world - 1)),
        world_size=world,
        settings=draw(_settings),
        cursor=tuple(draw(st.lists(st.integers(0, 10**9), max_size=3))),
    )


@settings(deadline=None)  # pure and fast, but a loaded CI machine can pause any example past 200 ms
@given(_positions())
def test_a_position_round_trips_through_its_state(pos: EpochPosition) -> None:
    state = pos.get_state()
    assert state["order"] == ORDER_VERSION
    back = EpochPosition.from_state(state, owner="test", world_size=pos.world_size, settings=pos.settings)
    assert back == pos
    assert back.get_state() == state


def test_a_wrong_version_or_mismatched_setting_is_refused_by_name() -> None:
    pos = EpochPosition(3, 5, 1, 4, {"seed": 7, "window": 2}, (1, 2))
    state = pos.get_state()
    read = lambda s, **kw: EpochPosition.from_state(  # noqa: E731
        s, owner="X", world_size=kw.get("world_size", 4), settings=kw.get("settings", pos.settings))
    with pytest.raises(ValueError, match=r"cannot resume X: the state's order is version 1"):
        read({**state, "order": 1})
    with pytest.raises(ValueError, match=r"version 1"):
        read({k: v for k, v in state.items() if k != "order"})
    with pytest.raises(ValueError, match=r"window: saved 2, now 3"):
        read(state, settings={"seed": 7, "window": 3})
    with pytest.raises(ValueError, match=r"world_size: saved 4, now 8"):
        read(state, world_size=8)
    with pytest.raises(ValueError, match=r"seed: saved 7, now 8.*window: saved 2, now 1"):
        read(state, settings={"seed": 8, "window": 1})
    for field, bad in (("consumed", -1), ("epoch", "2"), ("cursor", [1, -2]), ("cursor", 3), ("settings", [1])):
        with pytest.raises(ValueError, match=field):
            read({**state, field: bad})


def test_both_samplers_save_the_shared_shape_and_refuse_another_world() -> None:
    lengths = np.random.default_rng(0).integers(1, 300, size=500)
    token = TokenBudgetBatchSampler(lengths, max_tokens=2048, rank=1, world_size=2, seed=3)
    window = ShardWindowSampler([40, 25, 60, 10], window=2, seed=3, rank=1, world_size=2)
    for sampler, owner in ((token, "TokenBudgetBatchSampler"), (window, "ShardWindowSampler")):
        it = iter(sampler)
        for _ in range(3):
            next(it)
        state = sampler.state_dict()
        assert set(state) == {"order", "epoch", "consumed", "rank", "world_size", "cursor", "settings"}
        assert state["consumed"] == 3 and state["rank"] == 1 and state["world_size"] == 2
        saved = EpochPosition.from_state(state, owner=owner, world_size=2, settings=state["settings"])
        assert saved == sampler.position
        with pytest.raises(ValueError, match=rf"cannot resume {owner}: .*world_size: saved 2, now 4"):
            _other_world(sampler).load_state_dict(state)


def _other_world(sampler: TokenBudgetBatchSampler | ShardWindowSampler) -> TokenBudgetBatchSampler | ShardWindowSampler:
    if isinstance(sampler, TokenBudgetBatchSampler):
        return TokenBudgetBatchSampler(sampler.lengths, max_tokens=2048, rank=1, world_size=4, seed=3)
    return ShardWindowSampler([40, 25, 60, 10], window=2, seed=3, rank=1, world_size=4)


def test_a_flat_state_still_resumes_exactly() -> None:
    """The flat form (settings beside the position, `order_version`) resumes like the shared shape."""
    lengths = np.random.default_rng(1).integers(1, 300, size=800)
    kw = {"max_tokens": 2048, "rank": 0, "world_size": 2, "seed": 5}
    full = TokenBudgetBatchSampler(lengths, **kw)
    expected = list(full)
    first = TokenBudgetBatchSampler(lengths, **kw)
    it = iter(first)
    head = [next(it) for _ in range(4)]
    new = first.state_dict()
    flat = {**new["settings"], "order_version": ORDER_VERSION, "world_size": 2, "rank": 0, "epoch": 0,
            "batches_yielded": new["consumed"], "at": new["cursor"]}
    resumed = TokenBudgetBatchSampler(lengths, **kw)
    resumed.load_state_dict(flat)
    assert head + list(resumed) == expected

    sizes = [40, 25, 60, 10]
    full_w = list(ShardWindowSampler(sizes, window=2, seed=5, rank=1, world_size=2))
    part = ShardWindowSampler(sizes, window=2, seed=5, rank=1, world_size=2)
    it_w = iter(part)
    head_w = [next(it_w) for _ in range(9)]
    new = part.state_dict()
    flat = {**new["settings"], "order_version": ORDER_VERSION, "world_size": 2, "rank": 1, "epoch": 0,
            "consumed": 9}
    again = ShardWindowSampler(sizes, window=2, seed=5, rank=1, world_size=2)
    again.load_state_dict(flat)
    assert head_w + list(again) == full_w
    with pytest.raises(ValueError, match="window: saved 2, now 3"):
        ShardWindowSampler(sizes, window=3, seed=5, rank=1, world_size=2).load_state_dict(flat)
