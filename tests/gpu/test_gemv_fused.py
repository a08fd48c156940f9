"""The gemv kernels with a fused prologue (RMSNorm / SwiGLU of x as it loads) and residual
epilogue (kernels/gemv_mma.cuh, PRO) against the torch composition, on the GPU.

Reference: residual + act(x) @ W_dequant.T with act TorchBackend's rms_norm / swiglu in bf16
(the linear in float64). Fresh random activations for every case, NaN-poisoned outputs (every
element must be written), relative error <= 1e-2; NaN never passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

cupy = pytest.importorskip("cupy")

from kestrel_rt.cuda.gemv_variants import BF16_MAX_ROWS, FILES_OF, MAX_ROWS, all_variants
from kestrel_rt.cuda.linear import Gemv
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

TOL = 1e-2
EPS = 1e-6
KINDS = ("bf16", "int8", "int4")
PROS = ("plain", "rmsnorm", "swiglu")
ROWS = (1, 3, 8, 9, 16)
# (N, K) of the weight: qwen3-8b's qkv, gate_up, down (K = intermediate), o; odd sizes
SHAPES = [(6144, 4096), (24576, 4096), (4096, 12288), (4096, 4096), (1000, 1152), (520, 384),
          (8, 128)]


@pytest.fixture(scope="module")
def gemv():
    g = Gemv("cuda")
    g.compile(pros=(0, 1, 2))
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


def act_ref(x: torch.Tensor, norm: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    """TorchBackend.rms_norm / swiglu on bf16 x (the identity otherwise)."""
    if norm is not None:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return norm * (xf * torch.rsqrt(var + EPS)).to(x.dtype)
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


def _inputs(pro: str, m: int, k: int, gen: torch.Generator):
    """x [m, K] (swiglu: [m, 2K]) and the norm weight [K] (rmsnorm) or None."""
    width = 2 * k if pro == "swiglu" else k
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    if pro == "rmsnorm":
        x = x * 3.0 + 0.5  # rows not already unit-RMS
        norm = (1.0 + 0.2 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
        return x, norm
    return x, None


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


def _run(gemv, kind, x, w, **kw):
    return getattr(gemv, kind)(x, w, **kw)


@pytest.mark.parametrize("with_res", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pro", PROS)
def test_prologue_and_residual(gemv, weights, pro, kind, m, n, k, with_res):
    if not _fits(kind, n, k):
        pytest.skip(f"{kind} kernel does not take K={k}, N={n}")
    gen = torch.Generator("cuda").manual_seed(hash((pro, kind, m, n, k, with_res)) % 2**31)
    w, dense = weights(kind, n, k)
    x, norm = _inputs(pro, m, k, gen)
    ref = act_ref(x, norm, pro == "swiglu").double() @ dense.T  # [m, n]
    res = _residual(ref, gen) if with_res else None
    if res is not None:
        ref = ref + res.double()
    y = _run(gemv, kind, x, w, out=_poisoned(m, n), norm=norm, eps=EPS,
             swiglu=pro == "swiglu", residual=res)
    assert _rel_err(y, ref) <= TOL


@pytest.mark.parametrize("m", (1, 9))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pro", PROS)
def test_out_may_alias_residual(gemv, weights, pro, kind, m):
    """out = residual: y = residual + act(x) @ W.T written in place (the residual stream)."""
    n, k = 4096, 4096
    gen = torch.Generator("cuda").manual_seed(hash((pro, kind, m)) % 2**31)
    w, dense = weights(kind, n, k)
    x, norm = _inputs(pro, m, k, gen)
    prod = act_ref(x, norm, pro == "swiglu").double() @ dense.T
    res = _residual(prod, gen)
    ref = prod + res.double()
    y = _run(gemv, kind, x, w, out=res, norm=norm, eps=EPS, swiglu=pro == "swiglu",
             residual=res)
    assert y.data_ptr() == res.data_ptr()
    assert _rel_err(res, ref) <= TOL


@pytest.mark.parametrize("pro", ("rmsnorm", "swiglu"))
@pytest.mark.parametrize("k", (1024, 384))
def test_prologue_rounds_like_the_reference(gemv, pro, k):
    """With W = I (bf16) the output is act(x) itself: bitwise TorchBackend's bf16 op, up to
    rare flips of an ulp or two where rstd / expf differ in the last fp32 bit."""
    gen = torch.Generator("cuda").manual_seed(k + len(pro))
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    for m in (1, 5, 8):
        x, norm = _inputs(pro, m, k, gen)
        want = act_ref(x, norm, pro == "swiglu")
        got = gemv.bf16(x, eye, out=_poisoned(m, k), norm=norm, eps=EPS,
                        swiglu=pro == "swiglu")
        assert torch.isfinite(got).all()
        assert (got == want).float().mean().item() >= 0.99
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-6 + 1e-30).all()


@pytest.mark.parametrize("pro", ("rmsnorm", "swiglu"))
@pytest.mark.parametrize("kind,geom", [(kind, v) for kind in KINDS
                                       for v in all_variants(FILES_OF[kind])])
def test_every_launch_variant_with_prologue(gemv_all, pro, kind, geom):
    """Each (K split, tiles per block, U, prefetch) variant with a prologue and a residual
    (register-heavy ones included), ragged N, both n-tile widths."""
    gemv = gemv_all
    gen = torch.Generator("cuda").manual_seed(hash((pro, kind, geom)) % 2**31)
    n, k = 1032, 2048
    w32 = torch.randn(n, k, device="cuda", generator=gen)
    w = {"bf16": w32.bfloat16(), "int8": Int8Weight.from_float(w32),
         "int4": Int4Weight.from_float(w32)}[kind]
    dense = w.double() if kind == "bf16" else w.dequantize(torch.float64)
    for m in (1, 12):
        x, norm = _inputs(pro, m, k, gen)
        prod = act_ref(x, norm, pro == "swiglu").double() @ dense.T
        res = _residual(prod, gen)
        y = _run(gemv, kind, x, w, out=_poisoned(m, n), geom=geom, norm=norm, eps=EPS,
                 swiglu=pro == "swiglu", residual=res)
        assert _rel_err(y, prod + res.double()) <= TOL


@pytest.fixture(scope="module")
def gemv_all():
    g = Gemv("cuda", sweep=True)
    g.compile(pros=(1, 2))
    return g


@pytest.mark.parametrize("kind", KINDS)
def test_fused_api_shapes_and_values(gemv, weights, kind):
    """fused() on [B, S, K] inputs: each prologue, with and without residual."""
    n, k = 4096, 4096
    w, dense = weights(kind, n, k)
    gen = torch.Generator("cuda").manual_seed(len(kind))
    max_rows = BF16_MAX_ROWS if kind == "bf16" else MAX_ROWS
    for lead in ((1, 1), (2, 3), (max_rows // 2, 2)):
        for pro in PROS:
            x, norm = _inputs(pro, lead[0] * lead[1], k, gen)
            x = x.view(*lead, -1)
            prod = act_ref(x, norm, pro == "swiglu").double() @ dense.T  # [*lead, n]
            y = gemv.fused(x, w, norm=norm, eps=EPS, swiglu=pro == "swiglu")
            assert y is not None and y.shape == (*lead, n)
            assert _rel_err(y, prod) <= TOL
            res = _residual(prod, gen)
            y = gemv.fused(x, w, norm=norm, eps=EPS, swiglu=pro == "swiglu", residual=res)
            assert y is not None and y.shape == (*lead, n)
            assert _rel_err(y, prod + res.double()) <= TOL


def test_fused_returns_none_where_no_kernel_fits(gemv, weights):
    n, k = 512, 1024
    wb, _ = weights("bf16", n, k)
    w8, _ = weights("int8", n, k)
    norm = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert gemv.fused(x, wb, norm=norm) is not None
    # rows: bf16 beyond BF16_MAX_ROWS, any weight beyond MAX_ROWS
    assert gemv.fused(torch.randn(BF16_MAX_ROWS + 1, k, device="cuda").bfloat16(), wb) is None
    assert gemv.fused(torch.randn(BF16_MAX_ROWS + 1, k, device="cuda").bfloat16(), w8) is not None
    assert gemv.fused(torch.randn(MAX_ROWS + 1, k, device="cuda").bfloat16(), w8) is None
    # dtype of x, of the norm weight, of the residual
    assert gemv.fused(x.float(), wb) is None
    assert gemv.fused(x, wb, norm=norm.float()) is None
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
        gemv.fused(x, wb, swiglu=True)  # swiglu needs x [..., 2K]
    with pytest.raises(ValueError):
        gemv.fused(x, wb, residual=torch.zeros(2, n, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        gemv.fused(x, wb, norm=norm, swiglu=True)


def test_nan_in_the_activation_reaches_the_output(gemv, weights):
    """A NaN in x must show after a prologue too (no masking of bad values)."""
    n, k = 520, 384
    for kind in KINDS:
        w, _ = weights(kind, n, k)
        for pro in ("rmsnorm", "swiglu"):
            x, norm = _inputs(pro, 2, k, torch.Generator("cuda").manual_seed(1))
            x[1, 5] = float("nan")  # row 1 (its gate half with swiglu)
            y = _run(gemv, kind, x, w, norm=norm, eps=EPS, swiglu=pro == "swiglu")
            assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all(), (kind, pro)


def test_deterministic_and_captured_in_a_graph(gemv, weights):
    """The RMSNorm prologue sums in a fixed order: two runs are bitwise equal; the fused call
    replays inside a CUDA graph."""
    n, k = 6144, 4096
    w, dense = weights("int8", n, k)
    gen = torch.Generator("cuda").manual_seed(3)
    x, norm = _inputs("rmsnorm", 4, k, gen)
    res = torch.zeros(4, n, device="cuda", dtype=torch.bfloat16)
    first = gemv.fused(x, w, norm=norm, eps=EPS, residual=res)
    assert torch.equal(first, gemv.fused(x, w, norm=norm, eps=EPS, residual=res))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = gemv.fused(x, w, norm=norm, eps=EPS, residual=res)
    x2, _ = _inputs("rmsnorm", 4, k, gen)
    x.copy_(x2)
    res.copy_(torch.randn(4, n, device="cuda", generator=gen).bfloat16())
    static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = act_ref(x, norm, False).double() @ dense.T + res.double()
    assert _rel_err(static, ref) <= TOL


# -- SwiGLU epilogue (glu): W = [gate; up], y = silu(act(x) @ gate.T) * (act(x) @ up.T) -------
GLU_SHAPES = [(24576, 4096), (6144, 1024), (1040, 384), (16, 128)]  # 2I rows, I % 8 == 0


def glu_ref(x, norm, dense) -> torch.Tensor:
    """TorchBackend.swiglu of the bf16 linear output: silu(gate) * up, each rounded to bf16."""
    lin = (act_ref(x, norm, False).double() @ dense.T).bfloat16()  # [m, 2I]
    gate, up = lin.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("n,k", GLU_SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pro", ("plain", "rmsnorm"))
def test_swiglu_epilogue(gemv, weights, pro, kind, m, n, k):
    if not _fits(kind, n, k):
        pytest.skip(f"{kind} kernel does not take K={k}, N={n}")
    gen = torch.Generator("cuda").manual_seed(hash(("glu", pro, kind, m, n, k)) % 2**31)
    w, dense = weights(kind, n, k)
    x, norm = _inputs(pro, m, k, gen)
    y = _run(gemv, kind, x, w, out=_poisoned(m, n // 2), norm=norm, eps=EPS, glu=True)
    assert y.shape == (m, n // 2)
    assert _rel_err(y, glu_ref(x, norm, dense).double()) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_swiglu_epilogue_through_fused(gemv, weights, kind):
    n, k = 6144, 1024
    w, dense = weights(kind, n, k)
    gen = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(2, 3, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = gemv.fused(x, w, glu=True)
    assert y is not None and y.shape == (2, 3, n // 2)
    assert _rel_err(y.view(6, -1), glu_ref(x.view(6, k), None, dense).double()) <= TOL
    odd, _ = weights("bf16", 24, 128)  # I = 12: not a whole number of 8-row tiles
    assert gemv.fused(torch.randn(1, 128, device="cuda", dtype=torch.bfloat16), odd,
                      glu=True) is None
    with pytest.raises(ValueError):
        gemv.bf16(x.view(6, k)[:1], weights("bf16", n, k)[0], glu=True,
                  residual=torch.zeros(1, n, device="cuda", dtype=torch.bfloat16))


# -- the row-scale RMSNorm (rstd): y[m] = rstd(x[m]) * (x[m] . W), bf16 weights --------------
RSTD_SHAPES = [(6144, 4096), (151936 // 16, 4096), (1000, 1152), (8, 128)]


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """TorchBackend.rms_norm of bf16 x with a unit weight: bf16(x * rstd)."""
    return act_ref(x, torch.ones(x.shape[-1], device=x.device, dtype=x.dtype), False)


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
    y = gemv.bf16(x, w, out=_poisoned(m, n), rstd=True, eps=EPS)
    assert _rel_err(y, unit_norm(x).double() @ dense.T) <= TOL


@pytest.mark.parametrize("m", (1, 5, 16))
def test_rstd_with_swiglu_epilogue_and_through_fused(gemv, weights, m):
    n, k = 6144, 1024
    w, dense = weights("bf16", n, k)
    gen = torch.Generator("cuda").manual_seed(m)
    x = (torch.randn(m, k, device="cuda", generator=gen) * 3.0 + 0.5).bfloat16()
    y = gemv.bf16(x, w, out=_poisoned(m, n // 2), rstd=True, eps=EPS, glu=True)
    assert _rel_err(y, glu_ref(unit_norm(x), None, dense).double()) <= TOL
    got = gemv.fused(x.view(1, m, k), w, rstd=True, eps=EPS)
    if m > BF16_MAX_ROWS:  # more bf16 rows go to cuBLAS: fused declines, the caller composes
        assert got is None
    else:
        assert _rel_err(got.view(m, n), unit_norm(x).double() @ dense.T) <= TOL
    q, _ = weights("int8", n, k)
    assert gemv.fused(x, q, rstd=True, eps=EPS) is None  # bf16 kernel only


# -- sums of squares: the producer (ssq_out, with the residual) and the consumer (ssq_in) ----
# (N, K): qwen3-8b's o and down (the producers), qkv and gate_up (the consumers); N or K not
# a multiple of 16 (a partial last tile); K % 16 == 8 (bf16 only)
SSQ_SHAPES = [(4096, 4096), (4096, 12288), (6144, 4096), (24576, 4096), (1000, 1152),
              (520, 384), (8, 128), (32, 136)]


def tile_ssq(y: torch.Tensor) -> torch.Tensor:
    """Sum of squares of y [M, N] per row and 16-column tile (zeros past N): float64
    [M, ceil(N / 16)]."""
    m, n = y.shape
    p = -(-n // 16)
    padded = torch.zeros(m, 16 * p, dtype=torch.float64, device=y.device)
    padded[:, :n] = y.double()
    return padded.pow(2).view(m, p, 16).sum(-1)


@pytest.mark.parametrize("n,k", SSQ_SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_producer_sums_of_squares(gemv, weights, kind, m, n, k):
    """y = res + x W^T as before, and ssq_out [M, ceil(N / 16)] the sums of squares of the
    stored bf16 y per tile: every element (m < M) written (NaN-poisoned), rows of the buffer
    past M untouched, the same bits on a second run."""
    if not _fits(kind, n, k):
        pytest.skip(f"{kind} kernel does not take K={k}, N={n}")
    gen = torch.Generator("cuda").manual_seed(hash(("ssq", kind, m, n, k)) % 2**31)
    w, dense = weights(kind, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = x.double() @ dense.T
    res = _residual(ref, gen)
    p = -(-n // 16)
    big = torch.full((m + 2, p), float("nan"), device="cuda")  # rows m, m + 1: must stay NaN
    ssq = big[:m]
    y = _run(gemv, kind, x, w, out=_poisoned(m, n), residual=res, ssq_out=ssq)
    assert _rel_err(y, ref + res.double()) <= TOL
    assert torch.isfinite(ssq).all(), "an ssq_out element not written"
    assert torch.isnan(big[m:]).all(), "ssq_out written past row M"
    want = tile_ssq(y)
    assert ((ssq.double() - want).abs() <= 1e-5 * want + 1e-30).all(), (
        (ssq.double() - want).abs().max().item())
    again = torch.full_like(ssq, float("nan"))
    _run(gemv, kind, x, w, out=_poisoned(m, n), residual=res, ssq_out=again)
    assert torch.equal(again, ssq)  # no atomics: deterministic


@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("n,k", SSQ_SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_consumer_rstd_from_sums_of_squares(gemv, weights, kind, m, n, k, glu):
    """ssq_in from torch (the producer's layout): y = rstd * (x W^T) against the unit-weight
    RMSNorm then the matmul (with glu: then the SwiGLU), as test_rstd_row_scale; rows of very
    different scale, so a wrong row's rstd shows."""
    if not _fits(kind, n, k) or (glu and n % 16):
        pytest.skip(f"{kind} kernel does not take K={k}, N={n}{' with glu' if glu else ''}")
    gen = torch.Generator("cuda").manual_seed(hash(("ssq_in", kind, m, n, k, glu)) % 2**31)
    w, dense = weights(kind, n, k)
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.linspace(
        0.1, 8.0, m, device="cuda")[:, None]
    x = x.bfloat16()
    ssq = tile_ssq(x).float()  # [m, ceil(K / 16)]
    width = n // 2 if glu else n
    y = _run(gemv, kind, x, w, out=_poisoned(m, width), ssq_in=ssq, eps=EPS, glu=glu)
    ref = glu_ref(unit_norm(x), None, dense).double() if glu else unit_norm(x).double() @ dense.T
    assert _rel_err(y, ref) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_producer_feeds_consumer_through_fused(gemv, weights, kind):
    """The pair as CupyBackend runs it: o (producer) then gate_up (consumer, SwiGLU
    epilogue) through fused, against torch's residual add, unit-weight RMSNorm and SwiGLU."""
    h, inter, m = 1024, 768, 4
    wo, do = weights(kind, h, h)
    wg, dg = weights(kind, 2 * inter, h)
    gen = torch.Generator("cuda").manual_seed(11)
    a = torch.randn(1, m, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(1, m, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    ssq = torch.full((m, h // 16), float("nan"), device="cuda")
    x = gemv.fused(a, wo, residual=res, ssq_out=ssq)
    assert x is not None and torch.isfinite(ssq).all()
    act = gemv.fused(x, wg, ssq_in=ssq, eps=EPS, glu=True)
    assert act is not None and act.shape == (1, m, inter)
    x2 = x.view(m, h)
    assert _rel_err(x2, (a.view(m, h).double() @ do.T + res.view(m, h).double())) <= TOL
    assert _rel_err(act.view(m, inter), glu_ref(unit_norm(x2), None, dg).double()) <= TOL
    if kind == "bf16":  # more rows than the bf16 gemv takes: no kernel, the caller composes
        x9 = torch.randn(9, h, device="cuda", dtype=torch.bfloat16)
        assert gemv.fused(x9, wg, ssq_in=torch.zeros(9, h // 16, device="cuda"), eps=EPS,
                          glu=True) is None
    with pytest.raises(ValueError):
        gemv.fused(x, wg, ssq_in=torch.zeros(m, h // 16 - 1, device="cuda"), eps=EPS)
