"""What the simulator charges a measured step that ran beside other serving loops' steps on
its device (stage_audit.py): its time alone, stretched by the contention law of the costs
(kestrel_sim/costs/contention.py) over the parts of its time that other steps ran beside it:

    charged = alone / ((1 - sum_j s_j) + sum_j s_j / f_j)

s_j the share of the step's measured time during which the set j of other loops' steps ran
beside it, f_j the law's slowdown of the step beside that set. The step is taken to spend
the same shares of its time beside the same steps as it did when measured: a step the other
covered whole (s = 1) is charged alone x f, what the simulator's device (sim/device.py)
charges a job while another one runs beside it, and a step beside nothing its time alone.

The law weighs each step by its time alone as the simulator's jobs are: a prefill step's
target pass and the draft's pass after it (the same requests, the same loop) are one job
of the simulator's prefill step (sim/steps.py), each weighed by their sum; a draft step, a
verify or a decode step by its own (the simulator also adds a round's host time to its
verify's job: not a span, so not here).

A kept audit has no trace, only its rows (`kept_charges`): a row's steps are taken to run
beside the rows of the other phase of a disaggregated pair (a prefill row's beside the
decode-like rows and back; a device where only one phase ran beside: every row beside),
each in proportion to the time it ran beside (spans x measured ms x share beside), at the
rows' mean shapes and times alone.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from itertools import pairwise
from typing import NamedTuple

from kestrel_sim.costs.base import Shares
from kestrel_sim.costs.contention import Contention
from kestrel_sim.traced import loop_of


class Step(NamedTuple):
    """A priced step: its time alone (s), the time alone the law weighs it by (s: its job's
    in the simulator), how it uses the device, its side (contention.side_of)."""

    alone: float
    grain: float
    shares: Shares
    side: str


def charged(me: Step, parts: list[tuple[float, list[Step]]], contention: Contention
            ) -> float:
    """Seconds the simulator charges `me`: parts [(share of its time, the other steps
    beside it then)] (the rest of its time: none beside); see the module docstring."""
    rate = 1.0
    for share, others in parts:
        if not others or share <= 0.0:
            continue
        f = contention.slowdowns([me.grain] + [o.grain for o in others],
                                 [me.shares] + [o.shares for o in others],
                                 [me.side] + [o.side for o in others])[0]
        rate -= share * (1.0 - 1.0 / f)
    return me.alone / max(rate, 1e-9)


def job_grains(spans: dict[tuple, tuple]) -> dict[tuple, float]:
    """(worker, start, end) -> the time alone of the simulator's job the span is part of,
    where it is not the span's own: a prefill's target pass and the draft's pass over the
    same requests right after it, on the same loop. `spans`: key -> (Span, Step)."""
    last: dict[str, tuple] = {}  # loop -> its latest target prefill (key, Span, Step)
    out = {}
    for key, (span, step) in sorted(spans.items(), key=lambda kv: kv[0][1]):
        if span.kind != "prefill":
            continue
        loop = loop_of(span.worker)
        if not span.worker.endswith("draft"):
            last[loop] = (key, span, step)
            continue
        prev = last.pop(loop, None)
        if prev is not None and prev[1].requests == span.requests and prev[1].end <= span.start:
            out[key] = out[prev[0]] = prev[2].alone + step.alone
    return out


def trace_charges(trace, spans: dict[tuple, tuple], contention: Contention
                  ) -> dict[tuple, float]:
    """key -> seconds charged, for every step (`spans`: key (worker, start, end) -> (Span,
    Step)) that another loop on its device (trace meta `placement`) ran beside."""
    grains = job_grains(spans)
    steps = {k: st._replace(grain=grains.get(k, st.grain)) for k, (_, st) in spans.items()}
    loops: dict[str, list[tuple]] = defaultdict(list)
    for key in steps:
        loops[loop_of(key[0])].append(key)
    placement = trace.meta.get("placement") or {}
    out = {}
    for loop, mine in loops.items():
        device = placement.get(loop)
        if device is None:
            continue
        others = sorted((k for n, ks in loops.items() if n != loop
                         and placement.get(n) == device for k in ks), key=lambda k: k[1])
        if not others:
            continue
        starts = [k[1] for k in others]
        longest = max(k[2] - k[1] for k in others)
        for key in mine:
            a, b = key[1], key[2]
            if b <= a:
                continue
            near = [k for k in others[bisect_left(starts, a - longest):bisect_left(starts, b)]
                    if k[2] > a]
            if near:
                out[key] = charged(steps[key], _parts(a, b, near, steps), contention)
    return out


def _parts(a: float, b: float, near: list[tuple], steps: dict) -> list[tuple[float, list]]:
    """[(share of [a, b], the steps of `near` active then)] over the stretches of [a, b]
    in which the same steps ran."""
    cuts = sorted({a, b, *(min(max(k[1], a), b) for k in near),
                   *(min(max(k[2], a), b) for k in near)})
    out = []
    for x, y in pairwise(cuts):
        if y > x:
            active = [steps[k] for k in near if k[1] < y and k[2] > x]
            out.append(((y - x) / (b - a), active))
    return out


def phase(stage: str) -> str:
    """A row's side of a disaggregated pair: its prefill loop's steps or the decode loop's."""
    return "prefill" if stage.startswith("prefill") else "decode"


def kept_charges(rows: list[dict], steps: list[Step | None], contention: Contention
                 ) -> list[float | None]:
    """Seconds charged per row (its mean step; None where it has no Step or never ran
    beside), from the rows alone (see the module docstring)."""
    beside = [i for i, r in enumerate(rows) if steps[i] is not None and r.get("beside", 0) > 0]
    out: list[float | None] = [None] * len(rows)
    for i in beside:
        mine = phase(rows[i]["stage"])
        others = [j for j in beside if phase(rows[j]["stage"]) != mine] or beside
        weight = {j: rows[j]["spans"] * rows[j]["measured_ms"] * rows[j]["beside"]
                  for j in others}
        total = sum(weight.values())
        if total <= 0:
            continue
        share = rows[i]["beside"]
        out[i] = charged(steps[i], [(share * weight[j] / total, [steps[j]]) for j in others],
                         contention)
    return out
