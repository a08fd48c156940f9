"""Quantized (int8 / int4) MoE experts on the cupy backend: routed by the moe_route kernel,
run by the expert-indexed gemv (kestrel_rt/cuda/gemv_moe.py), eager and in CUDA graphs.

Tiny Qwen3-MoE models whose expert dimensions take int4's group of 128, loaded from a folder
(per-expert tensors, so quantize_weights quantizes the experts too) and quantized once.

* The MoE block alone (8 experts, top 2): CupyBackend.moe on tokens whose top-k choice has a
  clear margin (so any precision picks the same experts) against a float64 reference on the
  same quantized weights: relative error <= 1e-2 (bf16 operands), and gemv_moe ran.
* Whole models, eager and graphs: with top-k = all experts the output is continuous in its
  inputs (no routing flip can turn bf16 noise into a different expert), so the bar of
  test_cupy_backend.py holds: the cupy backend's error against fp32 (same quantized weights)
  is at most 1.5x the torch bf16 backend's (+1e-3).
"""

from __future__ import annotations

import json

import gpu_models as gm
import pytest
import torch

cupy = pytest.importorskip("cupy")

from typer.testing import CliRunner

from kestrel_cli.app import app
from kestrel_rt import moe as moe_ref
from kestrel_rt.backend import TorchBackend
from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.cuda import gemv_moe
from kestrel_rt.cuda.graphs import GraphModel
from kestrel_rt.loading import load_folder
from kestrel_rt.model import Qwen3Model
from kestrel_rt.quant_weights import Int4Weight, Int8Weight, quantize_weights

# gpu_models' wide_moe (hidden 128, 8 experts, top 2) with moe_intermediate 128 (int4 needs
# down_proj's input a multiple of 128); ALL: 4 experts, every one chosen.
CONFIGS = {
    "select": dict(gm.WIDE["wide_moe"], moe_intermediate_size=128),
    "all": dict(gm.WIDE["wide_moe"], moe_intermediate_size=128, num_experts=4,
                num_experts_per_tok=4),
}
LENGTHS = [5, 9, 3, 20]  # 20 > 16: a prefill over MAX_MOE_TOKENS falls back to torch
KIND = {"int8": Int8Weight, "int4": Int4Weight}


@pytest.fixture
def gemv_moe_calls(monkeypatch) -> list[int]:
    """Token counts of every gemv_moe.moe call made during the test."""
    calls: list[int] = []
    real = gemv_moe.moe

    def counted(gemv, x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(gemv, x, *args, **kwargs)

    monkeypatch.setattr(gemv_moe, "moe", counted)
    return calls


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    made = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
        made[name] = tmp_path_factory.mktemp(f"quant_moe_{name}")
        model.eval().save_pretrained(made[name])
    return made


def _model(folder, mode: str, backend, cls=Qwen3Model):
    shape, weights = load_folder(folder, "cpu", "float32")
    m = cls(shape, quantize_weights(weights, mode), backend)
    m.allocate_kv(4, 128)
    return m


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_moe_block_matches_float64(folders, mode, tokens, gemv_moe_calls):
    be = CupyBackend("cuda", torch.bfloat16)
    m = _model(folders["select"], mode, be)
    s = m.shape
    router = be.weight("layers.0.router")  # [E, H] bf16
    gate_up, down = be.weight("layers.0.experts.gate_up"), be.weight("layers.0.experts.down")
    assert isinstance(gate_up, KIND[mode]) and isinstance(down, KIND[mode])
    gen = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(256, s.hidden_size, device="cuda", generator=gen).bfloat16()  # [256, H]
    logits = torch.nn.functional.linear(x, router).double()  # [256, E], bf16-rounded
    top = logits.topk(s.num_experts_per_tok + 1, dim=-1).values
    clear = top[:, -2] - top[:, -1] > 0.1  # the k-th expert clearly beats the (k+1)-th
    x, logits = x[clear][:tokens], logits[clear][:tokens]
    assert x.shape[0] == tokens
    got = be.moe(x, 0)  # [T, H]
    assert gemv_moe_calls == [tokens]
    probs = torch.softmax(logits, dim=-1)
    weights, experts = probs.topk(s.num_experts_per_tok, dim=-1)  # [T, k]
    if s.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    ref = moe_ref.experts_forward(x.double(), weights, experts, gate_up.dequantize(torch.float64),
                                  down.dequantize(torch.float64))
    assert gm.rel_err(got, ref) <= 1e-2


@pytest.mark.parametrize("cls", [Qwen3Model, GraphModel], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_moe_model_as_accurate_as_torch_bf16(folders, mode, cls, gemv_moe_calls):
    folder = folders["all"]
    exact = gm.run_script(_model(folder, mode, TorchBackend("cuda", torch.float32)), LENGTHS, 6)
    ref = gm.run_script(_model(folder, mode, TorchBackend("cuda", torch.bfloat16)), LENGTHS, 6)
    be = CupyBackend("cuda", torch.bfloat16)
    m = _model(folder, mode, be, cls)
    assert isinstance(be.weight("layers.0.experts.gate_up"), KIND[mode])
    assert be.graph_safe(4, 1) and be.graph_safe(4, 4)  # quantized MoE may be captured
    got = gm.run_script(m, LENGTHS, 6)
    assert gemv_moe_calls, "the expert-indexed gemv never ran"
    if cls is GraphModel:
        assert m.replays > 0
    for g, r, e in zip(got, ref, exact):
        err_cupy, err_torch = gm.rel_err(g, e), gm.rel_err(r, e)
        assert err_cupy <= 1.5 * err_torch + 1e-3, (err_cupy, err_torch)
        # each is ~2-3% from fp32 (measured on the CPU torch backend), in different ways
        assert gm.rel_err(g, r) <= 5e-2


def test_fp32_quantized_experts_fall_back_to_torch(folders, gemv_moe_calls):
    """gemv_moe reads bf16 tokens only: fp32 with int8 experts takes the torch reference."""
    folder = folders["select"]
    ref = gm.run_script(_model(folder, "int8", TorchBackend("cuda", torch.float32)), [4, 6], 3)
    got = gm.run_script(_model(folder, "int8", CupyBackend("cuda", torch.float32)), [4, 6], 3)
    assert gemv_moe_calls == []
    assert max(gm.rel_err(g, r) for g, r in zip(got, ref)) <= 1e-5


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cli_quant_on_cupy_backend(folders, mode, gemv_moe_calls):
    args = ["generate", "--model", str(folders["select"]), "--prompt-ids", "5,17,3,88,41",
            "--max-new-tokens", "8", "--json", "--ignore-eos", "--device", "cuda",
            "--dtype", "bfloat16", "--quant", mode, "--backend", "cupy"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    assert (report["backend"], report["quant"], report["graphs"]) == ("cupy", mode, True)
    assert len(report["token_ids"]) == 8 and gemv_moe_calls
    assert all(0 <= t < CONFIGS["select"]["vocab_size"] for t in report["token_ids"])
