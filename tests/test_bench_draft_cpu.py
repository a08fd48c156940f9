"""Benchmark: a CPU draft step (qwen3-0.6b's layer shapes, fp32) at batch 4, context 128 and
1024, its attention reading the cache in place (the CPU path) or gathered per step into one
[B, Hkv, T, D] copy per layer (the CUDA path, run here on the CPU for comparison).

The full qwen3-0.6b is ~2.4 GB in fp32, so the benchmark keeps every per-layer shape of the
preset (hidden 1024, 16 / 8 heads of 128, MLP 3072: the same K/V copy per layer, 16.8 MB at
batch 4, context 1024) with 4 of its 28 layers and a 16384-token vocabulary.

    python -m pytest tests/test_bench_draft_cpu.py --benchmark-enable

extra_info: ms per step, and the minor page faults one step took (a gathered copy past a few
MB comes from fresh kernel pages, a fault per 4 KB: the cost the in-place path removes).
CI runs each body once (--benchmark-disable) and checks both paths choose the same tokens.
"""

from __future__ import annotations

import resource

import pytest

torch = pytest.importorskip("torch")

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model
from kestrel_rt.weights import dummy_weights
from kestrel_sim.models import PRESETS

SHAPE = PRESETS["qwen3-0.6b"].model_copy(
    update={"name": "qwen3-0.6b-4layers", "num_hidden_layers": 4, "vocab_size": 16384})
BATCH = 4
MAX_LEN = 1027  # calibration's draft@cpu cache for the default grid: context 1024 + 2 + 1


@pytest.fixture(scope="module")
def model():
    weights = dummy_weights(SHAPE, "cpu", "float32", seed=0)
    m = Qwen3Model(SHAPE, weights, TorchBackend("cpu", torch.float32))
    kv = m.allocate_kv(BATCH, MAX_LEN)
    kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(1)))
    kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(2)))
    return m


def gathered_attention(be: TorchBackend):
    """The backend's attention with the batched gather (attention_gathered) on the CPU."""
    def attention(q, k, v, layer, step):
        B, M = q.shape[:2]
        rows = step.slots[:, None].expand(B, M)  # [B, M]
        be.kv.k[layer][rows, step.positions] = k
        be.kv.v[layer][rows, step.positions] = v
        return be.attention_gathered(q, layer, step)
    return attention


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("context", [128, 1024])
@pytest.mark.parametrize("attention", ["in_place", "gathered"])
def test_draft_step_b4(benchmark, model, attention, context):
    be, kv = model.backend, model.kv
    slots = list(range(BATCH))
    tokens = torch.randint(0, SHAPE.vocab_size, (BATCH, 1),
                           generator=torch.Generator().manual_seed(context))  # [B, 1]

    def step() -> torch.Tensor:  # one draft step at `context` cached tokens per sequence
        for s in slots:
            kv.lengths[s] = context
        return model.forward(tokens, slots, greedy=True)  # [B, 1]

    expect = step()  # the CPU path's choice
    if attention == "gathered":
        be.attention = gathered_attention(be)
    try:
        step()  # warm: the allocator's state as a running loop leaves it
        before = faults()
        step()
        step_faults = faults() - before
        ids = benchmark(step)
    finally:
        be.__dict__.pop("attention", None)
        for s in slots:
            kv.rollback(s, 0)
    assert torch.equal(ids, expect)  # both paths choose the same draft tokens
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None with --benchmark-disable
        benchmark.extra_info["ms_per_step"] = 1000 * stats.stats.median
    benchmark.extra_info.update(
        model=SHAPE.name, batch=BATCH, context=context, attention=attention,
        page_faults_per_step=step_faults, threads=torch.get_num_threads())
