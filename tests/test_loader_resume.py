"""Seeded orders, rank splits and exact mid-epoch resume of `fastload.Loader`."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from index_data import IdxDS
from probe_clock import use_step_clock
from torch.utils.data import DataLoader, DistributedSampler

from fastload.loader import Loader
from fastload.order.sampling import epoch_permutation, rank_indices, resolve_rank_world

pytestmark = pytest.mark.timeout(120)


class DirectIdxDS(IdxDS):
    """IdxDS on the Loader's direct path (`direct_takes`, `direct_plan`): its seeded order is
    planned, so the rank's whole epoch is computed at once and the next one ahead."""

    def direct_takes(self, gather=None) -> list:
        return [("i", lambda idx: np.array(idx, dtype=np.int64))]

    def direct_plan(self, indices, *, max_bytes=None) -> list | None:
        if max_bytes is not None and len(indices) * 8 > max_bytes:
            return None
        return [("i", np.array(indices, dtype=np.int64), None)]

    def direct_read(self, indices) -> None:
        return None  # it has takes: never asked


class PyDS(IdxDS):
    """Per-sample `__getitem__` only (generic path)."""

    get_batch = None  # type: ignore[assignment]


def ids(batch) -> list[int]:
    return (batch["i"] if isinstance(batch, dict) else batch).tolist()


def run(loader, epochs=1) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        out += [ids(b) for b in loader]
    return out


def interrupted(make, stop_after: int, epochs: int = 2) -> tuple[list[list[int]], list[list[int]]]:
    """(uninterrupted batches, batches before the stop + batches after resuming in a new loader)."""
    full = run(make(), epochs)
    first = make()
    seen: list[list[int]] = []
    it = iter(first)
    for _ in range(stop_after):
        seen.append(ids(next(it)))
    state = first.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)  # checkpointable
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    del it, first
    second = make()
    second.load_state_dict(state)
    rest = run(second, epochs - state["epoch"])
    return full, seen + rest


WORKERS = [(0, "auto"), (2, "thread"), (2, "process")]


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("stop_after", [0, 3, 10, 11])
def test_seeded_resume_is_exact(workers, stop_after):
    nw, wt = workers

    def make():
        return Loader(IdxDS(), batch_size=10, shuffle=True, seed=11, num_workers=nw, worker_type=wt)

    full, resumed = interrupted(make, stop_after)
    assert resumed == full


