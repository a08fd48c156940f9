"""The torch reference backend on CUDA gives what it gives on the CPU (fp32), and bf16 stays
close; needs no transformers (random weights of a small shape)."""

from __future__ import annotations

import pytest
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.engine import generate
from kestrel_rt.model import Qwen3Model
from kestrel_rt.weights import expected_tensors
from kestrel_sim.models import ModelShape

SHAPES = {
    "dense": ModelShape(vocab_size=512, hidden_size=256, num_hidden_layers=3,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=48,
                        intermediate_size=384, max_position_embeddings=512),
    "moe": ModelShape(architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=512),
}


def _weights(shape: ModelShape) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dims in expected_tensors(shape).items():
        t = torch.randn(dims, generator=g)
        out[name] = 1 + 0.3 * t if name.endswith("norm.weight") else 0.2 * t
    return out


def _run(shape: ModelShape, device: str, dtype: torch.dtype):
    model = Qwen3Model(shape, _weights(shape), TorchBackend(device, dtype))
    model.allocate_kv(3, 128)
    slots = [model.kv.allocate() for _ in range(3)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, shape.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9)]
    logits = [model.prefill(prompts, slots).float().cpu()]  # [3, V] each
    for i in range(16):
        logits.append(model.forward(torch.tensor([[7], [8], [9]]) + i, slots)[:, 0].float().cpu())
    return torch.stack(logits), generate(model, prompts, 24).token_ids


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_cuda_matches_cpu(name):
    cpu_logits, cpu_tokens = _run(SHAPES[name], "cpu", torch.float32)
    cuda_logits, cuda_tokens = _run(SHAPES[name], "cuda", torch.float32)
    assert (cuda_logits - cpu_logits).abs().max().item() <= 1e-3
    assert cuda_tokens == cpu_tokens


def test_bf16_dense_stays_close_to_fp32():
    ref, _ = _run(SHAPES["dense"], "cpu", torch.float32)
    bf16, _ = _run(SHAPES["dense"], "cuda", torch.bfloat16)
    assert torch.isfinite(bf16).all()
    assert (bf16 - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
