"""Timing whole speculative rounds: the target and the draft, each its own backend, as
serving runs a round (kestrel_rt/spec/round.py SpecDecoder).

    spec = build_spec(bench_plan, grid)        # both models built and prepared
    record = measure_round(spec, point)        # Record: a round's median wall time

A round point (calibration/round_grid.py) is b sequences of `context` random tokens made by
bookkeeping alone (no prefill): both caches hold all but the last token (context - 1, set by
length; kestrel_rt/spec/round.py says what each cache holds). The decoder proposes k = M - 1
tokens, greedy, with the fused correction and controlled acceptance whose per-position rates
are all 0: every round rejects every proposal, so each round starts as the one before did
(its first draft step feeds one token per sequence) and its verify runs all k + 1 tokens
per sequence (the sequences have room for them). Its spans are recorded by a Tracer, as
serving's are (their CUDA events are part of a served round's cost).

A run is one `decoder.round(seqs)`, timed by the host clock from an idle device (synchronized
before it) to its return: round() reads its result on the host, so it ends synchronized.
Before each run the sequences are made again (tokens back to `context`, both caches to
context - 1, the rows on the next window of each model's slots). A point of M = 1 (k = 0)
is a plain decode round of the target alone (measure_decode_round). Warm-up runs come first;
prepare() has captured the graphs the rounds replay (the draft's one-token steps, the
target's verify of each k), so nothing is captured in a timed run. Works on any device (the
plan measures it on a GPU only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from calibration.driver import ROTATION, warm_catch_up
from calibration.measure import Bench, Record, record_of, set_lengths
from calibration.round_grid import DRAFT_ROUND_K
from kestrel_rt.spec import SpecConfig, SpecDecoder, SpecSequence
from kestrel_rt.spec.controlled import accept_rng
from kestrel_rt.trace import Tracer

SEED = 0  # the decoder's seed: the accepted lengths are 0 whatever it draws


@dataclass
class SpecBench:
    """The target and the draft, each its own model instance, slots and runs per point."""

    name: str  # "spec@gpu"
    target: Bench
    draft: Bench
    tracer: Tracer


def proposals(point) -> int:
    """k of a point's rounds: a round point's M - 1; a draft step timed inside rounds
    (calibration/draft_rounds.py), DRAFT_ROUND_K."""
    return DRAFT_ROUND_K if point.stage == "draft" else point.m - 1


def layout(points) -> dict:
    """prepare()'s arguments for both models: slots for the largest batch to rotate over,
    room for the longest sequence and its k proposals beyond the verify (the decoder keeps
    k tokens of room), the batches and the target's verify sizes M = k + 1."""
    k = max(proposals(p) for p in points)
    longest = max(p.context + (p.m if p.stage == "draft" else 0) for p in points)
    return {"slots": ROTATION * max(p.batch for p in points),
            "max_len": longest + 2 * k + 2,
            "batches": tuple(sorted({p.batch for p in points})),
            "verify": tuple(sorted({proposals(p) + 1 for p in points}))}


def build_spec(bp, grid) -> SpecBench:
    """The round bench of a plan's `spec@...` BenchPlan (its `draft`: the draft's plan):
    both models built (calibration/driver.py bench_options) and prepared (spec@cpu: the
    draft on the CPU, its steps timed inside rounds, calibration/draft_rounds.py)."""
    from calibration.driver import bench_options
    from kestrel_rt.runner import build_model, prepare

    lay, t = layout(bp.points), grid.timing
    benches = []
    for plan, role, new_tokens in ((bp, "target", lay["verify"]), (bp.draft, "draft", (1,))):
        model = build_model(plan.model, plan.device, plan.dtype, plan.quant,
                            bench_options(plan), seed=0)
        prepare(model, lay["slots"], lay["max_len"], lay["batches"], new_tokens,
                prefill=(min(32, lay["max_len"] - 1),))
        gpu = model.device.type == "cuda"
        benches.append(Bench(f"{bp.name}/{role}", model,
                             [model.kv.allocate() for _ in range(lay["slots"])],
                             t.warmup if gpu else t.cpu_warmup,
                             t.repeats if gpu else t.cpu_repeats))
    target, draft = benches
    warm_catch_up(draft, [p for p in bp.points if p.catch_up])  # draft steps of M > 1
    return SpecBench(bp.name, target, draft, Tracer(target.model.device))


