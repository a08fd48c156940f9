"""kestrel_rt/fold.py: the folded checkpoint is the same model (logits of the reference
backend, fp32), its norms are unit, a tied lm_head is untied."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.fold import fold_norms
from kestrel_rt.model import Qwen3Model
from kestrel_rt.options import FOLD_DENSE_HIDDEN, fold_helps
from kestrel_sim.errors import KestrelError


def _logits(shape, hf, tokens):
    model = Qwen3Model(shape, {k: v.clone() for k, v in hf.items()},
                       TorchBackend("cpu", torch.float32))
    model.allocate_kv(1, 32)
    slot = model.kv.allocate()
    return model.forward(tokens, [slot])  # [1, M, V]


@pytest.mark.parametrize("name", ["tied", "untied", "moe", "moe_norm"])
def test_folded_model_gives_the_same_logits(name):
    ref = tm.in_memory(name)
    shape, hf = tm.shape_of(ref.config), tm.weights_of(ref)
    tokens = torch.tensor([[3, 17, 5, 60, 2, 9]])
    want = _logits(shape, hf, tokens)
    fshape, folded = fold_norms(shape, {k: v.clone() for k, v in hf.items()})
    got = _logits(fshape, folded, tokens)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not fshape.tie_word_embeddings
    assert torch.equal(folded["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}"
        assert torch.equal(folded[f"{p}.input_layernorm.weight"],
                           torch.ones_like(hf[f"{p}.input_layernorm.weight"]))
        post = folded[f"{p}.post_attention_layernorm.weight"]
        assert torch.equal(post, torch.ones_like(post))
    assert torch.equal(folded["model.norm.weight"], torch.ones_like(hf["model.norm.weight"]))


def test_fold_helps_float_models_where_the_row_scale_is_fast():
    """RuntimeOptions.fold_norms's default (options.fold_helps): every float model where the
    bulk kernel applies the row scale; without it, MoE models and small dense ones; never a
    quantized model."""
    from kestrel_sim.models import preset

    dense, small, moe = preset("qwen3-8b"), preset("qwen3-0.6b"), preset("qwen3-30b-a3b")
    assert small.hidden_size <= FOLD_DENSE_HIDDEN < dense.hidden_size
    for quant in (None, "none", "bf16"):
        assert fold_helps(dense, quant, bulk=True) and fold_helps(moe, quant, bulk=False)
        assert fold_helps(small, quant, bulk=False) and not fold_helps(dense, quant, bulk=False)
    for quant in ("int8", "int4"):
        assert not any(fold_helps(s, quant, bulk) for s in (dense, small, moe)
                       for bulk in (False, True))


def test_fold_refuses_quantized_or_missing_weights():
    from kestrel_rt.quant_weights import quantize_weights

    ref = tm.in_memory("untied")
    shape, hf = tm.shape_of(ref.config), tm.weights_of(ref)
    with pytest.raises(KestrelError, match="fold before quantizing"):
        fold_norms(shape, quantize_weights({k: v.clone() for k, v in hf.items()}, "int8"))
    del hf["lm_head.weight"]
    with pytest.raises(KestrelError, match="'lm_head.weight'"):
        fold_norms(shape, hf)


def test_per_expert_checkpoint_form_folds_the_same():
    """Experts stored one tensor per projection (the on-disk form) fold like the fused form."""
    ref = tm.in_memory("moe")
    shape, hf = tm.shape_of(ref.config), tm.weights_of(ref)
    split = {}
    for k, v in hf.items():
        if k.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            p, n = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                split[f"{p}{e}.gate_proj.weight"] = v[e, :n].clone()
                split[f"{p}{e}.up_proj.weight"] = v[e, n:].clone()
        elif k.endswith("experts.down_proj"):  # [E, H, I]
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                split[f"{p}{e}.down_proj.weight"] = v[e].clone()
        else:
            split[k] = v.clone()
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    want = _logits(*fold_norms(shape, {k: v.clone() for k, v in hf.items()}), tokens)
    got = _logits(*fold_norms(shape, split), tokens)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
