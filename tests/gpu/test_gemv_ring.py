"""The persistent ring gemv kernels (kernels/gemv_ring.cu) against the torch reference.

bf16 and int4 weights; plain, residual (also in place) and SwiGLU-epilogue launches; every
compiled (KSPLIT, S) variant with 1 and 2 blocks per SM; grids smaller than the tiles (each
block loops) and larger (blocks without a tile). Fresh random inputs, NaN-poisoned outputs
(every element must be written), relative error <= 1e-2; NaN never passes. Plus the same
launches under PDL inside a CUDA graph, and a bf16 model whose decode runs them.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from kestrel_rt.cuda.gemv_variants import RING_VARIANTS
from kestrel_rt.cuda.linear import Gemv
from kestrel_rt.quant_weights import Int4Weight

TOL = 1e-2
# (M, N, K): qwen3-8b's decode shapes (qkv, o, down), ragged and tiny ones
SHAPES = [(1, 6144, 4096), (1, 4096, 12288), (1, 4096, 4096), (3, 1000, 1152), (8, 520, 384),
          (1, 8, 128), (2, 4104, 256)]


@pytest.fixture(scope="module")
def gemv():
    g = Gemv("cuda")
    g.bulk = None  # the cp.async ring, not the bulk kernel
    g.ring = g.ring_int4 = (8, 8, 1)
    return g


def _weight(kind: str, n: int, k: int, gen: torch.Generator):
    """(weight, dense float64 [N, K])."""
    w32 = torch.randn(n, k, device="cuda", generator=gen)
    if kind == "bf16":
        w = (w32 * 0.02).bfloat16()
        return w, w.double()
    w = Int4Weight.from_float(w32)
    return w, w.dequantize(torch.float64)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (an element not written, or a NaN)"
    return ((y.double() - ref).norm() / ref.norm()).item()


def _x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def _silu_glu_ref(prod: torch.Tensor) -> torch.Tensor:
    """TorchBackend.swiglu of the bf16 linear [M, 2I] -> [M, I] (float64)."""
    gate, up = prod.bfloat16().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).bfloat16() * up).double()


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_ring_plain_and_residual(gemv, kind, m, n, k):
    if kind == "int4" and (k % 128 or n % 8):
        pytest.skip("int4 needs K % 128 == 0 and N % 8 == 0")
    gen = torch.Generator("cuda").manual_seed(m * 7919 + n * 31 + k + len(kind))
    w, dense = _weight(kind, n, k, gen)
    x = _x(m, k, gen)
    assert gemv.takes_ring("gemv" if kind == "bf16" else "gemv_int4", 0, m, k)
    ref = x.double() @ dense.T
    y = getattr(gemv, kind)(x, w, out=_poisoned(m, n))
    assert _rel_err(y, ref) <= TOL
    res = (torch.randn(m, n, device="cuda", generator=gen) * ref.std() * 0.3).bfloat16()
    want = res.double() + ref
    y = getattr(gemv, kind)(x, w, out=_poisoned(m, n), residual=res)
    assert _rel_err(y, want) <= TOL
    y = getattr(gemv, kind)(x, w, out=res, residual=res)  # in place: the residual stream
    assert y.data_ptr() == res.data_ptr() and _rel_err(y, want) <= TOL


@pytest.mark.parametrize("m,i,k", [(1, 12288, 4096), (5, 520, 384), (1, 8, 128)])
@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_ring_glu_epilogue(gemv, kind, m, i, k):
    if kind == "int4" and k % 128:
        pytest.skip("int4 needs K % 128 == 0")
    gen = torch.Generator("cuda").manual_seed(m + i + k + len(kind))
    w, dense = _weight(kind, 2 * i, k, gen)
    x = _x(m, k, gen)
    y = getattr(gemv, kind)(x, w, out=_poisoned(m, i), glu=True)
    assert _rel_err(y, _silu_glu_ref(x.double() @ dense.T)) <= TOL


def _rms_ref(x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """TorchBackend.rms_norm of bf16 x [M, K] with weight norm (bf16 result)."""
    xf = x.float()
    return norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (1, 24576, 4096), (3, 1000, 1152),
                                   (8, 520, 384), (1, 16, 128)])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_ring_rmsnorm_prologue(gemv, kind, glu, m, n, k):
    """The RMSNorm of x done as the ring stages x (PRO 1, with the SwiGLU epilogue 9):
    rmsnorm then linear (then SwiGLU), as TorchBackend rounds them."""
    if glu and n % 16:
        pytest.skip("the SwiGLU epilogue needs N % 16 == 0")
    if kind == "int4" and (k % 128 or n % 8):
        pytest.skip("int4 needs K % 128 == 0 and N % 8 == 0")
    gen = torch.Generator("cuda").manual_seed(m * 3 + n + k + glu)
    w, dense = _weight(kind, n, k, gen)
    x = _x(m, k, gen) * 3
    norm = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16()
    eps = 1e-6
    ref = _rms_ref(x, norm, eps).double() @ dense.T
    out = _poisoned(m, n // 2 if glu else n)
    y = getattr(gemv, kind)(x, w, out=out, norm=norm, eps=eps, glu=glu)
    assert _rel_err(y, _silu_glu_ref(ref) if glu else ref) <= TOL
    if not glu:  # the norm really is applied: without it the result is far off
        assert _rel_err(getattr(gemv, kind)(x, w), ref) > 0.1


@pytest.mark.parametrize("bps", [1, 2])
@pytest.mark.parametrize("kind,variant",
                         [("bf16", v) for v in RING_VARIANTS["gemv"]]
                         + [("int4", v) for v in RING_VARIANTS["gemv_int4"]])
def test_every_ring_variant(kind, variant, bps):
    """Each (KSPLIT, S) with 1 and 2 blocks per SM: K short of the warps (idle warps), a grid
    of fewer blocks than tiles and one of more, tile counts not a multiple of the int4
    kernel's tiles per block."""
    g = Gemv("cuda")
    g.bulk = None
    if kind == "bf16":
        g.ring = (*variant, bps)
    else:
        g.ring_int4 = (*variant, bps)
    gen = torch.Generator("cuda").manual_seed(abs(hash((kind, variant, bps))) % 2**31)
    for m, n, k in ((1, 8200, 1024), (4, 16, 256), (1, 40000, 128), (2, 4104, 512)):
        w, dense = _weight(kind, n, k, gen)
        x = _x(m, k, gen)
        y = getattr(g, kind)(x, w, out=_poisoned(m, n))
        assert _rel_err(y, x.double() @ dense.T) <= TOL


