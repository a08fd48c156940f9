"""The attention kernels (kestrel_rt/cuda/attention.py) against the torch reference, on the GPU.

References are the TorchBackend ops themselves (qk_norm_rope, attention), called on a small
stand-in object that holds only what they read, and for rope_attention also the kernel
composition ops.qk_norm_rope + attention.attention, which it must equal bit for bit (both
normalise with common.cuh's head_norm_rope and attend with the same attn_decode). Fresh random
inputs for every case; outputs go into a NaN-poisoned buffer (every element must be written);
the kernels' KV caches are NaN past each sequence's length (never to be read, never written),
and so is the partials workspace (nan_partials: the last-block merge reads only what the
launch wrote); calling the same attention over and over with other lengths, eagerly and as
graph replays, checks the merge's tickets; relative error ||out - ref|| / ||ref|| <= 1e-5 in
fp32 and <= 1e-2 with bf16 operands; NaN never passes. attn_verify (the tensor-core verify
kernel, RuntimeOptions.mma_verify) is checked the same way, and a whole model's forwards with
it on against it off (tests/test_verify_attention_algorithm.py checks its algorithm on the
CPU).
"""

from __future__ import annotations

import types

import pytest
import torch

cupy = pytest.importorskip("cupy")

from kernel_checks import DTYPES, EPS, check, poisoned, rnd

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda import attention, ops
from kestrel_rt.cuda.ops import Unsupported
from kestrel_rt.kv_cache import KVCache
from kestrel_rt.rope import cos_sin, inv_freq


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


def _stand_in(kv: KVCache, device, **fields) -> types.SimpleNamespace:
    """What TorchBackend.attention reads of its backend: the cache, the device and its
    attention_gathered method (plus `fields`)."""
    be = types.SimpleNamespace(kv=kv, device=torch.device(device), **fields)
    be.attention_gathered = types.MethodType(TorchBackend.attention_gathered, be)
    return be


def _torch_attention(kv: KVCache, q, k, v, step):
    """TorchBackend.attention of layer 0 (writes k, v into kv) -> [B, M, Hq, D]."""
    return TorchBackend.attention(_stand_in(kv, q.device), q, k, v, 0, step)


def _copy(kv: KVCache) -> KVCache:
    """A second cache with the same contents (NaN included)."""
    other = KVCache(1, kv.num_slots, kv.max_len, kv.k.shape[3], kv.k.shape[4], kv.device,
                    kv.k.dtype)
    other.k.copy_(kv.k)
    other.v.copy_(kv.v)
    return other


def _qkv(B, M, Hq, Hkv, D, dtype, pad=0, scale=1.0):
    """q [B, M, Hq, D], k, v [B, M, Hkv, D]: strided views of one qkv projection output
    (pad extra elements per token make the token stride unaligned)."""
    qkv = rnd(B, M, (Hq + 2 * Hkv) * D + pad, dtype=dtype, scale=scale)
    q = qkv[..., : Hq * D].view(B, M, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    v = qkv[..., (Hq + Hkv) * D: (Hq + 2 * Hkv) * D].unflatten(-1, (Hkv, D))
    return q, k, v


def _written_where_expected(kv, ref_kv, slots, lengths, M, exact=True, dtype=None):
    """The new K/V landed where the reference put them (exactly, or within the tolerance
    where the reference normalised k differently) and nowhere else."""
    for b, s in enumerate(slots):
        n = lengths[b] + M
        if exact:
            assert torch.equal(kv.k[0, s, :n], ref_kv.k[0, s, :n])
        else:
            assert torch.equal(kv.k[0, s, :lengths[b]], ref_kv.k[0, s, :lengths[b]])
            check(kv.k[0, s, lengths[b]:n], ref_kv.k[0, s, lengths[b]:n], dtype)
        assert torch.equal(kv.v[0, s, :n], ref_kv.v[0, s, :n])
        assert torch.isnan(kv.k[0, s, n:].float()).all()  # and nowhere else
        assert torch.isnan(kv.v[0, s, n:].float()).all()
    unused = kv.num_slots - 1  # slot B: no sequence
    assert torch.isnan(kv.k[0, unused].float()).all() and torch.isnan(kv.v[0, unused].float()).all()


@pytest.fixture
def nan_partials(monkeypatch):
    """Every launch's partials workspace NaN: the merge must read only what the launch wrote
    (blocks of splits past a sequence's context write nothing)."""
    def partials(rows, D, device):
        return (torch.full((rows * D,), float("nan"), device=device),
                torch.full((rows * 2,), float("nan"), device=device))
    monkeypatch.setattr(attention, "_partials", partials)


# -- attention over the cache (q, k already normalised and rotated) ---------------------------
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
    ([2], 1, 32, 8, 128, 4096),            # short context, large cache: one split holds keys
    ([0, 40, 9], 9, 32, 4, 128, 4096),     # the same on attn_partial, 3 row groups
])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_attention(km, sms, nan_partials, dtype, lengths, M, Hq, Hkv, D, max_len, fused):
    B = len(lengths)
    slots = list(range(B))[::-1]  # sequence b lives in slot B-1-b; slot B stays unused
    kv, ref_kv = _caches(B, max_len, Hkv, D, dtype, lengths, slots)
    step = kv.step(slots, M, [M] * B)
    q, k, v = _qkv(B, M, Hq, Hkv, D, dtype)
    out = poisoned(B, M, Hq, D, dtype=dtype)
    if fused:  # the attention op: the decode kernel writes the cache itself where it can
        attention.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                            out=out)
        again = poisoned(B, M, Hq, D, dtype=dtype)
        attention.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                            out=again)
        assert torch.equal(again, out)  # deterministic, and rewriting the cache is harmless
    else:  # q a strided view: the warp kernel reads it in place, attn_partial copies it
        attention.kv_write(km, k, v, kv.k[0], kv.v[0], step.slots, step.positions)
        attention.decode_attention(km, q, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                                   out=out)
    ref = _torch_attention(ref_kv, q, k, v, step)
    _written_where_expected(kv, ref_kv, slots, lengths, M)
    check(out, ref, dtype)


