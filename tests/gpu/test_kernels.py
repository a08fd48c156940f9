"""Every kernel of kernels/*.cu against the torch reference op, on the GPU.

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

from kestrel_rt import moe as moe_ref
from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda import ops, reference
from kestrel_rt.cuda.module import KernelModules
from kestrel_rt.kv_cache import KVCache
from kestrel_rt.rope import cos_sin, inv_freq

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-6


@pytest.fixture(scope="module")
def km():
    return KernelModules(torch.device("cuda"))


@pytest.fixture(scope="module")
def sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


_seed = iter(range(10_000, 10**9))


def rnd(*shape, dtype=torch.float32, scale=1.0):
    """Fresh N(0, scale^2) values on the GPU (a new seed every call)."""
    g = torch.Generator(device="cuda").manual_seed(next(_seed))
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def poisoned(*shape, dtype):
    if dtype in (torch.long, torch.int32):
        return torch.full(shape, -7, dtype=dtype, device="cuda")
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def check(out, ref, dtype):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output: an element not written, or a NaN"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def stand_in(**fields):
    """An object the TorchBackend ops can run on: fields plus the reference methods."""
    obj = types.SimpleNamespace(**fields)
    for name in ("rms_norm", "add_rms_norm"):
        setattr(obj, name, types.MethodType(getattr(TorchBackend, name), obj))
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
        ref, ref_s = TorchBackend.add_rms_norm(be, x, r, "w")
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


# -- attention --------------------------------------------------------------------------------
def _caches(B, max_len, Hkv, D, dtype, lengths, slots):
    """(kernel cache, reference cache): the same random K/V below each sequence's length;
    past it NaN in the kernel's cache (never to be read) and zeros in the reference's."""
    kv = KVCache(1, B + 1, max_len, Hkv, D, torch.device("cuda"), dtype)
    ref = KVCache(1, B + 1, max_len, Hkv, D, torch.device("cuda"), dtype)
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    for s, n in zip(slots, lengths):
        kk, vv = rnd(n, Hkv, D, dtype=dtype), rnd(n, Hkv, D, dtype=dtype)
        kv.k[0, s, :n], kv.v[0, s, :n] = kk, vv
        ref.k[0, s, :n], ref.v[0, s, :n] = kk, vv
        kv.lengths[s] = ref.lengths[s] = n
    return kv, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,M,Hq,Hkv,D,max_len", [
    ([37], 1, 32, 8, 128, 64),             # qwen3-8b heads, decode
    ([0, 5, 300, 1021], 4, 8, 2, 128, 1100),  # different lengths, verify k=3, split context
    ([3000, 17], 9, 32, 4, 128, 4096),     # qwen3-30b-a3b heads, verify k=8, many splits
    ([11, 2], 16, 6, 2, 24, 40),           # odd head_dim, M = 16
    ([250], 2, 4, 4, 256, 300),            # head_dim 256 (no GQA)
    ([60, 61, 62], 1, 16, 8, 64, 80),
    ([100, 7, 2000], 2, 32, 8, 128, 2100),  # warp-per-key kernel at its 8-row limit
    ([5, 900], 3, 8, 4, 64, 1000),          # 6 rows: warp kernel, 8-row variant
    ([4000], 1, 32, 8, 128, 4096),          # long context: many keys per warp
    ([1, 0], 1, 8, 8, 256, 24),             # no GQA, head_dim 256, tiny contexts
])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_attention(km, sms, dtype, lengths, M, Hq, Hkv, D, max_len, fused):
    B = len(lengths)
    slots = list(range(B))[::-1]  # sequence b lives in slot B-1-b; slot B stays unused
    kv, ref_kv = _caches(B, max_len, Hkv, D, dtype, lengths, slots)
    step = kv.step(slots, M, [M] * B)
    qkv = rnd(B, M, (Hq + 2 * Hkv) * D, dtype=dtype)
    q = qkv[..., : Hq * D].view(B, M, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, M, Hkv, D)
    v = qkv[..., (Hq + Hkv) * D:].view(B, M, Hkv, D)
    out = poisoned(B, M, Hq, D, dtype=dtype)
    if fused:  # the attention op: the decode kernel writes the cache itself where it can
        ops.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms, out=out)
        again = poisoned(B, M, Hq, D, dtype=dtype)
        ops.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms, out=again)
        assert torch.equal(again, out)  # deterministic, and rewriting the cache is harmless
    else:
        ops.kv_write(km, k, v, kv.k[0], kv.v[0], step.slots, step.positions)
        ops.decode_attention(km, q.contiguous(), kv.k[0], kv.v[0], step.slots, step.positions,
                             sms, out=out)
    ref = TorchBackend.attention(types.SimpleNamespace(kv=ref_kv), q, k, v, 0, step)
    for b, s in enumerate(slots):  # the new K/V landed exactly where the reference put them
        n = lengths[b] + M
        assert torch.equal(kv.k[0, s, :n], ref_kv.k[0, s, :n])
        assert torch.equal(kv.v[0, s, :n], ref_kv.v[0, s, :n])
        assert torch.isnan(kv.k[0, s, n:].float()).all()  # and nowhere else
    check(out, ref, dtype)


def test_attention_plan_does_not_depend_on_lengths(sms):
    a = ops.attention_plan(1, 1, 32, 8, 128, 4096, sms)
    assert a == ops.attention_plan(1, 1, 32, 8, 128, 4096, sms)
    rb, groups, tile, splits, tpd = a
    assert rb * 128 <= ops.ATTN_ELEMS and splits >= 1 and groups == 1
    assert rb * tile * tpd <= ops.ATTN_THREADS and 32 % tpd == 0


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E,k,H,I", [(1, 128, 8, 2048, 768), (7, 16, 4, 256, 128),
                                       (64, 32, 8, 512, 64), (3, 6, 2, 40, 24)])
@pytest.mark.parametrize("renorm", [False, True])
def test_moe_experts(km, dtype, N, E, k, H, I, renorm):
    x = rnd(N, H, dtype=dtype)
    gate_up = rnd(E, 2 * I, H, dtype=dtype, scale=H**-0.5 * 2)
    down = rnd(E, H, I, dtype=dtype, scale=I**-0.5)
    router = rnd(E, H, dtype=dtype, scale=H**-0.5)
    weights, experts = moe_ref.route(x, router, k, renorm)  # the reference's own routing
    out = poisoned(N, H, dtype=dtype)
    ops.moe_experts(km, x, weights, experts, gate_up, down, out=out)
    check(out, moe_ref.experts_forward(x, weights, experts, gate_up, down), dtype)


# -- greedy accept ----------------------------------------------------------------------------
@pytest.mark.parametrize("B,k", [(1, 1), (1, 4), (8, 3), (64, 8), (300, 5)])
def test_greedy_accept(km, B, k):
    g = torch.Generator(device="cuda").manual_seed(next(_seed))
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