def test_ring_not_taken_where_it_does_not_fit(gemv):
    """More than 8 rows, x above the staging budget, a SwiGLU prologue or int8 weights go to
    the tuned kernels."""
    assert not gemv.takes_ring("gemv", 0, 9, 4096)
    assert not gemv.takes_ring("gemv", 0, 2, 12288)  # 48 KiB of x
    assert not gemv.takes_ring("gemv", 2, 1, 4096)  # SwiGLU of x
    assert gemv.takes_ring("gemv", 1, 1, 4096)  # its RMSNorm: done as x is staged
    assert not gemv.takes_ring("gemv_int8", 0, 1, 4096)
    default = Gemv("cuda")
    if default.bulk is not None:  # sm_90: the bulk kernel takes the launch ahead of the ring
        assert not default.takes_ring("gemv", 0, 1, 4096)
        default.bulk = None
    assert default.takes_ring("gemv", 0, 1, 4096)  # bf16: the ring by default (behind bulk)
    assert not default.takes_ring("gemv_int4", 0, 1, 4096)  # int4: the tuned kernel
    default.ring = None
    assert not default.takes_ring("gemv", 0, 1, 4096)
    with pytest.raises(ValueError, match="Gemv.ring"):
        default.ring = (8, 5, 1)


def test_ring_under_pdl_in_a_cuda_graph():
    """A chain of ring launches with PDL (each waits for the one before: o = x @ W1, then
    y = o @ W2 + res) captured in a CUDA graph and replayed with new x."""
    g = Gemv("cuda", pdl=True)
    g.bulk = None
    g.ring = g.ring_int4 = (8, 8, 1)
    gen = torch.Generator("cuda").manual_seed(5)
    w1, d1 = _weight("bf16", 4096, 4096, gen)
    w2, d2 = _weight("int4", 4096, 4096, gen)
    x = _x(1, 4096, gen)
    mid, res, out = _poisoned(1, 4096), _poisoned(1, 4096), _poisoned(1, 4096)

    def step():
        g.bf16(x, w1, out=mid)
        g.int4(mid, w2, out=out, residual=res)

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
        assert _rel_err(mid, x.double() @ d1.T) <= TOL
        assert _rel_err(out, want) <= TOL


