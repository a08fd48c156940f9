"""The gemv kernels (kernels/gemv*.cu) against the torch reference on the GPU.

Fresh random inputs for every case, a NaN-poisoned output buffer (every element must be
written), relative error ||y - ref|| / ||ref|| <= 1e-2 for bf16 operands; NaN never passes.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from gemv_checks import make_gemv

from kestrel_rt.cuda.gemv_plan import Plan
from kestrel_rt.cuda.gemv_variants import FILES_OF, all_variants
from kestrel_rt.quant import int4_fits
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

TOL = 1e-2
# (M, N, K): qwen3-8b's decode shapes (qkv, o, gate_up, down), verify widths, odd sizes.
SHAPES = [
    (1, 6144, 4096), (1, 4096, 4096), (1, 24576, 4096), (1, 4096, 12288),
    (4, 4096, 4096), (9, 6144, 4096), (16, 4096, 12288),
    (1, 1024, 1024), (3, 1000, 1152), (16, 8, 128), (7, 520, 384), (2, 3000, 640),
]


@pytest.fixture(scope="module")
def gemv():
    """The kernels this device's default options choose (bf16: the bulk kernel at 1-2 rows on
    sm_90+, the ring at up to 8 rows below it; the rest: the tuned kernels)."""
    g = make_gemv()
    g.compile()
    return g


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (an element not written, or a NaN)"
    return ((y.double() - ref).norm() / ref.norm()).item()


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def _x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16(gemv, m, n, k):
    gen = torch.Generator("cuda").manual_seed(m * 7919 + n * 31 + k)
    x = _x(m, k, gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    y = gemv.matmul(x, w, out=_poisoned(m, n))
    assert _rel_err(y, x.double() @ w.double().T) <= TOL


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized(gemv, kind, m, n, k):
    cls = Int8Weight if kind == "int8" else Int4Weight
    if kind == "int8" and k % 16:
        pytest.skip("int8 kernel needs K % 16 == 0")
    if kind == "int4" and not int4_fits(n, k):
        pytest.skip("int4 kernel needs K % 128 == 0 and N % 8 == 0")
    gen = torch.Generator("cuda").manual_seed(m * 7 + n * 131 + k + len(kind))
    x = _x(m, k, gen)
    w = cls.from_float(torch.randn(n, k, device="cuda", generator=gen))
    y = gemv.matmul(x, w, out=_poisoned(m, n))
    assert _rel_err(y, x.double() @ w.dequantize(torch.float64).T) <= TOL


@pytest.fixture(scope="module")
def gemv_all():
    g = make_gemv(sweep=True)
    g.compile()
    return g


@pytest.mark.parametrize("kind,geom", [(kind, v) for kind in ("bf16", "int8", "int4")
                                       for v in all_variants(FILES_OF[kind])])
def test_every_launch_variant(gemv_all, kind, geom):
    """Each (K split, tiles per block, U, prefetch) variant, ragged N, both n-tile widths."""
    gemv = gemv_all
    gen = torch.Generator("cuda").manual_seed(abs(hash((kind, geom))) % 2**31)
    n, k = 1032, 2048
    w32 = torch.randn(n, k, device="cuda", generator=gen)
    w = {"bf16": w32.bfloat16(), "int8": Int8Weight.from_float(w32),
         "int4": Int4Weight.from_float(w32)}[kind]
    dense = w if kind == "bf16" else w.dequantize(torch.float64)
    for m in (1, 12):
        x = _x(m, k, gen)
        y = gemv.matmul(x, w, out=_poisoned(m, n), chosen=Plan("tuned", geom))
        assert _rel_err(y, x.double() @ dense.double().T) <= TOL


def test_nan_input_gives_nan(gemv):
    """A NaN in the activations must show in the output (no masking of bad values)."""
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    x[0, 5] = float("nan")
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.isnan(gemv.matmul(x, w)).all()


def test_linear_dispatch_and_graph_capture(gemv):
    """linear() on [B, M, K] inputs, cuBLAS above 16 rows, and replay inside a CUDA graph."""
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Weight.from_float(w.float())
    for rows in ((1, 1), (2, 5), (3, 7)):  # 1, 10, 21 rows: kernel, kernel, cuBLAS
        x = torch.randn(*rows, 1024, device="cuda", dtype=torch.bfloat16)
        for weight, dense in ((w, w.double()), (q4, q4.dequantize(torch.float64))):
            y = gemv.linear(x, weight)
            assert y.shape == (*rows, 512)
            assert _rel_err(y, x.double() @ dense.T) <= TOL
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    out = _poisoned(1, 512)
    gemv.matmul(x, w, out=out)  # warm (module loaded) before capture
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        gemv.matmul(x, w, out=out)
    x.copy_(torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(out, x.double() @ w.double().T) <= TOL


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1152), (8, 128)])
def test_dequantize_kernels_equal_the_torch_reference(gemv, n, k):
    """One-pass GPU dequantization (prefill path) is bitwise the reference's bf16 weight."""
    gen = torch.Generator("cuda").manual_seed(n + k)
    w32 = torch.randn(n, k, device="cuda", generator=gen)
    for w in (Int8Weight.from_float(w32), Int4Weight.from_float(w32)):
        got = gemv.dequantize(w)
        assert torch.equal(got, w.dequantize(torch.bfloat16)), type(w).__name__
