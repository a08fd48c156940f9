"""Every kernel of kernels/*.cu against the torch reference op, on the GPU (attention:
test_attention.py).

The reference is the TorchBackend op itself, called on a small stand-in object that holds
only what the op reads (weights, eps, RoPE tables, KV cache). Fresh random inputs for every
case; outputs go into a NaN-poisoned buffer (every element must be written); relative error
||out - ref|| / ||ref|| <= 1e-5 in fp32 and <= 1e-2 with bf16 operands; NaN never passes.
"""

from __future__ import annotations

import types

import pytest
import torch

cupy = pytest.importorskip("cupy")

from kernel_checks import DTYPES, EPS, check, generator, poisoned, rnd

from kestrel_rt import moe as moe_ref
from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda import ops, reference
from kestrel_rt.rope import cos_sin, inv_freq


def stand_in(**fields):
    """An object the TorchBackend ops can run on: fields plus the reference methods."""
    obj = types.SimpleNamespace(**fields)
    obj.rms_norm = types.MethodType(TorchBackend.rms_norm, obj)
    return obj


# -- RMSNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 4096), (3, 5, 1024), (2, 7, 100), (4, 40)])
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm(km, dtype, shape, fused):
    n = shape[-1]
    w = 1 + rnd(n, dtype=dtype, scale=0.3)
    be = stand_in(weight=lambda name: w, shape=types.SimpleNamespace(rms_norm_eps=EPS))
    x, r = rnd(*shape, dtype=dtype, scale=3), rnd(*shape, dtype=dtype)
    out, res = poisoned(*shape, dtype=dtype), poisoned(*shape, dtype=dtype)
    if fused:
        ops.rms_norm(km, x, w, EPS, residual=r, out=out, res_out=res)
        ref_s = r + x  # the residual stream, rounded as torch adds
        ref = TorchBackend.rms_norm(be, ref_s, "w")
        check(res, ref_s, dtype)
    else:
        ops.rms_norm(km, x, w, EPS, out=out)
        ref = TorchBackend.rms_norm(be, x, "w")
    check(out, ref, dtype)


# -- q/k norm + RoPE --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,M,Hq,Hkv,D", [(1, 1, 32, 8, 128), (3, 4, 6, 2, 24), (2, 9, 4, 4, 256),
                                          (5, 1, 16, 8, 64)])
def test_qk_norm_rope(km, dtype, B, M, Hq, Hkv, D):
    P = 4096
    cos, sin = cos_sin(torch.arange(P, device="cuda"), inv_freq(D, 1e6, "cuda"), dtype)
    qw, kw = 1 + rnd(D, dtype=dtype, scale=0.3), 1 + rnd(D, dtype=dtype, scale=0.3)
    ws = {"layers.0.q_norm": qw, "layers.0.k_norm": kw}
    be = stand_in(weight=ws.__getitem__, shape=types.SimpleNamespace(rms_norm_eps=EPS),
                  _cos=cos, _sin=sin)
    qkv = rnd(B, M, (Hq + 2 * Hkv) * D, dtype=dtype, scale=2)  # views, as the model passes
    q = qkv[..., : Hq * D].view(B, M, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, M, Hkv, D)
    start = torch.randint(0, P - M, (B,), device="cuda")
    step = types.SimpleNamespace(positions=start[:, None] + torch.arange(M, device="cuda"))
    oq, ok = poisoned(B, M, Hq, D, dtype=dtype), poisoned(B, M, Hkv, D, dtype=dtype)
    ops.qk_norm_rope(km, q, k, qw, kw, cos, sin, step.positions, EPS, q_out=oq, k_out=ok)
    rq, rk = TorchBackend.qk_norm_rope(be, q, k, 0, step)
    check(oq, rq, dtype)
    check(ok, rk, dtype)


