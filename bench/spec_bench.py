"""Speculative decoding on one GPU: stage times, end-to-end rates, and the rate the stage
times predict (issue 24's performance table), in one run.

    python bench/spec_bench.py --out DIR [--commit HASH] [--quick]

1. stage times (median device time of a CUDA-graph replay, batch 1, `CONTEXT` cached
   tokens): the target's decode step (= a separate correction), its verify at M = k + 1 for
   k = 1..8, the draft's step on the GPU, and on the CPU (host clock), a 512-token prefill
   of each model, and a mixed step (a decode step then a 512-token chunk, as serving runs
   it);
2. plain greedy decode of the target (kestrel_rt.engine.generate: the overlapped loop);
3. speculative generation of one request (kestrel_rt.spec.speculative_generate) for k =
   1..8, fused and separate, controlled acceptance alpha = 0.3 / 0.5 / 0.7 / 0.9 (the real
   draft, verify and correction work), the draft on the GPU, and a few on the CPU; each row
   with its rate, tokens per round, the rate its own stage times predict (tokens per round /
   (k draft steps + verify [+ correction])), how much of the decode time the traced
   stages cover, and how many rounds ran ahead of the host (kestrel_rt/spec/ahead.py:
   controlled, greedy, fused); the headline row also with run_ahead off;
4. the organic pair: qwen3-0.6b against its quantized copy (int4 in the last 14 layers),
   accepting for real.
Writes DIR/spec_bench.md and .json and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from kestrel_rt.engine import generate
from kestrel_rt.runner import build_model, prepare
from kestrel_rt.spec import SpecConfig, speculative_generate
from kestrel_rt.trace import Tracer
from kestrel_sim.scenario import Acceptance
from kestrel_sim.traced import length

TARGET, DRAFT = "qwen3-8b", "qwen3-0.6b"
CONTEXT = 128  # prompt tokens: the context the stages are timed at
NEW = 192  # tokens generated per end-to-end row
KS = tuple(range(1, 9))
ALPHAS = (0.3, 0.5, 0.7, 0.9)
KEY_RUNS = 5  # the headline row (k = 4, fused, alpha 0.8): its median run; one run is ~0.45 s
ORGANIC_QUANT = "int4-last-14"  # kestrel_rt/spec/organic.py: 0.67 per token on qwen3-0.6b


def cpu_step_ms(model, reps: int = 8) -> float:
    """Median host milliseconds of one [1, 1] greedy step of a CPU model at CONTEXT."""
    kv = model.kv
    slot = kv.allocate()
    kv.advance([slot], [CONTEXT])
    times = []
    tok = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        model.forward(tok, [slot], greedy=True)
        times.append((time.perf_counter() - t0) * 1e3)
        kv.rollback(slot, CONTEXT)
    kv.free(slot)
    return statistics.median(times[1:])


def mixed_ms(model, chunk: int, reps: int = 5) -> float:
    """A decode step of one sequence then a `chunk`-token prefill chunk of another, one after
    the other as serving runs a mixed step (kestrel_rt/serve/forward.py), device time."""
    kv = model.kv
    a, b = kv.allocate(), kv.allocate()
    kv.advance([a], [CONTEXT])
    tok, prompt = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, chunk, dtype=torch.long)
    times = []
    for _ in range(reps + 1):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        model.forward(tok, [a], greedy=True)
        model.forward(prompt, [b], last_only=True, greedy=True)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        kv.rollback(a, CONTEXT)
        kv.rollback(b, 0)
    kv.free(a)
    kv.free(b)
    return statistics.median(times[1:])


def coverage(spans, seconds: float) -> float:
    """Fraction of `seconds` covered by the union of the round's traced spans."""
    stages = [(s.start, s.end) for s in spans if s.kind in ("draft", "verify", "correction")]
    return length(stages) / seconds if seconds > 0 else 0.0


