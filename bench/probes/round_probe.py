"""What a speculative round costs beyond its stages: timed as calibration times it, and
back to back as serving runs it.

    python bench/probes/round_probe.py [--target qwen3-8b] [--draft qwen3-0.6b]
                                       [--batch 4] [--ks 1,4] [--rounds 60]

Why: the simulator adds the round overhead that calibration fitted (0.61 ms + 0.025 ms a
sequence, from `round` rows timed one at a time from an idle device, calibration/rounds.py).
In the served spec-k1-fused run the loop's gaps came to 0.25 ms a round, where the simulator's
came to 0.73 ms: its TPOT is 10% long (docs/validation.md). This times the same rounds three
ways, on one pair of dummy-weight models:
- one: each round from an idle device (synchronized first), by the host clock, as
  calibration does;
- back to back: `rounds` rounds in a row, each after the previous one's read (as serving's
  loop runs them), by the host clock over all of them;
- spans: the same back-to-back rounds' traced spans (CUDA events), summed per round; what
  the loop adds between them is the round time less this.
Every proposal is rejected (controlled acceptance 0, as calibration's round rows), so each
round starts as the one before did. It prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from kestrel_rt.runner import build_model, prepare
from kestrel_rt.spec import SpecConfig, SpecDecoder, SpecSequence
from kestrel_rt.spec.controlled import accept_rng
from kestrel_rt.trace import Tracer

CONTEXT = 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--draft", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ks", default="1,4")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    b, kmax = args.batch, max(ks)
    max_len = CONTEXT + args.rounds + 2 * kmax + 8  # back to back, a token a round
    target = build_model(args.target, args.device, seed=0)
    draft = build_model(args.draft, args.device, seed=0)
    prepare(target, b, max_len, (b,), tuple(k + 1 for k in ks), (32,))
    prepare(draft, b, max_len, (b,), (1,), (32,))
    tslots = [target.kv.allocate() for _ in range(b)]
    dslots = [draft.kv.allocate() for _ in range(b)]
    tracer = Tracer(target.device)
    prompts = torch.randint(0, target.shape.vocab_size, (b, CONTEXT)).tolist()
    gpu = target.device.type == "cuda"

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(target.device)

    def fresh() -> list[SpecSequence]:
        for kv, slots in ((target.kv, tslots), (draft.kv, dslots)):
            for s in slots:
                kv.rollback(s, 0)
            kv.advance(slots, [CONTEXT - 1] * b)
        return [SpecSequence(i, list(prompts[i]), CONTEXT, 10**6, tslots[i], dslots[i],
                             accept_rng=accept_rng(0, i)) for i in range(b)]

    rows = []
    for k in ks:
        config = SpecConfig.parse(k=k, correction="fused", seed=0,
                                  acceptance={"per_position": [0.0] * k})
        decoder = SpecDecoder(target, draft, config, tracer)
        one = []
        for i in range(2 + args.rounds // 4):  # as calibration: a fresh round from idle
            seqs = fresh()
            sync()
            t0 = time.perf_counter()
            decoder.round(seqs)
            if i >= 2:
                one.append((time.perf_counter() - t0) * 1e3)
        tracer.collect()
        seqs = fresh()
        for _ in range(2):
            decoder.round(seqs)  # warm, then back to back
        tracer.collect()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            decoder.round(seqs)  # each emits one token a sequence (all rejected)
        loop = (time.perf_counter() - t0) * 1e3 / args.rounds
        spans = sum(s.end - s.start for s in tracer.collect()) * 1e3 / args.rounds
        rows.append((k, statistics.median(one), loop, spans))
    print(f"\n{args.target} + {args.draft}, batch {b}, context {CONTEXT}, every proposal "
          f"rejected; ms per round ({args.device})\n")
    print("| k | one, from idle (calibration) | back to back (serving) | its spans | "
          "between spans |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for k, one, loop, spans in rows:
        print(f"| {k} | {one:.3f} | {loop:.3f} | {spans:.3f} | {loop - spans:.3f} |")


if __name__ == "__main__":
    main()
