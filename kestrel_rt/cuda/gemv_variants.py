"""The skinny-matmul kernels' launch variants and names (kernels/gemv*.cu templates).

A variant is (KSPLIT warps splitting K per tile, TPB tiles per block, U sub-steps per loop
iteration, PF L2 prefetch hint); a kernel's name is its C++ template-id (what cupy's
RawModule is asked for), carrying the n-tiles MT and the prologue / epilogue bits PRO. The
best variant per shape comes from an H200 sweep (bench/gemv_bench.py --sweep ->
gemv_tuned.json); default_variant covers the rest. Which kernel a launch takes is decided in
kestrel_rt/cuda/gemv_plan.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MAX_ROWS = 16  # activation rows the kernels take (two n-tiles of 8)
# bf16 above this many rows goes to cuBLAS, which streams as fast or faster there
# (docs/performance.md: the gemv sweep).
BF16_MAX_ROWS = 8
KERNELS = {"gemv": "gemv_bf16", "gemv_int8": "gemv_int8", "gemv_int4": "gemv_int4"}
FILES_OF = {"bf16": "gemv", "int8": "gemv_int8", "int4": "gemv_int4"}
DEQUANT = {"gemv_int8": ("dequant_int8",), "gemv_int4": ("dequant_int4",)}  # extern "C"
# The kernels' template PRO: the activation prologue (plain x, or the SwiGLU of x = gate|up,
# which only the expert kernels take) plus epilogue bits, each a compile-time choice (the
# residual's code costs the kernels without it up to 12 registers, kernels/gemv_mma.cuh).
PLAIN, SWIGLU = 0, 2
RESIDUAL = 4  # + residual: y = res + x @ W.T
GLU = 8  # + the SwiGLU epilogue: W is [gate; up], the result silu(gate) * up (no residual)
RSTD = 16  # + the row-scale RMSNorm: y[m] = rstd(x[m]) * (x[m] . W), norm weight folded in W
ARGMAX = 128  # the greedy choice of each row of x instead of y (the bulk bf16 kernel only)
EXPERT_PROS = (PLAIN, SWIGLU)  # the expert-indexed kernels take no residual
# The PROs compiled for every dense kernel: plain x with or without the residual, and the
# SwiGLU epilogue; the bf16 kernel also takes the row-scale RMSNorm (alone or with GLU).
DENSE_PROS = (PLAIN, RESIDUAL, GLU)
BF16_PROS = (RSTD, RSTD | GLU)


# The persistent ring kernel (kernels/gemv_ring.cu, bf16 weights): the (KSPLIT warps per
# block on one tile, S ring slots per thread) variants compiled, the prologues it takes, and
# the most bytes of x it stages in shared memory (M * K * 2).
RING_VARIANTS = ((8, 8), (8, 4), (16, 4), (16, 8), (4, 16))
# The default: 128 KB of ring per block, at most one ring block per SM (docs/performance.md)
RING_DEFAULT = (16, 8, 1)
RING_PROS = (PLAIN, RESIDUAL, GLU)
RING_X_BYTES = 32 * 1024
RING_KERNEL = "gemv_ring_bf16"
RING_SLOT_BYTES = 32 * 32  # shared bytes per warp and slot: 32 threads' two 16-byte vectors


def ring_name(ksplit: int, slots: int, pro: int) -> str:
    return f"{RING_KERNEL}<{ksplit}, {slots}, {pro}>"


def ring_shared_bytes(ksplit: int, slots: int, m: int, k: int) -> int:
    """Dynamic shared memory of a ring launch: the slots, then x's m rows of k bf16."""
    return slots * ksplit * RING_SLOT_BYTES + m * k * 2


def ring_static_bytes(ksplit: int) -> int:
    """Static shared memory of a ring kernel, at most: the K-split sums (two tiles' worth)."""
    return 4 * 2 * ksplit * 4 * 32


