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
the draft's to the decode side's.

b may be fitted per law, or once per family of laws (`fit_family`: decode-like steps,
"decode" and "draft"; prefill chunks, "prefill" and "prefill/draft"), a factor a per law:
how a step's slowdown grows with the other's length against its own is the interleaving
itself, which a step of the target and one of the draft share, and a law with few rows (the
draft's four in the default grid) borrows its exponent from the others'. On the H200
profiles of 2026-12-02 that took the rows' held-out median from 9.2% to 8.9% (bf16) and
from 9.0% to 7.7% (int4): `python -m kestrel_sim.costs.report PROFILE`.
contention.fit_contention keeps whichever law, this (either fit) or the shares model,
predicts the rows better when each is left out of its fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SIDES = ("decode", "prefill")  # every law has these; "draft", "prefill/draft" where fitted
PER_FAMILY = "interleave, one exponent per family"  # Contention.law_held_out's name
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


def family(key: str) -> str:
    """The kind of step a law's key slows: a prefill chunk ("prefill", "prefill/draft":
    few large kernels) or a decode-like step ("decode", "draft": many small ones)."""
    return "prefill" if key.split("/")[0] == "prefill" else "decode"


def fit_family(pairs: dict[str, list[tuple[float, float, float]]]) -> dict[str, Ratio] | None:
    """Ratio per key of one family with ONE exponent b for all of them and a factor a per
    key: least squares of log(f - 1) on a key's log a + b log(T_other / T). How a step's
    slowdown grows with the other's length against its own is the interleaving itself
    (small kernels waiting behind large ones), which a step of the target and one of the
    draft share; how much each waits (a) is the step's own. A key with one row then has a
    law; None where the rows cannot tell b (one ratio of times in all)."""
    keys = [k for k, rows in pairs.items() if any(o > 0 and t > 0 for t, o, _ in rows)]
    xs, ys, cols = [], [], []
    for i, key in enumerate(keys):
        for own, other, f in pairs[key]:
            if own > 0.0 and other > 0.0:
                xs.append(math.log(other / own))
                ys.append(math.log(max(f - 1.0, MIN_EXCESS)))
                cols.append(i)
    spread = [max(x for x, c in zip(xs, cols) if c == i) - min(x for x, c in zip(xs, cols)
                                                                if c == i)
              for i in range(len(keys))]
    if not keys or max(spread) < 1e-9:  # b shows only within a key's rows
        return None
    a = np.zeros((len(xs), len(keys) + 1))  # [rows, keys + 1]: one-hot log a, then x
    a[np.arange(len(xs)), cols] = 1.0
    a[:, -1] = xs
    sol, *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    if not np.isfinite(sol).all():
        return None
    return {key: Ratio(float(math.exp(sol[i])), float(sol[-1])) for i, key in enumerate(keys)}


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


def family_laws(rows) -> dict[str, Ratio]:
    """The law of every key with overlap rows (contention.OverlapRow), one exponent per
    family (fit_family); a side without rows of its own takes the fit of all rows, as
    contention.fit_keyed gives it."""
    laws: dict[str, Ratio] = {}
    for fam in ("decode", "prefill"):
        pairs: dict[str, list] = {}
        for r in rows:
            if family(r.key) == fam:
                pairs.setdefault(r.key, []).append(r.pair())
        laws.update(fit_family(pairs) or {})
    pooled = fit_ratio([r.pair() for r in rows])
    for side in SIDES:
        if side not in laws and pooled is not None:
            laws[side] = pooled
    return laws


def fit_interleave_family(rows) -> tuple[dict[str, Ratio] | None, list[tuple[str, float]]]:
    """family_laws of overlap rows, and each row's (key, |error| %) when left out of the
    whole fit, priced by the law its step takes (law_for); (None, []) where the rows do not
    price both steps' times or leave a side without a law."""
    if not rows or any(r.timed_ms <= 0 or r.other_ms <= 0 for r in rows):
        return None, []
    laws = family_laws(rows)
    if any(side not in laws for side in SIDES):
        return None, []
    held = []
    for i, r in enumerate(rows):
        rest = family_laws([q for j, q in enumerate(rows) if j != i])
        if any(k in rest for k in (f"{r.side}/{r.other_side}", r.side, FALLBACK.get(r.side))):
            law = law_for(rest, r.side, r.other_side)
            f = 1.0 + law.excess(r.timed_ms, r.other_ms)
            held.append((r.key, abs(f / r.observed - 1) * 100))
    return laws, held
