"""`IdxDS`: a map-style dataset whose sample i is i, with the batched protocol (`get_batch`), so every
worker kind and resume path applies; the tests of exact resume read orders off it."""

from __future__ import annotations

import numpy as np


class IdxDS:
    """Sample i is i; the batched protocol, so every worker kind applies."""

    def __init__(self, n: int = 103) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)

    def get_batch(self, idx) -> dict:
        return {"i": np.asarray(idx, dtype=np.int64)}
