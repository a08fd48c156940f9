"""Load a model: a Hugging Face folder (config.json + safetensors) or a dummy preset.

Every tensor's name, shape and dtype is checked against the config's shape from the
safetensors headers alone, before any tensor data is read, so a bad checkpoint fails fast
and says which file and which tensor are wrong. MoE experts load from either on-disk form
(per expert, or fused as transformers 5 holds them) and come back per expert.

A pre-quantized AWQ folder (config.json's quantization_config says awq, or its tensors are
named *.qweight) loads through kestrel_rt/awq.py: `load_folder` routes it there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kestrel_rt.config import checkpoint_dtype, read_config, shape_from_hf_config
from kestrel_rt.hub import cached_folder, fetch_hint
from kestrel_rt.safetensors_files import (  # noqa: F401  (the checkpoint errors, re-exported)
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    MissingShardError,
    read_headers,
    weight_files,
)
from kestrel_rt.weights import (
    expected_tensors,
    has_fused_experts,
    load_dummy,
    parse_device,
    parse_dtype,
    split_fused_experts,
)
from kestrel_sim.models import PRESETS, ModelShape, UnknownPresetError

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
DISK_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class MissingConfigError(CheckpointError):
    """A model folder without config.json (or a path that is not a folder)."""


class MissingTensorError(CheckpointError):
    """A tensor the config requires is in no weights file."""


class TensorShapeError(CheckpointError):
    """A tensor whose shape or dtype is not what the config says."""


class UnexpectedTensorError(CheckpointError):
    """Tensors in the checkpoint that the config's model does not have."""


def _is_harmless(name: str, shape: ModelShape) -> bool:
    """Extra tensors that carry nothing the model needs: RoPE buffers, a tied lm_head copy."""
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and shape.tie_word_embeddings
    )


def check_tensors(
    shape: ModelShape, found: dict[str, tuple[Path, tuple[int, ...], str]], folder: Path
) -> None:
    """Raise on the first missing, misshaped, wrongly typed or unexpected tensor."""
    expected = expected_tensors(shape, has_fused_experts(found))
    for name, dims in expected.items():
        if name not in found:
            where = ", ".join(sorted({p.name for p, _, _ in found.values()})) or "no files"
            raise MissingTensorError(
                f"tensor '{name}' (shape {list(dims)}) is missing from {folder} (searched "
                f"{where}); the config.json describes a model that needs it"
            )
        path, got, disk = found[name]
        if got != dims:
            raise TensorShapeError(
                f"tensor '{name}' in {path} has shape {list(got)}, expected {list(dims)} "
                f"from {folder / 'config.json'}"
            )
        if disk not in DISK_DTYPES:
            raise TensorShapeError(
                f"tensor '{name}' in {path} is stored as {disk}; expected one of "
                f"{', '.join(DISK_DTYPES)} (quantized checkpoints are not supported)"
            )
    extra = sorted(n for n in found if n not in expected and not _is_harmless(n, shape))
    if extra:
        shown = ", ".join(f"'{n}' ({found[n][0].name})" for n in extra[:3])
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise UnexpectedTensorError(
            f"{folder} holds tensors the config.json model does not have: {shown}{more}; "
            "expected the config and the weights to describe the same model"
        )


def load_folder(
    folder: str | Path, device: str | torch.device, dtype: str | torch.dtype | None = None
) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """Shape and weights of a Hugging Face Qwen3 / Qwen3-MoE folder, on `device` in `dtype`.

    dtype None keeps the dtype config.json declares (float32 when it declares none).
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    config_path = find_config(folder)
    config = read_config(config_path)
    shape = shape_from_hf_config(config, config_path)
    device = parse_device(device)
    dtype = parse_dtype(dtype or checkpoint_dtype(config, config_path) or "float32")
    found = read_headers(weight_files(folder))
    if awq_declared(config) or any(n.endswith(".qweight") for n in found):
        from kestrel_rt.awq import load_awq_folder

        return load_awq_folder(folder, device, dtype)
    check_tensors(shape, found, folder)
    by_file: dict[Path, list[str]] = {}
    for name in expected_tensors(shape, has_fused_experts(found)):
        by_file.setdefault(found[name][0], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in names:
                    weights[name] = f.get_tensor(name).to(dtype=dtype)
        except SafetensorError as err:
            raise CorruptCheckpointError(
                f"{path} could not be read ({err}); it may be truncated or corrupt"
            ) from None
    return shape, split_fused_experts(weights)


def awq_declared(config: dict) -> bool:
    """True when config.json's quantization_config names AWQ."""
    qc = config.get("quantization_config") or {}
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "awq"


