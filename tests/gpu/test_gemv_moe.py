"""Expert-indexed gemv kernels and the MoE block on them, against the torch reference (GPU).

Fresh random inputs, NaN-poisoned outputs, relative error <= 1e-2 for bf16 operands."""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from kestrel_rt import moe as moe_ref
from kestrel_rt.cuda import gemv_moe
from kestrel_rt.cuda.linear import Gemv
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

TOL = 1e-2


@pytest.fixture(scope="module")
def gemv():
    g = Gemv("cuda")
    g.compile()
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


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_moe_block_matches_reference_and_captures(gemv, kind):
    gen = torch.Generator("cuda").manual_seed(7)
    e, h, inter, tokens, top_k = 8, 256, 128, 4, 2
    gate_up, down = _stacked(kind, e, 2 * inter, h, gen), _stacked(kind, e, h, inter, gen)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    router = torch.randn(e, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights, experts = moe_ref.route(x, router, top_k, True)
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
