"""Loading: config.json -> ModelShape, expected tensor names, folders, shards, dtypes, dummies."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_rt.config import shape_from_hf_config
from kestrel_rt.loading import TensorShapeError, load_folder, load_model
from kestrel_rt.weights import dummy_weights, expected_tensors, load_dummy
from kestrel_sim.models import PRESETS

TINY = {
    "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
}
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def save_tiny(folder, moe=False, dtype=torch.float32, max_shard_size=None, seed=0, **overrides):
    """A random tiny Qwen3 (or Qwen3-MoE) saved by transformers' save_pretrained; its model."""
    torch.manual_seed(seed)
    if moe:
        config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, **overrides}))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def on_disk(folder) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


@pytest.mark.parametrize(
    "moe, overrides",
    [
        (False, {"tie_word_embeddings": True}),
        (False, {"tie_word_embeddings": False, "head_dim": 12}),  # head_dim != hidden / heads
        (True, {"norm_topk_prob": True}),
        (True, {"num_hidden_layers": 3, "decoder_sparse_step": 2, "mlp_only_layers": [1]}),
    ],
)
def test_expected_tensors_are_transformers_on_disk_names(tmp_path, moe, overrides):
    save_tiny(tmp_path, moe=moe, **overrides)
    shape = shape_from_hf_config(
        transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
        | {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]},
        tmp_path / "config.json",
    )
    assert expected_tensors(shape) == on_disk(tmp_path)


@pytest.mark.parametrize("shard", [None, "8KB"])
@pytest.mark.parametrize("moe", [False, True])
def test_folder_weights_equal_the_saved_model(tmp_path, shard, moe):
    model = save_tiny(tmp_path, moe=moe, max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    shape, weights, tokenizer = load_model(tmp_path, "cpu")
    assert tokenizer is None and shape.is_moe == moe and shape.name == tmp_path.name
    reference = model.state_dict()
    assert set(weights) == set(expected_tensors(shape))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        if ".experts." not in name:  # transformers 5 fuses experts in memory
            assert torch.equal(tensor, reference[name]), name
    if moe:  # expert 1's up projection is the second half of the fused gate_up [E, 2m, h]
        m = shape.moe_intermediate_size
        fused = reference["model.layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(weights["model.layers.0.mlp.experts.1.up_proj.weight"], fused[1, m:])


@pytest.mark.parametrize("shard", [None, "8KB"])
def test_fused_expert_folder_loads_as_the_per_expert_one(tmp_path, shard):
    """save_pretrained(save_original_format=False) writes transformers 5's fused experts
    (mlp.experts.gate_up_proj [E, 2I, H]); transformers loads that folder, and so do we."""
    model = save_tiny(tmp_path / "per_expert", moe=True, num_hidden_layers=3, mlp_only_layers=[1])
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / "fused", save_original_format=False, **kwargs)
    assert "model.layers.0.mlp.experts.gate_up_proj" in on_disk(tmp_path / "fused")
    shape, fused = load_folder(tmp_path / "fused", "cpu", "float32")
    _, per_expert = load_folder(tmp_path / "per_expert", "cpu", "float32")
    assert set(fused) == set(per_expert) == set(expected_tensors(shape))
    assert all(torch.equal(fused[n], per_expert[n]) for n in fused)


def test_fused_expert_folder_with_a_misshaped_tensor_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, moe=True).save_pretrained(tmp_path, save_original_format=False)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    tensors[name] = tensors[name][:, :, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorShapeError, match=rf"'{name}' .* has shape \[4, 32, 15\], "
                       r"expected \[4, 32, 16\]"):
        load_folder(tmp_path, "cpu")


