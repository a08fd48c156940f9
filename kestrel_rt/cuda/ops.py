"""Python wrappers of the kernels: torch tensors in, torch tensors out, on torch's stream.

Each wrapper checks what its kernel assumes (dtype, layout, sizes) and raises
`Unsupported` when it does not hold, so the caller can fall back to the torch reference.
Shapes follow the Backend ops (kestrel_rt/backend/base.py). `km` is the calling backend's
KernelModules. The attention wrappers live in kestrel_rt/cuda/attention.py (they use the
argument helpers below).
"""

from __future__ import annotations

import math

import torch

from kestrel_rt.cuda.module import KernelModules, f32, i32, i64, ptr

SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_MOE_EXPERTS = 256


class Unsupported(Exception):
    """This kernel cannot take these inputs; use the torch reference instead."""


def dtype_suffix(*tensors: torch.Tensor) -> str:
    dtype = tensors[0].dtype
    if dtype not in SUFFIX or any(t.dtype != dtype for t in tensors):
        raise Unsupported(f"dtypes {[t.dtype for t in tensors]}")
    if any(not t.is_cuda for t in tensors):
        raise Unsupported("tensor not on a CUDA device")
    return SUFFIX[dtype]


def vec_elems(dtype: torch.dtype) -> int:
    """Elements of `dtype` in 16 bytes."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [B, M, heads, D] -> (x or a dense copy, stride between consecutive (b, m) tokens)
    such that token t = b * M + m starts at t * stride and its heads x D are dense."""
    B, M, heads, D = x.shape
    st = x.stride()
    if (D == 1 or st[3] == 1) and (heads == 1 or st[2] == D):
        if M == 1:
            return x, st[0]
        if B == 1 or st[0] == M * st[1]:
            return x, st[1]
    x = x.contiguous()
    return x, heads * D


def dest(out: torch.Tensor | None, shape, dtype: torch.dtype,
          device: torch.device | None = None) -> torch.Tensor:
    """`out` checked to be a dense tensor of shape/dtype, or a new empty one."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected dense {tuple(shape)} {dtype}")
    return out


# -- norms ----------------------------------------------------------------------------------
def rms_norm(km: KernelModules, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., n] (+ residual) -> (w * rmsnorm(s), s) with s = residual + x (None without).
    out / res_out: optional dense destinations shaped like x."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    sfx = dtype_suffix(*tensors)
    n = x.shape[-1]
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x) if out is None else dest(out, x.shape, x.dtype)
    if residual is None:
        res_out = None
    else:
        res_out = torch.empty_like(x) if res_out is None else dest(res_out, x.shape, x.dtype)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out, res_out
    v = vec_elems(x.dtype)
    vec = n % v == 0 and aligned(*tensors, out) and (res_out is None or aligned(res_out))
    threads = min(1024, max(32, round_up(math.ceil(n / (v if vec else 1)), 32)))
    km.launch("rmsnorm", f"rmsnorm_{sfx}", (rows,), (threads,),
              (ptr(x), ptr(residual), ptr(weight.contiguous()), ptr(out), ptr(res_out),
               i32(n), f32(eps), i32(int(vec))))
    return out, res_out


def qk_norm_rope(km: KernelModules, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, eps: float, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, M, Hq, D], k [B, M, Hkv, D] (strided views allowed), cos/sin tables [P, D],
    positions [B, M] int64 -> (q, k) normalised per head and rotated, dense."""
    sfx = dtype_suffix(q, k, q_weight, k_weight, cos, sin)
    B, M, Hq, D = q.shape
    Hkv = k.shape[2]
    if D % 2 or D > 256 or positions.dtype != torch.long:
        raise Unsupported(f"head_dim {D}, positions {positions.dtype}")
    q, q_st = token_rows(q)
    k, k_st = token_rows(k)
    q_out = dest(q_out, (B, M, Hq, D), q.dtype, q.device)
    k_out = dest(k_out, (B, M, Hkv, D), q.dtype, q.device)
    if B * M == 0:
        return q_out, k_out
    warps = min(4, Hq + Hkv)
    km.launch("qk_norm_rope", f"qk_norm_rope_{sfx}", (B * M, math.ceil((Hq + Hkv) / warps)),
              (32 * warps,),
              (ptr(q), i64(q_st), ptr(k), i64(k_st), ptr(q_weight.contiguous()),
               ptr(k_weight.contiguous()), ptr(cos.contiguous()), ptr(sin.contiguous()),
               ptr(positions.contiguous()), ptr(q_out), ptr(k_out), i32(Hq), i32(Hkv), i32(D),
               f32(eps)))
    return q_out, k_out


