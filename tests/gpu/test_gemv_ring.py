"""The persistent ring gemv kernel (kernels/gemv_ring.cu, bf16 weights) against the torch
reference.

Plain, residual (also in place) and SwiGLU-epilogue launches; every compiled (KSPLIT, S)
variant with 1 and 2 blocks per SM; grids smaller than the tiles (each block loops) and
larger (blocks without a tile). Fresh random inputs, NaN-poisoned outputs (every element must
be written), relative error <= 1e-2; NaN never passes. Plus the ring under PDL inside a CUDA
graph, a bf16 model whose decode runs it, and the load-time probe that keeps it only where it
streams well (kestrel_rt/cuda/ring_probe.py).
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from gemv_checks import CUDA, TOL, hopper, make_gemv, poisoned, rel_err, silu_glu_ref, weight

from kestrel_rt.cuda.gemv_plan import Plan
from kestrel_rt.cuda.gemv_variants import GLU, PLAIN, RESIDUAL, RING_VARIANTS, SWIGLU
from kestrel_rt.options import default_options
from kestrel_rt.quant_weights import Int8Weight

# (M, N, K): qwen3-8b's decode shapes (qkv, o, down), ragged and tiny ones
SHAPES = [(1, 6144, 4096), (1, 4096, 12288), (1, 4096, 4096), (3, 1000, 1152), (8, 520, 384),
          (1, 8, 128), (2, 4104, 256)]
RING = Plan("ring", (8, 8, 1))  # the setting these launches force: 8 warps, 8 slots, 1 per SM


@pytest.fixture(scope="module")
def gemv():
    """The ring kernel's plan (no bulk kernel): bf16 launches of <= 8 rows take the ring."""
    return make_gemv(bulk=False, ring=True)


def _x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_ring_plain_and_residual(gemv, m, n, k):
    gen = torch.Generator("cuda").manual_seed(m * 7919 + n * 31 + k + 4)
    w, dense = weight("bf16", n, k, gen)
    x = _x(m, k, gen)
    for pro in (PLAIN, RESIDUAL):
        assert gemv.plan(w, pro, m, k).kernel == "ring"
    ref = x.double() @ dense.T
    y = gemv.matmul(x, w, out=poisoned(m, n), chosen=RING)
    assert rel_err(y, ref) <= TOL
    res = (torch.randn(m, n, device="cuda", generator=gen) * ref.std() * 0.3).bfloat16()
    want = res.double() + ref
    y = gemv.matmul(x, w, out=poisoned(m, n), residual=res, chosen=RING)
    assert rel_err(y, want) <= TOL
    y = gemv.matmul(x, w, out=res, residual=res, chosen=RING)  # in place: the residual stream
    assert y.data_ptr() == res.data_ptr() and rel_err(y, want) <= TOL


@pytest.mark.parametrize("m,i,k", [(1, 12288, 4096), (5, 520, 384), (1, 8, 128)])
def test_ring_glu_epilogue(gemv, m, i, k):
    gen = torch.Generator("cuda").manual_seed(m + i + k + 4)
    w, dense = weight("bf16", 2 * i, k, gen)
    x = _x(m, k, gen)
    assert gemv.plan(w, GLU, m, k).kernel == "ring"
    y = gemv.matmul(x, w, out=poisoned(m, i), glu=True, chosen=RING)
    assert rel_err(y, silu_glu_ref(x.double() @ dense.T)) <= TOL


@pytest.mark.parametrize("bps", [1, 2])
@pytest.mark.parametrize("variant", RING_VARIANTS, ids=lambda v: ".".join(map(str, v)))
def test_every_ring_variant(variant, bps):
    """Each (KSPLIT, S) with 1 and 2 blocks per SM: K short of the warps (idle warps), a grid
    of fewer blocks than tiles and one of more."""
    g = make_gemv(bulk=False, ring=True)
    chosen = Plan("ring", (*variant, bps))
    gen = torch.Generator("cuda").manual_seed(abs(hash(("bf16", variant, bps))) % 2**31)
    for m, n, k in ((1, 8200, 1024), (4, 16, 256), (1, 40000, 128), (2, 4104, 512)):
        w, dense = weight("bf16", n, k, gen)
        x = _x(m, k, gen)
        y = g.matmul(x, w, out=poisoned(m, n), chosen=chosen)
        assert rel_err(y, x.double() @ dense.T) <= TOL


def test_ring_not_taken_where_it_does_not_fit(gemv):
    """More than 8 rows, x above the staging budget, a SwiGLU prologue or int8 weights go to
    the tuned kernels; where the bulk kernel runs (sm_90+), bf16 decode launches take it and
    never the ring; without the ring, the tuned kernels."""
    gen = torch.Generator("cuda").manual_seed(3)
    w, _ = weight("bf16", 4096, 4096, gen)
    assert gemv.plan(w, PLAIN, 1, 4096).kernel == "ring"
    assert gemv.plan(w[:, :2048].contiguous(), PLAIN, 8, 2048).kernel == "ring"  # 32 KiB of x
    assert gemv.plan(w, PLAIN, 9, 4096).kernel == "tuned"
    wide, _ = weight("bf16", 4096, 12288, gen)
    assert gemv.plan(wide, PLAIN, 2, 12288).kernel == "tuned"  # 48 KiB of x
    assert gemv.plan(w, SWIGLU, 1, 4096).kernel == "tuned"  # SwiGLU of x (experts only)
    q8 = Int8Weight.from_float(torch.randn(4096, 4096, device="cuda", generator=gen))
    assert gemv.plan(q8, PLAIN, 1, 4096).kernel == "tuned"
    off = make_gemv(bulk=False, ring=False)
    assert off.plan(w, PLAIN, 1, 4096).kernel == "tuned"
    if hopper():  # the bulk kernel takes the launch ahead of the ring, and declines 3+ rows
        both = make_gemv(bulk=True, ring=True)
        assert both.plan(w, PLAIN, 1, 4096).kernel == "bulk"
        assert both.plan(w, PLAIN, 4, 4096).kernel == "tuned"


