"""The remote path's stage counters and the rule for how many whole-shard GETs stay in flight."""

from __future__ import annotations

import threading
import time

from fastload.remote_get import BYTES_IN_FLIGHT, MAX_GETS, gets_in_flight
from fastload.transfer_stats import TransferStats

MB = 1 << 20


def test_gets_in_flight_follows_shard_size_and_budget():
    assert gets_in_flight(32 * MB, 10_000 * MB) == BYTES_IN_FLIGHT // (32 * MB) == 8
    assert gets_in_flight(1 * MB, 10_000 * MB) == MAX_GETS  # small shards: capped
    assert gets_in_flight(1024 * MB, 100_000 * MB) == 2  # huge shards: still two
    assert gets_in_flight(32 * MB, 6 * 32 * MB) == 4  # the budget holds 6: two stay for the reader
    assert gets_in_flight(32 * MB, 2 * 32 * MB) == 1  # never none


def test_in_flight_gauge_mean_and_max():
    st = TransferStats()
    gate, inside = threading.Event(), threading.Barrier(3)

    def one() -> None:
        with st.get(10):
            inside.wait()
            gate.wait()

    threads = [threading.Thread(target=one) for _ in range(2)]
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
    assert 1.5 < snap["remote_gets_in_flight_mean"] <= 2.0  # both outstanding for most of the busy time
    assert snap["remote_get_busy_s"] >= 0.05 and snap["remote_write_s"] == 0.5 and snap["remote_bytes"] == 20
    st.reset()
    assert st.snapshot()["gets_in_flight_max"] == 0 and st.snapshot()["bytes"] == 0
