"""The bulk-copy gemvs (kernels/gemv_bulk.cu gemv_bulk_bf16, gemv_bulk_int4) against the torch
reference.

Every compiled (WARPS, S, C) variant of both; plain, residual (also in place) and
SwiGLU-epilogue launches, bf16 also with the RMSNorm prologue; rows whose length is not a multiple of C (a partial last item),
tile counts below and above the warps of the grid, up to 8 rows of x. Fresh random inputs,
NaN-poisoned outputs (every element must be written), relative error <= 1e-2; NaN never
passes. Plus a chain under PDL inside a CUDA graph, and a model's decode through it.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from test_gemv_ring import _poisoned, _rel_err, _rms_ref, _silu_glu_ref, _weight

from kestrel_rt.cuda.gemv_variants import BULK_DEFAULT, BULK_VARIANTS
from kestrel_rt.cuda.linear import Gemv

TOL = 1e-2
# (M, N, K): qwen3-8b's decode shapes (qkv, down), a row shorter than an item's C bytes (a
# partial last item), 8-row tiles at the end, up to 8 rows of x, more tiles than warps; all with
# K % 128 == 0 and N % 8 == 0, as int4 needs
SHAPES = [(1, 6144, 4096), (1, 4096, 12288), (3, 1000, 1152), (8, 520, 384), (1, 8, 128),
          (2, 40000, 256)]


BF16 = BULK_VARIANTS["gemv"]
INT4 = BULK_VARIANTS["gemv_int4"]
# (weight kind, variant): every compiled bulk kernel
VARIANTS = [("bf16", v) for v in BF16] + [("int4", v) for v in INT4]
FILE = {"bf16": "gemv", "int4": "gemv_int4"}


def _ids(case) -> str:
    return f"{case[0]}-{'.'.join(map(str, case[1]))}"


def _gemv(kind: str, variant) -> Gemv:
    """A Gemv whose launches of this weight kind go to the bulk kernel `variant`."""
    g = Gemv("cuda")
    g.ring = g.ring_int4 = None
    g.bulk_max_rows = 8  # every row count the kernels take (the default routes up to 2)
    if kind == "bf16":
        g.bulk = variant
    else:
        g.bulk_int4 = variant
    return g


@pytest.mark.parametrize("case", VARIANTS, ids=_ids)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bulk_plain_and_residual(case, m, n, k):
    kind, variant = case
    g = _gemv(kind, variant)
    if not g.takes_bulk(FILE[kind], 0, m, k):
        pytest.skip("the ring and x need more shared memory than this device has")
    gen = torch.Generator("cuda").manual_seed(m * 7919 + n * 31 + k + sum(variant) + len(kind))
    w, dense = _weight(kind, n, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = x.double() @ dense.T
    linear = getattr(g, kind)
    assert _rel_err(linear(x, w, out=_poisoned(m, n)), ref) <= TOL
    res = (torch.randn(m, n, device="cuda", generator=gen) * ref.std() * 0.3).bfloat16()
    want = res.double() + ref
    assert _rel_err(linear(x, w, out=_poisoned(m, n), residual=res), want) <= TOL
    y = linear(x, w, out=res, residual=res)  # in place: the residual stream
    assert y.data_ptr() == res.data_ptr() and _rel_err(y, want) <= TOL


@pytest.mark.parametrize("case", VARIANTS, ids=_ids)
@pytest.mark.parametrize("m,i,k", [(1, 12288, 4096), (5, 520, 384)])
@pytest.mark.parametrize("norm", [False, True])
def test_bulk_glu_and_rmsnorm(case, m, i, k, norm):
    """The SwiGLU epilogue, with and without the RMSNorm of x (bf16: done as x is staged;
    int4: XLoad's, the rstd once per block)."""
    kind, variant = case
    g = _gemv(kind, variant)
    assert g.takes_bulk(FILE[kind], 9 if norm else 8, m, k)
    gen = torch.Generator("cuda").manual_seed(m + i + k + norm + len(kind))
    w, dense = _weight(kind, 2 * i, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    nw = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16() if norm else None
    xin = _rms_ref(x, nw, 1e-6) if norm else x
    y = getattr(g, kind)(x, w, out=_poisoned(m, i), glu=True, norm=nw, eps=1e-6)
    assert _rel_err(y, _silu_glu_ref(xin.double() @ dense.T)) <= TOL


@pytest.mark.parametrize("variant", BF16, ids=lambda v: ".".join(map(str, v)))
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (2, 9504, 4096), (8, 2128, 384),
                                   (3, 2400, 1152)])
