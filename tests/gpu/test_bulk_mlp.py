"""The fused attention-output + MLP launch (kernels/bulk_mlp.cu, kestrel_rt/cuda/bulk_mlp.py)
against the torch reference and against the three bulk launches it replaces.

qwen3-8b's and qwen3-0.6b's shapes and small odd ones, 1 and 2 rows; fresh random inputs,
NaN-poisoned scratch and output (every element must be written), relative error <= 1e-2
against float64 math with the backend's roundings; NaN never passes. Replays in a CUDA graph
under PDL (the grid barrier's counters reset themselves), and a model's decode through it.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from test_gemv_ring import _rel_err, _rms_ref, _silu_glu_ref, _weight

from kestrel_rt.cuda.bulk_mlp import BulkMlp
from kestrel_rt.cuda.gemv_variants import BULK_VARIANTS
from kestrel_rt.cuda.linear import Gemv

TOL = 1e-2
# (M, H, KO, I): qwen3-8b, qwen3-0.6b (KO = 2 H), fewer 16-row tiles than SMs in every matmul,
# a hidden size whose rows end inside an item (2 H bytes not a multiple of C)
SHAPES = [(1, 4096, 4096, 12288), (2, 1024, 2048, 3072), (1, 256, 512, 384),
          (2, 1168, 1024, 1040)]


def _inputs(m, hidden, k_o, inter, gen):
    wo, do = _weight("bf16", hidden, k_o, gen)
    wgu, dgu = _weight("bf16", 2 * inter, hidden, gen)
    wd, dd = _weight("bf16", hidden, inter, gen)
    o = torch.randn(m, k_o, device="cuda", generator=gen).bfloat16()
    h_in = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
    nw = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    return (o, h_in, wo, wgu, wd, nw), (do, dgu, dd)


def _reference(o, h_in, nw, do, dgu, dd, eps):
    """The three launches' math in float64 with the bf16 roundings between them."""
    h = (h_in.double() + (o.double() @ do.T).bfloat16().double()).bfloat16()
    act = _silu_glu_ref(_rms_ref(h, nw, eps).double() @ dgu.T).bfloat16()
    return h.double() + (act.double() @ dd.T).bfloat16().double()


def _unfused(g, o, h_in, wo, wgu, wd, nw, eps):
    """The three gemv_bulk_bf16 launches (norm in the staging) it replaces."""
    h = g.bf16(o, wo, residual=h_in)
    act = g.bf16(h, wgu, norm=nw, eps=eps, glu=True)
    return g.bf16(act, wd, residual=h)


def _gemv(variant, pdl=False):
    g = Gemv("cuda", pdl=pdl)
    g.bulk = variant
    return g


@pytest.mark.parametrize("variant", [BULK_VARIANTS["gemv"][0], (16, 4, 2048), (8, 3, 4096)],
                         ids=lambda v: ".".join(map(str, v)))
@pytest.mark.parametrize("m,hidden,k_o,inter", SHAPES)
def test_bulk_mlp_against_reference_and_the_three_launches(variant, m, hidden, k_o, inter):
    g = _gemv(variant)
    mlp = BulkMlp(g)
    if not mlp.takes(m, hidden, k_o, inter):
        pytest.skip("x or the ring need more shared memory than this device gives a block")
    gen = torch.Generator("cuda").manual_seed(m + hidden + inter)
    (o, h_in, wo, wgu, wd, nw), (do, dgu, dd) = _inputs(m, hidden, k_o, inter, gen)
    eps = 1e-6
    h = mlp(o, h_in, wo, wgu, wd, nw, eps)
    assert h is not None and h.shape == (m, hidden)
    assert _rel_err(h, _reference(o, h_in, nw, do, dgu, dd, eps)) <= TOL
    ref = _unfused(g, o, h_in, wo, wgu, wd, nw, eps)
    assert _rel_err(h, ref.double()) <= 1e-3  # the same roundings (up to the norm's sum order)
    h_in_copy = h_in.clone()
    again = mlp(o, h_in, wo, wgu, wd, nw, eps)  # a second launch: the barrier reset itself
    assert torch.equal(again, h) and torch.equal(h_in, h_in_copy)  # h_in is not written


