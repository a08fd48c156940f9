"""Each TorchBackend op against the transformers module it stands for (the reference the
cupy kernels are later checked against)."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from kestrel_rt.backend import TorchBackend

TOL = 1e-5


def _pair(name: str):
    ref = tm.in_memory(name, seed=3)
    backend = TorchBackend("cpu", torch.float32)
    backend.load("m", tm.shape_of(ref.config), tm.weights_of(ref))
    return ref, backend


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= TOL


@pytest.fixture(scope="module", params=["odd_head_dim", "moe_norm"])
def pair(request):
    return _pair(request.param)


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_weight_keys_carry_the_model_id(pair):
    _, be = pair
    assert be.weight_names() and all(k.startswith("m/") for k in be.weight_names())


def test_embed_norms_linear_swiglu(pair):
    ref, be = pair
    H = ref.config.hidden_size
    tokens = torch.tensor([[1, 5, 9], [0, 2, 2]])
    _close(be.embed(tokens), ref.model.embed_tokens(tokens))
    x, r = _x(2, 3, H), _x(2, 3, H, seed=1)
    layer = ref.model.layers[0]
    _close(be.rms_norm(x, "layers.0.input_norm"), layer.input_layernorm(x))
    _close(be.rms_norm(x + r, "layers.0.post_norm"), layer.post_attention_layernorm(x + r))
    attn = layer.self_attn
    qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    _close(be.linear(x, "layers.0.qkv"), qkv)
    gu = _x(2, 3, 2 * 24, seed=2)
    _close(be.swiglu(gu), F.silu(gu[..., :24]) * gu[..., 24:])
    _close(be.logits(x + r), ref.lm_head(ref.model.norm(x + r)))


def test_qk_norm_rope(pair):
    ref, be = pair
    c = ref.config
    be.allocate_kv(2, 32)
    kv = be.kv
    slots = [kv.allocate(), kv.allocate()]
    kv.lengths[slots[1]] = 9  # the second sequence already has 9 tokens
    step = kv.step(slots, 3, [3, 3])
    q, k = _x(2, 3, c.num_attention_heads, c.head_dim), _x(2, 3, c.num_key_value_heads, c.head_dim, seed=1)
    oq, ok = be.qk_norm_rope(q, k, 1, step)
    attn = ref.model.layers[1].self_attn
    cos, sin = ref.model.rotary_emb(q, step.positions)  # [B, M, D]
    eq, ek = apply_rotary_pos_emb(attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), cos, sin)
    _close(oq, eq.transpose(1, 2))
    _close(ok, ek.transpose(1, 2))


def test_attention_over_cache_with_different_lengths(pair):
    ref, be = pair
    c = ref.config
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    L = c.num_hidden_layers - 1
    be.allocate_kv(3, 32)
    kv = be.kv
    slots = [kv.allocate() for _ in range(3)]
    context = [0, 5, 11]
    for s, n in zip(slots, context):  # fill earlier tokens' K/V directly
        kv.k[L, s, :n], kv.v[L, s, :n] = _x(n, Hkv, D, seed=s), _x(n, Hkv, D, seed=10 + s)
        kv.lengths[s] = n
    M = 4
    step = kv.step(slots, M, [M] * 3)
    q, k, v = _x(3, M, Hq, D, seed=20), _x(3, M, Hkv, D, seed=21), _x(3, M, Hkv, D, seed=22)
    out = be.attention(q, k, v, L, step)  # [3, M, Hq, D]
    module = ref.model.layers[L].self_attn
    for b, (s, n) in enumerate(zip(slots, context)):
        keys = torch.cat([kv.k[L, s, :n], k[b]])[None].transpose(1, 2)  # [1, Hkv, T, D]
        values = torch.cat([kv.v[L, s, :n], v[b]])[None].transpose(1, 2)
        assert torch.equal(kv.k[L, s, : n + M], keys[0].transpose(0, 1))  # written to cache
        T = n + M
        allowed = torch.arange(T)[None, :] <= (n + torch.arange(M))[:, None]  # [M, T]
        mask = torch.zeros(M, T).masked_fill(~allowed, float("-inf"))[None, None]
        expect, _ = eager_attention_forward(
            module, q[b : b + 1].transpose(1, 2), keys, values, mask, scaling=D**-0.5)
        _close(out[b], expect[0])  # expect [1, M, Hq, D] -> [M, Hq, D]


@pytest.mark.parametrize("name", ["moe", "moe_norm"])  # norm_topk_prob off / on
def test_moe_block(name):
    ref, be = _pair(name)
    shape = tm.shape_of(ref.config)
    assert shape.norm_topk_prob == (name == "moe_norm")
    moe_layers = [i for i in range(shape.num_hidden_layers) if shape.is_moe_layer(i)]
    assert moe_layers
    for layer in moe_layers:
        x = _x(13, shape.hidden_size, seed=layer) * 2  # [N, H]
        _close(be.moe(x, layer), ref.model.layers[layer].mlp(x[None])[0])


def test_fused_ops_compose_the_primitives(pair):
    """The Backend's fused ops (what the model calls) against the transformers modules."""
    ref, be = pair
    c = ref.config
    H, Hq, D = c.hidden_size, c.num_attention_heads, c.head_dim
    x = _x(2, 3, H, seed=4)
    layer = ref.model.layers[0]
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
    _close(be.norm_linear(x, "layers.0.input_norm", "layers.0.qkv"), qkv)
    o = _x(2, 3, Hq * D, seed=5)
    _close(be.linear_add(o, "layers.0.o", x), x + attn.o_proj(o))
    _close(be.logits(x), ref.lm_head(ref.model.norm(x)))
    dense = [i for i in range(c.num_hidden_layers) if not tm.shape_of(c).is_moe_layer(i)]
    for i in dense:
        layer_i = ref.model.layers[i]
        act = be.norm_linear_swiglu(x, f"layers.{i}.post_norm", f"layers.{i}.gate_up")
        h = layer_i.post_attention_layernorm(x)
        mlp = layer_i.mlp
        _close(act, F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        _close(be.linear_add(act, f"layers.{i}.down", x), x + mlp(h))
    for i in range(c.num_hidden_layers):
        if tm.shape_of(c).is_moe_layer(i):
            xs = _x(5, H, seed=7)
            _close(be.moe_add(xs, i, xs * 3), xs * 3 + ref.model.layers[i].mlp(xs[None])[0])
            layer_i = ref.model.layers[i]
            _close(be.norm_moe_add(xs, f"layers.{i}.post_norm", i),
                   xs + layer_i.mlp(layer_i.post_attention_layernorm(xs)[None])[0])


def test_rope_attention_is_norm_rope_then_attention(pair):
    ref, be = pair
    c = ref.config
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    out = []
    for fused in (True, False):
        be.allocate_kv(2, 16)
        kv = be.kv
        slots = [kv.allocate(), kv.allocate()]
        kv.lengths[slots[1]] = 4
        step = kv.step(slots, 2, [2, 2])
        q, k, v = _x(2, 2, Hq, D, seed=8), _x(2, 2, Hkv, D, seed=9), _x(2, 2, Hkv, D, seed=10)
        if fused:
            o = be.rope_attention(q, k, v, 1, step)
        else:
            o = be.attention(*be.qk_norm_rope(q, k, 1, step), v, 1, step)
        out.append((o, kv.k[1].clone(), kv.v[1].clone()))
    for a, b in zip(*out):
        assert torch.equal(a, b)
