"""What lies in a serving loop's gaps: the time between its steps while it had work (what
its traced share leaves out, kestrel_sim/traced.py), and what happened in each gap.

    gap_causes(trace)   # loop -> {"gaps": 840, "gap_s": 0.79, "p50_ms": 0.41, ...}

A loop is a worker prefix (gpu0, decode0: its target and draft together). Its gaps are the
holes between its merged step spans, within its work periods. Each gap is counted under
every cause it shows (they overlap, so the causes need not add up to gap_s):

- `after_handover_s`: a KV hand-over to this loop landed (a kv_transfer span ended) in the
  gap or in the step before it: a request joined;
- `rows_changed_s`: the step after the gap ran other requests than the step before (a
  request joined or left: a round the serving loop could not launch ahead);
- `beside_s`: the part of the gap another loop on the same device (trace meta placement)
  was running a step: the two loops' threads share the host;
- `none_s`: gaps with none of the three.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from kestrel_sim.traced import NOT_STAGES, beside, covered, loop_of, merged, overlap, work_periods


def gap_causes(trace) -> dict[str, dict[str, float]]:
    """Per loop with work: its gaps and their causes (see the module docstring)."""
    steps = [s for s in trace.spans if s.kind not in NOT_STAGES]
    loops: dict[str, list] = {}
    for s in steps:
        loops.setdefault(loop_of(s.worker), []).append(s)
    shared = beside(trace, loops)
    decoded_on: dict[int, set[str]] = {}  # request -> the loops that decoded it
    for s in steps:
        if s.kind in ("decode", "verify"):
            for r in s.requests:
                decoded_on.setdefault(r, set()).add(loop_of(s.worker))
    landed: dict[str, list[float]] = {}  # loop -> end times of the hand-overs to it
    for s in trace.spans:
        if s.kind == "kv_transfer":
            for loop in set().union(*(decoded_on.get(r, set()) for r in s.requests)):
                landed.setdefault(loop, []).append(s.end)
    out = {}
    for loop, mine in sorted(loops.items()):
        working = merged(work_periods(trace, mine[0].worker))
        if not working:
            continue
        out[loop] = _causes(sorted(mine, key=lambda s: s.start), working,
                            shared.get(loop, []), sorted(landed.get(loop, [])))
    return out


def _causes(mine, working, others, landed) -> dict[str, float]:
    holes = []  # (start, end, step before, step after)
    reach = mine[0].end
    before = mine[0]
    for s in mine[1:]:
        if s.start > reach:
            holes.append((reach, s.start, before, s))
        if s.end >= reach:
            reach, before = s.end, s
    out = {"gaps": 0, "gap_s": 0.0, "after_handover_s": 0.0, "rows_changed_s": 0.0,
           "beside_s": 0.0, "none_s": 0.0}
    sizes = []
    other_starts = [a for a, _ in others]
    for a, b, prev, nxt in holes:
        t = overlap([(a, b)], working)
        if t <= 0.0:
            continue
        out["gaps"] += 1
        out["gap_s"] += t
        sizes.append(t)
        handover = bisect_left(landed, prev.start) < bisect_right(landed, b)
        changed = set(prev.requests) != set(nxt.requests)
        by_other = covered(a, b, others, other_starts)
        out["after_handover_s"] += t if handover else 0.0
        out["rows_changed_s"] += t if changed else 0.0
        out["beside_s"] += min(by_other, t)
        out["none_s"] += t if not (handover or changed or by_other > 0.0) else 0.0
    sizes.sort()
    out["p50_ms"] = sizes[len(sizes) // 2] * 1e3 if sizes else 0.0
    out["p99_ms"] = sizes[min(len(sizes) - 1, int(len(sizes) * 0.99))] * 1e3 if sizes else 0.0
    return out