def decoder_for(spec: SpecBench, k: int) -> SpecDecoder:
    """The round's decoder: k proposals, greedy, fused, every proposal rejected."""
    config = SpecConfig.parse(k=k, correction="fused", seed=SEED,
                              acceptance={"per_position": [0.0] * k})
    return SpecDecoder(spec.target.model, spec.draft.model, config, spec.tracer)


def synchronize(spec: SpecBench) -> None:
    for bench in (spec.target, spec.draft):
        if bench.on_gpu:
            torch.cuda.synchronize(bench.model.device)


def measure_round(spec: SpecBench, point) -> Record:
    """Time one round point; see the module docstring."""
    if point.m == 1:
        return measure_decode_round(spec, point)
    target, draft = spec.target, spec.draft
    b, c, k = point.batch, point.context, point.m - 1
    decoder = decoder_for(spec, k)
    vocab = target.model.shape.vocab_size
    prompts = torch.randint(0, vocab, (b, c)).tolist()  # b lists of c token ids

    def setup() -> list[SpecSequence]:
        spec.tracer.collect()  # the last run's spans, dropped
        tslots, dslots = target.take(b), draft.take(b)
        set_lengths(target.model.kv, tslots, c - 1)
        set_lengths(draft.model.kv, dslots, c - 1)
        return [SpecSequence(i, list(prompts[i]), c, k + 1, ts, ds,
                             accept_rng=accept_rng(SEED, i))
                for i, (ts, ds) in enumerate(zip(tslots, dslots))]

    def run(seqs: list[SpecSequence]) -> None:
        emitted = decoder.round(seqs)
        if any(len(tokens) != 1 for tokens in emitted):
            raise RuntimeError(f"{point.id}: a round accepted a proposal (emitted "
                               f"{[len(t) for t in emitted]} tokens per sequence)")

    try:
        times = host_timed(spec, setup, run)
    finally:
        spec.tracer.collect()
        set_lengths(target.model.kv, target.slots, 0)
        set_lengths(draft.model.kv, draft.slots, 0)
    return record_of(point, times)


def host_timed(spec: SpecBench, setup, run) -> list[float]:
    """setup() -> state, untimed; run(state) timed by the host clock from an idle device
    (ms); the target bench's warm-up runs first, its timed runs returned."""
    target = spec.target
    times = []
    for i in range(target.warmup + target.repeats):
        state = setup()
        synchronize(spec)
        t0 = time.perf_counter()
        run(state)
        elapsed = (time.perf_counter() - t0) * 1e3
        if i >= target.warmup:
            times.append(elapsed)
    return times


def measure_decode_round(spec: SpecBench, point) -> Record:
    """A plain decode round (k = 0) as serving runs one it cannot launch ahead: the target's
    greedy step over b sequences of `context` - 1 cached tokens, then the host's read of its
    ids (kestrel_rt/serve/forward.py decode_forward and run_step), timed by the host clock
    from an idle device."""
    target = spec.target
    b, c = point.batch, point.context
    model = target.model
    tokens = torch.randint(0, model.shape.vocab_size, (b, 1))  # [b, 1] on the host

    def setup() -> list[int]:
        slots = target.take(b)
        set_lengths(model.kv, slots, c - 1)
        return slots

    try:
        times = host_timed(spec, setup,
                           lambda slots: model.forward(tokens, slots, greedy=True)[:, 0].tolist())
    finally:
        set_lengths(model.kv, target.slots, 0)
    return record_of(point, times)