# Lengths before the step, one call after another on the same tickets: contexts that one split
# holds (no ticket taken), all splits, and in between, in one batch.
REPEATS = [[3, 4000], [100, 7], [4000, 0], [1500, 60], [0, 2], [3990, 3990], [8, 700]]


def _cached(kv, positions, slots):
    """The cache's K/V at the step's positions, [B, M, Hkv, D] each (writing them back into
    the cache changes nothing)."""
    rows = slots[:, None].expand(positions.shape)
    return kv.k[0][rows, positions], kv.v[0][rows, positions]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,Hq,Hkv,mma", [
    (1, 32, 8, False), (2, 32, 8, False), (9, 32, 4, False),  # last: attn_partial
    (5, 32, 8, True), (16, 32, 8, True), (9, 32, 4, True)])  # attn_verify (bf16; f32: partial)
@pytest.mark.parametrize("graph", [False, True])
def test_attention_repeated(km, sms, nan_partials, dtype, M, Hq, Hkv, mma, graph):
    """The same attention op again and again with other lengths, eagerly or as replays of one
    captured graph (inputs changed in place): each launch leaves the merge's tickets at zero
    for the next."""
    B, D, max_len, slots = 2, 128, 4096, [1, 0]
    kv = KVCache(1, B, max_len, Hkv, D, torch.device("cuda"), dtype)
    kv.k.copy_(rnd(*kv.k.shape, dtype=dtype))
    kv.v.copy_(rnd(*kv.v.shape, dtype=dtype))
    step = kv.step(slots, M, [M] * B)  # static inputs, lengths 0
    q = rnd(B, M, Hq, D, dtype=dtype)
    k, v = _cached(kv, step.positions, step.slots)
    out = torch.empty(B, M, Hq, D, dtype=dtype, device="cuda")

    def call():
        attention.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                            out=out, mma_verify=mma)

    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile, make the tickets outside the capture
            call()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        call = captured.replay
    for lengths in REPEATS:
        for s, n in zip(slots, lengths):
            kv.lengths[s] = n
        now = kv.step(slots, M, [M] * B)
        step.positions.copy_(now.positions)
        q.copy_(rnd(B, M, Hq, D, dtype=dtype))
        for x, y in zip((k, v), _cached(kv, now.positions, now.slots)):
            x.copy_(y)
        out.fill_(float("nan"))
        call()
        ref = _torch_attention(kv, q, k, v, now)
        check(out, ref, dtype)


def test_attention_plan_does_not_depend_on_lengths(sms):
    a = attention.attention_plan(1, 1, 32, 8, 128, 4096, sms)
    assert a == attention.attention_plan(1, 1, 32, 8, 128, 4096, sms)
    rb, groups, tile, splits, tpd = a
    assert rb * 128 <= attention.ATTN_ELEMS and splits >= 1 and groups == 1
    assert rb * tile * tpd <= attention.ATTN_THREADS and 32 % tpd == 0


