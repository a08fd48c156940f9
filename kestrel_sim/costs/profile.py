"""Stage costs fitted to a measured Profile.

Per stage, a least-squares fit of

    ms = f(T) + g(T) * b*c        (T = b*M new tokens, c = context per sequence)

where f and g are piecewise linear in T with a knot at every measured T: f captures the
bend from memory-bound to compute-bound, g the KV read per cached token (which depends on
the batch: attention kernels change shape with it). When the measurements cannot pin a g
per knot, one constant g = a is fitted, plus `e` per (new token x cached token) where the
data separate it.

Context terms are fitted only from context the measurements actually vary (two or more
contexts at one (b, M)), and never negative: more cached tokens do not make a step
faster. A target stage measured at one context only (e.g. verify at c = 128 over b and
M) takes its KV-read slope from the profile's `decode` fit at the same number of
sequences: every target forward reads the same KV per cached token. Without that rule a
fit reads batch effects at fixed T as a (negative) context slope.

Above a stage's largest measured T, f continues to the profile's `prefill` curve where
prefill was measured at larger T (a target forward of T tokens costs about the same
whatever the stage), and along its last segment beyond that. Below the smallest measured
T, f is clamped. A `correction` step (one token per sequence through the target) is
priced as `decode` when the profile has no correction measurements. A stage the scenario
needs but the profile lacks is a ConfigError naming the stage and the file.

Mixed steps (a decode or verify step of T = b*M tokens carrying a prefill chunk of P
tokens in one forward) are not measured; they are priced as the step alone plus the
chunk's marginal cost along the prefill curve,

    marginal = f_prefill(T' + P) - f_prefill(T') + the chunk's own KV-context terms,
    T' = max(T, smallest measured prefill T),

i.e. what P more tokens add to a forward that already reads the weights. Starting at
T' rather than T keeps it conservative: f is clamped below its first knot and gets
steeper with T (memory-bound, then compute-bound), so a higher start never underprices.
The result is kept between max(step alone, chunk alone) and step alone + chunk alone.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from kestrel_sim.costs.base import Chunk
from kestrel_sim.errors import ConfigError
from kestrel_sim.profile import Profile

TARGET_STAGES = ("prefill", "verify", "correction", "decode")


def _hats(t: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """[len(t), len(knots)] piecewise-linear basis: column j is 1 at knot j, 0 at the others."""
    hats = np.zeros((len(t), len(knots)))
    if len(knots) == 1:
        hats[:, 0] = 1.0
        return hats
    for j, k in enumerate(knots):
        if j > 0:
            left = knots[j - 1]
            sel = (t >= left) & (t <= k)
            hats[sel, j] = (t[sel] - left) / (k - left)
        if j + 1 < len(knots):
            right = knots[j + 1]
            sel = (t >= k) & (t <= right)
            hats[sel, j] = (right - t[sel]) / (right - k)
    return hats


def _varies_context(b: np.ndarray, m: np.ndarray, c: np.ndarray) -> bool:
    """True where some (b, M) pair was measured at two or more contexts."""
    seen: dict[tuple[float, float], float] = {}
    for bi, mi, ci in zip(b.tolist(), m.tolist(), c.tolist()):
        if seen.setdefault((bi, mi), ci) != ci:
            return True
    return False


def _interp(ks: list[float], vs: list[float], t: float) -> float:
    """Piecewise linear through (ks, vs): clamped below, along the last segment above."""
    if len(ks) == 1 or t <= ks[0]:
        return vs[0]
    i = min(bisect_right(ks, t), len(ks) - 1)
    return vs[i - 1] + (vs[i] - vs[i - 1]) * (t - ks[i - 1]) / (ks[i] - ks[i - 1])


def _lstsq(columns: list[np.ndarray], ms: np.ndarray) -> np.ndarray | None:
    """Least-squares coefficients, or None when the columns are not independent."""
    design = np.column_stack(columns)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    return np.linalg.lstsq(design, ms, rcond=None)[0]


class _StageFit:
    __slots__ = ("a", "borrow", "e", "floor", "knots", "own", "slopes", "values")

    def __init__(self, rows: list[tuple[int, int, int, float]], borrow: _StageFit | None = None):
        """`borrow`: a fit (decode's) whose KV slope this stage takes if its rows do not
        vary the context."""
        b, m, c, ms = (np.array(col, dtype=float) for col in zip(*rows))
        t = b * m
        knots = np.unique(t)
        hats = _hats(t, knots)
        n = len(knots)
        self.slopes: list[float] | None = None  # g per knot
        self.a = self.e = 0.0
        self.borrow: _StageFit | None = None  # decode's fit, for a stage without context data
        self.floor = float(ms.min()) * 0.1
        coef = None
        varies = _varies_context(b, m, c)
        if not varies and borrow is not None and borrow.fits_context:
            self.borrow = borrow
            ms = ms - np.array([self.kv_slope(bi, bi) * bi * ci for bi, ci in zip(b, c)])
        elif varies:
            coef = _lstsq([hats, hats * (b * c)[:, None]], ms)
            if coef is not None and (coef[n:] >= 0).all():
                self.slopes = [float(v) for v in coef[n:]]
            else:
                coef = self._constant_terms(hats, {"a": b * c, "e": b * m * c}, ms)
        if coef is None:
            coef = _lstsq([hats], ms)
        self.own = [float(k) for k in knots]  # measured T (g lives on these)
        self.knots = list(self.own)  # f's knots, maybe extended by the prefill curve
        self.values = [float(v) for v in coef[:n]]

    def _constant_terms(self, hats, extra: dict[str, np.ndarray], ms) -> np.ndarray | None:
        """Fit f plus constant a and e, dropping terms the data cannot separate or that
        come out negative; sets self.a / self.e."""
        names = list(extra)
        while names:
            kept: list[str] = []
            for name in names:
                if _lstsq([hats] + [extra[x] for x in (*kept, name)], ms) is not None:
                    kept.append(name)
            coef = _lstsq([hats] + [extra[x] for x in kept], ms)
            rest = dict(zip(kept, coef[hats.shape[1]:]))
            negative = [k for k, v in rest.items() if v < 0]
            if not negative:
                self.a, self.e = float(rest.get("a", 0.0)), float(rest.get("e", 0.0))
                return coef
            names = [k for k in names if k not in negative]
        return None

    @property
    def fits_context(self) -> bool:
        return self.slopes is not None or self.a > 0 or self.e > 0

    def extend(self, other: _StageFit) -> None:
        """Continue f to `other`'s knots above this fit's largest measured T."""
        top = self.knots[-1]
        for k, v in zip(other.knots, other.values):
            if k > top:
                self.knots.append(k)
                self.values.append(v)

    def kv_slope(self, batch: float, t: float) -> float:
        """ms per (sequence x cached token) for a step of `batch` sequences, T = t."""
        if self.borrow is not None:
            return self.borrow.kv_slope(batch, batch)  # decode: T = batch
        if self.slopes is not None:
            ks = self.own
            return _interp(ks, self.slopes, min(max(t, ks[0]), ks[-1]))
        return self.a

    def curve(self, t: float) -> float:
        """f(T): ms of a forward of T new tokens, before context terms."""
        return _interp(self.knots, self.values, t)

    def context_ms(self, batch: float, t: float, context: float) -> float:
        """ms the step's cached context adds (`batch` sequences, T = t, `context` each)."""
        return self.kv_slope(batch, t) * batch * context + self.e * t * context

    def ms(self, batch: int, m: float, context: float) -> float:
        t = batch * m
        return max(self.floor, self.curve(t) + self.context_ms(batch, t, context))


class ProfileCost:
    """Seconds per step interpolated from a Profile's measurements."""

    __slots__ = ("_fallback", "_fits", "path")

    def __init__(self, profile: Profile, path: str = "<profile>", fallback=None,
                 stages: tuple[str, ...] | None = None):
        self.path = path
        self._fallback = fallback  # a StageCost for stages the profile lacks, or None
        rows: dict[str, list] = {}
        for mm in profile.measurements:
            if stages is not None and mm.stage not in stages:
                continue  # e.g. a draft model's costs: only the `draft` rows are its own
            rows.setdefault(mm.stage, []).append((mm.batch, mm.tokens_per_seq, mm.context, mm.ms))
        decode = _StageFit(rows["decode"]) if "decode" in rows else None
        self._fits = {
            stage: decode if stage == "decode" else _StageFit(
                r, borrow=decode if stage in TARGET_STAGES else None)
            for stage, r in rows.items()
        }
        prefill = self._fits.get("prefill")
        for stage, fit in self._fits.items():
            if stage in TARGET_STAGES and prefill is not None and fit is not prefill:
                fit.extend(prefill)
        if "correction" not in self._fits and "decode" in self._fits:
            self._fits["correction"] = self._fits["decode"]

    def has(self, stage: str) -> bool:
        return stage in self._fits

    def require(self, stages) -> None:
        missing = [s for s in stages if s not in self._fits]
        if missing:
            raise ConfigError(
                f"profile {self.path} has no measurements for stage(s) {', '.join(missing)}, "
                f"which this scenario needs (it has: {', '.join(sorted(self._fits))})"
            )

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        fit = self._fits.get(stage)
        if fit is None:
            if self._fallback is not None:
                return self._fallback.seconds(stage, batch, m, context)
            self.require([stage])
        return fit.ms(batch, m, context) * 1e-3

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float,
                      chunk: Chunk) -> float:
        """A `stage` step carrying a prefill chunk: see the module docstring."""
        fit, pre = self._fits.get(stage), self._fits.get("prefill")
        if fit is None or pre is None:
            self.require([stage, "prefill"])
        alone = fit.ms(batch, m, context)
        chunk_alone = pre.ms(chunk.batch, chunk.m, chunk.context)
        p = chunk.tokens
        start = max(batch * m, pre.own[0])
        marginal = max(0.0, pre.curve(start + p) - pre.curve(start)
                       + pre.context_ms(chunk.batch, p, chunk.context))
        ms = min(alone + chunk_alone, max(alone + marginal, chunk_alone))
        return ms * 1e-3
