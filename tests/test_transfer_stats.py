"""The remote path's stage counters and the rule for how many whole-shard GETs stay in flight."""

from __future__ import annotations

import threading
import time

import pytest

from fastload.remote.get import BYTES_IN_FLIGHT, MAX_GETS, gets_in_flight
from fastload.remote.transfer_stats import TransferStats

MB = 1 << 20


def test_gets_in_flight_follows_shard_size_and_budget():
    assert gets_in_flight(32 * MB, 10_000 * MB) == BYTES_IN_FLIGHT // (32 * MB) == 8
    assert gets_in_flight(1 * MB, 10_000 * MB) == MAX_GETS  # small shards: capped
    assert gets_in_flight(1024 * MB, 100_000 * MB) == 2  # huge shards: still two
    assert gets_in_flight(32 * MB, 6 * 32 * MB) == 4  # the budget holds 6: two stay for the reader
    assert gets_in_flight(32 * MB, 2 * 32 * MB) == 1  # never none


def test_in_flight_gauge_mean_and_max(monkeypatch):
    from types import SimpleNamespace

    from fastload.remote import transfer_stats

    st = TransferStats()
    gate, inside = threading.Event(), threading.Barrier(3)

    def one() -> None:
        with st.get(10):
            inside.wait()
            gate.wait()

    threads = [threading.Thread(target=one) for _ in range(2)]  # from two threads: both counted at once
    for t in threads:
        t.start()
    inside.wait()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join()
    st.add_many(write_s=0.5, bytes=20)
    snap = st.snapshot("remote_")
    assert snap["remote_gets_in_flight_max"] == 2 and snap["remote_bytes_in_flight_max"] == 20
    assert 1.0 < snap["remote_gets_in_flight_mean"] <= 2.0  # both outstanding for part of the busy time
    assert snap["remote_get_busy_s"] >= 0.05 and snap["remote_write_s"] == 0.5 and snap["remote_bytes"] == 20
    st.reset()
    assert st.snapshot()["gets_in_flight_max"] == 0 and st.snapshot()["bytes"] == 0
    clock = SimpleNamespace(now=100.0)  # the mean, exactly: GETs outstanding weighted by time
    monkeypatch.setattr(transfer_stats, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    with st.get(10):  # one from 100.00
        clock.now = 100.01
        with st.get(30):  # two from 100.01 to 100.11
            clock.now = 100.11
        clock.now = 100.12  # one to 100.12
    clock.now = 105.0  # idle time is not busy time
    snap = st.snapshot()
    assert snap["get_busy_s"] == pytest.approx(0.12) and snap["gets_in_flight_max"] == 2
    assert snap["gets_in_flight_mean"] == pytest.approx((0.01 + 2 * 0.10 + 0.01) / 0.12)
    assert snap["bytes_in_flight_max"] == 40


def _drive(window, rate_at) -> list[int]:
    """Finish GETs one after another, each turn receiving `rate_at(target)` bytes/s; the targets seen."""
    now, received, seen = 0.0, 0, []
    for _ in range(100):
        now += 0.1
        received += int(rate_at(window.target) * 0.1)
        seen.append(window.finished(now=now, received=received))
    return seen


def test_get_window_doubles_while_it_pays_then_undoes_the_step_that_did_not():
    from fastload.remote.get_window import GetWindow

    w = GetWindow(start=2, ceiling=16)
    seen = _drive(w, lambda k: min(k, 4) * 100e6)  # each GET 100 MB/s, the link full at 4
    assert seen[0] == 2 and 4 in seen and 8 in seen and seen[-1] == 4 and w.settled
    st = w.stats()
    assert st["gets_target"] == 4 and st["gets_settled"] == 1
    assert [round(st[f"gets_MBps_at_{k}"]) for k in (2, 4, 8)] == [200, 400, 400]


def test_get_window_stays_at_two_on_a_full_link_and_climbs_to_the_ceiling_on_a_slow_store():
    from fastload.remote.get_window import GetWindow

    lan = GetWindow(start=2, ceiling=16)
    assert set(_drive(lan, lambda k: 1e9)) == {2, 4} and lan.target == 2 and lan.settled
    store = GetWindow(start=2, ceiling=16)
    assert _drive(store, lambda k: k * 50e6)[-1] == 16 and store.settled  # 50 MB/s per GET, never full
    assert GetWindow(start=2, ceiling=1).target == 1  # the cache budget's bound wins
    fixed = GetWindow(start=2, ceiling=6, adaptive=False)  # `fetch_threads=6`: six, no search
    assert set(_drive(fixed, lambda k: 1e9)) == {6} and fixed.stats()["gets_target"] == 6


def test_get_window_starts_at_half_its_ceiling_and_stays_there_on_a_link_that_fills():
    """Two GETs leave the cores that receive and write them idle: the window starts at half its bound
    (at least 2), climbs from there while that pays, and stays where a full link puts it."""
    from fastload.remote.get_window import GetWindow

    assert [GetWindow(ceiling=c).target for c in (1, 2, 3, 9, 16)] == [1, 2, 2, 4, 8]
    full = GetWindow(ceiling=16)
    assert set(_drive(full, lambda k: min(k, 4) * 100e6)) == {8, 16} and full.target == 8 and full.settled
    slow = GetWindow(ceiling=16)
    assert _drive(slow, lambda k: k * 50e6)[-1] == 16 and slow.settled
