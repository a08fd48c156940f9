"""Fitting the contention law (kestrel_sim/costs/contention.py) to a profile's overlap rows:
each law (the shares model's lam per side; the interleave law's a and b per law, or with one
exponent per family: interleave.py) fitted, each row's error taken with the row left out of
the fit, and the law that predicts the rows better held out kept.

    fitted = fit_contention(ProfileFits(profile).overlap_rows())   # a Contention
"""

from __future__ import annotations

import math

import numpy as np

from kestrel_sim.costs.contention import SIDES, Contention, OverlapRow, chain, predict
from kestrel_sim.costs.interleave import Ratio, family, fit_family, fit_ratio, law_for


def fit_serial(rows: list[OverlapRow]) -> float | None:
    """lam minimising the relative error of f = ideal + lam (serial - ideal) over `rows`,
    within 0..1; None where the rows cannot tell (both bounds equal on every row)."""
    num = den = 0.0
    for r in rows:
        ideal, serial = r.bounds()
        w = 1.0 / (r.observed * r.observed)
        num += w * (r.observed - ideal) * (serial - ideal)
        den += w * (serial - ideal) ** 2
    if den < 1e-12:
        return None
    return min(1.0, max(0.0, num / den))


def keys_of(rows: list[OverlapRow]) -> list[str]:
    """The laws a set of rows fits: the two sides', then those of the draft's rows."""
    return [*SIDES, *sorted({r.key for r in rows} - set(SIDES))]


def fit_keyed(rows: list[OverlapRow], fit) -> tuple[dict, dict[str, str]]:
    """`fit` (rows -> law or None) per key: a side of its own rows, else of all rows; a
    draft key of its own rows only (none: law_for falls back). (laws, how each came)."""
    laws, how = {}, {}
    pooled = fit(rows)
    for key in keys_of(rows):
        mine = [r for r in rows if r.key == key]
        law = fit(mine) if mine else None
        if law is not None:
            laws[key], how[key] = law, "fitted"
        elif key in SIDES and pooled is not None:
            laws[key], how[key] = pooled, "fitted on all rows (none of its own)"
    return laws, how


def held_out(rows: list[OverlapRow], fit, predict_row) -> list[tuple[str, float]]:
    """(key, |error| %) of each row left out of its fit, in row order: the law of the
    first key of its chain with rows left (else of all rows left)."""
    out = []
    for i, r in enumerate(rows):
        rest = [q for j, q in enumerate(rows) if j != i]
        law = next((law for key in chain(r.key)
                    if (law := fit([q for q in rest if q.key == key])) is not None), None)
        if law is None:
            law = fit(rest)
        if law is not None:
            out.append((r.key, abs(predict_row(r, law) / r.observed - 1) * 100))
    return out


def by_key(errors: list[tuple[str, float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for key, err in errors:
        out.setdefault(key, []).append(err)
    return out


def fit_contention(rows: list[OverlapRow]) -> Contention:
    """lam per side from overlap rows (see the module docstring), with the leave-one-out
    error of each row; the default where there are none. Where the rows also price both
    steps' times, the interleaving law (interleave.py) is fitted too, and kept when its
    held-out median error is lower."""
    out = fit_shares(rows)
    if not out.fitted:
        return out
    out.law_held_out["shares"] = float(np.median(out.held_out_pct)) if out.held_out_pct \
        else math.inf
    for name, fit in ((INTERLEAVE, fit_interleave), (PER_FAMILY, fit_interleave_family)):
        ratio, held = fit(rows)
        if ratio is None or not held:
            continue
        out.law_held_out[name] = float(np.median([e for _, e in held]))
        if out.law_held_out[name] < min(v for k, v in out.law_held_out.items() if k != name):
            out.law, out.ratio, out.per_family = "interleave", ratio, name == PER_FAMILY
            out.held_out_pct, out.held_out_by = [e for _, e in held], by_key(held)
    return out


INTERLEAVE = "interleave"  # law_held_out's names of the interleave law's two fits
PER_FAMILY = "interleave, one exponent per family"


def ratio_of(rows: list[OverlapRow]) -> Ratio | None:
    return fit_ratio([r.pair() for r in rows])


def fit_interleave(rows: list[OverlapRow]
                   ) -> tuple[dict[str, Ratio] | None, list[tuple[str, float]]]:
    """The interleaving law per side (a side without rows of its own takes all rows'; the
    draft's keys only with rows of their own), and each row's error when left out of its
    fit (held_out); (None, []) where the rows cannot tell."""
    if not rows or any(r.timed_ms <= 0 or r.other_ms <= 0 for r in rows):
        return None, []
    laws, _ = fit_keyed(rows, ratio_of)
    if any(side not in laws for side in SIDES):
        return None, []
    return laws, held_out(rows, ratio_of,
                          lambda r, law: 1.0 + law.excess(r.timed_ms, r.other_ms))


def family_laws(rows: list[OverlapRow]) -> dict[str, Ratio]:
    """The interleave law of every key with rows, one exponent per family of keys
    (interleave.fit_family: decode-like steps, prefill chunks); a side without rows of its
    own takes the fit of all rows, as fit_keyed gives it."""
    laws: dict[str, Ratio] = {}
    for fam in ("decode", "prefill"):
        pairs: dict[str, list] = {}
        for r in rows:
            if family(r.key) == fam:
                pairs.setdefault(r.key, []).append(r.pair())
        laws.update(fit_family(pairs) or {})
    pooled = ratio_of(rows)
    for side in SIDES:
        if side not in laws and pooled is not None:
            laws[side] = pooled
    return laws


def fit_interleave_family(rows: list[OverlapRow]
                          ) -> tuple[dict[str, Ratio] | None, list[tuple[str, float]]]:
    """fit_interleave with one exponent per family (family_laws), and each row's error when
    left out of the whole fit, priced by the law its step would take (law_for)."""
    if not rows or any(r.timed_ms <= 0 or r.other_ms <= 0 for r in rows):
        return None, []
    laws = family_laws(rows)
    if any(side not in laws for side in SIDES):
        return None, []
    held = []
    for i, r in enumerate(rows):
        rest = family_laws([q for j, q in enumerate(rows) if j != i])
        try:
            law = law_for(rest, r.side, r.other_side)
        except KeyError:
            continue
        held.append((r.key, abs((1.0 + law.excess(r.timed_ms, r.other_ms)) / r.observed - 1)
                     * 100))
    return laws, held


def fit_shares(rows: list[OverlapRow]) -> Contention:
    """The shares law's lam per side, with each row's leave-one-out error."""
    out = Contention()
    if not rows or fit_serial(rows) is None:
        return out
    laws, how = fit_keyed(rows, fit_serial)
    out.serial.update(laws)
    out.how.update(how)
    out.rows = len(rows)
    held = held_out(rows, fit_serial, predict)
    out.held_out_pct, out.held_out_by = [e for _, e in held], by_key(held)
    return out
