"""Qwen3-MoE experts through the expert-indexed gemv kernels (bf16, int8 or int4 experts).

    y = gemv_moe.moe(gemv, x, weights, experts, gate_up, down, residual=None)

Each (token, chosen expert) pair is one row: `gemv_*_experts` kernels read the expert index
from device memory, so a routed layer needs no host sync and can be captured in a CUDA
graph, and only the experts a token picked are read (in their stored format: int4 experts
stream a quarter of the bytes). For decode and verify batches (T * k pairs, T small).
The down projection reads the gate|up rows directly (SwiGLU prologue, kernels/gemv_mma.cuh):
no separate SwiGLU pass.
"""

from __future__ import annotations

import math

import torch

from kestrel_rt.cuda.gemv import Gemv
from kestrel_rt.cuda.gemv_variants import PLAIN, SWIGLU, default_variant, expert_u, experts_name
from kestrel_rt.cuda.gemv_weights import kernel_reads, output, weight_format
from kestrel_rt.cuda.module import i32, ptr


def experts(gemv: Gemv, x: torch.Tensor, w, ids: torch.Tensor, x_div: int,
            out: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """y[p] = act(x[p // x_div]) @ W[ids[p]].T for each of P pairs -> [P, N] bf16.

    x [R, K] bf16 contiguous, or gate|up [R, 2K] with swiglu (act = silu(gate) * up, rounded
    as TorchBackend.swiglu; else act = identity); w [E, N, K]: a bf16 tensor, Int8Weight or
    Int4Weight; ids [P] int64 on the device (read by the kernel).
    """
    fmt = weight_format(w)
    file = fmt.file
    _, n, k = w.shape
    if x.dim() != 2 or x.shape[1] != (2 * k if swiglu else k):
        raise ValueError(f"x {list(x.shape)} does not fit experts [.., {n}, {k}]"
                         f"{' with swiglu (x [R, 2K])' if swiglu else ''}")
    pairs = ids.numel()
    y = output(out, pairs, n, x.device)
    pro = SWIGLU if swiglu else PLAIN
    variant = default_variant(file, n, k, max(1, gemv.sms // max(pairs, 1)), expert_u(file, pro))
    args = (*fmt.args(w), ptr(x), ptr(y), ptr(ids), i32(x_div), i32(n), i32(k))
    grid = (math.ceil(n / (16 * variant[1])), pairs)
    gemv.launch(file, experts_name(file, variant, pro), grid, (32 * variant[0] * variant[1],),
                args, pro=pro)
    return y


def supports(x: torch.Tensor, gate_up, down) -> bool:
    """True when moe() takes these: bf16 tokens [T, H], 3-D expert weights the kernels read."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        return False
    return all(w.dim() == 3 and kernel_reads(w, w.shape[1], w.shape[2]) for w in (gate_up, down))


def moe(gemv: Gemv, x: torch.Tensor, weights: torch.Tensor, experts_: torch.Tensor, gate_up,
        down, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], weights [T, k], experts [T, k] int64, gate_up [E, 2I, H], down [E, H, I]
    -> [T, H]: SwiGLU of each chosen expert (in the down kernel's prologue), weighted and
    summed in fp32, rounded to bf16; plus residual [T, H] when given (rounded as torch's
    `residual + moe_out`)."""
    t, top_k = experts_.shape
    ids = experts_.reshape(-1).contiguous()  # [T * k]
    h = experts(gemv, x.contiguous(), gate_up, ids, top_k)  # [T * k, 2I]
    y = experts(gemv, h, down, ids, 1, swiglu=True)  # [T * k, H]
    mixed = (y.view(t, top_k, -1).float() * weights.float()[..., None]).sum(1)  # [T, H]
    out = mixed.to(x.dtype)
    return out if residual is None else residual + out
