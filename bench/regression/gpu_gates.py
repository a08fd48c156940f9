"""The GPU's gates: decode step, verify and speculative round times of qwen3-8b (bf16, dummy
weights, real shapes) with a qwen3-0.6b draft, on the machine's first CUDA device.

    models = build()                     # target and draft, graphs captured
    times = measure(models)              # gate -> milliseconds

Steps are timed as `kestrel calibrate` times them (calibration/measure.py: CUDA events,
warm-up runs first, the median of the repeats); a speculative round is a whole round of
kestrel_rt.spec (k draft steps, the verify, acceptance and rollback, host work included),
its time the decode seconds of a batch-1 controlled generation over its rounds. Baselines:
baselines/gpu_h200.json, milliseconds, recorded on an H200 (tests/bench/test_gpu_gates.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TARGET, DRAFT = "qwen3-8b", "qwen3-0.6b"
CONTEXT = 512  # cached tokens per sequence for the timed steps
K = 4  # draft tokens per round
ROUND_TOKENS = 256  # new tokens of the timed speculative generation
# gate -> (model, stage, batch, new tokens per sequence)
STEPS = {
    "decode_b1_ms": ("target", "decode", 1, 1),
    "decode_b32_ms": ("target", "decode", 32, 1),
    "verify_k4_b1_ms": ("target", "verify", 1, K + 1),
    "verify_k4_b16_ms": ("target", "verify", 16, K + 1),
    "draft_step_b1_ms": ("draft", "draft", 1, 1),
}
ROUNDS = ("spec_round_k4_fused_ms", "spec_round_k4_separate_ms")


@dataclass
class Models:
    target: object
    draft: object
    slots: dict  # model name -> its KV slots


def build(device: str = "cuda", target: str = TARGET, draft: str = DRAFT,
          context: int = CONTEXT, round_tokens: int = ROUND_TOKENS) -> Models:
    """Both models, KV for the largest step, graphs of every timed shape captured (a CPU
    run with small models checks the code path: tests/bench/test_gpu_gates.py)."""
    from kestrel_rt.runner import build_model, prepare

    batches = tuple(sorted({b for _, _, b, _ in STEPS.values()}))
    max_len = context + round_tokens + 2 * (K + 1) + 64
    models = {}
    for name, which, new_tokens in (("target", target, (1, K + 1)), ("draft", draft, (1,))):
        models[name] = build_model(which, device, seed=0)
        prepare(models[name], max(batches), max_len, batches, new_tokens, prefill=(context,))
    slots = {name: [m.kv.allocate() for _ in range(max(batches))]
             for name, m in models.items()}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return Models(models["target"], models["draft"], slots)


def step_times(models: Models, warmup: int = 3, repeats: int = 20,
               context: int = CONTEXT) -> dict[str, float]:
    from calibration.grid import Point
    from calibration.measure import Bench, measure

    out = {}
    for gate, (which, stage, batch, m) in STEPS.items():
        model = models.target if which == "target" else models.draft
        where = "gpu" if model.device.type == "cuda" else "cpu"
        bench = Bench(f"{which}@{where}", model, models.slots[which], warmup, repeats)
        out[gate] = measure(bench, Point(which, where, stage, batch, m, context)).ms
    return out


def round_times(models: Models, context: int = CONTEXT,
                round_tokens: int = ROUND_TOKENS) -> dict[str, float]:
    """ms per speculative round, batch 1, controlled alpha 0.7 (the same rounds each run)."""
    from kestrel_rt.spec import SpecConfig, speculative_generate
    from kestrel_sim.scenario import Acceptance

    for name, m in (("target", models.target), ("draft", models.draft)):
        for slot in models.slots.pop(name, []):  # back to the prepared cache, graphs kept:
            m.kv.free(slot)                       # speculative_generate takes its slots there
    out = {}
    vocab = models.target.shape.vocab_size
    prompt = [[(7 * i) % (vocab - 1) + 1 for i in range(context)]]
    for gate, correction in zip(ROUNDS, ("fused", "separate")):
        config = SpecConfig(k=K, correction=correction, seed=0,
                            acceptance=Acceptance(alpha=0.7))
        speculative_generate(models.target, models.draft, prompt, 32, config)  # warm up
        result = speculative_generate(models.target, models.draft, prompt, round_tokens, config)
        out[gate] = result.decode_s / result.decode_steps * 1e3
    return out


def measure_all() -> tuple[dict[str, float], str]:
    """Every gate in ms, and the device's name."""
    models = build()
    times = step_times(models)
    times |= round_times(models)
    return times, torch.cuda.get_device_name(0)
