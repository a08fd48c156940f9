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
context (and a mixed forward's mean chunk: `reprice` prices a kept audit again);
error_pct = (priced - measured) / measured x 100, negative where the simulator prices the
stage too fast. What the audit leaves out is time between spans: the host's, which
the simulator prices as a round's overhead where the profile measured one.

Where two serving loops share a device (disaggregated prefill and decode workers on one GPU:
trace meta `placement`), a step is priced as the simulator charges it beside the other
loop's steps that covered it: its time alone stretched by the costs' contention law
(kestrel_sim/costs/contention.py) over the parts of its time each ran beside it
(stage_contention.py); `alone_ms` is its price alone. A step that ran at least a quarter of
its time beside the other loop is grouped apart, its stage named "..., beside another
loop", with `beside` the mean share of its time the other ran: the rows where the law, not
the step's cost alone, sets the price.
"""

from __future__ import annotations

from collections import defaultdict

from kestrel_sim.costs.base import IDLE, Chunk, Shares
from kestrel_sim.costs.contention import side_of
from kestrel_sim.stage_contention import Step, kept_charges, trace_charges
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


def price(s, costs, chunks: dict) -> tuple | None:
    """(role, b, m, c, chunk Shape or None, Step) of a priced span (chunks: the prefill
    spans by key, for a decode or verify that carried them), None where no cost prices it."""
    who = role(s.worker)
    cost = costs.draft if who == "draft" else costs.target
    if cost is None:
        return None
    b = max(len(s.requests), 1)
    c = s.context / b
    m = 1
    if s.kind == "verify":
        m = s.proposed + 1
    elif s.kind == "draft":
        m = 2 if s.tokens > b else 1
    elif s.kind == "prefill":
        m = s.tokens / b
    chunk = chunks.get((s.worker, s.start, s.end)) if s.kind in ("decode", "verify") else None
    shape = None
    if chunk is not None:
        nb = max(len(chunk.requests), 1)
        shape = Chunk(nb, chunk.tokens / nb, chunk.context / nb)
        alone = cost.mixed_seconds(s.kind, b, m, c, shape)
    else:
        alone = cost.seconds(s.kind, b, m, c)
    return who, b, m, c, shape, Step(alone, alone, shares_of(s.worker, cost, s.kind, b, m,
                                                             c, shape), side_of(s.kind))


def shares_of(worker: str, cost, kind: str, b: int, m: float, c: float, shape) -> Shares:
    """How the step uses its device (a CPU draft's: not at all)."""
    return IDLE if worker.endswith("cpu-draft") else cost.shares(kind, b, m, c, shape)


def stage_audit(trace: Trace, costs) -> list[dict]:
    """The rows of the module docstring, ordered by worker role, stage and batch."""
    spans = [s for s in trace.spans if s.kind in PRICED]
    chunks = {(s.worker, s.start, s.end): s for s in spans if s.kind == "prefill"}
    steps = {(s.worker, s.start, s.end) for s in spans if s.kind in ("decode", "verify")}
    shared = beside_shares(trace, spans)
    priced = {}  # key -> (Span, its price)
    for s in spans:
        key = (s.worker, s.start, s.end)
        if s.kind == "prefill" and key in steps:
            continue  # priced with the step it rode in
        got = price(s, costs, chunks)
        if got is not None:
            priced[key] = (s, got)
    charges = (trace_charges(trace, {k: (s, p[-1]) for k, (s, p) in priced.items()},
                             costs.contention) if shared else {})
    # per group: spans, measured ms, charged ms, context, chunk prompts, tokens, context,
    # share of time beside another loop, ms alone
    groups: dict[tuple, list[float]] = defaultdict(
        lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for key, (s, (who, b, m, c, shape, step)) in priced.items():
        beside = shared.get(key, 0.0)
        stage = (s.kind + (MIXED if shape is not None else "")
                 + (BESIDE if beside >= BESIDE_AT else ""))
        g = groups[who, stage, b, m]
        g[0] += 1
        g[1] += (s.end - s.start) * 1e3
        g[2] += charges.get(key, step.alone) * 1e3
        g[3] += c
        if shape is not None:
            g[4] += shape.batch
            g[5] += shape.m
            g[6] += shape.context
        g[7] += beside
        g[8] += step.alone * 1e3
    rows = []
    for (who, stage, b, m), (n, measured, priced_ms, c, nb, cm, cc, bs, alone) in sorted(
            groups.items()):
        row = {"worker": who, "stage": stage, "batch": b, "tokens_per_seq": m,
               "context": c / n, "spans": n, "measured_ms": measured / n,
               "priced_ms": priced_ms / n, "error_pct": _error(priced_ms, measured)}
        if shared:
            row["beside"] = bs / n
            row["alone_ms"] = alone / n
        if MIXED in stage:
            row["chunk"] = [nb / n, cm / n, cc / n]  # prompts, tokens each, context (means)
        rows.append(row)
    return rows


def reprice(rows: list[dict], costs) -> list[dict]:
    """Audit rows kept from an earlier run priced again by `costs` (another profile or
    simulator), each group at its mean shape (its mean context and chunk), the rows that
    shared a device with another loop stretched by the contention law as the rows tell
    (stage_contention.kept_charges): what a kept measurement says of new costs without its
    trace (kestrel validate --measured)."""
    kept, steps, alone_of = [], [], {}
    for r in rows:
        cost = costs.draft if r["worker"] == "draft" else costs.target
        if cost is None:
            continue
        kind = base_kind(r["stage"])
        args = (kind, r["batch"], r["tokens_per_seq"], r["context"])
        shape = Chunk(*r["chunk"]) if "chunk" in r else None
        alone = cost.mixed_seconds(*args, shape) if shape else cost.seconds(*args)
        grain = alone + prefill_partner(r, rows, costs)
        kept.append(r)
        alone_of[id(r)] = alone
        on_cpu = r["worker"] == "draft" and getattr(costs.draft_hardware, "kind", "") == "cpu"
        shares = IDLE if on_cpu else cost.shares(*args, shape)
        steps.append(None if on_cpu else Step(alone, grain, shares, side_of(kind)))
    charges = kept_charges(kept, steps, costs.contention)
    out = []
    for r, charge in zip(kept, charges):
        alone = alone_of[id(r)]
        priced = (alone if charge is None else charge) * 1e3
        row = {**r, "priced_ms": priced, "error_pct": _error(priced, r["measured_ms"])}
        if "beside" in r:
            row["alone_ms"] = alone * 1e3
        out.append(row)
    return out


def prefill_partner(row: dict, rows: list[dict], costs) -> float:
    """Seconds of the other pass of a prefill job the row's prefill is part of (the draft's
    pass after the target's, and back: stage_contention.job_grains), where the rows have
    both passes beside another loop; else 0."""
    if base_kind(row["stage"]) != "prefill" or not row.get("beside") or costs.draft is None:
        return 0.0
    other = "target" if row["worker"] == "draft" else "draft"
    if not any(r["worker"] == other and base_kind(r["stage"]) == "prefill" and r.get("beside")
               for r in rows):
        return 0.0
    cost = costs.target if other == "target" else costs.draft
    return cost.seconds("prefill", row["batch"], row["tokens_per_seq"], row["context"])


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