# -- SwiGLU -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 12288), (3, 4, 2 * 768), (5, 2 * 100), (2, 2 * 7)])
def test_swiglu(km, sms, dtype, shape):
    gu = rnd(*shape, dtype=dtype, scale=3)
    out = poisoned(*shape[:-1], shape[-1] // 2, dtype=dtype)
    ops.swiglu(km, gu, sms, out=out)
    check(out, TorchBackend.swiglu(None, gu), dtype)


# -- MoE --------------------------------------------------------------------------------------
def _distinct_logits(N, E, dtype):
    """Router logits with no ties after rounding (top-k order is then unique)."""
    steps = torch.arange(E, device="cuda", dtype=torch.float32) * 0.0625  # exact in bf16
    perm = torch.stack([torch.randperm(E, device="cuda") for _ in range(N)])
    return (steps[perm] - 2.0 + 0.0 * rnd(N, E)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E,k", [(1, 128, 8), (13, 6, 2), (64, 128, 8), (5, 256, 4), (3, 33, 1)])
@pytest.mark.parametrize("renorm", [False, True])
def test_moe_route(km, dtype, N, E, k, renorm):
    logits = _distinct_logits(N, E, dtype)
    w, e = poisoned(N, k, dtype=dtype), poisoned(N, k, dtype=torch.long)
    ops.moe_route(km, logits, k, renorm, out=(w, e))
    # moe_ref.route computes logits = F.linear(x, router): x = logits, router = I gives them
    eye = torch.eye(E, device="cuda", dtype=dtype)
    rw, re = moe_ref.route(logits, eye, k, renorm)
    assert torch.equal(e, re)
    check(w, rw, dtype)


def _moe_weights(E, H, I, dtype):
    """gate_up [E, 2I, H], down [E, H, I], router [E, H]."""
    return (rnd(E, 2 * I, H, dtype=dtype, scale=H**-0.5 * 2),
            rnd(E, H, I, dtype=dtype, scale=I**-0.5), rnd(E, H, dtype=dtype, scale=H**-0.5))


# Qwen3-30B-A3B (H 2048, I 768, top 8: one chunk per row) at 1 and 5 tokens; top_k 1, 3, 8
# and 10 (two groups of 8 experts in moe_down); H and I not multiples of a chunk (several
# chunks, the last partial: 2056 / 776 are 257 / 97 bf16 vectors); tiny models; 16 and 64
# tokens.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E,k,H,I", [(1, 128, 8, 2048, 768), (5, 128, 8, 2048, 768),
                                       (7, 16, 4, 256, 128), (64, 32, 8, 512, 64),
                                       (3, 6, 2, 40, 24), (1, 64, 1, 64, 32),
                                       (5, 16, 3, 776, 200), (2, 10, 8, 2056, 776),
                                       (16, 24, 10, 128, 64), (1, 8, 8, 64, 32)])
@pytest.mark.parametrize("renorm", [False, True])
def test_moe_experts(km, dtype, N, E, k, H, I, renorm):
    x = rnd(N, H, dtype=dtype)
    gate_up, down, router = _moe_weights(E, H, I, dtype)
    weights, experts = moe_ref.route(x, router, k, renorm)  # the reference's own routing
    out = poisoned(N, H, dtype=dtype)
    ops.moe_experts(km, x, weights, experts, gate_up, down, out=out)
    expect = moe_ref.experts_forward(x, weights, experts, gate_up, down)
    check(out, expect, dtype)
    residual = rnd(N, H, dtype=dtype)
    out = poisoned(N, H, dtype=dtype)
    ops.moe_experts(km, x, weights, experts, gate_up, down, residual=residual, out=out)
    check(out, residual + expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E,k,H,I", [(1, 128, 8, 2048, 768), (5, 16, 3, 776, 200),
                                       (3, 6, 2, 40, 24)])
def test_moe_experts_row_scale(km, dtype, N, E, k, H, I):
    """row_eps: x is the raw residual stream and its RMSNorm with a unit weight (the weight
    folded into gate_up, kestrel_rt/fold.py) is a row scale inside moe_gate_up; against the
    reference on the normalised x, + x as the residual."""
    x = (rnd(N, H) * 3.0 + 0.5).to(dtype)
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    gate_up, down, router = _moe_weights(E, H, I, dtype)
    weights, experts = moe_ref.route(xn, router, k, True)
    out = poisoned(N, H, dtype=dtype)
    ops.moe_experts(km, x, weights, experts, gate_up, down, residual=x, out=out, row_eps=EPS)
    check(out, x + moe_ref.experts_forward(xn, weights, experts, gate_up, down), dtype)


