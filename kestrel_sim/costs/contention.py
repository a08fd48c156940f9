"""Steps of several workers that overlap in time on one device: how much each one slows.

A step's use of its device is its Shares (base.py), fractions of its time alone: the
bandwidth b and compute g it uses on average, the parts of its time bound by memory (mu)
and by compute (kappa), busy s = mu + kappa; the rest, 1 - s, is overhead (launches, host
work, gaps) that another stream's kernels fill. While a set S of steps is active on one
device, step i advances at 1 / f_i of its speed alone:

    X_B = max(1, sum_S b_j)       bandwidth asked for, over what the device has
    X_C = max(1, sum_S g_j)       compute asked for, over what it has
    X_T = max(1, sum_S s_j)       device time asked for, were kernels run one at a time

    f_i = (1 - s_i) + (1 - lam_i) (mu_i X_B + kappa_i X_C) + lam_i s_i X_T

lam = 0 is processor sharing of two resources: a memory-bound decode step beside a
compute-bound prefill chunk slows little (neither resource is oversubscribed), while two
memory-bound steps split the bandwidth. lam = 1: the two streams' kernels run one at a time
and only the overhead gaps overlap. Between the two, lam_i is the part of step i's kernel
time that cannot run beside the other stream's kernels (SMs held by the other's thread
blocks, caches, the memory controller's queues). Alone every X is 1 and f = 1; f_i grows
with lam_i and with the other steps' shares, and never passes its lam = 1 bound.

This is the `shares` law. The H200's overlap rows slowed past its lam = 1 bound (a decode
step's many small kernels each waiting behind a prefill's large ones): the `interleave`
law (interleave.py) prices that, and fit_contention keeps whichever predicts the rows
better, each left out of its fit.

lam is per side, `decode` (decode and speculative rounds, mixed steps: many small
kernels) and `prefill` (prefill chunks: large GEMMs), since the two suffer differently.
Each is fitted from a profile's overlap rows (a step timed while a step of the other side
loops on another stream of the same GPU: observed f = ms / alone_ms), where f is linear in
lam: least squares on relative error, kept within 0..1; a side without rows takes the fit
of all rows. Without overlap rows both sides take DEFAULT_SERIAL, halfway between the two
bounds, and the cost description says the contention is uncalibrated.

Where a profile has overlap rows of the speculative decode worker's draft steps (the draft
model's one-token step beside the target's chunk, calibration/overlap_grid.py), they get
laws of their own: `draft` (a draft step timed beside a chunk) and `prefill/draft` (a
chunk timed beside draft steps); the simulator then runs a round's draft steps apart from
its verify (kestrel_sim/sim/steps.py, `Contention.drafts_apart`). Without such rows a
draft step is decode-like and a chunk beside it prices as beside any decode step
(interleave.law_for), today's law exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kestrel_sim.costs.base import Shares
from kestrel_sim.costs.interleave import (
    FALLBACK,
    PER_FAMILY,
    SIDES,
    Ratio,
    fit_interleave_family,
    fit_ratio,
    law_for,
    ratio_slowdowns,
)

DEFAULT_SERIAL = 0.5  # halfway between ideal sharing (0) and kernels one at a time (1)


def side_of(stage: str) -> str:
    """The side a step of `stage` is on: prefill chunks, the draft's steps, or decode-like
    steps (a draft step takes the decode side's law where it has none of its own)."""
    return stage if stage in ("prefill", "draft") else "decode"


def chain(key: str) -> list[str]:
    """The keys whose rows fit a key's law, the most particular first ("prefill/draft":
    itself, then prefill; "draft": itself, then decode)."""
    side = key.split("/")[0]
    return list(dict.fromkeys([key, side, FALLBACK.get(side, side)]))


def asked(shares: list[Shares]) -> tuple[float, float, float]:
    """(X_B, X_C, X_T) of a set of active steps."""
    bw = fl = busy = 0.0
    for sh in shares:
        bw += sh.bandwidth
        fl += sh.compute
        busy += sh.busy
    return max(1.0, bw), max(1.0, fl), max(1.0, busy)


def bounds(shares: list[Shares], i: int, x: tuple[float, float, float] | None = None
           ) -> tuple[float, float]:
    """(f at lam 0, f at lam 1) of step i while all of `shares` are active (x: their
    asked(), where already known)."""
    xb, xc, xt = x or asked(shares)
    me = shares[i]
    busy = me.busy
    return (1.0 - busy + me.memory_bound * xb + me.compute_bound * xc,
            1.0 - busy + busy * xt)


def slowdowns(shares: list[Shares], serial: list[float]) -> list[float]:
    """f_i of every active step (see the module docstring); serial[i] is step i's lam."""
    if len(shares) == 1:
        return [1.0]
    x = asked(shares)
    out = []
    for i, lam in enumerate(serial):
        ideal, one_at_a_time = bounds(shares, i, x)
        out.append(ideal + lam * (one_at_a_time - ideal))
    return out


@dataclass
class OverlapRow:
    """One measured overlap: the timed step's and the other step's Shares (from the cost
    model's terms), the timed step's side, its observed slowdown ms / alone_ms, and both
    steps' times alone as the cost model prices them (ms; 0: unknown)."""

    timed: Shares
    other: Shares
    side: str
    observed: float
    timed_ms: float = 0.0
    other_ms: float = 0.0
    other_side: str = ""

    @property
    def key(self) -> str:
        """The law that prices it: its side's, or its side's beside the draft's steps."""
        beside_draft = self.other_side == "draft" and self.side != "draft"
        return f"{self.side}/draft" if beside_draft else self.side

    def pair(self) -> tuple[float, float, float]:
        return self.timed_ms, self.other_ms, self.observed

    def bounds(self) -> tuple[float, float]:
        return bounds([self.timed, self.other], 0)


@dataclass
class Contention:
    """The law steps on one device slow each other by: `shares` (lam per side, this
    module) or `interleave` (a, b per side: interleave.py), where it came from, and
    (fitted) the held-out error of its rows."""

    serial: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SIDES, DEFAULT_SERIAL))
    rows: int = 0  # overlap rows fitted (0: the default)
    how: dict[str, str] = field(default_factory=lambda: dict.fromkeys(SIDES, "default"))
    held_out_pct: list[float] = field(default_factory=list)  # |error| % of each row, left out
    law: str = "shares"
    ratio: dict[str, Ratio] = field(default_factory=dict)  # the interleave law's, per side
    # the median held-out error of each law the rows were fitted with (the kept one lowest)
    law_held_out: dict[str, float] = field(default_factory=dict)
    # the kept law's held-out errors by the law that priced each row (OverlapRow.key)
    held_out_by: dict[str, list[float]] = field(default_factory=dict)
    # the interleave law's exponent: one per law, or one per family (interleave.py)
    per_family: bool = False

    @property
    def fitted(self) -> bool:
        return self.rows > 0

    @property
    def table(self) -> dict:
        """The kept law's entries: side (or "side/other") -> lam or Ratio."""
        return self.ratio if self.law == "interleave" else self.serial

    @property
    def drafts_apart(self) -> bool:
        """Whether the draft's steps have a law of their own (rows of them were fitted): the
        simulator then runs them apart from the rest of a round."""
        return any("draft" in key for key in self.table)

    def slowdowns(self, seconds: list[float], shares: list[Shares], sides: list[str]
                  ) -> list[float]:
        """f of every active step: its time alone (one step's, where a job is several),
        Shares and side."""
        if self.law == "interleave":
            return ratio_slowdowns(seconds, sides, self.ratio)
        return slowdowns(shares, [law_for(self.serial, s) for s in sides])

    def describe(self) -> str:
        if self.law == "interleave":
            law = ", ".join(f"{s} {r.a:.2f} x (T_other / T)^{r.b:.2f}"
                            for s, r in self.ratio.items())
            one_b = ", one exponent per family" if self.per_family else ""
            text = (f"steps overlapping on one device: each slowed by the other's kernels "
                    f"({law}{one_b}), fitted from {self.rows} overlap rows")
        else:
            lam = ", ".join(f"{s} {v:.2f}" for s, v in self.serial.items())
            if not self.fitted:
                return (f"steps overlapping on one device: uncalibrated contention, lam {lam} "
                        "(halfway between sharing bandwidth and compute and running kernels "
                        "one at a time; the profile has no overlap rows)")
            text = (f"steps overlapping on one device: lam {lam} fitted from {self.rows} "
                    "overlap rows")
        if self.held_out_pct:
            text += f" (held-out error median {np.median(self.held_out_pct):.1f}%)"
        return text


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


def predict(row: OverlapRow, lam: float) -> float:
    ideal, serial = row.bounds()
    return ideal + lam * (serial - ideal)


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
    for name, fit in (("interleave", fit_interleave), (PER_FAMILY, fit_interleave_family)):
        ratio, held = fit(rows)
        if ratio is None or not held:
            continue
        out.law_held_out[name] = float(np.median([e for _, e in held]))
        if out.law_held_out[name] < min(v for k, v in out.law_held_out.items() if k != name):
            out.law, out.ratio, out.per_family = "interleave", ratio, name == PER_FAMILY
            out.held_out_pct, out.held_out_by = [e for _, e in held], by_key(held)
    return out


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
