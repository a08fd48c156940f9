"""Read a Hugging Face `config.json` for Qwen3 / Qwen3-MoE into a ModelShape.

Validation happens here, at the edge: every missing or ill-typed key is reported by name
with the file it came from, so the model code can trust the shape it is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kestrel_sim.errors import ConfigError, KestrelError
from kestrel_sim.models import ModelShape

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
CHECKPOINT_DTYPES = ("bfloat16", "float16", "float32")
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class UnsupportedArchitectureError(KestrelError):
    """A config.json whose `architectures` names a model Kestrel does not implement."""


def read_config(path: Path) -> dict[str, Any]:
    """The parsed JSON object in `path` (a config.json), or a ConfigError naming the file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read model config {path}: {err.strerror or err}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "expected a Hugging Face config.json object"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, expected an object")
    return config


def architecture_of(config: dict[str, Any], where: Path) -> str:
    """The supported architecture named by `architectures`, else an error. A config without
    `architectures` (a bare Qwen3Config().save_pretrained) is read by its `model_type`, as
    transformers' AutoModelForCausalLM reads it."""
    archs = config.get("architectures")
    if archs is None and config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise UnsupportedArchitectureError(
            f"{where}: key 'architectures' is {archs!r} and 'model_type' is "
            f"{config.get('model_type')!r}; expected architectures naming one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (or model_type {' or '.join(MODEL_TYPES)})"
        )
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedArchitectureError(
        f"{where}: architecture {', '.join(archs)} is not supported; Kestrel runs "
        f"{' and '.join(SUPPORTED_ARCHITECTURES)} (Qwen3 dense and Qwen3-MoE)"
    )


def _get(config: dict[str, Any], key: str, kind: type, where: Path, default: Any = ...) -> Any:
    """config[key] checked to be of `kind` (bool is not an int here), or `default` if absent."""
    if key not in config or config[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: required key '{key}' is missing")
        return default
    value = config[key]
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ConfigError(
            f"{where}: key '{key}' is {value!r}, expected a {kind.__name__}"
        )
    return value


def _rope_theta(config: dict[str, Any], where: Path) -> float:
    """rope_theta from the top level (Qwen3 releases) or from rope_parameters (transformers 5).

    Only plain RoPE is implemented; YaRN or other scaling is refused rather than ignored.
    """
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for key, table in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: key '{key}' is {table!r}, expected an object or null")
        kind = table.get("rope_type", table.get("type", "default"))
        if kind != "default":
            raise ConfigError(
                f"{where}: key '{key}' asks for rope_type {kind!r}; Kestrel implements only "
                "the default RoPE (no scaling)"
            )
    if "rope_theta" in config and config["rope_theta"] is not None:
        return _get(config, "rope_theta", float, where)
    return _get(params, "rope_theta", float, where, 10_000.0)


def _refuse_unsupported(config: dict[str, Any], where: Path) -> None:
    """Options of the HF classes that Kestrel's model does not implement."""
    if _get(config, "attention_bias", bool, where, False):
        raise ConfigError(f"{where}: key 'attention_bias' is true; Qwen3 in Kestrel has no biases")
    if _get(config, "use_sliding_window", bool, where, False):
        raise ConfigError(
            f"{where}: key 'use_sliding_window' is true; Kestrel implements full attention only"
        )
    act = _get(config, "hidden_act", str, where, "silu")
    if act != "silu":
        raise ConfigError(f"{where}: key 'hidden_act' is {act!r}, expected 'silu'")


def checkpoint_dtype(config: dict[str, Any], where: Path) -> str | None:
    """The dtype config.json declares (`dtype`, or the older `torch_dtype`), or None."""
    declared = []
    for key in ("dtype", "torch_dtype"):
        if config.get(key) is not None:
            value = config[key]
            if value not in CHECKPOINT_DTYPES:
                raise ConfigError(
                    f"{where}: key '{key}' is {value!r}, expected one of "
                    f"{', '.join(CHECKPOINT_DTYPES)}"
                )
            declared.append(value)
    return declared[0] if declared else None


def _model_name(folder: Path) -> str:
    """The folder's name, or the repo name for a Hugging Face cache snapshot
    (.../models--Qwen--Qwen3-8B/snapshots/<commit> -> Qwen3-8B)."""
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.split("--")[-1]
    return folder.name or "custom"


def shape_from_hf_config(config: dict[str, Any], where: Path) -> ModelShape:
    """The ModelShape of a Qwen3 / Qwen3-MoE config.json; `where` names the file in errors.

    Defaults for absent optional keys follow transformers' Qwen3Config / Qwen3MoeConfig.
    """
    arch = architecture_of(config, where)
    _refuse_unsupported(config, where)
    checkpoint_dtype(config, where)
    moe = arch == "Qwen3MoeForCausalLM"
    hidden = _get(config, "hidden_size", int, where)
    heads = _get(config, "num_attention_heads", int, where)
    fields: dict[str, Any] = {
        "name": _model_name(where.parent),
        "architecture": arch,
        "vocab_size": _get(config, "vocab_size", int, where),
        "hidden_size": hidden,
        "num_hidden_layers": _get(config, "num_hidden_layers", int, where),
        "num_attention_heads": heads,
        "num_key_value_heads": _get(config, "num_key_value_heads", int, where, heads),
        "head_dim": _get(config, "head_dim", int, where, hidden // heads if moe else 128),
        # MoE layers do not use it (only mlp_only_layers do); transformers' default then.
        "intermediate_size": _get(config, "intermediate_size", int, where, 6144 if moe else ...),
        "tie_word_embeddings": _get(config, "tie_word_embeddings", bool, where, False),
        "rope_theta": _rope_theta(config, where),
        "rms_norm_eps": _get(config, "rms_norm_eps", float, where, 1e-6),
        "max_position_embeddings": _get(config, "max_position_embeddings", int, where, 32768),
    }
    if moe:
        experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
        layers = _get(config, "mlp_only_layers", list, where, [])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ConfigError(f"{where}: key 'mlp_only_layers' is {layers!r}, expected integers")
        fields.update(
            num_experts=_get(config, experts_key, int, where),
            num_experts_per_tok=_get(config, "num_experts_per_tok", int, where),
            moe_intermediate_size=_get(config, "moe_intermediate_size", int, where),
            norm_topk_prob=_get(config, "norm_topk_prob", bool, where, False),
            decoder_sparse_step=_get(config, "decoder_sparse_step", int, where, 1),
            mlp_only_layers=tuple(layers),
        )
        if fields["num_experts_per_tok"] > fields["num_experts"]:
            raise ConfigError(
                f"{where}: key 'num_experts_per_tok' is {fields['num_experts_per_tok']}, "
                f"more than the {fields['num_experts']} experts"
            )
    if heads % fields["num_key_value_heads"]:
        raise ConfigError(
            f"{where}: key 'num_attention_heads' ({heads}) is not a multiple of "
            f"'num_key_value_heads' ({fields['num_key_value_heads']})"
        )
    try:
        return ModelShape(**fields)
    except ValidationError as err:
        problem = err.errors()[0]
        key = ".".join(str(p) for p in problem["loc"])
        raise ConfigError(
            f"{where}: key '{key}' is {problem.get('input')!r}: {problem['msg']}"
        ) from None