@pytest.fixture(scope="module")
def km_pdl():
    from kestrel_rt.cuda.module import KernelModules

    return KernelModules(torch.device("cuda"), pdl=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_route_then_experts_with_pdl(km_pdl, dtype):
    """moe_route -> moe_gate_up -> moe_down back to back with programmatic dependent launch:
    each kernel reads what the one before wrote (act) only after pdl_wait; moe_down reads
    experts (moe_route's) and issues its first weight loads before its wait."""
    N, E, k, H, I = 5, 128, 8, 2048, 768
    x, residual = rnd(N, H, dtype=dtype), rnd(N, H, dtype=dtype)
    gate_up, down, router = _moe_weights(E, H, I, dtype)
    for _ in range(3):
        weights, experts = ops.moe_route(km_pdl, torch.nn.functional.linear(x, router), k, True)
        out = poisoned(N, H, dtype=dtype)
        ops.moe_experts(km_pdl, x, weights, experts, gate_up, down, residual=residual, out=out)
        # the kernel's own routing (ties between bf16 logits may pick other experts than torch)
        expect = moe_ref.experts_forward(x, weights, experts, gate_up, down)
        check(out, residual + expect, dtype)


# -- argmax (greedy tokens) -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 151936), (3, 4097), (64, 1000), (2, 3, 7), (5, 1)])
def test_argmax(km, dtype, shape):
    x = rnd(*shape, dtype=dtype)
    out = poisoned(*shape[:-1], dtype=torch.long)
    ops.argmax(km, x, out=out)
    assert torch.equal(out, x.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_infinities_and_nan(km, dtype):
    """torch.argmax's choice: the first index of the maximum; a NaN beats every number (the
    first NaN wins); a row of -inf gives 0. Maxima in different blocks' chunks."""
    n = 3 * ops.ARGMAX_CHUNK + 5
    x = torch.zeros(6, n, dtype=dtype, device="cuda")
    x[0, [7, ops.ARGMAX_CHUNK + 1, n - 1]] = 2.0  # a tie across three chunks
    x[1, n - 1] = 1.0  # in the last, partial chunk
    x[2, [9000, 5]] = float("nan")
    x[2, 3] = float("inf")
    x[3] = float("-inf")
    x[4, [2 * ops.ARGMAX_CHUNK, 100]] = float("inf")
    x[5] = rnd(n, dtype=dtype)
    out = poisoned(6, dtype=torch.long)
    ops.argmax(km, x, out=out)
    assert out.tolist() == [7, n - 1, 5, 0, 100, int(x[5].float().argmax())]
    assert torch.equal(out, x.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_takes_minus_zero_as_zero_and_checks_its_scratch(km, dtype):
    """-0 ties with +0 (the first index wins, as torch's comparison); the scratch buffers must
    be argmax_scratch's for the shape."""
    x = torch.full((2, 5000), -1.0, dtype=dtype, device="cuda")
    x[0, 4500], x[0, 3] = -0.0, 0.0
    x[1, 17], x[1, 4000] = 0.0, -0.0
    out = poisoned(2, dtype=torch.long)
    ops.argmax(km, x, out=out)
    assert out.tolist() == [3, 17] and torch.equal(out, x.argmax(-1))
    with pytest.raises(ValueError, match="expected argmax_scratch"):
        ops.argmax(km, x, ops.argmax_scratch(2, 50000, x.device))


@pytest.mark.parametrize("parity", [0, 1])
def test_argmax_writes_the_ids_to_pinned_host_memory(km, parity):
    """With host buffers the kernel also writes the ids into host[parity] (the other half
    untouched), readable once the stream has passed the launch."""
    x = rnd(3, 5000, dtype=torch.bfloat16)
    host = torch.full((2, 3), -7, dtype=torch.long, pin_memory=True)
    par = torch.tensor([parity], device="cuda")
    out = poisoned(3, dtype=torch.long)
    ops.argmax(km, x, out=out, host=(host, par))
    torch.cuda.synchronize()
    assert torch.equal(host[parity], x.argmax(-1).cpu()) and torch.equal(out, x.argmax(-1))
    assert host[1 - parity].eq(-7).all()
    with pytest.raises(ValueError, match="pinned int64"):
        ops.argmax(km, x, host=(torch.zeros(2, 3, dtype=torch.long), par))


def test_argmax_replays_in_a_cuda_graph(km):
    """The per-row counters are back at zero after each launch, so a captured graph replays
    (the backend keeps the scratch buffers for that)."""
    x = rnd(4, 50000, dtype=torch.bfloat16)
    scratch = ops.argmax_scratch(4, 50000, x.device)
    out = poisoned(4, dtype=torch.long)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.argmax(km, x, scratch, out)  # warm-up: compiles the module
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ops.argmax(km, x, scratch, out)
    for i in range(3):
        x.copy_(rnd(4, 50000, dtype=torch.bfloat16))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(-1)), i
    assert scratch[1].eq(0).all()


# -- greedy accept ----------------------------------------------------------------------------
@pytest.mark.parametrize("B,k", [(1, 1), (1, 4), (8, 3), (64, 8), (300, 5)])
def test_greedy_accept(km, B, k):
    g = generator()
    target = torch.randint(0, 5, (B, k + 1), generator=g, device="cuda")
    draft = target[:, :k].clone()
    cut = torch.randint(0, k + 1, (B,), generator=g, device="cuda")  # first disagreement
    for b in range(B):
        if cut[b] < k:
            draft[b, cut[b]] = (target[b, cut[b]] + 1) % 5
            draft[b, cut[b] + 1:] = torch.randint(0, 5, (k - cut[b] - 1,), generator=g,
                                                  device="cuda")
    acc, nxt = poisoned(B, dtype=torch.long), poisoned(B, dtype=torch.long)
    ops.greedy_accept(km, draft, target, out=(acc, nxt))
    ref_acc, ref_nxt = reference.greedy_accept(draft, target)
    assert torch.equal(acc, ref_acc) and torch.equal(acc, cut)
    assert torch.equal(nxt, ref_nxt)
