"""`get_state()` / `set_state()` (Grain's names) on the Loader and the shipped samplers: the same state
as torch's `state_dict()` / `load_state_dict()`, an exact resume, and a wrong version refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from index_data import IdxDS

from fastload.loader import Loader
from fastload.order.bucketing import TokenBudgetBatchSampler
from fastload.order.position import ORDER_VERSION
from fastload.order.shard_shuffle import ShardWindowSampler

pytestmark = pytest.mark.timeout(120)


def _ids(batch) -> list[int]:
    return (batch["i"] if isinstance(batch, dict) else batch).tolist()


def _seeded(n: int = 97, batch_size: int = 8, **kw) -> Loader:
    return Loader(IdxDS(n), batch_size=batch_size, shuffle=True, seed=3, num_workers=0, **kw)


def _torch_order(n: int = 97) -> Loader:
    return Loader(IdxDS(n), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=0)


def _token_sampler() -> TokenBudgetBatchSampler:
    lengths = np.random.default_rng(0).integers(1, 300, size=600)
    return TokenBudgetBatchSampler(lengths, max_tokens=2048, rank=1, world_size=2, seed=3)


def _window_sampler() -> ShardWindowSampler:
    return ShardWindowSampler([40, 25, 60, 10], window=2, seed=3, rank=1, world_size=2)


def _advance(obj, k: int) -> list:
    """The first `k` items of `obj`'s epoch (batch ids for a Loader), leaving it there."""
    it = iter(obj)
    return [_ids(next(it)) if isinstance(obj, Loader) else next(it) for _ in range(k)]


def _rest(obj) -> list:
    return [_ids(b) for b in obj] if isinstance(obj, Loader) else list(obj)


@pytest.mark.parametrize("make", [_seeded, _torch_order, _token_sampler, _window_sampler],
                         ids=["loader-seeded", "loader-torch-order", "token-budget", "shard-window"])
def test_both_names_save_and_load_the_same_state(make) -> None:
    obj = make()
    _advance(obj, 3)
    state = obj.get_state()
    assert obj.state_dict() == state
    by_grain, by_torch = make(), make()
    by_grain.set_state(state)
    by_torch.load_state_dict(state)
    assert by_grain.get_state() == by_torch.get_state() == by_torch.state_dict()
    assert _rest(by_grain) == _rest(by_torch) != []


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), batch_size=st.integers(1, 40), drop_last=st.booleans(), data=st.data())
def test_a_loader_resumes_exactly_through_get_state_and_set_state(n, batch_size, drop_last, data) -> None:
    def make() -> Loader:
        return _seeded(n, batch_size, drop_last=drop_last)

    uninterrupted = make()
    epoch0, epoch1 = _rest(uninterrupted), _rest(uninterrupted)
    stop = data.draw(st.integers(0, len(epoch0)), label="batches before the save")
    first = make()
    head = _advance(first, stop)
    resumed = make()
    resumed.set_state(first.get_state())
    # the rest of the saved epoch, then the next one (a state saved after an epoch's last batch starts the next)
    after = _rest(resumed) + (_rest(resumed) if stop < len(epoch0) else [])
    assert head + after == epoch0 + epoch1


@settings(max_examples=30, deadline=None)
@given(which=st.sampled_from(["token-budget", "shard-window"]), data=st.data())
def test_a_sampler_resumes_exactly_through_get_state_and_set_state(which, data) -> None:
    make = _token_sampler if which == "token-budget" else _window_sampler
    full = list(make())
    stop = data.draw(st.integers(0, len(full)), label="items before the save")
    first = make()
    head = _advance(first, stop)
    resumed = make()
    resumed.set_state(first.get_state())
    assert head + list(resumed) == full


def test_a_loader_state_of_another_version_is_refused_by_name() -> None:
    loader = _seeded()
    _advance(loader, 2)
    state = loader.get_state()
    with pytest.raises(ValueError, match=r"cannot resume the Loader: the state's 'version' is 2"):
        _seeded().set_state({**state, "version": 2})
    with pytest.raises(ValueError, match=r"the state's 'version' is None"):
        _seeded().load_state_dict({k: v for k, v in state.items() if k != "version"})
    old_order = {**state, "position": {**state["position"], "order": ORDER_VERSION - 1}}
    with pytest.raises(ValueError, match=rf"order is version {ORDER_VERSION - 1}, this fastload computes version"):
        _seeded().set_state(old_order)


@pytest.mark.parametrize("make, owner", [(_token_sampler, "TokenBudgetBatchSampler"),
                                         (_window_sampler, "ShardWindowSampler")])
def test_a_sampler_state_of_another_version_is_refused_by_name(make, owner) -> None:
    sampler = make()
    _advance(sampler, 2)
    state = sampler.get_state()
    with pytest.raises(ValueError, match=rf"cannot resume {owner}: the state's order is version 1"):
        make().set_state({**state, "order": 1})
    with pytest.raises(ValueError, match=rf"cannot resume {owner}: the state's order is version 7"):
        make().load_state_dict({**state, "order": 7})
