"""The interleaving law of contention: two streams on one GPU take turns at kernel grain.

On the H200, a decode step beside a looping prefill chunk slowed far past the bound of
contention.py's shares model (kernels one at a time: f <= 1 + busy share of the other):
qwen3-8b's decode of 4 sequences took 4.5x its time beside a 2048-token chunk. Its many
small kernels each wait behind the other stream's large ones, so the slowdown grows with how
long the other's step is against its own:

    f_i = 1 + sum_{j != i} a_s (T_j / T_i) ** b_s

T the steps' times alone (a step of several, as a speculative round's draft steps: one
step's), s the side of step i (decode-like, prefill or draft: contention.py), a and b
fitted per side to a profile's overlap rows (least squares of log(f - 1) on
log(T_j / T_i)). A law may also be kept for a side beside one other side ("prefill/draft":
a prefill chunk beside the draft's steps, which slow it far less than a verify does):
`law_for` picks the most particular law a table holds, falling back to the side's own and
the draft's to the decode side's. contention.fit_contention keeps whichever law, this or the shares model,
predicts the rows better when each is left out of its fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_EXCESS = 1e-3  # f - 1 floor: a row that did not slow says little about the law's shape
FALLBACK = {"draft": "decode"}  # a side without a law of its own takes this side's


def law_for(table: dict, side: str, other: str = ""):
    """The entry of `table` (side or "side/other" -> law) that prices a step of `side`
    beside one of `other`: "side/other", else the side's own, else its FALLBACK's."""
    for key in (f"{side}/{other}", side, FALLBACK.get(side, side)):
        if key in table:
            return table[key]
    raise KeyError(f"no contention law for side {side!r}")


@dataclass(frozen=True)
class Ratio:
    """f = 1 + a (T_other / T_self) ** b for one side."""

    a: float
    b: float

    def excess(self, own_s: float, other_s: float) -> float:
        if own_s <= 0.0:
            return 0.0
        return self.a * (other_s / own_s) ** self.b


def fit_ratio(pairs: list[tuple[float, float, float]]) -> Ratio | None:
    """Ratio fitted to (own time, other's time, observed f) pairs; None where they cannot
    tell (fewer than two, or one ratio of times)."""
    xs, ys = [], []
    for own, other, f in pairs:
        if own > 0.0 and other > 0.0:
            xs.append(math.log(other / own))
            ys.append(math.log(max(f - 1.0, MIN_EXCESS)))
    if len(xs) < 2 or max(xs) - min(xs) < 1e-9:
        return None
    a = np.column_stack([np.ones(len(xs)), xs])
    (log_a, b), *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    return Ratio(float(math.exp(log_a)), float(b))


def ratio_slowdowns(times: list[float], sides: list[str], laws: dict[str, Ratio]
                    ) -> list[float]:
    """f_i of every active step (see the module docstring)."""
    if len(times) == 1:
        return [1.0]
    out = []
    for i, (own, side) in enumerate(zip(times, sides)):
        out.append(1.0 + sum(law_for(laws, side, sides[j]).excess(own, other)
                             for j, other in enumerate(times) if j != i))
    return out
