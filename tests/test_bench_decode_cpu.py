"""Benchmark: greedy decode tokens/s on the CPU, qwen3-0.6b's layer shapes with 4 layers.

The full qwen3-0.6b in fp32 is ~2.4 GB and decodes at about 1 token/s on a small CPU, so
the benchmark keeps every per-layer shape of the preset (hidden 1024, 16/8 heads of 128,
MLP 3072) but 4 of the 28 layers and a 16384-token vocabulary. Each round rolls the KV
cache back to the prompt and decodes DECODE_STEPS tokens for every sequence in the batch.

    python -m pytest tests/test_bench_decode_cpu.py --benchmark-enable

CI runs it with --benchmark-disable (pyproject addopts): the body runs once, as a test.
tokens/s is in each benchmark's extra_info (JSON with --benchmark-json=PATH).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kestrel_rt.backend import TorchBackend
from kestrel_rt.engine import generate
from kestrel_rt.model import Qwen3Model
from kestrel_rt.weights import dummy_weights
from kestrel_sim.models import PRESETS

SHAPE = PRESETS["qwen3-0.6b"].model_copy(
    update={"name": "qwen3-0.6b-4layers", "num_hidden_layers": 4, "vocab_size": 16384}
)
PROMPT_LEN = 32
DECODE_STEPS = 16
MAX_BATCH = 4


@pytest.fixture(scope="module")
def model():
    weights = dummy_weights(SHAPE, "cpu", "float32", seed=0)
    return Qwen3Model(SHAPE, weights, TorchBackend("cpu", torch.float32))


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, SHAPE.vocab_size, (batch, PROMPT_LEN), generator=g).tolist()


@pytest.mark.parametrize("batch", [1, MAX_BATCH])
def test_decode_tokens_per_s(benchmark, model, batch):
    kv = model.allocate_kv(MAX_BATCH, PROMPT_LEN + DECODE_STEPS + 1)
    slots = [kv.allocate() for _ in range(batch)]
    first = model.prefill(prompts(batch), slots).argmax(-1)  # [B]

    def decode() -> list[list[int]]:
        for s in slots:
            kv.rollback(s, PROMPT_LEN)
        token = first[:, None]  # [B, 1]
        out = []
        for _ in range(DECODE_STEPS):
            token = model.forward(token, slots)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            out.append(token[:, 0])
        return torch.stack(out, dim=1).tolist()  # [B, DECODE_STEPS]

    ids = benchmark(decode)

    # The timed loop computes what the engine computes: greedy ids after the first token.
    reference = generate(model, prompts(batch), DECODE_STEPS + 1).token_ids
    assert ids == [r[1:] for r in reference]
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None when run with --benchmark-disable
        seconds = stats.stats.median
        benchmark.extra_info["decode_tokens_per_s"] = batch * DECODE_STEPS / seconds
        benchmark.extra_info["decode_ms_per_step"] = 1000 * seconds / DECODE_STEPS
    benchmark.extra_info.update(
        model=SHAPE.name, batch=batch, prompt_tokens=PROMPT_LEN, decode_steps=DECODE_STEPS,
        dtype="float32", threads=torch.get_num_threads(),
    )
