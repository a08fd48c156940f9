"""Stage costs fitted to a measured Profile.

Per stage, a least-squares fit of

    ms = f(T) + a * b*c + e * b*M*c        (T = b*M new tokens, c = context per sequence)

where f is piecewise linear in T with a knot at every measured T (it captures the bend
from memory-bound to compute-bound), `a` the KV read per cached token and `e` the
attention work per (new token x cached token); a and e are dropped when the measurements
do not vary them independently. Below the smallest measured T, f is clamped; above the
largest, it continues along its last segment. A `correction` step (one token per
sequence through the target) is priced as `decode` when the profile has no correction
measurements. A stage the scenario needs but the profile lacks is a ConfigError naming
the stage and the file.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from kestrel_sim.errors import ConfigError
from kestrel_sim.profile import Profile


class _StageFit:
    __slots__ = ("a", "e", "floor", "knots", "values")

    def __init__(self, rows: list[tuple[int, int, int, float]]):
        b, m, c, ms = (np.array(col, dtype=float) for col in zip(*rows))
        t = b * m
        knots = np.unique(t)
        hats = np.zeros((len(t), len(knots)))
        for j, k in enumerate(knots):
            if len(knots) == 1:
                hats[:, j] = 1.0
                continue
            left = knots[j - 1] if j > 0 else None
            right = knots[j + 1] if j + 1 < len(knots) else None
            col = np.zeros(len(t))
            if left is not None:
                sel = (t >= left) & (t <= k)
                col[sel] = (t[sel] - left) / (k - left)
            if right is not None:
                sel = (t >= k) & (t <= right)
                col[sel] = (right - t[sel]) / (right - k)
            hats[:, j] = col
        cols = [hats]
        extra = []
        for name, x in (("a", b * c), ("e", b * m * c)):
            trial = np.column_stack(cols + [x])
            if np.linalg.matrix_rank(trial) == trial.shape[1]:
                cols.append(x[:, None])
                extra.append(name)
        design = np.column_stack(cols)
        coef, *_ = np.linalg.lstsq(design, ms, rcond=None)
        self.knots = [float(k) for k in knots]
        self.values = [float(v) for v in coef[: len(knots)]]
        rest = dict(zip(extra, coef[len(knots):]))
        self.a = float(rest.get("a", 0.0))
        self.e = float(rest.get("e", 0.0))
        self.floor = float(ms.min()) * 0.1

    def ms(self, batch: int, m: float, context: float) -> float:
        t = batch * m
        ks, vs = self.knots, self.values
        if len(ks) == 1 or t <= ks[0]:
            f = vs[0]
        else:
            i = min(bisect_right(ks, t), len(ks) - 1)
            f = vs[i - 1] + (vs[i] - vs[i - 1]) * (t - ks[i - 1]) / (ks[i] - ks[i - 1])
        y = f + self.a * batch * context + self.e * t * context
        return max(self.floor, y)


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
        self._fits = {stage: _StageFit(r) for stage, r in rows.items()}
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