@pytest.mark.parametrize("ring_norm", [False, True], ids=["rmsnorm-kernel", "ring-norm"])
def test_model_decode_with_ring_as_accurate(ring_norm):
    """A bf16 model whose decode gemvs run the ring kernels (the default) stays as close to
    fp32 as with the tuned kernels."""
    import gpu_models as gm

    from kestrel_rt.backend import TorchBackend
    from kestrel_rt.backend.cupy_backend import CupyBackend

    lengths = [5, 9, 3, 20]
    exact = gm.run_script(gm.model("wide", TorchBackend("cuda", torch.float32)), lengths, 6)
    tuned = CupyBackend("cuda", torch.bfloat16)
    tuned.gemv().ring = tuned.gemv().bulk = None
    ref = gm.run_script(gm.model("wide", tuned), lengths, 6)
    be = CupyBackend("cuda", torch.bfloat16)
    be.ring_norm = ring_norm
    be.settle_ring = False  # the ring whatever this device's probe says
    g = be.gemv()
    g.bulk = None  # the ring rather than the bulk kernel
    assert g.ring is not None  # the default
    pros = []
    launch_ring = g._launch_ring
    g._launch_ring = lambda *a: pros.append(a[8]) or launch_ring(*a)
    got = gm.run_script(gm.model("wide", be), lengths, 6)
    assert len(pros) > 0
    assert any(p & 3 == 1 for p in pros) == ring_norm  # RMSNorm prologue launches
    for g, r, e in zip(got, ref, exact, strict=True):
        assert gm.rel_err(g, e) <= 1.5 * gm.rel_err(r, e) + 1e-3


def test_probe_and_settle_ring():
    """probe_ring times the ring and the tuned bf16 kernel (and leaves the settings as they
    were); settle_ring keeps the ring or turns it off by that measurement, and probes nothing
    while the bulk kernel is set (the default on sm_90), as a backend's first use shows."""
    from kestrel_rt.backend.cupy_backend import CupyBackend
    from kestrel_rt.cuda.gemv_variants import RING_DEFAULT

    g = Gemv("cuda")
    g.settle_ring()  # the bulk kernel is set (sm_90): nothing to probe
    assert g.bulk is not None and g.ring_probe_us is None and g.ring == RING_DEFAULT
    ring_us, tuned_us = g.probe_ring(copies=2, reps=3)
    assert 0 < ring_us < 1e4 and 0 < tuned_us < 1e4
    assert g.ring == RING_DEFAULT and g.bulk is not None  # both as they were
    g.bulk = None
    g.settle_ring()
    assert g.ring_probe_us is not None
    assert g.ring == (RING_DEFAULT if g.ring_probe_us[0] <= 1.1 * g.ring_probe_us[1] else None)
    be = CupyBackend("cuda", torch.bfloat16)
    assert be.gemv().bulk is not None and be.gemv().ring_probe_us is None
    off = CupyBackend("cuda", torch.bfloat16)
    off.settle_ring = False
    assert off.gemv().ring == RING_DEFAULT and off.gemv().ring_probe_us is None
