"""Bad model input: each case is a KestrelError subclass whose message names what and where."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file

from kestrel_rt.config import UnsupportedArchitectureError, shape_from_hf_config
from kestrel_rt.loading import (
    CorruptCheckpointError,
    MissingConfigError,
    MissingShardError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    load_model,
)
from kestrel_sim.errors import ConfigError, KestrelError
from kestrel_sim.models import UnknownPresetError

TINY = {
    "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 24,
}


@pytest.fixture
def folder(tmp_path):
    """A valid tiny single-file Qwen3 folder."""
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture
def sharded(tmp_path):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY))
    model.save_pretrained(tmp_path, max_shard_size="4KB")
    return tmp_path


def one_paragraph(err: Exception) -> str:
    message = str(err)
    assert "\n" not in message and "Traceback" not in message
    return message


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_folder_without_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(MissingConfigError) as err:
        load_model(folder)
    assert str(folder) in one_paragraph(err.value) and "config.json" in str(err.value)


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(MissingConfigError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_unsupported_architecture(folder):
    edit_config(folder, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(folder)
    message = one_paragraph(err.value)
    for part in ("config.json", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert part in message


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("hidden_size", None, "required key 'hidden_size' is missing"),
        ("num_hidden_layers", "28", "key 'num_hidden_layers' is '28', expected a int"),
        ("tie_word_embeddings", 1, "key 'tie_word_embeddings' is 1, expected a bool"),
        ("vocab_size", 0, "vocab_size"),
        ("num_key_value_heads", 3, "not a multiple of 'num_key_value_heads'"),
        ("torch_dtype", "int8", "key 'torch_dtype' is 'int8'"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
        ("attention_bias", True, "attention_bias"),
    ],
)
def test_invalid_config_names_the_key(folder, key, value, words):
    edit_config(folder, **{key: value})
    with pytest.raises(ConfigError) as err:
        load_model(folder)
    message = one_paragraph(err.value)
    assert words in message and "config.json" in message


def test_config_that_is_not_json(folder):
    (folder / "config.json").write_text('{"architectures": [')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(folder)


def test_moe_config_missing_expert_count(tmp_path):
    config = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 2,
              "moe_intermediate_size": 8}
    with pytest.raises(ConfigError, match="'num_local_experts' is missing"):
        shape_from_hf_config(config, tmp_path / "config.json")


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_safetensors_names_the_file(folder, keep):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(CorruptCheckpointError) as err:
        load_model(folder)
    assert str(path) in one_paragraph(err.value) and "truncated" in str(err.value)


def test_garbage_header_names_the_file(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_model(folder)


def test_missing_tensor_names_tensor_and_folder(folder):
    name = "model.layers.1.self_attn.k_norm.weight"
    edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(MissingTensorError) as err:
        load_model(folder)
    message = one_paragraph(err.value)
    assert name in message and str(folder) in message and "[8]" in message


def test_misshaped_tensor_names_shapes_and_file(folder):
    name = "model.layers.0.mlp.up_proj.weight"
    edit_tensors(folder, lambda t: t.update({name: torch.zeros(24, 17)}))
    with pytest.raises(TensorShapeError) as err:
        load_model(folder)
    message = one_paragraph(err.value)
    assert name in message and "model.safetensors" in message
    assert "[24, 17]" in message and "[24, 16]" in message


def test_quantized_tensor_is_refused(folder):
    name = "model.layers.0.mlp.up_proj.weight"
    edit_tensors(folder, lambda t: t.update({name: torch.zeros(24, 16, dtype=torch.int8)}))
    with pytest.raises(TensorShapeError, match="I8"):
        load_model(folder)


def test_tensors_the_config_does_not_know(folder):
    """A config with fewer layers than the weights is a mismatch, not something to ignore."""
    edit_config(folder, num_hidden_layers=1)
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.1\."):
        load_model(folder)


def test_rotary_inv_freq_is_ignored(folder):
    edit_tensors(folder, lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(4)}))
    _, weights, _ = load_model(folder)
    assert "model.rotary_emb.inv_freq" not in weights


def test_tied_checkpoint_with_an_lm_head_copy_loads(folder):
    """Some tied checkpoints also store lm_head.weight; the model uses the embedding."""
    edit_config(folder, tie_word_embeddings=True)
    shape, weights, _ = load_model(folder)
    assert shape.tie_word_embeddings and "lm_head.weight" not in weights


def test_index_naming_a_missing_shard(sharded):
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(MissingShardError) as err:
        load_model(sharded)
    message = one_paragraph(err.value)
    assert shards[1].name in message and "model.safetensors.index.json" in message


def test_index_that_is_not_an_index(sharded):
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CorruptCheckpointError, match="weight_map"):
        load_model(sharded)


def test_folder_without_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(MissingShardError, match="has no weights"):
        load_model(folder)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(UnknownPresetError) as err:
        load_model("qwen3-9b")
    message = one_paragraph(err.value)
    assert "qwen3-9b" in message and "qwen3-0.6b" in message and "qwen3-30b-a3b" in message


@pytest.mark.parametrize("dtype", ["int8", "fp8", "half-ish"])
def test_unsupported_dtype(folder, dtype):
    with pytest.raises(KestrelError, match=f"dtype '{dtype}'"):
        load_model(folder, "cpu", dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda(folder):
    with pytest.raises(KestrelError, match="no CUDA device"):
        load_model(folder, "cuda")


def test_config_without_architectures_is_read_by_model_type(folder):
    """transformers' Auto classes go by model_type; a config without architectures loads."""
    edit_config(folder, architectures=None)
    shape, _, _ = load_model(folder)
    assert shape.architecture == "Qwen3ForCausalLM"
    edit_config(folder, model_type="llama")
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(folder)
    assert "'model_type' is 'llama'" in one_paragraph(err.value) and "config.json" in str(err.value)