@pytest.mark.parametrize("workers", [(0, "auto"), (2, "process")])
def test_torch_order_resume_with_generator(workers):
    nw, wt = workers

    def make():
        return Loader(PyDS(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(9),
                      num_workers=nw, worker_type=wt)

    full, resumed = interrupted(make, 5)
    assert resumed == full
    assert full[:13] == run(DataLoader(PyDS(), batch_size=8, shuffle=True,
                                       generator=torch.Generator().manual_seed(9)))


def test_torch_order_resume_with_global_rng():
    torch.manual_seed(1)
    loader = Loader(PyDS(), batch_size=8, shuffle=True)
    it = iter(loader)
    head = [ids(next(it)) for _ in range(4)]
    rest_uninterrupted = [ids(b) for b in it]
    # checkpoint taken after 4 batches of a fresh, identically seeded run
    torch.manual_seed(1)
    a = Loader(PyDS(), batch_size=8, shuffle=True)
    it = iter(a)
    assert [ids(next(it)) for _ in range(4)] == head
    state = a.state_dict()
    torch.manual_seed(12345)  # a different global RNG when resuming
    b = Loader(PyDS(), batch_size=8, shuffle=True)
    b.load_state_dict(state)
    assert [ids(x) for x in b] == rest_uninterrupted


def test_state_at_epoch_end_starts_next_epoch():
    make = lambda: Loader(IdxDS(), batch_size=10, shuffle=True, seed=3)  # noqa: E731
    a = make()
    first = run(a)
    state = a.state_dict()
    assert state["epoch"] == 1 and state["batches_yielded"] == 0
    b = make()
    b.load_state_dict(state)
    second = run(b)
    assert second != first and sorted(i for b in second for i in b) == list(range(103))
    assert second == run(make(), 2)[len(first):]


@pytest.mark.parametrize("workers", [(0, "auto"), (2, "thread")])
def test_state_after_leaving_an_epoch_early_and_setting_the_next(workers):
    """An epoch left after 3 batches, then `set_epoch(5)`: the state is epoch 5 from its start (not
    the abandoned epoch's position), also once the loader is closed; a resume yields all of epoch 5."""
    nw, kind = workers
    make = lambda: Loader(IdxDS(), batch_size=10, shuffle=True, seed=3, num_workers=nw, worker_type=kind)  # noqa: E731
    a = make()
    it = iter(a)
    for _ in range(3):
        next(it)
    assert a.state_dict()["batches_yielded"] == 3
    a.set_epoch(5)
    state = a.state_dict()
    assert state["epoch"] == 5 and state["batches_yielded"] == 0
    a.close()
    assert a.state_dict()["batches_yielded"] == 0
    b = make()
    b.load_state_dict(state)
    reference = make()
    reference.set_epoch(5)
    assert run(b) == run(reference)


class StatefulBatchSampler:
    """A batch sampler with its own state (torchdata `Stateful` convention)."""

    def __init__(self, n: int, bs: int) -> None:
        self.n, self.bs, self.epoch, self.pos = n, bs, 0, 0
        self.calls: list[str] = []

    def set_epoch(self, e: int) -> None:
        self.calls.append(f"set_epoch({e})")
        self.epoch = e

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, d: dict) -> None:
        self.calls.append("load")
        self.epoch, self.pos = d["epoch"], d["pos"]

    def __len__(self) -> int:
        return -(-self.n // self.bs)

    def __iter__(self):
        order = np.random.default_rng(self.epoch).permutation(self.n)
        while self.pos < len(self):
            k = self.pos
            self.pos += 1
            yield order[k * self.bs : (k + 1) * self.bs].tolist()
        self.pos = 0


@pytest.mark.parametrize("workers", [(0, "auto"), (2, "thread")])
def test_stateful_batch_sampler_resumes_exactly(workers):
    nw, wt = workers

    def make():
        return Loader(IdxDS(50), batch_sampler=StatefulBatchSampler(50, 4), num_workers=nw, worker_type=wt)

    a = make()
    a.set_epoch(2)
    assert a.batch_sampler.calls == ["set_epoch(2)"]
    full = run(a)
    b = make()
    b.set_epoch(2)
    it = iter(b)
    head = [ids(next(it)) for _ in range(5)]  # the sampler has run ahead (prefetch)
    state = b.state_dict()
    assert state["position"]["sampler_state"] == {"epoch": 2, "pos": 5}
    c = make()
    c.load_state_dict(state)
    assert c.batch_sampler.calls[-1] == "set_epoch(2)"
    assert head + run(c) == full


def test_plain_sampler_is_fast_forwarded():
    order = list(np.random.default_rng(0).permutation(60))
    make = lambda: Loader(PyDS(60), batch_size=7, sampler=order)  # noqa: E731
    full, resumed = interrupted(make, 4, epochs=1)
    assert resumed == full


def test_set_epoch_reaches_distributed_sampler_like_torch():
    ds = PyDS(40)
    s1 = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
    s2 = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
    dl, fl = DataLoader(ds, batch_size=4, sampler=s1), Loader(ds, batch_size=4, sampler=s2)
    for e in range(2):
        s1.set_epoch(e)
        fl.set_epoch(e)
        assert run(dl) == run(fl)


def test_seeded_order_is_pure_and_changes_per_epoch():
    a = Loader(IdxDS(), batch_size=10, shuffle=True, seed=5)
    b = Loader(IdxDS(), batch_size=10, shuffle=True, seed=5)
    ea, eb = run(a, 2), run(b, 2)
    assert ea == eb
    assert ea[:11] != ea[11:]
    perm = epoch_permutation(103, seed=5, epoch=0, shuffle=True).tolist()
    assert ea[:11] == [sorted(perm[k : k + 10]) for k in range(0, 103, 10)]  # sorted inside a batch
    b.set_epoch(1)
    assert run(b) == ea[11:]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(-(2**40), 2**40), max_size=60)
    | st.lists(st.integers(0, 2**31 - 1), max_size=60)
    | st.lists(st.integers(-(2**31), 0), max_size=60),
    batch_size=st.integers(1, 9),
    world_size=st.integers(1, 3),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_rank_indices_sorts_each_batch_exactly_whatever_the_range(values, batch_size, world_size, drop_last, data):
    """Sorting narrows indices to int32 when they fit: same int64 result as sorting each batch."""
    order = np.array(values, dtype=np.int64)
    rank = data.draw(st.integers(0, world_size - 1))
    kw = dict(base=0, world_size=world_size, rank=rank, batch_size=batch_size, drop_last=drop_last)
    plain = rank_indices(order, **kw)
    got = rank_indices(order, sort=True, **kw)
    assert got.dtype == np.int64
    want = [np.sort(plain[k : k + batch_size]) for k in range(0, len(plain), batch_size)]
    assert got.tolist() == (np.concatenate(want).tolist() if want else [])


