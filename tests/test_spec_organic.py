"""Organic drafts made from a dummy target's own weights: copies on their own backends."""

from __future__ import annotations

import pytest
import spec_models as sm
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.engine import generate
from kestrel_rt.model import Qwen3Model
from kestrel_rt.quant_weights import Int4Weight, Int8Weight
from kestrel_rt.spec import SpecConfig, speculative_generate
from kestrel_rt.spec.organic import (
    agreement,
    dequantized,
    layer_skip_weights,
    organic_pair,
    quantized_weights,
)
from kestrel_rt.weights import dummy_weights
from kestrel_sim.errors import KestrelError
from kestrel_sim.models import preset

# qwen3-0.6b's structure, shrunk (int4 needs inputs in groups of 128)
SHAPE = preset("qwen3-0.6b").model_copy(update={
    "name": "small", "num_hidden_layers": 3, "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "max_position_embeddings": 128})


def _model(shape, hf) -> Qwen3Model:
    return Qwen3Model(shape, hf, TorchBackend("cpu", torch.float32))


def _storages(model: Qwen3Model) -> set[int]:
    out = set()
    for w in model.backend._weights.values():
        for t in (w.tensors() if hasattr(w, "tensors") else [w]):
            out.add(t.untyped_storage().data_ptr())
    return out


def test_layer_skip_draft_is_a_copy_of_the_first_layers():
    hf = dummy_weights(SHAPE, "cpu", "float32")
    shape, draft = layer_skip_weights(SHAPE, hf, 1)
    assert shape.num_hidden_layers == 1
    assert not any(".layers.1." in n or ".layers.2." in n for n in draft)
    assert "model.embed_tokens.weight" in draft and "model.norm.weight" in draft
    ptrs = {t.untyped_storage().data_ptr() for t in hf.values()}
    assert ptrs.isdisjoint(t.untyped_storage().data_ptr() for t in draft.values())
    # keeping every layer is the target itself
    full_shape, full = layer_skip_weights(SHAPE, hf, SHAPE.num_hidden_layers)
    prompts = sm.prompts(SHAPE.vocab_size, [5, 9])
    tokens = generate(_model(SHAPE, hf), prompts, 12).token_ids
    assert agreement(tokens, prompts, _model(full_shape, full)) == (24, 24)
    with pytest.raises(KestrelError, match="0..3 layers"):
        layer_skip_weights(SHAPE, hf, 4)


def test_quantized_draft_mixes_int4_and_int8_layers():
    hf = dummy_weights(SHAPE, "cpu", "float32")
    shape, draft = quantized_weights(SHAPE, hf, 2)  # the last 2 of 3 layers in int4
    assert isinstance(draft["model.layers.0.mlp.down_proj.weight"], Int8Weight)
    assert isinstance(draft["model.layers.1.self_attn.q_proj.weight"], Int4Weight)
    assert isinstance(draft["model.layers.2.mlp.gate_proj.weight"], Int4Weight)
    assert torch.equal(draft["model.norm.weight"], hf["model.norm.weight"])
    # dequantized values compute what the quantized objects compute (the CPU measurement)
    prompt = torch.tensor([sm.prompts(SHAPE.vocab_size, [6])[0]])
    a, b = _model(shape, dict(draft)), _model(shape, dequantized(draft, torch.float32))
    for m in (a, b):
        m.allocate_kv(1, 8)
    torch.testing.assert_close(a.forward(prompt, [0]), b.forward(prompt, [0]))


@pytest.mark.parametrize(("kind", "layers"), [("layer_skip", 1), ("quantized", 3)])
def test_organic_pair_decodes_as_its_target(kind, layers):
    target, draft = organic_pair(SHAPE, kind, layers)
    assert target.backend is not draft.backend
    assert _storages(target).isdisjoint(_storages(draft))
    prompts = sm.prompts(SHAPE.vocab_size, [3, 8, 5])
    got = speculative_generate(target, draft, prompts, 16, SpecConfig(k=3))
    assert got.token_ids == generate(target, prompts, 16).token_ids
    assert got.stats.num_drafts > 0
