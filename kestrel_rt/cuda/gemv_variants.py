"""The skinny-matmul kernels' launch variants and names (kernels/gemv*.cu templates).

A variant is (KSPLIT warps splitting K per tile, TPB tiles per block, U sub-steps per loop
iteration, PF L2 prefetch hint); a kernel's name is its C++ template-id (what cupy's
RawModule is asked for), carrying the n-tiles MT and the activation prologue PRO. The best
variant per shape comes from an H200 sweep (bench/gemv_bench.py --sweep ->
gemv_tuned.json); default_variant covers the rest. Used by kestrel_rt/cuda/linear.py (Gemv)
and gemv_moe.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MAX_ROWS = 16  # activation rows the kernels take (two n-tiles of 8)
# bf16 above this many rows goes to cuBLAS: on the H200 sweep (bench/results/NOTES_gemv.md)
# our kernel streams the qwen3-8b layers at 89% of copy bandwidth at M = 1 and 88% at M = 4
# against cuBLAS's 84%, but 81% against 84% at M = 16.
BF16_MAX_ROWS = 8
KERNELS = {"gemv": "gemv_bf16", "gemv_int8": "gemv_int8", "gemv_int4": "gemv_int4"}
FILES_OF = {"bf16": "gemv", "int8": "gemv_int8", "int4": "gemv_int4"}
DEQUANT = {"gemv_int8": ("dequant_int8",), "gemv_int4": ("dequant_int4",)}  # extern "C"
# The kernels' template PRO: an activation prologue (plain, RMSNorm of x, SwiGLU of x =
# gate|up) plus RESIDUAL when the epilogue adds one (a compile-time choice: the residual's
# code costs the kernels without it up to 12 registers, kernels/gemv_mma.cuh store_tile).
PLAIN, RMSNORM, SWIGLU = 0, 1, 2
RESIDUAL = 4
GLU = 8  # + the SwiGLU epilogue: W is [gate; up], the result silu(gate) * up (no residual)
RSTD = 16  # + the row-scale RMSNorm: y[m] = rstd(x[m]) * (x[m] . W), norm weight folded in W
# + the sums of squares of the stored y per (row, 16 columns) into ssq_out [M, ceil(N / 16)]
# (with RESIDUAL): what a later RSTD_IN kernel reads instead of squaring x itself
SSQ = 32
RSTD_IN = 64  # + RSTD's row scale with rstd from ssq_in [M, ceil(K / 16)] (an SSQ kernel's)
ARGMAX = 128  # the greedy choice of each row of x instead of y (the bulk bf16 kernel only)
EXPERT_PROS = (PLAIN, SWIGLU)  # the expert-indexed kernels take no RMSNorm, no residual
# The PROs the runtime and the tests compile: every prologue with and without the residual,
# the SwiGLU epilogue (plain or after the RMSNorm prologue), and for the bf16 kernel the
# row-scale RMSNorm (alone or with the SwiGLU epilogue).
DENSE_PROS = (tuple(act | res for res in (0, RESIDUAL) for act in (PLAIN, RMSNORM, SWIGLU))
              + (GLU, GLU | RMSNORM))
BF16_PROS = (RSTD, RSTD | GLU)
# The producer / consumer pair of the row-scale RMSNorm (all three kernels): the residual
# gemv writing its sums of squares, the next gemv reading them (alone or with the SwiGLU
# epilogue). CupyBackend.norm_row_scale "producer".
SSQ_PROS = (RESIDUAL | SSQ, RSTD_IN, RSTD_IN | GLU)


# The persistent ring kernels (kernels/gemv_ring.cu): the (KSPLIT, S) variants compiled per
# weight kind (bf16: KSPLIT warps per block on one tile; int4: 16 warps per block, KSPLIT on
# each of 16 / KSPLIT tiles; S ring slots per thread), the prologues they take, the most bytes
# of x they stage in shared memory (M * K * 2), and which weight kinds have one.
RING_VARIANTS = {"gemv": ((8, 8), (8, 4), (16, 4), (16, 8), (4, 16)),
                 "gemv_int4": ((16, 8), (16, 4), (8, 8), (4, 8))}
# The default for bf16 weights: 128 KB of ring per block, so at most one ring block per SM
# (kernels/gemv_ring.cu). H200, bench/ablation.py: qwen3-8b bf16 decode step 4.200 ms against
# 4.505 with the tuned kernels; the int4 ring kernels measured slower (qwen3-8b int4: 2.601 ms
# with (8, 8) against 2.352, session 8), so int4 weights keep the tuned kernel unless
# Gemv.ring_int4 is set.
RING_DEFAULT = (16, 8, 1)
RING_PROS = (PLAIN, RESIDUAL, GLU, RMSNORM, RMSNORM | GLU)
RING_X_BYTES = 32 * 1024
RING_KERNELS = {"gemv": "gemv_ring_bf16", "gemv_int4": "gemv_ring_int4"}
# shared bytes per warp and ring slot: 32 threads' two 16-byte vectors (int4: and the warp's
# 48 bytes of scales and zeros, kernels/gemv_ring.cu Int4Meta)
RING_SLOT_BYTES = {"gemv": 32 * 32, "gemv_int4": 32 * 32 + 48}


def ring_name(file: str, ksplit: int, slots: int, pro: int) -> str:
    return f"{RING_KERNELS[file]}<{ksplit}, {slots}, {pro}>"


def ring_warps(file: str, ksplit: int) -> int:
    """Warps per block of a ring kernel: KSPLIT (bf16), 16 (int4)."""
    return 16 if file == "gemv_int4" else ksplit


def ring_tiles(file: str, ksplit: int) -> int:
    """16-row tiles a ring block works on at a time: 1 (bf16), 16 / KSPLIT (int4)."""
    return ring_warps(file, ksplit) // ksplit


def ring_shared_bytes(file: str, ksplit: int, slots: int, m: int, k: int) -> int:
    """Dynamic shared memory of a ring launch: the slots, then x's m rows of k bf16."""
    return slots * ring_warps(file, ksplit) * RING_SLOT_BYTES[file] + m * k * 2


