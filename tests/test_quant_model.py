"""Quantized models on the CPU: a tiny Qwen3 (and Qwen3-MoE) quantized to int8 / int4 against
its fp32 self (logits error reported and bounded), and AWQ checkpoints written and loaded."""

from __future__ import annotations

import json

import pytest
import tiny_models as tm
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kestrel_rt.awq import AwqCheckpointError, load_awq_folder
from kestrel_rt.awq_write import write_awq_folder
from kestrel_rt.backend import TorchBackend
from kestrel_rt.loading import is_awq_checkpoint
from kestrel_rt.model import Qwen3Model
from kestrel_rt.packing import pack_weights
from kestrel_rt.quant_weights import (
    Int4Weight,
    Int8Weight,
    is_fused_experts,
    is_projection,
    quantize_weights,
)
from kestrel_rt.weights import split_fused_experts

# Shapes large enough for int4's group of 128 along every projection's input.
DENSE = {"vocab_size": 96, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
             "max_position_embeddings": 64, "tie_word_embeddings": False}
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
           norm_topk_prob=True)
# Relative logits error ||q - fp32|| / ||fp32|| allowed. Measured (this test, CPU): int8 0.012,
# int4 0.19 on these Gaussian random weights (int4's step is ~range/15 per group of 128, so
# each weight carries ~10% rms error; real checkpoints, with AWQ's scaling search, do better).
BOUND = {"int8": 0.03, "int4": 0.3}


def _hf_model(moe: bool):
    torch.manual_seed(0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**DENSE))
    return model.eval()


def _logits(shape, weights, tokens) -> torch.Tensor:
    model = Qwen3Model(shape, weights, TorchBackend("cpu", torch.float32))
    model.allocate_kv(tokens.shape[0], 32)
    slots = [model.kv.allocate() for _ in range(tokens.shape[0])]
    return model.forward(tokens, slots)  # [B, M, V]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_tiny_model_logits_error_is_bounded(mode, moe, capsys):
    hf = _hf_model(moe)
    shape = tm.shape_of(hf.config)
    tokens = torch.randint(0, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _logits(shape, tm.weights_of(hf), tokens)
    weights = quantize_weights(tm.weights_of(hf), mode)
    # every projection is quantized, MoE experts (fused in memory, as transformers 5 holds
    # them) included; embeddings, norms, router and lm_head are not
    kinds = {type(w) for n, w in weights.items() if is_projection(n) or is_fused_experts(n)}
    assert kinds == {Int8Weight if mode == "int8" else Int4Weight}
    assert all(isinstance(w, torch.Tensor) for n, w in weights.items()
               if not (is_projection(n) or is_fused_experts(n)))
    got = _logits(shape, weights, tokens)
    rel = ((got - ref).norm() / ref.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\n{mode} {'moe' if moe else 'dense'}: logits rel error {rel:.4f}, "
              f"argmax agreement {agree:.0%}")
    assert torch.isfinite(got).all()
    assert 0 < rel <= BOUND[mode]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    src = tmp_path_factory.mktemp("fp32")
    _hf_model(False).save_pretrained(src)
    dst = write_awq_folder(src, tmp_path_factory.mktemp("awq"))
    return src, dst


def test_awq_folder_loads_as_int4_and_matches_quantize_at_load(folders):
    src, dst = folders
    assert is_awq_checkpoint(dst) and not is_awq_checkpoint(src)
    shape, weights = load_awq_folder(dst, "cpu", "float32")
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], Int4Weight)
    assert isinstance(weights["model.embed_tokens.weight"], torch.Tensor)
    tokens = torch.randint(0, shape.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    from_file = _logits(shape, weights, tokens)
    _, fp = tm.read(src)
    at_load = _logits(shape, {n: (w.half().float() if not n.endswith("proj.weight") else w)
                              for n, w in quantize_weights(fp, "int4").items()}, tokens)
    # same quantization either way (the file stores non-projection tensors in fp16)
    torch.testing.assert_close(from_file, at_load, rtol=1e-4, atol=1e-4)


def test_awq_folder_errors_name_the_tensor(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    _, dst = folders
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(AwqCheckpointError, match="up_proj.scales"):
        load_awq_folder(bad, "cpu")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(AwqCheckpointError, match="group_size"):
        load_awq_folder(bad, "cpu")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_moe_experts_quantize_expert_by_expert(mode):
    """transformers 5 holds MoE experts fused (mlp.experts.gate_up_proj [E, 2I, H], names
    without .weight): they quantize too, exactly as the per-expert on-disk form does."""
    hf = _hf_model(True)
    shape = tm.shape_of(hf.config)
    E, m, h = shape.num_experts, shape.moe_intermediate_size, shape.hidden_size
    kind = {"int8": Int8Weight, "int4": Int4Weight}[mode]
    fused = quantize_weights(tm.weights_of(hf), mode)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        for name, dims in ((f"{p}.gate_up_proj", (E, 2 * m, h)), (f"{p}.down_proj", (E, h, m))):
            assert isinstance(fused[name], kind) and tuple(fused[name].shape) == dims, name
    left = [n for n, w in fused.items() if isinstance(w, torch.Tensor)
            and (is_projection(n) or is_fused_experts(n))]
    assert left == []

    per_expert = quantize_weights(split_fused_experts(tm.weights_of(hf)), mode)
    a = pack_weights(shape, dict(fused))
    b = pack_weights(shape, dict(per_expert))
    for name in (f"layers.{i}.experts.{w}" for i in range(shape.num_hidden_layers)
                 for w in ("gate_up", "down")):
        assert type(a[name]) is type(b[name]) and a[name].shape == b[name].shape
        assert all(torch.equal(x, y) for x, y in zip(a[name].tensors(), b[name].tensors()))
    tokens = torch.randint(0, shape.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(shape, fused, tokens), _logits(shape, per_expert, tokens))


def test_truncated_awq_file_is_a_clear_error(folders, tmp_path):
    from kestrel_rt.loading import CorruptCheckpointError

    _, dst = folders
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((dst / "config.json").read_text())
    data = (dst / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load_awq_folder(bad, "cpu")
