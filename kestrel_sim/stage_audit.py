"""Each measured stage priced by the simulator's cost model at the shape it ran: where a
prediction's error comes from, stage by stage (docs/validation.md: every scenario past 10%
explained).

    rows = stage_audit(measured_trace, costs)      # costs: kestrel_sim.costs.build.SimCosts
    rows[0]   # {"worker": "target", "stage": "verify", "batch": 5, "spans": 120,
              #  "measured_ms": 12.6, "priced_ms": 10.4, "error_pct": -17.5}

A span of the runtime's trace is priced as the simulator would price that step: its batch
(the requests in it), its new tokens per sequence (a verify's proposed + 1, a draft step's
tokens over its batch: 2 where a lagging sequence made it a catch-up step), its mean context,
its model (a `draft` worker's spans by the draft's costs); a verify or decode span with a
prefill span of the same worker, start and end is one mixed forward, priced with its chunks.
Rows group the spans by worker role, stage, batch and tokens per sequence, with their mean
context (and a mixed forward's mean chunk: `reprice` prices a kept audit again); error_pct = (priced - measured) / measured x 100, negative where the simulator
prices the stage too fast. What the audit leaves out is time between spans: the host's, which
the simulator prices as a round's overhead where the profile measured one.

Where two serving loops share a device (disaggregated prefill and decode workers on one GPU:
trace meta `placement`), a step that ran at least a quarter of its time beside the other
loop's steps is grouped apart, its stage named "..., beside another loop", with `beside` the
mean share of its time the other ran: the audit prices each step alone, so those rows show
the contention the simulator's law (kestrel_sim/costs/contention.py) must account for.
"""

from __future__ import annotations

from collections import defaultdict

from kestrel_sim.costs.base import Chunk
from kestrel_sim.trace import Trace
from kestrel_sim.traced import beside, covered, loop_of

PRICED = ("prefill", "decode", "verify", "correction", "draft")
MIXED = " + prompt chunk"  # a decode or verify stage that carried prompt chunks
BESIDE = ", beside another loop"  # a step that shared its device with another loop's steps
BESIDE_AT = 0.25  # the share of its time from which a step counts as beside the other


def base_kind(stage: str) -> str:
    """The span kind an audit row's stage names (decode, verify, ...)."""
    return stage.removesuffix(BESIDE).removesuffix(MIXED)


def beside_shares(trace: Trace, spans) -> dict[tuple, float]:
    """(worker, start, end) -> the share of the span's time that another serving loop's
    priced spans on the same device covered (none where no device has two loops)."""
    loops: dict[str, list] = defaultdict(list)  # loop -> its spans
    for s in spans:
        loops[loop_of(s.worker)].append(s)
    out = {}
    for loop, others in beside(trace, loops).items():
        starts = [a for a, _ in others]
        for s in loops[loop]:
            if s.end > s.start:
                out[s.worker, s.start, s.end] = (covered(s.start, s.end, others, starts)
                                                 / (s.end - s.start))
    return out


def role(worker: str) -> str:
    """"draft" for a draft model's worker (gpu0/draft, gpu0/cpu-draft), else "target"."""
    return "draft" if worker.rsplit("/", 1)[-1] in ("draft", "cpu-draft") else "target"


def stage_audit(trace: Trace, costs) -> list[dict]:
    """The rows of the module docstring, ordered by worker role, stage and batch."""
    spans = [s for s in trace.spans if s.kind in PRICED]
    chunks = {(s.worker, s.start, s.end): s for s in spans if s.kind == "prefill"}
    steps = {(s.worker, s.start, s.end) for s in spans if s.kind in ("decode", "verify")}
    shared = beside_shares(trace, spans)
    # per group: spans, measured ms, priced ms, context, chunk prompts, tokens, context,
    # share of time beside another loop
    groups: dict[tuple, list[float]] = defaultdict(
        lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for s in spans:
        key = (s.worker, s.start, s.end)
        if s.kind == "prefill" and key in steps:
            continue  # priced with the step it rode in
        who = role(s.worker)
        cost = costs.draft if who == "draft" else costs.target
        if cost is None:
            continue
        b = max(len(s.requests), 1)
        c = s.context / b
        m = 1
        if s.kind == "verify":
            m = s.proposed + 1
        elif s.kind == "draft":
            m = 2 if s.tokens > b else 1
        elif s.kind == "prefill":
            m = s.tokens / b
        chunk = chunks.get(key) if s.kind in ("decode", "verify") else None
        shape = None
        if chunk is not None:
            nb = max(len(chunk.requests), 1)
            shape = Chunk(nb, chunk.tokens / nb, chunk.context / nb)
            priced = cost.mixed_seconds(s.kind, b, m, c, shape)
        else:
            priced = cost.seconds(s.kind, b, m, c)
        beside = shared.get(key, 0.0)
        stage = (s.kind + (MIXED if chunk is not None else "")
                 + (BESIDE if beside >= BESIDE_AT else ""))
        g = groups[who, stage, b, m]
        g[0] += 1
        g[1] += (s.end - s.start) * 1e3
        g[2] += priced * 1e3
        g[3] += c
        if shape is not None:
            g[4] += shape.batch
            g[5] += shape.m
            g[6] += shape.context
        g[7] += beside
    rows = []
    for (who, stage, b, m), (n, measured, priced, c, nb, cm, cc, bs) in sorted(groups.items()):
        row = {"worker": who, "stage": stage, "batch": b, "tokens_per_seq": m,
               "context": c / n, "spans": n, "measured_ms": measured / n,
               "priced_ms": priced / n, "error_pct": _error(priced, measured)}
        if shared:
            row["beside"] = bs / n
        if MIXED in stage:
            row["chunk"] = [nb / n, cm / n, cc / n]  # prompts, tokens each, context (means)
        rows.append(row)
    return rows


def reprice(rows: list[dict], costs) -> list[dict]:
    """Audit rows kept from an earlier run priced again by `costs` (another profile or
    simulator), each group at its mean shape (its mean context and chunk): what a kept
    measurement says of new costs without its trace (kestrel validate --measured)."""
    out = []
    for r in rows:
        cost = costs.draft if r["worker"] == "draft" else costs.target
        kind = base_kind(r["stage"])
        if cost is None:
            continue
        args = (kind, r["batch"], r["tokens_per_seq"], r["context"])
        if "chunk" in r:
            priced = cost.mixed_seconds(*args, Chunk(*r["chunk"])) * 1e3
        else:
            priced = cost.seconds(*args) * 1e3
        out.append({**r, "priced_ms": priced,
                    "error_pct": _error(priced, r["measured_ms"])})
    return out


def _error(priced: float, measured: float) -> float | None:
    return (priced / measured - 1) * 100 if measured > 0 else None


def totals(rows: list[dict]) -> list[dict]:
    """Per worker role and stage: spans, measured and priced seconds in all, error."""
    acc: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        a = acc[r["worker"], r["stage"]]
        a[0] += r["spans"]
        a[1] += r["measured_ms"] * r["spans"] / 1e3
        a[2] += r["priced_ms"] * r["spans"] / 1e3
    return [{"worker": w, "stage": st, "spans": n, "measured_s": ms, "priced_s": ps,
             "error_pct": (ps / ms - 1) * 100 if ms > 0 else None}
            for (w, st), (n, ms, ps) in sorted(acc.items())]