def test_next_epoch_order_is_computed_ahead_and_used_only_when_it_matches():
    """While epoch e runs, epoch e+1's indices are computed on a background thread; the epoch that
    then runs uses them only if it is that epoch from its start (set_epoch elsewhere, or a resume
    mid-epoch, computes its own)."""
    loader = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, order_ahead=True)
    fresh = _epoch_of
    first = run(loader)
    order = loader.order_stage
    assert order.ahead_pending == (1, 0, 0)
    assert run(loader) == fresh(1)  # taken from the background result
    assert order.ahead_pending == (2, 0, 0)
    loader.set_epoch(7)  # not the epoch computed ahead: computed on the spot, same batches
    assert run(loader) == fresh(7)
    assert order.ahead_pending == (8, 0, 0)
    assert first == fresh(0)
    # a resume two batches into epoch 1, on a loader that has epoch 1 from its start computed ahead
    other = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, order_ahead=True)
    it = iter(other)
    next(it), next(it)
    state = other.state_dict()  # epoch 0, two batches in
    resumed = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, order_ahead=True)
    run(resumed)
    assert resumed.order_stage.ahead_pending == (1, 0, 0)
    resumed.load_state_dict(state)
    assert run(resumed) == fresh(0)[2:]
    other.set_epoch(1)
    it = iter(other)
    next(it), next(it)
    state = other.state_dict()  # epoch 1, two batches in
    resumed.load_state_dict(state)
    assert resumed.order_stage.ahead_pending == (1, 0, 0)  # epoch 1 from its start: not what is asked now
    assert run(resumed) == fresh(1)[2:]
    assert resumed.order_stage.ahead_pending == (2, 0, 0)


def test_orders_larger_than_the_ahead_budget_are_computed_at_epoch_start(monkeypatch):
    import fastload.order.sampling

    monkeypatch.setattr(fastload.order.sampling, "AHEAD_MAX_BYTES", 8 * 102)  # DirectIdxDS() has 103 samples
    loader = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, order_ahead=True)
    assert run(loader) == _epoch_of(0) and loader.order_stage.ahead_pending is None
    assert run(loader) == _epoch_of(1) and loader.order_stage.ahead_pending is None


def _epoch_of(epoch: int) -> list[list[int]]:
    loader = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, order_ahead=False)
    loader.set_epoch(epoch)
    return run(loader)


@pytest.mark.parametrize(
    ("extra_cores", "workers", "worker_type", "expected"),
    [
        (1, 0, "thread", True),  # the direct path fetches on torch's intra-op threads: one core more is left over
        (0, 0, "thread", False),
        (2 - torch.get_num_threads(), 1, "thread", False),  # 2 cores: one worker and the stealing consumer fill both
        (4 - torch.get_num_threads(), 1, "thread", True),
    ],
)
def test_next_epoch_order_is_computed_ahead_by_default_only_when_a_core_is_left_over(
    monkeypatch, extra_cores, workers, worker_type, expected
):
    import fastload.pipeline.config

    cores = torch.get_num_threads() + extra_cores
    monkeypatch.setattr(fastload.pipeline.config, "usable_cores", lambda: cores)
    loader = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, num_workers=workers, worker_type=worker_type)
    assert run(loader) == _epoch_of(0)
    assert (loader.order_stage.ahead_pending == (1, 0, 0)) is expected
    assert run(loader) == _epoch_of(1)
    kw = {"num_workers": workers, "worker_type": worker_type}
    forced = Loader(DirectIdxDS(), batch_size=10, shuffle=True, seed=5, order_ahead=not expected, **kw)
    assert run(forced) == _epoch_of(0)
    assert (forced.order_stage.ahead_pending == (1, 0, 0)) is not expected