def ring_static_bytes(file: str, ksplit: int) -> int:
    """Static shared memory of a ring kernel, at most: the K-split sums (two tiles' worth),
    the RMSNorm partials and the int4 group sums (kernels/gemv_ring.cu)."""
    warps = ring_warps(file, ksplit)
    # int4: 8 mma columns' sums per 128-k group, at most RING_X_BYTES of x at M = 1
    group_sums = RING_X_BYTES // 2 // 128 * 8 if file == "gemv_int4" else 0
    return 4 * (2 * warps * 4 * 32 + (warps + 1) * 8 + group_sums)


# The bulk-copy kernels (kernels/gemv_bulk.cu gemv_bulk_bf16 / gemv_bulk_int4): (WARPS
# consumer warps per block (and a producer warp), S slots per block, C bytes of each of a
# tile's 16 rows per slot) variants compiled per weight kind, each above half an SM's shared
# memory (one block per SM). They take the rings' prologues (RING_PROS: plain x or its RMSNorm,
# a residual or the SwiGLU epilogue); bf16 stages x as the ring does, int4 reads it as
# gemv_int4.cu does. (Measured and dropped, H200, 36 qwen3-8b layers alone: bf16 (8, 5, 2048)
# 76.6% and (8, 8, 1024) 50.3% of copy against 84.6% for (8, 4, 2048); int4 (4, 4, 2048) 25.1%
# and (8, 3, 4096) 23.3% against 35.3%: NOTES_decode.md, session 10. (8, 5, 2048) for the o
# projection alone, beside decode attention, was slower too: session 13.)
BULK_KERNELS = {"gemv": "gemv_bulk_bf16", "gemv_int4": "gemv_bulk_int4"}
BULK_VARIANTS = {"gemv": ((8, 4, 2048), (8, 6, 2048), (16, 4, 2048), (8, 3, 4096),
                          (16, 3, 4096)),
                 "gemv_int4": ((8, 4, 2048), (16, 4, 2048))}
