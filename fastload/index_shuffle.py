"""`IndexShuffle`: a keyed pseudorandom bijection on `[0, n)`, computed per position.

The i-th element of a shuffled epoch is `IndexShuffle(n, seed=s, epoch=e)(i)`: a function of
(seed, epoch, n, i) alone, in O(1) time and memory per position, so a rank (or a worker) maps
exactly the positions of its own next batches and never materializes the epoch's permutation.
Like Grain's `index_shuffle` and `tf.random_index_shuffle`, it is a Feistel network over the
bit-width of `n` with cycle walking:

* the domain is `[0, 2**k)` with `k = max(2, bit_length(n - 1))`, split into a high half of
  `ceil(k/2)` bits and a low half of `floor(k/2)` bits; `ROUNDS` alternating rounds xor one half
  with a keyed hash of the other (each round is its own inverse, so the network is a bijection
  of the domain whatever the hash);
* cycle walking: a value that lands at or past `n` is mapped again until it falls in `[0, n)`.
  That restricts the domain's bijection to `[0, n)` (the walk follows the permutation's cycle
  back into `[0, n)`); since `2**k < 2n`, at most half the domain is outside, so a position
  walks twice on average.

The round keys come from `numpy.random.SeedSequence([seed, epoch, stream, tag])`. Everything is
vectorized over an array of positions; the walk loops only over the positions still outside.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "IndexShuffle", "index_shuffle"]

ROUNDS = 8  # alternating half-rounds: 4 full Feistel rounds (Luby-Rackoff's strong PRP needs 4)
_TAG = 0x1D5F_5EED  # separates these keys from other uses of (seed, epoch) (e.g. workers' seeds)
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's multipliers
_M2 = np.uint64(0x94D049BB133111EB)
_U64 = (1 << 64) - 1
_CHUNK = 1 << 15  # positions mapped per pass (their temporaries stay in the CPU caches)


class IndexShuffle:
    """The bijection of `[0, n)` for (seed, epoch, stream): `shuffle(positions) -> indices`,
    `shuffle.inverse(indices) -> positions` (int64 arrays, any shape)."""

    __slots__ = ("_hi_bits", "_keys", "_lo_bits", "_lo_mask", "n")

    def __init__(self, n: int, *, seed: int, epoch: int = 0, stream: int = 0) -> None:
        n = int(n)
        if n < 1:
            raise ValueError(f"an index shuffle needs n >= 1 elements, got n={n}")
        if n > 1 << 62:
            raise ValueError(f"n={n} is past the index shuffle's 2**62 elements")
        self.n = n
        k = max(2, (n - 1).bit_length())
        self._hi_bits, self._lo_bits = k - k // 2, k // 2
        self._lo_mask = np.uint64((1 << self._lo_bits) - 1)
        entropy = [int(seed) & _U64, int(epoch) & _U64, int(stream) & _U64, _TAG]
        self._keys = [np.uint64(v) for v in np.random.SeedSequence(entropy).generate_state(ROUNDS, np.uint64)]

    def __repr__(self) -> str:
        return f"IndexShuffle(n={self.n})"

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        """The indices at `positions` (each in `[0, n)`)."""
        return self._walk(positions, inverse=False)

    def inverse(self, indices: np.ndarray | int) -> np.ndarray:
        """The positions of `indices`: `shuffle.inverse(shuffle(p)) == p`."""
        return self._walk(indices, inverse=True)

    # ---- internals
    def _walk(self, values: np.ndarray | int, *, inverse: bool) -> np.ndarray:
        x = np.asarray(values)
        if x.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got dtype {x.dtype}")
        shape = x.shape
        x = x.reshape(-1)
        out = np.empty(x.size, dtype=np.int64)
        if x.size == 0:
            return out.reshape(shape)
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi >= self.n:
            bad = lo if lo < 0 else hi
            raise IndexError(f"position {bad} is outside [0, {self.n}) of this index shuffle")
        u = out.view(np.uint64)
        for a in range(0, x.size, _CHUNK):
            part = x[a : a + _CHUNK].astype(np.uint64)
            mapped = self._network(part, inverse)
            walk = np.flatnonzero(mapped >= self.n)
            while walk.size:  # cycle walking, over the values still outside [0, n) only
                again = self._network(mapped[walk], inverse)
                mapped[walk] = again
                walk = walk[again >= self.n]
            u[a : a + _CHUNK] = mapped
        return out.reshape(shape)

    def _network(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        """The Feistel network (or its inverse) on domain values `x` (uint64): a new array."""
        lo_bits, hi_bits = self._lo_bits, self._hi_bits
        hi = x >> lo_bits
        lo = x & self._lo_mask
        rounds = range(ROUNDS - 1, -1, -1) if inverse else range(ROUNDS)
        t = np.empty_like(x)
        for r in rounds:
            # even rounds: hi ^= F(lo); odd rounds: lo ^= F(hi). Each is an involution.
            src, dst, bits = (lo, hi, hi_bits) if r % 2 == 0 else (hi, lo, lo_bits)
            np.bitwise_xor(src, self._keys[r], out=t)
            t *= _M1
            t ^= t >> np.uint64(31)
            t *= _M2
            t >>= np.uint64(64 - bits)  # the best-mixed high bits
            dst ^= t
        hi <<= np.uint64(lo_bits)
        hi |= lo
        return hi


def index_shuffle(positions: np.ndarray | int, *, n: int, seed: int, epoch: int = 0) -> np.ndarray:
    """`IndexShuffle(n, seed=seed, epoch=epoch)(positions)`."""
    return IndexShuffle(n, seed=seed, epoch=epoch)(positions)
