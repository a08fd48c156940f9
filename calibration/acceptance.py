"""The draft pair's acceptance, measured on the calibration's device as serving would run it.

    ap = plan_acceptance(request, benches)     # None unless --draft-quant (an organic copy)
    block = run_acceptance(ap)                 # kestrel_sim MeasuredAcceptance: the Profile's
                                               # `acceptance` block

A draft made of the target's own dummy weights (a quantized copy: `--draft-quant`) agrees
with it for real, and how often depends on the numbers the device computes (bf16 cupy
kernels on a GPU, fp32 torch on a CPU), so it is measured where the pair is calibrated:
both models built as serving builds them (kestrel_rt/runner.py build_model with the bench's
device, dtype, quantization and options), `prompts` prompts of `prompt_tokens` ids drawn
as serving draws a scenario's (kestrel_rt/serve/requests.py prompt_ids, workload seed 0:
the first prompts of a scenario of that length and seed), prefilled a few prompts per
forward, then `rounds` greedy speculative rounds of k proposals, fused (kestrel_rt/spec
SpecDecoder), all sequences in one batch. k is the grid's largest k (verify, round, mixed), so a scenario of any k the
profile prices takes the first k rates (kestrel_sim/measured_acceptance.py). Each sequence
has room for every round's k proposals, so every draft proposes k: a round that emits n + 1
tokens accepted n.

Besides the pooled counts, the block records each sequence's agreement string (`sequences`:
'1' where the draft, given the true prefix, proposed the target's token, '0' a round's
correction, '?' the bonus after a round that kept all k; kestrel_sim/measured_acceptance.py),
which the simulator replays one per request. Sequence j's rounds are lengths[j::prompts] of
measure_pair's lengths (round by round, the sequences in order in each).

On dummy weights the first tokens of a generation agree least (organic.py's rates below count
each sequence's first 32 tokens only), and sequences differ from each other, so on a GPU the
rounds cover more tokens than a served request emits (128 rounds: ~550 tokens at k = 8 for
the organic pair's ~4.3 tokens a round, ~190 for a sequence of 1.5 a round), so a replayed
request rarely runs past its sequence's end (the pooled rates then count tokens later than a
served request's too). A CPU measures 32 rounds (about as many tokens as a served request:
~140 at k = 8), what the fp32 torch backend's time allows. Measured 2026-12-02 for qwen3-0.6b and its
int4-last-14 copy, conditional acceptance at positions 1..4:

| where                                                         | rates                     |
| ------------------------------------------------------------- | ------------------------- |
| this measurement, CPU fp32 torch, k = 8, 256 drafts           | 0.63 / 0.81 / 0.96 / 0.94 |
| served on the H200 (bf16 cupy), spec-organic-int4-copy, k = 4 | 0.58 / 0.86 / 0.91 / 0.93 |
| kestrel_rt/spec/organic.py: 6 x 16-token prompts, 32 tokens   | 0.49 / 0.76 / 0.89 / 0.77 |

(the first row: `kestrel calibrate --model qwen3-0.6b --draft qwen3-0.6b --draft-quant
int4-last-14 --device cpu --grid G` with G holding only `verify: {batches: [1], k: [4, 8],
contexts: [8]}`; 48 minutes on 2 shared cores, the draft's projections dequantized at every
forward. The H200's row: bench/results/validation/measured.json.gz.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibration.estimate import CPU, GPU, build_seconds, param_counts, step_seconds

if TYPE_CHECKING:
    from calibration.grid import Grid
    from calibration.plan import BenchPlan, Request

DEFAULT_K = 8  # where the grid has no k (no verify, round or mixed section)
PROMPT_TOKENS = 512  # the validation suite's organic scenario's prompts
# rounds per sequence: ~550 / ~150 generated tokens at k = 8 (the organic pair's ~4.3 a round);
# `kestrel calibrate --dry-run` estimates the H200's step at 15 s with 128 (12.6 s with 32,
# which took 2.1 s there)
ROUNDS = {"gpu": 128, "cpu": 32}
PROMPTS = {"gpu": 64, "cpu": 8}  # sequences (one batch): 8192 / 256 drafts at position 0
MIN_PROMPT_TOKENS = 4
PREFILL_TOKENS = 4096  # prompt tokens per prefill forward, at most (whole prompts)
SEED = 0  # the workload seed the prompts are drawn with
CAPTURES = 12  # graphs a GPU measurement captures on the way (prefill, steps, verify)
# the torch backend dequantizes a quantized projection at every forward: qwen3-0.6b's
# int4-last-14 copy (0.44 G projection params) took 1.1-1.5 s a forward on 2 CPU cores
# (a batch-8 draft step 1.7-2 s, the fp32 target's 0.44 s), 2026-12-02
CPU_DEQUANT_S_PER_PARAM = 3e-9


@dataclass
class AcceptancePlan:
    """What run_acceptance builds (the two BenchPlans: device, dtype, quant) and runs."""

    target: BenchPlan
    draft: BenchPlan
    k: int
    prompts: int
    prompt_tokens: int
    rounds: int

    name = "acceptance"

    def describe(self) -> str:
        return (f"the pair's acceptance: {self.prompts} prompts of {self.prompt_tokens} tokens, "
                f"{self.rounds} greedy rounds of k = {self.k} each "
                f"({self.prompts * self.rounds} drafts), draft on the {self.draft_device}")

    @property
    def draft_device(self) -> str:
        return "gpu" if self.draft.device.startswith("cuda") else "cpu"


def grid_k(grid: Grid) -> int:
    """The largest k the grid prices (verify, round and mixed sections), or DEFAULT_K."""
    ks = [k for section in (grid.verify, grid.round, grid.mixed) if section is not None
          for k in section.k]
    return max(ks, default=0) or DEFAULT_K


def plan_acceptance(request: Request, benches: list[BenchPlan]) -> AcceptancePlan | None:
    """The acceptance measurement of a calibration with an organic draft (--draft-quant),
    with the draft where serving would run it (the GPU when it is measured there), else
    None. `benches`: make_plan's, before those without points are dropped."""
    if request.draft is None or request.draft_quant is None:
        return None
    target = benches[0]
    drafts = {b.name: b for b in benches if b.name.startswith("draft@")}
    draft = drafts.get("draft@gpu") or drafts.get("draft@cpu")
    if draft is None:
        return None
    k = grid_k(request.grid)
    gpu = target.device.startswith("cuda")
    rounds = ROUNDS["gpu" if gpu else "cpu"]
    context = min(target.shape.max_position_embeddings, draft.shape.max_position_embeddings)
    while rounds > 1 and context - sequence_tokens(0, rounds, k) < MIN_PROMPT_TOKENS:
        rounds //= 2
    prompt_tokens = min(PROMPT_TOKENS, context - sequence_tokens(0, rounds, k))
    if prompt_tokens < 1:
        return None
    return AcceptancePlan(target, draft, k, PROMPTS["gpu" if gpu else "cpu"], prompt_tokens,
                          rounds)