# The default for bf16 weights on sm_90 (ahead of the cp.async ring, which then never runs):
# H200, bench/ablation.py, qwen3-8b bf16 decode step 4.270 ms against 4.444 with the tuned
# kernels on a node where the cp.async ring streamed at 63% of copy; the bigger rings ((8, 6,
# 2048): 203 KB) stream faster alone but make the step slower (4.94 ms); also faster for
# qwen3-0.6b (0.761 vs 0.791 ms) and qwen3-30b-a3b (2.746 vs 2.883): NOTES_decode.md, session 9.
# int4 weights keep the tuned kernel: the int4 bulk kernel streams the 36 qwen3-8b layers at
# 35-38% of copy against 55% (bench/gemv_bench.py; NOTES_decode.md, session 10).
BULK_DEFAULT = (8, 4, 2048)
# The o projection's (the gemv after decode attention) at one row of x where its weight has
# more 16-row tiles than the GPU has SMs: six slots (219 KB: no decode attention block beside
# it, so its blocks start as attention's leave, then six items in flight; at two rows the
# qwen3-8b step took 5.218 ms with it against 4.382 without, the batch sweep of
# bench/results/h200_decode_28b1ee4.md). H200, bench/ablation.py --kind-bulk,
# three nodes: qwen3-8b bf16 4.152-4.154 / 4.139-4.154 / 4.154 ms per step against
# 4.190-4.206 / 4.171-4.172 / 4.192-4.201 with (8, 4, 2048); (8, 5, 2048) (186 KB, beside
# attention) 4.213-4.215, (8, 3, 4096) 4.205, (16, 3, 4096) 4.209, (16, 4, 2048) 4.193;
# qwen3-30b-a3b (128 tiles) slower with it, 2.779-2.782 against 2.749-2.751, qwen3-0.6b (64)
# the same (bench/results/ablation_o_bulk*_h200.log, ablation_kind_bulk_h200.log).
BULK_AFTER_ATTENTION = (8, 6, 2048)
# The most rows of x Gemv sends to a bulk kernel by default (the kernels take up to 8): on the
# H200 (bench/bulk_rows.py: qwen3-8b bf16, batch 1, 128 cached tokens) a forward of M tokens
# took 4.257 / 4.571 ms through the bulk kernel at M = 1 / 2 against 4.514 / 4.800 through the
# tuned kernels, but 5.538 / 5.635 against 5.178 / 5.232 at M = 3 / 4 (NOTES_decode.md,
# session 10).
BULK_MAX_ROWS = 2
# bytes a slot row is padded by: bank-conflict-free 16-byte reads (kernels/gemv_bulk.cu)
BULK_PAD = {"gemv": 64, "gemv_int4": 32}


# The bulk bf16 kernel's further prologues: the row-scale RMSNorm (RSTD: the norm weight folded
# into W, x staged as it is with its sums of squares, the rows' rstd applied as the tiles are
# stored), plain or with the SwiGLU epilogue.
BULK_RSTD_PROS = (RSTD, RSTD | GLU)
# ... and its greedy choice instead of y (ARGMAX: argmax over the N results of each row of x,
# Gemv.argmax; the lm_head of a greedy decode step), after plain x or RSTD's row scale.
BULK_ARGMAX_PROS = (ARGMAX, RSTD | ARGMAX)


def persistent_pros(source: str) -> tuple[int, ...]:
    """The prologues a kernels/SOURCE.cu (gemv_ring or gemv_bulk) module is compiled for."""
    return RING_PROS + (BULK_RSTD_PROS + BULK_ARGMAX_PROS if source == "gemv_bulk" else ())


def persistent_names(source: str, pro: int) -> list[str]:
    """The kernels a module of kernels/SOURCE.cu (gemv_ring or gemv_bulk) holds for prologue
    pro (one of persistent_pros): every variant of the weight kinds that take it."""
    if source == "gemv_ring":
        return [ring_name(f, ks, s, pro) for f in RING_KERNELS for ks, s in RING_VARIANTS[f]]
    files = ["gemv"] if pro in BULK_RSTD_PROS + BULK_ARGMAX_PROS else BULK_KERNELS
    return [bulk_name(f, *v, pro) for f in files for v in BULK_VARIANTS[f]]


def bulk_name(file: str, warps: int, slots: int, row_bytes: int, pro: int) -> str:
    return f"{BULK_KERNELS[file]}<{warps}, {slots}, {row_bytes}, {pro}>"