@pytest.mark.parametrize("disk", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("want", ["bfloat16", "float32"])
def test_dtypes_on_disk_are_cast_to_the_requested_one(tmp_path, disk, want):
    model = save_tiny(tmp_path, dtype=disk)
    _, weights = load_folder(tmp_path, "cpu", want)
    name = "model.layers.1.mlp.down_proj.weight"
    assert weights[name].dtype == getattr(torch, want)
    assert torch.equal(weights[name], model.state_dict()[name].to(getattr(torch, want)))


def test_dtype_defaults_to_the_one_config_declares(tmp_path):
    save_tiny(tmp_path, dtype=torch.bfloat16, torch_dtype="bfloat16")
    _, weights = load_folder(tmp_path, "cpu")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


# Published Qwen3 config.json values (the model cards' configs), written as the files hold them.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "use_sliding_window": False, "sliding_window": None,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "head_dim": 128, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


@pytest.mark.parametrize(
    "config, name", [(QWEN3_0_6B, "qwen3-0.6b"), (QWEN3_30B_A3B, "qwen3-30b-a3b")]
)
def test_published_configs_give_the_presets(tmp_path, config, name):
    where = tmp_path / name / "config.json"
    assert shape_from_hf_config(config, where) == PRESETS[name]


def test_transformers5_config_keys_are_read(tmp_path):
    """transformers 5 writes rope_parameters and num_local_experts instead of the old keys."""
    save_tiny(tmp_path, moe=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    import json

    config = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in config and "rope_theta" not in config
    shape = shape_from_hf_config(config, tmp_path / "config.json")
    assert (shape.rope_theta, shape.num_experts) == (5e5, 4)


# Parameters from the Qwen3 model cards, in billions: (total, non-embedding).
PUBLISHED_B = {
    "qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2),
    "qwen3-30b-a3b": (30.5, 29.9),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_tensors_count_the_published_parameters(name):
    tensors = expected_tensors(PRESETS[name])
    embedding = {"model.embed_tokens.weight", "lm_head.weight"}
    total = sum(math.prod(d) for d in tensors.values()) / 1e9
    non_embedding = sum(math.prod(d) for n, d in tensors.items() if n not in embedding) / 1e9
    published_total, published_non_embedding = PUBLISHED_B[name]
    assert total == pytest.approx(published_total, rel=0.02)
    assert non_embedding == pytest.approx(published_non_embedding, rel=0.015)


TRIMMED = PRESETS["qwen3-30b-a3b"].model_copy(
    update={"num_hidden_layers": 2, "vocab_size": 512, "num_experts": 8, "hidden_size": 256}
)


def test_dummy_weights_have_real_shapes_and_sensible_values():
    weights = dummy_weights(TRIMMED, "cpu", "float32", seed=3)
    expected = expected_tensors(TRIMMED)
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected
    flat = torch.cat([t.flatten() for n, t in weights.items() if "norm" not in n])
    norms = torch.cat([t.flatten() for n, t in weights.items() if "norm" in n])
    assert abs(flat.std().item() - 0.02) < 1e-3 and abs(flat.mean().item()) < 1e-3
    assert abs(norms.mean().item() - 1.0) < 0.01


def test_dummy_weights_are_deterministic_per_seed():
    a = dummy_weights(TRIMMED, "cpu", "bfloat16", seed=1)
    b = dummy_weights(TRIMMED, "cpu", "bfloat16", seed=1)
    c = dummy_weights(TRIMMED, "cpu", "bfloat16", seed=2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert {t.dtype for t in a.values()} == {torch.bfloat16}


def test_load_model_picks_a_preset_by_name(monkeypatch):
    """A preset name gives the preset's shape and a dummy load (made small here)."""
    import kestrel_rt.weights as weights_mod

    small = PRESETS["qwen3-0.6b"].model_copy(update={"num_hidden_layers": 1, "vocab_size": 64})
    monkeypatch.setattr(weights_mod, "preset", lambda name: small)
    shape, weights, tokenizer = load_model("Qwen3-0.6B", "cpu")
    assert shape == small and tokenizer is None
    assert weights["model.embed_tokens.weight"].dtype == torch.float32  # CPU default
    assert "lm_head.weight" not in weights  # tied


@pytest.mark.gpu
def test_dummy_load_is_made_on_the_gpu_without_host_memory():
    """qwen3-8b in bf16 (16 GB) appears on the GPU while this process's RSS barely moves."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    _shape, weights = load_dummy("qwen3-8b", "cuda", "bfloat16", seed=0)
    torch.cuda.synchronize()
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    on_gpu = sum(t.numel() * t.element_size() for t in weights.values())
    assert all(t.is_cuda for t in weights.values())
    assert on_gpu > 15e9 and grown_gib < 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("shard", [None, "8KB"])
def test_folder_loads_onto_the_gpu(tmp_path, shard):
    model = save_tiny(tmp_path, moe=True, dtype=torch.bfloat16, max_shard_size=shard)
    _, weights = load_folder(tmp_path, "cuda", "float32")
    name = "model.layers.1.self_attn.o_proj.weight"
    assert all(t.is_cuda and t.dtype == torch.float32 for t in weights.values())
    assert torch.equal(weights[name].cpu(), model.state_dict()[name].float())


def test_free_memory_is_read_and_a_model_too_large_for_it_is_refused():
    from kestrel_rt.memory import check_fits, free_bytes, kv_bytes
    from kestrel_sim.errors import KestrelError

    cpu = torch.device("cpu")
    assert free_bytes(cpu) > 0
    shape = PRESETS["qwen3-8b"]  # 36 layers x 8 KV heads x 128: 147,456 bf16 bytes a token
    assert kv_bytes(shape, "bfloat16", 10) == 10 * 2 * 2 * 36 * 8 * 128
    check_fits(shape, "bfloat16", cpu, free=17_000_000_000)  # 16.4 GB of weights fit
    with pytest.raises(KestrelError, match=r"'qwen3-8b' needs 16.4 GB in bfloat16 .* but cpu has "
                       r"16.0 GB free"):
        check_fits(shape, "bfloat16", cpu, free=16_000_000_000)
    with pytest.raises(KestrelError, match=r"needs 22.3 GB .* 5.9 GB of KV cache for 40000 tok"):
        check_fits(shape, "bfloat16", cpu, free=17_000_000_000, kv_tokens=40_000)
    check_fits(shape, "float32", cpu, free=None)  # unknown: no refusal