# -- attn_verify: verify rows (M * Hq / Hkv > 8) on the tensor cores ---------------------------
def _record_launches(km, monkeypatch) -> list[str]:
    """The names of the kernels km launches from now on, in order (until the test ends)."""
    names: list[str] = []
    real = km.launch

    def launch(file, kernel, *args, **kwargs):
        names.append(kernel)
        return real(file, kernel, *args, **kwargs)

    monkeypatch.setattr(km, "launch", launch)
    return names


@pytest.fixture
def launched(km, monkeypatch):
    """The names of the kernels km launches during the test."""
    return _record_launches(km, monkeypatch)


def _ragged(B: int, most: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, most, (B,), generator=g).tolist()


# (lengths before the step, M, Hq, Hkv, D, max_len): M 3..16, batch 1..64, ragged contexts with
# lengths 0 and 1 and ends on either side of the 64-key tiles, one split to many
VERIFY_CASES = [
    ([0], 3, 32, 8, 128, 64),                       # 12 rows, context = M
    ([1, 0, 61, 63, 64, 65, 127, 130], 5, 32, 8, 128, 200),  # qwen3-8b k = 4, tile ends
    ([1019], 5, 32, 8, 128, 2048),                 # batch 1, many splits
    ([100, 7, 2000], 9, 32, 8, 128, 2100),          # 36 rows: 3 m-tiles
    ([3000, 17], 16, 32, 8, 128, 4096),             # 64 rows: 4 m-tiles
    ([0, 40, 9], 9, 32, 4, 128, 4096),              # 72 rows: two row groups
    ([5, 900], 4, 16, 4, 64, 1000),                 # head_dim 64
    ([33, 1], 12, 8, 8, 128, 80),                   # no GQA: 12 rows
    ([2], 6, 32, 8, 128, 4096),                     # short context, large cache
    (_ragged(32, 2000, 1), 7, 32, 8, 128, 2048),    # batch 32: one or two splits
    (_ragged(64, 2040, 2), 5, 32, 8, 128, 2048),    # batch 64: one split, two waves
    (_ragged(17, 600, 3), 8, 16, 8, 64, 700),       # qwen3-0.6b heads, 16 rows
]


def _verify_inputs(lengths, M, Hq, Hkv, D, max_len):
    """A ragged bf16 case for attn_verify: (kv, ref_kv, slots, step, q, k, v, poisoned out)."""
    dtype, B = torch.bfloat16, len(lengths)
    slots = list(range(B))[::-1]
    kv, ref_kv = _caches(B, max_len, Hkv, D, dtype, lengths, slots)
    step = kv.step(slots, M, [M] * B)
    q, k, v = _qkv(B, M, Hq, Hkv, D, dtype, scale=2)
    return kv, ref_kv, slots, step, q, k, v, poisoned(B, M, Hq, D, dtype=dtype)


@pytest.mark.parametrize("case", range(len(VERIFY_CASES)))
def test_verify_attention(km, sms, nan_partials, launched, case):
    lengths, M, Hq, Hkv, D, max_len = VERIFY_CASES[case]
    dtype, B = torch.bfloat16, len(lengths)
    kv, ref_kv, slots, step, q, k, v, out = _verify_inputs(*VERIFY_CASES[case])
    got = attention.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                              out=out, mma_verify=True)
    mt, _, _ = attention.verify_plan(B, M, Hq, Hkv, D, max_len, sms)
    assert got is out and launched == ["kv_write_bf16", f"attn_verify_bf16_d{D}_t{mt}"]
    ref = _torch_attention(ref_kv, q, k, v, step)
    _written_where_expected(kv, ref_kv, slots, lengths, M)
    check(out, ref, dtype)
    again = poisoned(B, M, Hq, D, dtype=dtype)  # the decode_attention entry, on the same cache
    attention.decode_attention(km, q, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                               out=again, mma_verify=True)
    assert torch.equal(again, out)  # deterministic


