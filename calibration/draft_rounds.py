"""Timing the draft's steps inside speculative rounds, where serving runs a draft on the host
CPU (grid `draft.cpu.timed: in_rounds`).

    spec = build_spec(bench_plan, grid)             # calibration/rounds.py: target + draft
    record = measure_draft_in_rounds(spec, point)   # Record: a draft step's median, host clock

Why: a CPU draft step timed alone, back to back in a process that holds nothing else, is
not quite the step serving runs. Serving runs it in a process whose target runs on the GPU,
the host waiting for each verify and reading it between the draft's steps. On the H200's
host (2026-12-02, same device session) draft-cpu's batch-1 one-token steps took 48.3 ms
served against 37.1 ms in the profile's row timed alone, while its batch-2 and catch-up
steps were within 2-4% of theirs; these rows are timed as served to tell the two apart.

A point (b, M, context) of the bench `spec@DEVICE` is timed as the first draft step of
rounds of DRAFT_ROUND_K proposals: b sequences of context + M tokens, the draft's cache
holding `context` of them (M = 1, a round's plain first step; M = 2, the catch-up step after
a round that accepted every proposal), the target's all but the last. A run is one
`SpecDecoder.round` (greedy, fused, every proposal rejected: calibration/rounds.py
decoder_for), its draft steps timed by the decoder's tracer as serving's are (the host
clock for a CPU draft), its verify on the target's device between one run's draft steps and
the next's. A one-token point also takes the round's later steps (one token at context + 1,
...), which follow a draft step rather than a verify, as served rounds' later steps do; a
catch-up point its first step only. The record is the median of those steps' times over the
draft bench's timed runs, after its warm-up runs.
"""

from __future__ import annotations

import torch

from calibration.measure import Record, record_of, set_lengths
from calibration.round_grid import DRAFT_ROUND_K
from calibration.rounds import SEED, SpecBench, decoder_for
from kestrel_rt.spec import SpecSequence
from kestrel_rt.spec.controlled import accept_rng


def measure_draft_in_rounds(spec: SpecBench, point) -> Record:
    """Time one draft step point inside rounds; see the module docstring."""
    target, draft = spec.target, spec.draft
    b, m, c, k = point.batch, point.m, point.context, DRAFT_ROUND_K
    decoder = decoder_for(spec, k)
    vocab = target.model.shape.vocab_size
    prompts = torch.randint(0, vocab, (b, c + m)).tolist()  # b lists of c + M token ids
    samples: list[float] = []
    try:
        for run in range(draft.warmup + draft.repeats):
            spec.tracer.collect()  # the last run's spans, dropped
            tslots, dslots = target.take(b), draft.take(b)
            set_lengths(target.model.kv, tslots, c + m - 1)  # all but the last token
            set_lengths(draft.model.kv, dslots, c)  # M tokens behind
            seqs = [SpecSequence(i, list(prompts[i]), c + m, k + 1, ts, ds,
                                 accept_rng=accept_rng(SEED, i))
                    for i, (ts, ds) in enumerate(zip(tslots, dslots))]
            emitted = decoder.round(seqs)
            if any(len(tokens) != 1 for tokens in emitted):
                raise RuntimeError(f"{point.id}: a round accepted a proposal")
            steps = sorted((s for s in spec.tracer.collect() if s.kind == "draft"),
                           key=lambda s: s.start)  # step 1 (M tokens), then 2..k (one)
            if len(steps) != k or steps[0].tokens != b * m:
                raise RuntimeError(f"{point.id}: the round's draft steps were "
                                   f"{[s.tokens for s in steps]} tokens, expected {b * m} "
                                   f"then {b} x {k - 1}")
            if run >= draft.warmup:
                samples += [(s.end - s.start) * 1e3 for s in (steps if m == 1 else steps[:1])]
    finally:
        spec.tracer.collect()
        set_lengths(target.model.kv, target.slots, 0)
        set_lengths(draft.model.kv, draft.slots, 0)
    return record_of(point, samples)
