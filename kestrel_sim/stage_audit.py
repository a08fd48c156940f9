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
Rows group the spans by worker role, stage and batch (a draft step also by its tokens per
sequence); error_pct = (priced - measured) / measured x 100, negative where the simulator
prices the stage too fast. What the audit leaves out is time between spans: the host's, which
the simulator prices as a round's overhead where the profile measured one.
"""

from __future__ import annotations

from collections import defaultdict

from kestrel_sim.costs.base import Chunk
from kestrel_sim.trace import Trace

PRICED = ("prefill", "decode", "verify", "correction", "draft")


def role(worker: str) -> str:
    """"draft" for a draft model's worker (gpu0/draft, gpu0/cpu-draft), else "target"."""
    return "draft" if worker.rsplit("/", 1)[-1] in ("draft", "cpu-draft") else "target"


def stage_audit(trace: Trace, costs) -> list[dict]:
    """The rows of the module docstring, ordered by worker role, stage and batch."""
    spans = [s for s in trace.spans if s.kind in PRICED]
    chunks = {(s.worker, s.start, s.end): s for s in spans if s.kind == "prefill"}
    steps = {(s.worker, s.start, s.end) for s in spans if s.kind in ("decode", "verify")}
    groups: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
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
        if chunk is not None:
            nb = max(len(chunk.requests), 1)
            priced = cost.mixed_seconds(s.kind, b, m, c,
                                        Chunk(nb, chunk.tokens / nb, chunk.context / nb))
        else:
            priced = cost.seconds(s.kind, b, m, c)
        stage = s.kind + (" + prompt chunk" if chunk is not None else "")
        g = groups[who, stage, b, m if s.kind == "draft" else None]
        g[0] += 1
        g[1] += (s.end - s.start) * 1e3
        g[2] += priced * 1e3
    rows = []
    for (who, stage, b, m), (n, measured, priced) in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] or 0)):
        row = {"worker": who, "stage": stage, "batch": b, "spans": n,
               "measured_ms": measured / n, "priced_ms": priced / n,
               "error_pct": (priced / measured - 1) * 100 if measured > 0 else None}
        if m is not None:
            row["tokens_per_seq"] = m
        rows.append(row)
    return rows


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
