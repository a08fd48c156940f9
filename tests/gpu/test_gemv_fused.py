"""The gemv kernels with their fused epilogues (kernels/gemv_mma.cuh, PRO: the residual add,
the SwiGLU of a [gate; up] weight, the row-scale RMSNorm) against the torch composition, on
the GPU, through Gemv.matmul and Gemv.fused as the backend calls them.

Reference: residual + x @ W_dequant.T (the linear in float64), TorchBackend's swiglu and
unit-weight rms_norm in bf16. Fresh random activations for every case, NaN-poisoned outputs
(every element must be written), relative error <= 1e-2; NaN never passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

cupy = pytest.importorskip("cupy")

from gemv_checks import make_gemv, unit_norm

from kestrel_rt.cuda.gemv_plan import Plan
from kestrel_rt.cuda.gemv_variants import BF16_MAX_ROWS, FILES_OF, MAX_ROWS, RESIDUAL, all_variants
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

TOL = 1e-2
EPS = 1e-6
KINDS = ("bf16", "int8", "int4")
ROWS = (1, 3, 8, 9, 16)
# (N, K) of the weight: qwen3-8b's qkv, gate_up, down (K = intermediate), o; odd sizes
SHAPES = [(6144, 4096), (24576, 4096), (4096, 12288), (4096, 4096), (1000, 1152), (520, 384),
          (8, 128)]


@pytest.fixture(scope="module")
def gemv():
    """The kernels this device's default options choose (bf16 at 1-2 rows: the bulk kernel on
    sm_90+; else and beyond: the ring up to 8 rows below sm_90, the tuned kernels)."""
    g = make_gemv()
    g.compile(pros=(0, RESIDUAL))
    return g


@pytest.fixture(scope="module")
def weights():
    """(kind, n, k) -> (weight, dense float64 [N, K]), made once per module (big ones)."""
    cache: dict = {}

    def get(kind: str, n: int, k: int):
        key = (kind, n, k)
        if key not in cache:
            gen = torch.Generator("cuda").manual_seed(n * 31 + k + len(kind))
            w32 = torch.randn(n, k, device="cuda", generator=gen)
            if kind == "bf16":
                w = (w32 * 0.02).bfloat16()
                cache[key] = (w, w.double())
            else:
                w = (Int8Weight if kind == "int8" else Int4Weight).from_float(w32)
                cache[key] = (w, w.dequantize(torch.float64))
        return cache[key]

    return get


def _fits(kind: str, n: int, k: int) -> bool:
    return {"bf16": k % 8 == 0, "int8": k % 16 == 0, "int4": k % 128 == 0 and n % 8 == 0}[kind]


def _x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """x [m, K] bf16."""
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (an element not written, or a NaN)"
    return ((y.double() - ref).norm() / ref.norm()).item()


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def _residual(ref: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A bf16 residual about 0.3x the size of the product: dropping it fails the tolerance,
    and an error in the product still shows."""
    scale = 0.3 * ref.pow(2).mean().sqrt().item()
    return (torch.randn(ref.shape, device="cuda", generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("with_res", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_plain_and_residual(gemv, weights, kind, m, n, k, with_res):
    if not _fits(kind, n, k):
        pytest.skip(f"{kind} kernel does not take K={k}, N={n}")
    gen = torch.Generator("cuda").manual_seed(hash(("plain", kind, m, n, k, with_res)) % 2**31)
    w, dense = weights(kind, n, k)
    x = _x(m, k, gen)
    ref = x.double() @ dense.T  # [m, n]
    res = _residual(ref, gen) if with_res else None
    if res is not None:
        ref = ref + res.double()
    y = gemv.matmul(x, w, out=_poisoned(m, n), residual=res)
    assert _rel_err(y, ref) <= TOL


@pytest.mark.parametrize("m", (1, 9))
@pytest.mark.parametrize("kind", KINDS)
def test_out_may_alias_residual(gemv, weights, kind, m):
    """out = residual: y = residual + x @ W.T written in place (the residual stream)."""
    n, k = 4096, 4096
    gen = torch.Generator("cuda").manual_seed(hash(("plain", kind, m)) % 2**31)
    w, dense = weights(kind, n, k)
    x = _x(m, k, gen)
    prod = x.double() @ dense.T
    res = _residual(prod, gen)
    ref = prod + res.double()
    y = gemv.matmul(x, w, out=res, residual=res)
    assert y.data_ptr() == res.data_ptr()
    assert _rel_err(res, ref) <= TOL


@pytest.mark.parametrize("kind,geom", [(kind, v) for kind in KINDS
                                       for v in all_variants(FILES_OF[kind])])
def test_every_launch_variant_with_residual(gemv_all, kind, geom):
    """Each (K split, tiles per block, U, prefetch) variant with the residual epilogue
    (register-heavy ones included), ragged N, both n-tile widths."""
    gemv = gemv_all
    gen = torch.Generator("cuda").manual_seed(hash(("residual", kind, geom)) % 2**31)
    n, k = 1032, 2048
    w32 = torch.randn(n, k, device="cuda", generator=gen)
    w = {"bf16": w32.bfloat16(), "int8": Int8Weight.from_float(w32),
         "int4": Int4Weight.from_float(w32)}[kind]
    dense = w.double() if kind == "bf16" else w.dequantize(torch.float64)
    for m in (1, 12):
        x = _x(m, k, gen)
        prod = x.double() @ dense.T
        res = _residual(prod, gen)
        y = gemv.matmul(x, w, out=_poisoned(m, n), residual=res, chosen=Plan("tuned", geom))
        assert _rel_err(y, prod + res.double()) <= TOL


@pytest.fixture(scope="module")
def gemv_all():
    g = make_gemv(sweep=True)
    g.compile(pros=(RESIDUAL,))
    return g


@pytest.mark.parametrize("kind", KINDS)
def test_fused_api_shapes_and_values(gemv, weights, kind):
    """fused() on [B, S, K] inputs, with and without residual."""
    n, k = 4096, 4096
    w, dense = weights(kind, n, k)
    gen = torch.Generator("cuda").manual_seed(len(kind))
    max_rows = BF16_MAX_ROWS if kind == "bf16" else MAX_ROWS
    for lead in ((1, 1), (2, 3), (max_rows // 2, 2)):
        x = _x(lead[0] * lead[1], k, gen).view(*lead, -1)
        prod = x.double() @ dense.T  # [*lead, n]
        y = gemv.fused(x, w)
        assert y is not None and y.shape == (*lead, n)
        assert _rel_err(y, prod) <= TOL
        res = _residual(prod, gen)
        y = gemv.fused(x, w, residual=res)
        assert y is not None and y.shape == (*lead, n)
        assert _rel_err(y, prod + res.double()) <= TOL


def test_fused_returns_none_where_no_kernel_fits(gemv, weights):
    n, k = 512, 1024
    wb, _ = weights("bf16", n, k)
    w8, _ = weights("int8", n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert gemv.fused(x, wb) is not None
    # rows: bf16 beyond BF16_MAX_ROWS, any weight beyond MAX_ROWS
    assert gemv.fused(torch.randn(BF16_MAX_ROWS + 1, k, device="cuda").bfloat16(), wb) is None
    assert gemv.fused(torch.randn(BF16_MAX_ROWS + 1, k, device="cuda").bfloat16(), w8) is not None
    assert gemv.fused(torch.randn(MAX_ROWS + 1, k, device="cuda").bfloat16(), w8) is None
    # dtype of x, of the residual
    assert gemv.fused(x.float(), wb) is None
    assert gemv.fused(x, wb, residual=torch.zeros(1, n, device="cuda")) is None
    # alignment: x starting 2 bytes into a buffer
    buf = torch.randn(k + 8, device="cuda", dtype=torch.bfloat16)
    assert gemv.fused(buf[1:k + 1].view(1, k), wb) is None
    # K rules: int8 needs K % 16 (bf16 takes K % 8); (int4 weights exist only for
    # int4_fits shapes, which the kernel takes)
    x8 = torch.randn(1, 1032, device="cuda", dtype=torch.bfloat16)
    assert gemv.fused(x8, Int8Weight.from_float(torch.randn(64, 1032, device="cuda"))) is None
    assert gemv.fused(x8, torch.randn(64, 1032, device="cuda").bfloat16()) is not None
    w4 = Int4Weight.from_float(torch.randn(64, 256, device="cuda"))
    assert gemv.fused(torch.randn(1, 256, device="cuda").bfloat16(), w4) is not None
    # a CPU tensor
    assert gemv.fused(x.cpu(), wb.cpu()) is None
    # shapes that do not fit are the caller's bug
    with pytest.raises(ValueError):
        gemv.fused(torch.randn(1, k + 8, device="cuda").bfloat16(), wb)
    with pytest.raises(ValueError):
        gemv.fused(x, wb, residual=torch.zeros(2, n, device="cuda", dtype=torch.bfloat16))


def test_nan_in_the_activation_reaches_the_output(gemv, weights):
    """A NaN in a row of x shows in that row of the output and in no other (no masking of
    bad values), with plain x and, bf16, with the row-scale RMSNorm (the row's rstd NaN)."""
    n, k = 520, 384
    for kind in KINDS:
        w, _ = weights(kind, n, k)
        for rstd in (False, True) if kind == "bf16" else (False,):
            x = _x(2, k, torch.Generator("cuda").manual_seed(1))
            x[1, 5] = float("nan")
            y = gemv.matmul(x, w, rstd=rstd, eps=EPS)
            assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all(), (kind, rstd)


@pytest.mark.parametrize("kind,rstd", [("int8", False), ("bf16", True)],
                         ids=["int8-residual", "bf16-rstd"])
def test_deterministic_and_captured_in_a_graph(gemv, weights, kind, rstd):
    """The kernels sum in a fixed order (int8 with the residual; bf16 with the row-scale
    RMSNorm, whose sums of squares too): two runs are bitwise equal; the fused call replays
    inside a CUDA graph."""
    n, k = 6144, 4096
    w, dense = weights(kind, n, k)
    gen = torch.Generator("cuda").manual_seed(3)
    x = (_x(4, k, gen) * 3.0 + 0.5)  # rows not already unit-RMS
    res = None if rstd else torch.zeros(4, n, device="cuda", dtype=torch.bfloat16)
    kw = {"rstd": True, "eps": EPS} if rstd else {"residual": res}
    first = gemv.fused(x, w, **kw)
    assert torch.equal(first, gemv.fused(x, w, **kw))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = gemv.fused(x, w, **kw)
    x.copy_(_x(4, k, gen) * 3.0 + 0.5)
    if res is not None:
        res.copy_(torch.randn(4, n, device="cuda", generator=gen).bfloat16())
    static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = (unit_norm(x, EPS) if rstd else x).double() @ dense.T
    assert _rel_err(static, ref if rstd else ref + res.double()) <= TOL


# -- SwiGLU epilogue (glu): W = [gate; up], y = silu(x @ gate.T) * (x @ up.T) ---------------
GLU_SHAPES = [(24576, 4096), (6144, 1024), (1040, 384), (16, 128)]  # 2I rows, I % 8 == 0


def glu_ref(x, dense) -> torch.Tensor:
    """TorchBackend.swiglu of the bf16 linear output: silu(gate) * up, each rounded to bf16."""
    lin = (x.double() @ dense.T).bfloat16()  # [m, 2I]
    gate, up = lin.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("n,k", GLU_SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_swiglu_epilogue(gemv, weights, kind, m, n, k):
    if not _fits(kind, n, k):
        pytest.skip(f"{kind} kernel does not take K={k}, N={n}")
    gen = torch.Generator("cuda").manual_seed(hash(("glu", "plain", kind, m, n, k)) % 2**31)
    w, dense = weights(kind, n, k)
    x = _x(m, k, gen)
    y = gemv.matmul(x, w, out=_poisoned(m, n // 2), glu=True)
    assert y.shape == (m, n // 2)
    assert _rel_err(y, glu_ref(x, dense).double()) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_swiglu_epilogue_through_fused(gemv, weights, kind):
    n, k = 6144, 1024
    w, dense = weights(kind, n, k)
    gen = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(2, 3, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = gemv.fused(x, w, glu=True)
    assert y is not None and y.shape == (2, 3, n // 2)
    assert _rel_err(y.view(6, -1), glu_ref(x.view(6, k), dense).double()) <= TOL
    odd, _ = weights("bf16", 24, 128)  # I = 12: not a whole number of 8-row tiles
    assert gemv.fused(torch.randn(1, 128, device="cuda", dtype=torch.bfloat16), odd,
                      glu=True) is None
    with pytest.raises(ValueError):
        gemv.matmul(x.view(6, k)[:1], weights("bf16", n, k)[0], glu=True,
                    residual=torch.zeros(1, n, device="cuda", dtype=torch.bfloat16))


# -- the row-scale RMSNorm (rstd): y[m] = rstd(x[m]) * (x[m] . W), bf16 weights --------------
RSTD_SHAPES = [(6144, 4096), (151936 // 16, 4096), (1000, 1152), (8, 128)]


@pytest.mark.parametrize("n,k", RSTD_SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_rstd_row_scale(gemv, weights, m, n, k):
    """Against the unit-weight RMSNorm then the matmul (folded weights: kestrel_rt/fold.py);
    rows of very different scale, so a wrong row's rstd shows."""
    gen = torch.Generator("cuda").manual_seed(hash(("rstd", m, n, k)) % 2**31)
    w, dense = weights("bf16", n, k)
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.linspace(
        0.1, 8.0, m, device="cuda")[:, None]
    x = x.bfloat16()
    y = gemv.matmul(x, w, out=_poisoned(m, n), rstd=True, eps=EPS)
    assert _rel_err(y, unit_norm(x, EPS).double() @ dense.T) <= TOL


@pytest.mark.parametrize("m", (1, 5, 16))
def test_rstd_with_swiglu_epilogue_and_through_fused(gemv, weights, m):
    n, k = 6144, 1024
    w, dense = weights("bf16", n, k)
    gen = torch.Generator("cuda").manual_seed(m)
    x = (torch.randn(m, k, device="cuda", generator=gen) * 3.0 + 0.5).bfloat16()
    y = gemv.matmul(x, w, out=_poisoned(m, n // 2), rstd=True, eps=EPS, glu=True)
    assert _rel_err(y, glu_ref(unit_norm(x, EPS), dense).double()) <= TOL
    got = gemv.fused(x.view(1, m, k), w, rstd=True, eps=EPS)
    if m > BF16_MAX_ROWS:  # more bf16 rows go to cuBLAS: fused declines, the caller composes
        assert got is None
    else:
        assert _rel_err(got.view(m, n), unit_norm(x, EPS).double() @ dense.T) <= TOL
    q, _ = weights("int8", n, k)
    assert gemv.fused(x, q, rstd=True, eps=EPS) is None  # bf16 kernel only
