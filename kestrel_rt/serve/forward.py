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

from kestrel_rt.cuda.graph_shapes import prefill_warm_shapes
from kestrel_rt.model import Qwen3Model
from kestrel_rt.serve.settings import ServeSettings
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


# Prefill graphs a warm-up captures per model at most: past it, the shapes of the largest
# keys (the longest contexts) are left to capture mid-run, and the warm-up status says so.
# A 40960-token cache (qwen3's context) in 8192-token chunks needs 90 (tests/test_warm_shapes.py).
WARM_PREFILL_LIMIT = 128


def chunk_limits(s: ServeSettings, longest_prompt: int, longest_request: int) -> tuple[int, bool]:
    """(the longest chunk a run prefills, whether a chunk can start past a sequence's first
    token), from the serving rules: a sequence is prefilled from its first token in chunks
    of at most prefill_chunk, cut shorter where max_batched_tokens runs out; a request is
    preempted (and recomputed, prompt and tokens generated so far) only under `preempt`
    when the KV budget cannot hold max_batch of the longest requests."""
    recompute = s.preempt and s.max_batch * (longest_request + s.k + 1) > s.kv_capacity
    longest = longest_request if recompute else longest_prompt
    cut = s.max_batch * max(longest, s.k + 1) > s.max_tokens  # the budget can end a chunk
    return min(s.chunk, s.max_tokens, longest), longest > s.chunk or cut


def warm_up(w, max_batch: int, k: int, longest_chunk: int = 0, chunks_start_mid: bool = False,
            status=None) -> int:
    """Run the step shapes once before the clock starts (on a GPU: kernels compile and a
    GraphModel captures, on its scratch slot, every graph the worker's steps replay: round
    steps (not on a prefill worker) for every batch bucket up to max_batch, the target's
    decode, or verify at M = k + 1, the draft's steps at M = 1 and 2; chunk steps (not on a
    decode worker) of each length up to max_m, then every prefill graph chunks of up to
    longest_chunk tokens reach: at start 0, or with chunks_start_mid at every keys level
    (kestrel_rt/cuda/graph_shapes.py), at most WARM_PREFILL_LIMIT per model), then empty
    the slots used; status(text) says what it captures. Returns the graphs captured."""
    rows_max = min(max_batch, w.slots.num_slots)
    captured = 0
    for model in w.models:
        sizes = []
        for bucket in getattr(model, "buckets", (1,)):
            sizes.append(min(bucket, rows_max))
            if bucket >= rows_max:
                break
        steps, left_out = [], 0
        if w.role != "decode":
            steps, left_out = chunk_steps(model, longest_chunk, chunks_start_mid)
        if w.role != "prefill":
            steps += round_steps(model, w, sorted(set(sizes)), k)
        slots = list(range(max(sizes)))
        zeros = torch.zeros(len(slots), 2, dtype=torch.long)  # [rows, 2]
        Qwen3Model.forward(model, zeros, slots, last_only=True, greedy=True)  # eager path
        for s in slots:
            model.kv.rollback(s, 0)
        warm = getattr(model, "warm_steps", None)
        if warm is None:  # no graphs: each shape once, eagerly, on the first slots
            run_eagerly(model, steps)
        else:
            if status is not None:
                name = w.draft_name if model is w.draft else w.name
                status(f"warming {name}: up to {len(steps)} CUDA graphs" + (
                    f" ({left_out} prefill shapes past {WARM_PREFILL_LIMIT} left to capture "
                    "mid-run)" if left_out else ""))
            captured += warm(steps)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
    return captured


def chunk_steps(model: Qwen3Model, longest: int, start_mid: bool
                ) -> tuple[list[tuple[int, int, bool, int]], int]:
    """(the (rows, M, last_only, start) steps prompt chunks of up to `longest` tokens run,
    one per graph, prefill shapes left out past WARM_PREFILL_LIMIT)."""
    steps = [(1, n, True, 0) for n in small_chunk_lengths(model, longest)]
    buckets = getattr(model, "prefill_buckets", ())
    if not buckets:
        return steps, 0
    shapes = prefill_warm_shapes(buckets, model.kv.max_len, longest, start_mid,
                                 model.prefill_min_keys)  # by keys: the longest contexts last
    # each at the start that ends its padded chunk at its keys: a start that reaches them
    steps += [(1, bucket, True, keys - bucket) for bucket, keys in shapes[:WARM_PREFILL_LIMIT]]
    return steps, max(0, len(shapes) - WARM_PREFILL_LIMIT)


def round_steps(model: Qwen3Model, w, sizes: list[int], k: int
                ) -> list[tuple[int, int, bool, int]]:
    """The (rows, M, last_only, start) steps of a worker's rounds on `model`, per batch size."""
    if model is w.draft:
        shapes = [(1, False), (2, True)]  # (M, last_only)
    else:
        shapes = [(1, False)] + ([(k + 1, False)] if k and w.spec is not None else [])
    return [(b, m, last_only, 0) for b in sizes for m, last_only in shapes]


def run_eagerly(model: Qwen3Model, steps) -> None:
    """Each step at start 0 once, on the model's first slots, then empty them."""
    for rows, m, last_only, start in steps:
        if start == 0 and m <= model.kv.max_len:
            slots = list(range(rows))
            model.forward(torch.zeros(rows, m, dtype=torch.long), slots, last_only=last_only,
                          greedy=True)
            for s in slots:
                model.kv.rollback(s, 0)


def small_chunk_lengths(model: Qwen3Model, longest: int) -> list[int]:
    """Chunk lengths a GraphModel replays at their own length, not a prefill bucket: up to
    its max_m (none for a model without graphs), whatever their start. A prompt's last
    chunk, or one cut by what is left of max_batched_tokens, can be any of them; one first
    seen mid-run is captured then, stalling the worker (trace meta `graph_captures_in_run`)."""
    return list(range(1, min(getattr(model, "max_m", 0), longest) + 1))