# (lengths, M, Hq, Hkv, D, max_len): decode-shaped rows (M * G <= 8) on attn_verify
# (RuntimeOptions.mma_decode_min_batch): one m-tile mostly padding
DECODE_ON_MMA_CASES = [
    ([0, 1, 63, 64, 65, 2000], 1, 32, 8, 128, 2048),  # qwen3-8b decode: 4 rows
    ([1019], 2, 32, 8, 128, 2048),                    # 8 rows, many splits
    (_ragged(64, 2040, 4), 1, 32, 8, 128, 2048),      # batch 64
    ([5, 900, 0], 1, 16, 8, 64, 1000),                # qwen3-0.6b heads: 2 rows
    ([33, 1], 1, 8, 8, 128, 80),                      # no GQA: 1 row
]


@pytest.mark.parametrize("case", range(len(DECODE_ON_MMA_CASES)))
def test_decode_rows_on_verify_kernel(km, sms, nan_partials, launched, case):
    """attention(mma_decode=True): kv_write then attn_verify for rows attn_decode would take,
    the torch reference's output."""
    lengths, M, _, _, D, _ = DECODE_ON_MMA_CASES[case]
    kv, ref_kv, slots, step, q, k, v, out = _verify_inputs(*DECODE_ON_MMA_CASES[case])
    attention.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                        out=out, mma_verify=True, mma_decode=True)
    assert launched == ["kv_write_bf16", f"attn_verify_bf16_d{D}_t1"]
    ref = _torch_attention(ref_kv, q, k, v, step)  # writes ref_kv
    _written_where_expected(kv, ref_kv, slots, lengths, M)
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("what", ["off", "decode_rows", "fp32", "head_dim_256"])
def test_verify_attention_routing(km, sms, launched, what):
    """attn_verify only where mma_verify asks and it takes the shapes; elsewhere the kernels of
    before, the same output."""
    M, Hq, Hkv, D, dtype = {"decode_rows": (2, 32, 8, 128, torch.bfloat16),
                            "fp32": (5, 32, 8, 128, torch.float32),
                            "head_dim_256": (5, 8, 2, 256, torch.bfloat16)}.get(
        what, (5, 32, 8, 128, torch.bfloat16))
    lengths, max_len = [70, 3], 128
    slots = [1, 0]
    kv, ref_kv = _caches(2, max_len, Hkv, D, dtype, lengths, slots)
    step = kv.step(slots, M, [M] * 2)
    q, k, v = _qkv(2, M, Hq, Hkv, D, dtype)
    out = attention.attention(km, q, k, v, kv.k[0], kv.v[0], step.slots, step.positions, sms,
                              mma_verify=what != "off")
    assert not any(n.startswith("attn_verify") for n in launched)
    check(out, _torch_attention(ref_kv, q, k, v, step), dtype)


@pytest.mark.parametrize("name", ["wide", "wide128"])
@pytest.mark.parametrize("verify_m", [3, 5, 9])
@pytest.mark.parametrize("decode_too", [False, True])
def test_model_forwards_with_mma_verify(name, verify_m, decode_too, monkeypatch):
    """A tiny model's script (ragged prefill, decode steps, a verify forward of verify_m tokens
    a sequence, rollback, decode) with mma_verify on (decode_too: and mma_decode_min_batch 1,
    the decode steps on attn_verify as well): its verify ran attn_verify, and its logits are
    as close to the fp32 model's as with mma_verify off (head_dim 64 and 128, Hq / Hkv = 4:
    12, 20 and 36 verify rows)."""
    import gpu_models as gm

    from kestrel_rt.backend.cupy_backend import CupyBackend
    from kestrel_rt.options import default_options

    lengths = [5, 9, 3, 20]
    exact = gm.run_script(gm.model(name, TorchBackend("cuda", torch.float32)), lengths, 6,
                          verify_m=verify_m)
    runs = {}
    for on in (False, True):
        extra = {"mma_decode_min_batch": 1 if decode_too else None} if on else {}
        be = CupyBackend("cuda", torch.bfloat16, options=default_options(
            "cuda", backend="cupy", mma_verify=on, **extra))
        names = _record_launches(be.kernels, monkeypatch)
        runs[on] = gm.run_script(gm.model(name, be), lengths, 6, verify_m=verify_m)
        assert any(n.startswith("attn_verify") for n in names) == on
        assert any(n.startswith("attn_decode") for n in names) == (not decode_too or not on)
    for got, ref, e in zip(runs[True], runs[False], exact):
        err_on, err_off = gm.rel_err(got, e), gm.rel_err(ref, e)
        assert err_on <= 1.5 * err_off + 1e-3, (err_on, err_off)
        assert gm.rel_err(got, ref) <= 3e-2


