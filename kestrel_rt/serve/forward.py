"""All model execution of one serving step, behind one function:

    out = run_step(worker, tracer, plan)    # out.rows[i]: tokens row i emits
                                            # out.chunks[j]: the token after chunk j

Each stage is a span (CUDA events on a GPU, the host clock on the CPU), written as the
simulator writes it: a round is a `decode` span on the worker's target; a mixed step (a
round carrying prompt chunks) is that span plus a `prefill` span of the chunks with the
same start and end; a prefill-only step is one `prefill` span.

Today a mixed step runs two forwards inside its span: the decode forward ([b, 1] through
the CUDA graphs of a GraphModel) and one padded forward of the chunks ([chunks, longest],
eager, each row's KV continuing from the tokens it already prefilled). MIXED_FORWARD says
so in the trace's meta. The packed (varlen) forward that runs decode rows and chunks in
one pass without padding replaces the inside of `run_step`, nothing around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel_rt.model import Qwen3Model
from kestrel_rt.trace import OpenSpan, Tracer

MIXED_FORWARD = "separate: a decode forward, then a padded forward of the prompt chunks"


@dataclass
class StepOutput:
    rows: list[list[int]]  # per running row: the tokens it emits this step
    chunks: list[int]  # per chunk: the greedy token after its last token


def run_step(w, tracer: Tracer, plan) -> StepOutput:
    target = w.target
    cids = [job.rid for job, _ in plan.chunks]
    ctokens = plan.chunk_tokens
    cctx = sum(job.done for job, _ in plan.chunks)
    if plan.kind == "prefill":
        with tracer.span("prefill", w.name, cids, tokens=ctokens, context=cctx):
            after = prefill_forward(target, plan.chunks)  # [chunks]
        return StepOutput([], after.tolist())
    rows = plan.rows
    rids = [seq.rid for seq in rows]
    with tracer.span("decode", w.name, rids, tokens=len(rows),
                     context=sum(seq.ctx for seq in rows)) as span:
        nxt = decode_forward(target, rows)  # [rows]
        after = prefill_forward(target, plan.chunks) if plan.chunks else None  # [chunks]
    if plan.chunks:  # one step: the chunks' span has the round's start and end
        tracer.spans.append(OpenSpan("prefill", w.name, cids, ctokens, cctx,
                                     start=span.start, end=span.end))
    return StepOutput([[t] for t in nxt.tolist()], [] if after is None else after.tolist())


def decode_forward(model: Qwen3Model, rows) -> torch.Tensor:
    """Each row's next greedy token after its last one: int64 [rows]."""
    tokens = torch.tensor([[seq.tokens[-1]] for seq in rows], dtype=torch.long)  # [b, 1]
    return model.forward(tokens, [seq.slot for seq in rows], greedy=True)[:, 0]


def prefill_forward(model: Qwen3Model, chunks) -> torch.Tensor:
    """Append each chunk to its sequence's KV (one padded batch, eager: chunk shapes vary,
    so no CUDA graph is captured mid-run); the greedy token after each: int64 [chunks]."""
    width = max(n for _, n in chunks)
    tokens = torch.zeros(len(chunks), width, dtype=torch.long)  # [chunks, width], 0-padded
    for i, (job, n) in enumerate(chunks):
        tokens[i, :n] = torch.tensor(job.seq.tokens[job.done:job.done + n], dtype=torch.long)
    slots = [job.seq.slot for job, _ in chunks]
    return Qwen3Model.forward(model, tokens, slots, [n for _, n in chunks], last_only=True,
                              greedy=True)


def warm_up(w, max_batch: int) -> None:
    """Run the step shapes once before the clock starts (on a GPU: kernels compile and a
    GraphModel captures its decode graph for every batch bucket up to max_batch), then
    empty the slots used."""
    rows_max = min(max_batch, w.slots.num_slots)
    for model in w.models:
        sizes = []
        for bucket in getattr(model, "buckets", (1,)):
            sizes.append(min(bucket, rows_max))
            if bucket >= rows_max:
                break
        slots = list(range(max(sizes)))
        zeros = torch.zeros(len(slots), 2, dtype=torch.long)  # [rows, 2]
        Qwen3Model.forward(model, zeros, slots, last_only=True, greedy=True)
        for b in sorted(set(sizes)):
            model.forward(torch.zeros(b, 1, dtype=torch.long), slots[:b], greedy=True)
            for s in slots[:b]:
                model.kv.rollback(s, 2)
        for s in slots:
            model.kv.rollback(s, 0)
    if w.models[0].device.type == "cuda":
        torch.cuda.synchronize(w.models[0].device)