@pytest.mark.parametrize("glu", [False, True])
def test_bulk_rstd_row_scale(variant, m, n, k, glu):
    """The row-scale RMSNorm (rstd: the norm weight folded into W): x staged as it is, the
    rows' rstd from the sums of squares taken as it is staged, applied as the tiles are stored;
    rows of very different scale, so a wrong row's rstd shows. Against the unit-weight RMSNorm
    then the matmul (and the SwiGLU epilogue)."""
    g = _gemv("bf16", variant)
    pro = 24 if glu else 16
    n = n if glu else n - 8  # (without the SwiGLU epilogue: a partial last tile)
    if not g.takes_bulk("gemv", pro, m, k):
        pytest.skip("the ring and x need more shared memory than this device has")
    gen = torch.Generator("cuda").manual_seed(m + n + k + glu)
    w, dense = _weight("bf16", n, k, gen)
    x = (torch.randn(m, k, device="cuda", generator=gen)
         * torch.linspace(0.1, 8.0, m, device="cuda")[:, None]).bfloat16()
    unit = _rms_ref(x, torch.ones(k, device="cuda", dtype=torch.bfloat16), 1e-6)
    launches = []
    launch = g._launch_bulk
    g._launch_bulk = lambda *a, **kw: launches.append(a[8]) or launch(*a, **kw)
    y = g.bf16(x, w, out=_poisoned(m, n // 2 if glu else n), rstd=True, eps=1e-6, glu=glu)
    assert launches == [pro]
    prod = unit.double() @ dense.T
    assert _rel_err(y, _silu_glu_ref(prod) if glu else prod) <= TOL


def _argmax_state(m: int):
    return (torch.zeros(m, dtype=torch.long, device="cuda"),
            torch.zeros(1, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("variant", BF16, ids=lambda v: ".".join(map(str, v)))
@pytest.mark.parametrize("m,n,k", [(1, 151936, 1024), (2, 40000, 4096), (1, 520, 384)])
@pytest.mark.parametrize("rstd", [False, True])
def test_bulk_argmax_epilogue(variant, m, n, k, rstd):
    """Gemv.argmax (the ARGMAX epilogue, no y) chooses what the same kernel's stored y would
    give torch.argmax: the first of equal maxima when the best row is copied to an index in
    another block's tiles, the first NaN; keys and count back at zero after each launch."""
    g = _gemv("bf16", variant)
    g.bulk_max_rows = 2
    x = torch.randn(m, k, device="cuda").bfloat16()
    if not g.takes_argmax(x, torch.empty(n, k, device="cuda", dtype=torch.bfloat16), rstd):
        pytest.skip("the ring and x need more shared memory than this device has")
    gen = torch.Generator("cuda").manual_seed(m + n + k + rstd)
    w, _ = _weight("bf16", n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    state = _argmax_state(m)

    def both():
        y = g.bf16(x, w, out=_poisoned(m, n), rstd=rstd, eps=1e-6)  # [M, N] bf16
        out = torch.full((m,), -7, dtype=torch.long, device="cuda")
        assert g.argmax(x, w, rstd=rstd, eps=1e-6, state=state, out=out)
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


def test_bulk_argmax_in_a_graph_writes_the_host_halves():
    """Captured in a CUDA graph with pinned host buffers: each replay's ids land in the half
    the device parity names, and equal the stored y's argmax."""
    g = _gemv("bf16", BULK_DEFAULT)
    m, n, k = 1, 30000, 1024
    gen = torch.Generator("cuda").manual_seed(5)
    w, _ = _weight("bf16", n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    state, out = _argmax_state(m), torch.zeros(m, dtype=torch.long, device="cuda")
    host = torch.full((2, m), -7, dtype=torch.long, pin_memory=True)
    parity = torch.zeros(1, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        assert g.argmax(x, w, rstd=True, eps=1e-6, state=state, out=out, host=(host, parity))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        g.argmax(x, w, rstd=True, eps=1e-6, state=state, out=out, host=(host, parity))
    for i in range(4):
        x.copy_(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
        parity.fill_(i % 2)
        graph.replay()
        torch.cuda.synchronize()
        ref = g.bf16(x, w, rstd=True, eps=1e-6).float().argmax(-1)
        assert torch.equal(out, ref) and host[i % 2].tolist() == ref.tolist(), i
    assert state[0].eq(0).all() and state[1].eq(0).all()


def test_bulk_setting_checked_and_routing():
    g = Gemv("cuda")
    assert g.bulk == BULK_DEFAULT  # the default on sm_90
    g.bulk = None
    assert not g.takes_bulk("gemv", 0, 1, 4096)
    with pytest.raises(ValueError, match="Gemv.bulk"):
        g.bulk = (4, 4, 384)
    g.bulk = BF16[0]
    assert g.takes_bulk("gemv", 0, 1, 4096) and g.takes_bulk("gemv", 1, 2, 4096)
    assert not g.takes_bulk("gemv", 1, 3, 4096)  # more than bulk_max_rows (2): tuned
    g.bulk_max_rows = 8
    assert g.takes_bulk("gemv", 1, 4, 4096)
    assert not g.takes_bulk("gemv", 0, 9, 4096)  # more than 8 rows
    assert not g.takes_bulk("gemv", 2, 1, 4096)  # SwiGLU prologue
    assert not g.takes_bulk("gemv_int4", 0, 1, 4096)  # int4: off by default
    assert not g.takes_bulk("gemv", 0, 2, 12288)  # x above the staging budget
    g.bulk_int4 = INT4[0]
    assert g.takes_bulk("gemv_int4", 0, 1, 4096) and g.takes_bulk("gemv_int4", 9, 1, 4096)


@pytest.mark.parametrize("kind2", ["bf16", "int4"])
def test_bulk_under_pdl_in_a_cuda_graph(kind2):
    """o = x @ W1 (bf16), then y = o @ W2 + res (W2 bf16 or int4): each launch waits for the
    one before (PDL), captured in a CUDA graph and replayed with new x."""
    g = Gemv("cuda", pdl=True)
    g.bulk, g.bulk_int4 = BF16[0], INT4[0]
    gen = torch.Generator("cuda").manual_seed(5 + len(kind2))
    w1, d1 = _weight("bf16", 4096, 4096, gen)
    w2, d2 = _weight(kind2, 4096, 4096, gen)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    mid, res, out = _poisoned(1, 4096), _poisoned(1, 4096), _poisoned(1, 4096)

    def step():
        g.bf16(x, w1, out=mid)
        getattr(g, kind2)(mid, w2, out=out, residual=res)

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
        assert _rel_err(mid, x.double() @ d1.T) <= TOL
        assert _rel_err(out, res.double() + mid.double() @ d2.T) <= TOL


def test_model_decode_with_bulk_as_accurate():
    """A bf16 model whose decode gemvs run the bulk kernel stays as close to fp32 as with the
    tuned kernels."""
    import gpu_models as gm

    from kestrel_rt.backend import TorchBackend
    from kestrel_rt.backend.cupy_backend import CupyBackend

    lengths = [5, 9, 3, 20]
    exact = gm.run_script(gm.model("wide", TorchBackend("cuda", torch.float32)), lengths, 6)
    tuned = CupyBackend("cuda", torch.bfloat16)
    tuned.settle_ring = False
    tuned.gemv().ring = tuned.gemv().bulk = None
    ref = gm.run_script(gm.model("wide", tuned), lengths, 6)
    be = CupyBackend("cuda", torch.bfloat16)
    be.settle_ring = False
    g = be.gemv()
    g.bulk = BF16[0]
    g.bulk_max_rows = 8  # the script decodes 4 sequences at once
    launches = []
    launch = g._launch_bulk
    g._launch_bulk = lambda *a, **kw: launches.append(a) or launch(*a, **kw)
    got = gm.run_script(gm.model("wide", be), lengths, 6)
    assert launches
    for a, r, e in zip(got, ref, exact, strict=True):
        assert gm.rel_err(a, e) <= 1.5 * gm.rel_err(r, e) + 1e-3
