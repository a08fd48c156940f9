"""The bulk-copy gemv (kernels/gemv_bulk.cu gemv_bulk_bf16, sm_90+) against the torch
reference.

Every compiled (WARPS, S, C) variant, forced by Plan("bulk", ...); plain, residual (also in
place) and SwiGLU-epilogue launches, the row-scale RMSNorm, the ARGMAX epilogue; rows whose
length is not a multiple of C (a partial last item), tile counts below and above the warps of
the grid, up to 8 rows of x (the plan sends it 1-2). Fresh random inputs, NaN-poisoned
outputs (every element must be written), relative error <= 1e-2; NaN never passes. Plus the
plan on this device, a chain under PDL inside a CUDA graph, and a model's decode through it.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from gemv_checks import (
    CUDA,
    TOL,
    bulk_fits,
    hopper,
    make_gemv,
    poisoned,
    rel_err,
    silu_glu_ref,
    unit_norm,
    weight,
)

from kestrel_rt.cuda.gemv_plan import Plan
from kestrel_rt.cuda.gemv_variants import (
    ARGMAX,
    BULK_AFTER_ATTENTION,
    BULK_DEFAULT,
    BULK_VARIANTS,
    GLU,
    PLAIN,
    RESIDUAL,
    RSTD,
    SWIGLU,
)
from kestrel_rt.options import default_options

pytestmark = pytest.mark.skipif(not hopper(), reason="the bulk-copy gemv needs sm_90+")

# (M, N, K): qwen3-8b's decode shapes (qkv, down), a row shorter than an item's C bytes (a
# partial last item), 8-row tiles at the end, up to 8 rows of x, more tiles than warps
SHAPES = [(1, 6144, 4096), (1, 4096, 12288), (3, 1000, 1152), (8, 520, 384), (1, 8, 128),
          (2, 40000, 256)]


def _ids(variant) -> str:
    return ".".join(map(str, variant))


@pytest.fixture(scope="module")
def gemv():
    """The bulk kernel's plan (bf16 at 1-2 rows); the tests force each variant."""
    return make_gemv(bulk=True, ring=False)


@pytest.mark.parametrize("variant", BULK_VARIANTS, ids=_ids)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bulk_plain_and_residual(gemv, variant, m, n, k):
    if not bulk_fits(gemv, variant, m, k):
        pytest.skip("the ring and x need more shared memory than this device has")
    chosen = Plan("bulk", variant)
    gen = torch.Generator("cuda").manual_seed(m * 7919 + n * 31 + k + sum(variant) + 4)
    w, dense = weight("bf16", n, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = x.double() @ dense.T
    assert rel_err(gemv.matmul(x, w, out=poisoned(m, n), chosen=chosen), ref) <= TOL
    res = (torch.randn(m, n, device="cuda", generator=gen) * ref.std() * 0.3).bfloat16()
    want = res.double() + ref
    y = gemv.matmul(x, w, out=poisoned(m, n), residual=res, chosen=chosen)
    assert rel_err(y, want) <= TOL
    y = gemv.matmul(x, w, out=res, residual=res, chosen=chosen)  # in place: the residual stream
    assert y.data_ptr() == res.data_ptr() and rel_err(y, want) <= TOL


@pytest.mark.parametrize("variant", BULK_VARIANTS, ids=_ids)
@pytest.mark.parametrize("m,i,k", [(1, 12288, 4096), (5, 520, 384)])
def test_bulk_glu_epilogue(gemv, variant, m, i, k):
    """The SwiGLU epilogue: W = [gate; up], y = silu(x @ gate.T) * (x @ up.T)."""
    assert bulk_fits(gemv, variant, m, k)
    gen = torch.Generator("cuda").manual_seed(m + i + k + 4)
    w, dense = weight("bf16", 2 * i, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    y = gemv.matmul(x, w, out=poisoned(m, i), glu=True, chosen=Plan("bulk", variant))
    assert rel_err(y, silu_glu_ref(x.double() @ dense.T)) <= TOL


@pytest.mark.parametrize("variant", BULK_VARIANTS, ids=_ids)
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (2, 9504, 4096), (8, 2128, 384),
                                   (3, 2400, 1152)])