# -- MLP ------------------------------------------------------------------------------------
def swiglu(km: KernelModules, gate_up: torch.Tensor, num_sms: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [..., 2I] (gate then up) -> silu(gate) * up [..., I]."""
    sfx = dtype_suffix(gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise Unsupported(f"odd last dim {two_i}")
    inter = two_i // 2
    gate_up = gate_up.contiguous()
    out = dest(out, gate_up.shape[:-1] + (inter,), gate_up.dtype, gate_up.device)
    rows = gate_up.numel() // two_i if two_i else 0
    if rows == 0:
        return out
    n = vec_elems(gate_up.dtype)
    vec = inter % n == 0 and aligned(gate_up, out)
    work = rows * (inter // n if vec else inter)
    blocks = max(1, min(math.ceil(work / 256), 8 * num_sms))
    km.launch("swiglu", f"swiglu_{sfx}", (blocks,), (256,),
              (ptr(gate_up), ptr(out), i64(rows), i32(inter), i32(int(vec))))
    return out


def moe_route(km: KernelModules, logits: torch.Tensor, top_k: int,
              renorm: bool, out: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in logits' dtype, experts [N, k] int64)."""
    sfx = dtype_suffix(logits)
    N, E = logits.shape
    if E > MAX_MOE_EXPERTS or not 0 < top_k <= min(E, 32):
        raise Unsupported(f"{E} experts, top {top_k}")
    logits = logits.contiguous()
    out = out or (None, None)
    weights = dest(out[0], (N, top_k), logits.dtype, logits.device)
    experts = dest(out[1], (N, top_k), torch.long, logits.device)
    if N:
        km.launch("moe", f"moe_route_{sfx}", (math.ceil(N / 4),), (128,),
                  (ptr(logits), ptr(weights), ptr(experts), i32(N), i32(E), i32(top_k),
                   i32(int(renorm))))
    return weights, experts


# 16-byte vectors per lane and weight row of one chunk that kernels/moe.cu instantiates: the
# largest fill 128 registers (2 blocks of MOE_THREADS per SM).
MOE_THREADS = 256  # 8 warps: 8 output columns (gate_up) or elements (down) per block
MOE_GATE_UP_U = (1, 2, 4, 8)
MOE_DOWN_U = {torch.bfloat16: (1, 2, 3), torch.float32: (1, 2)}


def _moe_u(n: int, vec: int, choices: tuple[int, ...]) -> int:
    """The smallest U whose chunk (32 U vec elements) covers a row of n, else the largest
    (the kernel then loops over chunks)."""
    need = math.ceil(n / (32 * vec))
    return next((u for u in choices if u >= need), choices[-1])


def moe_launches(dtype: torch.dtype, N: int, H: int, inter: int, top_k: int
                 ) -> list[tuple[str, tuple[int, int], tuple[int]]]:
    """(kernel, grid, block) of moe_gate_up and moe_down for N tokens: one warp per output.
    Qwen3-30B-A3B bf16 at N = 1: down is 256 blocks, one wave at 2 blocks per SM on 132 SMs."""
    sfx, vec, warps = SUFFIX[dtype], vec_elems(dtype), MOE_THREADS // 32
    gate_up = f"moe_gate_up_{sfx}_u{_moe_u(H, vec, MOE_GATE_UP_U)}"
    down = f"moe_down_{sfx}_u{_moe_u(inter, vec, MOE_DOWN_U[dtype])}"
    return [(gate_up, (N * top_k, math.ceil(inter / warps)), (MOE_THREADS,)),
            (down, (N, math.ceil(H / warps)), (MOE_THREADS,))]


def moe_experts(km: KernelModules, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                row_eps: float | None = None) -> torch.Tensor:
    """x [N, H], weights [N, k], experts [N, k] int64, gate_up [E, 2I, H], down [E, H, I]
    -> [N, H]: each token's chosen experts' SwiGLU MLPs, weighted and summed
    (+ residual [N, H], rounded as torch's residual + moe_out, when given). row_eps: x is
    the raw residual stream and its RMSNorm (unit weight, this eps; the weight folded into
    gate_up: kestrel_rt/fold.py) is a row scale inside moe_gate_up. moe_down issues its first
    weight loads before its PDL wait, while moe_gate_up finishes (kernels/moe.cu)."""
    dtype_suffix(x, weights, gate_up, down, *(() if residual is None else (residual,)))
    top_k = weights.shape[1]
    x, residual, act, out = _moe_buffers(x, gate_up, down, residual, top_k, out)
    weights, experts = weights.contiguous(), experts.contiguous()
    N, H = x.shape
    if N == 0:
        return out
    inter = act.shape[2]
    (gu_name, gu_grid, block), (down_name, down_grid, _) = moe_launches(x.dtype, N, H, inter,
                                                                        top_k)
    km.launch("moe", gu_name, gu_grid, block,
              (ptr(x), ptr(gate_up), ptr(experts), ptr(act), i32(top_k), i32(H), i32(inter),
               f32(-1.0 if row_eps is None else row_eps)))
    km.launch("moe", down_name, down_grid, block,
              _moe_down_args(act, down, experts, weights, residual, out))
    return out


def _moe_buffers(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 residual: torch.Tensor | None, top_k: int, out: torch.Tensor | None):
    """The checks moe.cu's expert kernels need (Unsupported otherwise) and their buffers:
    (x, residual) contiguous, act [N, k, I] and out [N, H]."""
    N, H = x.shape
    inter = gate_up.shape[1] // 2
    n = vec_elems(x.dtype)
    if H % n or inter % n or not (gate_up.is_contiguous() and down.is_contiguous()):
        raise Unsupported(f"hidden {H}, intermediate {inter}")
    if residual is not None and tuple(residual.shape) != (N, H):
        raise Unsupported(f"residual {tuple(residual.shape)}, expected {(N, H)}")
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    if not aligned(x, gate_up, down):
        raise Unsupported("x, gate_up and down must be 16-byte aligned")
    act = torch.empty((N, top_k, inter), dtype=x.dtype, device=x.device)  # [N, k, I]
    return x, residual, act, dest(out, x.shape, x.dtype, x.device)


def _moe_down_args(act, down, experts, weights, residual, out) -> tuple:
    """moe_down's arguments (act [N, k, I], routing [N, k] each, out [N, H]; early loads on)."""
    _, top_k, inter = act.shape
    return (ptr(act), ptr(down), ptr(experts), ptr(weights), ptr(residual), ptr(out),
            i32(top_k), i32(out.shape[1]), i32(inter), i32(1))


# -- greedy sampling ------------------------------------------------------------------------
ARGMAX_CHUNK = 4096  # elements of a row per block (a multiple of every dtype's vector)


def _argmax_chunks(n: int) -> int:
    """Blocks (chunks of ARGMAX_CHUNK elements) per row of n."""
    return max(1, math.ceil(n / ARGMAX_CHUNK))


def argmax_scratch(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What `argmax` of [rows, n] needs between its blocks: each chunk's best candidate (a
    64-bit key, kernels/argmax_key.cuh) and one counter per row (zeroed here; the kernel
    leaves it at zero)."""
    return (torch.empty(rows, _argmax_chunks(n), dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device))


def check_host_out(host: tuple[torch.Tensor, torch.Tensor] | None, rows: int,
                   device: torch.device) -> None:
    """What a kernel writing `rows` token ids to the host needs (None: nothing): (pinned int64
    [2, rows] on the host, parity int64 on `device`); ValueError otherwise."""
    if host is None:
        return
    buf, parity = host
    if (buf.device.type != "cpu" or not buf.is_pinned() or buf.dtype != torch.long
            or tuple(buf.shape) != (2, rows) or not buf.is_contiguous()
            or parity.dtype != torch.long or parity.device != device):
        raise ValueError(f"argmax host buffers {tuple(buf.shape)} {buf.dtype} {buf.device}, "
                         f"parity {parity.dtype} {parity.device}: expected a pinned int64 "
                         f"[2, {rows}] on the host and an int64 on {device}")


def argmax(km: KernelModules, x: torch.Tensor, scratch: tuple[torch.Tensor, ...] | None = None,
           out: torch.Tensor | None = None,
           host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., n] -> [...] int64, the first index of each row's maximum (a NaN above any
    number), as torch.argmax(x, -1). scratch: argmax_scratch(rows, n) (kept by the caller so
    that a captured CUDA graph replays with the same buffers; made here when None). host:
    (pinned int64 [2, rows] on the host, parity: int64 [1] on the device): the ids are also
    written to host[parity], by the kernel itself (no copy on the stream)."""
    sfx = dtype_suffix(x)
    n = x.shape[-1]
    if n == 0 or n >= 2**31:
        raise Unsupported(f"argmax over {n} elements")
    x = x.contiguous()
    rows = x.numel() // n
    out = dest(out, x.shape[:-1], torch.long, x.device)
    if rows == 0:
        return out
    chunks = _argmax_chunks(n)
    scratch = scratch or argmax_scratch(rows, n, x.device)
    part, counter = scratch
    if (part.shape != (rows, chunks) or part.dtype != torch.long or counter.numel() < rows
            or counter.dtype != torch.int32):
        raise ValueError(f"argmax scratch {[(tuple(t.shape), t.dtype) for t in scratch]}: "
                         f"expected argmax_scratch({rows}, {n})")
    check_host_out(host, rows, x.device)
    vec = n % vec_elems(x.dtype) == 0 and aligned(x)
    km.launch("argmax", f"argmax_{sfx}", (chunks, rows), (256,),
              (ptr(x), ptr(out), ptr(part), ptr(counter),
               ptr(None if host is None else host[0]), ptr(None if host is None else host[1]),
               i32(n), i32(ARGMAX_CHUNK), i32(int(vec))))
    return out


# -- speculative decoding -------------------------------------------------------------------
def greedy_accept(km: KernelModules, draft: torch.Tensor,
                  target: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, k], target argmax [B, k+1] (int64) -> (accepted [B], next token [B]) int64."""
    B, k = draft.shape
    if draft.dtype != torch.long or target.dtype != torch.long or target.shape != (B, k + 1):
        raise Unsupported(f"draft {tuple(draft.shape)} {draft.dtype}, target "
                          f"{tuple(target.shape)} {target.dtype}")
    out = out or (None, None)
    accepted = dest(out[0], (B,), torch.long, draft.device)
    nxt = dest(out[1], (B,), torch.long, draft.device)
    if B:
        km.launch("greedy_accept", "greedy_accept", (math.ceil(B / 128),), (128,),
                  (ptr(draft.contiguous()), ptr(target.contiguous()), ptr(accepted), ptr(nxt),
                   i32(B), i32(k)))
    return accepted, nxt
