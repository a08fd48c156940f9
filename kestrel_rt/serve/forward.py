"""All model execution of one serving step, behind one function:

    out = run_step(worker, tracer, plan)    # out.rows[i]: tokens row i emits
                                            # out.chunks[j]: the token after chunk j

Each stage is a span (CUDA events on a GPU, the host clock on the CPU), written as the
simulator writes it: a round is a `decode` span on the worker's target, or with a draft
model the speculative round's `draft`, `verify` (and `correction`) spans
(kestrel_rt/spec); a mixed step (a round carrying prompt chunks) adds a `prefill` span of
the chunks with the decode or verify span's start and end; a prefill-only step is one
`prefill` span; the draft's own pass over the chunks follows as a `prefill` span on the
draft's worker.

A mixed step runs its forwards one after the other inside its span: the decode forward
([b, 1], or the verify's [b, k+1]) and one forward per prompt chunk ([1, n], each chunk's KV
continuing from the tokens it already prefilled), all replays of a GraphModel's CUDA graphs
on a GPU (an eager forward would be bound by the host). MIXED_FORWARD says so in the trace's
meta. kestrel_rt/packed.py runs decode rows and chunks in one pass over the weights; it is
not yet captured in graphs, so eagerly it would be slower here than these replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel_rt.model import Qwen3Model
from kestrel_rt.trace import OpenSpan, Tracer

MIXED_FORWARD = "separate: the decode or verify forward, then one forward per prompt chunk"


@dataclass
class StepOutput:
    rows: list[list[int]]  # per running row: the tokens it emits this step
    chunks: list[int]  # per chunk: the greedy token after its last token


def run_step(w, tracer: Tracer, plan) -> StepOutput:
    chunks = plan.chunks
    cids = [job.rid for job, _ in chunks]
    counts = {"tokens": plan.chunk_tokens, "context": sum(job.done for job, _ in chunks)}
    rows: list[list[int]] = []
    after = None
    if plan.kind == "prefill":
        with tracer.span("prefill", w.name, cids, **counts):
            after = prefill_forward(w.target, chunks)  # [chunks]
    elif w.spec is None:
        rids = [seq.rid for seq in plan.rows]
        with tracer.span("decode", w.name, rids, tokens=len(rids),
                         context=sum(seq.ctx for seq in plan.rows)) as span:
            nxt = decode_forward(w.target, plan.rows)  # [rows]
            after = prefill_forward(w.target, chunks) if chunks else None  # [chunks]
        rows = [[t] for t in nxt.tolist()]
    else:
        rows, after, span = speculative_round(w, plan)
    if plan.kind == "round" and chunks:  # one step: the chunks' span is the round's
        tracer.spans.append(OpenSpan("prefill", w.name, cids, start=span.start, end=span.end,
                                     **counts))
    if chunks and w.draft is not None:  # the draft's own pass over the chunks
        with tracer.span("prefill", w.draft_name, cids, on_device=w.draft.device.type == "cuda",
                         **counts):
            prefill_forward(w.draft, chunks)
    return StepOutput(rows, [] if after is None else after.tolist())


def speculative_round(w, plan):
    """One round of the worker's decoder over the batch, the chunks riding in its verify
    forward: (tokens per row, the chunks' next tokens or None, the verify span)."""
    for seq in plan.rows:
        seq.spec.target_slot = seq.spec.draft_slot = seq.slot
    lengths = [seq.ctx for seq in plan.rows]
    after = []
    chunks = plan.chunks
    w.spec.alongside = (lambda: after.append(prefill_forward(w.target, chunks))) if chunks else None
    emitted = w.spec.round([seq.spec for seq in plan.rows])
    for seq, n in zip(plan.rows, lengths):
        del seq.tokens[n:]  # the decoder appended them to the shared list: postprocess does
    return emitted, after[0] if after else None, w.spec.verify_span


def decode_forward(model: Qwen3Model, rows) -> torch.Tensor:
    """Each row's next greedy token after its last one: int64 [rows]."""
    tokens = torch.tensor([[seq.tokens[-1]] for seq in rows], dtype=torch.long)  # [b, 1]
    return model.forward(tokens, [seq.slot for seq in rows], greedy=True)[:, 0]


def prefill_forward(model: Qwen3Model, chunks) -> torch.Tensor:
    """Append each chunk to its sequence's KV, one forward per chunk ([1, n]: on a GraphModel
    the replay of its length's prefill graph, whose eager run would be bound by the host);
    the greedy token after each: int64 [chunks]. Each result is copied out at once: a
    replay's ids are a view of its graph's static output, which the next chunk of the same
    length bucket overwrites."""
    out = []
    for job, n in chunks:
        tokens = torch.tensor([job.seq.tokens[job.done:job.done + n]], dtype=torch.long)
        out.append(model.forward(tokens, [job.seq.slot], last_only=True, greedy=True).clone())
    return torch.cat(out) if len(out) > 1 else out[0]  # [chunks]


def warm_up(w, max_batch: int, k: int, longest_chunk: int = 0) -> None:
    """Run the step shapes once before the clock starts (on a GPU: kernels compile and a
    GraphModel captures its graphs for every batch bucket up to max_batch: the target's
    decode, or verify at M = k + 1; the draft's steps at M = 1 and 2; and both models'
    one-sequence chunk graphs: each length up to max_m, then every prefill length bucket up
    to longest_chunk's), then empty the slots used."""
    rows_max = min(max_batch, w.slots.num_slots)
    for model in w.models:
        for n in [*small_chunk_lengths(model, longest_chunk),
                  *prefill_lengths(model, longest_chunk)]:
            model.forward(torch.zeros(1, n, dtype=torch.long), [0], last_only=True,
                          greedy=True)
            model.kv.rollback(0, 0)
        if model is w.draft:
            shapes = [(1, False), (2, True)]  # (M, last_only)
        else:
            shapes = [(1, False)] + ([(k + 1, False)] if k and w.spec is not None else [])
        sizes = []
        for bucket in getattr(model, "buckets", (1,)):
            sizes.append(min(bucket, rows_max))
            if bucket >= rows_max:
                break
        slots = list(range(max(sizes)))
        zeros = torch.zeros(len(slots), 2, dtype=torch.long)  # [rows, 2]
        Qwen3Model.forward(model, zeros, slots, last_only=True, greedy=True)
        for b in sorted(set(sizes)):
            for m, last_only in shapes:
                model.forward(torch.zeros(b, m, dtype=torch.long), slots[:b],
                              last_only=last_only, greedy=True)
                for s in slots[:b]:
                    model.kv.rollback(s, 2)
        for s in slots:
            model.kv.rollback(s, 0)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)


def small_chunk_lengths(model: Qwen3Model, longest: int) -> list[int]:
    """Chunk lengths a GraphModel replays at their own length, not a prefill bucket: up to
    its max_m (none for a model without graphs). A prompt's last chunk, or one cut by what
    is left of max_batched_tokens, can be any of them; one first seen mid-run is captured
    then, stalling the worker (trace meta `graph_captures_in_run`)."""
    return list(range(1, min(getattr(model, "max_m", 0), longest) + 1))


def prefill_lengths(model: Qwen3Model, longest: int) -> list[int]:
    """The prefill graph lengths a model replays for chunks of up to `longest` tokens (none
    for a model without prefill graphs)."""
    buckets = getattr(model, "prefill_buckets", ())
    top = next((b for b in buckets if b >= longest), None)
    return [b for b in buckets if top is not None and b <= min(top, model.kv.max_len)]
