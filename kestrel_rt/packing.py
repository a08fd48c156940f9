"""Hugging Face Qwen3 weight names -> the runtime's packed weight names.

A backend stores weights under short names (a model-id prefix is added by the backend):

| name                        | shape                      | from (HF on-disk names)                |
| --------------------------- | -------------------------- | -------------------------------------- |
| embed                       | [vocab, hidden]            | model.embed_tokens.weight              |
| layers.{i}.input_norm       | [hidden]                   | ...input_layernorm.weight              |
| layers.{i}.qkv              | [(Hq + 2 Hkv) * D, hidden] | q_proj, k_proj, v_proj (rows stacked)  |
| layers.{i}.q_norm, k_norm   | [D]                        | self_attn.{q,k}_norm.weight            |
| layers.{i}.o                | [hidden, Hq * D]           | self_attn.o_proj.weight                |
| layers.{i}.post_norm        | [hidden]                   | ...post_attention_layernorm.weight     |
| layers.{i}.gate_up          | [2 I, hidden]              | mlp.gate_proj, mlp.up_proj (dense)     |
| layers.{i}.down             | [hidden, I]                | mlp.down_proj (dense)                  |
| layers.{i}.router           | [E, hidden]                | mlp.gate.weight (MoE)                  |
| layers.{i}.experts.gate_up  | [E, 2 I_moe, hidden]       | mlp.experts.{e}.{gate,up}_proj (MoE)   |
| layers.{i}.experts.down     | [E, hidden, I_moe]         | mlp.experts.{e}.down_proj (MoE)        |
| norm                        | [hidden]                   | model.norm.weight                      |
| lm_head                     | [vocab, hidden]            | lm_head.weight, or embed when tied     |

MoE experts may also arrive fused as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); both forms load.
"""

from __future__ import annotations

import torch

from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape


class MissingTensorError(KestrelError):
    """A weight the model needs is not in the weight set."""


def _take(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return hf.pop(name)
    except KeyError:
        raise MissingTensorError(
            f"tensor '{name}' is missing from the model's weights: a Qwen3 checkpoint needs it "
            f"(found {len(hf)} other tensors)"
        ) from None


def _experts(hf: dict[str, torch.Tensor], p: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if f"{p}.experts.gate_up_proj" in hf:  # fused in-memory form (transformers 5)
        return _take(hf, f"{p}.experts.gate_up_proj"), _take(hf, f"{p}.experts.down_proj")
    gate_up, down = [], []
    for e in range(n):
        q = f"{p}.experts.{e}"
        gate_up.append(torch.cat([_take(hf, f"{q}.gate_proj.weight"),
                                  _take(hf, f"{q}.up_proj.weight")], dim=0))
        down.append(_take(hf, f"{q}.down_proj.weight"))
    return torch.stack(gate_up), torch.stack(down)  # [E, 2I, H], [E, H, I]


def pack_weights(shape: ModelShape, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed weights for `shape`, popping entries from `hf` (so originals can be freed)."""
    out: dict[str, torch.Tensor] = {"embed": _take(hf, "model.embed_tokens.weight")}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out[f"layers.{i}.input_norm"] = _take(hf, f"{p}.input_layernorm.weight")
        out[f"layers.{i}.post_norm"] = _take(hf, f"{p}.post_attention_layernorm.weight")
        out[f"layers.{i}.qkv"] = torch.cat(
            [_take(hf, f"{a}.{n}_proj.weight") for n in ("q", "k", "v")], dim=0)
        out[f"layers.{i}.q_norm"] = _take(hf, f"{a}.q_norm.weight")
        out[f"layers.{i}.k_norm"] = _take(hf, f"{a}.k_norm.weight")
        out[f"layers.{i}.o"] = _take(hf, f"{a}.o_proj.weight")
        m = f"{p}.mlp"
        if shape.is_moe_layer(i):
            out[f"layers.{i}.router"] = _take(hf, f"{m}.gate.weight")
            gate_up, down = _experts(hf, m, shape.num_experts)
            out[f"layers.{i}.experts.gate_up"] = gate_up
            out[f"layers.{i}.experts.down"] = down
        else:
            out[f"layers.{i}.gate_up"] = torch.cat(
                [_take(hf, f"{m}.gate_proj.weight"), _take(hf, f"{m}.up_proj.weight")], dim=0)
            out[f"layers.{i}.down"] = _take(hf, f"{m}.down_proj.weight")
    out["norm"] = _take(hf, "model.norm.weight")
    if shape.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
        out["lm_head"] = out["embed"]
    else:
        out["lm_head"] = _take(hf, "lm_head.weight")
    return out
