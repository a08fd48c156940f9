"""Tiny Qwen3 / Qwen3-MoE models on a chosen backend, for the GPU tests."""

from __future__ import annotations

import tiny_models as tm
import torch

from kestrel_rt.model import Qwen3Model

_REFS: dict[tuple[str, int], object] = {}

# Small models whose head_dim (64, 128) takes the fused decode-attention kernel, which the
# tiny_models configs (head_dim 16, 24) never reach.
_WIDE_BASE = dict(tm.CONFIGS["untied"], hidden_size=128, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=192)
WIDE: dict[str, dict] = {
    "wide": _WIDE_BASE,
    "wide128": dict(_WIDE_BASE, head_dim=128, num_attention_heads=4, num_key_value_heads=1),
    "wide_moe": dict(_WIDE_BASE, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, norm_topk_prob=True),
}


def weights(name: str, seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    """(ModelShape, fresh copy of the HF-named fp32 CPU weights) of tiny config `name`
    (a tiny_models config, or one of WIDE)."""
    key = (name, seed)
    if key not in _REFS:
        _REFS[key] = tm.from_config(WIDE[name], seed) if name in WIDE else tm.in_memory(name, seed=seed)
    ref = _REFS[key]
    return tm.shape_of(ref.config), tm.weights_of(ref)


def model(name: str, backend, seed: int = 0, cls=Qwen3Model, slots: int = 4,
          max_len: int = 128, **kwargs) -> Qwen3Model:
    shape, w = weights(name, seed)
    m = cls(shape, w, backend, **kwargs)
    m.allocate_kv(slots, max_len)
    return m


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def run_script(m: Qwen3Model, lengths: list[int], decode_steps: int, verify_m: int = 4,
               seed: int = 0) -> list[torch.Tensor]:
    """Ragged prefill of len(lengths) prompts, decode steps of the whole batch, one
    verify-shaped forward (verify_m tokens per sequence), a rollback and one more decode
    step: every logits tensor it produced, on the CPU. The tokens fed are fixed random ids
    (not argmax), so two backends see the same inputs even where their argmax would differ."""
    kv, vocab = m.kv, m.shape.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    slots = [kv.allocate() for _ in lengths]
    out = [m.prefill(prompts(vocab, lengths, seed), slots).cpu()]  # [B, V]
    for _ in range(decode_steps):
        feed = torch.randint(0, vocab, (len(slots), 1), generator=g)
        out.append(m.forward(feed, slots)[:, 0].cpu())  # [B, V]
    before = [kv.length(s) for s in slots]
    block = torch.randint(0, vocab, (len(slots), verify_m), generator=g)
    out.append(m.forward(block, slots).cpu())  # [B, M, V]
    for s, n in zip(slots, before):
        kv.rollback(s, n)
    feed = torch.randint(0, vocab, (len(slots), 1), generator=g)
    out.append(m.forward(feed, slots)[:, 0].cpu())
    for s in slots:
        kv.free(s)
    return out


def graphed(shape, hf: dict[str, torch.Tensor]):
    """A GraphModel (CUDA graphs) of fp32 weights `hf` (copied) on the cupy backend."""
    from kestrel_rt.backend.cupy_backend import CupyBackend
    from kestrel_rt.cuda.graphs import GraphModel

    return GraphModel(shape, {k: v.clone() for k, v in hf.items()},
                      CupyBackend("cuda", torch.float32))