@pytest.mark.parametrize(("ds", "workers", "worker_type"), [(IdxDS, 0, "auto"), (DirectIdxDS, 2, "process")])
def test_unplanned_epochs_are_streamed_not_computed_ahead(ds, workers, worker_type):
    """Without an epoch plan (not the direct path, or batches fetched in other processes) the
    order maps each rank's positions as its batches are asked for: nothing to compute ahead."""
    loader = Loader(ds(), batch_size=10, shuffle=True, seed=5, order_ahead=True, num_workers=workers,
                    worker_type=worker_type)
    assert run(loader) == _epoch_of(0) and loader.order_stage.ahead_pending is None
    assert run(loader) == _epoch_of(1) and loader.order_stage.ahead_pending is None


def test_ahead_computes_one_value_per_key_and_recomputes_in_the_caller_on_error():
    import threading

    from fastload.order.ahead import Ahead

    calls, release = [], threading.Event()

    def slow(x):
        calls.append(x)
        release.wait(10)
        if x < 0:
            raise ValueError("bad")
        return x * 2

    ahead = Ahead()
    ahead.start("a", slow, 3)
    ahead.start("a", slow, 3)  # already pending: not started twice
    release.set()
    assert ahead.take("a") == 6 and calls == [3]
    assert ahead.take("a") is None  # taken once
    ahead.start("b", slow, 4)
    assert ahead.take("c") is None and ahead.pending is None  # another key: the stale value is dropped
    ahead.start("d", slow, -1)
    assert ahead.take("d") is None  # its error is the caller's to meet when it computes the value itself


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_ranks_partition_each_epoch(world, drop_last):
    n, bs = 103, 5
    per_rank = [run(Loader(IdxDS(n), batch_size=bs, shuffle=True, seed=2, rank=r, world_size=world,
                           drop_last=drop_last)) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # every rank gets the same number of batches
    assert len(per_rank[0]) == len(Loader(IdxDS(n), batch_size=bs, seed=2, world_size=world, rank=0,
                                          drop_last=drop_last))
    assert all(len(b) == bs for p in per_rank for b in p[:-1])
    if drop_last:
        assert all(len(p[-1]) == bs for p in per_rank)
    counts = Counter(i for p in per_rank for b in p for i in b)
    if drop_last:
        assert all(c == 1 for c in counts.values()) and len(counts) >= n - world * bs
    else:
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == (-n) % world  # padding repeats, as DistributedSampler does


def test_rank_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank_world(None, None) == (2, 3)
    assert resolve_rank_world(0, 2) == (0, 2)
    loader = Loader(IdxDS(30), batch_size=5, shuffle=False)
    assert loader.rank == 2 and loader.world_size == 3
    assert run(loader) == [[2, 5, 8, 11, 14], [17, 20, 23, 26, 29]]
    with pytest.raises(ValueError):
        resolve_rank_world(3, 3)


@pytest.mark.parametrize("new_world", [2, 3, 5])
def test_resume_with_other_world_size_redeals_the_rest(new_world):
    n, bs, world = 211, 4, 4
    before: list[int] = []
    states = []
    for r in range(world):
        loader = Loader(IdxDS(n), batch_size=bs, shuffle=True, seed=8, rank=r, world_size=world)
        it = iter(loader)
        for _ in range(6):
            before += ids(next(it))
        states.append(loader.state_dict())
    assert all(s["position"] == states[0]["position"] for s in states[1:])  # ranks advance in lockstep
    after: list[int] = []
    lens = set()
    for r in range(new_world):
        loader = Loader(IdxDS(n), batch_size=bs, shuffle=True, seed=8, rank=r, world_size=new_world)
        loader.load_state_dict(states[r % world])
        got = run(loader)
        lens.add(len(got))
        after += [i for b in got for i in b]
    assert len(lens) == 1
    counts = Counter(before + after)
    assert set(counts) == set(range(n))  # nothing lost
    assert len(before) == len(set(before)) and not set(before) & set(after)  # nothing seen twice
    assert sum(counts.values()) - n == (-(n - len(before))) % new_world  # only the final padding repeats


class _ProbedEpoch:
    """What `EpochIterator` does with the probe's answers: its in-flight depth follows them."""

    def __init__(self, probe, depth: int) -> None:
        self.probe, self.full_depth, self.depth = probe, depth, 0

    def attach(self, now: float) -> None:
        self.depth = self.full_depth if self.probe.attach(now) else 0

    def tick(self, now: float) -> None:
        self.depth = self.full_depth if self.probe.tick(now) else 0


def _probe_and_epoch(depth: int):
    from fastload.pipeline import ThreadProbe

    probe = ThreadProbe(depth=depth)
    return probe, _ProbedEpoch(probe, depth)


@pytest.mark.parametrize(("margin", "watch", "final", "switches"),
                         [(0.0, 10**9, "threads", 1), (0.0, 64, "inline", 2), (1e9, 64, "inline", 0)])
def test_thread_probe_switches_modes_without_changing_batches(monkeypatch, margin, watch, final, switches):
    from fastload.pipeline import ThreadProbe

    monkeypatch.setattr(ThreadProbe, "MARGIN", margin)  # 0: threads always win, 1e9: inline does
    monkeypatch.setattr(ThreadProbe, "WATCH", watch)  # margin 0 also makes the watch fall back to inline
    monkeypatch.setattr(ThreadProbe, "MIN_WINDOW_S", 0.0)  # windows by batch count only: this epoch is short
    monkeypatch.setattr(ThreadProbe, "WATCH_S", 0.0)
    monkeypatch.setattr(ThreadProbe, "FIRST_S", 0.0)  # the workers' trial as soon as inline's window is full
    monkeypatch.setattr(ThreadProbe, "RETRY_S", 1e9)  # no retry of the workers: switches are counted exactly
    use_step_clock(monkeypatch)  # the probe times batch counts: the same decisions however loaded the machine
    # 400 batches: room for inline's 24-batch window, the workers' 32-batch fill and 24-batch window,
    # and the 64-batch watch after it
    ref = run(Loader(IdxDS(4000), batch_size=10, shuffle=True, seed=4))
    loader = Loader(IdxDS(4000), batch_size=10, shuffle=True, seed=4, num_workers=2, worker_type="thread",
                    autotune=True)
    it = iter(loader)
    got = [ids(b) for b in it]
    assert got == ref
    assert it.probe.choice == final and it.probe.switches == switches
    # resume in the middle of the probe's inline window
    state = None
    loader = Loader(IdxDS(4000), batch_size=10, shuffle=True, seed=4, num_workers=2, worker_type="thread",
                    autotune=True)
    for k, _ in enumerate(loader):
        if k == 60:
            state = loader.state_dict()
            break
    again = Loader(IdxDS(4000), batch_size=10, shuffle=True, seed=4, num_workers=2, worker_type="thread", autotune=True)
    again.load_state_dict(state)
    assert run(again) == ref[61:]


@pytest.mark.parametrize("kw", [{}, {"autotune": False}])
def test_without_autotune_the_workers_stay_on(kw):
    """By default (or `autotune=False`): no probe, the thread
    workers' queue stays full (never the inline mode), same batches as 0 workers."""
    from fastload.workers import ThreadSource

    ref = run(Loader(IdxDS(2000), batch_size=10, shuffle=True, seed=4), epochs=2)
    loader = Loader(IdxDS(2000), batch_size=10, shuffle=True, seed=4, num_workers=2, worker_type="thread", **kw)
    it = iter(loader)
    assert it.probe is None and isinstance(it.source, ThreadSource) and it.depth == loader.config.depth > 0
    got = []
    for b in it:
        got.append(ids(b))
        assert it.depth == loader.config.depth
    assert got + run(loader) == ref


@pytest.mark.parametrize("threads_rate", [2000, 500])
def test_thread_probe_windows_go_on_across_short_epochs(threads_rate):
    """Epochs of 10 batches (shorter than any window) with a second of the user's code between
    them: the windows complete over several epochs, timed without the gaps, and decide as one
    long epoch would."""
    from fastload.pipeline import ThreadProbe

    probe, it = _probe_and_epoch(4)
    now, epochs = 0.0, 0
    while not probe.trials or probe.phase in ("fill", "threads"):  # until the first trial is decided
        it.attach(now)
        for _ in range(10):
            now += 1 / threads_rate if it.depth else 1e-3  # the workers' rate when they run, else inline's 1000/s
            it.tick(now)
        now += 1.0  # between epochs: not timed
        epochs += 1
        assert epochs < 100
    assert probe.rate_threads == pytest.approx(threads_rate)
    assert probe.rate_inline == pytest.approx(1000)
    assert probe.choice == ("threads" if threads_rate > 1000 else "inline")
    assert epochs > ThreadProbe.FILL // 10 + 3  # the windows did span several epochs


def test_thread_probe_counts_an_epoch_start_in_its_mode():
    """The time from an epoch's start to its first batch (its order, the queue refilling) is the
    running mode's cost; the time before the start is not counted."""

    probe, it = _probe_and_epoch(4)
    it.attach(0.0)
    assert probe.phase == "inline"
    now = 0.0
    for _ in range(5):  # 5 batches at 1 ms, then an epoch ends
        now += 1e-3
        it.tick(now)
    it.attach(now + 5.0)  # 5 s of the user's code, then the next epoch starts...
    now += 5.0 + 0.01  # ... and its first batch comes 10 ms later
    it.tick(now)
    assert probe.count == 6 and probe.before + probe.last - probe.t0 == pytest.approx(0.015)


def _until_phase_changes(probe, it, now: float, step: float) -> tuple[float, int]:
    """Deliver batches `step` seconds apart until the probe leaves its phase -> (time, batches)."""
    phase, ticks = probe.phase, 0
    while probe.phase == phase:
        now += step
        ticks += 1
        it.tick(now)
        assert ticks < 10**6
    return now, ticks


def test_thread_probe_retries_the_workers_after_choosing_inline():
    """Inline is chosen on a noisy comparison; the workers are tried again after RETRY_S (then after
    twice as long), measured against the inline stretch since the decision, and kept when faster."""
    from fastload.pipeline import ThreadProbe

    probe, it = _probe_and_epoch(4)
    it.attach(0.0)
    now, _ = _until_phase_changes(probe, it, 0.0, 1e-3)  # inline at 1000 batches/s until the first trial
    assert probe.phase == "fill" and it.depth == 4 and probe.rate_inline == pytest.approx(1000)
    now, ticks = _until_phase_changes(probe, it, now, 1e-3)
    assert probe.phase == "threads" and ticks == ThreadProbe.FILL  # warmed up before they are timed
    now, _ = _until_phase_changes(probe, it, now, 2e-3)  # the workers at 500/s (a slow stretch)
    assert (probe.phase, probe.choice, it.depth, probe.retries) == ("inline", "inline", 0, 0)
    decided = now
    now, ticks = _until_phase_changes(probe, it, now, ThreadProbe.RETRY_S / 200)
    assert now - decided >= ThreadProbe.RETRY_S > now - decided - ThreadProbe.RETRY_S / 200
    assert probe.phase == "fill" and it.depth == 4 and probe.retries == 1
    assert probe.rate_inline == pytest.approx(ticks / (now - decided))  # the whole inline stretch
    assert probe.retry_s == 2 * ThreadProbe.RETRY_S
    now, _ = _until_phase_changes(probe, it, now, 1e-3)
    now, _ = _until_phase_changes(probe, it, now, ThreadProbe.RETRY_S / 400)  # twice the inline stretch: kept
    assert (probe.phase, probe.choice, it.depth, probe.switches) == ("watch", "threads", 4, 1)


def test_thread_probe_backs_off_while_inline_keeps_winning():
    from fastload.pipeline import ThreadProbe

    probe, it = _probe_and_epoch(2)
    it.attach(0.0)
    now, _ = _until_phase_changes(probe, it, 0.0, 1e-3)  # inline until the first trial
    waits = []
    for _ in range(10):
        now, _ = _until_phase_changes(probe, it, now, 1e-2)  # fill
        now, _ = _until_phase_changes(probe, it, now, 1e-2)  # the workers 10x slower than inline
        assert (probe.phase, probe.choice, it.depth) == ("inline", "inline", 0)
        decided = now
        now, _ = _until_phase_changes(probe, it, now, 1e-3)
        waits.append(now - decided)
    assert probe.retries == 10 and probe.switches == 0
    expected = [min(ThreadProbe.RETRY_S * 2**k, ThreadProbe.RETRY_MAX_S) for k in range(10)]
    assert waits == pytest.approx(expected, abs=2e-3)


@pytest.mark.parametrize("workers", [1, 2])
def test_thread_probe_retrying_every_batch_keeps_batches_and_order(monkeypatch, workers):
    """Mode switches on every retry (RETRY_S 0: as often as possible) change neither the batches nor their order."""
    from fastload.pipeline import ThreadProbe

    monkeypatch.setattr(ThreadProbe, "MARGIN", 1e9)  # inline always wins, so the workers are retried again and again
    monkeypatch.setattr(ThreadProbe, "MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(ThreadProbe, "RETRY_S", 0.0)
    monkeypatch.setattr(ThreadProbe, "FIRST_S", 0.0)
    monkeypatch.setattr(ThreadProbe, "FILL", 2)
    ref = run(Loader(IdxDS(3000), batch_size=10, shuffle=True, seed=5), epochs=2)
    loader = Loader(IdxDS(3000), batch_size=10, shuffle=True, seed=5, num_workers=workers, worker_type="thread",
                    autotune=True)
    assert run(loader, epochs=2) == ref
    assert loader.autotune_probe.retries >= 3 and loader.autotune_probe.choice == "inline"


@pytest.mark.parametrize("threads_rate", [2000, 900, 500])
def test_thread_probe_order_of_windows(threads_rate):
    """Inline for FIRST_S (at least a window), the workers' fill, their window (as long as WINDOW
    inline batches took; cut after a third when they run `CLEAR_LOSS` slower), then the choice."""
    from fastload.pipeline import ThreadProbe

    probe, it = _probe_and_epoch(4)
    it.attach(0.0)
    assert (probe.phase, it.depth) == ("inline", 0)
    now, ticks = _until_phase_changes(probe, it, 0.0, 1e-3)
    assert ticks == max(ThreadProbe.WINDOW, round(ThreadProbe.FIRST_S / 1e-3), round(ThreadProbe.MIN_WINDOW_S / 1e-3))
    assert probe.rate_inline == pytest.approx(1000) and (probe.phase, it.depth, probe.trials) == ("fill", 4, 1)
    now, ticks = _until_phase_changes(probe, it, now, 1e-3)
    assert probe.phase == "threads" and ticks == ThreadProbe.FILL
    now, ticks = _until_phase_changes(probe, it, now, 1 / threads_rate)
    window = max(ThreadProbe.MIN_WINDOW_S, ThreadProbe.WINDOW / 1000)
    clearly = threads_rate * ThreadProbe.CLEAR_LOSS < 1000
    assert ticks == pytest.approx(threads_rate * window / (3 if clearly else 1), abs=1)
    assert probe.rate_threads == pytest.approx(threads_rate)
    if threads_rate > 1000 * ThreadProbe.MARGIN:
        assert (probe.phase, probe.choice, it.depth) == ("watch", "threads", 4)
    else:
        assert (probe.phase, probe.choice, it.depth) == ("inline", "inline", 0)
        assert probe.retry_at == pytest.approx(now + ThreadProbe.RETRY_S)


def test_a_run_shorter_than_first_s_never_starts_the_workers(monkeypatch):
    """An autotuned 2-worker Loader over a run shorter than FIRST_S reads inline throughout, as 0
    workers would: its worker threads are never started."""
    from fastload.pipeline import ThreadProbe

    monkeypatch.setattr(ThreadProbe, "FIRST_S", 1e9)  # however slow this machine: the run is shorter
    ref = run(Loader(IdxDS(2000), batch_size=10, shuffle=True, seed=4), epochs=2)
    loader = Loader(IdxDS(2000), batch_size=10, shuffle=True, seed=4, num_workers=2, worker_type="thread",
                    autotune=True)
    assert run(loader, epochs=2) == ref
    assert loader.autotune_probe.trials == 0 and loader.autotune_probe.choice == "inline"
    pool = loader.thread_pool
    assert pool is not None and not pool.started
