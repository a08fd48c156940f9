"""A MoE model's one-sequence prefill chunk past the MoE kernels' 64 tokens replays as a CUDA
graph with RuntimeOptions.moe_prefill_graphs (its experts on the capture-safe grouped matmul:
kestrel_rt/moe.py static_experts_forward), and gives what the eager forward gives; without the
option it stays eager. The CPU side: tests/test_moe_static.py."""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

import gpu_models as gm

from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.cuda.graphs import GraphModel
from kestrel_rt.fold import fold_norms
from kestrel_rt.model import Qwen3Model
from kestrel_rt.options import RuntimeOptions

TOL = 1e-2  # bf16 (tests/gpu/test_graphs.py)
MAX_LEN = 320

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="torch's grouped matmul kernel needs compute capability 9.0+")


def _model(cls, fold: bool, **options) -> Qwen3Model:
    shape, w = gm.weights("wide_moe")  # 8 experts, top 2, hidden 128
    if fold:
        shape, w = fold_norms(shape, w)
    opts = RuntimeOptions(backend="cupy", graphs=True, **options)
    m = cls(shape, w, CupyBackend("cuda", torch.bfloat16, opts))
    m.allocate_kv(2, MAX_LEN)
    return m


def _prefill_then_decode(m: Qwen3Model, prompt: list[int], nxt: int):
    """(last-token logits of the prompt's prefill, logits of one decode step after it), the
    slot freed after."""
    slot = m.kv.allocate()
    try:
        first = m.prefill([prompt], [slot]).cpu()  # [1, V]
        second = m.forward(torch.tensor([[nxt]]), [slot])[:, 0].cpu()  # [1, V]
    finally:
        m.kv.free(slot)
    return first, second


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("length", [80, 200])  # padded to the 96- and 256-token buckets
def test_moe_prefill_replays_and_matches_eager(length, fold):
    eager = _model(Qwen3Model, fold)
    graphed = _model(GraphModel, fold, moe_prefill_graphs=True)
    assert graphed.backend.static_moe()
    vocab = eager.shape.vocab_size
    prompts = gm.prompts(vocab, [length, length], seed=length)
    prompts.append([5] * length)  # every token picks the same 2 experts: 6 empty groups
    for i, prompt in enumerate(prompts):
        before = graphed.replays
        want = _prefill_then_decode(eager, prompt, 7)
        got = _prefill_then_decode(graphed, prompt, 7)
        for g, w in zip(got, want):
            assert gm.rel_err(g, w) <= TOL
        if i:  # the first prompt captured the graph; the others replay it
            assert graphed.replays >= before + 2  # the prefill and the decode step
    bucket = next(b for b in graphed.prefill_buckets if b >= length)
    assert any(key[:3] == (1, bucket, True) for key in graphed.graphs)


def test_without_the_option_moe_prefill_stays_eager():
    graphed = _model(GraphModel, False)
    prompt = gm.prompts(graphed.shape.vocab_size, [80])[0]
    _prefill_then_decode(graphed, prompt, 7)
    _prefill_then_decode(graphed, prompt, 7)
    assert not any(key[1] > graphed.max_m for key in graphed.graphs)  # no prefill graph
    assert graphed.replays >= 1  # the decode steps still replay