def bulk_shared_bytes(file: str, warps: int, slots: int, row_bytes: int, m: int,
                      k: int) -> int:
    """Dynamic shared memory of a bulk launch: the slots (16 padded rows each), then x (bf16)
    or the group sums of x (int4, which reads x from global memory: float2 [K / 128][4])."""
    x_bytes = m * k * 2 if file == "gemv" else 32 * (k // 128)
    return slots * 16 * (row_bytes + BULK_PAD[file]) + x_bytes


def bulk_static_bytes(file: str, warps: int, slots: int) -> int:
    """Static shared memory of a bulk kernel: its mbarriers, two tiles' per-warp sums and (bf16)
    the RMSNorm partials."""
    return 16 * slots + 4 * 2 * warps * 4 * 32 + (4 * (warps + 2) * 8 if file == "gemv" else 0)


def pros_of(file: str) -> tuple[int, ...]:
    """The PROs compiled for kernels/FILE.cu (see DENSE_PROS)."""
    return DENSE_PROS + SSQ_PROS + (BF16_PROS if file == "gemv" else ())
# A launch variant: (KSPLIT warps splitting K per tile, TPB tiles per block, U sub-steps per
# loop iteration, PF L2 prefetch hint); blockDim = 32 * KSPLIT * TPB.
GEOMETRIES = ((1, 8), (2, 4), (4, 2), (8, 1), (16, 1))
# U per kernel: more would spill registers (two pipeline stages of 2U 16-byte vectors each)
U_CHOICES = {"gemv": (2, 4, 8), "gemv_int8": (1, 2, 4), "gemv_int4": (1, 2, 4)}
K_PER_SUB = {"gemv": 32, "gemv_int8": 64, "gemv_int4": 128}  # k one sub-step covers
DEFAULT_U = {"gemv": 4, "gemv_int8": 4, "gemv_int4": 2}
# U of the expert kernels with the SwiGLU prologue: DEFAULT_U spills there (ptxas, sm_90:
# int8 experts with 16 warps per block spill 420 bytes at U = 4, none at U = 2)
SWIGLU_EXPERT_U = {"gemv": 2, "gemv_int8": 2, "gemv_int4": 2}
WARPS_PER_SM = 16  # aim: enough 16-byte loads in flight to cover DRAM latency
# Best variant per (file, N, K, n-tiles) measured by `bench/gemv_bench.py --sweep` on an H200.
TUNED_FILE = Path(__file__).with_name("gemv_tuned.json")


def kernel_name(file: str, mt: int, variant: tuple[int, int, int, bool], pro: int = PLAIN) -> str:
    ks, tpb, u, pf = variant
    return f"{KERNELS[file]}<{mt}, {ks}, {tpb}, {u}, {'true' if pf else 'false'}, {pro}>"


def expert_u(file: str, pro: int) -> int:
    """U of the expert-indexed kernels (launched with default_variant's geometry)."""
    return SWIGLU_EXPERT_U[file] if pro == SWIGLU else DEFAULT_U[file]


def experts_name(file: str, variant: tuple[int, int, int, bool], pro: int = PLAIN) -> str:
    ks, tpb, u, pf = variant
    return f"{KERNELS[file]}_experts<{ks}, {tpb}, {u}, {'true' if pf else 'false'}, {pro}>"


def all_variants(file: str) -> list[tuple[int, int, int, bool]]:
    return [(ks, tpb, u, pf) for ks, tpb in GEOMETRIES for u in U_CHOICES[file]
            for pf in (False, True)]


def default_variant(file: str, n: int, k: int, sms: int,
                    u: int | None = None) -> tuple[int, int, int, bool]:
    """Split K over more warps until the chip holds ~WARPS_PER_SM warps per SM (u: sub-steps
    per iteration, DEFAULT_U[file] unless given)."""
    u = DEFAULT_U[file] if u is None else u
    tiles = math.ceil(n / 16)
    iters = math.ceil(k / (K_PER_SUB[file] * u))
    for ks, tpb in GEOMETRIES:
        if tiles * ks >= sms * WARPS_PER_SM or 2 * ks > iters:
            return ks, tpb, u, True
    return (*GEOMETRIES[-1], u, True)


def module_names(file: str, pro: int, tuned: dict, sweep: bool = False) -> list[str]:
    """The kernels one (file, PRO) module compiles: the tuned and default variants
    (sweep: every variant), the expert kernels gemv_moe launches, the extern "C" ones."""
    if sweep:
        variants = set(all_variants(file))
    else:
        variants = {v for key, v in tuned.items() if key[0] == file}
        variants |= {(ks, tpb, DEFAULT_U[file], True) for ks, tpb in GEOMETRIES}
    names = sorted({kernel_name(file, mt, v, pro) for v in variants for mt in (1, 2)})
    if pro in EXPERT_PROS:  # gemv_moe launches default_variant's geometries
        experts = (variants if sweep else
                   {(ks, tpb, expert_u(file, pro), True) for ks, tpb in GEOMETRIES})
        names += sorted({experts_name(file, v, pro) for v in experts})
    return names + (list(DEQUANT.get(file, ())) if pro == PLAIN else [])


def load_tuned(path: Path = TUNED_FILE) -> dict:
    """{(file, n, k, mt): variant} from a sweep's JSON, or {} when there is none."""
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())["best"]
    return {(r["file"], r["n"], r["k"], r["mt"]): tuple(r["variant"]) for r in rows}