# The bulk-copy kernel (kernels/gemv_bulk.cu gemv_bulk_bf16, sm_90+): (WARPS consumer warps
# per block and a producer warp, S slots per block, C bytes of each of a tile's 16 rows per
# slot) variants compiled, each above half an SM's shared memory (one block per SM).
BULK_KERNEL = "gemv_bulk_bf16"
BULK_VARIANTS = ((8, 4, 2048), (8, 6, 2048), (16, 4, 2048), (8, 3, 4096), (16, 3, 4096))
BULK_DEFAULT = (8, 4, 2048)
# The o projection's (the gemv right after decode attention) at one row of x where its weight
# has more 16-row tiles than the GPU has SMs: six slots (219 KB: no decode attention block
# beside it, so its blocks start as attention's leave, then six items in flight).
BULK_AFTER_ATTENTION = (8, 6, 2048)
# The most rows of x that go to the bulk kernel (it takes up to 8; the tuned kernels are
# faster from 3 rows on: docs/performance.md)
BULK_MAX_ROWS = 2
BULK_PAD = 64  # bytes a slot row is padded by: bank-conflict-free 16-byte reads
# The bulk kernel's prologues: the ring's, the row-scale RMSNorm (RSTD: x staged as it is
# with its sums of squares, the rows' rstd applied as the tiles are stored), and the greedy
# choice instead of y (ARGMAX: Gemv.argmax, the lm_head of a greedy decode step).
BULK_RSTD_PROS = (RSTD, RSTD | GLU)
BULK_ARGMAX_PROS = (ARGMAX, RSTD | ARGMAX)


def persistent_pros(source: str) -> tuple[int, ...]:
    """The prologues a kernels/SOURCE.cu (gemv_ring or gemv_bulk) module is compiled for."""
    return RING_PROS + (BULK_RSTD_PROS + BULK_ARGMAX_PROS if source == "gemv_bulk" else ())


def persistent_names(source: str, pro: int) -> list[str]:
    """The kernels a module of kernels/SOURCE.cu (gemv_ring or gemv_bulk) holds for prologue
    pro (one of persistent_pros): every compiled variant."""
    if source == "gemv_ring":
        return [ring_name(ks, s, pro) for ks, s in RING_VARIANTS]
    return [bulk_name(*v, pro) for v in BULK_VARIANTS]


def bulk_name(warps: int, slots: int, row_bytes: int, pro: int) -> str:
    return f"{BULK_KERNEL}<{warps}, {slots}, {row_bytes}, {pro}>"


def bulk_shared_bytes(warps: int, slots: int, row_bytes: int, m: int, k: int) -> int:
    """Dynamic shared memory of a bulk launch: the slots (16 padded rows each), then x."""
    return slots * 16 * (row_bytes + BULK_PAD) + m * k * 2


def bulk_static_bytes(warps: int, slots: int) -> int:
    """Static shared memory of a bulk kernel: its mbarriers, two tiles' per-warp sums and the
    row-scale partials."""
    return 16 * slots + 4 * 2 * warps * 4 * 32 + 4 * (warps + 1) * 8


def pros_of(file: str) -> tuple[int, ...]:
    """The PROs compiled for kernels/FILE.cu (see DENSE_PROS)."""
    return DENSE_PROS + (BF16_PROS if file == "gemv" else ())
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


def module_pros(file: str) -> tuple[int, ...]:
    """The PROs kernels/FILE.cu is compiled for, one module each: the dense kernels' and the
    expert kernels' (gemv_moe)."""
    return tuple(dict.fromkeys(pros_of(file) + EXPERT_PROS))


def module_names(file: str, pro: int, tuned: dict, sweep: bool = False) -> list[str]:
    """The kernels one (file, PRO) module compiles: the tuned and default variants of the
    dense kernel (sweep: every variant), the expert kernels gemv_moe launches, the extern "C"
    ones."""
    if sweep:
        variants = set(all_variants(file))
    else:
        variants = {v for key, v in tuned.items() if key[0] == file}
        variants |= {(ks, tpb, DEFAULT_U[file], True) for ks, tpb in GEOMETRIES}
    names = []
    if pro in pros_of(file):  # (the SwiGLU prologue: expert kernels only)
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
