"""Fold each RMSNorm's weight into the linear that reads its output (a checkpoint transform).

    shape, hf = fold_norms(shape, hf)   # HF-named float weights, before quantize_weights

(W @ (w * x_hat) = (W diag(w)) @ x_hat.) After folding, every input, post-attention and final
norm has a unit weight, and q/k/v, gate/up (a MoE layer's router and experts' gate/up) and
lm_head carry them, so a backend may apply such a norm as a per-row scale inside its matmul
(kernels/gemv_mma.cuh and moe.cu, RSTD) instead of a norm kernel before it; whether to fold
is RuntimeOptions.fold_norms (kestrel_rt/options.py). W diag(w) is rounded once to the weights' dtype, where the reference rounds
w * x_hat: the same model to within that rounding. A tied lm_head is untied: it becomes the
folded copy of the embedding, and the returned shape says untied.
"""

from __future__ import annotations

import torch

from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape


def fold_norms(shape: ModelShape, hf: dict) -> tuple[ModelShape, dict]:
    """Fold in place (hf is returned); see the module docstring."""
    for i in range(shape.num_hidden_layers):
        p, moe = f"model.layers.{i}", shape.is_moe_layer(i)
        post = f"{p}.post_attention_layernorm.weight"
        _fold(hf, f"{p}.input_layernorm.weight",
              [f"{p}.self_attn.{n}_proj.weight" for n in ("q", "k", "v")])
        if not moe:
            _fold(hf, post, [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"])
        elif f"{p}.mlp.experts.gate_up_proj" in hf:  # fused in-memory form [E, 2I, H]
            _fold(hf, post, [f"{p}.mlp.gate.weight", f"{p}.mlp.experts.gate_up_proj"])
        else:
            _fold(hf, post, [f"{p}.mlp.gate.weight"] + [
                f"{p}.mlp.experts.{e}.{n}_proj.weight" for e in range(shape.num_experts)
                for n in ("gate", "up")])
    if shape.tie_word_embeddings:
        hf["lm_head.weight"] = _tensor(hf, "model.embed_tokens.weight").clone()
        shape = shape.model_copy(update={"tie_word_embeddings": False})
    _fold(hf, "model.norm.weight", ["lm_head.weight"])
    return shape, hf


def _tensor(hf: dict, name: str) -> torch.Tensor:
    t = hf.get(name)
    if t is None:
        raise KestrelError(f"folding the norms needs tensor '{name}', which the weights lack")
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
        raise KestrelError(f"folding the norms needs float weights, but '{name}' is "
                           f"{type(t).__name__}: fold before quantizing")
    return t


def _fold(hf: dict, norm: str, linears: list[str]) -> None:
    """linears[j] [..., out, in] <- linears[j] * norm weight [in]; the norm weight <- ones."""
    w = _tensor(hf, norm).float()  # [in]
    for name in linears:
        lin = _tensor(hf, name)
        hf[name] = (lin.float() * w).to(lin.dtype)
    hf[norm] = torch.ones_like(hf[norm])