# -- rope_attention: q/k norm + RoPE inside the decode kernel -----------------------------------
def _rope_inputs(D, max_len, dtype):
    """q_norm, k_norm [D] weights and the cos / sin tables [max_len, D] allocate_kv builds."""
    cos, sin = cos_sin(torch.arange(max_len, device="cuda"), inv_freq(D, 1e6, "cuda"), dtype)
    qw, kw = 1 + rnd(D, dtype=dtype, scale=0.3), 1 + rnd(D, dtype=dtype, scale=0.3)
    return qw, kw, cos, sin


def _torch_rope_attention(q, k, v, qw, kw, cos, sin, ref_kv, step):
    """The TorchBackend composition: qk_norm_rope then attention (writes ref_kv)."""
    weights = {"layers.0.q_norm": qw, "layers.0.k_norm": kw}
    be = _stand_in(ref_kv, q.device, weight=weights.__getitem__, _cos=cos, _sin=sin,
                   shape=types.SimpleNamespace(rms_norm_eps=EPS))
    be.rms_norm = types.MethodType(TorchBackend.rms_norm, be)
    qr, kr = TorchBackend.qk_norm_rope(be, q, k, 0, step)
    return TorchBackend.attention(be, qr, kr, v, 0, step)


# Sequence lengths before the step, cycled over the cases: one sequence, ragged batches with
# empty and long ones (many context splits; new keys spread over several splits).
LENGTHS = [[37], [0, 5, 300, 1021], [3000, 17], [1, 0, 64], [130, 129, 128, 127, 2], [511]]
# (M, G = Hq / Hkv, Hkv): every M * G <= DECODE_MAX_ROWS for G in 1, 2, 4, 8.
ROPE_SHAPES = [(m, 1, 4) for m in range(1, 9)] + [(m, 2, 2) for m in range(1, 5)] + [
    (1, 4, 8), (2, 4, 1), (1, 8, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("case", range(len(ROPE_SHAPES)))
def test_rope_attention(km, sms, dtype, D, case):
    M, G, Hkv = ROPE_SHAPES[case]
    Hq = G * Hkv
    lengths = LENGTHS[(case + D // 64) % len(LENGTHS)]
    B = len(lengths)
    max_len = max(lengths) + M + 7
    slots = list(range(B))[::-1]
    kv, ref_kv = _caches(B, max_len, Hkv, D, dtype, lengths, slots)
    kv2 = _copy(kv)  # for the kernel composition
    step = kv.step(slots, M, [M] * B)
    q, k, v = _qkv(B, M, Hq, Hkv, D, dtype, scale=2)
    qw, kw, cos, sin = _rope_inputs(D, max_len, dtype)

    out = poisoned(B, M, Hq, D, dtype=dtype)
    got = attention.rope_attention(km, q, k, v, qw, kw, cos, sin, kv.k[0], kv.v[0], step.slots,
                                   step.positions, EPS, sms, out=out)
    assert got is out
    ref = _torch_rope_attention(q, k, v, qw, kw, cos, sin, ref_kv, step)
    check(out, ref, dtype)
    _written_where_expected(kv, ref_kv, slots, lengths, M, exact=False, dtype=dtype)

    # the kernel composition: same bits, output and cache
    qn, kn = ops.qk_norm_rope(km, q, k, qw, kw, cos, sin, step.positions, EPS)
    composed = attention.attention(km, qn, kn, v, kv2.k[0], kv2.v[0], step.slots,
                                   step.positions, sms)
    assert torch.equal(out, composed), "fused output differs from qk_norm_rope + attention"
    _written_where_expected(kv, kv2, slots, lengths, M)

    again = attention.rope_attention(km, q, k, v, qw, kw, cos, sin, kv.k[0], kv.v[0],
                                     step.slots, step.positions, EPS, sms)
    assert torch.equal(again, out)  # deterministic, and rewriting the cache is harmless


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attention_unaligned_views(km, sms, dtype):
    """Token strides that break the kernel's vector loads: the wrapper copies q, k, v."""
    B, M, Hq, Hkv, D, lengths = 2, 2, 8, 2, 128, [40, 3]
    max_len = 64
    slots = [1, 0]
    kv, ref_kv = _caches(B, max_len, Hkv, D, dtype, lengths, slots)
    step = kv.step(slots, M, [M] * B)
    q, k, v = _qkv(B, M, Hq, Hkv, D, dtype, pad=1, scale=2)
    qw, kw, cos, sin = _rope_inputs(D, max_len, dtype)
    out = attention.rope_attention(km, q, k, v, qw, kw, cos, sin, kv.k[0], kv.v[0], step.slots,
                                   step.positions, EPS, sms, out=poisoned(B, M, Hq, D, dtype=dtype))
    check(out, _torch_rope_attention(q, k, v, qw, kw, cos, sin, ref_kv, step), dtype)
    _written_where_expected(kv, ref_kv, slots, lengths, M, exact=False, dtype=dtype)


@pytest.mark.parametrize("why", ["rows", "rows_gqa", "head_dim_96", "head_dim_24", "heads",
                                 "fp16", "mixed_dtypes", "cache_strided", "positions_int32",
                                 "table_strided", "weight_shape"])
def test_rope_attention_unsupported(km, sms, why):
    """Shapes the fused kernel does not take raise Unsupported before touching the cache."""
    dtype = torch.float16 if why == "fp16" else torch.bfloat16
    M, Hq, Hkv, D = {"rows": (9, 4, 4, 128), "rows_gqa": (3, 16, 4, 128),
                     "head_dim_96": (1, 8, 2, 96), "head_dim_24": (1, 8, 2, 24),
                     "heads": (1, 6, 4, 64)}.get(why, (1, 8, 2, 64))
    B, lengths, max_len = 2, [10, 3], 32
    kv = KVCache(1, B, max_len, Hkv, D, torch.device("cuda"), dtype)
    kc, vc = kv.k[0], kv.v[0]
    kc.copy_(rnd(*kc.shape, dtype=dtype))
    before = kc.clone()
    for s, n in enumerate(lengths):
        kv.lengths[s] = n
    step = kv.step([0, 1], M, [M] * B)
    positions = step.positions
    q, k, v = _qkv(B, M, Hq, Hkv, D, dtype)
    qw, kw, cos, sin = _rope_inputs(D, max_len, dtype)
    if why == "mixed_dtypes":
        qw = qw.float()
    elif why == "cache_strided":
        kc = kv.k[0].transpose(0, 1)
    elif why == "positions_int32":
        positions = positions.int()
    elif why == "table_strided":
        wide = rnd(max_len, 2 * D, dtype=dtype)
        cos = wide[:, :D]
    elif why == "weight_shape":
        qw = qw[: D // 2]
    with pytest.raises(Unsupported):
        attention.rope_attention(km, q, k, v, qw, kw, cos, sin, kc, vc, step.slots, positions,
                                 EPS, sms)
    assert torch.equal(kv.k[0], before)


# -- benchmark: one decode step's attention over 36 layers, replayed as a CUDA graph -----------
@pytest.mark.parametrize("ctx", [512, 4000])
@pytest.mark.parametrize("how", ["qk_norm_rope+attention", "rope_attention"])
def test_rope_attention_benchmark(km, sms, benchmark, how, ctx):
    """qwen3-8b heads (Hq 32, Hkv 8, D 128), bf16, batch 1, M = 1. The graph replays 36
    layers; us per layer = mean / 36. Enable with --benchmark-enable."""
    L, B, M, Hq, Hkv, D, max_len, dtype = 36, 1, 1, 32, 8, 128, 4096, torch.bfloat16
    kv = KVCache(L, B, max_len, Hkv, D, torch.device("cuda"), dtype)
    kv.k.normal_()
    kv.v.normal_()
    kv.lengths[0] = ctx
    step = kv.step([0], M, [M])
    q, k, v = _qkv(B, M, Hq, Hkv, D, dtype)
    qw, kw, cos, sin = _rope_inputs(D, max_len, dtype)
    out = torch.empty(B, M, Hq, D, dtype=dtype, device="cuda")

    def layers():
        for i in range(L):
            if how == "rope_attention":
                attention.rope_attention(km, q, k, v, qw, kw, cos, sin, kv.k[i], kv.v[i],
                                         step.slots, step.positions, EPS, sms, out=out)
            else:
                qn, kn = ops.qk_norm_rope(km, q, k, qw, kw, cos, sin, step.positions, EPS)
                attention.attention(km, qn, kn, v, kv.k[i], kv.v[i], step.slots, step.positions,
                                    sms, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        layers()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    replay()
    benchmark.pedantic(replay, rounds=50, warmup_rounds=5)
    assert torch.isfinite(out).all()  # (correctness: test_rope_attention)
