"""`GetWindow`: how many whole-shard GETs a `RemoteStorage` keeps in flight, chosen from measured throughput.

GETs in flight share the link, so each extra one delays the shard the reader needs next: with 8
GETs of equal shards in flight, the first needed shard arrives when all 8 do. GETs also share the
cores that receive, verify and write them, and too few leave those idle: each GET alternates between
receiving and writing, so two of them do not keep two cores busy. The window therefore starts at
half its `ceiling` (`start`, at least 2) and doubles while doubling raises the received throughput
by at least `gain` (25%); the first doubling that does not pay off is undone and the window settles
there. A store that serves each connection slowly (object stores: tens of MB/s per GET) climbs to
the `ceiling` (`gets_in_flight`: a fast link's bandwidth-delay product, within the cache budget); a
link that the starting GETs already fill (a server on the LAN) stays there.

Throughput at a window size is measured over `TURNS` (2) whole turns of the window: from the first
GET that finishes at this size to the `2 x size`-th after it, as body bytes received over that time
(`received` counts every byte as it arrives, so GETs still running are counted too). Two turns and
a 25% bar keep a machine's load swings (which move one turn's throughput by tens of percent) from
passing for a gain.
"""

from __future__ import annotations

import threading

__all__ = ["TURNS", "GetWindow"]

TURNS = 2  # window turns measured at each size


class GetWindow:
    """The adaptive GET count from `start` (default: half the `ceiling`, at least 2) up to `ceiling`
    (fixed at `ceiling` when `adaptive` is False)."""

    def __init__(self, *, ceiling: int, start: int | None = None, adaptive: bool = True, gain: float = 1.25) -> None:
        self.ceiling = max(1, int(ceiling))
        first = max(2, self.ceiling // 2) if start is None else max(1, int(start))
        self.target = self.ceiling if not adaptive else min(first, self.ceiling)
        self.gain = gain
        self.settled = self.target >= self.ceiling
        self.tried: dict[int, float] = {}  # window size -> bytes/s measured at that size
        self._lock = threading.Lock()
        self._mark: tuple[float, int] | None = None  # (time, bytes received) at the measurement's start
        self._done = 0  # GETs finished since the mark

    def finished(self, *, now: float, received: int) -> int:
        """One GET finished at `now` with `received` body bytes received in all so far; returns the target."""
        with self._lock:
            if self.settled:
                return self.target
            if self._mark is None:
                self._mark, self._done = (now, received), 0
                return self.target
            self._done += 1
            if self._done < TURNS * self.target or now <= self._mark[0]:
                return self.target
            rate = (received - self._mark[1]) / (now - self._mark[0])
            self._decide(rate)
            self._mark = None
            return self.target

    def _decide(self, rate: float) -> None:
        smaller = [k for k in self.tried if k < self.target]
        before = self.tried[max(smaller)] if smaller else 0.0
        self.tried[self.target] = rate
        if smaller and rate < self.gain * before:
            self.target, self.settled = max(smaller), True  # more GETs did not pay: undo the last step
        elif self.target >= self.ceiling:
            self.settled = True
        else:
            self.target = min(self.ceiling, 2 * self.target)

    def stats(self) -> dict[str, float]:
        """`gets_target` (GETs kept in flight now), `gets_settled` (1 when the search ended), and
        `gets_MBps_at_<k>`: the throughput measured with k GETs in flight, for each k tried."""
        with self._lock:
            out = {"gets_target": float(self.target), "gets_settled": float(self.settled)}
            out.update({f"gets_MBps_at_{k}": v / 1e6 for k, v in sorted(self.tried.items())})
        return out