class Bench:
    def __init__(self, out: Path, quick: bool):
        self.out, self.quick = out, quick
        self.gen = torch.Generator().manual_seed(0)
        self.stages: dict[str, float] = {}
        self.rows: list[dict] = []

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def stage_times(self, target, draft, cpu_draft) -> None:
        steps = 24 if self.quick else 64
        st = self.stages
        st["decode"] = measure.time_steps(target, 1, 1, CONTEXT, steps, self.gen)["ms"]
        for k in KS:
            st[f"verify k={k}"] = measure.time_steps(target, 1, k + 1, CONTEXT, steps,
                                                     self.gen)["ms"]
        st["draft (gpu)"] = measure.time_steps(draft, 1, 1, CONTEXT, steps, self.gen)["ms"]
        if cpu_draft is not None:
            st["draft (cpu)"] = cpu_step_ms(cpu_draft)
        st["prefill 512 (target)"] = measure.time_prefill(target, 512, 3, self.gen)["ms"]
        st["prefill 512 (draft)"] = measure.time_prefill(draft, 512, 3, self.gen)["ms"]
        st["mixed: decode + 512 chunk"] = mixed_ms(target, 512)
        self.log(json.dumps(st))

    def plain(self, target, label: str) -> float:
        prompt = torch.randint(0, target.shape.vocab_size, (CONTEXT,), generator=self.gen)
        r = generate(target, [prompt.tolist()], NEW)
        self.rows.append({"run": label, "k": 0, "correction": "-", "alpha": None,
                          "tok_s": r.decode_tokens_per_s, "tokens_per_round": 1.0,
                          "predicted_tok_s": 1e3 / self.stages.get("decode", float("nan")),
                          "coverage": None, "rounds_ahead": None})
        self.log(json.dumps(self.rows[-1]))
        return r.decode_tokens_per_s

    def speculative(self, target, draft, k: int, correction: str, alpha: float | None,
                    label: str, draft_ms: float, run_ahead: bool = True) -> dict:
        prompt = torch.randint(0, target.shape.vocab_size, (CONTEXT,), generator=self.gen)
        tracer = Tracer(target.device)
        acceptance = None if alpha is None else Acceptance(alpha=alpha)
        config = SpecConfig(k=k, correction=correction, acceptance=acceptance, seed=0)
        r = speculative_generate(target, draft, [prompt.tolist()], NEW, config, tracer=tracer,
                                 run_ahead=run_ahead)
        spans = tracer.collect()
        rounds = max(r.decode_steps, 1)
        per_round = (r.generated_tokens - 1) / rounds  # the first token comes from prefill
        cost = k * draft_ms + self.stages[f"verify k={k}"]
        if correction == "separate":
            cost += self.stages["decode"]
        row = {"run": label, "k": k, "correction": correction, "alpha": alpha,
               "tok_s": (r.generated_tokens - 1) / r.decode_s, "tokens_per_round": per_round,
               "predicted_tok_s": per_round / cost * 1e3,
               "coverage": coverage([s for s in spans if s.start >= 0], r.decode_s),
               "acceptance_length": r.stats.acceptance_length,
               "rounds": r.decode_steps, "rounds_ahead": r.rounds_ahead}
        self.rows.append(row)
        self.log(json.dumps(row))
        return row

    def run(self, commit: str | None) -> None:
        props = torch.cuda.get_device_properties(0)
        max_len = max(CONTEXT + NEW, CONTEXT + 512) + 16  # the mixed step's 512-token chunk
        self.log(f"build {TARGET} and {DRAFT}")
        target = build_model(TARGET, "cuda")
        prepare(target, 2, max_len, new_tokens=(1, *[k + 1 for k in KS]),
                prefill=(CONTEXT, 512))
        draft = build_model(DRAFT, "cuda")
        prepare(draft, 2, max_len, prefill=(CONTEXT, 512, 2))
        cpu_draft = None if self.quick else build_model(DRAFT, "cpu")
        if cpu_draft is not None:
            cpu_draft.allocate_kv(2, max_len)
        self.stage_times(target, draft, cpu_draft)
        plain = self.plain(target, f"{TARGET} plain")
        for k in (KS if not self.quick else (1, 4, 8)):
            for correction in ("fused", "separate"):
                for alpha in (ALPHAS if not self.quick else (0.8,)):
                    self.speculative(target, draft, k, correction, alpha,
                                     f"{TARGET} + {DRAFT} (gpu)", self.stages["draft (gpu)"])
        keys = sorted((self.speculative(target, draft, 4, "fused", 0.8,
                                        f"{TARGET} + {DRAFT} (gpu)", self.stages["draft (gpu)"])
                       for _ in range(KEY_RUNS)), key=lambda r: r["tok_s"])
        key = dict(keys[KEY_RUNS // 2], runs=[r["tok_s"] for r in keys])
        key["round_by_round"] = statistics.median(
            self.speculative(target, draft, 4, "fused", 0.8,
                             f"{TARGET} + {DRAFT} (gpu), run_ahead off",
                             self.stages["draft (gpu)"], run_ahead=False)["tok_s"]
            for _ in range(KEY_RUNS))
        if cpu_draft is not None:
            for k in (1, 4):
                self.speculative(target, cpu_draft, k, "fused", 0.8,
                                 f"{TARGET} + {DRAFT} (cpu)", self.stages["draft (cpu)"])
        del target, draft, cpu_draft
        torch.cuda.empty_cache()
        self.organic()
        self.write(props.name, commit, plain, key)

    def organic(self) -> None:
        """qwen3-0.6b and its quantized copy (same seed: the same dummy weights), organic."""
        max_len = CONTEXT + NEW + 16
        target = build_model(DRAFT, "cuda")
        prepare(target, 2, max_len, new_tokens=(1, 5), prefill=(CONTEXT,))
        draft = build_model(DRAFT, "cuda", quant=ORGANIC_QUANT)
        prepare(draft, 2, max_len, prefill=(CONTEXT, 2))
        saved = dict(self.stages)
        self.stages["decode"] = measure.time_steps(target, 1, 1, CONTEXT, 32, self.gen)["ms"]
        self.stages["verify k=4"] = measure.time_steps(target, 1, 5, CONTEXT, 32, self.gen)["ms"]
        draft_ms = measure.time_steps(draft, 1, 1, CONTEXT, 32, self.gen)["ms"]
        self.plain(target, f"{DRAFT} plain")
        self.speculative(target, draft, 4, "fused", None,
                         f"organic: {DRAFT} + its {ORGANIC_QUANT} copy", draft_ms)
        self.stages = saved

    def write(self, device: str, commit: str | None, plain: float, key: dict) -> None:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        lines = [f"# Speculative decoding: {device}, {when}", "",
                 (f"commit {commit}; `python bench/spec_bench.py --out DIR --commit HASH`; "
                  f"batch 1, {CONTEXT}-token prompt, {NEW} new tokens, dummy weights."), "",
                 "| stage | ms |", "| --- | ---: |"]
        lines += [f"| {name} | {ms:.3f} |" for name, ms in self.stages.items()]
        lines += ["", ("| run | k | correction | alpha | tok/s | tokens / round | "
                       "predicted tok/s | of predicted | traced | ahead |"),
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in self.rows:
            cov = "" if r["coverage"] is None else f"{r['coverage']:.1%}"
            ahead = "" if r["rounds_ahead"] is None else f"{r['rounds_ahead']}/{r['rounds']}"
            lines.append(f"| {r['run']} | {r['k']} | {r['correction']} | {r['alpha'] or ''} | "
                         f"{r['tok_s']:.1f} | {r['tokens_per_round']:.2f} | "
                         f"{r['predicted_tok_s']:.1f} | {r['tok_s'] / r['predicted_tok_s']:.1%} "
                         f"| {cov} | {ahead} |")
        spread = ", ".join(f"{x:.1f}" for x in key["runs"])
        lines += ["", (f"k = 4, fused, alpha 0.8, the median of {len(key['runs'])} runs "
                       f"({spread} tok/s): {key['tok_s']:.1f} tok/s = "
                       f"{key['tok_s'] / plain:.2f}x plain decode ({plain:.1f} tok/s), "
                       f"{key['tok_s'] / key['predicted_tok_s']:.1%} of its stage-time rate "
                       f"({key['rounds_ahead']} of {key['rounds']} rounds ahead; round by "
                       f"round, the median of {KEY_RUNS}: {key['round_by_round']:.1f} tok/s).")]
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "spec_bench.md").write_text("\n".join(lines) + "\n")
        (self.out / "spec_bench.json").write_text(json.dumps(
            {"device": device, "commit": commit, "stages_ms": self.stages, "rows": self.rows},
            indent=1))
        print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rows (a smoke run)")
    args = ap.parse_args()
    Bench(args.out, args.quick).run(args.commit)


if __name__ == "__main__":
    main()
