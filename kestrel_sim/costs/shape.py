"""A model's shape from a preset name or a Hugging Face folder's config.json (no torch)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import ValidationError

from kestrel_sim.errors import ConfigError
from kestrel_sim.models import PRESETS, ModelShape, preset

_KEYS = set(ModelShape.model_fields) - {"name", "architecture"}


def model_shape(name_or_folder: str) -> ModelShape:
    """The preset called `name_or_folder`, or the shape read from its config.json."""
    if name_or_folder.lower() in PRESETS:
        return preset(name_or_folder)
    path = Path(name_or_folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read model config {path}: {err}") from None
    data = {k: v for k, v in cfg.items() if k in _KEYS}
    if "head_dim" not in data and "hidden_size" in cfg and "num_attention_heads" in cfg:
        data["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if isinstance(data.get("mlp_only_layers"), list):
        data["mlp_only_layers"] = tuple(data["mlp_only_layers"])
    arch = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
    try:
        return ModelShape(name=Path(name_or_folder).name, architecture=arch, **data)
    except ValidationError as err:
        raise ConfigError(f"model config {path} does not describe a Qwen3 model: {err}") from None


# ModelShape fields that change a step's bytes or flops (not names, rope or norm constants)
COST_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "num_experts",
               "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
               "mlp_only_layers")


def shape_hash(shape: ModelShape) -> str:
    """A stable 16-hex-digit hash of the shape fields that affect a step's cost: two models
    with the same hash move the same bytes and do the same flops per step. Written in a
    Profile's fingerprint (model_shape_hash, draft_shape_hash)."""
    fields = {name: getattr(shape, name) for name in COST_FIELDS}
    fields["mlp_only_layers"] = sorted(fields["mlp_only_layers"])
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
