"""Tiny random Qwen3 / Qwen3-MoE checkpoints written by transformers' save_pretrained.

`build(name, folder)` writes a checkpoint (config.json + safetensors, sharded with an index
for "sharded"); `read(folder)` returns (ModelShape, HF-named weights) by reading the files
directly and the config through transformers (independent of the runtime's loader, which
the equivalence tests use); `reference(folder)` loads the same folder with transformers. Weights are scaled up from transformers' tiny init (std 0.02) and
norm weights randomised, so logits are far from ties and every op matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kestrel_sim.models import ModelShape

_BASE = {
    "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
_MOE = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24}

CONFIGS: dict[str, dict] = {
    "tied": dict(_BASE, tie_word_embeddings=True),
    "untied": dict(_BASE, tie_word_embeddings=False, num_hidden_layers=3),
    "odd_head_dim": dict(_BASE, hidden_size=40, head_dim=24, num_attention_heads=6,
                         num_key_value_heads=2, rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 1e6}),
    "sharded": dict(_BASE, tie_word_embeddings=False, num_key_value_heads=4),
    "moe": dict(_BASE, **_MOE, norm_topk_prob=False),
    "moe_norm": dict(_BASE, **_MOE, norm_topk_prob=True, num_hidden_layers=3,
                     mlp_only_layers=[1]),
}
MOE_CONFIGS = {"moe", "moe_norm"}
SHARD_SIZE = "20KB"  # gives several shards and an index for the "sharded" model


def in_memory(name: str, seed: int = 0):
    """The transformers model of tiny config `name` (a key of CONFIGS), fp32, eval mode."""
    return from_config(CONFIGS[name], seed)


def from_config(cfg: dict, seed: int = 0):
    """The transformers model of a config dict (MoE when it has num_experts), fp32, eval
    mode, norm weights randomised."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if "num_experts" in cfg:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()


def build(name: str, folder: Path, seed: int = 0) -> Path:
    """Write tiny checkpoint `name` (a key of CONFIGS) into `folder`; returns the folder."""
    folder = Path(folder)
    kwargs = {"max_shard_size": SHARD_SIZE} if name == "sharded" else {}
    in_memory(name, seed).save_pretrained(folder, **kwargs)
    return folder


def shape_of(config) -> ModelShape:
    """ModelShape from a transformers Qwen3 / Qwen3-MoE config object."""
    moe = getattr(config, "num_experts", 0) or 0
    return ModelShape(
        name=Path(getattr(config, "_name_or_path", "") or "tiny").name or "tiny",
        architecture=config.architectures[0] if config.architectures else (
            "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"),
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_theta=config.rope_parameters["rope_theta"], rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        num_experts=moe, num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) if moe else 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        decoder_sparse_step=getattr(config, "decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(getattr(config, "mlp_only_layers", ()) or ()),
    )


def weights_of(model) -> dict[str, torch.Tensor]:
    """A transformers model's weights by HF name (copies; MoE experts in fused form)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read(folder: Path) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, weights by HF on-disk name) read straight from the folder's files."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(folder / f))
    return shape_of(AutoConfig.from_pretrained(folder)), weights


def reference(folder: Path):
    """The transformers model of the folder, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def spec_plan(folders: dict, points: list):
    """calibration's `spec@cpu` bench over tiny folders: the "tied" target with the "untied"
    draft (its own BenchPlan, no points), measuring `points`."""
    from calibration.plan import BenchPlan
    from kestrel_rt.loading import resolve

    shape, _ = resolve(folders["tied"])
    dshape, _ = resolve(folders["untied"])
    draft = BenchPlan("draft@cpu", str(folders["untied"]), "cpu", "float32", None, dshape, [])
    return BenchPlan("spec@cpu", str(folders["tied"]), "cpu", "float32", None, shape, points,
                     draft)
