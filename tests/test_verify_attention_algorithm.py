"""attn_verify's algorithm (kernels/verify_attention.cu), emulated step by step in numpy on
the CPU, against a direct softmax attention; and its launch as the wrapper builds it.

No GPU runs here, so `emulate` repeats what the kernel does, block by block, with the plan
and launch shape of kestrel_rt/cuda/attention.py (verify_plan, verify_launch): each block's
slice of the context (chunks of whole 64-key tiles, splits past the context exit), tiles
zero-filled past the split, each warp's 16 rows x KPW keys of every tile with its own online
softmax in base 2, the mask (key p visible to (b, m) iff p <= positions[b, m]), P rounded to
bf16 before P V, the in-block merge of the warps, the partials in attn_partial's workspace
layout (NaN where nothing was written), the arrival tickets in a random block order, and
common.cuh's merge_rows. With the roundings off it must equal softmax attention to fp32
precision (the algorithm: masks, splits, tiles, merges); with them on, within bf16's error.
tests/gpu/test_attention.py runs the kernel itself against torch.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import KERNEL_DIR
from kestrel_rt.cuda import attention

LN2 = 0.69314718055994531


def bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 (nearest, ties to even), as fp32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def warps_per_mtile(mt: int) -> int:
    return attention.verify_launch(mt, 64)[0] // 32 // mt


def emulate(q, kc, vc, slots, positions, num_sms, rounded=True, seed=0):
    """attn_verify + its last-block merge. q [B, M, Hq, D], caches [slots, max_len, Hkv, D]
    (fp32 arrays), slots [B], positions [B, M] -> (out [B, M, Hq, D], tickets after)."""
    B, M, Hq, D = q.shape
    max_len, Hkv = kc.shape[1], kc.shape[2]
    G, rows, TK = Hq // Hkv, M * (Hq // Hkv), attention.VERIFY_TILE
    mt_n, groups, splits = attention.verify_plan(B, M, Hq, Hkv, D, max_len, num_sms)
    KW = warps_per_mtile(mt_n)
    KPW, ROWS = TK // KW, 16 * mt_n
    scale_log2 = np.float32(D ** -0.5 / math.log(2))
    rnd = bf16 if rounded else (lambda x: x)
    part_acc = np.full((B * Hkv * rows * splits, D), np.nan, np.float32)
    part_ml = np.full((B * Hkv * rows * splits, 2), np.nan, np.float32)
    tickets = np.zeros(B * Hkv * groups, np.int64)
    out = np.full((B, M, Hq, D), np.nan, np.float32)

    def block(x, y, z):
        """One block's partials; its `active` (0: the block exits at once)."""
        b, kvh = divmod(x, Hkv)
        row0 = y * ROWS
        ctx = int(positions[b, M - 1]) + 1
        chunk = -(-ctx // splits)
        chunk = -(-chunk // TK) * TK
        active = -(-ctx // chunk)
        if z >= active:
            return 0
        k_begin = z * chunk
        k_end = min(ctx, k_begin + chunk)
        n_keys = k_end - k_begin
        qb = np.zeros((ROWS, D), np.float32)  # the block's rows, zero past R
        last = np.full(ROWS, -1)
        for r in range(ROWS):
            gr = row0 + r
            if gr < rows:
                qb[r] = q[b, gr // G, kvh * G + gr % G]
                p = min(int(positions[b, gr // G]), k_end - 1)
                last[r] = -1 if p < k_begin else p - k_begin
        m_run = np.full((mt_n, KW, 16), -np.inf, np.float32)
        l_run = np.zeros((mt_n, KW, 16), np.float32)
        o = np.zeros((mt_n, KW, 16, D), np.float32)
        for i in range(-(-n_keys // TK)):
            keys = i * TK + np.arange(TK)  # within the split
            inside = keys < n_keys
            kt = np.zeros((TK, D), np.float32)  # zero-filled past the split
            vt = np.zeros((TK, D), np.float32)
            kt[inside] = kc[slots[b], k_begin + keys[inside], kvh]
            vt[inside] = vc[slots[b], k_begin + keys[inside], kvh]
            for mt in range(mt_n):
                for kw in range(KW):
                    sl = slice(kw * KPW, (kw + 1) * KPW)
                    s = (qb[16 * mt:16 * mt + 16] @ kt[sl].T).astype(np.float32)  # [16, KPW]
                    visible = keys[sl][None, :] <= last[16 * mt:16 * mt + 16, None]
                    s = np.where(visible, s * scale_log2, -np.inf).astype(np.float32)
                    m_new = np.maximum(m_run[mt, kw], s.max(axis=1))
                    none = m_new == -np.inf
                    with np.errstate(invalid="ignore"):
                        sc = np.where(none, 1, np.exp2(m_run[mt, kw] - m_new))
                    sub = np.where(none, 0, m_new).astype(np.float32)
                    p = np.exp2(s - sub[:, None]).astype(np.float32)
                    l_run[mt, kw] = l_run[mt, kw] * sc + p.sum(axis=1)
                    o[mt, kw] = o[mt, kw] * sc[:, None] + rnd(p) @ vt[sl]
                    m_run[mt, kw] = m_new
        # the warps of an m-tile merged, then this split's partials
        with np.errstate(invalid="ignore"):
            mmax = m_run.max(axis=1)  # [mt, 16]
            f = np.where(m_run == -np.inf, 0, np.exp2(m_run - mmax[:, None]))  # [mt, KW, 16]
        lsum = (f * l_run).sum(axis=1)
        acc = (f[..., None] * o).sum(axis=1)  # [mt, 16, D]
        row_base = (b * Hkv + kvh) * rows
        for r in range(ROWS):
            gr = row0 + r
            if gr < rows:
                at = (row_base + gr) * splits + z
                part_acc[at] = acc[r // 16, r % 16]
                part_ml[at] = (mmax[r // 16, r % 16] * LN2, lsum[r // 16, r % 16])
        return active

    def merge(x, y, n):
        """merge_rows: rows of block group (x, y) over splits 0 .. n."""
        b, kvh = divmod(x, Hkv)
        for gr in range(y * ROWS, min(rows, (y + 1) * ROWS)):
            at = ((b * Hkv + kvh) * rows + gr) * splits
            m, lsum = part_ml[at:at + n, 0], part_ml[at:at + n, 1]
            w = np.where(m == -np.inf, 0, np.exp(m - m.max()))
            o = (w[:, None] * part_acc[at:at + n]).sum(axis=0) / (w * lsum).sum()
            out[b, gr // G, kvh * G + gr % G] = rnd(o)

    order = [(x, y, z) for x in range(B * Hkv) for y in range(groups) for z in range(splits)]
    np.random.default_rng(seed).shuffle(order)
    for x, y, z in order:
        active = block(x, y, z)
        if active == 0:
            continue
        ticket = x * groups + y
        if active > 1:
            tickets[ticket] += 1
            if tickets[ticket] < active:
                continue
            tickets[ticket] = 0
        merge(x, y, active)
    return out, tickets


def softmax_attention(q, kc, vc, slots, positions):
    """Direct attention in float64: q [B, M, Hq, D] over keys 0 .. positions[b, m]."""
    B, M, Hq, D = q.shape
    G = Hq // kc.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for m in range(M):
            n = int(positions[b, m]) + 1
            for h in range(Hq):
                k = kc[slots[b], :n, h // G].astype(np.float64)
                s = k @ q[b, m, h].astype(np.float64) * D ** -0.5
                p = np.exp(s - s.max())
                out[b, m, h] = p @ vc[slots[b], :n, h // G] / p.sum()
    return out


def inputs(lengths, M, Hq, Hkv, D, max_len, seed=0):
    """bf16-valued q and caches (NaN past each sequence's length + M), slots reversed,
    positions[b, m] = lengths[b] + m."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    slots = np.arange(B)[::-1].copy()
    kc = np.full((B + 1, max_len, Hkv, D), np.nan, np.float32)
    vc = kc.copy()
    for b, n in enumerate(lengths):
        kc[slots[b], :n + M] = bf16(rng.standard_normal((n + M, Hkv, D)))
        vc[slots[b], :n + M] = bf16(rng.standard_normal((n + M, Hkv, D)))
    q = bf16(rng.standard_normal((B, M, Hq, D)) * 2)
    positions = np.asarray(lengths)[:, None] + np.arange(M)[None, :]
    return q, kc, vc, slots, positions


def rel_err(a, b) -> float:
    assert np.isfinite(a).all(), "an output element not written, or a NaN read"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (lengths before the step, M, Hq, Hkv, D, max_len, num_sms): ragged batches, contexts of 1 and
# around tile boundaries, one split to many, row groups
CASES = [
    ([0], 3, 32, 8, 128, 64, 132),                  # context = M: first tile only
    ([60, 61, 62, 63, 64, 125], 5, 32, 8, 128, 200, 132),  # around 64-key tiles, M = 5
    ([0, 5, 300, 1021], 5, 8, 2, 128, 1100, 132),   # ragged, many splits, the new keys split
    ([1, 127, 128, 129], 9, 16, 4, 64, 300, 7),     # 36 rows: 3 m-tiles, KW = 2
    ([2000], 16, 32, 8, 128, 2100, 132),            # 64 rows: 4 m-tiles
    ([700, 3], 9, 32, 4, 128, 800, 132),            # 72 rows: two row groups of 48
    ([250, 40, 1], 4, 8, 2, 64, 300, 1),            # 16 rows, few splits (num_sms 1)
    ([33, 64, 65], 3, 12, 2, 64, 200, 300),         # G = 6: R = 18, more splits than tiles
    ([100, 100], 7, 4, 4, 128, 130, 132),           # no GQA: R = 7 < 8 (decode's shapes too)
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("rounded", [False, True])
def test_emulated_kernel_is_softmax_attention(case, rounded):
    lengths, M, Hq, Hkv, D, max_len, sms = CASES[case]
    q, kc, vc, slots, positions = inputs(lengths, M, Hq, Hkv, D, max_len, seed=case)
    ref = softmax_attention(q, kc, vc, slots, positions)
    got, tickets = emulate(q, kc, vc, slots, positions, sms, rounded=rounded, seed=case)
    assert not tickets.any()  # every launch leaves the tickets at zero
    assert rel_err(got, ref) <= (1e-2 if rounded else 1e-5)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_emulated_kernel_any_shape(data):
    """Random ragged batches, M, GQA group, head count, SM count (so splits) and cache
    length."""
    B = data.draw(st.integers(1, 4))
    lengths = data.draw(st.lists(st.integers(0, 200), min_size=B, max_size=B))
    M = data.draw(st.integers(2, 16))
    G = data.draw(st.sampled_from([1, 2, 4, 8]))
    Hkv = data.draw(st.integers(1, 2))
    max_len = max(lengths) + M + data.draw(st.integers(0, 100))
    sms = data.draw(st.integers(1, 200))
    q, kc, vc, slots, positions = inputs(lengths, M, G * Hkv, Hkv, 64, max_len,
                                         seed=data.draw(st.integers(0, 99)))
    got, tickets = emulate(q, kc, vc, slots, positions, sms, rounded=False)
    assert not tickets.any()
    assert rel_err(got, softmax_attention(q, kc, vc, slots, positions)) <= 1e-5


# -- the plan and the launch --------------------------------------------------------------
def test_constants_match_the_kernel():
    src = (KERNEL_DIR / "verify_attention.cu").read_text()
    assert re.search(r"#define VERIFY_TILE (\d+)", src).group(1) == str(attention.VERIFY_TILE)
    assert re.search(r"#define VERIFY_PAD (\d+)", src).group(1) == str(attention.VERIFY_PAD)
    assert "KW = MT <= 2 ? 4 : 2" in src  # verify_launch's warps per m-tile
    assert [warps_per_mtile(mt) for mt in (1, 2, 3, 4)] == [4, 4, 2, 2]


@pytest.mark.parametrize("B,M,Hq,Hkv,D", [(1, 5, 32, 8, 128), (64, 5, 32, 8, 128),
                                         (8, 9, 32, 4, 128), (3, 16, 16, 8, 64),
                                         (2, 16, 32, 4, 128)])
def test_plan_covers_the_rows_and_fits(B, M, Hq, Hkv, D):
    rows = M * (Hq // Hkv)
    for max_len in (16, 512, 4096, 40960):
        mt, groups, splits = attention.verify_plan(B, M, Hq, Hkv, D, max_len, 132)
        assert 1 <= mt <= 4 and groups * 16 * mt >= rows > (groups - 1) * 16 * mt
        assert 1 <= splits <= attention.MAX_SPLITS
        assert splits <= math.ceil(max_len / attention.VERIFY_TILE)
        threads, smem = attention.verify_launch(mt, D)
        assert threads <= 256 and smem <= 227 * 1024  # sm_90's per-block limit
        # the warps' O merge reuses the K/V stages (VerifyShape's static_assert)
        assert threads // 32 * 16 * (D + 8) * 4 <= 2 * 2 * 64 * (D + 8) * 2


class _Recorder:
    def __init__(self):
        self.launches, self.workspaces = [], {}

    def launch(self, file, name, grid, block, args, shared_mem=0):
        self.launches.append((file, name, grid, block, args, shared_mem))


def _entry_kinds() -> list[type]:
    """Argument kinds of VERIFY_ENTRY (pointers as np.uint64)."""
    src = (KERNEL_DIR / "verify_attention.cu").read_text().replace("\\\n", " ")
    params = re.search(r"attn_verify_bf16_d##D##_t##MT\((.*?)\)\s*\{", src).group(1)
    kinds = {"int": np.int32, "float": np.float32, "long long": np.int64}
    out = []
    for p in params.split(","):
        p = " ".join(p.split())
        out.append(np.uint64 if "*" in p else kinds[p.rsplit(" ", 1)[0].replace("const ", "")])
    return out


def test_launch_matches_the_kernel(monkeypatch):
    monkeypatch.setattr(attention, "_tickets",
                        lambda km, n, device: torch.zeros(1024, dtype=torch.int32))
    monkeypatch.setattr(attention, "_allow_shared", lambda km, file, name, smem: None)
    B, M, Hq, Hkv, D, max_len = 3, 5, 32, 8, 128, 2048
    q = torch.zeros(B, M, Hq, D, dtype=torch.bfloat16)
    cache = torch.zeros(B, max_len, Hkv, D, dtype=torch.bfloat16)
    slots, positions = torch.arange(B), torch.zeros(B, M, dtype=torch.long)
    km = _Recorder()
    out = torch.empty_like(q)
    assert attention._verify(km, q, cache, cache.clone(), slots, positions, 132, out) is out
    (file, name, grid, block, args, smem), = km.launches
    mt, groups, splits = attention.verify_plan(B, M, Hq, Hkv, D, max_len, 132)
    assert (file, name) == ("verify_attention", f"attn_verify_bf16_d{D}_t{mt}") and mt == 2
    assert grid == (B * Hkv, groups, splits) and (block[0], smem) == attention.verify_launch(mt, D)
    assert [type(a) for a in args] == _entry_kinds()
    assert int(args[-4]) == M and int(args[-3]) == Hq and int(args[-2]) == Hkv
    assert float(args[-1]) == pytest.approx(D ** -0.5 * math.log2(math.e), rel=1e-6)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not on PATH")
def test_every_entry_is_compiled(tmp_path):
    """Each name _verify can ask for is an entry of the module nvcc compiles for sm_90."""
    import subprocess

    from kestrel_rt.cuda.module import full_source

    src = tmp_path / "verify_attention.cu"
    src.write_text(full_source("verify_attention"))
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o",
                    str(tmp_path / "v.ptx")], check=True, capture_output=True)
    entries = set(re.findall(r"\.entry\s+(\w+)", (tmp_path / "v.ptx").read_text()))
    assert entries == {f"attn_verify_bf16_d{d}_t{mt}" for d in attention.VERIFY_HEAD_DIMS
                       for mt in (1, 2, 3, 4)}


# -- the fragments: the kernel's shared-memory indexing against the mma's ISA layout ----------
# Lane l = 4 g + t. These helpers transcribe verify_attention.cu's address expressions (in bf16
# elements of a row-padded shared array, STRIDE = D + 8) literally; `mma` is the PTX ISA's
# mma.m16n8k16 (row.col): what the hardware does with the registers, whatever they hold.
LANES = [(lane >> 2, lane & 3) for lane in range(32)]


def mma(a, b, c):
    """a [32][4], b [32][2] pairs (lo, hi) of values; c [32][4] -> d [32][4]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane, (g, t) in enumerate(LANES):
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                          (g + 8, 2 * t + 8)]):
            A[row, col:col + 2] = a[lane][reg]
        B[2 * t:2 * t + 2, g] = b[lane][0]
        B[2 * t + 8:2 * t + 10, g] = b[lane][1]
    Dm = A @ B
    return [[c[lane][e] + Dm[g + 8 * (e >> 1), 2 * t + (e & 1)] for e in range(4)]
            for lane, (g, t) in enumerate(LANES)]


@pytest.mark.parametrize("D,KPW", [(128, 16), (128, 32), (64, 16), (64, 32)])
def test_fragments_compute_qk_and_pv(D, KPW):
    """One warp's tile: S = Q K^T and O = P V through the kernel's fragment loads equal the
    matrix products, S and O landing where the kernel reads them (key 8 n + 2t + (e & 1) of
    row g + 8 (e >> 1); O column 8 n + 2t + (e & 1))."""
    STRIDE, NT, KS = D + 8, KPW // 8, KPW // 16
    rng = np.random.default_rng(D + KPW)
    Q, K, V = (rng.standard_normal(s) for s in ((16, D), (KPW, D), (KPW, D)))
    sq, sk, sv = (np.zeros(n * STRIDE) for n in (16, KPW, KPW))  # padded shared rows
    for flat, mat in ((sq, Q), (sk, K), (sv, V)):
        for r in range(mat.shape[0]):
            flat[r * STRIDE:r * STRIDE + D] = mat[r]

    def lds32(arr, i):
        return (arr[i], arr[i + 1])

    s = [[[0.0] * 4 for _ in range(32)] for _ in range(NT)]
    for kk in range(0, D, 16):
        a = [[lds32(sq, qa), lds32(sq, qa + 8 * STRIDE), lds32(sq, qa + 8),
              lds32(sq, qa + 8 * STRIDE + 8)]
             for qa in (g * STRIDE + kk + 2 * t for g, t in LANES)]
        for n in range(NT):
            b = [(lds32(sk, kb), lds32(sk, kb + 8))
                 for kb in ((8 * n + g) * STRIDE + kk + 2 * t for g, t in LANES)]
            s[n] = mma(a, b, s[n])
    S = Q @ K.T
    for n in range(NT):
        for lane, (g, t) in enumerate(LANES):
            for e in range(4):
                assert s[n][lane][e] == pytest.approx(S[g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)])
    P = rng.standard_normal((16, KPW))  # as if softmaxed: P lands in s's layout
    for n in range(NT):
        for lane, (g, t) in enumerate(LANES):
            for e in range(4):
                s[n][lane][e] = P[g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)]
    o = [[[0.0] * 4 for _ in range(32)] for _ in range(D // 8)]
    for ks in range(KS):
        a = [[(s[2 * ks][lane][0], s[2 * ks][lane][1]), (s[2 * ks][lane][2], s[2 * ks][lane][3]),
              (s[2 * ks + 1][lane][0], s[2 * ks + 1][lane][1]),
              (s[2 * ks + 1][lane][2], s[2 * ks + 1][lane][3])] for lane in range(32)]
        for n in range(D // 8):
            b = []
            for g, t in LANES:
                vp = (16 * ks + 2 * t) * STRIDE + g + 8 * n
                b.append(((sv[vp], sv[vp + STRIDE]),
                          (sv[vp + 8 * STRIDE], sv[vp + 8 * STRIDE + STRIDE])))
            o[n] = mma(a, b, o[n])
    O = P @ V
    for n in range(D // 8):
        for lane, (g, t) in enumerate(LANES):
            for e in range(4):
                assert o[n][lane][e] == pytest.approx(O[g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)])


def conflict_free(byte_addrs: list[int], width: int) -> bool:
    """A warp's shared accesses of `width` bytes each take one pass per 128 bytes requested:
    within each pass no two lanes hit one bank at different 4-byte words."""
    per_pass = 128 // max(4, width)
    for p in range(0, 32, per_pass):
        banks: dict[int, set] = {}
        for addr in byte_addrs[p:p + per_pass]:
            for w in range(addr // 4, (addr + max(4, width)) // 4):
                banks.setdefault(w % 32, set()).add(w)
        if any(len(words) > 1 for words in banks.values()):
            return False
    return True


@pytest.mark.parametrize("D", [64, 128])
def test_fragment_loads_are_bank_conflict_free(D):
    """The padded rows (D + 8) put the 32 lanes of each fragment load on distinct banks."""
    STRIDE, OST = D + 8, D + 8
    for kk in range(0, D, 16):
        assert conflict_free([2 * (g * STRIDE + kk + 2 * t) for g, t in LANES], 4)  # Q, K
        assert conflict_free([2 * (g * STRIDE + kk + 2 * t + 8 * STRIDE + 8) for g, t in LANES], 4)
    for n in range(D // 8):
        for row in (0, 1, 8, 9):  # V: column pairs of keys 2t (+1, +8, +9)
            assert conflict_free([2 * ((2 * t + row) * STRIDE + g + 8 * n) for g, t in LANES], 2)
        for h in (0, 8):  # the O merge's float2 stores
            assert conflict_free([4 * ((g + h) * OST + 8 * n + 2 * t) for g, t in LANES], 8)
    # the 16-byte stores of a tile's rows (cp.async) and the O merge's float4 reads
    chunks = D // 8
    assert conflict_free([2 * ((e // chunks) * STRIDE + e % chunks * 8) for e in range(32)], 16)
    assert conflict_free([4 * ((e // (D // 4)) * OST + e % (D // 4) * 4) for e in range(32)], 16)
    assert not conflict_free([2 * (g * D + 2 * t) for g, t in LANES], 4)  # unpadded rows would