def is_awq_checkpoint(folder: str | Path) -> bool:
    """True for a pre-quantized AWQ folder (config or tensor names say so); reads headers
    only, and a corrupt file is a CorruptCheckpointError, not a crash."""
    folder = Path(folder)
    config_path = find_config(folder)
    if awq_declared(read_config(config_path)):
        return True
    return any(n.endswith(".qweight") for n in read_headers(weight_files(folder)))


def find_config(folder: Path) -> Path:
    """folder/config.json, or an error saying what the path is instead."""
    if not folder.exists():
        raise MissingConfigError(f"model folder {folder} does not exist{fetch_hint(str(folder))}")
    if not folder.is_dir():
        raise MissingConfigError(
            f"{folder} is a file; expected a Hugging Face model folder with config.json "
            "and *.safetensors"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise MissingConfigError(
            f"{folder} has no config.json; expected a Hugging Face model folder (config.json "
            f"plus {SINGLE_FILE} or {INDEX_FILE} with its shards), or a preset name: "
            f"{', '.join(sorted(PRESETS))}"
        )
    return config_path


def load_tokenizer(folder: Path) -> Any | None:
    """transformers' tokenizer of `folder` when it has tokenizer files, else None."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # noqa: BLE001 (tokenizers raises bare Exception on bad JSON)
        reason = " ".join(str(err).split()) or type(err).__name__  # one paragraph
        raise CheckpointError(
            f"the tokenizer files in {folder} could not be loaded ({reason}); expected "
            "tokenizer.json / tokenizer_config.json as transformers saves them, or remove "
            "them and pass --prompt-ids"
        ) from None


def looks_like_path(name: str) -> bool:
    """True when `name` is written as a path rather than a preset name."""
    return "/" in name or "\\" in name or name.startswith((".", "~")) or Path(name).exists()


def resolve(path_or_preset: str | Path) -> tuple[ModelShape, Path | None]:
    """(shape, folder) for a model folder, (shape, None) for a preset; reads no weights.

    Cheap, so callers can check a request against the shape (context length, vocabulary)
    before a long load.
    """
    name = str(path_or_preset)
    if isinstance(path_or_preset, Path) or looks_like_path(name):
        folder = Path(name).expanduser()
        if not folder.exists():  # a hub id (Qwen/Qwen3-8B) from the local cache, if there
            folder = cached_folder(name) or folder
        config_path = find_config(folder)
        return shape_from_hf_config(read_config(config_path), config_path), folder
    if name.lower() not in PRESETS:
        raise UnknownPresetError(
            f"model '{name}' is neither a folder nor a known preset: expected one of "
            f"{', '.join(sorted(PRESETS))}, or a path to a Hugging Face model folder "
            "with a config.json"
        )
    return PRESETS[name.lower()], None


def default_dtype(folder: Path | None, device: str | torch.device) -> str:
    """A folder's declared dtype (float32 if none); for presets and AWQ folders (whose
    declared fp16 is the storage of scales and norms) bfloat16 on CUDA, else float32."""
    if folder is not None:
        config_path = find_config(folder)
        config = read_config(config_path)
        if not awq_declared(config):
            return checkpoint_dtype(config, config_path) or "float32"
    return "bfloat16" if parse_device(device).type == "cuda" else "float32"


def load_model(
    path_or_preset: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
) -> tuple[ModelShape, dict[str, torch.Tensor], Any | None]:
    """(shape, weights, tokenizer or None) of a model folder or a named dummy preset.

    A preset gets random weights (seeded) made on `device`. dtype None: see default_dtype.
    """
    shape, folder = resolve(path_or_preset)
    dtype = dtype or default_dtype(folder, device)
    if folder is not None:
        shape, weights = load_folder(folder, device, dtype)
        return shape, weights, load_tokenizer(folder)
    shape, weights = load_dummy(shape.name, device, dtype, seed)
    return shape, weights, None
