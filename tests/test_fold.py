"""kestrel_rt/fold.py: the folded checkpoint is the same model (logits of the reference
backend, fp32), its norms are unit, a tied lm_head is untied."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.fold import FOLD_DENSE_HIDDEN, fold_for_speed, fold_norms
from kestrel_rt.model import Qwen3Model
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


@pytest.mark.parametrize("name", ["moe", "moe_norm", "untied"])
def test_moe_only_folds_the_moe_post_norms(name):
    """moe_only: the same logits, the post-attention norms of MoE layers unit and every other
    norm (and a tied lm_head) as it was. fold_for_speed folds every norm of a float MoE model
    or a small float dense one (these tiny ones are small), of every float model where the bulk
    kernel applies the row scale (bulk), and nothing else."""
    ref = tm.in_memory(name)
    shape, hf = tm.shape_of(ref.config), tm.weights_of(ref)
    tokens = torch.tensor([[3, 17, 5, 60, 2, 9]])
    want = _logits(shape, hf, tokens)
    fshape, folded = fold_norms(shape, {k: v.clone() for k, v in hf.items()}, moe_only=True)
    assert torch.allclose(_logits(fshape, folded, tokens), want, rtol=1e-4, atol=1e-4)
    assert fshape.tie_word_embeddings == shape.tie_word_embeddings
    for n, t in folded.items():
        moe_post = n.endswith("post_attention_layernorm.weight") and shape.is_moe_layer(
            int(n.split(".")[2]))
        if n.endswith("norm.weight") or moe_post:
            assert torch.equal(t, torch.ones_like(t)) if moe_post else torch.equal(t, hf[n]), n
    _, fast = fold_for_speed(shape, {k: v.clone() for k, v in hf.items()}, None)
    _, cli = fold_for_speed(shape, {k: v.clone() for k, v in hf.items()}, "none")  # (CLI)
    assert all(torch.equal(cli[n], fast[n]) for n in hf)
    _, every = fold_norms(shape, {k: v.clone() for k, v in hf.items()})
    assert all(torch.equal(fast[n], every[n]) for n in hf)
    _, kept = fold_for_speed(shape, {k: v.clone() for k, v in hf.items()}, "int8")
    assert all(torch.equal(kept[n], hf[n]) for n in hf)
    big = shape.model_copy(update={"hidden_size": 2 * FOLD_DENSE_HIDDEN})  # (only a label)
    moe = any(shape.is_moe_layer(i) for i in range(shape.num_hidden_layers))
    _, large = fold_for_speed(big, {k: v.clone() for k, v in hf.items()}, None)
    assert all(torch.equal(large[n], (every if moe else hf)[n]) for n in hf)
    _, bulk = fold_for_speed(big, {k: v.clone() for k, v in hf.items()}, None, bulk=True)
    assert all(torch.equal(bulk[n], every[n]) for n in hf)  # with the bulk row scale: all
    _, bulk_int8 = fold_for_speed(big, {k: v.clone() for k, v in hf.items()}, "int8", bulk=True)
    assert all(torch.equal(bulk_int8[n], hf[n]) for n in hf)


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


def test_norm_row_scale_takes_known_values_only():
    """CupyBackend.norm_row_scale (which unit-weight norms become row scales) refuses a typo
    instead of silently running none of them (no CUDA needed: the setter alone)."""
    from kestrel_rt.backend.cupy_backend import CupyBackend

    be = CupyBackend.__new__(CupyBackend)
    for value in CupyBackend.NORM_ROW_SCALES:
        be.norm_row_scale = value
        assert be.norm_row_scale == value
    with pytest.raises(ValueError, match="norm_row_scale must be one of all, moe, none"):
        be.norm_row_scale = "al"
