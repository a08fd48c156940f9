"""How much of a run its traced stages cover, per worker (issue 24: at least 95%), on
either side: the rest of a worker's working time is its host's (or, simulated, the serving
loop's overhead the simulator adds between steps).

    traced_share(trace)        # worker -> {"run": share of the run, "working": share of
                               #            the time the worker had requests to serve}

"run" is over the run's wall time, first arrival to last finish; "working" only over the
periods the worker had work: a colocated worker from a request's prefill to its finish, a
disaggregated prefill worker from a prefill's start to the request's first token, a decode
worker from its decode start to its finish (a draft worker as its target); a loop whose
target and draft are two workers (gpu0/target, gpu0/draft) also as one (gpu0). A worker idle for
want of requests lowers "run" but not "working", which is what says whether the engine's
own time between stages is traced. Queue waits and KV transfers are not stages.
"""

from __future__ import annotations

from bisect import bisect_right

NOT_STAGES = ("queue_wait", "kv_transfer")


def merged(intervals) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same points as `intervals` [(start, end)]."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in merged(intervals))


def overlap(xs, ys) -> float:
    """Length of the points both sets of intervals cover."""
    xs, ys = merged(xs), merged(ys)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def covered(a: float, b: float, intervals: list[tuple[float, float]],
            starts: list[float]) -> float:
    """Length of [a, b] that `intervals` (merged: disjoint, sorted; `starts` their starts)
    cover, found by bisection."""
    total = 0.0
    i = max(bisect_right(starts, a) - 1, 0)
    while i < len(intervals) and intervals[i][0] < b:
        total += max(0.0, min(b, intervals[i][1]) - max(a, intervals[i][0]))
        i += 1
    return total


def loop_of(worker: str) -> str:
    """A worker's serving loop: its prefix (gpu0/target, gpu0/draft -> gpu0)."""
    return worker.split("/")[0]


def beside(trace, loops: dict[str, list]) -> dict[str, list[tuple[float, float]]]:
    """Per loop (loop -> its spans), the merged steps of the other loops on its device
    (trace meta placement); only loops that share a device with another appear."""
    placement = trace.meta.get("placement") or {}
    out = {}
    for loop in loops:
        device = placement.get(loop)
        mates = [n for n in loops if n != loop and device is not None
                 and placement.get(n) == device]
        if mates:
            out[loop] = merged((o.start, o.end) for n in mates for o in loops[n])
    return out


def work_periods(trace, worker: str) -> list[tuple[float, float]]:
    """When `worker` had requests to serve (see the module docstring)."""
    role = loop_of(worker)
    out = []
    for r in trace.requests:
        if r.finish is None:
            continue
        if role.startswith("prefill"):
            start, end = r.prefill_start, r.first_token
        elif role.startswith("decode"):
            start, end = r.decode_start, r.finish
        else:
            start, end = r.prefill_start or r.arrival, r.finish
        if start is not None and end is not None:
            out.append((start, end))
    return out


def traced_share(trace) -> dict[str, dict[str, float]]:
    spans = [s for s in trace.spans if s.kind not in NOT_STAGES]
    done = [r for r in trace.requests if r.finish is not None]
    if not done:
        return {}
    run = [(min(r.arrival for r in trace.requests), max(r.finish for r in done))]
    workers = sorted({s.worker for s in spans})
    loops = {}  # a worker's prefix (gpu0, decode0): its target and draft, one serving loop
    for w in workers:
        loops.setdefault(loop_of(w), []).append(w)
    groups = {w: [w] for w in workers} | {p: ws for p, ws in loops.items() if len(ws) > 1}
    out = {}
    for name, members in sorted(groups.items()):
        mine = [(s.start, s.end) for s in spans if s.worker in members]
        working = work_periods(trace, members[0])
        out[name] = {"run": overlap(mine, run) / length(run),
                     "working": overlap(mine, working) / length(working) if working else 0.0}
    return out