def sequence_tokens(prompt_tokens: int, rounds: int, k: int) -> int:
    """The most tokens a sequence reaches: its prompt, the first token, k + 1 a round."""
    return prompt_tokens + 1 + rounds * (k + 1)


def acceptance_seconds(ap: AcceptancePlan) -> float:
    """The estimate: both builds, the prompts' prefill and the rounds (k draft steps and a
    verify each, at the mean context), erring long as calibration/estimate.py does."""
    from calibration.plan import itemsize

    t, d = ap.target, ap.draft
    t_speed = GPU if t.device.startswith("cuda") else CPU
    d_speed = GPU if d.device.startswith("cuda") else CPU
    t_size, d_size = itemsize(t.dtype), itemsize(d.dtype)
    context = ap.prompt_tokens + ap.rounds * (ap.k + 1) // 2
    b = ap.prompts
    seconds = (build_seconds(t.shape, t_speed, t_size, t.quant, 0)
               + build_seconds(d.shape, d_speed, d_size, d.quant, 0)
               + step_seconds(t.shape, t_speed, t_size, t.quant, b, ap.prompt_tokens, 0, False)
               + step_seconds(d.shape, d_speed, d_size, d.quant, b, ap.prompt_tokens, 0, False))
    per_round = (ap.k * (step_seconds(d.shape, d_speed, d_size, d.quant, b, 1, context, True)
                         + dequantize_seconds(d))
                 + step_seconds(t.shape, t_speed, t_size, t.quant, b, ap.k + 1, context, True)
                 + dequantize_seconds(t))
    captures = CAPTURES * 0.1 if t_speed is GPU else 0.0
    return seconds + ap.rounds * per_round + captures


def dequantize_seconds(bp: BenchPlan) -> float:
    """Per forward of a quantized model on a CPU: its projections dequantized (torch)."""
    if bp.device.startswith("cuda") or bp.quant in (None, "none"):
        return 0.0
    return param_counts(bp.shape)[0] * CPU_DEQUANT_S_PER_PARAM


