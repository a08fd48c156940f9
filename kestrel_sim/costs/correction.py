"""What a stage's physical terms miss at its measured points, interpolated between them.

Kernels change tiles and variants with the batch and the tokens per sequence (verify at
batch 16 is 3 ms slower at M = 9 than at M = 8 in the bundled qwen3-8b profile), which no
smooth term follows. The profile cost model adds back, in ms, the residual

    r_i = measured_i - physical_i

interpolated by inverse-distance weighting (power 2) in (log2 batch, log2 M[, log2 chunk
tokens]) at each measured context level, and linearly in context between the levels
(clamped outside them). At a measured point it returns that point's residual exactly;
between points a distance-weighted blend; far from all of them the blend of the nearest.
The result is kept at or above half the physical time.

Values are computed once per (batch, M[, chunk]) and kept (the simulator asks the same
few shapes over and over); the memo is emptied past MEMO_SIZE entries. A whole M up to 64
is looked up as itself; a larger or fractional one (a prefill's mean chunk per prompt) at
the nearest of 16 steps per octave (within 2.2%; powers of two exactly).
"""

from __future__ import annotations

from bisect import bisect_right
from math import log2

import numpy as np

MEMO_SIZE = 8192


def context_coord(c: float) -> float:
    return log2(1.0 + c / 128.0)


class Correction:
    __slots__ = ("_levels", "_memo", "_points", "_resid", "_values")

    def __init__(self, keys: np.ndarray, contexts: np.ndarray, resid_ms: np.ndarray):
        """keys: [n, d] (batch, M[, chunk tokens]) of each point; contexts: [n]; resid_ms: [n]."""
        self._levels = sorted(set(contexts.tolist()))
        ctx = np.array([context_coord(c) for c in contexts.tolist()])
        self._points = np.column_stack([np.log2(keys), ctx])  # [n, d + 1]
        self._resid = resid_ms
        self._memo: dict[tuple, list[float]] = {}  # key as asked -> values per level
        self._values: dict[tuple, list[float]] = {}  # key on the grid -> values per level

    def _at(self, point: np.ndarray) -> float:
        d2 = ((self._points - point) ** 2).sum(axis=1)  # [n]
        exact = d2 < 1e-18
        if exact.any():
            return float(self._resid[exact].mean())
        w = 1.0 / d2
        return float((w * self._resid).sum() / w.sum())

    def ms(self, key: tuple[float, ...], c: float) -> float:
        """Residual ms at `key` (batch, M[, chunk tokens]) and context c."""
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
                self._values.clear()
            grid_key = tuple(map(_on_grid, key))
            got = self._values.get(grid_key)
            if got is None:
                coords = [log2(v) for v in grid_key]
                got = self._values[grid_key] = [
                    self._at(np.array([*coords, context_coord(lv)])) for lv in self._levels]
            self._memo[key] = got
        levels, values = self._levels, got
        if len(levels) == 1 or c <= levels[0]:
            return values[0]
        if c >= levels[-1]:
            return values[-1]
        i = bisect_right(levels, c)
        c0, c1 = levels[i - 1], levels[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (c - c0) / (c1 - c0)


def _on_grid(v: float) -> float:
    """A whole number up to 64 as itself; any other value at the nearest of 16 steps per
    octave (the simulator's prefill steps carry a mean, fractional, tokens per prompt)."""
    if v <= 64 and v == int(v):
        return max(v, 1e-9)
    return 2.0 ** (round(log2(max(v, 1e-9)) * 16) / 16)