def test_ring_under_pdl_in_a_cuda_graph():
    """A ring launch with PDL then a tuned int4 one (each waits for the one before: o = x @ W1,
    then y = o @ W2 + res) captured in a CUDA graph and replayed with new x."""
    g = make_gemv(bulk=False, ring=True, pdl=True)
    gen = torch.Generator("cuda").manual_seed(5)
    w1, d1 = weight("bf16", 4096, 4096, gen)
    w2, d2 = weight("int4", 4096, 4096, gen)
    x = _x(1, 4096, gen)
    mid, res, out = poisoned(1, 4096), poisoned(1, 4096), poisoned(1, 4096)

    def step():
        g.matmul(x, w1, out=mid, chosen=RING)
        g.matmul(mid, w2, out=out, residual=res)

    assert g.plan(w2, RESIDUAL, 1, 4096).kernel == "tuned"
    res.copy_(torch.randn(1, 4096, device="cuda", generator=gen).bfloat16())
    step()  # compiled and warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(_x(1, 4096, gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = res.double() + mid.double() @ d2.T
        assert rel_err(mid, x.double() @ d1.T) <= TOL
        assert rel_err(out, want) <= TOL


def _options(**overrides):
    """This device's cupy options with `overrides`."""
    return default_options(CUDA, backend="cupy", **overrides)


def test_model_decode_with_ring_as_accurate(monkeypatch, gemv_plans):
    """A bf16 model whose decode gemvs run the ring kernel (ring_gemv, the default below
    sm_90; kept here whatever this device's load-time probe says) stays as close to fp32 as
    with the tuned kernels."""
    import gpu_models as gm

    from kestrel_rt.backend import TorchBackend, cupy_backend
    from kestrel_rt.backend.cupy_backend import CupyBackend

    lengths = [5, 9, 3, 20]
    exact = gm.run_script(gm.model("wide", TorchBackend("cuda", torch.float32)), lengths, 6)
    tuned = CupyBackend("cuda", torch.bfloat16, _options(bulk_gemv=False, ring_gemv=False))
    ref = gm.run_script(gm.model("wide", tuned), lengths, 6)
    assert gemv_plans and all(p.kernel == "tuned" for _, _, p in gemv_plans)
    gemv_plans.clear()
    monkeypatch.setattr(cupy_backend, "ring_streams_well", lambda gemv: True)
    be = CupyBackend("cuda", torch.bfloat16, _options(bulk_gemv=False, ring_gemv=True))
    got = gm.run_script(gm.model("wide", be), lengths, 6)
    assert be.gemv.target.ring and not be.gemv.target.bulk
    assert any(p.kernel == "ring" for _, _, p in gemv_plans)
    for g, r, e in zip(got, ref, exact, strict=True):
        assert gm.rel_err(g, e) <= 1.5 * gm.rel_err(r, e) + 1e-3


def test_probe_and_the_backend_keeping_the_ring(monkeypatch):
    """probe_ring times the ring and the tuned bf16 kernel; ring_streams_well keeps the ring by
    that measurement; a backend asking for the ring (and not the bulk kernel) probes once at
    load and keeps the ring only where it streams well; with the bulk kernel (the default on
    sm_90+) nothing is probed."""
    import gpu_models as gm

    from kestrel_rt.backend.cupy_backend import CupyBackend
    from kestrel_rt.cuda import ring_probe

    g = make_gemv(bulk=False, ring=True)
    ring_us, tuned_us = ring_probe.probe_ring(g, copies=2, reps=3)
    assert 0 < ring_us < 1e4 and 0 < tuned_us < 1e4
    probes = []
    real = ring_probe.probe_ring

    def probe(gemv, **kw):
        probes.append(real(gemv, **kw))
        return probes[-1]

    monkeypatch.setattr(ring_probe, "probe_ring", probe)
    kept = ring_probe.ring_streams_well(g)
    (ring_us, tuned_us), = probes
    assert kept == (ring_us <= 1.1 * tuned_us)
    probes.clear()
    be = CupyBackend("cuda", torch.bfloat16, _options(bulk_gemv=False, ring_gemv=True))
    gm.model("wide", be)
    (ring_us, tuned_us), = probes
    assert be.gemv.target.ring == (ring_us <= 1.1 * tuned_us) and not be.gemv.target.bulk
    probes.clear()
    default = _options()
    be = CupyBackend("cuda", torch.bfloat16, default)
    gm.model("wide", be)
    assert len(probes) == (1 if default.ring_gemv and not default.bulk_gemv else 0)
    assert be.gemv.target.bulk == default.bulk_gemv
