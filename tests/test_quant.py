"""Quantization math on the CPU: int8 per channel, AWQ int4 (group 128), packing, reference
matmuls, the weight objects' torch hooks, and a tiny model quantized vs fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel_rt import quant
from kestrel_rt.quant_weights import (
    Int4Weight,
    Int8Weight,
    is_projection,
    quantize_weights,
)
from kestrel_sim.errors import KestrelError


def _w(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * 0.05


@pytest.mark.parametrize("shape", [(64, 256), (40, 384), (8, 128)])
def test_int8_round_trip_within_half_a_step(shape):
    w = _w(*shape, seed=1)
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (shape[0],)
    assert q.abs().max() <= 127
    err = (quant.dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all()
    # the largest |w| of each row maps to +-127 exactly
    assert (q.abs().amax(dim=1) == 127).all()


def test_int8_zero_row_is_zero():
    w = _w(4, 64, seed=2)
    w[1] = 0
    q, s = quant.quantize_int8(w)
    assert (quant.dequantize_int8(q, s)[1] == 0).all()


@pytest.mark.parametrize("shape", [(64, 256), (16, 384), (8, 128)])
def test_int4_round_trip_within_one_step(shape):
    w = _w(*shape, seed=3)
    q, z, s = quant.quantize_int4(w)
    assert q.shape == (shape[1], shape[0]) and z.shape == s.shape == (shape[1] // 128, shape[0])
    assert q.max() <= 15 and z.max() <= 15 and s.dtype == torch.float16
    deq = quant.dequantize_int4_values(q, z, s)  # [out, in]
    step = s.float().repeat_interleave(128, dim=0).T  # [out, in]
    err = (deq - w).abs()
    assert (err <= step * 1.0 + 1e-6).all()  # rounding (1/2) + zero-point rounding (1/2)
    assert (err <= step / 2 + 1e-6).float().mean() > 0.95  # almost all within half a step
    # rms error close to uniform rounding noise, step / sqrt(12)
    assert err.pow(2).mean().sqrt() < 0.4 * step.mean()


def test_awq_pack_order_and_round_trip():
    # one row, columns 0..7 -> nibbles in AWQ order (0, 2, 4, 6, 1, 3, 5, 7)
    vals = torch.arange(8, dtype=torch.uint8)[None] + 1  # 1..8
    word = quant.pack_awq(vals)[0, 0].item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [1, 3, 5, 7, 2, 4, 6, 8]
    g = torch.Generator().manual_seed(4)
    v = torch.randint(0, 16, (33, 64), generator=g, dtype=torch.uint8)
    packed = quant.pack_awq(v)
    assert packed.dtype == torch.int32 and packed.shape == (33, 8)
    assert torch.equal(quant.unpack_awq(packed), v)
    assert (packed < 0).any()  # high nibbles >= 8 use the sign bit, and survive


def test_kernel_layout_round_trip_and_dequantize():
    w = _w(48, 256, seed=5)
    qweight, qzeros, scales = quant.quantize_awq(w)
    qt = quant.awq_to_kernel(qweight)
    assert qt.shape == (48, 256 // 8)
    assert torch.equal(quant.kernel_to_awq(qt), qweight)
    assert torch.equal(quant.dequantize_kernel_int4(qt, qzeros, scales),
                       quant.dequantize_awq(qweight, qzeros, scales))


def test_reference_matmuls_equal_dequantize_then_matmul():
    w = _w(64, 256, seed=6)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    q, s = quant.quantize_int8(w)
    torch.testing.assert_close(quant.int8_matmul_ref(x, q, s),
                               x @ quant.dequantize_int8(q, s).T)
    qw, qz, sc = quant.quantize_awq(w)
    torch.testing.assert_close(quant.awq_matmul_ref(x, qw, qz, sc),
                               x @ quant.dequantize_awq(qw, qz, sc).T)
    for obj in (Int8Weight.from_float(w), Int4Weight.from_float(w)):
        torch.testing.assert_close(F.linear(x, obj), x @ obj.dequantize().T)


def test_weight_objects_cat_stack_index_to():
    a, b = _w(16, 256, seed=8), _w(24, 256, seed=9)
    for cls in (Int8Weight, Int4Weight):
        qa, qb = cls.from_float(a), cls.from_float(b)
        fused = torch.cat([qa, qb], dim=0)  # as packing.py fuses q/k/v rows
        assert isinstance(fused, cls) and tuple(fused.shape) == (40, 256)
        assert torch.equal(fused.dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))
        stacked = torch.stack([qa, qa])  # experts [E, out, in]
        assert tuple(stacked.shape) == (2, 16, 256)
        assert torch.equal(stacked[1].dequantize(), qa.dequantize())
        moved = qa.to(device="cpu", dtype=torch.bfloat16).contiguous()
        assert torch.equal(moved.dequantize(), qa.dequantize())
        assert moved.nbytes < a.numel() * 2  # smaller than bf16


def test_awq_file_tensors_round_trip_through_int4weight():
    w = _w(32, 128, seed=10)
    qweight, qzeros, scales = quant.quantize_awq(w)
    obj = Int4Weight.from_awq(qweight, qzeros, scales)
    back = obj.to_awq()
    assert all(torch.equal(u, v) for u, v in zip(back, (qweight, qzeros, scales)))


def test_quantize_weights_only_touches_projections():
    hf = {
        "model.embed_tokens.weight": _w(100, 128, 1),
        "model.layers.0.self_attn.q_proj.weight": _w(128, 128, 2),
        "model.layers.0.mlp.experts.3.down_proj.weight": _w(128, 256, 3),
        "model.layers.0.mlp.gate.weight": _w(8, 128, 4),
        "model.layers.0.input_layernorm.weight": torch.ones(128),
        "lm_head.weight": _w(100, 128, 5),
    }
    quantize_weights(hf, "int4")
    quantized = {n for n, t in hf.items() if isinstance(t, Int4Weight)}
    assert quantized == {"model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.mlp.experts.3.down_proj.weight"}
    assert is_projection("model.layers.1.mlp.up_proj.weight")
    assert not is_projection("model.layers.1.mlp.gate.weight")
    with pytest.raises(KestrelError, match="int3"):
        quantize_weights({}, "int3")
    with pytest.raises(KestrelError, match="q_proj"):
        quantize_weights({"model.layers.0.self_attn.q_proj.weight": _w(8, 100, 1)}, "int4")
