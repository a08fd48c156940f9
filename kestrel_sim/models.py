"""Model shapes: the named presets and the shape of any Qwen3 / Qwen3-MoE config.

Shared by the simulator (roofline costs) and the runtime (dummy loads), so the field
names follow Hugging Face's `config.json` for Qwen3 and Qwen3-MoE.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field

from kestrel_sim.errors import KestrelError


class ModelShape(BaseModel):
    """The numbers that fix a Qwen3 model's tensors (no weights)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    architecture: str = "Qwen3ForCausalLM"  # or "Qwen3MoeForCausalLM"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    # MoE only (Qwen3MoeForCausalLM); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """True where layer `layer` uses experts (transformers' rule)."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token holds in the cache over all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


# ModelShape fields that change a step's bytes or flops (not names, rope or norm constants)
COST_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "num_experts",
               "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
               "mlp_only_layers")


def shape_hash(shape: ModelShape) -> str:
    """A stable 16-hex-digit hash of the shape fields that affect a step's cost: two models
    with the same hash move the same bytes and do the same flops per step. Written in a
    Profile's fingerprint (model_shape_hash, draft_shape_hash); kestrel_sim.costs.shape
    re-exports it."""
    fields = {name: getattr(shape, name) for name in COST_FIELDS}
    fields["mlp_only_layers"] = sorted(fields["mlp_only_layers"])
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dense(name: str, hidden: int, layers: int, heads: int, kv: int, inter: int, tied: bool) -> ModelShape:
    return ModelShape(
        name=name, vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
        intermediate_size=inter, tie_word_embeddings=tied,
    )


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _dense("qwen3-0.6b", 1024, 28, 16, 8, 3072, True),
        _dense("qwen3-1.7b", 2048, 28, 16, 8, 6144, True),
        _dense("qwen3-4b", 2560, 36, 32, 8, 9728, True),
        _dense("qwen3-8b", 4096, 36, 32, 8, 12288, False),
        _dense("qwen3-14b", 5120, 40, 40, 8, 17408, False),
        _dense("qwen3-32b", 5120, 64, 64, 8, 25600, False),
        ModelShape(
            name="qwen3-30b-a3b", architecture="Qwen3MoeForCausalLM", vocab_size=151936,
            hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, intermediate_size=6144,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            norm_topk_prob=True,
        ),
    )
}


class UnknownPresetError(KestrelError):
    """A model name that is neither a preset nor a path."""


def preset(name: str) -> ModelShape:
    """The preset called `name`, or an error listing the known ones."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise UnknownPresetError(
            f"unknown model preset '{name}': expected one of {known}, or a path to a "
            "Hugging Face model folder with a config.json"
        ) from None
