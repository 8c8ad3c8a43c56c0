"""`IndexShuffle`: a keyed pseudorandom bijection on `[0, n)`, computed per position.

The i-th element of a shuffled epoch is `IndexShuffle(n, seed=s, epoch=e)(i)`: a function of
(seed, epoch, n, i) alone, in O(1) time and memory per position, so a rank (or a worker) maps
exactly the positions of its own next batches and never materializes the epoch's permutation.
Like Grain's `index_shuffle` and `tf.random_index_shuffle`, it is a Feistel network with cycle
walking, here over a mixed-radix domain rather than a power of two:

* the domain is `[0, a*b)` with `a = ceil(sqrt(n))`, `b = ceil(n/a)`, so `n <= a*b < n + a`; a
  value is the pair (`hi`, `lo`) = divmod(x, b); `ROUNDS` alternating rounds add to one half,
  modulo its radix, a keyed hash of the other (multiply-xorshift-multiply with splitmix64's
  constants, its high bits scaled to the radix), so each round, and the
  network, is a bijection of the domain whatever the hash (the numeral Feistel of Black and
  Rogaway's "FE2");
* cycle walking: a value that lands at or past `n` is mapped again until it falls in `[0, n)`,
  which restricts the domain's bijection to `[0, n)` (the walk follows the value's cycle back
  into `[0, n)`). Fewer than `a` ~ sqrt(n) of the domain's values lie outside, so a position
  walks with probability below 1/sqrt(n) (a power-of-two domain walks half the time).

The round keys come from `numpy.random.SeedSequence([seed, epoch, stream, tag])`. Everything is
vectorized over an array of positions; the walk loops only over the positions still outside.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ROUNDS", "IndexShuffle", "index_shuffle"]

ROUNDS = 8  # alternating half-rounds: 4 full Feistel rounds (Luby-Rackoff's strong PRP needs 4)
_TAG = 0x1D5F_5EED  # separates these keys from other uses of (seed, epoch) (e.g. workers' seeds)
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's mixer
_M2 = np.uint64(0x94D049BB133111EB)
_S29, _S32 = np.uint64(29), np.uint64(32)
_SMALL_RADIX = np.uint64(1 << 20)  # radixes up to this (n up to 2**40) map a hash to [0, m) with a bias <= 2**-12
_U64 = (1 << 64) - 1
_CHUNK = 1 << 15  # positions mapped per pass (their temporaries stay in the CPU caches)


class IndexShuffle:
    """The bijection of `[0, n)` for (seed, epoch, stream): `shuffle(positions) -> indices`,
    `shuffle.inverse(indices) -> positions` (int64 arrays, any shape)."""

    __slots__ = ("_a", "_b", "_keys", "n")

    def __init__(self, n: int, *, seed: int, epoch: int = 0, stream: int = 0) -> None:
        n = int(n)
        if n < 1:
            raise ValueError(f"an index shuffle needs n >= 1 elements, got n={n}")
        if n > 1 << 62:
            raise ValueError(f"n={n} is past the index shuffle's 2**62 elements")
        self.n = n
        a = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
        self._a, self._b = np.uint64(a), np.uint64(-(-n // a))
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
            mapped = self._network(x[a : a + _CHUNK].astype(np.uint64), inverse)
            walk = np.flatnonzero(mapped >= self.n)
            while walk.size:  # cycle walking, over the values still outside [0, n) only
                again = self._network(mapped[walk], inverse)
                mapped[walk] = again
                walk = walk[again >= self.n]
            u[a : a + _CHUNK] = mapped
        return out.reshape(shape)

    def _network(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        """The Feistel network (or its inverse) on domain values `x` (uint64): a new array."""
        a, b = self._a, self._b
        hi, lo = np.divmod(x, b)
        rounds = range(ROUNDS - 1, -1, -1) if inverse else range(ROUNDS)
        t, u = np.empty_like(x), np.empty_like(x)
        for r in rounds:
            # even rounds: hi = hi +- F(lo) mod a; odd rounds: lo = lo +- F(hi) mod b
            src, dst, m = (lo, hi, a) if r % 2 == 0 else (hi, lo, b)
            np.bitwise_xor(src, self._keys[r], out=t)
            t *= _M1
            t ^= t >> _S29
            t *= _M2
            if m <= _SMALL_RADIX:  # the high 32 bits scaled to [0, m): no division
                t >>= _S32
                t *= m
                t >>= _S32
            else:
                t %= m
            # dst +- t modulo m without a division: of the two candidates, the one that did not wrap
            if inverse:
                dst -= t
                np.add(dst, m, out=u)
            else:
                dst += t
                np.subtract(dst, m, out=u)
            np.minimum(dst, u, out=dst)
        hi *= b
        hi += lo
        return hi


def index_shuffle(positions: np.ndarray | int, *, n: int, seed: int, epoch: int = 0) -> np.ndarray:
    """`IndexShuffle(n, seed=seed, epoch=epoch)(positions)`."""
    return IndexShuffle(n, seed=seed, epoch=epoch)(positions)
