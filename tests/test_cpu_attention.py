"""The torch backend's CPU attention reads the KV cache in place.

A CPU draft step used to gather every sequence's cache rows into one [B, Hkv, T, D] copy per
layer, K and V; past a few MB those copies came from fresh kernel pages each time (a page
fault per 4 KB), and the qwen3-0.6b draft step at batch 4, context 1024 cost several times
its cost at context 128, in calibration and in serving alike. These tests pin that the CPU
path (attention_in_place) computes what the batched gather (attention_gathered, kept for
CUDA graphs) computes, and that a CPU step allocates nothing that grows with the context.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.profiler import ProfilerActivity, profile

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model
from kestrel_rt.weights import dummy_weights
from kestrel_sim.models import PRESETS

TOL = 1e-5
# qwen3-0.6b's head layout (16 query heads, 8 KV heads of 128: grouped-query) in a model
# small enough for CI: 2 layers, hidden 256, a 512-token vocabulary
SHAPE = PRESETS["qwen3-0.6b"].model_copy(update={
    "name": "qwen3-0.6b-heads", "num_hidden_layers": 2, "hidden_size": 256,
    "intermediate_size": 512, "vocab_size": 512})


@pytest.fixture(scope="module")
def model():
    weights = dummy_weights(SHAPE, "cpu", "float32", seed=0)
    return Qwen3Model(SHAPE, weights, TorchBackend("cpu", torch.float32))


def _x(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def filled_cache(model, slots: int, max_len: int):
    """The model's cache with random K/V everywhere (rows past a length must not matter)."""
    kv = model.allocate_kv(slots, max_len)
    kv.k.copy_(_x(*kv.k.shape, seed=1))
    kv.v.copy_(_x(*kv.v.shape, seed=2))
    return kv


@pytest.mark.parametrize("m, n_new", [(1, [1, 1, 1]), (3, [3, 1, 2])])
def test_in_place_equals_the_batched_gather(model, m, n_new):
    """Unordered slots, ragged contexts (one empty), padding rows: the same outputs."""
    be, s = model.backend, SHAPE
    kv = filled_cache(model, 4, 64)
    slots, context = [2, 0, 3], [19, 0, 7]
    for slot, n in zip(slots, context):
        kv.lengths[slot] = n
    step = kv.step(slots, m, n_new)
    q = _x(3, m, s.num_attention_heads, s.head_dim, seed=3)  # [B, M, Hq, D]
    k = _x(3, m, s.num_key_value_heads, s.head_dim, seed=4)  # [B, M, Hkv, D]
    v = _x(3, m, s.num_key_value_heads, s.head_dim, seed=5)
    layer = 1
    out = be.attention(q, k, v, layer, step)  # writes k, v, then the CPU path
    assert be.device.type == "cpu"
    for b, (slot, n) in enumerate(zip(slots, context)):
        assert torch.equal(kv.k[layer, slot, n:n + m], k[b])  # the new tokens were written
    expect = be.attention_gathered(q, layer, step)
    assert out.shape == expect.shape == (3, m, s.num_attention_heads, s.head_dim)
    assert (out - expect).abs().max().item() <= TOL


def step_bytes(model, batch: int, context: int, attention=None) -> tuple[int, int]:
    """(bytes allocated in all, the largest single allocation) by one greedy decode step
    of `batch` sequences at `context` cached tokens (`attention`: the backend's, replaced
    for this step)."""
    kv = model.kv
    slots = list(range(batch))
    for slot in slots:
        kv.lengths[slot] = context
    be = model.backend
    if attention is not None:
        be.attention = attention
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model.forward(torch.zeros(batch, 1, dtype=torch.long), slots, greedy=True)
    finally:
        be.__dict__.pop("attention", None)
        for slot in slots:
            kv.rollback(slot, 0)
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return sum(sizes), max(sizes)


def test_a_cpu_step_allocates_nothing_that_grows_with_context(model):
    """Batch 4: the bytes a step allocates at context 2048 are those at context 64, where
    the batched gather allocates a [4, 2049, Hkv, D] copy of K and of V per layer."""
    filled_cache(model, 4, 2100)
    short, _ = step_bytes(model, 4, 64)
    long, largest = step_bytes(model, 4, 2048)
    one_copy = 4 * 2049 * SHAPE.num_key_value_heads * SHAPE.head_dim * 4  # fp32 [4, T, Hkv, D]
    assert long - short < 64 * 1024
    assert largest < one_copy // 8

    be = model.backend

    def gathered(q, k, v, layer, step):  # the batched path, run on the CPU
        B, M = q.shape[:2]
        rows = step.slots[:, None].expand(B, M)
        be.kv.k[layer][rows, step.positions] = k
        be.kv.v[layer][rows, step.positions] = v
        return be.attention_gathered(q, layer, step)

    # the measure sees a gather: each layer's K and V copies, of the context's size
    long_gathered, largest_gathered = step_bytes(model, 4, 2048, gathered)
    assert largest_gathered >= one_copy
    assert long_gathered - long >= 2 * SHAPE.num_hidden_layers * one_copy