def measure_pair(target, draft, prompts: list[list[int]], k: int, rounds: int):
    """Greedy speculative rounds of `draft` for `target` (each its own backend), all
    prompts in one batch: (accepted lengths, one per draft, round by round, the prompts in
    order in each round: prompt j's are lengths[j::len(prompts)]; the decoder's SpecStats of
    the same rounds). Every draft proposes k tokens (the sequences are given room for all
    rounds), so a round that emits n + 1 tokens accepted n."""
    from kestrel_rt.spec import SpecConfig, SpecDecoder

    decoder = SpecDecoder(target, draft, SpecConfig(k=k, correction="fused"))
    new_tokens = sequence_tokens(0, rounds, k)
    decoder.allocate_kv(len(prompts), max(map(len, prompts)) + new_tokens)
    seqs = [decoder.add(i, p, new_tokens) for i, p in enumerate(prompts)]
    group = max(1, PREFILL_TOKENS // max(map(len, prompts)))
    for i in range(0, len(seqs), group):  # prompt chunks of a size serving steps take
        decoder.prefill(seqs[i: i + group])
    lengths = []
    for _ in range(rounds):
        emitted = decoder.round(seqs)
        lengths += [len(tokens) - 1 for tokens in emitted]
    for s in seqs:
        decoder.release(s)
    if decoder.stats.draft_tokens != k * len(lengths):
        raise RuntimeError(f"the acceptance measurement's drafts proposed "
                           f"{decoder.stats.draft_tokens} tokens, not k = {k} each: a "
                           "sequence ran out of room")
    return lengths, decoder.stats


def run_acceptance(ap: AcceptancePlan):
    """Build the pair as serving would (calibration/driver.py bench_options), measure it
    (measure_pair) and free it: the Profile's MeasuredAcceptance."""
    import numpy as np
    import torch

    from calibration.driver import bench_options, model_name, release
    from calibration.fingerprint import environment
    from kestrel_rt.runner import build_model
    from kestrel_rt.serve.requests import prompt_ids
    from kestrel_sim.measured_acceptance import MeasuredAcceptance, agreement

    t0 = time.monotonic()
    t, d = ap.target, ap.draft
    options = bench_options(t)
    models = []
    try:
        for bp, bp_options in ((t, options), (d, bench_options(d))):
            models.append(build_model(bp.model, bp.device, bp.dtype, bp.quant, bp_options,
                                      seed=0))
        prompts = prompt_ids(SEED, np.full(ap.prompts, ap.prompt_tokens),
                             models[0].shape.vocab_size)
        lengths, _ = measure_pair(*models, prompts, ap.k, ap.rounds)
    finally:
        models.clear()  # the models go before their memory is reclaimed
        for device in dict.fromkeys((t.device, d.device)):
            release(device)
    backend = options.backend + ("+graphs" if options.graphs else "")
    sequences = [agreement(lengths[j::ap.prompts], ap.k) for j in range(ap.prompts)]
    return MeasuredAcceptance.from_lengths(
        lengths, ap.k, draft_model=model_name(d.model), draft_quant=d.quant or "none",
        device=environment(torch.device(t.device))["device"], draft_device=ap.draft_device,
        dtype=t.dtype, backend=backend, prompts=ap.prompts, prompt_tokens=ap.prompt_tokens,
        rounds=ap.rounds, sequences=sequences, seconds=round(time.monotonic() - t0, 1))


def measure_planned(ap: AcceptancePlan, outcome, reporter, deadline: float | None) -> None:
    """The driver's hook: measure into outcome.acceptance, or record why not in
    outcome.failures["acceptance"] (past the --max-minutes deadline: skipped)."""
    from calibration.driver import SKIPPED, describe

    if deadline is not None and time.monotonic() > deadline:
        outcome.failures[ap.name] = SKIPPED
        reporter.measured_acceptance(ap, None, SKIPPED)
        return
    reporter.measuring_acceptance(ap)
    try:
        outcome.acceptance = run_acceptance(ap)
    except Exception as err:  # noqa: BLE001 - the stage costs stand without it
        outcome.failures[ap.name] = f"measuring the acceptance failed: {describe(err)}"
        reporter.measured_acceptance(ap, None, outcome.failures[ap.name])
        return
    reporter.measured_acceptance(ap, outcome.acceptance, None)