@pytest.mark.parametrize("glu", [False, True])
def test_bulk_rstd_row_scale(gemv, monkeypatch, variant, m, n, k, glu):
    """The row-scale RMSNorm (rstd: the norm weight folded into W): x staged as it is, the
    rows' rstd from the sums of squares taken as it is staged, applied as the tiles are stored;
    rows of very different scale, so a wrong row's rstd shows. Against the unit-weight RMSNorm
    then the matmul (and the SwiGLU epilogue)."""
    pro = RSTD | GLU if glu else RSTD
    n = n if glu else n - 8  # (without the SwiGLU epilogue: a partial last tile)
    if not bulk_fits(gemv, variant, m, k):
        pytest.skip("the ring and x need more shared memory than this device has")
    gen = torch.Generator("cuda").manual_seed(m + n + k + glu)
    w, dense = weight("bf16", n, k, gen)
    x = (torch.randn(m, k, device="cuda", generator=gen)
         * torch.linspace(0.1, 8.0, m, device="cuda")[:, None]).bfloat16()
    modules = []  # (file, PRO) of each launch's module
    module = gemv.module
    monkeypatch.setattr(gemv, "module", lambda file, p=PLAIN: modules.append((file, p))
                        or module(file, p))
    y = gemv.matmul(x, w, out=poisoned(m, n // 2 if glu else n), rstd=True, eps=1e-6, glu=glu,
                    chosen=Plan("bulk", variant))
    assert modules == [("gemv_bulk", pro)]
    prod = unit_norm(x).double() @ dense.T
    assert rel_err(y, silu_glu_ref(prod) if glu else prod) <= TOL


def _argmax_state(m: int):
    return (torch.zeros(m, dtype=torch.long, device="cuda"),
            torch.zeros(1, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("variant", BULK_VARIANTS, ids=_ids)
@pytest.mark.parametrize("m,n,k", [(1, 151936, 1024), (2, 40000, 4096), (1, 520, 384)])
@pytest.mark.parametrize("rstd", [False, True])
def test_bulk_argmax_epilogue(gemv, variant, m, n, k, rstd):
    """The ARGMAX epilogue (no y) of each variant chooses what the same kernel's stored y
    would give torch.argmax: the first of equal maxima when the best row is copied to an index
    in another block's tiles, the first NaN; keys and count back at zero after each launch.
    Where the plan picks the variant for the lm_head (BULK_DEFAULT), through Gemv.argmax."""
    if not bulk_fits(gemv, variant, m, k):
        pytest.skip("the ring and x need more shared memory than this device has")
    chosen = Plan("bulk", variant)
    gen = torch.Generator("cuda").manual_seed(m + n + k + rstd)
    w, _ = weight("bf16", n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    state = _argmax_state(m)
    planned = gemv.plan(w, (RSTD if rstd else PLAIN) | ARGMAX, m, k, "lm_head") == chosen

    def both():
        y = gemv.matmul(x, w, out=poisoned(m, n), rstd=rstd, eps=1e-6, chosen=chosen)  # [M, N]
        out = torch.full((m,), -7, dtype=torch.long, device="cuda")
        if planned:
            assert gemv.argmax(x, w, rstd=rstd, eps=1e-6, state=state, out=out)
        else:
            gemv.matmul(x, w, rstd=rstd, eps=1e-6, argmax=(out, None, None, *state),
                        chosen=chosen)
        torch.cuda.synchronize()
        assert state[0].eq(0).all() and state[1].eq(0).all()
        return y.float().argmax(-1), out

    ref, out = both()
    assert torch.equal(out, ref)
    best = int(ref[0])
    w[3] = w[best]  # row 3 (tile 0, block 0) now ties with the best: the smaller index wins
    ref, out = both()
    assert int(out[0]) == min(3, best) and torch.equal(out, ref)
    w[n - 1, 0] = float("nan")  # NaN rows: the first of them wins over every number
    w[n // 2, 5] = float("nan")
    ref, out = both()
    assert out.tolist() == [n // 2] * m and torch.equal(out, ref)


def test_bulk_argmax_in_a_graph_writes_the_host_halves(gemv):
    """Gemv.argmax captured in a CUDA graph with pinned host buffers: each replay's ids land in
    the half the device parity names, and equal the stored y's argmax."""
    m, n, k = 1, 30000, 1024
    gen = torch.Generator("cuda").manual_seed(5)
    w, _ = weight("bf16", n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    assert gemv.plan(w, RSTD | ARGMAX, m, k, "lm_head") == Plan("bulk", BULK_DEFAULT)
    state, out = _argmax_state(m), torch.zeros(m, dtype=torch.long, device="cuda")
    host = torch.full((2, m), -7, dtype=torch.long, pin_memory=True)
    parity = torch.zeros(1, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        assert gemv.argmax(x, w, rstd=True, eps=1e-6, state=state, out=out, host=(host, parity))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemv.argmax(x, w, rstd=True, eps=1e-6, state=state, out=out, host=(host, parity))
    for i in range(4):
        x.copy_(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
        parity.fill_(i % 2)
        graph.replay()
        torch.cuda.synchronize()
        ref = gemv.matmul(x, w, rstd=True, eps=1e-6,
                          chosen=Plan("bulk", BULK_DEFAULT)).float().argmax(-1)
        assert torch.equal(out, ref) and host[i % 2].tolist() == ref.tolist(), i
    assert state[0].eq(0).all() and state[1].eq(0).all()


def test_bulk_is_the_default_and_its_plan_on_this_device(gemv):
    """default_options on sm_90+ take the bulk kernel; the plan sends it bf16 launches of 1-2
    rows with plain x, a residual or the SwiGLU epilogue, and nothing else: not 3+ rows, not
    the SwiGLU prologue (experts only), not int4 weights, not x above the staging budget; and
    nothing without it."""
    assert default_options(CUDA, backend="cupy").bulk_gemv
    gen = torch.Generator("cuda").manual_seed(2)
    w, _ = weight("bf16", 4096, 4096, gen)
    for pro in (PLAIN, RESIDUAL, GLU):
        assert gemv.plan(w, pro, 1, 4096) == Plan("bulk", BULK_DEFAULT)
        assert gemv.plan(w, pro, 2, 4096) == Plan("bulk", BULK_DEFAULT)
        assert gemv.plan(w, pro, 3, 4096).kernel == "tuned"  # more than BULK_MAX_ROWS
    assert gemv.plan(w, PLAIN, 9, 4096).kernel == "tuned"
    assert gemv.plan(w, SWIGLU, 1, 4096).kernel == "tuned"
    assert gemv.plan(weight("int4", 4096, 4096, gen)[0], PLAIN, 1, 4096).kernel == "tuned"
    wide, _ = weight("bf16", 4096, 12288, gen)
    assert gemv.plan(wide, PLAIN, 2, 12288).kernel == "tuned"  # x above the staging budget
    assert make_gemv(bulk=False, ring=False).plan(w, PLAIN, 1, 4096).kernel == "tuned"


def test_after_attention_setting_gives_the_same_bits(gemv):
    """The o projection at one row where its weight has more 16-row tiles than SMs (qwen3-8b's
    o: 256 tiles) takes BULK_AFTER_ATTENTION, a deeper ring of the same WARPS and C as
    BULK_DEFAULT (two rows or another matmul keep BULK_DEFAULT): the same sums in the same
    order, so bitwise the same y, through fused as CupyBackend.linear_add calls it."""
    n = k = 4096
    assert n // 16 > gemv.sms
    gen = torch.Generator("cuda").manual_seed(6)
    w, dense = weight("bf16", n, k, gen)
    assert gemv.plan(w, RESIDUAL, 1, k, "o") == Plan("bulk", BULK_AFTER_ATTENTION)
    assert gemv.plan(w, RESIDUAL, 2, k, "o") == Plan("bulk", BULK_DEFAULT)
    assert gemv.plan(w, RESIDUAL, 1, k, "down") == Plan("bulk", BULK_DEFAULT)
    for _ in range(3):
        x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        res = torch.randn(1, 1, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        after = gemv.fused(x, w, residual=res, matmul="o")
        default = gemv.matmul(x.view(1, k), w, residual=res.view(1, n),
                              chosen=Plan("bulk", BULK_DEFAULT))
        assert torch.equal(after.view(1, n), default)
        assert rel_err(default, res.view(1, n).double() + x.view(1, k).double() @ dense.T) <= TOL


@pytest.mark.parametrize("second", ["bf16", "int4"], ids=["bulk", "tuned-int4"])
def test_bulk_under_pdl_in_a_cuda_graph(second):
    """o = x @ W1 (bulk), then y = o @ W2 + res (W2 bf16: the bulk kernel again; int4: the
    tuned int4 kernel): each launch waits for the one before (PDL), captured in a CUDA graph
    and replayed with new x."""
    g = make_gemv(bulk=True, ring=False, pdl=True)
    gen = torch.Generator("cuda").manual_seed(5 + len(second))
    w1, d1 = weight("bf16", 4096, 4096, gen)
    w2, d2 = weight(second, 4096, 4096, gen)
    assert g.plan(w1, PLAIN, 1, 4096).kernel == "bulk"
    assert g.plan(w2, RESIDUAL, 1, 4096).kernel == ("bulk" if second == "bf16" else "tuned")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    mid, res, out = poisoned(1, 4096), poisoned(1, 4096), poisoned(1, 4096)

    def step():
        g.matmul(x, w1, out=mid)
        g.matmul(mid, w2, out=out, residual=res)

    res.copy_(torch.randn(1, 4096, device="cuda", generator=gen).bfloat16())
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=gen).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(mid, x.double() @ d1.T) <= TOL
        assert rel_err(out, res.double() + mid.double() @ d2.T) <= TOL


def test_model_decode_with_bulk_as_accurate(gemv_plans):
    """A bf16 model whose decode gemvs run the bulk kernel (two sequences: the rows it takes)
    stays as close to fp32 as with the tuned kernels."""
    import gpu_models as gm

    from kestrel_rt.backend import TorchBackend
    from kestrel_rt.backend.cupy_backend import CupyBackend

    lengths = [9, 20]
    exact = gm.run_script(gm.model("wide", TorchBackend("cuda", torch.float32)), lengths, 6)
    tuned = CupyBackend("cuda", torch.bfloat16,
                        default_options(CUDA, backend="cupy", bulk_gemv=False, ring_gemv=False))
    ref = gm.run_script(gm.model("wide", tuned), lengths, 6)
    assert gemv_plans and all(p.kernel == "tuned" for _, _, p in gemv_plans)
    gemv_plans.clear()
    be = CupyBackend("cuda", torch.bfloat16,
                     default_options(CUDA, backend="cupy", bulk_gemv=True, ring_gemv=False))
    got = gm.run_script(gm.model("wide", be), lengths, 6)
    assert any(p.kernel == "bulk" for _, _, p in gemv_plans)
    for a, r, e in zip(got, ref, exact, strict=True):
        assert gm.rel_err(a, e) <= 1.5 * gm.rel_err(r, e) + 1e-3
