"""A model's shape from a preset name or a Hugging Face folder's config.json (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from kestrel_sim.errors import ConfigError
from kestrel_sim.models import PRESETS, ModelShape, preset, shape_hash  # noqa: F401 (re-export)

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

