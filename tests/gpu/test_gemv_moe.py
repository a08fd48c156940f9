"""Expert-indexed gemv kernels and the MoE block on them, against the torch reference (GPU).

Fresh random inputs, NaN-poisoned outputs, relative error <= 1e-2 for bf16 operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

cupy = pytest.importorskip("cupy")

from gemv_checks import make_gemv

from kestrel_rt import moe as moe_ref
from kestrel_rt.cuda import gemv_moe
from kestrel_rt.cuda.gemv_variants import PLAIN, SWIGLU
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

TOL = 1e-2


@pytest.fixture(scope="module")
def gemv():
    g = make_gemv()
    g.compile(pros=(PLAIN, SWIGLU))
    return g


def _stacked(kind: str, e: int, n: int, k: int, gen):
    w = torch.randn(e, n, k, device="cuda", generator=gen) * 0.05
    if kind == "bf16":
        return w.bfloat16()
    cls = Int8Weight if kind == "int8" else Int4Weight
    return torch.stack([cls.from_float(w[i]) for i in range(e)])


def _dense(w) -> torch.Tensor:
    return w.double() if isinstance(w, torch.Tensor) else w.dequantize(torch.float64)


def _rel(y, ref) -> float:
    assert torch.isfinite(y).all(), "non-finite output (an element not written?)"
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("e,n,k,tokens,top_k", [(16, 1536, 2048, 1, 8), (8, 2048, 768, 3, 2),
                                                (4, 264, 384, 5, 3)])
def test_experts_rows(gemv, kind, e, n, k, tokens, top_k):
    gen = torch.Generator("cuda").manual_seed(e * n + k + tokens)
    w = _stacked(kind, e, n, k, gen)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randint(0, e, (tokens * top_k,), device="cuda", generator=gen)
    out = torch.full((tokens * top_k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = gemv_moe.experts(gemv, x, w, ids, top_k, out=out)
    dense = _dense(w)  # [E, N, K]
    ref = torch.stack([x[p // top_k].double() @ dense[ids[p]].T for p in range(ids.numel())])
    assert _rel(y, ref) <= TOL


def _moe_case(kind: str, tokens: int, gen: torch.Generator):
    """A routed MoE layer of 8 experts (hidden 256, intermediate 128, top 2): tokens [T, H],
    their routing weights and experts [T, 2], gate_up [8, 256, 256] and down [8, 256, 128]."""
    e, h, inter, top_k = 8, 256, 128, 2
    gate_up, down = _stacked(kind, e, 2 * inter, h, gen), _stacked(kind, e, h, inter, gen)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    router = torch.randn(e, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights, experts = moe_ref.route(x, router, top_k, True)
    return x, weights, experts, gate_up, down


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_moe_block_matches_reference_and_captures(gemv, kind):
    gen = torch.Generator("cuda").manual_seed(7)
    x, weights, experts, gate_up, down = _moe_case(kind, 4, gen)
    assert gemv_moe.supports(x, gate_up, down)
    got = gemv_moe.moe(gemv, x, weights, experts, gate_up, down)
    ref = moe_ref.experts_forward(x.double(), weights.double(), experts, _dense(gate_up),
                                  _dense(down))
    assert _rel(got, ref) <= TOL
    graph = torch.cuda.CUDAGraph()  # no host sync inside: it must capture
    with torch.cuda.graph(graph):
        static = gemv_moe.moe(gemv, x, weights, experts, gate_up, down)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(static, ref) <= TOL


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("e,n,k,tokens,top_k", [(16, 2048, 768, 1, 8), (8, 264, 384, 3, 2),
                                                (4, 4096, 1536, 5, 1)])
def test_experts_with_swiglu_prologue(gemv, kind, e, n, k, tokens, top_k):
    """experts(swiglu=True): rows of gate|up [2K] go in, SwiGLU (TorchBackend's bf16
    rounding) then the expert's matmul; x_div > 1 (one row per token) and = 1 (one per pair)."""
    gen = torch.Generator("cuda").manual_seed(e * n + k + tokens + 1)
    w = _stacked(kind, e, n, k, gen)
    dense = _dense(w)  # [E, N, K]
    ids = torch.randint(0, e, (tokens * top_k,), device="cuda", generator=gen)
    for x_div, rows in ((top_k, tokens), (1, tokens * top_k)):
        gu = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate) * up  # [rows, K] bf16
        out = torch.full((tokens * top_k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = gemv_moe.experts(gemv, gu, w, ids, x_div, out=out, swiglu=True)
        ref = torch.stack([act[p // x_div].double() @ dense[ids[p]].T
                           for p in range(ids.numel())])
        assert _rel(y, ref) <= TOL
    with pytest.raises(ValueError):  # plain rows [K] are not gate|up rows [2K]
        gemv_moe.experts(gemv, gu[:, :k].contiguous(), w, ids, 1, swiglu=True)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_moe_block_adds_the_residual(gemv, kind):
    """moe(residual=r) = r + moe(): the residual add rounds as torch's `r + moe_out`."""
    gen = torch.Generator("cuda").manual_seed(11)
    x, weights, experts, gate_up, down = _moe_case(kind, 3, gen)
    plain = gemv_moe.moe(gemv, x, weights, experts, gate_up, down)
    res = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = res * plain.float().pow(2).mean().sqrt().item()
    got = gemv_moe.moe(gemv, x, weights, experts, gate_up, down, residual=res)
    assert torch.equal(got, res + plain)  # same kernels, same rounding: bitwise
    ref = moe_ref.experts_forward(x.double(), weights.double(), experts, _dense(gate_up),
                                  _dense(down)) + res.double()
    assert _rel(got, ref) <= TOL