def test_bulk_mlp_declines_what_it_does_not_take():
    g = _gemv(BULK_VARIANTS["gemv"][0])
    mlp = BulkMlp(g)
    assert not mlp.takes(3, 4096, 4096, 12288)  # more rows than bulk_max_rows (2)
    assert not mlp.takes(2, 4096, 4096, 12288)  # 48 KB of x: above the staging budget
    assert not mlp.takes(1, 4100, 4096, 12288)  # H not a multiple of 16
    gen = torch.Generator("cuda").manual_seed(3)
    (o, h_in, wo, wgu, wd, nw), _ = _inputs(1, 256, 512, 384, gen)
    assert mlp(o.float(), h_in, wo, wgu, wd, nw, 1e-6) is None  # not bf16
    assert mlp(o, h_in, wo, wgu[:-2], wd, nw, 1e-6) is None  # gate/up rows not 2 I
    g.bulk = None
    assert mlp(o, h_in, wo, wgu, wd, nw, 1e-6) is None  # no bulk setting


def test_bulk_mlp_in_a_cuda_graph_under_pdl():
    """A bulk gemv, then the fused launch, then another bulk gemv reading its output, each
    under PDL, captured once and replayed with new inputs: the barrier's counters stay
    consistent from replay to replay."""
    g = _gemv(BULK_VARIANTS["gemv"][0], pdl=True)
    mlp = BulkMlp(g)
    gen = torch.Generator("cuda").manual_seed(11)
    m, hidden, k_o, inter, eps = 1, 1024, 2048, 3072, 1e-6
    (_, h_in, wo, wgu, wd, nw), (do, dgu, dd) = _inputs(m, hidden, k_o, inter, gen)
    w1, d1 = _weight("bf16", k_o, hidden, gen)
    x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
    wt = wo.T.contiguous()  # [KO, H]: a gemv that reads h back
    outs = {}

    def captured():
        outs["o"] = g.bf16(x, w1)
        outs["h"] = mlp(outs["o"], h_in, wo, wgu, wd, nw, eps)
        outs["y"] = g.bf16(outs["h"], wt)

    captured()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    for _ in range(4):
        x.copy_(torch.randn(m, hidden, device="cuda", generator=gen).bfloat16())
        h_in.copy_(torch.randn(m, hidden, device="cuda", generator=gen).bfloat16())
        outs["h"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref = (x.double() @ d1.T).bfloat16()
        assert _rel_err(outs["o"], o_ref.double()) <= TOL
        h_ref = _reference(outs["o"], h_in, nw, do, dgu, dd, eps)
        assert _rel_err(outs["h"], h_ref) <= TOL
        assert _rel_err(outs["y"], outs["h"].double() @ wt.double().T) <= TOL


def test_model_decode_with_bulk_mlp_as_accurate():
    """A bf16 model whose dense layers run attn_out_mlp through the fused launch stays as
    close to fp32 as with the three launches, and the launch is taken."""
    import gpu_models as gm

    from kestrel_rt.backend import TorchBackend
    from kestrel_rt.backend.cupy_backend import CupyBackend

    lengths = [5, 9]  # 2 sequences: decode steps of 2 rows
    exact = gm.run_script(gm.model("wide128", TorchBackend("cuda", torch.float32)), lengths, 6)
    ref_be = CupyBackend("cuda", torch.bfloat16)
    ref_be.settle_ring = False
    ref = gm.run_script(gm.model("wide128", ref_be), lengths, 6)
    be = CupyBackend("cuda", torch.bfloat16)
    be.settle_ring = False
    be.bulk_mlp = True
    calls = []
    fused = be._bulk_mlp

    def counted(*args):
        y = fused(*args)
        calls.extend([] if y is None else [args[2]])
        return y

    be._bulk_mlp = counted
    got = gm.run_script(gm.model("wide128", be), lengths, 6)
    assert calls
    for a, r, e in zip(got, ref, exact, strict=True):
        assert gm.rel_err(a, e) <= 1.5 * gm.rel_err(r, e) + 1e-3
